"""The import graph of ``moecomm/`` has no cycle: every ``import`` of every module, at module
level and inside functions, read with ``ast`` (only those under ``if TYPE_CHECKING:``, which
never run, are left out)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "moecomm"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The module of ``modules`` that importing ``name`` runs last (its longest known prefix)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, modules: dict) -> set[str]:
    is_package = path.name == "__init__.py"
    here = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                 for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # "from X import y": y may be a submodule of X, or a name X defines
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (as a path that returns to its start), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    mods = {"p": Path("p/__init__.py"), "p.a": Path("p/a.py"), "p.b": Path("p/b.py")}
    assert _resolve("p.a.thing", mods) == "p.a" and _resolve("numpy", mods) is None
    assert _is_type_checking(ast.parse("if TYPE_CHECKING:\n    import x").body[0])


def test_moecomm_imports_are_acyclic():
    modules = _modules()
    assert f"{PACKAGE}.communicator" in modules and f"{PACKAGE}.hierarchical" in modules
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert f"{PACKAGE}.hierarchical" in graph[f"{PACKAGE}.communicator"]  # the walk sees imports
    cycle = _cycle(graph)
    assert not cycle, "import cycle in moecomm/: " + " -> ".join(cycle)
