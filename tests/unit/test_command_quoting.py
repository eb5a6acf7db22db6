"""Every value interpolated into a remote command in ops/ (and localcluster/, boottest/, fabfile.py) is quoted, a constant, or a number (issue 44).

Read with `ast`: each `.run(...)`, `.sudo(...)` and `sudo(c, ...)` whose command is an f-string, a
`%` or `+` concatenation or a `.format` (directly, or through a variable assigned in the same
function) must interpolate only: `shlex.quote(...)`/`q(...)`, `int(...)`/`len(...)`, an
UPPER_CASE constant, a value formatted as a number (`{mode:04o}`), a local variable assigned from
those, or a name in ALLOWED with the reason it is safe. New code that interpolates anything else
fails here: quote it, check it against a strict pattern, or add it to ALLOWED with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (file, name): why the value may reach the shell as it is.
ALLOWED = {
    ("ops/actions/munge.py", "restart"): "the inventory's service_cmd (a command by design, from the stack's "
                                         "own output or the local cluster's state), formatted with constants",
    ("ops/ssh/remote.py", "inv.service_cmd"): "the same template; its {action} and {service} are quoted",
}
_SAFE_CALLS = {"shlex.quote", "q", "int", "len"}


def _name(node: ast.AST) -> str:
    return ast.unparse(node)


def _assignments(scope: ast.AST, name: str) -> list[ast.AST]:
    """The values assigned to `name` in `scope` (tuple unpacking taken apart)."""
    out = []
    for n in ast.walk(scope):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name) and t.id == name:
                    out.append(n.value)
                elif isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple):
                    out += [v for e, v in zip(t.elts, n.value.elts, strict=False)
                            if isinstance(e, ast.Name) and e.id == name]
    return out


class Checker:
    def __init__(self, path: Path) -> None:
        self.rel = str(path.relative_to(REPO))
        self.tree = ast.parse(path.read_text())
        for n in ast.walk(self.tree):
            for c in ast.iter_child_nodes(n):
                c.parent = n  # type: ignore[attr-defined]
        self.bad: list[str] = []

    def scope(self, node: ast.AST) -> ast.AST:
        while (node := getattr(node, "parent", None)) is not None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return self.tree

    def safe(self, value: ast.AST, where: ast.AST, seen: frozenset = frozenset()) -> bool:
        if isinstance(value, ast.Constant):
            return True
        if (self.rel, _name(value)) in ALLOWED:
            return True
        if isinstance(value, ast.Call) and _name(value.func) in _SAFE_CALLS:
            return True
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "join"
                and isinstance(value.func.value, ast.Constant) and len(value.args) == 1):  # " ".join(...)
            arg = value.args[0]
            return (isinstance(arg, ast.Call) and _name(arg.func) == "map" and len(arg.args) == 2
                    and _name(arg.args[0]) in _SAFE_CALLS)
        if isinstance(value, (ast.JoinedStr, ast.BinOp)) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "format"):
            return all(self.safe(v, where, seen) for v in self.parts(value))
        leaf = value.attr if isinstance(value, ast.Attribute) else value.id if isinstance(value, ast.Name) else ""
        if leaf and leaf.isupper():
            return True
        if isinstance(value, ast.Name):
            if value.id in seen:
                return False
            found = _assignments(self.scope(where), value.id) or _assignments(self.tree, value.id)
            return bool(found) and all(self.safe(v, where, seen | {value.id}) for v in found)
        return False

    def parts(self, node: ast.AST) -> list[ast.AST]:
        """The values a command string interpolates."""
        if isinstance(node, ast.JoinedStr):
            out = []
            for v in node.values:
                if not isinstance(v, ast.FormattedValue):
                    continue
                spec = _name(v.format_spec) if v.format_spec else ""
                if spec and spec.rstrip("'\"")[-1:] in "dofxge":  # formatted as a number
                    continue
                out.append(v.value)
            return out
        if isinstance(node, ast.BinOp):
            return [x for side in (node.left, node.right)
                    for x in ([side] if not isinstance(side, (ast.JoinedStr, ast.BinOp)) else self.parts(side))]
        if isinstance(node, ast.Call):  # "...".format(...)
            return [*self.parts(node.func.value), *node.args, *(k.value for k in node.keywords)]
        return [node]

    def command_of(self, call: ast.Call) -> ast.AST | None:
        fn = call.func
        if isinstance(fn, ast.Attribute) and fn.attr in ("run", "sudo") and call.args:
            return call.args[0]
        if isinstance(fn, ast.Name) and fn.id == "sudo" and len(call.args) > 1:
            return call.args[1]
        return None

    def check(self) -> list[str]:
        for call in ast.walk(self.tree):
            if not isinstance(call, ast.Call) or (cmd := self.command_of(call)) is None:
                continue
            built = cmd
            if isinstance(cmd, ast.Name):  # assembled into a variable first
                found = _assignments(self.scope(call), cmd.id)
                built = found[-1] if len(found) == 1 else cmd
            if not isinstance(built, (ast.JoinedStr, ast.BinOp, ast.Call)):
                continue
            if isinstance(built, ast.Call) and not (isinstance(built.func, ast.Attribute)
                                                    and built.func.attr == "format"):
                continue
            for value in self.parts(built):
                if not self.safe(value, call):
                    self.bad.append(f"{self.rel}:{call.lineno}: {_name(value)}")
        return self.bad


def _check(files: list[Path]) -> list[str]:
    return [b for f in files for b in Checker(f).check()]


def test_every_value_in_a_remote_command_is_quoted_or_constant():
    files = [p for d in ("ops", "localcluster", "boottest") for p in (REPO / d).rglob("*.py")]
    assert _check(sorted(files) + [REPO / "fabfile.py"]) == []


def test_the_check_finds_an_unquoted_value(tmp_path):
    """The check itself: today's spot_notice.py before issue 44 interpolated the log's node list raw."""
    bad = tmp_path / "ops" / "x.py"
    bad.parent.mkdir()
    bad.write_text("import shlex\n"
                   "def drained(ctl, nodes):\n"
                   "    ctl.run(f\"sinfo -h -N -n '{nodes}' -o '%N|%E'\")\n"
                   "def good(ctl, nodes, mode):\n"
                   "    q = shlex.quote(nodes)\n"
                   "    ctl.run(f'sinfo -n {q} {mode:04o} {shlex.quote(nodes)}')\n"
                   "def built(c, path):\n"
                   "    cmd = 'cat ' + path\n"
                   "    c.run(cmd)\n"
                   "def fmt(c, name, jobs):\n"
                   "    sudo(c, 'systemctl restart {}'.format(name))\n"
                   "    c.run('scancel ' + ' '.join(jobs))\n"
                   "    c.run('scancel ' + ' '.join(map(shlex.quote, jobs)))\n")
    global REPO
    old, REPO = REPO, tmp_path
    try:
        found = _check([bad])
    finally:
        REPO = old
    assert found == ["ops/x.py:3: nodes", "ops/x.py:9: path", "ops/x.py:11: name", "ops/x.py:12: ' '.join(jobs)"]
