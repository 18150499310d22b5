"""The MoE router's capacity routing as two kernels: :func:`route_capacity` (from the top-k
scores to gates, queue positions and both slot maps, in one native call) and
:func:`route_backward` (from the gates' gradient to the router logits' gradient, in one
pass). Each has its pure-torch reference in :mod:`moecomm_ext.reference`."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import reference
from ._checks import check_ndim, index_arg, same_device, shape_is, shape_str, tensor_arg
from ._loader import module_for

__all__ = ["CapacityRoutes", "route_capacity", "route_dropless", "route_backward", "run_route_capacity", "run_route_backward",
           "step_ops"]

ROUTE_DTYPES = (torch.float32, torch.float64)
_CUDA_MAX_EXPERTS = 12 * 1024  # the CUDA kernels keep one int32 counter per expert in shared memory


class CapacityRoutes(NamedTuple):
    """Capacity routing of ``T`` tokens with ``k`` choices each over ``E`` experts of
    ``C`` slots (``M = E * C``; slot ``e * C + q`` holds the route at position ``q`` of
    expert ``e``'s queue)."""

    gates: Tensor
    """``[T, k]`` the top-k scores, divided by their sum (at least eps) with ``normalize``."""
    locations: Tensor
    """``[T, k]`` int64 position of each route in its expert's queue (every first choice in
    token order, then every second choice, ...)."""
    counts: Tensor
    """``[E]`` int64 routes per expert, dropped ones included."""
    first_counts: Tensor
    """``[E]`` first choices per expert, in the scores' dtype (the GShard loss's counts)."""
    token_slots: Tensor
    """``[T, k]`` int64 slot of each route, ``-1`` where its position is ``>= C`` (dropped)."""
    slot_token: Tensor
    """``[M]`` int64 token of each slot, ``-1`` for an empty slot."""
    slot_route: Tensor
    """``[M]`` int64 flat route ``t * k + j`` of each slot, ``-1`` for an empty slot."""
    slot_gate: Tensor
    """``[M]`` gate of each slot's route, 0 for an empty slot."""


def _native(device: torch.device, num_experts: int, use_native: bool | None):
    if device.type == "cuda" and num_experts > _CUDA_MAX_EXPERTS:
        return None
    return module_for(device.type, use_native)


def step_ops(device: torch.device, num_experts: int, use_native: bool | None):
    """The fused capacity step's glue for tensors on ``device``: the native module (its
    ``step_*`` functions issue the operations from C++) or :mod:`moecomm_ext.reference`
    (the same operations in torch, where the native kernels are not to be had)."""
    mod = _native(device, num_experts, use_native)
    return reference if mod is None else mod


def run_route_capacity(topk_scores: Tensor, topk_idx: Tensor, num_experts: int, capacity: int, normalize: bool,
                       use_native: bool | None) -> CapacityRoutes:
    """:func:`route_capacity` without argument checks (inputs of the documented shapes and
    dtypes, expert ids in range: the caller's promise; strided ones are copied); ``capacity=-1``:
    :func:`route_dropless`."""
    mod = _native(topk_scores.device, num_experts, use_native)
    if mod is None:
        out = reference.route_capacity(topk_scores, topk_idx, num_experts, capacity, normalize)
    else:
        out = mod.route_capacity(topk_scores.contiguous(), topk_idx.contiguous(), num_experts, capacity, normalize)
    return CapacityRoutes(*out)


def run_route_backward(grad_gates: Tensor, topk_scores: Tensor, topk_idx: Tensor, scores: Tensor, normalize: bool,
                       aux_grad: Tensor | None, aux_counts: Tensor | None, aux_scale: float, split_bf16: bool,
                       use_native: bool | None) -> Tensor:
    """:func:`route_backward` without argument checks."""
    mod = _native(scores.device, scores.shape[1], use_native)
    if mod is None:
        return reference.route_backward(grad_gates, topk_scores, topk_idx, scores, normalize, aux_grad, aux_counts,
                                        aux_scale, split_bf16)
    aux_counts = None if aux_counts is None else aux_counts.contiguous()
    return mod.route_backward(grad_gates.contiguous(), topk_scores.contiguous(), topk_idx.contiguous(),
                              scores.contiguous(), normalize, aux_grad, aux_counts, aux_scale, split_bf16)


def _route_dtype(fn: str, name: str, t: Tensor) -> None:
    if t.dtype not in ROUTE_DTYPES:
        raise TypeError(f"{fn}: argument '{name}' must be float32 or float64 (router scores); got {t.dtype}")


def _expert_ids(fn: str, topk_idx: Tensor, num_experts: int) -> None:
    if topk_idx.numel():
        lo, hi = (int(v) for v in torch.aminmax(topk_idx))
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{fn}: argument 'topk_idx' has entries out of range [0, num_experts={num_experts}): "
                             f"min = {lo}, max = {hi}")


