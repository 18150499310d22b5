"""Top-k routing: expert choices, gate weights, queue positions, capacity and slot maps.

Everything here runs on the tokens' device without host synchronisation, except where a
capacity must be agreed between ranks (``capacity_factor <= 0``) and the dropless count
exchange, which the layer does.

Queue positions follow Tutel's convention: all first choices queue before all second
choices, and so on; within one choice level tokens queue in token order, or by
decreasing top score with ``batch_prioritized`` (ties broken by token index). A route is
kept when its position is below the capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ._ops.step_cache import StepConstants

__all__ = ["Routing", "route", "top_k", "fixed_capacity", "SlotMap", "capacity_slots", "dropless_slots",
           "pipelined_capacity_slots", "chunk_sizes"]


@dataclass
class Routing:
    """The routing decisions for ``T`` tokens and ``k`` choices each."""

    topk_idx: Tensor
    """``[T, k]`` int64 chosen experts, best first."""
    gates: Tensor
    """``[T, k]`` gate weights (renormalised over the k choices when asked); differentiable."""
    locations: Tensor
    """``[T, k]`` int64 position of each route in its expert's queue on this rank."""
    counts: Tensor
    """``[E]`` int64 routes per expert on this rank (before any drop)."""
    capacity: Optional[int] = None
    """Slots per expert per source rank, or None (dropless)."""
    kept: Optional[Tensor] = None
    """``[T, k]`` bool: the route fits the capacity (all True when dropless)."""


def _consts(consts: Optional[StepConstants]) -> StepConstants:
    return consts if consts is not None else StepConstants()


def top_k(scores: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """``(gates [T, k], topk_idx [T, k] int64)``: each token's ``k`` best experts by ``scores``
    and their scores, divided by their sum (at least eps) when ``normalize`` and ``k > 1``."""
    if scores.shape[0]:
        gates, topk_idx = torch.topk(scores, k, dim=1)  # the values are scores.gather(1, topk_idx)
    else:
        topk_idx = torch.empty(0, k, dtype=torch.int64, device=scores.device)
        gates = scores.gather(1, topk_idx)
    if normalize and k > 1:
        denom = gates.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
        gates = gates / denom
    return gates, topk_idx


def route(scores: Tensor, k: int, *, batch_prioritized: bool = False, normalize: bool = True,
          consts: Optional[StepConstants] = None, selected: Optional[tuple[Tensor, Tensor]] = None) -> Routing:
    """Choose ``k`` experts per token from ``scores`` (``[T, E]`` probabilities), or take the
    choice ``selected`` = ``(gates [T, k], topk_idx [T, k])`` made already (then ``scores``
    serves the batch priority only and ``normalize`` is not applied).

    No one-hot matrices: positions come from one stable sort of the ``k*T`` expert ids, so
    the cost per route is the same for any ``k``. ``consts``: a cache of the constant
    index tensors (a layer keeps one), else they are made afresh.
    """
    T, E = scores.shape
    dev = scores.device
    cc = _consts(consts)
    gates, topk_idx = selected if selected is not None else top_k(scores, k, normalize)
    if batch_prioritized and T:
        order = torch.sort(-scores.detach().max(dim=1).values, stable=True).indices  # tokens, best first
        prio = topk_idx.index_select(0, order)
    else:
        order = None
        prio = topk_idx
    # Queue order: expert, then choice level j, then token (in priority order). One stable
    # sort of the token-major routes by the key e * k + j gives exactly that order.
    flat = prio.reshape(-1)  # route r = i * k + j
    N = flat.numel()
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat, cc.ones(N, torch.int64, dev))
    offsets = torch.cumsum(counts, 0) - counts
    key = torch.add(cc.arange(k, dev), prio, alpha=k).view(-1) if k > 1 else flat  # e * k + j
    # narrow keys: the radix sort makes one pass per key byte
    span = E * k
    key = key.to(torch.int16) if span <= 2 ** 15 else (key.to(torch.int32) if span <= 2 ** 31 else key)
    perm = torch.sort(key, stable=True).indices
    pos = torch.empty_like(flat).scatter_(0, perm, cc.arange(N, dev))
    loc_prio = (pos - offsets.index_select(0, flat)).view(T, k)
    if order is None:
        locations = loc_prio
    else:
        locations = torch.empty_like(loc_prio).index_copy_(0, order, loc_prio)
    return Routing(topk_idx=topk_idx, gates=gates, locations=locations, counts=counts)


