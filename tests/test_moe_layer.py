"""moecomm.moe.MoELayer on 1-4 MPI ranks against a dense single-process reference
(tests/ranks/moe_reference.py): outputs, gradients, dropped routes, capacities and aux losses
for both gates, k = 1..4, every capacity mode, dropless, sharded experts, data-parallel and
auto modes, overlap, 2dh, custom and gated (SwiGLU, GeGLU) experts, and the bad configurations
that need several ranks; each world size in the shared launch of its size (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
@pytest.mark.ranks_job("tests.ranks.moe_layer_checks", "all")
def test_layer_matches_dense_reference(nprocs, ranks_job):
    assert f"checks passed on {nprocs} ranks" in ranks_job()


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.ranks_job("tests.ranks.moe_layer_checks", "unequal", timeout=120, env={"MOECOMM_TIMEOUT": "20"})
def test_layer_unequal_token_counts(nprocs, ranks_job):
    """Default options with different token counts per rank (one rank with none): outputs and
    every gradient equal the dense reference; no rank hangs or returns early."""
    assert f"checks passed on {nprocs} ranks" in ranks_job()
