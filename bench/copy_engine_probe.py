"""Diagnostic: copy engines against NCCL, alone and beside a GEMM (2 GPUs of one node).

Run: ``mpirun -np 2 python -m bench.copy_engine_probe``. For each size it times, on both
ranks at once (every rank sends ``B`` bytes to its peer):

  ce_peer     one ``cudaMemcpyAsync`` into the peer's arena (CUDA IPC, copy engine)
  ce_peer4    the same bytes as 4 copies on 4 streams
  ce_local    one device-local ``cudaMemcpyAsync`` of ``B`` bytes
  nccl        ``all_to_all_v`` with known counts, ``B`` bytes to the peer and ``B`` to itself

then a two-matmul FFN alone, and the FFN on the current stream while each transfer runs on a
side stream: how much the FFN slows down and how long the transfer takes beside it. The
question it answers: whether an exchange moved by copy engines hides behind expert compute
better than NCCL's kernels, which take SMs from the GEMMs.
"""

from __future__ import annotations

import json
from typing import Callable

import numpy as np
import torch

import moecomm
from moecomm.backends import _cudart

from ._common import prog
from ._topology import RankZeroParser

__all__ = ["main"]


def _median_ms(fn: Callable[[], None], iters: int, world) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        world.Barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return float(np.median(out))


def main(argv=None) -> None:
    from mpi4py import MPI

    p = RankZeroParser(prog=prog(__spec__.name), description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="16,64,128")
    p.add_argument("--rows", type=int, default=16384, help="FFN rows (model 4096, hidden 1024)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    world = MPI.COMM_WORLD
    sizes = [int(s) << 20 for s in a.sizes_mib.split(",")]
    comm = moecomm.init("nccl", p2p_bytes=max(sizes) + (64 << 20))
    dev = comm.device
    torch.cuda.set_device(dev)
    t = comm.engine.peer
    peer_base = t._opened[0] + t.data_off
    src = torch.randn(max(sizes) // 2, device=dev, dtype=torch.bfloat16)
    local = torch.empty_like(src)
    both = torch.empty(2 * max(sizes), device=dev, dtype=torch.uint8)
    streams = [torch.cuda.Stream(dev) for _ in range(4)]
    x = torch.randn(a.rows, 4096, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16) / 64
    w2 = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16) / 32
    D2D = _cudart._rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice

    def ffn() -> None:
        for _ in range(4):
            torch.nn.functional.gelu(x @ w1) @ w2

    def ce_peer(nbytes: int, parts: int = 1) -> Callable[[], None]:
        def go() -> None:
            cur = torch.cuda.current_stream()
            step = nbytes // parts
            for i in range(parts):
                s = streams[i]
                s.wait_stream(cur)
                _cudart.copy_async(peer_base + i * step, src.data_ptr() + i * step, step, D2D, s.cuda_stream)
            for i in range(parts):
                cur.wait_stream(streams[i])
        return go

    def ce_local(nbytes: int) -> Callable[[], None]:
        def go() -> None:
            cur = torch.cuda.current_stream()
            streams[0].wait_stream(cur)
            _cudart.copy_async(local.data_ptr(), src.data_ptr(), nbytes, D2D, streams[0].cuda_stream)
            cur.wait_stream(streams[0])
        return go

    def nccl(nbytes: int) -> Callable[[], None]:
        rows = nbytes // 4096
        xb = both[: 2 * rows * 4096].view(2 * rows, 4096)

        def go() -> None:
            comm.all_to_all_v(xb, [rows, rows], [rows, rows])
        return go

    def beside(transfer: Callable[[], None]) -> tuple[float, float]:
        """(FFN ms, transfer ms) with the transfer issued on a side stream just before the FFN."""
        side = torch.cuda.Stream(dev)
        f, c = [], []
        for it in range(a.iters + 3):
            world.Barrier()
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            with torch.cuda.stream(side):
                e[0].record()
                transfer()
                e[1].record()
            e[2].record()
            ffn()
            e[3].record()
            cur.wait_stream(side)
            torch.cuda.synchronize()
            if it >= 3:
                c.append(e[0].elapsed_time(e[1]))
                f.append(e[2].elapsed_time(e[3]))
        return float(np.median(f)), float(np.median(c))

    rows = []
    ffn_ms = _median_ms(ffn, a.iters, world)
    for nbytes in sizes:
        row = {"bytes": nbytes, "ffn_alone_ms": ffn_ms}
        for name, fn in (("ce_peer", ce_peer(nbytes)), ("ce_peer4", ce_peer(nbytes, 4)),
                         ("ce_local", ce_local(nbytes)), ("nccl", nccl(nbytes))):
            ms = _median_ms(fn, a.iters, world)
            row[name + "_ms"] = ms
            row[name + "_GBps"] = nbytes / ms / 1e6
            if name != "ce_local":
                fm, cm = beside(fn)
                row[name + "_beside_ffn_ms"] = fm
                row[name + "_beside_xfer_ms"] = cm
        rows.append(row)
        if comm.rank == 0:
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if a.json and comm.rank == 0:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    comm.close()


if __name__ == "__main__":
    main()
