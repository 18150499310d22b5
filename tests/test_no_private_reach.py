"""No module of ``moecomm/`` reads or writes another object's underscored members.

Every ``x._name`` (and ``getattr``/``setattr``/``hasattr``/``delattr(x, "_name")``) in the
package, read with ``ast``, must be on ``self`` or ``cls``, on a sibling module bound by
``from . import _mod`` (a package's modules may share their private helpers), a namedtuple
method (``_replace`` and the like: public API, underscored only to avoid field names), or in
``ALLOWED`` with the reason. Modules talk through named, typed functions and objects handed
over explicitly, so that changing one class's internals cannot silently break another module.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "moecomm"

ALLOWED = {
    # torch's grouped GEMM has no public name in the torch versions supported (2.11, 2.13);
    # grouped_mm_available() checks that it exists and works before the layer uses it
    ("moecomm/moe/_ops/seg_gemm.py", "torch._grouped_mm"),
    # the raw handle of torch's current stream without building a torch.cuda.Stream object
    # per call (the public torch.cuda.current_stream(i).cuda_stream), on every exchange's path
    ("moecomm/backends/_cudart.py", "torch._C"),
    ("moecomm/backends/_cudart.py", "torch._C._cuda_getCurrentRawStream"),
    # the integrations' job: replacing DeepSpeed's and Megatron's own private _AllToAll.forward
    ("moecomm/integrations/_patch.py", "module._AllToAll"),
    # torchtitan's own test for "trace with the functional collective" (torch has no public name
    # for non-strict tracing); its dispatcher's methods are replaced by name from a tuple
    ("moecomm/integrations/torchtitan.py", "compiler._is_non_strict_tracing"),
    # enable(layer="moecomm") of DeepSpeed and Megatron: torch has no public way to ask whether a
    # module has forward hooks (a hooked expert must run its framework's own forward, which calls them)
    ("moecomm/integrations/_patch.py", "m._forward_hooks"),
    ("moecomm/integrations/_patch.py", "m._forward_pre_hooks"),
    ("moecomm/integrations/_patch.py", "m._forward_hooks_with_kwargs"),
    # ... and walks the experts' modules and parameters at every call: modules() / parameters()
    # go through generators, three times as slow (module_tree's docstring)
    ("moecomm/integrations/_patch.py", "m._modules"),
    ("moecomm/integrations/_patch.py", "m._parameters"),
    # ... and its rows cross the ranks through DeepSpeed's own _AllToAll, the one _patch.py
    # replaces, so that enable()'s exchange choice applies to it too
    ("moecomm/integrations/deepspeed.py", "sharded_moe._AllToAll"),
}

NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
_ATTR_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def _sibling_modules(tree: ast.Module) -> set[str]:
    """Names bound by ``from . import name`` anywhere in the module (sibling modules)."""
    return {alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None
            for alias in node.names}


def reaches(source: str) -> Iterator[tuple[int, str]]:
    """``(line, "owner._name")`` for every access of another object's underscored member."""
    tree = ast.parse(source)
    own = {"self", "cls"} | _sibling_modules(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner, name = node.value, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_FUNCTIONS \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            owner, name = node.args[0], node.args[1].value
        else:
            continue
        if not _private(name) or (isinstance(owner, ast.Name) and owner.id in own):
            continue
        yield node.lineno, f"{ast.unparse(owner)}.{name}"


def _package_reaches() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, what in reaches(path.read_text(encoding="utf-8")):
            found.setdefault((rel, what), []).append(line)
    return found


def test_no_module_reaches_into_another_objects_private_members():
    found = _package_reaches()
    bad = [f"{rel}:{lines[0]}: {what}" for (rel, what), lines in sorted(found.items()) if (rel, what) not in ALLOWED]
    assert not bad, "access to another object's underscored members (use a named interface):\n" + "\n".join(bad)


def test_every_allowed_reach_still_exists():
    stale = sorted(ALLOWED - set(_package_reaches()))
    assert not stale, f"ALLOWED entries no longer found in the code (remove them): {stale}"


def test_the_finder_sees_each_kind_of_reach():
    source = (
        "from . import _sibling\n"
        "import torch\n"
        "class A:\n"
        "    def f(self, other, t):\n"
        "        self._ok = _sibling._helper(t._replace(a=1))\n"
        "        other._state = 1\n"
        "        return getattr(other, '_x'), torch._C, super().__init__, other.public\n"
        "def g(b):\n"
        "    setattr(b, '_y', 2)\n"
        "    return b.c._d\n"
    )
    assert sorted(what for _, what in reaches(source)) == ["b._y", "b.c._d", "other._state", "other._x", "torch._C"]
