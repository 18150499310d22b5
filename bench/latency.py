"""Where the time of a small all-to-all goes on NCCL: the count round trip, piece by piece.

Run under MPI on GPUs (NCCL backend)::

    mpirun -n 2 python -m bench.latency --sizes 256K,1M,16M

Every method is timed round-robin with the others (MPI barrier, call, device synchronize),
the slowest rank's time per call, median over ``--iters``. The methods, from the floor up:

  nccl-tiny        one 16-byte-per-peer ncclAlltoAll on the current stream, then synchronize
  nccl-tiny-d2h    the same plus the copy of the counts to pinned host memory and ``tolist``
  counts           ``Communicator._exchange_counts`` (what ``all_to_all_v`` does first)
  torch-counts     torch's count exchange: ``all_to_all_single`` + ``.tolist()``
  grouped-known    the data exchange alone, grouped send/recv from the raw bindings
  known            ``all_to_all_v(x, send, recv)``
  gpu-counts       ``all_to_all_v(x, counts_on_gpu)``
  p2p              the same on a communicator with peer memory (``init(p2p_bytes=)``)
  torch            torch's MoE pattern (counts, ``.tolist()``, data)

``--per-peer`` adds the host cost of the native issuer per peer: one grouped exchange whose
rows for every peer are cut into ``n`` blocks (``n`` = 1, 2, 4, ... 64 send/recv pairs per
peer, through the same native call the backend makes), host time of the call against ``n``;
the slope of a least-squares line is the cost of one more send/recv pair, which is what
one more peer adds (with 2 GPUs there are not more peers to add).
"""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

import numpy as np
import torch

import moecomm.collectives.flat as flat

from .alltoall import Bench, build_parser, count_matrix, parse_size
from ._common import prog
from ._topology import RankZeroParser

__all__ = ["main"]


