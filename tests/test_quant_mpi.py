"""``wire_dtype`` exchanges on real MPI ranks (K = 1, 2, 3, 4, 8): tests/ranks/quant_checks.py."""

import pytest

from tests.mpi_util import run_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 8])
def test_wire_dtype_exchanges(nprocs):
    out = run_ranks(nprocs, "tests.ranks.quant_checks", timeout=240)
    assert f"checks passed on {nprocs} ranks" in out
