"""Decode dispatch and combine latency of :class:`moecomm.LowLatencyBuffer`, nccl-tests style.

Run under MPI (CPU ranks: small shapes; GPUs: one rank per GPU, or ranks sharing one under MPS)::

    mpiexec -n 8 python -m bench.low_latency -t 128 -H 7168 -E 256 -k 8 --fp8

Per mode and phase (``dispatch``, ``combine``), with new routing each call (uniform top-k),
median and p99 over ``--iters`` calls, beside the *floor*. Modes: ``eager`` and ``captured``
(each phase replayed from a CUDA graph; GPUs only) time one call at a time on the host, the
slowest rank's, from a barrier to a device synchronisation: that includes the launch, the
synchronisation and how far apart the ranks leave the barrier (about 10-20 us on a GPU).
``queued`` (GPUs) replays the captured phases back to back, ``--iters`` steps enqueued behind a
GPU sleep so that the host never starves the GPU, and times each phase with CUDA events on the
stream: its GPU time as a decode step replayed from one graph sees it (the ranks meet at
every phase, so waiting for the slowest is in it), the slowest rank's median. The *floor*: the bytes the phase
must move, read and written (each routed (token, expert) row read once and written once:
``2 * T * k * row``, ``row`` the token's bytes on the wire, FP8 and scales with ``--fp8``,
or one expert output), at the device-copy rate measured in the same run (``copy_`` of
``--copy-bytes``, read plus written bytes per second). ``wire`` is what the fixed-size
exchange really sends per rank (every peer's worst-case block).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

import moecomm
from moecomm import quant
from moecomm.low_latency import LowLatencyBuffer

from ._common import DTYPES, FLOAT_DTYPES, prog

__all__ = ["main", "build_parser", "copy_rate", "floor_bytes"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog("bench.low_latency"), description=__doc__.split("\n\n")[0])
    p.add_argument("-t", "--tokens", type=int, default=8, help="tokens per rank (max_tokens_per_rank)")
    p.add_argument("-H", "--hidden", type=int, default=256)
    p.add_argument("-E", "--experts", type=int, default=0, help="experts in total (default: 4 per rank)")
    p.add_argument("-k", type=int, default=2)
    p.add_argument("--dtype", choices=FLOAT_DTYPES, default="bfloat16")
    p.add_argument("--fp8", action="store_true", help="FP8 dispatch (float8_e4m3fn, block scales)")
    p.add_argument("-n", "--iters", type=int, default=50)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--copy-bytes", type=int, default=0, help="bytes of the copy-rate probe (default 256M GPU, 32M CPU)")
    p.add_argument("--torch-ops", action="store_true",
                   help="the buffer's torch ops instead of moecomm_ext's kernels (use_native=False), to compare")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then profile N eager dispatch + combine calls (torch.profiler: host and device time per "
                        "op and kernel, printed by rank 0)")
    p.add_argument("--rows-blocks", type=int, default=0, metavar="N",
                   help="diagnostic: thread blocks of the peer backend's used-rows exchange over all peers "
                        "(default: the library's)")
    p.add_argument("--no-gather", action="store_true",
                   help="diagnostic: the peer exchange copies staged send rows instead of gathering them on the way")
    p.add_argument("--json", default=None, help="write the results to this file (rank 0)")
    return p


def copy_rate(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Bytes read plus written per second by ``dst.copy_(src)`` of ``nbytes`` (best of ``reps``)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def floor_bytes(buf: LowLatencyBuffer, tokens: int) -> dict:
    """Bytes each phase must move for ``tokens`` tokens of ``k`` routes: read and written once."""
    es = torch.empty((), dtype=buf.dtype).element_size()
    row = quant.packed_row_bytes(buf.hidden) if buf.fp8_dtype is not None else buf.hidden * es
    return {"dispatch": 2 * tokens * buf.k * row, "combine": 2 * tokens * buf.k * buf.combine_hidden * es}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile(comm, dispatch: Callable[[], None], combine: Callable[[], None], new_routing: Callable[[], None],
             calls: int, device: torch.device) -> None:
    """Per op and kernel, host and device time of ``calls`` eager dispatch + combine calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    new_routing()
    _sync(device)
    comm.barrier()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            dispatch()
            combine()
        _sync(device)
    if comm.rank == 0:
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"# profile: {calls} eager dispatch + combine calls, by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    comm.barrier()


def _time_calls(comm, fn: Callable[[], None], iters: int, device: torch.device) -> np.ndarray:
    """Seconds per call, the slowest rank's, for ``iters`` calls of ``fn`` (each after a barrier)."""
    out = []
    for _ in range(iters):
        _sync(device)
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    t = torch.tensor(out, dtype=torch.float64, device=device)
    comm.allreduce(t, "max")
    return t.cpu().numpy()


