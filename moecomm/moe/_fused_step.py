"""The MoE layer's default capacity step as one autograd Function (``fused_step=True``).

The same computation as the op-by-op path (the gate, softmax, top-k, routing, GShard loss,
dispatch, the all-to-alls, the FFN experts, combine), issued as few operations as it takes
and with little Python: the routing after ``torch.topk`` is one native kernel call
(:func:`moecomm_ext.route_capacity`), the router's backward one more
(:func:`moecomm_ext.route_backward`), the operations between the exchanges are issued from
C++ (``moecomm_ext.unchecked.step_ops``: five calls a step), and the backward of the whole
step is one node of autograd instead of some thirty. An eager step is then bound by the
GPU, not by the host issuing it (``bench/results/README.md``).

It covers the layer's defaults: capacity mode (``capacity_factor > 0``) with the linear gate
in float32, no gate noise while training, the GShard loss or none, no z-loss in the loss,
postscore gates, the built-in ReLU experts unsharded, no pipelining (``overlap_degree=1``,
own rows not first) and no FP8 wire. :func:`applies` says whether a call is covered; the
others take the op-by-op path.

Against the op-by-op path: the forward is the same bits, except the gates for ``k >= 5``
(this path sums a token's top-k scores left to right, torch's reduction in another order);
the backward's softmax step sums over the experts in another order, so the gradients of the
input and the gate weight agree to float32 rounding before their cast to the input dtype
(one unit in the last place of bfloat16 for a few elements); the experts' gradients are the
same bits.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moecomm_ext import unchecked

from ._step_cache import StepConstants
from ._wide_gemm import wide_gemm_available, wide_linear_applies
from .experts import FFNExperts
from .gates import LinearTopKGate
from .routing import Routing

__all__ = ["applies", "CapacityCall", "capacity_step"]


def applies(layer: Any, gate: Any, x: Tensor, cf: float, dropless: bool, degree: Any, own: bool,
            wire: Optional[torch.dtype], world: int) -> bool:
    """Whether this expert-parallel call of ``layer`` is one the fused step covers (see the
    module's docstring)."""
    experts = layer.experts
    if not (cf > 0 and not dropless and degree == 1 and not (own and world > 1)
            and (wire is None or world == 1)):
        return False
    if type(gate) is not LinearTopKGate or not gate.fp32_gate or (gate.gate_noise > 0 and layer.training):
        return False
    if layer.balance_loss_type not in ("gshard", None) or layer.z_loss_weight != 0:
        return False
    if layer.batch_prioritized_routing or not layer.is_postscore or "_run_experts" in layer.__dict__:
        return False
    if type(experts) is not FFNExperts or experts.shards != 1 or experts.act is not F.relu:
        return False
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return False
    return all(p is None or p.dtype == x.dtype for p in (experts.fc1_weight, experts.fc1_bias,
                                                        experts.fc2_weight, experts.fc2_bias))


class CapacityCall:
    """One call's settings, and what the forward leaves for the layer (its routing, logits)."""

    __slots__ = ("comm", "world", "num_experts", "num_local", "k", "capacity", "algorithm", "normalize",
                 "gshard", "use_native", "consts", "wide", "routing", "logits")

    def __init__(self, comm: Any, num_experts: int, num_local: int, k: int, capacity: int, algorithm: Optional[str],
                 normalize: bool, gshard: bool, use_native: bool, consts: StepConstants) -> None:
        self.comm, self.world = comm, comm.size
        self.num_experts, self.num_local, self.k, self.capacity = num_experts, num_local, k, capacity
        self.algorithm = algorithm or "flat"
        self.normalize, self.gshard, self.use_native, self.consts = normalize, gshard, use_native, consts
        self.wide = False
        self.routing: Optional[Routing] = None
        self.logits: Optional[Tensor] = None

    def exchange(self, rows: Tensor) -> Tensor:
        """The all-to-all of the padded layout: ``num_local * capacity`` rows to and from every rank."""
        if self.world == 1:
            return rows
        n = [self.num_local * self.capacity] * self.world
        return self.comm.all_to_all_v(rows.contiguous(), n, n, algorithm=self.algorithm)[0]


class _CapacityStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: CapacityCall, x, wg, w1, b1, w2, b2):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        E, C, El = call.num_experts, call.capacity, call.num_local
        ops = unchecked.step_ops(x.device, E, call.use_native)
        call.wide = wide = wide_linear_applies(x, wg)
        send, logits, scores, topv, topi, gates, locations, counts, first, token_slots, slot_token, slot_gate, aux = \
            ops.step_route(x, wg, call.k, C, call.normalize, call.gshard, wide)
        got = call.exchange(send)
        rows_expert = call.consts.row_expert(call.world, El, C, x.device) if b1 is not None or b2 is not None else None
        h, ye = ops.step_ffn(got, w1, b1, w2, b2, rows_expert, El, C)
        back = call.exchange(ye)
        if x.dtype == torch.float64:  # the row kernels' weights are in their opmath dtype
            gates, slot_gate = gates.double(), slot_gate.double()
        y = unchecked.gather_reduce_rows(back, token_slots, gates, call.use_native)
        call.routing = Routing(topi, gates, locations, counts, C)
        call.logits = logits
        ctx.call, ctx.ops = call, ops
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        ctx.save_for_backward(x, wg, w1, w2, scores, topv, topi, token_slots, slot_token, slot_gate, first, got, h,
                              back)
        if not call.gshard:
            ctx.mark_non_differentiable(aux)
        return y, aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, gaux):  # type: ignore[override]
        x, wg, w1, w2, scores, topv, topi, token_slots, slot_token, slot_gate, first, got, h, back = ctx.saved_tensors
        call, ops = ctx.call, ctx.ops
        need = ctx.needs_input_grad  # (call, x, wg, w1, b1, w2, b2)
        T, E = scores.shape
        C, El = call.capacity, call.num_local
        gy = back.new_zeros(T, back.shape[1]) if gy is None else gy.contiguous()
        g_back, g_gates = ops.step_combine_backward(gy, slot_token, slot_gate, back, token_slots, scores.dtype)
        g_ye = call.exchange(g_back)
        ones = None  # the bias gradients by a bfloat16 GEMM with ones (as _seg_gemm.seg_sum)
        if (ctx.has_b1 or ctx.has_b2) and g_ye.dtype == torch.bfloat16 and wide_gemm_available(g_ye.device):
            ones = call.consts.ones(g_ye.shape[0], g_ye.dtype, g_ye.device)
        g_got, gw1, gb1, gw2, gb2 = ops.step_ffn_backward(g_ye, h, got, w1, w2, ctx.has_b1, ctx.has_b2,
                                                          [need[1], need[3], need[4], need[5], need[6]], El, C, ones)
        g_send = call.exchange(g_got) if need[1] else None
        aux_grad = gaux if call.gshard and gaux is not None and T else None
        gx, gwg = ops.step_route_backward(g_send, token_slots, g_gates, topv, topi, scores, call.normalize, aux_grad,
                                          first, E / (T * T) if T else 1.0, x, wg, call.wide, need[1], need[2])
        return None, gx, gwg, gw1, gb1, gw2, gb2


def capacity_step(call: CapacityCall, x: Tensor, wg: Tensor, experts: FFNExperts) -> tuple[Tensor, Tensor]:
    """``(y, aux)`` of one capacity step of ``[T, model_dim]`` tokens ``x`` (``aux`` the GShard
    loss, or a zero without a graph when the call has none); ``call.routing`` and
    ``call.logits`` are set."""
    return _CapacityStep.apply(call, x, wg, experts.fc1_weight, experts.fc1_bias, experts.fc2_weight,
                               experts.fc2_bias)
