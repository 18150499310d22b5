"""Pure-torch reference implementations of the moecomm_ext kernels.

These define the semantics that the native kernels must reproduce, run on any
device and dtype torch supports, and are differentiable through ordinary torch
autograd (the tests use that as an independent check of the hand-written
backward passes).  They do no argument validation: call them through the
public API, or with inputs that already satisfy its contracts.

Conventions shared with the native kernels:

* an index entry of ``-1`` means "no row": a zero row in :func:`gather_rows`,
  a skipped term in :func:`gather_reduce_rows`, a ``0`` in :func:`gather_rowdot`;
* arithmetic happens in the *opmath* dtype (:func:`opmath_dtype`): float32 for
  float16/bfloat16/float32 inputs, float64 for float64 inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "opmath_dtype",
    "gather_rows",
    "gather_reduce_rows",
    "gather_rowdot",
    "dispatch",
    "combine",
    "invert_slots",
    "slot_positions",
    "route_capacity",
    "route_backward",
    "step_route",
    "step_ffn",
    "seg_row_expert",
    "seg_bias_act",
    "seg_colsum",
    "step_combine_backward",
    "step_ffn_backward",
    "step_route_backward",
]


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, float32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _take_rows(src: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """``src[index]`` with ``-1`` entries pointing at row 0 (or an empty
    source), plus the validity mask.  Shape ``[*index.shape, *src.shape[1:]]``."""
    valid = index >= 0
    flat = index.reshape(-1)
    if src.shape[0] == 0:
        rows = src.new_zeros((flat.numel(), *src.shape[1:]))
    else:
        rows = src.index_select(0, flat.clamp(min=0))
    return rows.reshape(*index.shape, *src.shape[1:]), valid


def gather_rows(x: Tensor, index: Tensor, scale: Tensor | None = None) -> Tensor:
    """``out[i] = x[index[i]] * scale[i]`` (zero row where ``index[i] == -1``).

    x: ``[N, D]`` any dtype (floating when ``scale`` is given); index: ``[M]``
    int64; scale: ``[M]`` floating or None.  Returns ``[M, D]`` in ``x.dtype``.
    """
    rows, valid = _take_rows(x, index)
    mask = valid.unsqueeze(-1)
    if scale is None:
        return torch.where(mask, rows, torch.zeros((), dtype=x.dtype, device=x.device))
    op = opmath_dtype(x.dtype)
    out = rows.to(op) * scale.to(op).unsqueeze(-1)
    return torch.where(mask, out, torch.zeros((), dtype=op, device=x.device)).to(x.dtype)


def gather_reduce_rows(y: Tensor, index: Tensor, weight: Tensor | None = None) -> Tensor:
    """``out[t] = sum_j weight[t, j] * y[index[t, j]]`` over ``index[t, j] != -1``.

    y: ``[M, D]`` floating; index: ``[T, K]`` int64; weight: ``[T, K]`` floating
    or None (all ones).  Accumulates in opmath; returns ``[T, D]`` in ``y.dtype``.
    """
    op = opmath_dtype(y.dtype)
    rows, valid = _take_rows(y, index)  # [T, K, D]
    rows = torch.where(valid.unsqueeze(-1), rows.to(op), torch.zeros((), dtype=op, device=y.device))
    if weight is not None:
        rows = rows * weight.to(op).unsqueeze(-1)
    return rows.sum(dim=1).to(y.dtype)


def gather_rowdot(a: Tensor, b: Tensor, index: Tensor) -> Tensor:
    """``out[t, j] = dot(a[t], b[index[t, j]])`` (0 where ``index[t, j] == -1``).

    a: ``[T, D]``, b: ``[M, D]`` of one floating dtype; index: ``[T, K]`` int64.
    Returns ``[T, K]`` in opmath (float32, or float64 for float64 inputs).
    """
    op = opmath_dtype(a.dtype)
    rows, valid = _take_rows(b, index)  # [T, K, D]
    rows = torch.where(valid.unsqueeze(-1), rows.to(op), torch.zeros((), dtype=op, device=b.device))
    return torch.einsum("td,tkd->tk", a.to(op), rows)


def dispatch(
    x: Tensor, slot_token: Tensor, token_slots: Tensor, slot_scale: Tensor | None = None
) -> Tensor:
    """MoE dispatch: ``out[m] = x[slot_token[m]] * slot_scale[m]``; ``[M, D]``.
    ``token_slots`` is unused here (torch autograd needs no inverse map)."""
    del token_slots
    return gather_rows(x, slot_token, slot_scale)


def combine(
    y: Tensor, token_slots: Tensor, token_weight: Tensor | None, slot_token: Tensor
) -> Tensor:
    """MoE combine: ``out[t] = sum_j token_weight[t, j] * y[token_slots[t, j]]``;
    ``[T, D]``.  ``slot_token`` is unused here."""
    del slot_token
    return gather_reduce_rows(y, token_slots, token_weight)


def invert_slots(token_slots: Tensor, num_slots: int) -> Tensor:
    """slot -> token map (``-1`` for empty slots) of a ``[T, K]`` token -> slot map."""
    T, K = token_slots.shape
    out = torch.full((num_slots,), -1, dtype=torch.int64, device=token_slots.device)
    valid = token_slots >= 0
    tokens = torch.arange(T, device=token_slots.device).unsqueeze(1).expand(T, K)
    out[token_slots[valid]] = tokens[valid]
    return out


def slot_positions(token_slots: Tensor, num_slots: int) -> Tensor:
    """slot -> flat position ``t * K + j`` in ``token_slots`` (``-1`` if empty)."""
    out = torch.full((num_slots,), -1, dtype=torch.int64, device=token_slots.device)
    flat = token_slots.reshape(-1)
    valid = flat >= 0
    out[flat[valid]] = torch.arange(flat.numel(), device=token_slots.device)[valid]
    return out


def _denominator(v: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum, max(sum, eps))`` of each row of ``v`` ``[T, k]``, summed left to right."""
    s = v[:, 0]
    for j in range(1, v.shape[1]):
        s = s + v[:, j]
    s = s.unsqueeze(1)
    return s, s.clamp(min=torch.finfo(v.dtype).eps)


