"""How the peer-memory backend cuts one exchange into rounds that fit its buffers.

Every source owns a region of ``cap`` rows in each destination's arena per round
(:mod:`moecomm.backends.p2p`), so an exchange whose largest block between two ranks
exceeds ``cap`` rows moves in rounds: round ``r`` carries rows ``[r * cap, (r + 1) * cap)``
of every block. Each round is collective (every rank writes a header for every peer and
waits for every peer's), so every rank must run the same number of rounds: each computes
the rounds its own blocks need (:func:`rounds_needed`) and the ranks agree on the largest.
The rank's own block never enters a round: it is one device-local copy.

Pure Python on host integers, importable without CUDA (tested on the CPU against a
reference exchange).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = ["Round", "rounds_needed", "round_blocks"]


class Round(NamedTuple):
    """The rows of one round: per peer, a count and the row it starts at (own block: 0)."""

    send: list[int]
    send_displs: list[int]
    recv: list[int]
    recv_displs: list[int]


def rounds_needed(send: Sequence[int], recv: Sequence[int], me: int, cap: int) -> int:
    """Rounds this rank's blocks with its peers need: ``ceil(max(send[p], recv[p]) / cap)``
    over the peers ``p != me`` (0 when it exchanges nothing with any peer).

    Raises:
        ValueError: ``cap`` below 1 (a region smaller than one row).
    """
    if cap < 1:
        raise ValueError(f"cap must be at least one row per region, got {cap}")
    most = max((max(s, r) for p, (s, r) in enumerate(zip(send, recv)) if p != me), default=0)
    return -(-most // cap)


def round_blocks(send: Sequence[int], send_displs: Sequence[int], recv: Sequence[int],
                 recv_displs: Sequence[int], me: int, cap: int, r: int) -> Round:
    """Round ``r``'s share of every peer's block: ``min(cap, max(0, n - r * cap))`` rows from
    row ``displ + r * cap``; the rank's own block (``me``) is left out (0 rows)."""
    def part(counts: Sequence[int], displs: Sequence[int]) -> tuple[list[int], list[int]]:
        rows = [0 if p == me else min(cap, max(0, n - r * cap)) for p, n in enumerate(counts)]
        at = [d + r * cap if n else d for d, n in zip(displs, rows)]
        return rows, at

    s, sd = part(send, send_displs)
    rv, rd = part(recv, recv_displs)
    return Round(s, sd, rv, rd)
