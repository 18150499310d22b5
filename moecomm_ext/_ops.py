"""The validated public kernels: check every argument, then run natively or on the
reference (:mod:`moecomm_ext._kernels`). Not differentiable; :mod:`moecomm_ext._autograd`
holds the differentiable dispatch/combine built on them."""

from __future__ import annotations

from torch import Tensor

from ._checks import (
    check_ndim,
    floating,
    in_range,
    index_arg,
    no_grad_inputs,
    same_device,
    shape_is,
    shape_str,
    tensor_arg,
)
from ._kernels import run_gather_reduce_rows, run_gather_rowdot, run_gather_rows

__all__ = ["gather_rows", "gather_reduce_rows", "gather_rowdot"]


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

    Raises:
        TypeError: an argument is not a tensor, ``index`` is not int64, or ``scale`` (and
            then ``x``) is not floating.
        ValueError: a wrong number of dimensions or shape, tensors on different devices,
            or (``check``) an ``index`` entry outside ``[-1, N)``.
        RuntimeError: an input requires grad while grad mode is on.
        IndexError: ``check=False`` and the native CPU kernel met an entry out of range.
    """
    fn = "gather_rows"
    x = tensor_arg(fn, "x", x, "shape [N, D]")
    check_ndim(fn, "x", x, 2, "[N, D]")
    index = index_arg(fn, "index", index, 1, "[M]")
    same_device(fn, "x", x, index=index)
    if scale is not None:
        scale = tensor_arg(fn, "scale", scale, "floating of shape [M]")
        floating(fn, "scale", scale, "per-row scale factors")
        floating(fn, "x", x, "a scaled gather (scale is given)")
        shape_is(fn, "scale", scale, (index.shape[0],), "[M] (M = len(index))")
        same_device(fn, "x", x, scale=scale)
    no_grad_inputs(fn, x=x, scale=scale)
    if check:
        in_range(fn, "index", index, x.shape[0], "N = x.shape[0]")
    return run_gather_rows(x, index, scale, use_native)


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

    Raises:
        TypeError, ValueError, RuntimeError, IndexError: as :func:`gather_rows` (``index``
            entries checked against ``[-1, M)``).
    """
    fn = "gather_reduce_rows"
    y = tensor_arg(fn, "y", y, "shape [M, D]")
    check_ndim(fn, "y", y, 2, "[M, D]")
    floating(fn, "y", y, "gather_reduce_rows")
    index = index_arg(fn, "index", index, 2, "[T, K]")
    same_device(fn, "y", y, index=index)
    if weight is not None:
        weight = tensor_arg(fn, "weight", weight, "floating of shape [T, K]")
        floating(fn, "weight", weight, "combine weights")
        shape_is(fn, "weight", weight, tuple(index.shape), "[T, K] (= index.shape)")
        same_device(fn, "y", y, weight=weight)
    no_grad_inputs(fn, y=y, weight=weight)
    if check:
        in_range(fn, "index", index, y.shape[0], "M = y.shape[0]")
    return run_gather_reduce_rows(y, index, weight, use_native)


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

    Raises:
        TypeError, ValueError, RuntimeError, IndexError: as :func:`gather_rows`; also
            ``TypeError`` when ``b``'s dtype is not ``a``'s and ``ValueError`` when their
            row lengths or ``index``'s row count differ from ``a``'s.
    """
    fn = "gather_rowdot"
    a = tensor_arg(fn, "a", a, "shape [T, D]")
    b = tensor_arg(fn, "b", b, "shape [M, D]")
    check_ndim(fn, "a", a, 2, "[T, D]")
    check_ndim(fn, "b", b, 2, "[M, D]")
    floating(fn, "a", a, "gather_rowdot")
    if b.dtype != a.dtype:
        raise TypeError(f"{fn}: argument 'b' must have the dtype of 'a' ({a.dtype}); got {b.dtype}")
    if b.shape[1] != a.shape[1]:
        raise ValueError(
            f"{fn}: argument 'b' must have shape [M, D] with D = a.shape[1] = {a.shape[1]}; got shape {shape_str(b)}"
        )
    index = index_arg(fn, "index", index, 2, "[T, K]")
    if index.shape[0] != a.shape[0]:
        raise ValueError(
            f"{fn}: argument 'index' must have shape [T, K] with T = a.shape[0] = {a.shape[0]}; "
            f"got shape {shape_str(index)}"
        )
    same_device(fn, "a", a, b=b, index=index)
    no_grad_inputs(fn, a=a, b=b)
    if check:
        in_range(fn, "index", index, b.shape[0], "M = b.shape[0]")
    return run_gather_rowdot(a, b, index, use_native)
