"""scatter_compute_gather (moecomm.overlap) on real MPI ranks: equivalence with the
non-overlapped path (bit for bit), gradients, per-expert grouping, algorithm pass-through,
argument errors and fn failures (tests/ranks/overlap_checks.py holds the checks), each world
size in the shared launch of its size (tests/conftest.py)."""

import pytest

pytestmark = pytest.mark.mpi

ALL = "equivalence,own_first,split_forms,gradients,group_order,algorithm_passthrough,hypothesis,bad_arguments"


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 8])
# fn failures cost two communicator timeouts each: on 2 and 4 ranks only (1 rank has no peers)
@pytest.mark.ranks_job("tests.ranks.overlap_checks",
                       args=lambda n: ["mpi", ALL + (",fn_errors" if n in (2, 4) else "")])
def test_overlap_mpi_backend(nprocs, ranks_job):
    assert f"checks passed on {nprocs} ranks" in ranks_job()


# gloo cannot abandon a collective in flight, so fn failures are not run here: after an
# abort the process group itself is out of step (see docs/overlap.md, "Failures")
@pytest.mark.ranks_job("tests.ranks.overlap_checks", "torch", "equivalence,own_first,gradients", nprocs=2)
def test_overlap_torch_backend(ranks_job):
    assert "checks passed on 2 ranks" in ranks_job()
