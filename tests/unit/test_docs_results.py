"""The published benchmark tables and benchmarks/results/ agree: every results file is cited by
BENCHMARKS.md or README.md (files no table cites do not pile up), every cited file exists, and every
relative link of those two documents points at a file of the repository."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
DOCS = (REPO / "BENCHMARKS.md", REPO / "README.md")
CITED = re.compile(r"benchmarks/results/([\w.-]+\.json)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in DOCS)


def test_every_results_file_is_cited_by_a_published_table():
    cited = set(CITED.findall(_docs_text()))
    on_disk = {p.name for p in RESULTS.glob("*.json")}
    uncited = sorted(on_disk - cited)
    assert not uncited, (
        f"benchmarks/results/ holds files that neither BENCHMARKS.md nor README.md cites: {uncited}; "
        "cite each in a table (link benchmarks/results/<file>) or `git rm` it")


def test_every_cited_results_file_exists_and_is_a_result():
    cited = sorted(set(CITED.findall(_docs_text())))
    assert cited, "BENCHMARKS.md cites no results file: its tables must link their sources"
    missing = [name for name in cited if not (RESULTS / name).is_file()]
    assert not missing, f"BENCHMARKS.md or README.md cites results files that do not exist: {missing}"
    for name in cited:
        data = json.loads((RESULTS / name).read_text(encoding="utf-8"))
        assert data.get("gpu") and data.get("date"), f"{name}: a results file names its GPU and date"


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.name} -> {target}")
    assert not broken, f"links to files that do not exist: {broken}"

