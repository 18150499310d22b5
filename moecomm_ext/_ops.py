"""Validated public operations and their autograd wrappers."""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from ._loader import module_for

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# --------------------------------------------------------------------------
# validation helpers (every message names the function and the argument)


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _tensor(fn: str, name: str, value: object, expect: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor ({expect}); got {type(value).__name__}")
    return value


def _ndim(fn: str, name: str, t: Tensor, ndim: int, expect: str) -> None:
    if t.dim() != ndim:
        raise ValueError(
            f"{fn}: argument '{name}' must be a {ndim}-D tensor of shape {expect}; got shape {_shape(t)}"
        )


def _index(fn: str, name: str, value: object, ndim: int, expect: str) -> Tensor:
    t = _tensor(fn, name, value, f"int64 of shape {expect}")
    if t.dtype != torch.int64:
        raise TypeError(f"{fn}: argument '{name}' must have dtype torch.int64 (shape {expect}); got {t.dtype}")
    _ndim(fn, name, t, ndim, expect)
    return t


def _floating(fn: str, name: str, t: Tensor, expect: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{fn}: argument '{name}' must have a floating dtype (float16, bfloat16, float32 or "
            f"float64) for {expect}; got {t.dtype}"
        )


def _same_device(fn: str, ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{fn}: argument '{name}' must be on the same device as '{ref_name}' ({ref.device}); got {t.device}"
            )


def _shape_is(fn: str, name: str, t: Tensor, shape: tuple[int, ...], expect: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{fn}: argument '{name}' must have shape {expect} = {list(shape)}; got shape {_shape(t)}"
        )


def _range(fn: str, name: str, index: Tensor, upper: int, what: str) -> None:
    """Host-side range check: every entry in [-1, upper)."""
    if index.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(index))
    if lo < -1 or hi >= upper:
        raise ValueError(
            f"{fn}: argument '{name}' has entries out of range [-1, {upper}) ({what} = {upper}): "
            f"min = {lo}, max = {hi}"
        )


def _no_grad_inputs(fn: str, **tensors: Tensor | None) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise RuntimeError(
                f"{fn}: argument '{name}' requires grad but {fn} is not differentiable; use "
                f"moecomm_ext.dispatch / moecomm_ext.combine (autograd) or run under torch.no_grad()"
            )


def _opmath(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if t is None:
        return None
    return t.to(reference.opmath_dtype(dtype)).contiguous()


# --------------------------------------------------------------------------
# unvalidated implementations (inputs already checked)


def _native_result(fn: str, result, index: Tensor, upper: int) -> Tensor:
    """The CPU kernels return ``(out, bad)`` instead of throwing from their
    parallel loops (bad = flat position of an out-of-range entry, or -1)."""
    if not isinstance(result, tuple):
        return result  # CUDA kernels trap on a bad entry instead
    out, bad = result
    if bad >= 0:
        value = int(index.reshape(-1)[bad])
        raise IndexError(
            f"{fn}: argument 'index' entry {bad} (flat position) = {value} is out of range [-1, {upper})"
        )
    return out


def _gather_rows(x: Tensor, index: Tensor, scale: Tensor | None, use_native: bool | None) -> Tensor:
    mod = module_for(x.device.type, use_native)
    if mod is None:
        return reference.gather_rows(x, index, scale)
    index = index.contiguous()
    res = mod.gather_rows(x.contiguous(), index, _opmath(scale, x.dtype))
    return _native_result("gather_rows", res, index, x.shape[0])


def _gather_reduce_rows(y: Tensor, index: Tensor, weight: Tensor | None, use_native: bool | None) -> Tensor:
    mod = module_for(y.device.type, use_native)
    if mod is None:
        return reference.gather_reduce_rows(y, index, weight)
    index = index.contiguous()
    res = mod.gather_reduce_rows(y.contiguous(), index, _opmath(weight, y.dtype))
    return _native_result("gather_reduce_rows", res, index, y.shape[0])


def _gather_rowdot(a: Tensor, b: Tensor, index: Tensor, use_native: bool | None) -> Tensor:
    mod = module_for(a.device.type, use_native)
    if mod is None:
        return reference.gather_rowdot(a, b, index)
    index = index.contiguous()
    res = mod.gather_rowdot(a.contiguous(), b.contiguous(), index)
    return _native_result("gather_rowdot", res, index, b.shape[0])


# --------------------------------------------------------------------------
# public kernels


def gather_rows(
    x: Tensor,
    index: Tensor,
    scale: Tensor | None = None,
    *,
    check: bool = True,
    use_native: bool | None = None,
) -> Tensor:
    """Gather (and optionally scale) rows: ``out[i] = x[index[i]] * scale[i]``.

    Args:
        x: ``[N, D]`` source rows.  Any dtype when ``scale`` is None (rows are
            copied bit for bit, so bool/int8/uint8/int64/... all work);
            float16, bfloat16, float32 or float64 when ``scale`` is given.
        index: ``[M]`` int64 row numbers in ``[-1, N)``; ``-1`` gives a zero row.
        scale: ``[M]`` per-row factors of any floating dtype, or None.  The
            product is computed in float32 (float64 when ``x`` is float64)
            and rounded once to ``x.dtype``.
        check: verify on the host that ``index`` lies in ``[-1, N)`` (one
            min/max reduction; forces a device sync on CUDA) and raise
            ``ValueError`` otherwise.  ``check=False`` makes validity the
            caller's promise: the native CPU kernel still raises
            ``IndexError`` for a bad entry, the native CUDA kernel traps (a
            sticky CUDA error), and the reference path treats entries below
            ``-1`` like ``-1``.
        use_native: run the native kernel (default: ``not $MOECOMM_EXT_DISABLE``);
            the reference is used where the native build is unavailable.

    Returns:
        ``[M, D]`` tensor of ``x.dtype`` on ``x.device``.  Not differentiable
        (raises if an input requires grad while grad mode is on); use
        :func:`dispatch` / :func:`combine` for autograd.
    """
    fn = "gather_rows"
    x = _tensor(fn, "x", x, "shape [N, D]")
    _ndim(fn, "x", x, 2, "[N, D]")
    index = _index(fn, "index", index, 1, "[M]")
    _same_device(fn, "x", x, index=index)
    if scale is not None:
        scale = _tensor(fn, "scale", scale, "floating of shape [M]")
        _floating(fn, "scale", scale, "per-row scale factors")
        _floating(fn, "x", x, "a scaled gather (scale is given)")
        _shape_is(fn, "scale", scale, (index.shape[0],), "[M] (M = len(index))")
        _same_device(fn, "x", x, scale=scale)
    _no_grad_inputs(fn, x=x, scale=scale)
    if check:
        _range(fn, "index", index, x.shape[0], "N = x.shape[0]")
    return _gather_rows(x, index, scale, use_native)


def gather_reduce_rows(
    y: Tensor,
    index: Tensor,
    weight: Tensor | None = None,
    *,
    check: bool = True,
    use_native: bool | None = None,
) -> Tensor:
    """Gather rows and reduce them: ``out[t] = sum_j weight[t, j] * y[index[t, j]]``.

    Args:
        y: ``[M, D]`` float16, bfloat16, float32 or float64 rows.
        index: ``[T, K]`` int64 row numbers in ``[-1, M)``; ``-1`` entries are skipped.
        weight: ``[T, K]`` weights of any floating dtype, or None (all ones).
        check, use_native: as in :func:`gather_rows`.

    Returns:
        ``[T, D]`` tensor of ``y.dtype``, accumulated in float32 (float64 for
        float64 ``y``) in the order j = 0..K-1 and rounded once.  Not
        differentiable (see :func:`combine`).
    """
    fn = "gather_reduce_rows"
    y = _tensor(fn, "y", y, "shape [M, D]")
    _ndim(fn, "y", y, 2, "[M, D]")
    _floating(fn, "y", y, "gather_reduce_rows")
    index = _index(fn, "index", index, 2, "[T, K]")
    _same_device(fn, "y", y, index=index)
    if weight is not None:
        weight = _tensor(fn, "weight", weight, "floating of shape [T, K]")
        _floating(fn, "weight", weight, "combine weights")
        _shape_is(fn, "weight", weight, tuple(index.shape), "[T, K] (= index.shape)")
        _same_device(fn, "y", y, weight=weight)
    _no_grad_inputs(fn, y=y, weight=weight)
    if check:
        _range(fn, "index", index, y.shape[0], "M = y.shape[0]")
    return _gather_reduce_rows(y, index, weight, use_native)


def gather_rowdot(
    a: Tensor,
    b: Tensor,
    index: Tensor,
    *,
    check: bool = True,
    use_native: bool | None = None,
) -> Tensor:
    """Dot products with gathered rows: ``out[t, j] = dot(a[t], b[index[t, j]])``.

    Args:
        a: ``[T, D]`` float16, bfloat16, float32 or float64.
        b: ``[M, D]`` of the same dtype as ``a``.
        index: ``[T, K]`` int64 row numbers of ``b`` in ``[-1, M)``; ``-1`` gives 0.
        check, use_native: as in :func:`gather_rows`.

    Returns:
        ``[T, K]`` float32 (float64 when ``a`` is float64), accumulated in that
        dtype.  Not differentiable.
    """
    fn = "gather_rowdot"
    a = _tensor(fn, "a", a, "shape [T, D]")
    b = _tensor(fn, "b", b, "shape [M, D]")
    _ndim(fn, "a", a, 2, "[T, D]")
    _ndim(fn, "b", b, 2, "[M, D]")
    _floating(fn, "a", a, "gather_rowdot")
    if b.dtype != a.dtype:
        raise TypeError(f"{fn}: argument 'b' must have the dtype of 'a' ({a.dtype}); got {b.dtype}")
    if b.shape[1] != a.shape[1]:
        raise ValueError(
            f"{fn}: argument 'b' must have shape [M, D] with D = a.shape[1] = {a.shape[1]}; got shape {_shape(b)}"
        )
    index = _index(fn, "index", index, 2, "[T, K]")
    if index.shape[0] != a.shape[0]:
        raise ValueError(
            f"{fn}: argument 'index' must have shape [T, K] with T = a.shape[0] = {a.shape[0]}; "
            f"got shape {_shape(index)}"
        )
    _same_device(fn, "a", a, b=b, index=index)
    _no_grad_inputs(fn, a=a, b=b)
    if check:
        _range(fn, "index", index, b.shape[0], "M = b.shape[0]")
    return _gather_rowdot(a, b, index, use_native)


# --------------------------------------------------------------------------
# slot maps


def _check_token_slots(fn: str, token_slots: object, num_slots: int) -> Tensor:
    token_slots = _index(fn, "token_slots", token_slots, 2, "[T, K]")
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
        raise ValueError(f"{fn}: argument 'num_slots' must be a non-negative int; got {num_slots!r}")
    _range(fn, "token_slots", token_slots, num_slots, "num_slots")
    valid = token_slots[token_slots >= 0]
    if valid.numel() and int(torch.bincount(valid, minlength=num_slots).max()) > 1:
        raise ValueError(f"{fn}: argument 'token_slots' lists some slot more than once")
    return token_slots


def invert_slots(token_slots: Tensor, num_slots: int) -> Tensor:
    """Invert a token -> slot map.

    Args:
        token_slots: ``[T, K]`` int64; ``token_slots[t, j]`` is the slot (row of
            the expert buffers) holding the j-th copy of token t, or ``-1``.
            Each slot may appear at most once.
        num_slots: ``M``, the number of slots.

    Returns:
        ``slot_token``: ``[M]`` int64, the token held by each slot, ``-1`` for empty slots.
    """
    token_slots = _check_token_slots("invert_slots", token_slots, num_slots)
    return reference.invert_slots(token_slots, num_slots)


def slot_positions(token_slots: Tensor, num_slots: int) -> Tensor:
    """Companion of :func:`invert_slots`: each slot's position in ``token_slots``.

    Returns ``[M]`` int64 with ``t * K + j`` for the slot ``token_slots[t, j]``,
    ``-1`` for empty slots, so ``gather_rows(w.reshape(-1, 1), pos)`` gives each
    slot's weight ``w[t, j]`` (``slot_token == pos // K`` where ``pos >= 0``).
    """
    token_slots = _check_token_slots("slot_positions", token_slots, num_slots)
    return reference.slot_positions(token_slots, num_slots)


def _check_slot_pair(fn: str, slot_token: Tensor, token_slots: Tensor) -> None:
    """slot_token and token_slots must be inverse maps of each other."""
    T, K = token_slots.shape
    M = slot_token.shape[0]
    _range(fn, "slot_token", slot_token, T, "T = token_slots.shape[0]")
    _range(fn, "token_slots", token_slots, M, "M = slot_token.shape[0]")
    if token_slots.numel():
        back = reference.gather_rows(slot_token.unsqueeze(1), token_slots.reshape(-1)).reshape(T, K)
        tokens = torch.arange(T, device=token_slots.device).unsqueeze(1)
        if bool(((token_slots >= 0) & (back != tokens)).any()):
            raise ValueError(
                f"{fn}: arguments 'slot_token' and 'token_slots' are not inverse maps: some "
                f"token_slots[t, j] = m has slot_token[m] != t (build one from the other with invert_slots)"
            )
    if M and K:
        rows = reference.gather_rows(token_slots, slot_token)  # [M, K]
        slots = torch.arange(M, device=slot_token.device).unsqueeze(1)
        found = (rows == slots).any(dim=1)
        if bool(((slot_token >= 0) & ~found).any()):
            raise ValueError(
                f"{fn}: arguments 'slot_token' and 'token_slots' are not inverse maps: some slot m "
                f"with slot_token[m] = t is missing from token_slots[t] (use invert_slots)"
            )
    elif M and bool((slot_token >= 0).any()):
        raise ValueError(f"{fn}: argument 'slot_token' names tokens but 'token_slots' has K = 0 columns")


# --------------------------------------------------------------------------
# autograd wrappers


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot_token, token_slots, slot_scale, use_native):  # type: ignore[override]
        ctx.use_native = use_native
        ctx.save_for_backward(x, slot_token, token_slots, slot_scale)
        return _gather_rows(x, slot_token, slot_scale, use_native)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        x, slot_token, token_slots, slot_scale = ctx.saved_tensors
        use_native = ctx.use_native
        grad_out = grad_out.contiguous()
        T, K = token_slots.shape
        grad_x = grad_scale = None
        if ctx.needs_input_grad[0]:
            token_scale = None
            if slot_scale is not None:
                # weight of copy (t, j) = scale of the slot it went to
                token_scale = _gather_rows(
                    _opmath(slot_scale, x.dtype).unsqueeze(1), token_slots.reshape(-1), None, use_native
                ).reshape(T, K)
            grad_x = _gather_reduce_rows(grad_out, token_slots, token_scale, use_native)
        if slot_scale is not None and ctx.needs_input_grad[3]:
            g = _gather_rowdot(grad_out, x.contiguous(), slot_token.unsqueeze(1), use_native)
            grad_scale = g.reshape(-1).to(slot_scale.dtype)
        return grad_x, None, None, grad_scale, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, token_slots, token_weight, slot_token, use_native):  # type: ignore[override]
        ctx.use_native = use_native
        ctx.save_for_backward(y, token_slots, token_weight, slot_token)
        return _gather_reduce_rows(y, token_slots, token_weight, use_native)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        y, token_slots, token_weight, slot_token = ctx.saved_tensors
        use_native = ctx.use_native
        grad_out = grad_out.contiguous()
        M = slot_token.shape[0]
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            slot_weight = None
            if token_weight is not None:
                # weight of slot m = token_weight[t, j] for the (t, j) with
                # token_slots[t, j] == m and t = slot_token[m]: gather the
                # token's K slots and weights, keep the matching column.
                rows = _gather_rows(token_slots, slot_token, None, use_native)  # [M, K]
                wts = _gather_rows(_opmath(token_weight, y.dtype), slot_token, None, use_native)
                mine = rows == torch.arange(M, device=rows.device).unsqueeze(1)
                slot_weight = (wts * mine).sum(dim=1)
            grad_y = _gather_rows(grad_out, slot_token, slot_weight, use_native)
        if token_weight is not None and ctx.needs_input_grad[2]:
            grad_w = _gather_rowdot(grad_out, y.contiguous(), token_slots, use_native).to(token_weight.dtype)
        return grad_y, None, grad_w, None, None


