"""torchtitan's expert-parallel MoE exchanges on moecomm: ``enable()`` / ``disable()``.

torchtitan (0.3.0) runs expert parallelism in
``torchtitan.models.common.token_dispatcher.AllToAllTokenDispatcher``, which does its three
exchanges in three methods of its own:

* ``_token_count_exchange``: the per-expert token counts (an equal-split all-to-all, under
  ``no_grad``); the dispatcher then copies the per-rank sums to the host
  (``_sync_token_count_exchange``) as ``input_splits`` / ``output_splits`` lists;
* ``_dispatch_token_exchange``: the routed tokens to the ranks owning their experts;
* ``_combine_token_exchange``: the expert outputs back, with the splits swapped.

What those methods call depends on torchtitan's ``parallelism.spmd_backend``: under
``"spmd_types"`` (its default) ``spmd_types.all_to_all``, whose autograd Function sends with
the **list** form ``torch.distributed.all_to_all``; under ``"partial_dtensor"`` /
``"full_dtensor"`` (and always under ``torch.compile``) the functional collective
``torch.distributed._functional_collectives.all_to_all_single``, imported by name into the
dispatcher's module. So the plain swap ``torch.distributed.all_to_all_single =
moecomm.distributed.all_to_all_single`` reaches **neither**; this module replaces the three
methods on the class instead, which covers both backends and every dispatcher already built.

The replacements send with :func:`moecomm.functional.all_to_all_v` on the moecomm
communicator of the expert-parallel group (:func:`moecomm.integrations.communicator_for_group`:
the default communicator of :func:`moecomm.init` when its ranks are the group's, else one made
on the group), with both sides' splits known (torchtitan has them on the host already), so each
exchange is one round that moves only the rows; the backward sends the gradient back along the
reversed splits. The count exchange is an equal-split ``all_to_all_single`` on the same
communicator. Under ``torch.compile`` (or non-strict tracing) the replacements hand over to
torchtitan's own methods: moecomm's exchanges are not traceable ops.

The other dispatchers (``DeepEPTokenDispatcher``, ``HybridEPTokenDispatcher``,
``MinimalAsyncEPTokenDispatcher``) bring their own kernels and are not changed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ._groups import communicator_for_group

__all__ = ["enable", "disable", "is_enabled", "TESTED", "INSTALL"]

TESTED = "0.3.0"
"""The torchtitan release this module is tested with."""

INSTALL = ("pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring-parser typeguard "
           "&& pip install --no-deps triton")
"""The README's recipe: torchtitan with only what its MoE imports need, torch left as it is."""

_METHODS = ("_token_count_exchange", "_dispatch_token_exchange", "_combine_token_exchange")

_state: dict[str, dict[str, Any]] = {}
"""Explicit registry while enabled: "originals" -> {method name: torchtitan's own function}."""


def _tracing() -> bool:
    """torchtitan's own test for "use the traceable functional collective"."""
    compiler = torch.compiler
    non_strict = getattr(compiler, "_is_non_strict_tracing", None)
    return bool(compiler.is_compiling() or (non_strict is not None and non_strict()))


def _group(dispatcher: Any, pg: Any) -> Any:
    """The expert-parallel ProcessGroup: ``pg`` (what torchtitan resolved), else the EP mesh's."""
    import torch.distributed as dist

    if isinstance(pg, dist.ProcessGroup):
        return pg
    if dispatcher.ep_mesh is None:
        raise RuntimeError("moecomm.integrations.torchtitan: the dispatcher's ep_mesh is None "
                           "(wire_meshes() was not called)")
    return dispatcher.ep_mesh.get_group()


def _original(name: str) -> Callable[..., Any]:
    return _state["originals"][name]


def _token_count_exchange(self: Any, num_local_tokens_per_expert_E: torch.Tensor, pg: Any,  # noqa: N803
                          ep_size: int) -> torch.Tensor:
    if _tracing():
        return _original("_token_count_exchange")(self, num_local_tokens_per_expert_E, pg, ep_size)
    counts = num_local_tokens_per_expert_E.reshape(ep_size, -1).contiguous()
    received = torch.empty_like(counts)
    communicator_for_group(_group(self, pg)).all_to_all_single(received, counts)
    return received


def _rows(self: Any, x: torch.Tensor, pg: Any, send: list[int], recv: list[int]) -> torch.Tensor:
    """``send[p]`` rows of ``x`` to each rank of torchtitan's EP group, ``recv[p]`` back from each."""
    from ..functional import all_to_all_v

    return all_to_all_v(x, send, recv, comm=communicator_for_group(_group(self, pg)))[0]


def _dispatch_token_exchange(self: Any, routed_input_ND: torch.Tensor, pg: Any,  # noqa: N803
                             output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    if _tracing():
        return _original("_dispatch_token_exchange")(self, routed_input_ND, pg, output_splits, input_splits)
    return _rows(self, routed_input_ND, pg, input_splits, output_splits)


def _combine_token_exchange(self: Any, routed_output_RD: torch.Tensor, pg: Any,  # noqa: N803
                            input_splits: list[int], output_splits: list[int]) -> torch.Tensor:
    if _tracing():
        return _original("_combine_token_exchange")(self, routed_output_RD, pg, input_splits, output_splits)
    # the reverse of the dispatch: send what was received (output_splits), get back input_splits
    return _rows(self, routed_output_RD, pg, output_splits, input_splits)


_REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "_token_count_exchange": _token_count_exchange,
    "_dispatch_token_exchange": _dispatch_token_exchange,
    "_combine_token_exchange": _combine_token_exchange,
}


def _dispatcher_class() -> type:
    try:
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    except ImportError as exc:
        raise ImportError(
            "moecomm.integrations.torchtitan needs torchtitan (tested: 0.3.0; install as the README says, "
            f"\"torchtitan\": {INSTALL}); importing torchtitan.models.common.token_dispatcher failed: {exc}"
        ) from exc
    missing = [n for n in _METHODS if n not in AllToAllTokenDispatcher.__dict__]
    if missing:
        raise RuntimeError(
            f"torchtitan's AllToAllTokenDispatcher has no {', '.join(missing)}: this torchtitan version is not "
            f"supported by moecomm.integrations.torchtitan (tested: {TESTED})")
    return AllToAllTokenDispatcher


def enable() -> None:
    """Route torchtitan's ``AllToAllTokenDispatcher`` exchanges (forward and backward) through moecomm.

    Call it on every rank, before or after building the model (the methods are replaced on the
    class). Idempotent. A communicator is made for the expert-parallel group on its first
    exchange; call :func:`moecomm.init` first to have the default one reused.

    Raises:
        ImportError: torchtitan (or what its dispatcher imports) is missing; the message gives
            the README's install recipe.
        RuntimeError: the installed torchtitan's dispatcher lacks one of the three methods (an
            unsupported version; the message names them).
    """
    if "originals" in _state:
        return
    cls = _dispatcher_class()
    _state["originals"] = {n: cls.__dict__[n] for n in _METHODS}
    for name in _METHODS:
        setattr(cls, name, _REPLACEMENTS[name])


def disable() -> None:
    """Put torchtitan's own methods back (no-op when not enabled)."""
    originals: Optional[dict[str, Any]] = _state.pop("originals", None)
    if originals is None:
        return
    cls = _dispatcher_class()
    for name, fn in originals.items():
        setattr(cls, name, fn)


def is_enabled() -> bool:
    """True between :func:`enable` and :func:`disable`."""
    if "originals" not in _state:
        return False
    cls = _dispatcher_class()
    return all(cls.__dict__[n] is _REPLACEMENTS[n] for n in _METHODS)
