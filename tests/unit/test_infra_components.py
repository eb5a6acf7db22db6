"""Each Pulumi component of infra/ takes one args dataclass (issue 47): `Component(name, args, opts)`,
as pulumi/examples' aws-py-hub-and-spoke-network gives each component one args class, and ends with
`register_outputs`. Read with `ast`, so a component that grows keywords again fails here by name."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _is_component(node: ast.ClassDef) -> bool:
    return any(isinstance(b, ast.Attribute) and b.attr == "ComponentResource" for b in node.bases)


def _dataclasses(tree: ast.Module) -> set[str]:
    return {n.name for n in tree.body if isinstance(n, ast.ClassDef)
            and any("dataclass" in ast.unparse(d) for d in n.decorator_list)}


def component_shape_problems(rel: str, source: str) -> list[str]:
    """One line per component of this module that does not take (name, args: <its dataclass>, opts)
    or whose __init__ does not end with self.register_outputs(...)."""
    tree = ast.parse(source, rel)
    found = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and _is_component(n)):
        init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        a = init.args
        params = [p.arg for p in a.args]
        annotation = ast.unparse(a.args[2].annotation) if len(a.args) > 2 and a.args[2].annotation else ""
        given = params[1:] + [k.arg for k in a.kwonlyargs]
        if given != ["name", "args", "opts"] or len(a.defaults) != 1 or annotation not in _dataclasses(tree):
            found.append(f"{rel}:{init.lineno}: {cls.name}(name, args, opts) with args one dataclass, not "
                         f"({', '.join(given)})")
        last = init.body[-1]
        if not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
                and ast.unparse(last.value.func) == "self.register_outputs"):
            found.append(f"{rel}:{last.lineno}: {cls.name}.__init__ must end with self.register_outputs(...)")
    return found


def test_every_infra_component_takes_one_args_dataclass():
    files = {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "infra").glob("*.py"))}
    components = [n.name for s in files.values() for n in ast.parse(s).body
                  if isinstance(n, ast.ClassDef) and _is_component(n)]
    assert len(components) >= 6, components  # the walk found them
    assert [p for rel, s in files.items() for p in component_shape_problems(rel, s)] == []


def test_a_component_of_keywords_is_caught():
    source = ("import pulumi\n"
              "class NodesComponent(pulumi.ComponentResource):\n"
              "    def __init__(self, name, *, facts, ami, opts=None):\n"
              "        super().__init__('t', name, None, opts)\n"
              "        self.register_outputs({})\n"
              "        self.x = 1\n")
    assert component_shape_problems("infra/nodes.py", source) == [
        "infra/nodes.py:3: NodesComponent(name, args, opts) with args one dataclass, not (name, facts, ami, opts)",
        "infra/nodes.py:6: NodesComponent.__init__ must end with self.register_outputs(...)"]
