"""tests/ mirrors the tiers (docs/ARCHITECTURE.md): a file's folder says what it needs, so
`pytest tests/unit` runs anywhere and a cluster test cannot hide among the unit ones. A test file
sits in cluster/ when it or every test in it is marked `cluster`, in boot/ likewise for `boot`, and
in unit/ when none is; support/ holds no test."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "cluster", "boot")


def marks(path: Path) -> tuple[set[str], list[set[str]]]:
    """The module's `pytestmark` marks, and each test function's own."""
    tree = ast.parse(path.read_text())
    module: set[str] = set()
    per_test: list[set[str]] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module |= set(re.findall(r"mark\.(\w+)", ast.unparse(node.value)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_"):
            per_test.append({m for d in node.decorator_list for m in re.findall(r"mark\.(\w+)", ast.unparse(d))})
    return module, per_test


def tier_of(path: Path) -> str:
    module, per_test = marks(path)
    for t in ("boot", "cluster"):
        if t in module or (per_test and all(t in m for m in per_test)):
            return t
    mixed = [t for t in ("boot", "cluster") if any(t in m for m in per_test)]
    return f"mixed ({', '.join(mixed)} with unmarked tests)" if mixed else "unit"


def test_no_test_file_outside_a_tier():
    stray = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not stray, f"test files at tests/ itself: {stray}; move each to tests/unit, cluster or boot"
    support = [p.name for p in (TESTS / "support").glob("*.py")
               if "def test_" in p.read_text() or p.name.startswith("test_")]
    assert not support, f"tests/support/ holds no tests: {support}"


@pytest.mark.parametrize("tier", TIERS)
def test_each_file_sits_in_its_tier(tier):
    wrong = {p.name: tier_of(p) for p in sorted((TESTS / tier).glob("test_*.py")) if tier_of(p) != tier}
    assert not wrong, f"in tests/{tier}/ but belonging elsewhere (by their marks): {wrong}"


def test_the_rule_sees_a_misplaced_file(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("import pytest\n\n@pytest.mark.cluster\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n")
    assert tier_of(f).startswith("mixed")
    f.write_text("import pytest\npytestmark = [pytest.mark.boot, pytest.mark.slow]\n\ndef test_a():\n    pass\n")
    assert tier_of(f) == "boot"
