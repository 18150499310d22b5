"""Where the time of a small exchange on the peer backend goes (ranks sharing a GPU).

Run under MPI with the peer backend (``mpirun -n 2 python -m bench.peer_costs``): rank 0
prints the median host time per call of each piece, synchronised like ``bench.alltoall``
(a device synchronisation and an MPI barrier around every call), and back to back (neither:
what the host spends issuing it, and waiting where the call itself waits). The equal-blocks
exchange (``all_to_all_single`` without split sizes) is also timed replayed from a CUDA graph:
its GPU time without the host's.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
import torch

import moecomm


def _median_us(fn: Callable[[], object], n: int, sync: Callable[[], None]) -> float:
    times = []
    for i in range(n + 5):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def _unchecked(comm, fn: Callable[[], object]) -> object:
    """``fn()`` without the default check (a private switch, for this measurement only)."""
    comm.engine.row_tags = False
    try:
        return fn()
    finally:
        comm.engine.row_tags = True


def _graph_of(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (after a warm-up call on a side stream): its replay,
    the GPU work of the call without the host's."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-n", type=int, default=200)
    p.add_argument("--rows", type=int, default=64, help="rows of 2048 bf16 per peer")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then profile N calls of all_to_all_v (known counts, then counts on the GPU) on rank 0 "
                        "and print the top functions")
    args = p.parse_args()
    from mpi4py import MPI

    comm = moecomm.init()
    world = MPI.COMM_WORLD
    W, dev = comm.size, comm.device
    backend = comm.engine.backend
    host = backend._host  # noqa: SLF001 - a diagnostic of the backend's own pieces
    t = backend.transport
    x = torch.randn(W * args.rows, 2048, device=dev).to(torch.bfloat16)
    out = torch.empty_like(x)
    send = [args.rows] * W
    counts = torch.tensor(send, device=dev)

    def device_sync() -> None:
        torch.cuda.synchronize(dev)
        world.Barrier()

    def none() -> None:
        pass

    empty = torch.empty(0, dtype=torch.uint8, device=dev)
    zeros = [0] * W

    def round_only() -> None:
        h = backend.begin()
        t.issue_round(h, empty, zeros, None, empty, zeros, None, 1)
        backend.end("probe")

    codes = (1, 2)

    def gpu_round() -> None:  # the counts-on-the-GPU kernel round alone (the rows left in the arenas)
        request = t.start(x, counts, 4096, codes)
        while not request.test():
            pass

    def gpu_round_copy_out() -> None:  # ... with what the host does after it: counts, output, copy out
        request = t.start(x, counts, 4096, codes)
        while not request.test():
            pass
        sent, received, _ = t.counts()
        t.senders()
        o = torch.empty((sum(received), 2048), dtype=x.dtype, device=dev)
        t.finish(x, o, sent, received, 4096, False)

    pieces = {
        "sync alone": none,
        "host allreduce (3 ints)": lambda: host.allreduce([1, 2, 3], "max"),
        "host allgather (a record)": lambda: host.allgather(list(range(13 + 3 * W))),
        "export the output (IPC)": lambda: t.export_output(out),
        "empty GPU round": round_only,
        "backend.alltoallv known": lambda: backend.alltoallv(x, send, out, send, 4096).join(),
        "all_to_all_v known": lambda: comm.all_to_all_v(x, send, send),
        "the same, unchecked": lambda: _unchecked(comm, lambda: comm.all_to_all_v(x, send, send)),
        "the check's description": lambda: comm.engine.meta_of(x),
        "GPU round (counts on GPU)": gpu_round,
        "GPU round + copy out": gpu_round_copy_out,
        "all_to_all_v counts on GPU": lambda: comm.all_to_all_v(x, counts),
        "all_to_all_single equal": lambda: comm.all_to_all_single(out, x),
        "the same, graph replay": _graph_of(lambda: comm.all_to_all_single(out, x), dev) if backend.concurrent
        else none,
        "copy": lambda: out.copy_(x),
    }
    rows = []
    for name, fn in pieces.items():
        synced = _median_us(fn, args.n, device_sync)
        back_to_back = _median_us(fn, args.n, none) if name != "sync alone" else 0.0
        rows.append((name, synced, back_to_back))
    if comm.rank == 0:
        print(f"# peer backend, {W} ranks, concurrent={backend.concurrent}, {args.rows} rows of 4 KiB per peer")
        print(f"{'':>30} {'synced':>9}    {'back to back':>12}")
        for name, us, b2b in rows:
            print(f"{name:>30} {us:9.1f} us {b2b:9.1f} us")
    if args.profile:
        import cProfile
        import pstats

        for what, fn in (("equal blocks", lambda: comm.all_to_all_single(out, x)),
                         ("known counts", lambda: comm.all_to_all_v(x, send, send)),
                         ("counts on the GPU", lambda: comm.all_to_all_v(x, counts))):
            prof = cProfile.Profile()
            for _ in range(args.profile):
                device_sync()
                if comm.rank == 0:
                    prof.enable()
                fn()
                if comm.rank == 0:
                    prof.disable()
            if comm.rank == 0:
                print(f"# profile: all_to_all_v, {what}")
                stats = pstats.Stats(prof)
                stats.sort_stats("tottime").print_stats(40)
                stats.sort_stats("cumulative").print_stats(40)
    comm.close()


if __name__ == "__main__":
    main()