def fixed_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Tutel's capacity for ``|capacity_factor|``: ``k * int(|f| * ceil(T / E))``."""
    per_expert = (num_tokens + num_experts - 1) // num_experts
    return k * int(abs(capacity_factor) * per_expert)


def chunk_sizes(n: int, degree: int) -> list[int]:
    """``n`` split into ``degree`` near-equal parts, larger ones first (as ``tensor_split``)."""
    base, extra = divmod(n, degree)
    return [base + (1 if c < extra else 0) for c in range(degree)]


@dataclass
class SlotMap:
    """Where each kept route goes in the send buffer, and back.

    The send buffer is ``degree`` chunks one after the other; chunk ``c`` holds, expert by
    expert (and shard by shard for sharded experts), ``n[c, e]`` rows of expert ``e``: so
    each chunk is ordered by destination rank, ready for an all-to-all.
    """

    token_slots: Tensor
    """``[T, k*S]`` int64 slot of each route copy (``-1``: dropped)."""
    slot_route: Tensor
    """``[N]`` int64 flat index ``t*k*S + m`` into ``token_slots`` of each slot's route (``-1``: empty)."""
    slot_token: Tensor
    """``[N]`` int64 token of each slot (``-1``: empty)."""
    num_slots: int
    per_chunk_expert: Optional[Tensor] = None
    """``[degree, E]`` int64 rows per chunk and expert (per shard), where computed."""


def _slots(idx: Tensor, q: Tensor, chunk: Tensor, keep: Optional[Tensor], n: Tensor, shards: int,
           num_slots: int, consts: Optional[StepConstants] = None) -> SlotMap:
    """slot(t, j, s) = B[c] + S * P[c, e] + s * n[c, e] + q  (see :class:`SlotMap`)."""
    T, k = idx.shape
    d, E = n.shape
    S = shards
    dev = idx.device
    rows_c = n.sum(1) * S
    base_c = torch.cumsum(rows_c, 0) - rows_c
    prefix = torch.cumsum(n, 1) - n  # [d, E]
    flat_ce = chunk * E + idx  # [T, k]
    start = base_c.index_select(0, chunk.reshape(-1)).view(T, k) + S * prefix.reshape(-1).index_select(
        0, flat_ce.reshape(-1)).view(T, k) + q
    n_route = n.reshape(-1).index_select(0, flat_ce.reshape(-1)).view(T, k)
    s = torch.arange(S, device=dev).view(1, 1, S)
    slots = start.unsqueeze(2) + s * n_route.unsqueeze(2)  # [T, k, S]
    return _finish(slots, keep, num_slots, n, consts)


def _finish(slots: Tensor, keep: Optional[Tensor], num_slots: int, n: Optional[Tensor],
            consts: Optional[StepConstants] = None) -> SlotMap:
    """Slot map from the ``[T, k, S]`` slots of every route copy (``keep``: False = dropped)."""
    T, k, S = slots.shape
    dev = slots.device
    if keep is not None:
        keep = keep.unsqueeze(2)
        token_slots = torch.where(keep, slots, -1).view(T, k * S)
        # inverse map without host syncs: dropped routes write into a discarded extra slot
        target = torch.where(keep, slots, num_slots).view(-1)
    else:
        token_slots = slots.reshape(T, k * S)
        target = token_slots.reshape(-1)
    slot_route = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=dev)
    slot_route.scatter_(0, target, _consts(consts).arange(target.numel(), dev))
    slot_route = slot_route[:num_slots]
    # empty slots (-1) stay -1: floor(-1 / kS) = -1
    slot_token = torch.div(slot_route, max(k * S, 1), rounding_mode="floor")
    return SlotMap(token_slots, slot_route, slot_token, num_slots, n)


