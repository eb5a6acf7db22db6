"""Ideas that live once (issue 47 item 5): remote file I/O only in ops/ssh/remote.py, the stack tag only
in cluster/facts.py. Read with `ast`: a second definition, or a raw SFTP read or upload outside remote.py,
fails here naming where it is."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REMOTE = "ops/ssh/remote.py"
REMOTE_IO = {"put_bytes", "put_text", "read_remote", "exists", "read_text", "install_text"}
SIDES = ("ops", "localcluster", "boottest", "infra", "cluster", "bootstrap")


def _sources():
    for d in SIDES:
        yield from sorted((REPO / d).rglob("*.py"))
    yield REPO / "fabfile.py"


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def remote_io_copies(paths) -> list[str]:
    """Where a remote file helper is defined, or SFTP opened or a file uploaded, outside remote.py."""
    found = []
    for p in paths:
        rel = _rel(p)
        if rel == REMOTE:
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.FunctionDef) and n.name in REMOTE_IO and rel.startswith("ops/"):
                found.append(f"{rel}:{n.lineno}: def {n.name}")
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                inner = n.func.value
                if n.func.attr in ("open", "chmod") and isinstance(inner, ast.Call) \
                        and isinstance(inner.func, ast.Attribute) and inner.func.attr == "sftp":
                    found.append(f"{rel}:{n.lineno}: sftp().{n.func.attr}")
                elif n.func.attr == "put" and any(k.arg == "remote" for k in n.keywords):
                    found.append(f"{rel}:{n.lineno}: put(remote=...)")
    return found


def test_remote_file_io_lives_only_in_ops_ssh_remote():
    assert remote_io_copies(_sources()) == []


def test_the_check_finds_a_copy(tmp_path):
    global REPO
    bad = tmp_path / "ops" / "x.py"
    bad.parent.mkdir()
    bad.write_text("import io\n"
                   "def put_text(c, text, path):\n"
                   "    c.put(io.BytesIO(text.encode()), remote=path)\n"
                   "    c.sftp().chmod(path, 0o644)\n")
    saved, REPO = REPO, tmp_path
    try:
        assert remote_io_copies([bad]) == ["ops/x.py:2: def put_text", "ops/x.py:3: put(remote=...)",
                                           "ops/x.py:4: sftp().chmod"]
    finally:
        REPO = saved


def test_the_stack_tag_is_assigned_only_in_cluster_facts():
    where = [f"{_rel(p)}:{n.lineno}" for p in _sources() for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "STACK_TAG" for t in n.targets)]
    assert len(where) == 1 and where[0].startswith("cluster/facts.py:"), where
