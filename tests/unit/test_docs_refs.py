"""The docs name only what exists: every repository path, project module and `fab` task that
README.md, BENCHMARKS.md or docs/*.md names is there, and docs/ARCHITECTURE.md's layer table is
the import-graph test's ALLOWED table (so the diagram a newcomer reads is the one the tests enforce)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_import_graph import ALLOWED, LAYERS

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", REPO / "BENCHMARKS.md", *(REPO / "docs").glob("*.md")])
TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".")} - {"runs"}
PACKAGES = sorted(p.parent.name for p in REPO.glob("*/__init__.py"))
# A repository path: starts with a top-level file or directory of the repo; `<...>`, `*` and `{` mark
# a pattern (runs/<job-id>/), not a path.
PATH = re.compile(r"(?<![\w/.~$-])((?:" + "|".join(map(re.escape, sorted(TOP))) + r")(?:/[\w.@-]+)*/?)(?![\w<*{])")
# A dotted name of a project package: `ops.finetune.pipeline`, `python -m boottest.teardown`.
MODULE = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES) + r")(?:\.[a-z_][a-z0-9_]*)+)")
FILE_SUFFIXES = {"py", "md", "sh", "j2", "json", "yaml", "yml", "toml", "txt", "conf", "cfg", "out", "log"}
FAB = re.compile(r"`fab ([a-z][\w.-]*\*?)")
# A file named without its directory (`render.py`, `power.sh`): some file of the repository has that name.
BARE = re.compile(r"(?<![\w/.-])([\w-]+\.(?:py|sh|j2))\b")


def _doc_texts():
    return [(doc.relative_to(REPO), doc.read_text(encoding="utf-8")) for doc in DOCS]


def _module_exists(dotted: str) -> bool:
    """The longest prefix that is a module or package; what follows may be one name defined in it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:n])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or base.is_dir():
            rest = parts[n:]
            if not rest:
                return True
            source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            return len(rest) == 1 and source.is_file() and re.search(
                rf"^\s*(def|class)\s+{rest[0]}\b|^{rest[0]}\s*[:=]|import .*\b{rest[0]}\b",
                source.read_text(), re.M) is not None
    return False


def named_paths(text: str) -> set[str]:
    return {m.rstrip(".") for m in PATH.findall(text) if "/" in m or "." in m}


def test_every_path_a_doc_names_exists():
    missing = [f"{doc}: {path}" for doc, text in _doc_texts() for path in sorted(named_paths(text))
               if not (REPO / path).exists()]
    assert not missing, "docs name paths that do not exist (fix the doc or the path):\n" + "\n".join(missing)


def test_every_path_the_code_names_exists():
    """Comments and docstrings cite files too (a template, a program): they must not go stale either."""
    code = [f for pkg in PACKAGES if pkg != "tests" for f in (REPO / pkg).rglob("*")
            if f.suffix in (".py", ".sh", ".j2")] + [REPO / "fabfile.py", REPO / "__main__.py"]
    missing = [f"{f.relative_to(REPO)}: {path}" for f in sorted(code) for path in sorted(named_paths(f.read_text()))
               if not (REPO / path).exists()]
    assert not missing, "code names paths that do not exist:\n" + "\n".join(missing)


def test_every_module_a_doc_names_exists():
    missing = [f"{doc}: {name}" for doc, text in _doc_texts() for name in sorted(set(MODULE.findall(text)))
               if name.rsplit(".", 1)[-1] not in FILE_SUFFIXES and not _module_exists(name)]
    assert not missing, "docs name modules that do not exist:\n" + "\n".join(missing)


def test_every_file_a_doc_names_by_its_name_exists():
    names = {p.name for p in REPO.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts}
    missing = [f"{doc}: {name}" for doc, text in _doc_texts() for name in sorted(set(BARE.findall(text)))
               if name not in names]
    assert not missing, "docs name files that no directory of the repository holds:\n" + "\n".join(missing)


def fab_tasks() -> set[str]:
    import fabfile

    def walk(coll, prefix=""):
        names = {prefix + name for name in coll.tasks}
        for name, sub in coll.collections.items():
            names |= walk(sub, f"{prefix}{name}.")
        return names

    return walk(fabfile.ns)


def test_every_fab_task_a_doc_names_exists():
    tasks = fab_tasks()
    assert {"train", "status", "local.up"} <= tasks  # the walk found the menu
    unknown = [f"{doc}: fab {name}" for doc, text in _doc_texts() for name in sorted(set(FAB.findall(text)))
               if name not in tasks and not (name.endswith(".*") and any(t.startswith(name[:-1]) for t in tasks))]
    assert not unknown, "docs name fab tasks that do not exist:\n" + "\n".join(unknown)


def architecture_layers() -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's table `| layer | may import |` (names in backticks)."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    table = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return rows


def test_the_architecture_doc_table_is_the_enforced_one():
    assert architecture_layers() == ALLOWED


def test_every_package_is_in_the_architecture_doc():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    missing = [p for p in PACKAGES if p != "tests" and (p not in LAYERS or f"{p}/" not in text)]
    assert not missing, f"packages docs/ARCHITECTURE.md leaves out (or the layer table lacks): {missing}"


@pytest.mark.parametrize("text, found", [
    ("see `ops/finetune/pipeline.py` and bootstrap/templates/", {"ops/finetune/pipeline.py", "bootstrap/templates/"}),
    ("/etc/slurm/slurm.conf, runs/<job-id>/ and ~/ops/x.py", set()),
])
def test_paths_are_read_from_prose(text, found):
    assert named_paths(text) == found
