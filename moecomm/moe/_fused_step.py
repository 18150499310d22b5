"""The MoE layer's default capacity step as one autograd Function (``fused_step=True``).

The same computation as the op-by-op path (the gate, softmax, top-k, routing, GShard loss,
dispatch, the all-to-alls, the FFN experts, combine), issued as few operations as it takes:
the routing after ``torch.topk`` is one native call (:func:`moecomm_ext.route_capacity`),
the router's backward one more (:func:`moecomm_ext.route_backward`), and the backward of the
whole step is one node of autograd instead of some thirty. An eager step is then bound by
the GPU, not by the host issuing it (``bench/results/README.md``).

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

from ._seg_gemm import seg_mm, seg_sum, seg_wgrad
from ._segments import Segments
from ._step_cache import StepConstants
from ._wide_gemm import wide_linear_applies
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
        T = x.shape[0]
        E, k, C, native = call.num_experts, call.k, call.capacity, call.use_native
        call.wide = wide = wide_linear_applies(x, wg)
        logits = torch.mm(x, wg.t(), out_dtype=torch.float32) if wide else F.linear(x.float(), wg.float())
        scores = torch.softmax(logits, 1)
        if T:
            topv, topi = torch.topk(scores, k, dim=1)
        else:
            topi = torch.empty(0, k, dtype=torch.int64, device=x.device)
            topv = scores.new_empty(0, k)
        rt = unchecked.route_capacity(topv, topi, E, C, call.normalize, native)
        if not call.gshard:
            aux = scores.new_zeros(())
        elif T:
            aux = (scores.sum(0) * rt.first_counts).sum() * (E / (T * T))
        else:
            aux = scores.sum() * 0.0
        send = unchecked.gather_rows(x, rt.slot_token, None, native)
        got = call.exchange(send)
        seg = Segments.uniform_blocks(call.world, call.num_local, C, consts=call.consts)
        h = seg_mm(got, w1, seg, b1).relu_()
        back = call.exchange(seg_mm(h, w2, seg, b2))
        weights = rt.gates if x.dtype != torch.float64 else rt.gates.double()
        y = unchecked.gather_reduce_rows(back, rt.token_slots, weights, native)
        call.routing = Routing(topi, rt.gates, rt.locations, rt.counts, C)
        call.logits = logits
        ctx.call, ctx.seg = call, seg
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        ctx.save_for_backward(x, wg, w1, w2, scores, topv, topi, rt.token_slots, rt.slot_token,
                              rt.slot_gate.to(weights.dtype), rt.first_counts, got, h, back)
        if not call.gshard:
            ctx.mark_non_differentiable(aux)
        return y, aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, gaux):  # type: ignore[override]
        x, wg, w1, w2, scores, topv, topi, token_slots, slot_token, slot_gate, first_counts, got, h, back = \
            ctx.saved_tensors
        call, seg = ctx.call, ctx.seg
        native = call.use_native
        need = ctx.needs_input_grad  # (call, x, wg, w1, b1, w2, b2)
        T, E = scores.shape
        gy = back.new_zeros(T, back.shape[1]) if gy is None else gy.contiguous()
        # combine: the slots' gradient, and the gates'
        g_ye = call.exchange(unchecked.gather_rows(gy, slot_token, slot_gate, native))
        g_gates = unchecked.gather_rowdot(gy, back, token_slots, native).to(scores.dtype)
        # the experts (as the op-by-op path's _GroupedFFN with ReLU)
        gw2 = seg_wgrad(h, g_ye, seg) if need[5] else None
        gb2 = seg_sum(g_ye, seg) if ctx.has_b2 and need[6] else None
        gh = torch.ops.aten.threshold_backward(seg_mm(g_ye, w2, seg, transpose_w=True), h, 0)
        gw1 = seg_wgrad(got, gh, seg) if need[3] else None
        gb1 = seg_sum(gh, seg) if ctx.has_b1 and need[4] else None
        gx = gwg = None
        if need[1]:
            g_send = call.exchange(seg_mm(gh, w1, seg, transpose_w=True))
            gx = unchecked.gather_reduce_rows(g_send, token_slots, None, native)
        if need[1] or need[2]:
            aux_grad = gaux if call.gshard and gaux is not None and T else None
            gl = unchecked.route_backward(g_gates, topv, topi, scores, call.normalize, aux_grad,
                                          first_counts if aux_grad is not None else None,
                                          E / (T * T) if T else 1.0, call.wide, native)
            if call.wide:  # gl is [T, 2E] bfloat16: the float32 gradient's hi | lo (_wide_gemm's backward)
                if need[1]:
                    gx = gx + torch.mm(gl, torch.cat([wg, wg], dim=0))
                if need[2]:
                    both = torch.mm(gl.t(), x, out_dtype=torch.float32)
                    gwg = (both[:E] + both[E:]).to(wg.dtype)
            else:  # F.linear(x.float(), wg.float())'s backward
                if need[1]:
                    gxg = gl.mm(wg.float())
                    gx = gx + (gxg if x.dtype == torch.float32 else gxg.to(x.dtype))
                if need[2]:
                    gw = gl.t().mm(x.float())
                    gwg = gw if wg.dtype == torch.float32 else gw.to(wg.dtype)
        return None, gx, gwg, gw1, gb1, gw2, gb2


def capacity_step(call: CapacityCall, x: Tensor, wg: Tensor, experts: FFNExperts) -> tuple[Tensor, Tensor]:
    """``(y, aux)`` of one capacity step of ``[T, model_dim]`` tokens ``x`` (``aux`` the GShard
    loss, or a zero without a graph when the call has none); ``call.routing`` and
    ``call.logits`` are set."""
    return _CapacityStep.apply(call, x, wg, experts.fc1_weight, experts.fc1_bias, experts.fc2_weight,
                               experts.fc2_bias)
