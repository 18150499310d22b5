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