def route_capacity(topk_scores: Tensor, topk_idx: Tensor, num_experts: int, capacity: int,
                   normalize: bool = True) -> tuple[Tensor, ...]:
    """Capacity routing of ``T`` tokens' ``k`` choices (see :func:`moecomm_ext.route_capacity`;
    ``capacity=-1``: :func:`moecomm_ext.route_dropless`).

    Returns ``(gates, locations, counts, first_counts, token_slots, slot_token, slot_route,
    slot_gate)``. Queue positions come from one stable sort of the routes by ``(expert,
    choice level)``: every first choice queues before every second choice, each level in
    token order.
    """
    T, k = topk_idx.shape
    E, C = num_experts, capacity
    dev = topk_idx.device
    if normalize and k > 1:
        gates = topk_scores / _denominator(topk_scores)[1]
    else:
        gates = topk_scores.clone()
    flat = topk_idx.reshape(-1)  # route r = t * k + j
    counts = torch.bincount(flat, minlength=E)[:E] if flat.numel() else torch.zeros(E, dtype=torch.int64, device=dev)
    first = topk_idx[:, 0] if k else flat
    first_counts = (torch.bincount(first, minlength=E)[:E] if first.numel() else
                    torch.zeros(E, dtype=torch.int64, device=dev)).to(topk_scores.dtype)
    key = (topk_idx * k + torch.arange(k, device=dev)).reshape(-1)  # expert-major, then choice level
    perm = torch.sort(key, stable=True).indices
    rank = torch.empty_like(flat)
    rank[perm] = torch.arange(flat.numel(), device=dev)
    start = torch.cumsum(counts, 0) - counts
    locations = (rank - start[flat]).view(T, k)
    if C < 0:  # dropless: every route kept, expert e's slots after every earlier expert's
        M = T * k
        token_slots = start[topk_idx] + locations
    else:
        M = E * C
        token_slots = torch.where(locations < C, topk_idx * C + locations, torch.full_like(locations, -1))
    slot_token = torch.full((M,), -1, dtype=torch.int64, device=dev)
    slot_route = torch.full((M,), -1, dtype=torch.int64, device=dev)
    slot_gate = torch.zeros(M, dtype=topk_scores.dtype, device=dev)
    valid = token_slots.reshape(-1) >= 0
    slots = token_slots.reshape(-1)[valid]
    routes = torch.arange(T * k, device=dev)[valid]
    slot_token[slots] = torch.div(routes, max(k, 1), rounding_mode="floor")
    slot_route[slots] = routes
    slot_gate[slots] = gates.reshape(-1)[valid]
    return gates, locations, counts, first_counts, token_slots, slot_token, slot_route, slot_gate


