"""moecomm.moe.MoELayer on 1-4 MPI ranks against a dense single-process reference
(tests/ranks/moe_reference.py): outputs, gradients, dropped routes, capacities and aux losses
for both gates, k = 1..4, every capacity mode, dropless, sharded experts, data-parallel and
auto modes, overlap, 2dh, custom experts, and the bad configurations that need several ranks."""

from __future__ import annotations

import pytest

from tests.mpi_util import run_ranks



@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_layer_matches_dense_reference(nprocs):
    out = run_ranks(nprocs, "tests.ranks.moe_layer_checks", "all")
    assert f"checks passed on {nprocs} ranks" in out
