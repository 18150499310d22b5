"""Slot maps of MoE dispatch/combine: a token -> slot map ``[T, K]``, its inverse slot ->
token map ``[M]``, and the check that two given maps are inverse of each other."""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from ._checks import in_range, index_arg

__all__ = ["invert_slots", "slot_positions", "check_slot_pair"]


def _check_token_slots(fn: str, token_slots: object, num_slots: int) -> Tensor:
    token_slots = index_arg(fn, "token_slots", token_slots, 2, "[T, K]")
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
        raise ValueError(f"{fn}: argument 'num_slots' must be a non-negative int; got {num_slots!r}")
    in_range(fn, "token_slots", token_slots, num_slots, "num_slots")
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

    Raises:
        TypeError: ``token_slots`` is not an int64 tensor.
        ValueError: ``token_slots`` is not 2-D, ``num_slots`` is not an int >= 0, an entry
            lies outside ``[-1, num_slots)``, or a slot is listed more than once.
    """
    token_slots = _check_token_slots("invert_slots", token_slots, num_slots)
    return reference.invert_slots(token_slots, num_slots)


def slot_positions(token_slots: Tensor, num_slots: int) -> Tensor:
    """Companion of :func:`invert_slots`: each slot's position in ``token_slots``.

    Returns ``[M]`` int64 with ``t * K + j`` for the slot ``token_slots[t, j]``,
    ``-1`` for empty slots, so ``gather_rows(w.reshape(-1, 1), pos)`` gives each
    slot's weight ``w[t, j]`` (``slot_token == pos // K`` where ``pos >= 0``).

    Raises:
        TypeError, ValueError: as :func:`invert_slots`.
    """
    token_slots = _check_token_slots("slot_positions", token_slots, num_slots)
    return reference.slot_positions(token_slots, num_slots)


def check_slot_pair(fn: str, slot_token: Tensor, token_slots: Tensor) -> None:
    """slot_token and token_slots must be inverse maps of each other."""
    T, K = token_slots.shape
    M = slot_token.shape[0]
    in_range(fn, "slot_token", slot_token, T, "T = token_slots.shape[0]")
    in_range(fn, "token_slots", token_slots, M, "M = slot_token.shape[0]")
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
