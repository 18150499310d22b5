"""Timing through the communicator: collective timings, link probes and alpha-beta fits.

Every function here is collective over the communicator it is given (all ranks call it
with the same arguments). A timing of one iteration is the slowest rank's (the per-rank
durations are reduced with ``max`` once at the end, so timing adds no synchronisation
inside the loop beyond the barrier that starts each iteration).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

import moecomm
from moecomm.collectives import blocks as _blocks

__all__ = [
    "Timing",
    "time_collective",
    "time_collectives",
    "uniform_splits",
    "alltoall_input",
    "probe_links",
    "fit_alpha_beta",
    "fit_link",
    "format_bytes",
    "format_seconds",
    "parse_bytes",
]


@dataclass(frozen=True)
class Timing:
    """Seconds per iteration (slowest rank), over ``iters`` timed iterations."""

    median_s: float
    p99_s: float
    min_s: float
    iters: int

    def to_json(self) -> dict:
        return {"median_s": self.median_s, "p99_s": self.p99_s, "min_s": self.min_s, "iters": self.iters}


def _sync(comm: "moecomm.Communicator") -> None:
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)


def time_collective(comm: "moecomm.Communicator", fn: Callable[[], object], *, iters: int, warmup: int) -> Timing:
    """Time ``fn`` (a collective over ``comm``): barrier, run, synchronize; ``iters`` times."""
    return time_collectives(comm, {"fn": fn}, iters=iters, warmup=warmup)["fn"]


def time_collectives(comm: "moecomm.Communicator", fns: dict[str, Callable[[], object]], *, iters: int,
                     warmup: int) -> dict[str, Timing]:
    """Time several ``fns`` round-robin: iteration ``i`` runs each of them once in turn
    (barrier, run, synchronize), so that a noisy moment on a shared machine hits all alike."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
            _sync(comm)
    times = torch.zeros(len(fns), iters, dtype=torch.float64)
    for i in range(iters):
        for j, fn in enumerate(fns.values()):
            comm.barrier()
            t0 = time.perf_counter()
            fn()
            _sync(comm)
            times[j, i] = time.perf_counter() - t0
    worst = times.to(comm.device)
    comm.allreduce(worst, "max")
    result = {}
    for j, name in enumerate(fns):
        t = np.sort(worst[j].cpu().numpy())
        p99 = float(t[min(len(t) - 1, int(math.ceil(0.99 * len(t))) - 1)])
        result[name] = Timing(float(np.median(t)), p99, float(t[0]), iters)
    return result


def uniform_splits(total_rows: int, size: int) -> list[int]:
    """``total_rows`` spread over ``size`` destinations as evenly as possible."""
    base, extra = divmod(total_rows, size)
    return [base + (1 if p < extra else 0) for p in range(size)]


