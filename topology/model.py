"""An alpha-beta model of the flat and the 2DH all-to-all.

Per rank: ``B`` bytes in (all destinations), ``W = N * L`` ranks, equal splits. One
all-to-all over a link among ``P`` ranks with ``m`` bytes per peer takes

    ``alpha + (P - 1) * (msg + m / beta)``

(``alpha``: per-call latency, ``msg``: per-message overhead, ``beta``: one rank's
bandwidth on that link), which is how ``python -m topology probe`` fits its figures.

flat
    counts: one all-to-all of 8-byte counts; data: one all-to-all with ``L - 1``
    messages of ``B / W`` over the intra-node link and ``W - L`` over the inter-node link.
    One call latency (the larger link's); the two links' message terms run concurrently
    (``max``) on a real cluster, or share one memory system (``sum``: the default when the
    link kind says one host, i.e. simulated nodes).
2dh
    counts: an intra-node then a rail all-to-all of counts; data: an intra-node all-to-all
    of ``B / L`` per peer, two layout copies of ``B`` bytes (``alpha_c + B / beta_c`` each,
    only when ``N > 1`` and ``L > 1``), then a rail all-to-all of ``B / N`` per peer. The
    phases are sequential.

wire dtype (``all_to_all_v(..., wire_dtype=)``)
    the rows travel packed (FP8 bytes and block scales: ``w * B`` bytes for a wire ratio
    ``w``, :func:`wire_ratio`) through either algorithm, plus a quantize pass (reads ``B``,
    writes ``w * B``) and a dequantize pass (the reverse), each ``alpha_c + (1 + w) B / beta_c``
    on the copy link (:func:`wire_time`).

It ignores congestion beyond what the probe saw, switch topology and overlap between
phases; :func:`model_error` measures it against timings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Links", "Link", "flat_time", "hdh_time", "crossover", "model_error", "links_from_profile",
           "wire_ratio", "wire_time", "best_time"]

_COUNT_BYTES = 8


@dataclass(frozen=True)
class Link:
    alpha_s: float  # per call
    beta_Bps: float
    msg_s: float = 0.0  # per message

    def messages(self, nbytes: float, count: float) -> float:
        """The message term of ``count`` messages of ``nbytes`` (no call latency)."""
        return count * (self.msg_s + nbytes / self.beta_Bps) if count > 0 else 0.0

    def call(self, nbytes: float, peers: int) -> float:
        """One all-to-all among ``peers + 1`` ranks with ``nbytes`` per peer."""
        return self.alpha_s + self.messages(nbytes, peers) if peers > 0 else 0.0


@dataclass(frozen=True)
class Links:
    intra: Link
    inter: Link
    copy: Link
    concurrent: bool = True  # flat: intra and inter traffic overlap (max) or not (sum)


def _flat_call(links: Links, nodes: int, local: int, m: float) -> float:
    w = nodes * local
    if w == 1:
        return 0.0
    a = links.intra.messages(m, local - 1)
    b = links.inter.messages(m, w - local)
    lat = max(links.intra.alpha_s if local > 1 else 0.0, links.inter.alpha_s if nodes > 1 else 0.0)
    return lat + (max(a, b) if links.concurrent else a + b)


def flat_time(links: Links, nodes: int, local: int, bytes_per_rank: float, *, counts: bool = True) -> float:
    t = _flat_call(links, nodes, local, bytes_per_rank / (nodes * local))
    if counts:
        t += _flat_call(links, nodes, local, _COUNT_BYTES)
    return t


def hdh_time(links: Links, nodes: int, local: int, bytes_per_rank: float, *, counts: bool = True) -> float:
    b = bytes_per_rank
    t = links.intra.call(b / local, local - 1) + links.inter.call(b / nodes, nodes - 1)
    if nodes > 1 and local > 1:
        t += 2 * (links.copy.alpha_s + b / links.copy.beta_Bps)
    if counts:
        t += links.intra.call(_COUNT_BYTES * nodes, local - 1) + links.inter.call(_COUNT_BYTES * local, nodes - 1)
    return t


def wire_ratio(row_elems: int, elem_bytes: int, block: int = 128) -> float:
    """Bytes on the wire of a ``wire_dtype`` exchange over those of the plain one, for rows of
    ``row_elems`` elements of ``elem_bytes`` bytes (:func:`moecomm.quant.packed_row_bytes`)."""
    from moecomm.quant import packed_row_bytes

    if row_elems < 1 or elem_bytes < 1:
        raise ValueError(f"row_elems and elem_bytes must be >= 1, got {row_elems} and {elem_bytes}")
    return packed_row_bytes(row_elems, block) / (row_elems * elem_bytes)


def best_time(links: Links, nodes: int, local: int, bytes_per_rank: float, *, counts: bool = True) -> tuple[float, str]:
    """The faster algorithm's time and name (``"flat"`` or ``"2dh"``), as ``algorithm="auto"`` picks."""
    f = flat_time(links, nodes, local, bytes_per_rank, counts=counts)
    h = hdh_time(links, nodes, local, bytes_per_rank, counts=counts)
    return (h, "2dh") if h < f else (f, "flat")


