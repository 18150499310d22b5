"""2DH equals flat on real MPI ranks: 4, 6 and 8 ranks in every layout of the issue, plus
round-robin (non-consecutive) node layouts and nodes of unequal size.

Each launch runs, per layout: hypothesis-drawn variable splits with zeros over every
dtype (bfloat16, bool, float8, ...) and row shape (incl. zero-width rows), known and
unknown counts, sync and async; 2DH gradients against flat gradients; several async 2DH
exchanges in flight at once, waited out of order; and ``algorithm="auto"`` without a profile
(MOECOMM_PROFILE_DIR an empty directory). Each in the shared launch of its world size
(tests/conftest.py).
"""

import pytest

pytestmark = pytest.mark.mpi

LAYOUTS = {
    4: ["2x2", "1x4", "4x1", "rr2"],
    6: ["3x2", "2x3", "rr3", "uneq"],
    8: ["2x4", "4x2", "8x1", "1x8", "rr4"],
}


@pytest.mark.parametrize("nprocs", sorted(LAYOUTS))
@pytest.mark.ranks_job("tests.ranks.hierarchical_equiv", args=lambda n: LAYOUTS[n],
                       env={"MOECOMM_PROFILE_DIR": "{tmp}"})
def test_2dh_equals_flat(nprocs, ranks_job):
    assert f"checks passed on {nprocs} ranks" in ranks_job()
