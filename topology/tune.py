"""``python -m topology tune``: time flat and 2DH per message size, write the cluster's profile."""

from __future__ import annotations

import datetime
from typing import Callable, Optional, Sequence

import torch

import moecomm
from moecomm.profile import Profile, ProfileEntry, default_profile_path

from .measure import Timing, alltoall_input, format_bytes, format_seconds, probe_links, time_collective

__all__ = ["tune", "set_overlap_hook", "overlap_runner"]

OverlapHook = Callable[["moecomm.Communicator", torch.Tensor, list, int, str], Optional[Callable[[], object]]]


def _default_overlap_hook(comm, x, send, degree, algorithm):
    """One ``comm.scatter_compute_gather`` (identity compute) at chunk count ``degree``.

    Returns a zero-argument callable that runs it, or None where the communicator has no
    such method (the overlap sweep is then skipped).
    """
    fn = getattr(comm, "scatter_compute_gather", None)
    if fn is None:
        return None
    return lambda: fn(x, send, lambda rows, chunk: rows, degree=degree, algorithm=algorithm)


_overlap_hook: list = [_default_overlap_hook]


def set_overlap_hook(hook: Optional[OverlapHook]) -> None:
    """Replace how ``tune --degrees`` runs the overlapped exchange (None: the default hook)."""
    _overlap_hook[0] = hook or _default_overlap_hook


def overlap_runner(comm, x, send, degree, algorithm="flat"):
    return _overlap_hook[0](comm, x, send, degree, algorithm)


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
    log: Callable[[str], None] = print,
) -> Profile:
    """Collective: measure and return the profile (rank 0 logs through ``log``)."""
    state = comm._hier
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
        timings: dict[str, Timing] = {}
        for alg in ("flat", "2dh"):
            timings[alg] = time_collective(
                comm, lambda: comm.all_to_all_v(x, send, recv, algorithm=alg), iters=iters, warmup=warmup)
        choice = "2dh" if timings["2dh"].median_s < timings["flat"].median_s else "flat"
        best_degree = None
        if degrees:
            best_degree, overlap_note = _sweep_degrees(comm, x, send, degrees, iters, warmup, timings, choice)
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


def _sweep_degrees(comm, x, send, degrees, iters, warmup, timings, algorithm) -> tuple[Optional[int], str]:
    """Time the overlapped scatter/compute/gather at each chunk count with the chosen algorithm."""
    best: Optional[tuple[float, int]] = None
    for d in degrees:
        run = overlap_runner(comm, x, send, d, algorithm)
        if run is None:
            return None, ("overlap degrees skipped: this communicator has no scatter_compute_gather yet "
                          "(topology.tune.set_overlap_hook can supply one)")
        t = time_collective(comm, run, iters=iters, warmup=warmup)
        timings[f"overlap_d{d}"] = t
        if best is None or t.median_s < best[0]:
            best = (t.median_s, d)
    return (best[1] if best else None), ""


def default_output(profile: Profile) -> str:
    return str(default_profile_path(profile.fingerprint))
