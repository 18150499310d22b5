"""The fault campaign: every case launches ``mpiexec -n K python -m tests.faults.rank ...``.

A case passes when the job ends within ``timeout + 10 s`` of the phase's start (the exit hook
of :mod:`moecomm.backends._exit` aborts a job whose peers never come), and every rank other than the
victim either finished the phase (it did not need the victim after the fault) or raised a
named error within ``2 * timeout + 2 s``: ``TimeoutError`` saying what did not complete,
``RuntimeError`` naming the victim's rank, or ``PeerFailedError`` quoting the victim's failure
(the victim's failure notice, MPI: see moecomm.engine.notices); and at least one of them raised.

``python -m tests.faults [--ranks 2,3,4] [--phases ...] [--kinds ...] [--subset] [--jobs N] [--timeout S]
[--launcher "mpirun --allow-run-as-root"]``
runs the full matrix (or a part of it) and prints one line per case.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

from .rank import KINDS, PHASES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
END_SLACK_S = 10.0


@dataclasses.dataclass(frozen=True)
class Case:
    ranks: int
    phase: str
    kind: str
    victim: int

    @property
    def name(self) -> str:
        return f"{self.phase}-{self.kind}-n{self.ranks}-v{self.victim}"


def all_cases() -> list[Case]:
    """Every phase x kind on 2, 3 and 4 ranks (the 2DH phases on 2 x 2 only, init over a torch
    process group with kind ``raise`` only); the victim is
    the last rank, or rank 1 for the 2DH phases (so that both its node and its rail lose it)."""
    out = []
    for n in (2, 3, 4):
        for phase in PHASES:
            if phase.startswith("2dh") and n != 4:
                continue
            for kind in KINDS:
                if phase == "init-torch" and kind != "raise":
                    continue  # a gloo group waits with its own timeout and words; only a refused argument
                out.append(Case(n, phase, kind, 1 if phase.startswith("2dh") else n - 1))
    return out


SUBSET = [  # what pytest runs: each phase and kind at least once, each world size
    Case(3, "init", "raise", 1),   # issue 14, finding 3
    Case(2, "init-torch", "raise", 1),
    Case(2, "rows", "sleep", 1),   # issue 14, finding 4
    Case(4, "counts", "exit", 3),
    Case(3, "split", "sleep", 2),
    Case(4, "2dh-rail", "raise", 1),
    Case(3, "overlap", "exit", 2),
    Case(2, "moe", "sleep", 1),
]


def run_case(case: Case, timeout_s: float = 3.0, launcher: str = "mpiexec") -> tuple[list[str], str]:
    """Run one case; returns (problems, a one-line summary). No problems: it passed."""
    with tempfile.TemporaryDirectory(prefix="moecomm-faults-") as out:
        env = dict(os.environ, MOECOMM_TIMEOUT=str(timeout_s), FAULTS_DIR=out, OMP_NUM_THREADS="1",
                   MOECOMM_EXT_DISABLE="1", FAULTS_HANG_S=str(4 * timeout_s + 30),
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [*shlex.split(launcher), "-n", str(case.ranks), sys.executable, "-m", "tests.faults.rank",
               case.phase, case.kind, str(case.victim)]
        limit = 8 * timeout_s + 120  # a job that hangs (start-up included) is stopped here and fails
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, output = None, str(exc.stdout or "")
        end = time.time()
        lines = {}
        for r in range(case.ranks):
            path = os.path.join(out, f"rank{r}.txt")
            lines[r] = open(path).read().splitlines() if os.path.exists(path) else []
    problems = judge(case, timeout_s, rc, end, lines)
    if problems:
        problems.append("output tail:\n" + output[-3000:])
    errs = [ln.split(" type=")[1].split(" ")[0] for r in lines for ln in lines[r] if ln.startswith("error")
            and r != case.victim]
    started = [float(ln.split("t=")[1]) for r in lines for ln in lines[r] if ln.startswith("start")]
    took = end - min(started) if started else float("nan")
    summary = f"{case.name:28s} rc={rc} ended {took:5.1f} s after the phase began; survivors raised {errs}"
    return problems, summary


def judge(case: Case, timeout_s: float, rc, end: float, lines: dict) -> list[str]:
    problems = []
    if rc is None:
        return [f"{case.name}: mpiexec did not return (hung)"]
    starts = [float(ln.split("t=")[1]) for r in lines for ln in lines[r] if ln.startswith("start")]
    if len(starts) != case.ranks:
        return [f"{case.name}: only {len(starts)} of {case.ranks} ranks reached the phase (rc {rc})"]
    if end - min(starts) > timeout_s + END_SLACK_S:
        problems.append(f"{case.name}: the job ended {end - min(starts):.1f} s after the phase began "
                        f"(limit {timeout_s + END_SLACK_S:g} s)")
    raised = 0
    for r in range(case.ranks):
        if r == case.victim:
            continue
        result = [ln for ln in lines[r] if not ln.startswith("start")]
        if not result:
            problems.append(f"{case.name}: rank {r} neither finished nor raised")
            continue
        line = result[0]
        if line.startswith("done"):
            continue
        raised += 1
        m = re.match(r"error rank=\d+ after=([\d.]+) type=(\w+) msg=(.*)", line)
        if m is None:
            problems.append(f"{case.name}: rank {r}: unreadable result {line!r}")
            continue
        after, kind, msg = float(m.group(1)), m.group(2), m.group(3)
        victim_told = f"rank {case.victim} failed its call" in msg or f"rank {case.victim} aborted" in msg
        named = ((kind == "TimeoutError" and "did not complete within" in msg and msg.startswith("moecomm"))
                 or (kind == "RuntimeError" and f"failed on rank {case.victim}" in msg)
                 or (kind == "PeerFailedError" and victim_told))
        if not named:
            problems.append(f"{case.name}: rank {r} raised {kind}: {msg} (not a named timeout or failure)")
        if after > 2 * timeout_s + 2:
            problems.append(f"{case.name}: rank {r} raised after {after:.1f} s (limit {2 * timeout_s + 2:g} s)")
    if raised == 0:
        problems.append(f"{case.name}: no rank noticed the fault")
    elif rc == 0:
        problems.append(f"{case.name}: ranks raised but mpiexec returned 0")
    return problems


def run_all(cases: list[Case], jobs: int, timeout_s: float, echo=print, launcher: str = "mpiexec") -> list[str]:
    """Run ``cases``, ``jobs`` at a time; returns one report per failed case (none: all passed)."""
    failures: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for case, (probs, summary) in zip(cases, pool.map(lambda c: run_case(c, timeout_s, launcher), cases)):
            echo(("FAIL " if probs else "ok   ") + summary)
            if probs:
                failures.append("\n".join(probs))
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,3,4", help="world sizes (comma separated)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--subset", action="store_true", help="only the cases pytest runs")
    ap.add_argument("--jobs", type=int, default=3, help="cases run at once")
    ap.add_argument("--timeout", type=float, default=3.0, help="MOECOMM_TIMEOUT of the ranks, seconds")
    ap.add_argument("--launcher", default="mpiexec",
                    help='the MPI launcher and its options, e.g. "mpirun --allow-run-as-root" (Open MPI)')
    a = ap.parse_args(argv)
    sizes = {int(n) for n in a.ranks.split(",")}
    phases, kinds = set(a.phases.split(",")), set(a.kinds.split(","))
    cases = [c for c in (SUBSET if a.subset else all_cases())
             if c.ranks in sizes and c.phase in phases and c.kind in kinds]
    t0 = time.monotonic()
    failures = run_all(cases, a.jobs, a.timeout, echo=lambda s: print(s, flush=True), launcher=a.launcher)
    print(f"{len(cases)} cases, {len(cases) - len(failures)} passed, in {time.monotonic() - t0:.0f} s", flush=True)
    for f in failures:
        print(f)
    return 1 if failures else 0
