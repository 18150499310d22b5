"""``python -m topology tune``: time flat and 2DH per message size, write the cluster's profile."""

from __future__ import annotations

import datetime
from typing import Callable, Optional, Sequence

import torch

import moecomm
from moecomm.profile import Profile, ProfileEntry, default_profile_path

from .measure import (Timing, alltoall_input, format_bytes, format_seconds, probe_links, time_collective,
                      time_collectives)

__all__ = ["tune", "ExpertFn"]

ExpertFn = Callable[[torch.Tensor, object], torch.Tensor]
"""The compute ``tune --degrees`` overlaps with the exchange: ``fn(rows, chunk)`` as for
``Communicator.scatter_compute_gather``. Identity by default, which measures the pipeline's
exchange cost alone; pass a representative expert to tune for a real layer."""


def _identity(rows: torch.Tensor, chunk: object) -> torch.Tensor:
    return rows


def tune(
    comm: "moecomm.Communicator",
    sizes: Sequence[int],
    *,
    iters: int,
    warmup: int,
    row_bytes: int = 1024,
    dtype: torch.dtype = torch.bfloat16,
    skew: float = 0.0,
    known_counts: bool = False,
    probe_sizes: Sequence[int] = (),
    degrees: Sequence[int] = (),
    expert_fn: Optional[ExpertFn] = None,
    log: Callable[[str], None] = print,
) -> Profile:
    """Collective: measure and return the profile (rank 0 logs through ``log``)."""
    state = comm.topology
    if state is None or state.hierarchy is None:
        raise RuntimeError("tune needs the hierarchy groups: init the communicator with hierarchy=True")
    say = log if comm.rank == 0 else (lambda s: None)
    links = {}
    if probe_sizes:
        say(f"probing links ({comm.num_nodes} node(s) x {comm.local_size}):")
        links = probe_links(comm, probe_sizes, iters=iters, warmup=warmup, log=say)
    entries = []
    say(f"{'bytes/rank':>10s} {'flat median':>12s} {'flat p99':>10s} {'2dh median':>12s} {'2dh p99':>10s}  choice")
    overlap_note = ""
    for size in sizes:
        x, send = alltoall_input(comm, size, row_bytes=row_bytes, dtype=dtype, skew=skew, seed=size)
        recv = None
        if known_counts:
            _, recv = comm.all_to_all_v(x, send)
        timings: dict[str, Timing] = time_collectives(
            comm, {alg: (lambda alg=alg: comm.all_to_all_v(x, send, recv, algorithm=alg)) for alg in ("flat", "2dh")},
            iters=iters, warmup=warmup)
        choice = "2dh" if timings["2dh"].median_s < timings["flat"].median_s else "flat"
        best_degree = None
        if degrees:
            best_degree, overlap_note = _sweep_degrees(comm, x, send, degrees, iters, warmup, timings, choice,
                                                       expert_fn or _identity)
        actual = x.numel() * x.element_size()
        entries.append(ProfileEntry(actual, choice, {k: v.to_json() for k, v in timings.items()}, best_degree))
        f, h = timings["flat"], timings["2dh"]
        say(f"{format_bytes(actual):>10s} {format_seconds(f.median_s):>12s} {format_seconds(f.p99_s):>10s} "
            f"{format_seconds(h.median_s):>12s} {format_seconds(h.p99_s):>10s}  {choice}")
    if overlap_note:
        say(overlap_note)
    # Entries must have distinct sizes (tiny sizes may round to the same row count).
    unique: dict[int, ProfileEntry] = {}
    for e in entries:
        unique.setdefault(e.bytes_per_rank, e)
    return Profile(
        state.fingerprint,
        tuple(sorted(unique.values(), key=lambda e: e.bytes_per_rank)),
        links,
        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        moecomm.__version__,
    )


def _sweep_degrees(comm, x, send, degrees, iters, warmup, timings, algorithm, fn) -> tuple[Optional[int], str]:
    """Time the overlapped scatter/compute/gather at each chunk count with the chosen algorithm."""
    best: Optional[tuple[float, int]] = None
    for d in degrees:
        def run(d=d):
            return comm.scatter_compute_gather(x, send, fn, degree=d, algorithm=algorithm)
        t = time_collective(comm, run, iters=iters, warmup=warmup)
        timings[f"overlap_d{d}"] = t
        if best is None or t.median_s < best[0]:
            best = (t.median_s, d)
    return (best[1] if best else None), ""


def default_output(profile: Profile) -> str:
    return str(default_profile_path(profile.fingerprint))
