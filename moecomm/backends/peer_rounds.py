"""How the peer-memory backend cuts one exchange into rounds that fit its buffers.

Every source owns a region of ``cap`` rows in each destination's arena per round
(:mod:`moecomm.backends.p2p`), so an exchange whose largest block between two ranks
exceeds ``cap`` rows moves in rounds: round ``r`` carries rows ``[r * cap, (r + 1) * cap)``
of every block. Each round is collective (every rank writes a header for every peer and
waits for every peer's), so every rank must run the same number of rounds: each computes
the rounds its own blocks need (:func:`rounds_needed`) and the ranks agree on the largest.
The rank's own block never enters a round: it is one device-local copy.

Before any row moves the ranks all-gather one *record* each (:func:`agreement_record`):
the call number, the row size, the rounds, whether the peers may write straight into its
output (and where it lies), its counts and displacements, and what the exchange is (its
kind, dtype, row shape and wire dtype as codes: :data:`META_INTS`). Every rank checks the same table
(:func:`disagreement`) and reads from it where its rows go (:func:`direct_destinations`).

Pure Python on host integers, importable without CUDA (tested on the CPU against a
reference exchange).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

__all__ = ["Round", "rounds_needed", "round_blocks", "SHARED_INTS", "META_INTS", "agreement_record", "disagreement",
           "is_direct", "most_rounds", "direct_destinations"]

SHARED_INTS = 9
"""Where a rank's output lies, for peers to map: an IPC handle (8 int64) and a byte offset."""

META_INTS = 4
"""What the exchange is: codes of its kind, dtype, row shape and wire dtype
(:func:`moecomm.engine.tags.exchange_meta`; zeros where the caller gives none)."""

_META_NAMES = ("kind of exchange", "dtype", "row shape", "wire dtype")
_HEAD = 4  # call number, row bytes, rounds, share flag


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


def agreement_record(call: int, row_bytes: int, rounds: int, flag: int, shared: Sequence[int],
                     send: Sequence[int], recv: Sequence[int], recv_displs: Sequence[int],
                     meta: Sequence[int] = (0,) * META_INTS) -> list[int]:
    """This rank's record: ``flag`` 1 (its output is ``shared``), 0 (its blocks from peers
    are small: they go through its regions), -1 (it cannot share its output: every rank
    then goes through the arenas, in rounds); ``shared``: :data:`SHARED_INTS` ints (zeros
    unless ``flag`` is 1); ``meta``: :data:`META_INTS` codes of what the exchange is."""
    if len(shared) != SHARED_INTS:
        raise ValueError(f"shared must hold {SHARED_INTS} ints, got {len(shared)}")
    if len(meta) != META_INTS:
        raise ValueError(f"meta must hold {META_INTS} ints, got {len(meta)}")
    return [call, row_bytes, rounds, flag, *shared, *send, *recv, *recv_displs, *meta]


def disagreement(table: Sequence[Sequence[int]], me: int,
                 meta_words: Optional[Sequence[str]] = None) -> Optional[tuple[bool, str]]:
    """What the ranks' records disagree about, the same on every rank, or None: (True, what)
    where the ranks are out of step (different call numbers: the communicator must be
    aborted), (False, what) where they describe the exchange differently (its kind, dtype,
    row shape or wire dtype; ``meta_words``: this rank's, in words, for the message), their
    rows differ in size, or a sender and a receiver count a block differently (nothing has
    moved but the rank's own block). This rank's own disagreements are named first."""
    W = len(table)
    sent_at, expect_at, meta_at = _HEAD + SHARED_INTS, _HEAD + SHARED_INTS + W, _HEAD + SHARED_INTS + 3 * W
    first = table[0]
    if all(row[:2] == first[:2] and row[meta_at:] == first[meta_at:] for row in table) and list(
            zip(*[row[expect_at:expect_at + W] for row in table])) == [tuple(row[sent_at:expect_at]) for row in table]:
        return None  # (the common case, checked at once: the names below are for a disagreement)
    calls = [row[0] for row in table]
    sizes = [row[1] for row in table]
    if min(calls) != max(calls):
        return True, (f"the ranks are in different exchanges (numbers {min(calls)} to {max(calls)}; rank {me} is in "
                      f"{table[me][0]})")
    mine_meta = table[me][meta_at:meta_at + META_INTS]
    for i, name in enumerate(_META_NAMES):
        others = [r for r in range(W) if table[r][meta_at + i] != mine_meta[i]]
        if others:
            mine = f" ({meta_words[i]})" if meta_words is not None else ""
            return False, (f"rank(s) {others} pass another {name} than rank {me}{mine}: every rank must pass the "
                           f"same (found before any row moved)")
    if min(sizes) != max(sizes):
        return False, (f"the ranks' rows differ in size ({min(sizes)} to {max(sizes)} bytes; rank {me}'s: "
                       f"{table[me][1]}; found before any row moved)")
    for r in [me, *range(W)]:
        for s in range(W):
            sent, expected = table[s][sent_at + r], table[r][expect_at + s]
            if sent != expected:
                return False, (f"rank {r} expected {expected} rows from rank {s}, but rank {s} sent {sent} (the "
                               f"ranks' splits disagree; found before any row moved)")
    return None


def is_direct(table: Sequence[Sequence[int]]) -> bool:
    """One direct round: some rank shares its output and none said it cannot."""
    flags = [row[3] for row in table]
    return max(flags) == 1 and min(flags) >= 0


def most_rounds(table: Sequence[Sequence[int]]) -> int:
    """The rounds of an exchange through the arenas: the most any rank needs."""
    return max(row[2] for row in table)


def direct_destinations(table: Sequence[Sequence[int]], me: int, row_bytes: int,
                        map_output: Callable[[int, Sequence[int]], int]) -> list[int]:
    """Of a direct exchange: per peer, the address (in this process) where this rank's block
    goes in the peer's output, ``map_output(peer, shared)`` (the peer's output mapped here)
    plus the peer's displacement for this rank's rows; 0 where the block goes through the
    peer's regions (it did not share its output), is empty, or is the rank's own."""
    W = len(table)
    shared_at, sent_at, displ_at = _HEAD, _HEAD + SHARED_INTS, _HEAD + SHARED_INTS + 2 * W
    out = []
    for p in range(W):
        row = table[p]
        if p == me or row[3] != 1 or not table[me][sent_at + p]:
            out.append(0)
        else:
            out.append(map_output(p, row[shared_at:shared_at + SHARED_INTS]) + row[displ_at + me] * row_bytes)
    return out