def _case(comm, size_bytes: int, row_elems: int) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Random splits of about ``size_bytes`` of bf16 rows: (send, recv, input, send counts on the GPU)."""
    W, R, dev = comm.size, comm.rank, comm.device
    rows = max(size_bytes // (row_elems * 2), W)
    m = count_matrix("random", W, rows, seed=size_bytes)
    send, recv = [int(v) for v in m[R]], [int(v) for v in m[:, R]]
    x = torch.randn(rows, row_elems, device=dev).to(torch.bfloat16)
    return send, recv, x, torch.tensor(send, dtype=torch.int64, device=dev)


def _grouped_send_recv(backend, x: torch.Tensor, out: torch.Tensor, send: list[int], recv: list[int],
                       row_bytes: int, stream: int) -> None:
    """The grouped send/recv calls of a known-counts exchange, from the raw bindings."""
    raw, handle = backend._raw, backend._handle
    sp, rp, so, ro = x.data_ptr(), out.data_ptr(), 0, 0
    for peer in range(len(send)):
        sc, rc = send[peer] * row_bytes, recv[peer] * row_bytes
        if sc:
            raw.send(sp + so, sc, 1, peer, handle, stream)
        if rc:
            raw.recv(rp + ro, rc, 1, peer, handle, stream)
        so, ro = so + sc, ro + rc


def _methods(bench: Bench, size_bytes: int, row_elems: int) -> dict[str, Callable[[], object]]:
    comm = bench.comm
    backend = comm.engine.backend
    raw, handle = backend._raw, backend._handle
    W, dev = comm.size, comm.device
    row_bytes = row_elems * 2
    send, recv, x, counts_dev = _case(comm, size_bytes, row_elems)
    tiny = torch.zeros(4 * W, dtype=torch.int64, device=dev)
    pinned = torch.empty(4 * W, dtype=torch.int64, pin_memory=True)

    def nccl_tiny():
        s = torch.cuda.current_stream(dev)
        p = tiny.data_ptr()
        raw.allto_all(p, p + 16 * W, 16, 1, handle, s.cuda_stream)
        return None

    def nccl_tiny_d2h():
        nccl_tiny()
        pinned.copy_(tiny, non_blocking=True)
        torch.cuda.current_stream(dev).synchronize()
        return pinned.tolist()

    def grouped_known():
        out = torch.empty((sum(recv), row_elems), dtype=x.dtype, device=dev)
        raw.group_start()
        _grouped_send_recv(backend, x, out, send, recv, row_bytes, torch.cuda.current_stream(dev).cuda_stream)
        raw.group_end()
        return out

    methods: dict[str, Callable[[], object]] = {
        "nccl-tiny": nccl_tiny,
        "nccl-tiny-d2h": nccl_tiny_d2h,
        "counts": lambda: comm.engine.exchange_counts(counts_dev, "send_splits"),
        "grouped-known": grouped_known,
        "known": lambda: comm.all_to_all_v(x, send, recv)[0],
        "gpu-counts": lambda: comm.all_to_all_v(x, counts_dev)[0],
    }
    if bench.p2p is not None:
        methods["p2p"] = lambda: bench.p2p.all_to_all_v(x, counts_dev)[0]
    if bench.pg is not None:
        import torch.distributed as dist

        def torch_counts():
            r = torch.empty_like(counts_dev)
            dist.all_to_all_single(r, counts_dev, group=bench.pg)
            return r.tolist()

        methods["torch-counts"] = torch_counts
        methods["torch"] = lambda: bench._torch_pattern(x, counts_dev)
    return methods


def _phases(bench: Bench, size_bytes: int, row_elems: int, iters: int) -> dict[str, float]:
    """Host timestamps inside one counts-on-GPU ``all_to_all_v``: medians in microseconds."""
    comm = bench.comm
    dev = comm.device
    _, _, x, counts_dev = _case(comm, size_bytes, row_elems)
    marks: dict[str, list[float]] = {"counts on host": [], "data issued": [], "data done": []}
    for _ in range(iters):
        bench.world.Barrier()
        t0 = time.perf_counter()
        send, recv = comm.engine.exchange_counts(counts_dev, "send_splits")
        t1 = time.perf_counter()
        out = torch.empty((sum(recv), row_elems), dtype=x.dtype, device=dev)
        request = flat.alltoallv(comm.engine, x, send, out, recv)
        request.join()
        t2 = time.perf_counter()
        torch.cuda.synchronize(dev)
        t3 = time.perf_counter()
        for k, v in zip(marks, (t1 - t0, t2 - t1, t3 - t2)):
            marks[k].append(v * 1e6)
    return {k: float(np.median(v)) for k, v in marks.items()}


def _issue_steps(bench: Bench, size_bytes: int, row_elems: int, iters: int) -> dict[str, float]:
    """Host time of each step of issuing one known-counts exchange on the NCCL backend
    through the raw bindings (taken apart), and of the native call the backend makes
    instead (the same group in one call): medians in microseconds."""
    comm = bench.comm
    b = comm.engine.backend
    dev = comm.device
    row_bytes = row_elems * 2
    send, recv, x, _ = _case(comm, size_bytes, row_elems)
    names = ("empty", "begin", "send/recv calls", "group_end", "end", "join")
    marks: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(iters):
        bench.world.Barrier()
        t = [time.perf_counter()]
        out = torch.empty((sum(recv), row_elems), dtype=x.dtype, device=dev)
        t.append(time.perf_counter())
        h = b.begin(x, out)
        t.append(time.perf_counter())
        b._raw.group_start()
        _grouped_send_recv(b, x, out, send, recv, row_bytes, h)
        t.append(time.perf_counter())
        b._raw.group_end()
        t.append(time.perf_counter())
        request = b.end("all_to_all_v")
        t.append(time.perf_counter())
        request.join()
        t.append(time.perf_counter())
        torch.cuda.synchronize(dev)
        for i, k in enumerate(names):
            marks[k].append((t[i + 1] - t[i]) * 1e6)
        if b._native is not None:  # what the backend runs: the whole group in one native call
            h = b.begin(x, out)
            t0 = time.perf_counter()
            b._native.alltoallv(b._comm_ptr, h, x.data_ptr(), out.data_ptr(), send, recv, row_bytes, (), ())
            marks.setdefault("native group (start, calls, end)", []).append((time.perf_counter() - t0) * 1e6)
            b.end("all_to_all_v").join()
            torch.cuda.synchronize(dev)
    return {k: float(np.median(v)) for k, v in marks.items()}


def _p2p_steps(bench: Bench, size_bytes: int, row_elems: int, iters: int) -> dict[str, float]:
    """Host timestamps inside one peer-memory ``all_to_all_v`` (``init(p2p_bytes=)``), and the
    GPU time from the send kernel's start to the counts' arrival in host memory (CUDA
    events): medians in microseconds."""
    comm = bench.p2p
    t = comm.engine.peer
    dev = comm.device
    row_bytes = row_elems * 2
    _, _, x, counts_dev = _case(comm, size_bytes, row_elems)
    names = ("start", "wait", "counts+empty", "finish", "gpu done")
    marks: dict[str, list[float]] = {k: [] for k in names + ("gpu kernels+copy",)}
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        bench.world.Barrier()
        stamps = [time.perf_counter()]
        ev0.record()  # the transport issues on the current stream
        request = t.start(x, counts_dev, row_bytes)
        ev1.record()
        stamps.append(time.perf_counter())
        comm.engine.wait_host(request, "p2p", None)
        stamps.append(time.perf_counter())
        send, recv, _ = t.counts()
        out = torch.empty((sum(recv), row_elems), dtype=x.dtype, device=dev)
        request.join()
        stamps.append(time.perf_counter())
        t.finish(x, out, send, recv, row_bytes).join()
        stamps.append(time.perf_counter())
        torch.cuda.synchronize(dev)
        stamps.append(time.perf_counter())
        for i, k in enumerate(names):
            marks[k].append((stamps[i + 1] - stamps[i]) * 1e6)
        marks["gpu kernels+copy"].append(ev0.elapsed_time(ev1) * 1e3)
    return {k: float(np.median(v)) for k, v in marks.items()}


def _per_peer(bench: Bench, iters: int, blocks=(1, 2, 4, 8, 16, 32, 64)) -> dict:
    """Host time of the native grouped issue with ``n`` send/recv pairs per peer (microseconds,
    medians), and the least-squares slope: microseconds per extra pair."""
    comm = bench.comm
    b = comm.engine.backend
    if b._native is None:
        return {}
    W, me = comm.size, comm.rank
    row_bytes = 16
    peers = [p for p in range(W) if p != me]
    n_max = max(blocks)
    x = torch.zeros(n_max * len(peers) * 4, row_bytes, dtype=torch.uint8, device=comm.device)
    out = torch.empty_like(x)
    medians = {}
    for n in blocks:
        ranks = [p for p in peers for _ in range(n)]
        counts = [4] * len(ranks)
        times = []
        for _ in range(iters):
            bench.world.Barrier()
            h = b.begin(x, out)
            t0 = time.perf_counter()
            b._native.alltoallv(b._comm_ptr, h, x.data_ptr(), out.data_ptr(), counts, counts, row_bytes, (), (),
                                ranks)
            times.append((time.perf_counter() - t0) * 1e6)
            b.end("all_to_all_v").join()
            torch.cuda.synchronize(comm.device)
        medians[n] = float(np.median(times))
    pairs = np.array([n * len(peers) for n in blocks], dtype=np.float64)
    slope, _ = np.polyfit(pairs, np.array([medians[n] for n in blocks]), 1)
    return {**{f"{n} per peer": t for n, t in medians.items()}, "us per extra pair (slope)": float(slope)}


def main(argv: Optional[list[str]] = None) -> dict:
    p = RankZeroParser(prog=prog(__spec__.name), description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256K,1M,16M", help="bytes per rank, comma list (256K,1M,16M)")
    p.add_argument("--row-elems", type=int, default=2048)
    p.add_argument("-n", "--iters", type=int, default=200)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--per-peer", action="store_true", help="also the native issuer's host cost per peer")
    p.add_argument("--only-per-peer", action="store_true", help="only that")
    args = p.parse_args(argv)
    # bench.alltoall's own parser: every option it has gets its default
    bench_args = build_parser().parse_args(["--backend", "nccl", "--timeout", "120", "-d", "bfloat16", "--compare",
                                            "-w", "10", "-n", str(args.iters), "--row-elems", str(args.row_elems),
                                            "--p2p-bytes", "1G"])
    bench = Bench(bench_args)
    report: dict = {"sizes": {}}
    if args.per_peer or args.only_per_peer:
        report["per peer"] = _per_peer(bench, args.iters)
        if bench.comm.rank == 0:
            print("# host time of the native grouped issue, n send/recv pairs per peer (us, median): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in report["per peer"].items()), flush=True)
    for text in ([] if args.only_per_peer else args.sizes.split(",")):
        size = parse_size(text)
        timed = bench.time_methods(_methods(bench, size, args.row_elems))
        row = {name: float(np.median(t)) * 1e6 for name, (t, _) in timed.items()}
        row["phases of gpu-counts"] = _phases(bench, size, args.row_elems, args.iters)
        row["host steps of issuing known counts"] = _issue_steps(bench, size, args.row_elems, args.iters)
        if bench.p2p is not None:
            row["steps of p2p"] = _p2p_steps(bench, size, args.row_elems, args.iters)
        report["sizes"][text] = row
        if bench.comm.rank == 0:
            print(f"# {text} per rank, {bench.comm.size} ranks: median us per call (slowest rank)", flush=True)
            for name, us in row.items():
                text = ", ".join(f"{k} {v:.1f}" for k, v in us.items()) if isinstance(us, dict) else f"{us:9.1f}"
                print(f"  {name:>20}: {text}", flush=True)
    if args.json and bench.comm.rank == 0:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return report


if __name__ == "__main__":
    main()