def dispatch(
    x: Tensor,
    slot_token: Tensor,
    token_slots: Tensor,
    slot_scale: Tensor | None = None,
    *,
    check: bool = True,
    use_native: bool | None = None,
) -> Tensor:
    """MoE dispatch (differentiable): copy each token to its expert slots.

    ``out[m] = x[slot_token[m]] * slot_scale[m]`` and a zero row where
    ``slot_token[m] == -1`` (forward = :func:`gather_rows`).

    Args:
        x: ``[T, D]`` float16, bfloat16, float32 or float64 token rows.
        slot_token: ``[M]`` int64 slot -> token map, entries in ``[-1, T)``.
        token_slots: ``[T, K]`` int64 token -> slot map, entries in ``[-1, M)``;
            the inverse of ``slot_token`` (see :func:`invert_slots`).  Used by
            the backward pass, which is then a gather-reduce (no atomics):
            ``grad_x[t] = sum_j slot_scale[token_slots[t, j]] * grad[token_slots[t, j]]``.
        slot_scale: ``[M]`` floating per-slot factors, or None.  Its gradient is
            ``grad_scale[m] = dot(grad[m], x[slot_token[m]])`` (gather_rowdot),
            returned in ``slot_scale.dtype``.
        check: verify index ranges and that the two maps are inverse (host
            sync on CUDA).  Inconsistent maps give wrong gradients.
        use_native: as in :func:`gather_rows`.

    Returns:
        ``[M, D]`` tensor of ``x.dtype``.
    """
    fn = "dispatch"
    x = _tensor(fn, "x", x, "shape [T, D]")
    _ndim(fn, "x", x, 2, "[T, D]")
    _floating(fn, "x", x, "dispatch")
    slot_token = _index(fn, "slot_token", slot_token, 1, "[M]")
    token_slots = _index(fn, "token_slots", token_slots, 2, "[T, K]")
    if token_slots.shape[0] != x.shape[0]:
        raise ValueError(
            f"{fn}: argument 'token_slots' must have shape [T, K] with T = x.shape[0] = {x.shape[0]}; "
            f"got shape {_shape(token_slots)}"
        )
    if slot_scale is not None:
        slot_scale = _tensor(fn, "slot_scale", slot_scale, "floating of shape [M]")
        _floating(fn, "slot_scale", slot_scale, "per-slot scale factors")
        _shape_is(fn, "slot_scale", slot_scale, (slot_token.shape[0],), "[M] (M = len(slot_token))")
    _same_device(fn, "x", x, slot_token=slot_token, token_slots=token_slots, slot_scale=slot_scale)
    if check:
        _check_slot_pair(fn, slot_token, token_slots)
    return _Dispatch.apply(x, slot_token.contiguous(), token_slots.contiguous(), slot_scale, use_native)


