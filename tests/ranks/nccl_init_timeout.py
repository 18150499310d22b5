"""NCCL's blocking calls under a deadline, on 2 GPUs (``mpirun -n 2``): rank 1 never joins.

1. Split: both ranks make a communicator; rank 0 splits it while rank 1 does not; rank 0 gets
   a ``TimeoutError`` naming ``ncclCommSplit``, and afterwards the communicator refuses work
   (it raises that error) instead of touching NCCL under the abandoned split.
2. Communicator creation: rank 0 calls ``NcclBackend.create`` with a 3 s timeout while rank 1
   does not; rank 0 gets a ``TimeoutError`` naming ``ncclCommInitRank`` within seconds.

The abandoned NCCL calls stay blocked in their threads, so the ranks finalize MPI and leave with
``os._exit``.
"""

from __future__ import annotations

import os
import time

import torch
from mpi4py import MPI

from moecomm.backends.nccl import NcclBackend


def _timed(fn) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
        msg = "no error"
    except TimeoutError as exc:
        msg = str(exc)
    return msg, time.monotonic() - start


def main() -> int:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    ok = True

    uid = world.bcast(NcclBackend.new_unique_id() if rank == 0 else None, root=0)
    backend = NcclBackend.create(2, rank, uid, dev, 3.0)
    world.Barrier()
    if rank == 0:
        msg, took = _timed(lambda: backend.split(0, 0, [[0, 0], [0, 1]]))
        good = msg.startswith("moecomm: ncclCommSplit did not complete within 3 s on rank 0") and took < 30
        try:
            backend.check_health()
            after = "no error"
        except TimeoutError as exc:
            after = str(exc)
        good = good and after == msg
        print(f"split timeout: {'ok' if good else 'FAILED'} after {took:.1f} s: {msg}; afterwards: {after}",
              flush=True)
        ok &= good
    uid = world.bcast(NcclBackend.new_unique_id() if rank == 0 else None, root=0)
    if rank == 0:
        msg, took = _timed(lambda: NcclBackend.create(2, 0, uid, dev, 3.0))
        good = msg.startswith("moecomm: ncclCommInitRank did not complete within 3 s on rank 0") and took < 30
        print(f"init timeout: {'ok' if good else 'FAILED'} after {took:.1f} s: {msg}", flush=True)
        ok &= good
    world.Barrier()

    ok = world.allreduce(ok, op=MPI.LAND)
    if rank == 0:
        print("nccl deadline checks " + ("passed" if ok else "FAILED"), flush=True)
    MPI.Finalize()  # (os._exit skips mpi4py's own finalize, which Open MPI's mpirun requires)
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
