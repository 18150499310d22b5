"""What issuing GPU work costs the host when several processes share one GPU (issue 26).

Run with any number of processes (``mpirun -n 4 python -m bench.launch_cost``), under MPS or
not; no moecomm communicator is made. Each process issues batches of one kind of operation on
its current CUDA device and times the host side only (the batch is synchronised after it is
timed, so CUDA's launch queue never fills): ``add`` (one elementwise kernel), ``gemm`` (a
64 x 64 bf16 matrix product: cuBLAS), ``copy`` (a 4 KiB device copy), ``event`` (an event
recorded on one stream and waited on by another) and ``cpu`` (a Python loop with no CUDA
call: how fast the process's core is while the others run). Every process runs the same
kinds at the same time (an MPI barrier before each); rank 0 prints the per-operation median
(microseconds) of the fastest, median and slowest process.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import numpy as np
import torch


def _kinds(dev: torch.device) -> dict[str, Callable[[], object]]:
    x = torch.zeros(1024, device=dev)
    a = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    c = torch.empty(64, 64, device=dev, dtype=torch.bfloat16)
    src = torch.zeros(1024, device=dev)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    box = {"s": 0}

    def event() -> None:
        ev.record()
        side.wait_event(ev)

    def cpu() -> None:
        s = 0
        for i in range(200):
            s += i
        box["s"] = s

    return {"add": lambda: x.add_(1.0), "gemm": lambda: torch.mm(a, a, out=c), "copy": lambda: dst.copy_(src),
            "event": event, "cpu": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=100, help="operations per timed batch")
    p.add_argument("-n", type=int, default=30, help="timed batches per kind")
    args = p.parse_args()
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", "0")))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    kinds = _kinds(dev)
    rows = []
    for name, op in kinds.items():
        for _ in range(3):
            op()
        torch.cuda.synchronize(dev)
        world.Barrier()
        per_op = []
        for _ in range(args.n):
            t0 = time.perf_counter()
            for _ in range(args.batch):
                op()
            per_op.append((time.perf_counter() - t0) / args.batch * 1e6)
            torch.cuda.synchronize(dev)
        med = float(np.median(per_op))
        every = world.gather(med, root=0)
        if world.rank == 0:
            rows.append((name, min(every), float(np.median(every)), max(every)))
    if world.rank == 0:
        cpus = os.sched_getaffinity(0)
        print(f"# launch cost: {world.size} process(es) on {torch.cuda.get_device_name(dev)}, MPS "
              f"{'on' if os.environ.get('CUDA_MPS_PIPE_DIRECTORY') else 'off'}, rank 0 may run on {len(cpus)} "
              f"core(s), {os.cpu_count()} in all; us per operation (median of {args.n} batches of {args.batch})")
        print(f"{'kind':>6} {'fastest':>9} {'median':>9} {'slowest':>9}")
        for name, lo, mid, hi in rows:
            print(f"{name:>6} {lo:>9.2f} {mid:>9.2f} {hi:>9.2f}")


if __name__ == "__main__":
    main()
