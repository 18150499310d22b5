"""Helpers shared by the moecomm_ext tests and benchmarks (not part of the API)."""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import invert_slots

__all__ = ["random_routing"]


def random_routing(
    num_tokens: int,
    k: int,
    num_experts: int,
    capacity: int,
    *,
    drop_prob: float = 0.0,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor]:
    """Random top-k routing with a per-expert capacity.

    Each token picks ``k`` distinct experts (``k <= num_experts``); copies
    beyond an expert's ``capacity`` are dropped, and each remaining copy is
    also dropped with probability ``drop_prob``.  Slot ``e * capacity + p`` is
    the p-th kept copy routed to expert e.

    Returns:
        ``(token_slots, slot_token)``: ``[T, k]`` int64 token -> slot map and
        ``[num_experts * capacity]`` int64 slot -> token map (``-1`` = none),
        on ``device``.
    """
    if k > num_experts:
        raise ValueError(f"argument 'k' ({k}) must not exceed 'num_experts' ({num_experts})")
    T = num_tokens
    scores = torch.rand(T, num_experts, generator=generator)
    experts = scores.topk(k, dim=1).indices if k > 0 else torch.empty(T, 0, dtype=torch.int64)
    keep = torch.rand(T, k, generator=generator) >= drop_prob
    flat_e = torch.where(keep, experts, torch.full_like(experts, num_experts)).reshape(-1)
    # position of each copy among the copies sent to its expert (token order)
    order = torch.sort(flat_e, stable=True).indices
    sorted_e = flat_e[order]
    counts = torch.bincount(sorted_e, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(flat_e.numel()) - starts[sorted_e]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    ok = (flat_e < num_experts) & (pos < capacity)
    slots = torch.where(ok, flat_e * capacity + pos, torch.full_like(pos, -1))
    token_slots = slots.reshape(T, k)
    slot_token = invert_slots(token_slots, num_experts * capacity)
    return token_slots.to(device), slot_token.to(device)