def _time_queued(comm, phases: Sequence[Callable[[], None]], before: Callable[[], None], iters: int,
                 device: torch.device) -> list[np.ndarray]:
    """Microseconds of each of ``phases`` per step (CUDA events), ``iters`` steps of ``before()``
    then the phases, all enqueued behind a GPU sleep; per phase, the slowest rank's per step."""
    stream = torch.cuda.current_stream(device)
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(len(phases) + 1)] for _ in range(iters)]
    _sync(device)
    comm.barrier()
    torch.cuda._sleep(120_000 * iters)  # (cycles: about 60 us a step at 2 GHz, more than the host takes to enqueue one)
    for step in marks:
        before()
        step[0].record(stream)
        for i, phase in enumerate(phases):
            phase()
            step[i + 1].record(stream)
    _sync(device)
    per = torch.tensor([[step[i].elapsed_time(step[i + 1]) * 1e3 for step in marks] for i in range(len(phases))],
                       dtype=torch.float64, device=device)
    comm.allreduce(per, "max")
    return list(per.cpu().numpy())


def main(argv: Optional[Sequence[str]] = None) -> list:
    args = build_parser().parse_args(argv)
    comm = moecomm.init(set_default=False)
    dev, W = comm.device, comm.size
    E = args.experts or 4 * W
    dtype = DTYPES[args.dtype]
    M, H, k = args.tokens, args.hidden, args.k
    if args.rows_blocks < 0:
        raise SystemExit(f"--rows-blocks must be 0 (the library's) or positive, got {args.rows_blocks}")
    buf = LowLatencyBuffer(comm, M, H, E, k, dtype, fp8_dispatch=args.fp8, check_routing=False,
                           use_native=False if args.torch_ops else None)
    transport = getattr(comm.engine.backend, "transport", None)  # the peer backend's (diagnostic, this run only)
    if args.rows_blocks and transport is not None:
        transport.rows_blocks = args.rows_blocks
    if args.no_gather:
        buf.transport.gathers_rows = False  # private, for this measurement only
    L, R = buf.local_experts, buf.max_rows
    x = torch.randn(M, H, device=dev).to(dtype)
    idx = torch.zeros(M, k, dtype=torch.int64, device=dev)
    w = torch.rand(M, k, device=dev)
    ey = torch.randn(L, R, H, device=dev).to(dtype)
    gen = torch.Generator(device=dev).manual_seed(1234 + comm.rank)

    def new_routing() -> None:  # distinct experts per token, uniform
        idx.copy_(torch.rand(M, E, device=dev, generator=gen).topk(k, dim=1).indices)

    state = {}

    def dispatch() -> None:
        state["d"] = buf.dispatch(x, idx)

    def combine() -> None:
        buf.combine(ey, w, state["d"].handle)

    modes = [("eager", dispatch, combine)]
    if dev.type == "cuda":
        new_routing()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                dispatch()
                combine()
        torch.cuda.current_stream().wait_stream(s)
        gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(gd):
            dispatch()
        with torch.cuda.graph(gc):
            combine()
        modes.append(("captured", gd.replay, gc.replay))
        modes.append(("queued", gd.replay, gc.replay))

    kernels = "native" if buf.uses_native else "torch ops"
    rate = copy_rate(dev, args.copy_bytes or ((256 << 20) if dev.type == "cuda" else (32 << 20)))
    floors = floor_bytes(buf, M)
    wire = buf.wire_bytes()
    results = []
    for mode, d_fn, c_fn in modes:
        times = {"dispatch": [], "combine": []}
        if mode == "queued":
            _time_queued(comm, [d_fn, c_fn], new_routing, args.warmup, dev)  # (warm-up)
            td, tc = _time_queued(comm, [d_fn, c_fn], new_routing, args.iters, dev)
            times = {"dispatch": list(td / 1e6), "combine": list(tc / 1e6)}
        for it in range(0 if mode == "queued" else args.warmup + args.iters):
            new_routing()
            td = _time_calls(comm, d_fn, 1, dev)
            tc = _time_calls(comm, c_fn, 1, dev)
            if it >= args.warmup:
                times["dispatch"].append(td[0])
                times["combine"].append(tc[0])
        for phase in ("dispatch", "combine"):
            t = np.array(times[phase]) * 1e6
            floor_us = floors[phase] / rate * 1e6
            results.append({"mode": mode, "phase": phase, "ranks": W, "tokens": M, "hidden": H, "experts": E,
                            "k": k, "dtype": args.dtype, "fp8": args.fp8, "kernels": kernels,
                            "median_us": float(np.median(t)),
                            "p99_us": float(np.percentile(t, 99)), "floor_bytes": floors[phase],
                            "floor_us": floor_us, "wire_bytes": wire[phase], "copy_GBps": rate / 1e9})
    if args.profile:
        _profile(comm, dispatch, combine, new_routing, args.profile, dev)
    if comm.rank == 0:
        print(f"# {W} ranks on {dev.type}: tokens {M}, hidden {H}, experts {E}, top-{k}, {args.dtype}"
              f"{', FP8 dispatch' if args.fp8 else ''}, {kernels}; device copy {rate / 1e9:.1f} GB/s (read + written)")
        print(f"# {'mode':>9} {'phase':>9} {'median_us':>10} {'p99_us':>10} {'floor_us':>9} {'floor_B':>11} "
              f"{'wire_B':>11}")
        for r in results:
            print(f"  {r['mode']:>9} {r['phase']:>9} {r['median_us']:10.1f} {r['p99_us']:10.1f} {r['floor_us']:9.1f} "
                  f"{r['floor_bytes']:11d} {r['wire_bytes']:11d}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=1)
    comm.close()
    return results


if __name__ == "__main__":
    main()
