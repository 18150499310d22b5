"""The MoE layer's default capacity step as one autograd Function (``fused_step=True``).

The same computation as the op-by-op path (the gate, softmax, top-k, routing, GShard loss,
dispatch, the all-to-alls, the FFN experts, combine), issued as few operations as it takes
and with little Python: the routing after ``torch.topk`` is one native kernel call
(:func:`moecomm_ext.route_capacity`), the router's backward one more
(:func:`moecomm_ext.route_backward`), the operations between the exchanges are issued from
C++ (``moecomm_ext.unchecked.step_ops``: five calls a step), and the backward of the whole
step is one node of autograd instead of some thirty. An eager step is then bound by the
GPU, not by the host issuing it (``bench/results/README.md``).

It covers the layer's defaults: capacity mode (``capacity_factor > 0``) or dropless with the
linear gate in float32, no gate noise while training, the GShard loss or none, no z-loss in
the loss, postscore gates, the built-in experts unsharded with any activation (ReLU's FFN
issued from C++; the others, gated ones and any callable included, by the grouped FFN of
:mod:`~moecomm.moe.experts`, whose backward recomputes the activation from the saved
pre-activation: one aten kernel for the named ones, ``torch.autograd`` through a callable),
no pipelining (``overlap_degree=1``, own rows not first); with ``wire_dtype`` across ranks the
dispatch gather writes packed FP8 rows (as the op-by-op path's fused FP8 dispatch).
:func:`uncovered` says why a call is not covered (None when it is). A call whose router, gate
or loss is all that is not covered (:func:`uncovered_routed` None) runs :func:`routed_step`:
the layer routes with torch operations, the rest is this module's Function; the others take
the op-by-op path.

Against the op-by-op path: the forward is the same bits, except the gates for ``k >= 5`` on
the CPU and ``k >= 3`` on GPUs (this path sums a token's top-k scores left to right, torch's
reduction in another order);
the backward's softmax step sums over the experts in another order, so the gradients of the
input and the gate weight agree to float32 rounding before their cast to the input dtype
(one unit in the last place of bfloat16 for a few elements); the experts' gradients are the
same bits.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moecomm import quant
from moecomm.functional import all_to_all_v_backward
from moecomm.wire import WIRE_BLOCK
from moecomm_ext import unchecked

from .._ops.comm import check_received_counts
from .._ops.step_cache import StepConstants
from .._ops.wide_gemm import wide_gemm_available, wide_linear_applies
from .._ops.segments import Segments
from ..experts import FFNExperts, ffn_backward, ffn_forward
from ..gates import LinearTopKGate
from ..routing import Routing

__all__ = ["StepPath", "FUSED", "applies", "uncovered", "uncovered_routed", "routing_uncovered", "StepCall",
           "fused_step", "routed_step"]


class StepPath(NamedTuple):
    """Which path a call of the layer took (``MoELayer.last_step_path``): ``path`` is
    ``"fused"`` (this module's step), ``"op_by_op"`` or ``"cuda_graph"`` (a replay of the
    captured step, ``cuda_graph=True``); ``reason`` says why not fused (None when fused or
    replayed), naming the option."""

    path: str
    reason: Optional[str] = None


FUSED = StepPath("fused")


def _mode_reason(cf: float, dropless: bool, degree: Any, own: bool, world: int) -> Optional[str]:
    if not (cf > 0 or dropless):
        return f"capacity_factor={cf} (the fused step takes a fixed capacity, > 0, or dropless=True)"
    if degree != 1:
        return f"overlap_degree={degree!r} (pipelined exchanges run op by op)"
    if own and world > 1:
        return "own_first=True (pipelined exchanges run op by op)"
    return None


def uncovered(layer: Any, gate: Any, x: Tensor, cf: float, dropless: bool, degree: Any, own: bool,
              wire: Optional[torch.dtype], world: int) -> Optional[str]:
    """None when this expert-parallel call of ``layer`` is one the fused step covers (see the
    module's docstring), else why not: the option (its name and value) that sends it op by op."""
    return (_mode_reason(cf, dropless, degree, own, world) or routing_uncovered(layer, gate)
            or _layer_reason(layer, x, wire, world))


def routing_uncovered(layer: Any, gate: Any) -> Optional[str]:
    """Why the fused step's own routing (the linear float32 gate, softmax top-k, the GShard
    loss) does not cover ``layer``'s gate and losses, None when it does; a call covered but
    for this takes :func:`routed_step`."""
    if type(gate) is not LinearTopKGate:
        return f"gate={type(gate).__name__} (the fused step takes the linear gate)"
    if not gate.fp32_gate:
        return "fp32_gate=False (the fused step runs the gate in float32)"
    if gate.gate_noise > 0 and layer.training:
        return f"gate_noise={gate.gate_noise} while training"
    if layer.balance_loss_type not in ("gshard", None):
        return f"balance_loss={layer.balance_loss_type!r} (the fused step takes 'gshard' or None)"
    if layer.z_loss_weight != 0:
        return f"z_loss_weight={layer.z_loss_weight} (the fused step has no z-loss term)"
    return None


def uncovered_routed(layer: Any, x: Tensor, cf: float, dropless: bool, degree: Any, own: bool,
                     wire: Optional[torch.dtype], world: int) -> Optional[str]:
    """As :func:`uncovered` for a step the layer routes itself (:func:`routed_step`: any gate,
    router and losses), else why not."""
    return _mode_reason(cf, dropless, degree, own, world) or _layer_reason(layer, x, wire, world)


def _layer_reason(layer: Any, x: Tensor, wire: Optional[torch.dtype], world: int) -> Optional[str]:
    experts = layer.experts
    if layer.batch_prioritized_routing:
        return "batch_prioritized_routing=True"
    if not layer.is_postscore:
        return "is_postscore=False (the fused step applies the gates to the expert outputs)"
    if "_run_experts" in layer.__dict__:
        return "the layer's _run_experts is replaced"
    if type(experts) is not FFNExperts:
        return f"experts={type(experts).__name__} (the fused step runs the built-in FFN experts)"
    if experts.shards != 1:
        return f"num_experts={layer.num_experts} over {world} ranks (sharded experts)"
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return f"input dtype {x.dtype}"
    if wire is not None and world > 1 and x.dtype not in quant.INPUT_DTYPES:
        return f"wire_dtype={wire} with input dtype {x.dtype}"
    for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        p = getattr(experts, name)
        if p is not None and p.dtype != x.dtype:
            return f"dtype: experts.{name} is {p.dtype}, the input {x.dtype}"
    return None


def applies(layer: Any, gate: Any, x: Tensor, cf: float, dropless: bool, degree: Any, own: bool,
            wire: Optional[torch.dtype], world: int) -> bool:
    """Whether this expert-parallel call of ``layer`` is one the fused step covers
    (:func:`uncovered` says why not)."""
    return uncovered(layer, gate, x, cf, dropless, degree, own, wire, world) is None


class StepCall:
    """One call's settings, and what the forward leaves for the layer (its routing, logits).
    ``capacity`` None: dropless (the forward sets the split sizes)."""

    __slots__ = ("comm", "world", "num_experts", "num_local", "k", "capacity", "algorithm", "normalize",
                 "gshard", "use_native", "consts", "wire", "grad_wire", "wide", "routing", "logits", "send_splits",
                 "recv_splits", "act", "selected_idx", "weights")

    def __init__(self, comm: Any, num_experts: int, num_local: int, k: int, capacity: Optional[int],
                 algorithm: Optional[str], normalize: bool, gshard: bool, use_native: bool,
                 consts: StepConstants, wire: Optional[torch.dtype] = None,
                 grad_wire: Optional[torch.dtype] = None) -> None:
        self.comm, self.world = comm, comm.size
        self.num_experts, self.num_local, self.k, self.capacity = num_experts, num_local, k, capacity
        self.algorithm = algorithm or "flat"
        self.normalize, self.gshard, self.use_native, self.consts = normalize, gshard, use_native, consts
        # FP8 dispatch (more than one rank): the gather writes packed FP8 rows (as _wire_dispatch)
        self.wire = wire if self.world > 1 else None
        self.grad_wire = grad_wire
        self.wide = False
        self.act: Any = F.relu  # the experts' activation (fused_step sets it)
        self.routing: Optional[Routing] = None
        self.logits: Optional[Tensor] = None
        # routed by the layer (``routed_step``): the chosen experts; the Function's second input is
        # then the gates [T, k] (differentiable) in place of the gate weight
        self.selected_idx: Optional[Tensor] = None
        # the experts' (w1, w2) made again for the backward, in place of saving the forward's:
        # weights stacked per call from separate parameters then live only while used
        self.weights: Optional[Callable[[], tuple]] = None
        if capacity is not None:  # the padded layout: num_local * capacity rows to and from every rank
            self.send_splits = self.recv_splits = [num_local * capacity] * self.world

    def exchange(self, rows: Tensor, to_experts: bool) -> Tensor:
        """The all-to-all from the tokens' side to the experts' (``to_experts``) or back."""
        if self.world == 1:
            return rows
        if self.capacity is not None and self.algorithm == "flat":
            # equal blocks on every rank (the capacity is agreed): torch's equal split, which a
            # backend can check where the rows land instead of agreeing first (the peer backend)
            rows = rows.contiguous()
            out = torch.empty_like(rows)
            self.comm.all_to_all_single(out, rows)
            return out
        send, recv = (self.send_splits, self.recv_splits) if to_experts else (self.recv_splits, self.send_splits)
        return self.comm.all_to_all_v(rows.contiguous(), send, recv, algorithm=self.algorithm)[0]

    def dispatch(self, send: Optional[Tensor], x: Tensor, slot_token: Tensor) -> Tensor:
        """The dispatch exchange of the gathered rows, or with an FP8 wire of ``x``'s rows
        gathered straight into packed FP8 (``send`` None then), dequantized on arrival."""
        if self.wire is None:
            return self.exchange(send, True)
        packed = quant.gather_pack_rows(x, slot_token, self.wire, WIRE_BLOCK, use_native=self.use_native)
        return self.comm.all_to_all_v_packed(packed, self.send_splits, self.recv_splits, row_shape=tuple(x.shape[1:]),
                                             dtype=x.dtype, wire_dtype=self.wire, algorithm=self.algorithm)[0]

    def dispatch_backward(self, grad: Tensor) -> Tensor:
        """The dispatch exchange's backward: home in the activation dtype, or in
        ``grad_wire_dtype`` by :func:`moecomm.functional.all_to_all_v_backward`'s rule with an FP8 wire."""
        if self.wire is None:
            return self.exchange(grad, False)
        return all_to_all_v_backward(grad, self.send_splits, self.recv_splits, comm=self.comm, algorithm=self.algorithm,
                                     grad_wire_dtype=self.grad_wire)


def _route(call: StepCall, x: Tensor, wg: Tensor):
    """The router and the dispatch gather of a step (``step_ops``' first call); for a step the
    layer routed (``call.selected_idx``; ``wg`` is then the gates), the slots of its choice
    and the gather, with no logits, scores or loss."""
    ops = unchecked.step_ops(x.device, call.num_experts, call.use_native)
    C = -1 if call.capacity is None else call.capacity
    if call.selected_idx is not None:
        idx = call.selected_idx
        gates, locations, counts, first, token_slots, slot_token, _, slot_gate = unchecked.route_capacity(
            wg.detach(), idx, call.num_experts, C, False, call.use_native)
        send = unchecked.gather_rows(x, slot_token, None, call.use_native) if call.wire is None else None
        return ops, (send, None, None, wg, idx, gates, locations, counts, first, token_slots, slot_token, slot_gate,
                     x.new_zeros((), dtype=gates.dtype))
    call.wide = wide = wide_linear_applies(x, wg)
    return ops, ops.step_route(x, wg, call.k, C, call.normalize, call.gshard, wide, call.wire is None)


def _combine(call: StepCall, back: Tensor, token_slots: Tensor, gates: Tensor, slot_gate: Tensor, x: Tensor):
    """``(y, slot_gate)``: the weighted sum of each token's expert rows (the weights in the row
    kernels' opmath dtype)."""
    if x.dtype == torch.float64:
        gates, slot_gate = gates.double(), slot_gate.double()
    return unchecked.gather_reduce_rows(back, token_slots, gates, call.use_native), slot_gate


def _keep(ctx, call: StepCall, ops, aux: Tensor, b1, b2, *saved: Tensor) -> None:
    """What a step's backward needs: ``saved`` = (x, wg, w1, w2, scores, topv, topi,
    token_slots, slot_token, slot_gate, first_counts, expert input, expert activation, back)."""
    ctx.call, ctx.ops = call, ops
    ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
    if call.weights is not None:  # (w1, w2) made again in the backward: not kept from here to there
        empty = saved[2].new_empty(0)
        saved = saved[:2] + (empty, empty) + saved[4:]
    ctx.save_for_backward(*saved)
    if not call.gshard or call.selected_idx is not None:
        ctx.mark_non_differentiable(aux)


def _combine_backward(ctx, gy: Optional[Tensor]) -> tuple:
    """``(saved tensors, the expert outputs' gradient on the experts' side, the gates')``."""
    saved = ctx.saved_tensors
    if ctx.call.weights is not None:
        with torch.no_grad():
            saved = saved[:2] + tuple(ctx.call.weights()) + saved[4:]
    topv, token_slots, slot_token, slot_gate, back = saved[5], saved[7], saved[8], saved[9], saved[13]
    gy = back.new_zeros(token_slots.shape[0], back.shape[1]) if gy is None else gy.contiguous()
    g_back, g_gates = ctx.ops.step_combine_backward(gy, slot_token, slot_gate, back, token_slots, topv.dtype)
    return saved, ctx.call.exchange(g_back, True), g_gates


def _route_backward(ops, call: StepCall, g_send, token_slots, g_gates, topv, topi, scores, first, gaux, x, wg,
                    need: tuple) -> tuple:
    T, E = scores.shape
    aux_grad = gaux if call.gshard and gaux is not None and T else None
    return ops.step_route_backward(g_send, token_slots, g_gates, topv, topi, scores, call.normalize, aux_grad, first,
                                   E / (T * T) if T else 1.0, x, wg, call.wide, need[1], need[2])


def _backward_tail(call: StepCall, ops, saved: tuple, g_gates: Tensor, g_got, gw1, gb1, gw2, gb2, need: tuple,
                   gaux) -> tuple:
    """The dispatch's and the router's backward after the experts': the gradients of
    ``(call, x, wg, w1, b1, w2, b2)`` (``need`` in that order)."""
    x, wg, _, _, scores, topv, topi, token_slots = saved[:8]
    first = saved[10]
    g_send = call.dispatch_backward(g_got) if need[1] else None
    if call.selected_idx is not None:  # routed by the layer: the gates' gradient; autograd takes it on
        gx = unchecked.gather_reduce_rows(g_send, token_slots, None, call.use_native) if need[1] else None
        return None, gx, g_gates if need[2] else None, gw1, gb1, gw2, gb2
    gx, gwg = _route_backward(ops, call, g_send, token_slots, g_gates, topv, topi, scores, first, gaux, x, wg, need)
    return None, gx, gwg, gw1, gb1, gw2, gb2


class _CapacityStep(torch.autograd.Function):
    """The capacity step: the experts over the padded layout, their ops in C++ (``step_ffn``)
    for ReLU, else the grouped FFN of :mod:`~moecomm.moe.experts` (any activation, gated ones
    too; the same functions as the op-by-op path, so the same bits)."""

    @staticmethod
    def forward(ctx, call: StepCall, x, wg, w1, b1, w2, b2):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        C, El = call.capacity, call.num_local
        ops, (send, logits, scores, topv, topi, gates, locations, counts, first, token_slots, slot_token, slot_gate,
              aux) = _route(call, x, wg)
        got = call.dispatch(send, x, slot_token)
        if call.act is F.relu:
            rows_expert = call.consts.row_expert(call.world, El, C, x.device) if b1 is not None or b2 is not None \
                else None
            h, ye = ops.step_ffn(got, w1, b1, w2, b2, rows_expert, El, C)
        else:  # any other activation (gated ones too): the grouped FFN over the padded layout
            ctx.seg = Segments.uniform_blocks(call.world, El, C, consts=call.consts)
            ye, h = ffn_forward(got, w1, b1, w2, b2, ctx.seg, call.act, 1.0)
        back = call.exchange(ye, False)
        y, slot_gate = _combine(call, back, token_slots, gates, slot_gate, x)
        call.routing, call.logits = Routing(topi, gates, locations, counts, C), logits
        _keep(ctx, call, ops, aux, b1, b2, x, wg, w1, w2, scores, topv, topi, token_slots, slot_token, slot_gate, first,
              got, h, back)
        return y, aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, gaux):  # type: ignore[override]
        saved, g_ye, g_gates = _combine_backward(ctx, gy)
        x, wg, w1, w2, scores, topv, topi, token_slots, _, _, first, got, h, _ = saved
        call, ops = ctx.call, ctx.ops
        need = ctx.needs_input_grad  # (call, x, wg, w1, b1, w2, b2)
        if call.act is not F.relu:
            g_got, gw1, gb1, gw2, gb2 = ffn_backward(g_ye, got, h, w1, w2, ctx.seg, call.act,
                                                     (need[1], need[3], need[4], need[5], need[6]), ctx.has_b1,
                                                     ctx.has_b2)
            return _backward_tail(call, ops, saved, g_gates, g_got, gw1, gb1, gw2, gb2, need, gaux)
        ones = None  # the bias gradients by a bfloat16 GEMM with ones (as _seg_gemm.seg_sum)
        if (ctx.has_b1 or ctx.has_b2) and g_ye.dtype == torch.bfloat16 and wide_gemm_available(g_ye.device):
            ones = call.consts.ones(g_ye.shape[0], g_ye.dtype, g_ye.device)
        g_got, gw1, gb1, gw2, gb2 = ops.step_ffn_backward(g_ye, h, got, w1, w2, ctx.has_b1, ctx.has_b2,
                                                          [need[1], need[3], need[4], need[5], need[6]],
                                                          call.num_local, call.capacity, ones)
        return _backward_tail(call, ops, saved, g_gates, g_got, gw1, gb1, gw2, gb2, need, gaux)