def route_backward(grad_gates: Tensor, topk_scores: Tensor, topk_idx: Tensor, scores: Tensor,
                   normalize: bool = True, aux_grad: Tensor | None = None, aux_counts: Tensor | None = None,
                   aux_scale: float = 1.0, split_bf16: bool = False) -> Tensor:
    """The gradient of the router logits (see :func:`moecomm_ext.route_backward`): the gates'
    gradient through the renormalisation and the top-k selection, plus the GShard loss's
    ``(aux_grad * aux_scale) * aux_counts[e]`` on every score of column ``e``, through the
    softmax (``scores`` is its output)."""
    k = topk_idx.shape[1]
    gg = grad_gates
    if normalize and k > 1:
        s, d = _denominator(topk_scores)
        # div's gradients (torch's formulas): grad / d, and -grad * ((v / d) / d) summed over k
        per = -gg * ((topk_scores / d) / d)
        gd = per[:, 0]
        for j in range(1, k):
            gd = gd + per[:, j]
        gd = torch.where(s >= torch.finfo(s.dtype).eps, gd.unsqueeze(1), torch.zeros((), dtype=s.dtype,
                                                                                         device=s.device))
        gtop = gg / d + gd
    else:
        gtop = gg
    gin = torch.zeros_like(scores).scatter_(1, topk_idx, gtop)
    if aux_grad is not None:
        gin = gin + (aux_grad * aux_scale) * aux_counts
    dot = (gin * scores).sum(1, keepdim=True)
    gl = scores * (gin - dot)
    if not split_bf16:
        return gl
    hi = gl.to(torch.bfloat16)
    return torch.cat([hi, (gl - hi.to(gl.dtype)).to(torch.bfloat16)], dim=1)


# -- the fused capacity step's glue (moecomm_ext/_step.py): the native module issues the same
# operations from C++ (csrc/step.cpp) ---------------------------------------------------------

def step_route(x: Tensor, wg: Tensor, k: int, capacity: int, normalize: bool, gshard: bool,
               wide: bool, gather: bool = True) -> list:
    """The router and the dispatch gather: ``[send, logits, scores, topk_scores, topk_idx, gates,
    locations, counts, first_counts, token_slots, slot_token, slot_gate, aux]`` (``send`` None
    without ``gather``). ``wide``: the float32 logits of bfloat16 operands by
    ``torch.mm(..., out_dtype=torch.float32)``; ``capacity=-1``: dropless."""
    T, E = x.shape[0], wg.shape[0]
    logits = torch.mm(x, wg.t(), out_dtype=torch.float32) if wide else torch.mm(x.float(), wg.float().t())
    scores = torch.softmax(logits, 1)
    if T:
        topv, topi = torch.topk(scores, k, dim=1)
    else:
        topv, topi = scores.new_empty(0, k), torch.empty(0, k, dtype=torch.int64, device=x.device)
    gates, loc, counts, first, token_slots, slot_token, _, slot_gate = route_capacity(topv, topi, E, capacity,
                                                                                      normalize)
    if not gshard:
        aux = scores.new_zeros(())
    elif T:
        aux = (scores.sum(0) * first).sum() * (E / (T * T))
    else:
        aux = scores.sum() * 0.0
    send = gather_rows(x, slot_token) if gather else None
    return [send, logits, scores, topv, topi, gates, loc, counts, first, token_slots, slot_token, slot_gate, aux]


