"""moecomm.moe.MoELayer on 1-4 MPI ranks against a dense single-process reference."""

from __future__ import annotations

import pytest

from tests.mpi_util import run_ranks


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
@pytest.mark.timeout(150) if hasattr(pytest.mark, "timeout") else (lambda f: f)
def test_layer_matches_dense_reference(nprocs):
    out = run_ranks(nprocs, "tests.ranks.moe_layer_checks", "all", timeout=150)
    assert f"checks passed on {nprocs} ranks" in out
