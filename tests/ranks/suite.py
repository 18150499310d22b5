"""Several rank scripts in one launch of ranks (run by tests/mpi_util.py's shared launches).

    mpiexec -n K python -m tests.ranks.suite JOBS.json

``JOBS.json`` holds a list of jobs ``{"id", "module", "args", "env", "timeout"}``; every
rank runs them in order, each as ``python -m module args`` would (``runpy``, a fresh module
namespace, ``sys.argv`` and the job's environment variables set, torch's global generator
reseeded as in a fresh process), so that one launch pays for starting Python, torch and MPI
once instead of once per script. Every job stays runnable alone: ``mpiexec -n K python -m
module args``.

Rank 0 prints ``@@ranks-job begin|passed|failed ID`` around each job (tests/mpi_util.py cuts
the output into one section per job). A job whose check failed on every rank at once
(:func:`tests.mpi_util.collective_assert`) is reported failed and the next job runs; any
other failure, or a job running past its ``timeout`` (every thread's stack printed), ends the
whole launch with ``MPI_Abort`` as a single script's failure does.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import sys
import threading
import traceback

MARK = "@@ranks-job"


def _abort(rank: int, why: str) -> None:
    print(f"[rank {rank}] {why}", flush=True)
    sys.stderr.flush()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)


def _watchdog(rank: int, job_id: str, timeout: float) -> threading.Timer:
    def fire() -> None:
        print(f"[rank {rank}] {MARK} timeout {job_id}: still running after {timeout:g} s; stacks:", flush=True)
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        _abort(rank, f"job {job_id} timed out")

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    return timer


def run_job(job: dict, rank: int, seed: int) -> bool:
    """Run one job on this rank; True if it passed, False if a check failed on every rank."""
    import torch
    import torch.distributed as dist

    import moecomm
    from tests import mpi_util

    saved_env, saved_argv = dict(os.environ), sys.argv
    os.environ.update(job.get("env") or {})
    sys.argv = [job["module"], *job.get("args", [])]
    torch.manual_seed(seed)  # as a fresh process starts: scripts may rely on the same stream on every rank
    timer = _watchdog(rank, job["id"], float(job["timeout"]))
    try:
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
        passed = True
    except mpi_util.CheckFailedEverywhere:  # reported by rank_main; every rank is here
        passed = False
    except mpi_util.CollectiveAssertionError:  # in the script's set-up, before rank_main; every rank is here
        print(f"[rank {rank}] FAILED {job['id']} (set-up)\n{traceback.format_exc()}", flush=True)
        passed = False
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _abort(rank, f"job {job['id']} exited with {exc.code!r}")
        passed = True
    except BaseException:  # noqa: BLE001 - one rank failing must end the launch, not hang it
        print(f"[rank {rank}] {MARK} crashed {job['id']}\n{traceback.format_exc()}", flush=True)
        _abort(rank, f"job {job['id']} crashed")
        raise  # not reached
    finally:
        timer.cancel()
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    if dist.is_initialized():  # rank_main did not get to it (a failed check): gloo's threads stop
        dist.barrier()
        dist.destroy_process_group()
    moecomm.set_default_communicator(None)  # the next job starts without one, as a fresh process does
    sys.stdout.flush()
    mpi_util.world_barrier()
    return passed


def main() -> None:
    import torch

    from tests import mpi_util

    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    seed = torch.initial_seed()
    rank = mpi_util.world_rank()
    mpi_util.SHARED_LAUNCH = True
    failed = []
    for job in jobs:
        if rank == 0:
            print(f"{MARK} begin {job['id']}", flush=True)
        passed = run_job(job, rank, seed)
        if rank == 0:
            print(f"{MARK} {'passed' if passed else 'failed'} {job['id']}", flush=True)
        if not passed:
            failed.append(job["id"])
    if failed:
        if rank == 0:
            print(f"{len(failed)} of {len(jobs)} jobs failed: {', '.join(failed)}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
