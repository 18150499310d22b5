"""Launch real MPI ranks from pytest, and helpers for code running inside them."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Time limit of one launch of ranks. The slowest launch took 75 s on 2 cores at a load
# average of up to 24 (README, "Set up"): the limit stays far above that on a busy machine
# and still ends a hung launch within pytest's own limit (setup.cfg).
RANKS_TIMEOUT_S = 600.0
# The communicators' own timeout inside the ranks (MOECOMM_TIMEOUT), for a peer that is slow
# to reach a collective (importing torch on a busy machine), unless a test sets its own.
RANKS_COMM_TIMEOUT_S = "120"


def run_ranks(nprocs: int, module: str, *args: str, timeout: float = RANKS_TIMEOUT_S, env: dict | None = None) -> str:
    """Run ``python -m module args`` on ``nprocs`` MPI ranks; fail the test unless all exit 0.

    Returns the ranks' combined output.
    """
    full_env = dict(os.environ)
    full_env.setdefault("MOECOMM_TIMEOUT", RANKS_COMM_TIMEOUT_S)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.setdefault("OMP_NUM_THREADS", "1")
    # Open MPI's mpiexec refuses root without these (the GPU machine runs as root); mpich ignores them
    full_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    full_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    if env:
        full_env.update(env)
    cmd = ["mpiexec", "-n", str(nprocs), sys.executable, "-m", module, *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout[-8000:]}"
            f"\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc.stdout


def under_torchrun() -> bool:
    """True when the ranks were started by torchrun rather than an MPI launcher."""
    from moecomm.launch import detect_launcher

    return detect_launcher() == "torchrun"


def _allgather(obj):
    if under_torchrun():
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather(obj)


def init_gloo_over_mpi() -> None:
    """Inside MPI ranks: a torch.distributed gloo group over the same ranks (rank 0 picks a port)."""
    import socket

    import torch.distributed as dist
    from mpi4py import MPI

    if dist.is_initialized():
        return
    world = MPI.COMM_WORLD
    port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank, world_size=world.size)


def world_rank() -> int:
    if under_torchrun():
        return int(os.environ["RANK"])
    from mpi4py import MPI

    return MPI.COMM_WORLD.rank


def world_barrier() -> None:
    _allgather(None)


def collective_assert(ok: bool, message: str = "") -> None:
    """Inside ranks: fail on every rank if any rank's ``ok`` is False (no hang)."""
    flags = _allgather((bool(ok), message))
    bad = [(r, m) for r, (f, m) in enumerate(flags) if not f]
    if bad:
        raise AssertionError("; ".join(f"rank {r}: {m}" for r, m in bad))


def rank_main(checks: Sequence) -> None:
    """Run ``checks`` (callables) in order on every rank; exit non-zero on any failure."""
    import traceback

    rank = world_rank()
    for check in checks:
        if rank == 0 and os.environ.get("MOECOMM_TEST_VERBOSE"):
            print(f"[rank 0] {check.__name__} ...", flush=True)
        try:
            check()
        except BaseException:  # noqa: BLE001 - report and stop every rank
            print(f"[rank {rank}] FAILED {check.__name__}\n{traceback.format_exc()}", flush=True)
            if under_torchrun():
                os._exit(1)
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
    size = len(_allgather(None))
    if rank == 0:
        print(f"{len(checks)} checks passed on {size} ranks", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():  # gloo's threads must stop before the interpreter does
        dist.barrier()
        dist.destroy_process_group()