def _block_mm(x: Tensor, w: Tensor, bias: Tensor | None, row_expert: Tensor | None, El: int, C: int,
              transpose_w: bool = False) -> Tensor:
    wt = w.transpose(1, 2) if transpose_w else w
    R, B = x.shape[0], wt.shape[2]
    if C == 0:
        return torch.empty(R, B, dtype=x.dtype, device=x.device)
    xb = x.view(-1, El, C, x.shape[1])
    if bias is not None:  # every row starts as its expert's bias
        out = gather_rows(bias, row_expert)
        ob = out.view(-1, El, C, B)
        for b in range(xb.shape[0]):
            ob[b].baddbmm_(xb[b], wt)
        return out
    out = torch.empty(R, B, dtype=x.dtype, device=x.device)
    ob = out.view(-1, El, C, B)
    for b in range(xb.shape[0]):
        torch.bmm(xb[b], wt, out=ob[b])
    return out


def _block_wgrad(a: Tensor, g: Tensor, El: int, C: int) -> Tensor:
    A, B = a.shape[1], g.shape[1]
    if C == 0 or a.shape[0] == 0:
        return torch.zeros(El, A, B, dtype=a.dtype, device=a.device)
    ab, gb = a.view(-1, El, C, A), g.view(-1, El, C, B)
    out = torch.bmm(ab[0].transpose(1, 2), gb[0])
    for b in range(1, ab.shape[0]):
        out.baddbmm_(ab[b].transpose(1, 2), gb[b])
    return out


def _block_sum(g: Tensor, El: int, C: int, ones: Tensor | None) -> Tensor:
    B = g.shape[1]
    if C == 0 or g.shape[0] == 0:
        return torch.zeros(El, B, dtype=g.dtype, device=g.device)
    acc = opmath_dtype(g.dtype)
    if ones is not None:
        blocks = g.view(-1, C, B)
        nb = blocks.shape[0]
        sums = torch.bmm(ones.view(nb, 1, C), blocks, out_dtype=acc)
        return (sums.view(El, B) if nb == El else sums.view(-1, El, B).sum(0)).to(g.dtype)
    return g.view(-1, El, C, B).sum(dim=(0, 2), dtype=acc).to(g.dtype)


def step_ffn(rows: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
             row_expert: Tensor | None, num_local: int, capacity: int) -> list:
    """The built-in experts on ``blocks`` uniform blocks of ``[num_local][capacity]`` rows:
    ``[h, y]`` with ``h = relu(rows @ w1[e] + b1[e])`` and ``y = h @ w2[e] + b2[e]``;
    ``row_expert``: ``[rows]`` int64 local expert of every row (needed with a bias)."""
    h = _block_mm(rows, w1, b1, row_expert, num_local, capacity).relu_()
    return [h, _block_mm(h, w2, b2, row_expert, num_local, capacity)]


def step_combine_backward(gy: Tensor, slot_token: Tensor, slot_gate: Tensor, back: Tensor, token_slots: Tensor,
                          gate_dtype: torch.dtype) -> list:
    """The combine's backward: ``[the slots' gradient, the gates' gradient]``."""
    return [gather_rows(gy, slot_token, slot_gate), gather_rowdot(gy, back, token_slots).to(gate_dtype)]


def step_ffn_backward(gy: Tensor, h: Tensor, rows: Tensor, w1: Tensor, w2: Tensor, has_b1: bool, has_b2: bool,
                      need: list, num_local: int, capacity: int, ones: Tensor | None) -> list:
    """:func:`step_ffn`'s backward: ``[g_rows, g_w1, g_b1, g_w2, g_b2]`` (None where not
    needed; ``need``: rows, w1, b1, w2, b2). ``ones``: ``[rows]`` ones of the rows' dtype to
    sum the bias gradients with a bfloat16 GEMM, or None."""
    El, C = num_local, capacity
    gw2 = _block_wgrad(h, gy, El, C) if need[3] else None
    gb2 = _block_sum(gy, El, C, ones) if has_b2 and need[4] else None
    gh = torch.ops.aten.threshold_backward(_block_mm(gy, w2, None, None, El, C, True), h, 0)
    gw1 = _block_wgrad(rows, gh, El, C) if need[1] else None
    gb1 = _block_sum(gh, El, C, ones) if has_b1 and need[2] else None
    grows = _block_mm(gh, w1, None, None, El, C, True) if need[0] else None
    return [grows, gw1, gb1, gw2, gb2]


