"""Files as user-data carries them: bash scripts without their comment lines, Python programs
without their comments and docstrings, Slurm's config files without their comment lines (EC2's
16 KiB limit pays for every byte). The version hash
(bootstrap/user_data.py) is taken of these texts: what the hosts run.
"""

from __future__ import annotations

import ast
import re

from bootstrap.node_layout import CGROUP_CONF, GRES_CONF, POWER_PATH, SLURM_CONF

# Slurm reads these; in them "#" begins a comment (slurm.conf(5), gres.conf(5), cgroup.conf(5)).
SLURM_CONFIGS = (SLURM_CONF, GRES_CONF, CGROUP_CONF)


def shipped_python(source: str) -> str:
    """A Python program as user-data carries it: the same code without its docstrings and comments
    (`ast.unparse` of the parsed module, docstrings dropped), which EC2's 16 KiB would otherwise pay
    for (the spot watcher: 13 KB of text, 4.7 KB gzip-compressed; 2.8 KB without them). The `#!` line
    is kept. The source in the repository is the documented one."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    shebang = source.splitlines()[0] + "\n" if source.startswith("#!") else ""
    return shebang + ast.unparse(tree) + "\n"


# A here-document's start after `<<` (`<<WORD`, `<<-WORD`, `<<'WORD'`, `<<"WO-RD"`): bash(1)
# "Here Documents": the delimiter is a word; a quoted one is taken literally.
_HEREDOC = re.compile(r"<<(-?)[ \t]*(?:'([^'\n]+)'|\"([^\"\\$`\n]+)\"|([^\s'\"<>|&;()`$\\]+))")


class UnsafeShell(RuntimeError):
    """shipped_shell met a construct it cannot strip comments from safely: a bootstrap script's bug."""


def _scan_code(line: str, quote: str | None, where: str) -> tuple[str | None, list[tuple[str, bool]], bool]:
    """One line of bash outside a here-document body: the quote still open at its end (None, ' or "),
    the here-documents it starts (delimiter, strip tabs), and whether it ends with a `\\` continuation.
    A `#` that begins a word outside quotes ends the line (bash(1), COMMENTS)."""
    docs: list[tuple[str, bool]] = []
    i, text = 0, line.rstrip("\n")
    while i < len(text):
        c = text[i]
        if quote == "'":
            quote = None if c == "'" else quote
        elif quote == '"':
            if c == "\\":
                i += 1
            elif c == '"':
                quote = None
        elif c == "\\":
            i += 1
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1] in " \t;&|()"):
            return None, docs, False
        elif text.startswith("<<<", i):
            i += 2
        elif text.startswith("<<", i):
            m = _HEREDOC.match(text, i)
            if not m:
                raise UnsafeShell(f"{where}: a `<<` shipped_shell cannot parse: {text.strip()!r}")
            docs.append((m.group(2) or m.group(3) or m.group(4), m.group(1) == "-"))
            i = m.end() - 1
        i += 1
    continued = quote is None and (len(text) - len(text.rstrip("\\"))) % 2 == 1
    return quote, docs, continued


def shipped_shell(script: str, where: str = "script") -> str:
    """A bash script as user-data carries it: without its whole comment lines (the `#!` line kept, and
    every line of a here-document or a multi-line quoted string, whose text is data). bash ignores
    them (bash(1), COMMENTS); a test checks that bash parses both to the same commands (`declare -f`).
    The comments are for the repository's reader and cost EC2's 16 KiB about 2.6 KB gzip-compressed
    on a GPU node. Anything it cannot strip safely raises UnsafeShell (the render fails) rather than
    change the script: a comment line after a `\\` continuation (dropping it would join two commands),
    a `<<` it cannot parse, a here-document or a quote left open at the end."""
    out: list[str] = []
    pending: list[tuple[str, bool]] = []  # here-documents whose bodies come next, in order
    quote, continued = None, False
    for n, line in enumerate(script.splitlines(keepends=True)):
        if pending:  # a here-document's body: data, kept as is
            out.append(line)
            end, strip_tabs = pending[0]
            if (line.lstrip("\t") if strip_tabs else line).rstrip("\n") == end:
                pending.pop(0)
            continue
        if n and quote is None and line.lstrip().startswith("#"):
            if continued:
                raise UnsafeShell(f"{where}: a comment line after a `\\` continuation (line {n + 1}): "
                                  "dropping it would join two commands; move the comment")
            continue
        quote, docs, continued = _scan_code(line, quote, where)
        pending.extend(docs)
        out.append(line)
    if pending or quote:
        raise UnsafeShell(f"{where}: " + (f"here-document {pending[0][0]!r} never ends" if pending
                                          else f"a {quote} quote never closes"))
    return "".join(out)


def shipped_slurm_config(text: str) -> str:
    """A Slurm config file as user-data carries it: its first line (which says what rendered it) and
    every line that is not a whole-line comment; Slurm parses both to the same settings (slurm.conf(5):
    "Any text following a '#' in the configuration file is treated as a comment"). slurm.conf's
    comments are 1.3 KB of the controller's user-data gzip-compressed at 96 GPU nodes; the rendered
    file with its comments is in the repository's template and on the local cluster."""
    lines = text.splitlines(keepends=True)
    return "".join(lines[:1] + [line for line in lines[1:] if not line.lstrip().startswith("#")])


def shipped(files: dict[str, str]) -> dict[str, str]:
    """Path -> text as user-data carries them: bash scripts without their comments (shipped_shell), the
    power program without its comments and docstrings (shipped_python), Slurm's config files without
    their comment lines (shipped_slurm_config). fab's copies (`fab update-nodes`)
    keep the comments; the version hash (bootstrap_version) is taken of these texts."""
    def one(path: str, text: str) -> str:
        if text.startswith("#!/bin/bash\n"):
            return shipped_shell(text, path)
        if path in SLURM_CONFIGS:
            return shipped_slurm_config(text)
        return shipped_python(text) if path == POWER_PATH else text

    return {path: one(path, text) for path, text in files.items()}