def alltoall_input(comm: "moecomm.Communicator", bytes_per_rank: int, *, row_bytes: int = 1024,
                   dtype: torch.dtype = torch.bfloat16, skew: float = 0.0, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """An input of about ``bytes_per_rank`` bytes and its send splits.

    ``skew`` 0 gives equal splits; ``skew`` s > 0 draws each rank's splits from a
    Dirichlet(1/s) distribution (variable lengths, zeros likely for large s).
    """
    esize = torch.empty((), dtype=dtype).element_size()
    row_elems = max(1, row_bytes // esize)
    rows = max(0, bytes_per_rank // (row_elems * esize))
    if skew > 0 and rows:
        rng = np.random.default_rng([seed, comm.rank])
        w = rng.dirichlet(np.full(comm.size, 1.0 / skew))
        splits = np.floor(w * rows).astype(np.int64)
        splits[0] += rows - int(splits.sum())
        send = [int(v) for v in splits]
    else:
        send = uniform_splits(rows, comm.size)
    x = torch.empty((rows, row_elems), dtype=dtype, device=comm.device)
    if rows:
        x.view(torch.uint8).random_(0, 256) if dtype != torch.bool else x.random_(0, 2)
    return x, send


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``seconds = alpha + bytes / beta`` to ``(bytes, seconds)``; returns ``(alpha_s, beta_Bps)``."""
    alpha, _, beta = fit_link([(2, b, t) for b, t in points])
    return alpha, beta


def fit_link(points: Sequence[tuple[int, float, float]]) -> tuple[float, float, float]:
    """Fit ``t = alpha + (P - 1) * (msg + m / beta)`` to ``(P, m, t)`` points, minimising relative error.

    ``alpha`` is the per-call latency, ``msg`` the per-message overhead, ``beta`` the
    bandwidth of one rank's link. With a single group size ``P`` in the points, ``alpha``
    and ``msg`` cannot be told apart and ``msg`` is 0. Negative estimates are refitted
    without that term. Returns ``(alpha_s, msg_s, beta_Bps)`` (``beta`` inf: no bandwidth term).
    """
    pts = [(int(p), float(m), float(t)) for p, m, t in points if t > 0]
    if not pts:
        return 0.0, 0.0, float("inf")
    cols = {"alpha": lambda p, m: 1.0, "msg": lambda p, m: float(p - 1), "gamma": lambda p, m: (p - 1) * m}
    use = ["alpha", "msg", "gamma"]
    if len({p for p, _, _ in pts}) < 2:
        use.remove("msg")
    if len({m for _, m, _ in pts}) < 2 and "msg" in use:
        use.remove("msg")
    while True:
        a = np.array([[cols[c](p, m) / t for c in use] for p, m, t in pts])
        sol, *_ = np.linalg.lstsq(a, np.ones(len(pts)), rcond=None)
        est = dict(zip(use, (float(v) for v in sol)))
        negative = [c for c in use if est[c] < 0]
        if not negative or len(use) == 1:
            break
        use.remove(min(negative, key=lambda c: est[c]))
    alpha = max(0.0, est.get("alpha", 0.0))
    msg = max(0.0, est.get("msg", 0.0))
    gamma = est.get("gamma", 0.0)
    return alpha, msg, (1.0 / gamma if gamma > 0 else float("inf"))


def probe_links(comm: "moecomm.Communicator", sizes: Sequence[int], *, iters: int, warmup: int,
                log: Optional[Callable[[str], None]] = None) -> dict:
    """Latency and bandwidth of the intra-node link, the inter-node link and layout copies.

    ``intra``: an all-to-all inside every node at once (the intra-node sub-communicator),
    ``inter``: an all-to-all along every rail at once (the rail sub-communicator), with
    ``m`` bytes per peer for ``m`` in ``sizes``; where the group has more than 2 ranks also
    in pairs of it, so that per-call latency and per-message overhead can be told apart.
    Fitted as ``t = alpha + (P - 1) * (msg + m / beta)`` (:func:`fit_link`). ``copy``:
    ``moecomm.collectives.blocks.permute_blocks`` of ``m * W`` bytes on this rank's device, ``t = alpha +
    bytes / beta``. A link that the layout lacks (one node, or one rank per node) is omitted.

    Returns ``{"intra"|"inter"|"copy": {"alpha_s", "msg_s", "beta_Bps", "group",
    "points": [[P, bytes, seconds], ...]}}``.
    """
    state = comm.topology
    if state is None or state.hierarchy is None:
        raise RuntimeError("probe needs the hierarchy groups: init the communicator with hierarchy=True")
    h = state.hierarchy
    links: dict = {}
    for name, sub in (("intra", h.intra), ("inter", h.rail)):
        if sub.size < 2:
            continue
        groups = [sub]
        if sub.size > 2:  # pairs inside the group (an odd rank out idles)
            pair_color = sub.rank // 2 if sub.rank < sub.size - sub.size % 2 else None
            groups.append(sub.split(pair_color, sub.rank))
        sizes_seen = sorted({sub.size, 2})
        points = []
        for p in sizes_seen:
            g = groups[0] if p == sub.size else groups[1]
            for m in sizes:
                x = torch.empty(m * p, dtype=torch.uint8, device=comm.device).view(-1, 1)
                send = [m] * p
                if g is None:  # idle this round, but still part of the timing collective
                    run = lambda: None  # noqa: E731
                else:
                    run = (lambda g=g, x=x, send=send: g.all_to_all_v(x, send, send))
                t = time_collective(comm, run, iters=iters, warmup=warmup)
                points.append([p, m, t.median_s])
                if log:
                    bw = (p - 1) * m / t.median_s if t.median_s > 0 else float("nan")
                    log(f"  {name:5s} P={p:<4d} {format_bytes(m):>9s}/peer  {format_seconds(t.median_s):>9s}  "
                        f"p99 {format_seconds(t.p99_s):>9s}  {bw / 1e9:8.3f} GB/s")
        if len(groups) > 1 and groups[1] is not None:
            groups[1].close()
        alpha, msg, beta = fit_link(points)
        links[name] = {"alpha_s": alpha, "msg_s": msg, "beta_Bps": _finite(beta), "group": sub.size,
                       "points": points}
    points = []
    w = comm.size
    for m in sizes:
        nbytes = m * w
        x = torch.empty(max(1, nbytes // 64), 64, dtype=torch.uint8, device=comm.device)
        # The pack copy of a 2DH exchange: N x L blocks (at least 2 x 2, so that it copies).
        grid = _grid(x.shape[0], max(2, h.num_nodes), max(2, h.local_size))
        t = time_collective(comm, lambda: _blocks.permute_blocks(x, grid), iters=iters, warmup=warmup)
        points.append([1, x.numel(), t.median_s])
    alpha, _, beta = fit_link([(2, b, t) for _, b, t in points])
    links["copy"] = {"alpha_s": alpha, "msg_s": 0.0, "beta_Bps": _finite(beta), "group": 1, "points": points}
    if log:
        log(f"  copy  alpha {format_seconds(alpha)}  beta {_finite(beta) / 1e9:.3f} GB/s (permute_blocks)")
    return links


def _grid(rows: int, a: int, b: int) -> list[list[int]]:
    cells = a * b
    flat = uniform_splits(rows, cells)
    return [flat[i * b:(i + 1) * b] for i in range(a)]


def _finite(v: float) -> float:
    return v if math.isfinite(v) else 1e30


_UNITS = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]


def format_bytes(n: float) -> str:
    for unit, scale in _UNITS:
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def format_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "inf"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def parse_bytes(text: str) -> int:
    """``"4096"``, ``"64K"``, ``"16M"``, ``"1G"`` (binary multiples, optional ``iB``/``B``)."""
    t = text.strip().upper().replace("IB", "").rstrip("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            mult, t = m, t[:-1]
            break
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 4096, 64K, 16M, 1G)") from None
    if value < 0:
        raise ValueError(f"byte size must be >= 0, got {text!r}")
    return int(value * mult)