def _count(fn: str, name: str, value: object, lowest: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"{fn}: argument '{name}' must be an int >= {lowest}; got {value!r}")
    return value


def _topk_pair(fn: str, topk_scores: object, topk_idx: object) -> tuple[Tensor, Tensor]:
    topk_scores = tensor_arg(fn, "topk_scores", topk_scores, "float32 of shape [T, k]")
    check_ndim(fn, "topk_scores", topk_scores, 2, "[T, k]")
    _route_dtype(fn, "topk_scores", topk_scores)
    topk_idx = index_arg(fn, "topk_idx", topk_idx, 2, "[T, k]")
    shape_is(fn, "topk_idx", topk_idx, tuple(topk_scores.shape), "[T, k] (= topk_scores.shape)")
    same_device(fn, "topk_scores", topk_scores, topk_idx=topk_idx)
    return topk_scores.contiguous(), topk_idx.contiguous()


def route_capacity(topk_scores: Tensor, topk_idx: Tensor, num_experts: int, capacity: int, *,
                   normalize: bool = True, check: bool = True, use_native: bool | None = None) -> CapacityRoutes:
    """Capacity routing from each token's top-k experts, in one native call.

    Args:
        topk_scores: ``[T, k]`` float32 (or float64) router probabilities of the chosen
            experts, best first (``torch.topk`` of the softmax scores).
        topk_idx: ``[T, k]`` int64 expert ids of those choices, in ``[0, num_experts)``.
        num_experts: ``E``.
        capacity: ``C``, slots per expert (``>= 0``); routes at positions ``>= C`` are dropped.
        normalize: divide each token's gates by their sum (left to right, at least eps) when
            ``k > 1``, as the layer's ``normalize_gate``.
        check: verify on the host that every expert id is in range (one reduction: a device
            sync on CUDA); ``check=False`` makes that the caller's promise (the CPU kernel
            then raises for a bad id, the CUDA kernel traps).
        use_native: run the native kernel (default: ``not $MOECOMM_EXT_DISABLE``); the
            reference runs where it is unavailable, or on CUDA with more than 12288 experts.

    Returns:
        :class:`CapacityRoutes`; the same on the CPU and CUDA, native or reference.

    Raises:
        TypeError: a non-tensor, ``topk_idx`` not int64, ``topk_scores`` not float32/float64.
        ValueError: wrong shapes, devices, ``num_experts < 1``, ``capacity < 0``, or
            (``check``) an expert id out of range.
    """
    fn = "route_capacity"
    topk_scores, topk_idx = _topk_pair(fn, topk_scores, topk_idx)
    E = _count(fn, "num_experts", num_experts, 1)
    C = _count(fn, "capacity", capacity, 0)
    if check:
        _expert_ids(fn, topk_idx, E)
    return run_route_capacity(topk_scores, topk_idx, E, C, bool(normalize), use_native)


def route_dropless(topk_scores: Tensor, topk_idx: Tensor, num_experts: int, *, normalize: bool = True,
                   check: bool = True, use_native: bool | None = None) -> CapacityRoutes:
    """Dropless routing: :func:`route_capacity` with every route kept and no padding. The
    ``M = T * k`` slots hold expert 0's routes, then expert 1's, ...: expert ``e``'s route at
    queue position ``q`` goes to slot ``sum(counts[:e]) + q``.

    Args and raises: as :func:`route_capacity` (without ``capacity``).
    """
    fn = "route_dropless"
    topk_scores, topk_idx = _topk_pair(fn, topk_scores, topk_idx)
    E = _count(fn, "num_experts", num_experts, 1)
    if check:
        _expert_ids(fn, topk_idx, E)
    return run_route_capacity(topk_scores, topk_idx, E, -1, bool(normalize), use_native)