class _DroplessStep(torch.autograd.Function):
    """The dropless step: every route sent, the experts' grouped GEMMs over the received
    counts (:func:`~moecomm.moe.experts.ffn_forward`), after the step's one host
    synchronisation (the counts, for the exchanges' split sizes and the segments); on one
    rank none where the grouped GEMMs run (the counts stay on the device)."""

    @staticmethod
    def forward(ctx, call: StepCall, experts: FFNExperts, x, wg, w1, b1, w2, b2):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        W, El = call.world, call.num_local
        ops, (send, logits, scores, topv, topi, gates, locations, counts, first, token_slots, slot_token, slot_gate,
              aux) = _route(call, x, wg)
        if W > 1:
            recv_counts = call.comm.all_to_all_v(counts, [El] * W, [El] * W)[0]
            host = torch.cat([counts, recv_counts]).tolist()  # the step's one host synchronisation
            mine, theirs = host[:W * El], host[W * El:]
            check_received_counts(theirs, call.comm, El)
            blocks = [theirs[w * El:(w + 1) * El] for w in range(W)]
            call.send_splits = [sum(mine[w * El:(w + 1) * El]) for w in range(W)]
            call.recv_splits = [sum(b) for b in blocks]
            seg = Segments(blocks, El, counts_dev=recv_counts.view(W, El))
        else:  # every route stays here: the rows are known, the experts' counts stay on the device (no sync)
            call.send_splits = call.recv_splits = [slot_token.shape[0]]
            seg = Segments.on_device(counts.view(1, El), call.send_splits, El)
        got = call.dispatch(send, x, slot_token)
        ye, kept = ffn_forward(got, w1, b1, w2, b2, seg, call.act, 1.0)
        back = call.exchange(ye, False)
        y, slot_gate = _combine(call, back, token_slots, gates, slot_gate, x)
        call.routing, call.logits = Routing(topi, gates, locations, counts, None), logits
        ctx.seg = seg
        _keep(ctx, call, ops, aux, b1, b2, x, wg, w1, w2, scores, topv, topi, token_slots, slot_token, slot_gate, first,
              got, kept, back)
        return y, aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, gaux):  # type: ignore[override]
        saved, g_ye, g_gates = _combine_backward(ctx, gy)
        x, wg, w1, w2, scores, topv, topi, token_slots, _, _, first, got, kept, _ = saved
        call, ops = ctx.call, ctx.ops
        need = ctx.needs_input_grad  # (call, experts, x, wg, w1, b1, w2, b2)
        g_got, gw1, gb1, gw2, gb2 = ffn_backward(g_ye, got, kept, w1, w2, ctx.seg, call.act,
                                                 (need[2], need[4], need[5], need[6], need[7]), ctx.has_b1, ctx.has_b2)
        return (None,) + _backward_tail(call, ops, saved, g_gates, g_got, gw1, gb1, gw2, gb2, need[1:], gaux)


