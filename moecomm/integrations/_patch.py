"""Swap an autograd Function's ``forward`` and put it back (the integrations' one mechanism)."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Patch"]


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