def route_backward(grad_gates: Tensor, topk_scores: Tensor, topk_idx: Tensor, scores: Tensor, *,
                   normalize: bool = True, aux_grad: Tensor | None = None, aux_counts: Tensor | None = None,
                   aux_scale: float = 1.0, split_bf16: bool = False, use_native: bool | None = None) -> Tensor:
    """The gradient of the router logits of :func:`route_capacity`'s gates, in one pass.

    With ``scores = softmax(logits)``, ``(topk_scores, topk_idx) = topk(scores, k)`` and
    ``gates`` the (renormalised) ``topk_scores``: the gradient ``grad_gates`` of the gates
    goes back through the renormalisation and the top-k selection; the GShard balance loss
    ``aux_scale * sum_e sum_t(scores[t, e]) * aux_counts[e]`` adds ``(aux_grad * aux_scale) *
    aux_counts[e]`` to every score of column ``e``; then the softmax's backward.

    Args:
        grad_gates: ``[T, k]`` gradient of the gates, in the scores' dtype.
        topk_scores, topk_idx: as given to :func:`route_capacity`.
        scores: ``[T, E]`` the softmax output.
        normalize: as given to :func:`route_capacity`.
        aux_grad: 0-dim gradient of the balance loss, or None (no loss term).
        aux_counts: ``[E]`` the loss's counts (:attr:`CapacityRoutes.first_counts`); with ``aux_grad``.
        aux_scale: the loss's factor (``E / T**2`` for GShard's).
        split_bf16: return ``[T, 2E]`` bfloat16: the float32 gradient ``g`` as ``hi = bf16(g)``
            then ``lo = bf16(g - hi)`` (float32 scores only), the operands of a bfloat16 GEMM
            that sums ``hi + lo`` in float32.
        use_native: as in :func:`route_capacity`.

    Returns:
        ``[T, E]`` in the scores' dtype, or ``[T, 2E]`` bfloat16 with ``split_bf16``. The
        sum over experts runs in another order on the GPU than on the CPU (agreement to
        rounding).

    Raises:
        TypeError, ValueError: bad tensors (named), shapes or dtypes.
    """
    fn = "route_backward"
    topk_scores, topk_idx = _topk_pair(fn, topk_scores, topk_idx)
    scores = tensor_arg(fn, "scores", scores, "float32 of shape [T, E]")
    check_ndim(fn, "scores", scores, 2, "[T, E]")
    grad_gates = tensor_arg(fn, "grad_gates", grad_gates, "of shape [T, k]")
    shape_is(fn, "grad_gates", grad_gates, tuple(topk_scores.shape), "[T, k] (= topk_scores.shape)")
    T, E = scores.shape
    if topk_scores.shape[0] != T or topk_scores.shape[1] > E:
        raise ValueError(f"{fn}: argument 'scores' must be [T, E] with T = {topk_scores.shape[0]} and E >= k = "
                         f"{topk_scores.shape[1]}; got shape {shape_str(scores)}")
    for name, t in (("scores", scores), ("grad_gates", grad_gates)):
        if t.dtype != topk_scores.dtype:
            raise TypeError(f"{fn}: argument '{name}' must have topk_scores' dtype {topk_scores.dtype}; got {t.dtype}")
    if (aux_grad is None) != (aux_counts is None):
        raise ValueError(f"{fn}: arguments 'aux_grad' and 'aux_counts' go together (both or neither)")
    if aux_grad is not None:
        aux_grad = tensor_arg(fn, "aux_grad", aux_grad, "0-dim")
        aux_counts = tensor_arg(fn, "aux_counts", aux_counts, "[E]")
        shape_is(fn, "aux_grad", aux_grad, (), "[] (0-dim)")
        shape_is(fn, "aux_counts", aux_counts, (E,), "[E]")
        for name, t in (("aux_grad", aux_grad), ("aux_counts", aux_counts)):
            if t.dtype != scores.dtype:
                raise TypeError(f"{fn}: argument '{name}' must have the scores' dtype {scores.dtype}; got {t.dtype}")
        same_device(fn, "scores", scores, aux_grad=aux_grad, aux_counts=aux_counts)
        aux_counts = aux_counts.contiguous()
    if split_bf16 and scores.dtype != torch.float32:
        raise TypeError(f"{fn}: split_bf16 needs float32 scores; got {scores.dtype}")
    same_device(fn, "scores", scores, topk_scores=topk_scores, grad_gates=grad_gates)
    return run_route_backward(grad_gates.contiguous(), topk_scores, topk_idx, scores.contiguous(), bool(normalize),
                              aux_grad, aux_counts, float(aux_scale), bool(split_bf16), use_native)
