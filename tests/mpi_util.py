"""Launch real MPI ranks from pytest, and helpers for code running inside them."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from typing import Callable, Sequence

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
    cmd, rc, stdout, stderr = launch_ranks(nprocs, module, *args, timeout=timeout, env=env)
    if rc is None:
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s\n{stdout[-6000:]}")
    if rc != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {rc}\n--- stdout ---\n{stdout[-8000:]}"
                    f"\n--- stderr ---\n{stderr[-8000:]}")
    return stdout


# -- shared launches: the rank scripts of one world size in one launch ---------------------


@dataclasses.dataclass(frozen=True)
class RankJob:
    """``python -m module args`` on ``nprocs`` ranks, as one job of a shared launch.

    ``env`` (pairs) is set inside the ranks for this job only; a value ``"{tmp}"`` becomes a
    new empty directory. ``timeout`` limits the job, in seconds (every thread's stack is
    printed and the launch ends).
    """

    nprocs: int
    module: str
    args: tuple = ()
    env: tuple = ()
    timeout: float = RANKS_TIMEOUT_S

    def command(self) -> str:
        """The job on its own (the same checks, one launch)."""
        words = [f"{k}={v}" for k, v in self.env] + ["mpiexec", "-n", str(self.nprocs), "python", "-m", self.module]
        return " ".join(words + list(self.args))

    @classmethod
    def from_marker(cls, marker, nprocs: int) -> "RankJob":
        """From ``@pytest.mark.ranks_job(module, *args, env={...}, timeout=s)``; ``args`` may be a
        function of the world size instead (``args=lambda n: [...]``)."""
        args = marker.kwargs["args"](nprocs) if "args" in marker.kwargs else marker.args[1:]
        return cls(nprocs, marker.args[0], tuple(str(a) for a in args),
                   tuple(sorted((marker.kwargs.get("env") or {}).items())),
                   float(marker.kwargs.get("timeout", RANKS_TIMEOUT_S)))


# The launch limit of a shared launch: below pytest's own per-test limit (setup.cfg), which
# the test that starts the launch pays for.
SHARED_LAUNCH_TIMEOUT_S = 840.0
_MARK = "@@ranks-job"


class SharedLaunches:
    """One launch per world size runs every selected job of that size (tests/ranks/suite.py);
    a test reads its own job's section of the output. Made once per pytest session
    (tests/conftest.py): ``plan`` holds the jobs of the collected tests, in test order."""

    def __init__(self) -> None:
        self.plan: dict[int, list[RankJob]] = {}
        self.tmp_dir = None  # a callable giving a new empty directory (set by the fixture)
        self.results: dict[int, dict] = {}
        self._done: dict[int, threading.Event] = {}  # the planned launches the background runs
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._running: subprocess.Popen | None = None  # the launch in progress

    def add(self, job: RankJob) -> None:
        jobs = self.plan.setdefault(job.nprocs, [])
        if job not in jobs:
            jobs.append(job)

    def start_background(self) -> None:
        """Run every planned launch, one at a time and the largest world size (the slowest)
        first, on a thread, while pytest runs the tests before the first that needs one
        (tests/conftest.py orders the single-process tests first). A test waits for its own
        launch only; one launch at a time, since a launch of several ranks already fills
        the cores."""
        if self._thread is not None or not self.plan:
            return
        order = sorted(self.plan, reverse=True)
        for nprocs in order:
            self._done[nprocs] = threading.Event()

        def run() -> None:
            for nprocs in order:
                try:
                    if not self._stopping.is_set():
                        self._launch(nprocs, list(self.plan[nprocs]))
                finally:
                    self._done[nprocs].set()

        self._thread = threading.Thread(target=run, name="shared-launches", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the background launches (the session is ending): none starts any more, and the
        one still running, whose output no test is left to read, is killed."""
        self._stopping.set()
        proc = self._running
        if proc is not None and proc.poll() is None:
            proc.terminate()  # mpiexec passes SIGTERM on to its ranks (a SIGKILL would orphan them)

    def output(self, job: RankJob) -> str:
        """The ranks' output of ``job`` (stdout, its section); fails the test unless the job
        passed and the launch exited 0."""
        if job.nprocs in self._done:
            self._done[job.nprocs].wait()
        res = self.results.setdefault(job.nprocs, {"ids": {}, "runs": []})
        if job not in res["ids"]:  # the first test of this size (or a job the plan did not hold)
            self.add(job)
            self._launch(job.nprocs, [j for j in self.plan[job.nprocs] if j not in res["ids"]])
        index, jid = res["ids"][job]
        run = res["runs"][index]
        status, rc = run["status"].get(jid), run["rc"]
        ended = "did not finish in time" if rc is None else f"exited with {rc}"
        others_failed = any(run["status"].get(j) != "passed" for j in run["jobs"])
        if status == "passed" and (rc == 0 or others_failed):  # the job that failed accounts for the exit status
            return run["sections"][jid]
        if status == "passed":
            why = f"its checks passed, but the launch {ended} (every job passed)"
        elif status == "failed":
            why = "a check failed on every rank"
        elif jid in run["sections"]:
            why = f"the launch {ended} while it ran"
        else:
            why = f"not reached: the launch {ended} before it"
        pytest.fail(f"{job.command()}: {why}\n(one job of the shared launch {run['cmd']})\n"
                    f"--- the job's output ---\n{run['sections'].get(jid, '')[-8000:]}\n"
                    f"--- the launch's stdout, end ---\n{run['stdout'][-3000:]}\n"
                    f"--- the launch's stderr, end ---\n{run['stderr'][-6000:]}")

    def _launch(self, nprocs: int, jobs: list[RankJob]) -> None:
        import json

        res = self.results.setdefault(nprocs, {"ids": {}, "runs": []})
        index = len(res["runs"])
        specs = []
        for i, job in enumerate(jobs):
            env = {k: (str(self.tmp_dir()) if v == "{tmp}" else v) for k, v in job.env}
            jid = f"{i}:{job.module.rsplit('.', 1)[-1]}"
            specs.append({"id": jid, "module": job.module, "args": list(job.args), "env": env,
                          "timeout": job.timeout})
        path = os.path.join(str(self.tmp_dir()), "jobs.json")
        with open(path, "w") as f:
            json.dump(specs, f, indent=1)
        timeout = min(SHARED_LAUNCH_TIMEOUT_S, sum(j.timeout for j in jobs) + 60)
        cmd, rc, stdout, stderr = launch_ranks(nprocs, "tests.ranks.suite", path, timeout=timeout,
                                               started=lambda proc: setattr(self, "_running", proc))
        self._running = None
        # rank 0 prints "@@ranks-job begin|passed|failed ID"; a section runs from one begin to the next
        lines: dict[str, list[str]] = {}
        status: dict[str, str] = {}
        current = None
        for line in stdout.splitlines(keepends=True):
            if line.startswith(_MARK + " "):
                what, _, jid = line[len(_MARK) + 1:].strip().partition(" ")
                if what == "begin":
                    current = jid
                    lines[jid] = []
                    continue
                if what in ("passed", "failed"):
                    status[jid] = what
            if current is not None:
                lines[current].append(line)
        res["runs"].append({"cmd": " ".join(cmd) + "  # " + ", ".join(s["id"] for s in specs),
                            "jobs": [s["id"] for s in specs], "rc": rc, "stdout": stdout, "stderr": stderr,
                            "sections": {j: "".join(v) for j, v in lines.items()}, "status": status})
        for job, spec in zip(jobs, specs):  # only now: a test reading res["ids"] finds its run there
            res["ids"][job] = (index, spec["id"])