def step_route_backward(grad_send: Tensor | None, token_slots: Tensor, grad_gates: Tensor, topk_scores: Tensor,
                        topk_idx: Tensor, scores: Tensor, normalize: bool, aux_grad: Tensor | None,
                        aux_counts: Tensor, aux_scale: float, x: Tensor, wg: Tensor, wide: bool, need_x: bool,
                        need_wg: bool) -> list:
    """The dispatch's and the router's backward: ``[g_x, g_wg]`` (None where not needed)."""
    gx = gather_reduce_rows(grad_send, token_slots) if need_x else None
    gwg = None
    if not (need_x or need_wg):
        return [gx, gwg]
    gl = route_backward(grad_gates, topk_scores, topk_idx, scores, normalize, aux_grad,
                        aux_counts if aux_grad is not None else None, aux_scale, wide)
    E = wg.shape[0]
    if wide:  # gl: [T, 2E] bfloat16, hi | lo of the float32 gradient
        if need_x:
            gx = gx + torch.mm(gl, torch.cat([wg, wg], dim=0))
        if need_wg:
            both = torch.mm(gl.t(), x, out_dtype=torch.float32)
            gwg = (both[:E] + both[E:]).to(wg.dtype)
    else:
        if need_x:
            gxg = gl.mm(wg.float())
            gx = gx + (gxg if x.dtype == torch.float32 else gxg.to(x.dtype))
        if need_wg:
            gw = gl.t().mm(x.float())
            gwg = gw if wg.dtype == torch.float32 else gw.to(wg.dtype)
    return [gx, gwg]


_GLU_GATES = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
    "relu": torch.relu,
}


def seg_row_expert(ends: Tensor, num_local: int, rows: int) -> Tensor:
    """``[rows]`` int64: the local expert of every row of the segments ``ends`` (int32 segment
    ends, segment ``s`` belonging to expert ``s % num_local``; each end clamped to ``[0, rows]``,
    a segment empty where its ends are reversed), -1 for a row in no segment."""
    e = ends.detach().to(device="cpu", dtype=torch.int64).clamp(0, rows)
    starts = torch.cat([e.new_zeros(1), e[:-1]])
    out = torch.full((rows,), -1, dtype=torch.int64)
    for s in range(e.numel()):
        if e[s] > starts[s]:
            out[int(starts[s]):int(e[s])] = s % num_local
    return out.to(ends.device)


def seg_bias_act(h: Tensor, bias: Tensor, ends: Tensor, relu: bool) -> Tensor:
    """``h`` with ``bias[e]`` added to each row of local expert ``e`` (:func:`seg_row_expert`;
    rows in no segment unchanged), each element rounded once from the opmath sum, then ReLU
    where ``relu``. A new tensor."""
    rows_of = seg_row_expert(ends, bias.shape[0], h.shape[0])
    keep = rows_of >= 0
    out = h.clone()
    sums = (h[keep].to(opmath_dtype(h.dtype)) + bias[rows_of[keep]].to(opmath_dtype(h.dtype))).to(h.dtype)
    out[keep] = sums.relu() if relu else sums
    return out


def seg_colsum(g: Tensor, ends: Tensor, num_local: int) -> Tensor:
    """``[num_local, cols]`` of ``g``'s dtype: the sum of the rows of each local expert's
    segments (:func:`seg_row_expert`), in the opmath dtype, rounded once."""
    rows_of = seg_row_expert(ends, num_local, g.shape[0])
    keep = rows_of >= 0
    acc = torch.zeros(num_local, g.shape[1], dtype=opmath_dtype(g.dtype), device=g.device)
    return acc.index_add_(0, rows_of[keep], g[keep].to(acc.dtype)).to(g.dtype)


