"""The fault campaign's representative subset (``tests/faults``; the full matrix: ``python -m tests.faults``).

Each case kills, stalls or fails one rank at one phase on real ``mpiexec`` ranks with a 3 s
timeout, and checks that every other rank raises a named error in time (or finished without
needing the victim) and that the job ends within the timeout + 10 s.
"""

from __future__ import annotations

import shutil

import pytest

from tests.faults.campaign import SUBSET, run_all

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")


def test_fault_subset():
    lines: list[str] = []
    failures = run_all(SUBSET, jobs=3, timeout_s=3.0, echo=lines.append)
    assert not failures, "\n".join(lines + failures)


def test_exit_hook_reads_timeouts_in_the_chain():
    from moecomm.backends._exit import _timed_out

    try:
        try:
            raise TimeoutError("moecomm: all_to_all_v did not complete within 3 s")
        except TimeoutError as exc:
            raise RuntimeError("training step failed") from exc
    except RuntimeError as outer:
        chained = outer
    assert _timed_out(chained) and _timed_out(TimeoutError()) and not _timed_out(ValueError("x"))
    assert not _timed_out(None)


def test_agreement_on_one_rank():
    pytest.importorskip("mpi4py")
    from moecomm.launch import mpi_agree, mpi_world

    world = mpi_world()
    assert mpi_agree(world, b"host-a", timeout_s=5, what="moecomm.init") == [b"host-a"]
    with pytest.raises(ValueError, match="max_ctas"):
        mpi_agree(world, ValueError("max_ctas applies to the NCCL backend only"), timeout_s=5, what="moecomm.init")
    long = ValueError("x" * 1000)  # longer than the agreement carries: cut, and the rank's own error raised
    with pytest.raises(ValueError, match="^x{1000}$"):
        mpi_agree(world, long, timeout_s=5, what="moecomm.init")
