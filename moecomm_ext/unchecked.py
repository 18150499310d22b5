"""The kernels without argument checks, for hot paths that have checked their inputs once.

Each function here is its public namesake (:func:`moecomm_ext.gather_rows`, ...) minus the
validation: inputs must be tensors of the documented shapes, dtypes and devices (strided
ones are copied to contiguous first), indices in range, and nothing may require grad. A bad input gives an exception from the
native CPU kernel, a trap of the CUDA kernel (a sticky CUDA error) or, on the reference
path, undefined results. ``use_native`` as in the public functions (None: the default).

* ``gather_rows(x, index, scale, use_native)``
* ``gather_reduce_rows(y, index, weight, use_native)``
* ``gather_rowdot(a, b, index, use_native)``
* ``route_capacity(topk_scores, topk_idx, num_experts, capacity, normalize, use_native)``
* ``route_backward(grad_gates, topk_scores, topk_idx, scores, normalize, aux_grad, aux_counts,
  aux_scale, split_bf16, use_native)``
* ``step_ops(device, num_experts, use_native)``: the MoE layer's fused capacity step as five
  functions (``step_route``, ``step_ffn``, ``step_combine_backward``, ``step_ffn_backward``,
  ``step_route_backward``, documented in :mod:`moecomm_ext.reference`): the native module's,
  issued from C++, or the reference's
* ``low_latency_ops(device, use_native)``: the native module whose ``ll_dispatch_layout``,
  ``ll_dispatch_place`` and ``gather_reduce_rows(..., out=)`` run
  :class:`moecomm.LowLatencyBuffer`'s dispatch and combine (``csrc/lowlat.h``), or None where
  it is not to be had (the buffer then runs its torch ops)
* ``seg_ops(device, use_native)``: the native module whose ``seg_bias_act(h, bias, ends, relu)``
  and ``seg_colsum(g, ends, num_local)`` (contiguous inputs) run the dropless experts' biases
  and bias gradients from the segment ends, or None
* ``glu_ops(device, use_native)``: the native module whose ``glu_forward(h, code)`` and
  ``glu_backward(grad, h, code, need_out)`` (contiguous inputs; codes in
  ``moecomm_ext.GLU_CODES``) run the gated experts' activation, or None
"""

from __future__ import annotations

from ._kernels import run_gather_reduce_rows as gather_reduce_rows
from ._kernels import run_gather_rowdot as gather_rowdot
from ._kernels import run_gather_rows as gather_rows
from ._route import run_route_backward as route_backward
from ._route import run_route_capacity as route_capacity
from ._route import step_ops
from ._glu import glu_module as glu_ops
from ._seg import seg_module as seg_ops
from ._loader import module_for

__all__ = ["gather_rows", "gather_reduce_rows", "gather_rowdot", "route_capacity", "route_backward", "step_ops",
           "low_latency_ops", "glu_ops", "seg_ops"]


def low_latency_ops(device, use_native: bool | None):
    """The native module for the low-latency buffer's tensors on ``device``, or None."""
    mod = module_for(device.type, use_native)
    return mod if mod is not None and hasattr(mod, "ll_dispatch_layout") else None