def routed_step(call: StepCall, x: Tensor, gates: Tensor, topk_idx: Tensor, experts: FFNExperts) -> Tensor:
    """``y`` of one step whose routing the layer made (any router: ``gates`` ``[T, k]``
    differentiable, ``topk_idx`` ``[T, k]`` int64): the slots, dispatch, experts and combine
    as in :func:`fused_step`, the gates' gradient handed to autograd (through the layer's
    router). ``call.routing`` is set."""
    call.selected_idx = topk_idx
    params = (experts.fc1_weight, experts.fc1_bias, experts.fc2_weight, experts.fc2_bias)
    call.act = experts.act
    if call.capacity is None:
        return _DroplessStep.apply(call, experts, x, gates, *params)[0]
    return _CapacityStep.apply(call, x, gates, *params)[0]


def fused_step(call: StepCall, x: Tensor, wg: Tensor, experts: FFNExperts) -> tuple[Tensor, Tensor]:
    """``(y, aux)`` of one step of ``[T, model_dim]`` tokens ``x`` (``aux`` the GShard loss, or
    a zero without a graph when the call has none); ``call.routing`` and ``call.logits`` are set."""
    params = (experts.fc1_weight, experts.fc1_bias, experts.fc2_weight, experts.fc2_bias)
    call.act = experts.act
    if call.capacity is None:
        return _DroplessStep.apply(call, experts, x, wg, *params)
    return _CapacityStep.apply(call, x, wg, *params)
