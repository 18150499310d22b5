"""DeepSpeed's MoE exchange (and its ``use_tutel=True`` path) on moecomm: ``enable()`` / ``disable()``.

``enable()`` replaces the ``forward`` of ``deepspeed.moe.sharded_moe._AllToAll``, the
autograd Function ``MOELayer`` sends its capacity-padded ``[E, C, M]`` buffers with (both
exchanges, forward and backward), so its equal-split ``all_to_all_single`` runs on the
moecomm communicator of the expert-parallel group
(:func:`moecomm.integrations.communicator_for_group`).

``enable(tutel_kernels=True)`` also binds ``sharded_moe.tutel_moe`` to
:mod:`moecomm.moe.tutel_functional` and sets ``sharded_moe.TUTEL_INSTALLED = True``, so that
``deepspeed.moe.layer.MoE(..., use_tutel=True)`` runs its Tutel path (``fast_cumsum_sub_one``
in the top-1 gate, ``fast_dispatcher`` ``update`` / ``encode`` / ``decode`` in ``MOELayer``)
on moecomm's dispatch/combine kernels, with no package named ``tutel`` installed. The
dispatchers it makes skip the route check (``check_routes=False``, the default): DeepSpeed's
gates only give experts in ``[-1, E)`` and locations in ``[0, C)``, and the check costs a host
sync per step (issue 28's profile: it and the maps' extra launches made the Tutel path slower
than DeepSpeed's native one). DeepSpeed
reads ``TUTEL_INSTALLED`` when a layer is built: enable first, then build the model.
``disable()`` restores every name it changed.

A layer whose ``set_deepspeed_parallelism()`` was never called exchanges over the group
``None``, which DeepSpeed (and torch) read as the world group; so does moecomm here.
"""

from __future__ import annotations

from typing import Any

import torch

from ._groups import communicator_for_group
from ._patch import patch_all_to_all

__all__ = ["enable", "disable", "is_enabled", "tutel_kernels_enabled"]

_state: dict[str, Any] = {}
"""Explicit registry while enabled: "all_to_all" -> Patch, "tutel" -> the names it replaced."""

_MISSING = object()


def _forward(ctx: Any, group: Any, input: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    ctx.group = group
    input = input.contiguous()
    output = torch.empty_like(input)
    # None is DeepSpeed's expert group until set_deepspeed_parallelism(): the world group, to it
    communicator_for_group(dist.group.WORLD if group is None else group).all_to_all_single(output, input)
    return output


def _sharded_moe() -> Any:
    try:
        from deepspeed.moe import sharded_moe
    except ImportError as exc:
        raise ImportError(
            "moecomm.integrations.deepspeed needs DeepSpeed (on CPU: DS_BUILD_OPS=0 pip install deepspeed, "
            f"and DS_ACCELERATOR=cpu); importing deepspeed.moe.sharded_moe failed: {exc}"
        ) from exc
    return sharded_moe


class _TutelOps:
    """What ``sharded_moe.tutel_moe`` names while enabled: Tutel's two ops on moecomm's kernels."""

    def __init__(self, check_routes: bool) -> None:
        from ..moe import tutel_functional

        self.check_routes = check_routes
        self.fast_cumsum_sub_one = tutel_functional.fast_cumsum_sub_one
        self._cls = tutel_functional.FastDispatcher

    def fast_dispatcher(self, num_global_experts: int, capacity: int, model_dim: int,
                        dispatch_dtype: torch.dtype = torch.float32) -> Any:
        """:class:`moecomm.moe.tutel_functional.FastDispatcher` with ``check=check_routes``."""
        return self._cls(num_global_experts, capacity, model_dim, dispatch_dtype, check=self.check_routes)


def enable(tutel_kernels: bool = False, *, exchange: bool = True, check_routes: bool = False) -> None:
    """Route DeepSpeed's MoE all-to-all through moecomm (and its Tutel path onto moecomm's kernels).

    Args:
        tutel_kernels: also make ``use_tutel=True`` layers built from now on run on
            :mod:`moecomm.moe.tutel_functional`.
        exchange: route ``_AllToAll`` through moecomm (False: only the kernels, with
            DeepSpeed's own exchange, e.g. to compare the two separately).
        check_routes: make the Tutel dispatchers validate the routes in every ``update`` (a
            host sync per step; for debugging a gate other than DeepSpeed's own).

    Call it on every rank. A later call adds what it asks for; ``disable()`` removes all.

    Raises:
        ImportError: DeepSpeed is not installed (the message says how to install it on CPU).
        RuntimeError: ``sharded_moe._AllToAll.forward`` is missing (an unsupported version).
        TypeError: ``check_routes`` is not a bool.
    """
    if not isinstance(check_routes, bool):
        raise TypeError(f"enable: check_routes must be a bool, got {check_routes!r}")
    sharded_moe = _sharded_moe()
    if exchange and "all_to_all" not in _state:
        _state["all_to_all"] = patch_all_to_all(sharded_moe, _forward, "deepspeed.moe.sharded_moe._AllToAll.forward",
                                                "DeepSpeed")
    if tutel_kernels and "tutel" not in _state:
        _state["tutel"] = {n: getattr(sharded_moe, n, _MISSING) for n in ("tutel_moe", "TUTEL_INSTALLED")}
        sharded_moe.tutel_moe = _TutelOps(check_routes)
        sharded_moe.TUTEL_INSTALLED = True


def disable() -> None:
    """Restore DeepSpeed's own exchange and Tutel names (no-op when not enabled)."""
    patch = _state.pop("all_to_all", None)
    if patch is not None:
        patch.disable()
    saved = _state.pop("tutel", None)
    if saved is not None:
        sharded_moe = _sharded_moe()
        for name, value in saved.items():
            if value is _MISSING:
                delattr(sharded_moe, name)
            else:
                setattr(sharded_moe, name, value)


def is_enabled() -> bool:
    """True while the exchange is routed through moecomm (``enable(exchange=True)``)."""
    patch = _state.get("all_to_all")
    return patch is not None and patch.enabled


def tutel_kernels_enabled() -> bool:
    """True while ``enable(tutel_kernels=True)`` is in effect."""
    return "tutel" in _state