def wire_time(links: Links, nodes: int, local: int, bytes_per_rank: float, ratio: float, *,
              counts: bool = True) -> tuple[float, str]:
    """A ``wire_dtype`` exchange of ``bytes_per_rank`` activation bytes: the packed rows
    (``ratio`` of the bytes) through the faster algorithm, plus the quantize and dequantize
    passes on the copy link. Returns (seconds, algorithm)."""
    t, alg = best_time(links, nodes, local, bytes_per_rank * ratio, counts=counts)
    passes = 2 * (links.copy.alpha_s + (1 + ratio) * bytes_per_rank / links.copy.beta_Bps)
    return t + passes, alg


def crossover(links: Links, nodes: int, local: int, *, lo: int = 1, hi: int = 1 << 40, counts: bool = True) -> Optional[float]:
    """The bytes per rank where 2DH stops (or starts) being faster; None if it never changes.

    Scans a log grid of 8 points per octave and bisects the first sign change.
    """
    def diff(b: float) -> float:
        return hdh_time(links, nodes, local, b, counts=counts) - flat_time(links, nodes, local, b, counts=counts)

    steps = int(8 * math.log2(hi / lo))
    prev_b, prev = float(lo), diff(lo)
    for i in range(1, steps + 1):
        b = lo * 2 ** (i / 8)
        cur = diff(b)
        if (prev < 0) != (cur < 0):
            a, c = prev_b, b
            for _ in range(60):
                mid = math.sqrt(a * c)
                if (diff(mid) < 0) == (prev < 0):
                    a = mid
                else:
                    c = mid
            return math.sqrt(a * c)
        prev_b, prev = b, cur
    return None


def links_from_profile(links_json: dict, *, concurrent: Optional[bool], one_host: bool) -> Links:
    """:class:`Links` from a profile's (or probe's) ``links`` object.

    A link missing from the JSON (the layout had no such link) gets the figures of the
    other one, so that a model of a larger layout can still be made.
    """
    def get(name: str) -> Optional[Link]:
        fig = links_json.get(name)
        if not fig:
            return None
        return Link(float(fig.get("alpha_s", 0.0)), float(fig.get("beta_Bps", 1e30)) or 1e30,
                    float(fig.get("msg_s", 0.0)))

    intra, inter, copy = get("intra"), get("inter"), get("copy")
    if intra is None and inter is None:
        raise ValueError("the profile has no link figures (intra or inter); run `python -m topology tune` "
                         "without --no-probe, or give them on the command line")
    intra = intra or inter
    inter = inter or intra
    copy = copy or Link(0.0, 1e30)
    return Links(intra, inter, copy, (not one_host) if concurrent is None else concurrent)


def model_error(links: Links, nodes: int, local: int, measured: Sequence[tuple[int, str, float]]) -> dict:
    """Relative error of the model against ``(bytes_per_rank, algorithm, seconds)`` measurements.

    Returns ``{"n", "mean_abs_rel", "max_abs_rel", "per_algorithm": {...}, "rows": [...]}``.
    """
    rows = []
    for b, alg, t in measured:
        if t <= 0:
            continue
        pred = flat_time(links, nodes, local, b) if alg == "flat" else hdh_time(links, nodes, local, b)
        rows.append((b, alg, t, pred, (pred - t) / t))
    out: dict = {"n": len(rows), "rows": rows, "per_algorithm": {}}
    if rows:
        errs = [abs(r[4]) for r in rows]
        out["mean_abs_rel"] = sum(errs) / len(errs)
        out["max_abs_rel"] = max(errs)
        for alg in sorted({r[1] for r in rows}):
            e = [abs(r[4]) for r in rows if r[1] == alg]
            out["per_algorithm"][alg] = {"mean_abs_rel": sum(e) / len(e), "max_abs_rel": max(e), "n": len(e)}
    return out