def launch_ranks(nprocs: int, module: str, *args: str, timeout: float, env: dict | None = None,
                 started: Callable[[subprocess.Popen], None] | None = None):
    """``mpiexec -n nprocs python -m module args`` as run_ranks does; (cmd, rc or None, stdout, stderr).
    ``started`` is given the launch's process as soon as it runs (to end it early)."""
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
    with subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        if started is not None:
            started(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            return cmd, None, (stdout or "") + f"\n[did not finish within {timeout} s]", stderr or ""
    return cmd, proc.returncode, stdout, stderr


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


class CollectiveAssertionError(AssertionError):
    """Raised by :func:`collective_assert` on every rank at once."""


class CheckFailedEverywhere(Exception):
    """rank_main inside a shared launch (tests/ranks/suite.py): a check failed on every rank at
    once, and was reported; the launch goes on with its next job."""


# True inside tests/ranks/suite.py: a check failing on every rank at once ends its own job only
SHARED_LAUNCH = False


def collective_assert(ok: bool, message: str = "") -> None:
    """Inside ranks: fail on every rank if any rank's ``ok`` is False (no hang)."""
    flags = _allgather((bool(ok), message))
    bad = [(r, m) for r, (f, m) in enumerate(flags) if not f]
    if bad:
        raise CollectiveAssertionError("; ".join(f"rank {r}: {m}" for r, m in bad))


def rank_main(checks: Sequence) -> None:
    """Run ``checks`` (callables) in order on every rank; exit non-zero on any failure.

    In a shared launch (tests/ranks/suite.py) a check that failed on every rank at once
    (:func:`collective_assert`) raises :class:`CheckFailedEverywhere` instead, after the same
    report: the launch's next job runs. Any other failure ends the launch.
    """
    import traceback

    rank = world_rank()
    for check in checks:
        if rank == 0 and os.environ.get("MOECOMM_TEST_VERBOSE"):
            print(f"[rank 0] {check.__name__} ...", flush=True)
        try:
            check()
        except BaseException as exc:  # noqa: BLE001 - report and stop every rank
            print(f"[rank {rank}] FAILED {check.__name__}\n{traceback.format_exc()}", flush=True)
            if SHARED_LAUNCH and isinstance(exc, CollectiveAssertionError):
                raise CheckFailedEverywhere(check.__name__) from exc
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
