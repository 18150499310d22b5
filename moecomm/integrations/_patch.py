"""Swap an autograd Function's ``forward`` and put it back (the integrations' one mechanism)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["Patch", "patch_all_to_all", "has_forward_hooks", "any_forward_hooks"]


def has_forward_hooks(module: Any) -> bool:
    """Whether ``module`` or a submodule has forward (pre-)hooks: such experts must run their
    framework's own forward, which calls them (torch has no public way to ask)."""
    return any_forward_hooks(module.modules())


def any_forward_hooks(modules: Iterable[Any]) -> bool:
    """Whether any of ``modules`` (each alone, not its submodules) has forward (pre-)hooks."""
    return any(m._forward_hooks or m._forward_pre_hooks or getattr(m, "_forward_hooks_with_kwargs", None)
               for m in modules)


class Patch:
    """Replaces ``cls.forward`` with ``forward`` while enabled; ``disable`` restores the original.

    Replacing the method on the class (rather than a module's name for it) reaches every
    caller, however it imported the class or the helper that applies it, and the Function's
    own ``backward`` (which re-applies the class) goes through the replacement too.
    """

    def __init__(self, cls: type, forward: Callable[..., Any]) -> None:
        self.cls = cls
        self.forward = staticmethod(forward)
        self.original = cls.__dict__["forward"]

    @property
    def enabled(self) -> bool:
        return self.cls.__dict__["forward"] is self.forward

    def enable(self) -> None:
        self.cls.forward = self.forward

    def disable(self) -> None:
        self.cls.forward = self.original


def patch_all_to_all(module: Any, forward: Callable[..., Any], what: str, framework: str) -> Patch:
    """Enable a :class:`Patch` of ``module._AllToAll.forward`` (``what`` names it in errors).

    Raises:
        RuntimeError: the class or its own ``forward`` is missing (an unsupported version of
            ``framework``).
    """
    cls = getattr(module, "_AllToAll", None)
    if cls is None or "forward" not in getattr(cls, "__dict__", {}):
        raise RuntimeError(f"{what} not found: this {framework} version is not supported by moecomm.integrations")
    patch = Patch(cls, forward)
    patch.enable()
    return patch