def capacity_slots(r: Routing, capacity: int, num_experts: int, shards: int, degree: int = 1,
                   consts: Optional[StepConstants] = None) -> SlotMap:
    """Padded layout: every expert gets exactly ``capacity`` slots (split into ``degree``
    chunks along the capacity); routes at or past the capacity are dropped."""
    dev = r.topk_idx.device
    loc = r.locations
    keep = loc < capacity
    r.kept = keep
    if degree == 1 or capacity == 0:
        chunk = torch.zeros_like(loc)
        q = torch.where(keep, loc, torch.zeros_like(loc))
        n = torch.full((1, num_experts), capacity, dtype=torch.int64, device=dev)
        if degree > 1:
            n = n.expand(degree, num_experts).contiguous()
    else:  # chunk c holds positions [start_c, start_c + size_c); the first `extra` chunks are one longer
        base, extra = divmod(capacity, degree)
        safe = torch.where(keep, loc, torch.zeros_like(loc))
        big = extra * (base + 1)
        in_big = safe < big
        chunk = torch.where(in_big, torch.div(safe, base + 1, rounding_mode="floor"),
                            extra + torch.div(safe - big, max(base, 1), rounding_mode="floor"))
        q = torch.where(in_big, safe - chunk * (base + 1), safe - big - (chunk - extra) * base)
        c_idx = torch.arange(degree, device=dev).view(degree, 1)
        n = (base + (c_idx < extra).to(torch.int64)).expand(degree, num_experts).contiguous()
    return _slots(r.topk_idx, q, chunk, keep, n, shards, num_experts * shards * capacity, consts)


def dropless_slots(r: Routing, shards: int, degree: int, consts: Optional[StepConstants] = None) -> SlotMap:
    """Exact layout: expert ``e`` gets its ``counts[e]`` routes, split into ``degree`` chunks."""
    loc = r.locations
    T, k = loc.shape
    counts = r.counts
    r.kept = torch.ones_like(loc, dtype=torch.bool)
    if degree == 1:
        n = counts.view(1, -1)
        chunk = torch.zeros_like(loc)
        q = loc
    else:
        base = torch.div(counts, degree, rounding_mode="floor")
        extra = counts - base * degree
        c_idx = torch.arange(degree, device=loc.device).view(degree, 1)
        n = base.view(1, -1) + (c_idx < extra.view(1, -1)).to(torch.int64)  # [d, E]
        b = base.index_select(0, r.topk_idx.reshape(-1)).view_as(loc)
        x = extra.index_select(0, r.topk_idx.reshape(-1)).view_as(loc)
        big = x * (b + 1)  # rows in the first x chunks (each b + 1 long)
        in_big = loc < big
        chunk = torch.where(in_big, torch.div(loc, b + 1, rounding_mode="floor"),
                            x + torch.div(loc - big, b.clamp(min=1), rounding_mode="floor"))
        q = torch.where(in_big, loc - chunk * (b + 1), loc - big - (chunk - x) * b)
    return _slots(r.topk_idx, q, chunk, None, n, shards, shards * k * T, consts)


def pipelined_capacity_slots(r: Routing, capacity: int, num_experts: int, shards: int, degree: int,
                             experts_per_rank: int, consts: Optional[StepConstants] = None) -> SlotMap:
    """Padded layout for a pipelined all-to-all: the block for each destination rank holds
    ``degree`` equal chunks along the capacity (``ceil(capacity / degree)`` slots per expert
    each; the slots past ``capacity`` stay empty), each chunk expert by expert. Cutting every
    block into ``degree`` equal pieces (as ``scatter_compute_gather`` does) then gives every
    stage the same number of slots per expert. With ``degree == 1`` this is the plain
    capacity layout of :func:`capacity_slots`."""
    d, S = degree, shards
    El = experts_per_rank if S == 1 else 1
    Cc = -(-capacity // d) if capacity else 0
    dev = r.topk_idx.device
    loc = r.locations
    keep = loc < capacity
    r.kept = keep
    if d == 1 and S == 1:  # the common case in few ops: slot = e * C + position
        return _finish(torch.add(loc, r.topk_idx, alpha=capacity).unsqueeze(2), keep, num_experts * capacity, None,
                       consts)
    safe = torch.where(keep, loc, torch.zeros_like(loc))
    c = torch.div(safe, max(Cc, 1), rounding_mode="floor")
    q = safe - c * Cc
    e = r.topk_idx
    if S == 1:
        dest = torch.div(e, El, rounding_mode="floor")
        slots = (dest * (d * El * Cc) + c * (El * Cc) + (e - dest * El) * Cc + q).unsqueeze(2)
        W = num_experts // El
    else:
        dest = e.unsqueeze(2) * S + torch.arange(S, device=dev).view(1, 1, S)
        slots = dest * (d * Cc) + (c * Cc + q).unsqueeze(2)
        W = num_experts * S
    n = torch.full((d, num_experts), Cc, dtype=torch.int64, device=dev)
    return _finish(slots, keep, W * d * El * Cc, n, consts)
