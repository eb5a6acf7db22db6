"""The layering of docs/ARCHITECTURE.md, enforced: which of the project's packages may import which.

Every module's imports (lazy ones inside functions included) are read with `ast`; an import
of a project package (or of Fabric/Pulumi where a layer must not touch them) that the table
below does not allow fails the test, naming the module, the line and the forbidden edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The project's layers: packages, plus the two entry-point modules at the root.
LAYERS = ("cluster", "bootstrap", "infra", "ops", "localcluster", "training", "policy", "benchmarks",
          "boottest", "fabfile", "__main__")
# Outside libraries that decide a layer: Pulumi is the cloud side, Fabric the SSH side.
GUARDED = ("pulumi", "pulumi_aws", "fabric", "invoke")

# Who may import whom (a layer may always import itself). Anything absent is forbidden.
ALLOWED: dict[str, set[str]] = {
    "cluster": set(),  # the ground floor: facts, platforms, targets, inventory, settings
    "bootstrap": {"cluster"},  # renders first boot from the facts
    "infra": {"cluster", "bootstrap", "pulumi", "pulumi_aws"},
    "ops": {"cluster", "bootstrap", "training", "fabric", "invoke"},
    "localcluster": {"cluster", "bootstrap", "ops", "fabric", "invoke"},
    "training": set(),  # runs on the GPU nodes: nothing of the cluster side
    "policy": {"pulumi"},  # a separate Pulumi policy pack: nothing from the repo
    "benchmarks": {"training", "ops"},
    "boottest": {"cluster", "bootstrap", "ops"},  # the boot test's harness: rendered user-data, host keys
    "fabfile": {"cluster", "ops", "localcluster", "bootstrap", "fabric", "invoke"},
    "__main__": {"infra"},
}


def layer_of(path: Path) -> str:
    rel = path.relative_to(REPO)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_layers(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in LAYERS or top in GUARDED:
                found.append((node.lineno, top))
    return found


def violations(files: dict[str, str]) -> list[str]:
    """`files`: layer-relative path -> source. Returns one line per forbidden import."""
    bad = []
    for rel, source in sorted(files.items()):
        layer = layer_of(REPO / rel)
        for lineno, target in imported_layers(ast.parse(source, rel)):
            if target != layer and target not in ALLOWED[layer]:
                bad.append(f"{rel}:{lineno}: {layer} must not import {target}")
    return bad


def project_modules() -> dict[str, str]:
    paths = [REPO / "fabfile.py", REPO / "__main__.py"]
    for pkg in LAYERS:
        if (REPO / pkg).is_dir():
            paths += (REPO / pkg).rglob("*.py")
    return {str(p.relative_to(REPO)): p.read_text() for p in paths}


def test_every_package_is_in_the_table():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages <= set(LAYERS), f"add {packages - set(LAYERS)} to LAYERS and ALLOWED"
    assert set(ALLOWED) == set(LAYERS)


def test_the_code_follows_the_layering():
    modules = project_modules()
    assert len(modules) > 40  # the walk found the code
    assert violations(modules) == []


@pytest.mark.parametrize("rel, source, edge", [
    ("infra/cluster_component.py", "from ops.ssh.remote import Cluster\n", "infra must not import ops"),
    ("cluster/facts.py", "from bootstrap import render\n", "cluster must not import bootstrap"),
    ("infra/nodes.py", "def f():\n    import fabric\n", "infra must not import fabric"),
    ("bootstrap/render.py", "import infra.config\n", "bootstrap must not import infra"),
    ("training/train.py", "from localcluster import topology\n", "training must not import localcluster"),
    ("policy/rules.py", "from cluster import facts\n", "policy must not import cluster"),
    ("cluster/stack_config.py", "import pulumi\n", "cluster must not import pulumi"),  # settings stay pure
])
def test_a_forbidden_import_is_caught(rel, source, edge):
    assert violations({rel: source}) == [f"{rel}:{source.count(chr(10), 0, source.index('import'))+1}: {edge}"]


def test_allowed_and_outside_imports_pass():
    assert violations({"infra/cluster_component.py": "import json\nfrom cluster.inventory import Inventory\n",
                       "ops/finetune/pipeline.py": "from ops.actions import slurm\nimport fabric\n"}) == []


def test_no_module_level_getattr():
    """No class factory hides behind a module `__getattr__`: every name a module offers is defined."""
    hidden = [rel for rel, source in project_modules().items()
              for node in ast.parse(source, rel).body
              if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
    assert hidden == []


def module_name(rel: str) -> str:
    parts = list(Path(rel).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(files: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (lazy imports too). `from a.b import c` is an edge to
    a.b.c when that is a module of the project, else to a.b; `import a.b` is an edge to a.b."""
    modules = {module_name(rel) for rel in files}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for rel, source in files.items():
        here = module_name(rel)
        for node in ast.walk(ast.parse(source, rel)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            else:
                continue
            edges[here] |= {t for t in targets if t in modules and t != here}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, once each, as the list of modules around it (depth-first search)."""
    found, seen_cycles = [], set()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):]
                key = frozenset(cycle)
                if key not in seen_cycles:
                    seen_cycles.add(key)
                    found.append([*cycle, nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    return found


def test_no_import_circle_among_the_projects_modules():
    edges = import_edges(project_modules())
    assert "training.fastpath.trainer" in edges and edges["training.train"]  # the walk found the modules
    assert cycles(edges) == [], "import circles (break each: move the shared part to a module both import)"


def test_an_import_circle_is_caught():
    files = {"training/a.py": "from training.b import f\n",
             "training/b.py": "def f():\n    from training import a\n",
             "training/c.py": "import training.a\n"}
    assert cycles(import_edges(files)) == [["training.a", "training.b", "training.a"]]
    assert cycles(import_edges({"training/a.py": "import training.c\n", "training/c.py": "x = 1\n"})) == []


def test_every_module_name_is_unique():
    """One name, one module: `cluster.py` or `power.py` in three packages reads as one idea in three places."""
    seen: dict[str, list[str]] = {}
    for rel in project_modules():
        name = Path(rel).name
        if name not in ("__init__.py", "__main__.py"):
            seen.setdefault(name, []).append(rel)
    assert {n: rels for n, rels in seen.items() if len(rels) > 1} == {}


def test_every_class_name_means_one_thing():
    """Two unrelated classes called `Cluster` (the SSH side's and the estimate's) read as one."""
    seen: dict[str, list[str]] = {}
    for rel, source in project_modules().items():
        for node in ast.parse(source, rel).body:
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(rel)
    assert {n: rels for n, rels in seen.items() if len(rels) > 1} == {}


def paths_into_layers_above(files: dict[str, str]) -> list[str]:
    """Where a module of cluster/ (the ground floor) builds a path into another layer's folder
    (`... / "training" / "configs"`): what it would find there is that layer's to say."""
    found = []
    for rel, source in sorted(files.items()):
        if layer_of(REPO / rel) != "cluster":
            continue
        for node in ast.walk(ast.parse(source, rel)):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                    and isinstance(node.right.value, str) and node.right.value.split("/")[0] in set(LAYERS) - {"cluster"}:
                found.append(f"{rel}:{node.lineno}: a path into {node.right.value.split('/')[0]}/")
    return found


def test_the_ground_floor_names_no_path_above_it():
    modules = project_modules()
    assert any(rel.startswith("cluster/") for rel in modules)
    assert paths_into_layers_above(modules) == []


def test_a_path_into_a_layer_above_is_caught():
    source = 'from pathlib import Path\nCONFIGS = Path(__file__).parent.parent / "training" / "configs"\n'
    assert paths_into_layers_above({"cluster/targets/base.py": source}) == [
        "cluster/targets/base.py:2: a path into training/"]
    assert paths_into_layers_above({"ops/actions/options.py": source}) == []


# ---------------------------------------------------------------- the cluster spec's builders

# Each target's own plan builds its cluster spec (cluster/spec.py); everything else reads one that a
# target loaded (cluster.targets.load). The spec's own module reads its written form.
SPEC_BUILDERS = {
    "infra/cluster_component.py": "aws",  # the stack's `inventory` output
    "localcluster/plan.py": "local",
    "boottest/boot_cluster.py": "boot",
    "cluster/spec.py": "the written form",
}
SPEC_NAMES = {"ClusterSpec", "Inventory"}


def spec_builders(files: dict[str, str]) -> list[str]:
    """Where a module outside SPEC_BUILDERS calls ClusterSpec(...) or Inventory(...)."""
    found = []
    for rel, source in sorted(files.items()):
        if rel in SPEC_BUILDERS:
            continue
        for node in ast.walk(ast.parse(source, rel)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in SPEC_NAMES:
                found.append(f"{rel}:{node.lineno}: builds a cluster spec outside its target's plan")
    return found


def test_only_each_targets_plan_builds_the_cluster_spec():
    modules = project_modules()
    assert set(SPEC_BUILDERS) <= set(modules)
    assert spec_builders(modules) == []


def test_a_spec_built_elsewhere_is_caught():
    source = "from cluster.inventory import Inventory\nINV = Inventory(target='aws', facts=None, access=None)\n"
    assert spec_builders({"ops/actions/status_view.py": source}) == [
        "ops/actions/status_view.py:2: builds a cluster spec outside its target's plan"]
    assert spec_builders({"localcluster/plan.py": source}) == []


def test_the_spec_stands_on_the_facts_alone():
    """cluster/spec.py imports only the facts and the error base: the record every side shares."""
    tree = ast.parse((REPO / "cluster" / "spec.py").read_text())
    project = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
               and node.module.split(".")[0] in LAYERS}
    assert project == {"cluster.facts", "cluster.errors"}
