"""The MoE layer's dispatch exchange with rows sent in a low-precision ``wire_dtype``.

Forward: ``comm.all_to_all_v(..., wire_dtype=)`` (FP8 with block scales, dequantized to the
activation dtype on arrival). Backward: the dispatch gradient goes back in
``grad_wire_dtype``: an FP8 dtype (the same block-scaled rule), a floating dtype (the
gradient is cast to it for the exchange and back: bf16 by default), or None (the
gradient's own dtype). The gradient of the quantization is the straight-through one.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from moecomm.quant import WIRE_DTYPES, check_wire_dtype

from ._comm import _a2a_kwargs

__all__ = ["check_wire_args", "all_to_all_wire"]

_GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32) + tuple(WIRE_DTYPES)


def check_wire_args(wire_dtype: Any, grad_wire_dtype: Any) -> None:
    """``TypeError`` naming the argument unless ``wire_dtype`` is None or an FP8 dtype and
    ``grad_wire_dtype`` None, an FP8 dtype, bfloat16, float16 or float32."""
    if wire_dtype is not None:
        check_wire_dtype(wire_dtype)
    if grad_wire_dtype is not None and grad_wire_dtype not in _GRAD_DTYPES:
        raise TypeError(f"grad_wire_dtype must be None, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, "
                        f"torch.float16 or torch.float32, got {grad_wire_dtype!r}")


class _WireAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, send, recv, algorithm, wire_dtype, grad_wire_dtype):  # type: ignore[override]
        ctx.comm, ctx.send, ctx.recv, ctx.algorithm, ctx.grad_wire = comm, send, recv, algorithm, grad_wire_dtype
        out, _ = comm.all_to_all_v(x.contiguous(), send, recv, wire_dtype=wire_dtype, **_a2a_kwargs(comm, algorithm))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        comm, gw = ctx.comm, ctx.grad_wire
        kw = _a2a_kwargs(comm, ctx.algorithm)
        g = grad.contiguous()
        if gw in WIRE_DTYPES:
            out, _ = comm.all_to_all_v(g, ctx.recv, ctx.send, wire_dtype=gw, **kw)
        elif gw is not None and gw != g.dtype:
            out, _ = comm.all_to_all_v(g.to(gw), ctx.recv, ctx.send, **kw)
            out = out.to(g.dtype)
        else:
            out, _ = comm.all_to_all_v(g, ctx.recv, ctx.send, **kw)
        return out, None, None, None, None, None, None


def all_to_all_wire(x: torch.Tensor, comm: Any, send: Sequence[int], recv: Sequence[int], algorithm: Optional[str],
                    wire_dtype: torch.dtype, grad_wire_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Differentiable dispatch exchange in ``wire_dtype`` (identity on one rank: nothing travels)."""
    if comm.size == 1:
        return x
    return _WireAllToAll.apply(x, comm, list(send), list(recv), algorithm, wire_dtype, grad_wire_dtype)
