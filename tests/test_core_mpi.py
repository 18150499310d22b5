"""Every core collective on real MPI ranks (K = 1, 2, 3, 4, 8), MPI and torch (gloo) backends."""

import pytest

from tests.mpi_util import run_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 8])
def test_collectives_mpi_backend(nprocs):
    out = run_ranks(nprocs, "tests.ranks.core_collectives", "mpi", timeout=420)
    assert f"checks passed on {nprocs} ranks" in out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_collectives_torch_backend(nprocs):
    out = run_ranks(nprocs, "tests.ranks.core_collectives", "torch", timeout=300)
    assert f"checks passed on {nprocs} ranks" in out
