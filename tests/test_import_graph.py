"""The import graph of ``moecomm/`` has no cycle, and its folders are layers: every
``import`` of every module, at module level and inside functions, read with ``ast`` (only
those under ``if TYPE_CHECKING:``, which never run, are left out), runs within a layer or
down to a lower one (``LAYERS``, docs/architecture.md)."""

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


# The layers of moecomm/, lowest first (docs/architecture.md): a module may import its own
# layer's modules and those of lower layers, never a higher layer's. A layer is a folder,
# except at the top of moecomm/ and of moecomm/moe/, where the public modules are split in
# two: the vocabulary every folder below uses (errors, splits, ...; the layer's parts) at
# the bottom, and the front that assembles the folders at the top. A top-level module not
# named in a vocabulary set is front; a module in no declared folder fails the test.
CORE_VOCABULARY = {"_version", "errors", "splits", "layout", "launch", "env", "profile", "quant", "graphs", "pool"}
MOE_PARTS = {"config", "gates", "routing", "scoring", "experts", "losses", "tutel_functional"}
LAYERS = [
    "moecomm: vocabulary",   # errors, splits, layout, pool, quant, ...: import nothing above them
    "moecomm.backends",      # the transports, the host channel, and the choice of one
    "moecomm.engine",        # what runs a collective on a backend
    "moecomm.collectives",   # how each collective is made of backend exchanges
    "moecomm: front",        # init, communicator, functional, distributed, hierarchical, overlap, wire, ...
    "moecomm.moe._ops",      # grouped GEMMs, segments, the step cache, the layer's comm calls, argument checks
    "moecomm.moe: parts",    # config, gates, routing, scoring, experts, losses
    "moecomm.moe._checkpoint",  # the checkpoint file format and resharding
    "moecomm.moe._step",     # the step's machinery: routing step, expert/data parallel paths, fused, graphed, decode
    "moecomm.moe: front",    # MoELayer, tutel, checkpoint
    "moecomm.integrations",  # DeepSpeed and Megatron hooks
]


def layer_of(module: str) -> str:
    """The layer ``module`` (a dotted name inside moecomm) belongs to; KeyError if none."""
    parts = module.split(".")
    for depth in (3, 2):
        if len(parts) >= depth and ".".join(parts[:depth]) in LAYERS:
            return ".".join(parts[:depth])
    if parts[:2] == [PACKAGE, "moe"] and len(parts) <= 3:
        return "moecomm.moe: parts" if parts[-1] in MOE_PARTS else "moecomm.moe: front"
    if len(parts) <= 2:
        return "moecomm: vocabulary" if parts[-1] in CORE_VOCABULARY else "moecomm: front"
    raise KeyError(f"{module} is in no declared layer (tests/test_import_graph.py LAYERS)")


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b (layer A -> layer B)"`` for every import of a higher layer's module."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    return [f"{a} -> {b} ({layer_of(a)} -> {layer_of(b)})" for a in sorted(graph) for b in sorted(graph[a])
            if rank[layer_of(b)] > rank[layer_of(a)]]


def test_the_layer_check_sees_upward_edges():
    assert layer_of("moecomm.errors") == "moecomm: vocabulary" and layer_of("moecomm") == "moecomm: front"
    assert layer_of("moecomm.engine.engine") == "moecomm.engine" and layer_of("moecomm.moe") == "moecomm.moe: front"
    assert layer_of("moecomm.moe._step.fused_step") == "moecomm.moe._step"
    assert layer_of("moecomm.moe.gates") == "moecomm.moe: parts" and layer_of("moecomm.moe.layer") == "moecomm.moe: front"
    assert upward_edges({"moecomm.engine.engine": {"moecomm.collectives.flat", "moecomm.backends.base"}}) == [
        "moecomm.engine.engine -> moecomm.collectives.flat (moecomm.engine -> moecomm.collectives)"]
    assert upward_edges({"moecomm.backends.mpi": {"moecomm.errors"}, "moecomm.moe._step.decode": {"moecomm.moe._ops.segments"}}) == []


def test_every_module_has_a_layer():
    missing = []
    for module in _modules():
        try:
            layer_of(module)
        except KeyError as exc:
            missing.append(str(exc))
    assert not missing, "\n".join(missing)


def test_folders_are_layered():
    """No import runs upward between layers; with the file graph acyclic, no folder circle
    either (an edge between two layers only ever runs down, so the layer graph is acyclic)."""
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    bad = upward_edges(graph)
    assert not bad, "imports that run upward between layers (see LAYERS):\n" + "\n".join(bad)
    layers = {}
    for a, targets in graph.items():
        for b in targets:
            if layer_of(a) != layer_of(b):
                layers.setdefault(layer_of(a), set()).add(layer_of(b))
    cycle = _cycle(layers)
    assert not cycle, "circle between layers: " + " -> ".join(cycle)