def combine(
    y: Tensor,
    token_slots: Tensor,
    token_weight: Tensor | None,
    slot_token: Tensor,
    *,
    check: bool = True,
    use_native: bool | None = None,
) -> Tensor:
    """MoE combine (differentiable): weighted sum of each token's expert outputs.

    ``out[t] = sum_j token_weight[t, j] * y[token_slots[t, j]]`` over entries
    ``!= -1`` (forward = :func:`gather_reduce_rows`).

    Args:
        y: ``[M, D]`` float16, bfloat16, float32 or float64 expert outputs.
        token_slots: ``[T, K]`` int64 token -> slot map, entries in ``[-1, M)``.
        token_weight: ``[T, K]`` floating gate weights, or None (all ones).
            Its gradient ``grad_w[t, j] = dot(grad[t], y[token_slots[t, j]])``
            (gather_rowdot) is returned in ``token_weight.dtype``.
        slot_token: ``[M]`` int64 slot -> token map, the inverse of
            ``token_slots``; the backward w.r.t. ``y`` is
            ``gather_rows(grad, slot_token, scale=weight of the slot)``.
        check: verify index ranges and that the two maps are inverse.
        use_native: as in :func:`gather_rows`.

    Returns:
        ``[T, D]`` tensor of ``y.dtype`` (accumulated in float32, or float64).
    """
    fn = "combine"
    y = _tensor(fn, "y", y, "shape [M, D]")
    _ndim(fn, "y", y, 2, "[M, D]")
    _floating(fn, "y", y, "combine")
    token_slots = _index(fn, "token_slots", token_slots, 2, "[T, K]")
    slot_token = _index(fn, "slot_token", slot_token, 1, "[M]")
    if slot_token.shape[0] != y.shape[0]:
        raise ValueError(
            f"{fn}: argument 'slot_token' must have shape [M] with M = y.shape[0] = {y.shape[0]}; "
            f"got shape {_shape(slot_token)}"
        )
    if token_weight is not None:
        token_weight = _tensor(fn, "token_weight", token_weight, "floating of shape [T, K]")
        _floating(fn, "token_weight", token_weight, "combine weights")
        _shape_is(fn, "token_weight", token_weight, tuple(token_slots.shape), "[T, K] (= token_slots.shape)")
    _same_device(fn, "y", y, token_slots=token_slots, token_weight=token_weight, slot_token=slot_token)
    if check:
        _check_slot_pair(fn, slot_token, token_slots)
    return _Combine.apply(y, token_slots.contiguous(), token_weight, slot_token.contiguous(), use_native)
