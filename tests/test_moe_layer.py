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


@pytest.mark.parametrize("nprocs", [1, 2, 4])
@pytest.mark.ranks_job("tests.ranks.layer_disagreement", timeout=120)
def test_ranks_that_disagree(nprocs, ranks_job):
    """Issue 34 items 2 and 3: a layer whose ranks differ in a setting (or in the token count
    with inequivalent_tokens=False) raises CountMismatchError naming it on every rank; ranks
    in different collectives time out by name, without corrupting memory."""
    assert f"checks passed on {nprocs} ranks" in ranks_job()


def test_negative_counts_are_refused():
    """Issue 34 item 2: counts from ranks out of step (a negative one) are refused before a
    row map sized by their sum is written (torch.repeat_interleave(output_size=) wrote past
    it: the heap corruption)."""
    import torch

    from moecomm.collectives.blocks import _device_index
    from moecomm.errors import CountMismatchError
    from moecomm.moe._ops import comm as _comm
    from moecomm.moe._ops.segments import Segments

    with pytest.raises(ValueError, match=r"counts\[1\] = \[1, -1\]"):
        Segments([[2, 3], [1, -1]], 2, counts_dev=torch.tensor([[2, 3], [1, -1]]))

    class Comm:
        rank = 0

    with pytest.raises(CountMismatchError, match=r"rank 1 \(\[1, -1\]\)"):
        _comm.check_received_counts([2, 3, 1, -1], Comm(), 2)
    _comm.check_received_counts([2, 3, 1, 0], Comm(), 2)
    with pytest.raises(ValueError, match="block counts must be >= 0"):
        _device_index([3, 2, -1], [2, 1, 0], torch.device("cpu"))