def glu_forward(h: Tensor, act: str) -> Tensor:
    """``f(h[:, :H]) * h[:, H:]`` of ``h`` ``[N, 2H]`` (``f`` named by ``act``: ``"silu"``,
    ``"gelu"``, ``"gelu_tanh"`` or ``"relu"``), computed in the opmath dtype, rounded once."""
    H = h.shape[1] // 2
    hf = h.to(opmath_dtype(h.dtype))
    return (_GLU_GATES[act](hf[:, :H]) * hf[:, H:]).to(h.dtype)


def glu_backward(grad: Tensor, h: Tensor, act: str, need_out: bool) -> tuple[Tensor, Tensor | None]:
    """``(grad_h [N, 2H], glu_forward(h) or None)`` for ``grad`` ``[N, H]``, the gradient of
    :func:`glu_forward`'s output (autograd in the opmath dtype, each output rounded once)."""
    H = h.shape[1] // 2
    with torch.enable_grad():
        hf = h.detach().to(opmath_dtype(h.dtype)).requires_grad_(True)
        a = _GLU_GATES[act](hf[:, :H]) * hf[:, H:]
        (gh,) = torch.autograd.grad(a, hf, grad.to(hf.dtype))
    return gh.to(h.dtype), (a.detach().to(h.dtype) if need_out else None)


def router_scores(logits: Tensor, score_function: str) -> Tensor:
    """``[T, E]`` router scores: ``softmax(l)`` over the experts, or per expert ``sigmoid(l)``
    or ``sqrt(softplus(l))`` (Megatron-core's score functions)."""
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    if score_function == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    return torch.nn.functional.softmax(logits, dim=1)


def group_limited_topk(sel: Tensor, k: int, num_groups: int, group_topk: int) -> Tensor:
    """``[T, k]`` int64 experts of the largest ``sel`` (``[T, E]``) within each token's
    ``group_topk`` best groups of ``E / num_groups`` consecutive experts; a group's score is the
    sum of its ``k // group_topk`` largest values (Megatron-core's ``group_limited_topk``)."""
    T, E = sel.shape
    gs = sel.view(T, num_groups, E // num_groups).topk(k // group_topk, dim=-1).values.sum(dim=-1)
    gidx = torch.topk(gs, k=group_topk, dim=-1, sorted=False).indices
    gmask = torch.zeros(T, num_groups, dtype=torch.bool, device=sel.device).scatter_(1, gidx, True)
    emask = gmask.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, E)
    return torch.topk(sel.masked_fill(~emask, float("-inf")), k=k, dim=-1).indices


def select_experts(logits: Tensor, k: int, score_function: str, pre_softmax: bool, normalize: bool,
                   scaling_factor: float | None, num_groups: int | None, group_topk: int | None,
                   expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(gates [T, k], topk_idx [T, k])`` as :func:`moecomm_ext.select_experts` computes them
    (gates differentiable to ``logits``), as torch operations: the top-k of the scores plus
    ``expert_bias`` (within the best groups when ``num_groups``), gates from the unbiased scores
    (softmax after the top-k: of the chosen logits), renormalised (softmax: by
    ``max(sum, eps)``; the others: by ``sum + 1e-20``) when ``normalize`` and ``k > 1``, times
    ``scaling_factor``."""
    def top(sel: Tensor) -> Tensor:
        if num_groups is not None:
            return group_limited_topk(sel, k, num_groups, group_topk)
        return torch.topk(sel, k, dim=1).indices

    if score_function == "softmax" and not pre_softmax:
        idx = top(logits.detach() if expert_bias is None else logits.detach() + expert_bias)
        gates = torch.nn.functional.softmax(logits.gather(1, idx), dim=1)
    else:
        s = router_scores(logits, score_function)
        idx = top(s.detach() if expert_bias is None else s.detach() + expert_bias)
        gates = s.gather(1, idx)
        if normalize and k > 1:
            if score_function == "softmax":
                gates = gates / gates.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
            else:
                gates = gates / (gates.sum(dim=1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        gates = gates * scaling_factor
    return gates, idx
