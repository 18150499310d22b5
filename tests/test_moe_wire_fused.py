"""The MoE layer's fused FP8 dispatch against the unfused one, bit for bit, and
``Communicator.all_to_all_v_packed``, on real ranks: tests/ranks/moe_wire_fused.py."""

import pytest
import torch

from tests.mpi_util import run_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.ranks_job("tests.ranks.moe_wire_fused", nprocs=3, timeout=300)
def test_fused_wire_dispatch(ranks_job):
    """3 ranks (in the shared launch of 3, tests/conftest.py): the layer and dispatch checks on
    3 ranks, and on 2 and 1 (sub-communicators)."""
    assert "checks passed on 3 ranks" in ranks_job()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_wire_dispatch_on_one_gpu():
    """One NCCL rank: the layer does not exchange (nothing is quantized), so the fused
    gather + packed exchange (the CUDA gather_pack kernel) is checked directly against the
    unfused dispatch + wire exchange, with gradients, besides the layer checks."""
    out = run_ranks(1, "tests.ranks.moe_wire_fused", "nccl", timeout=300)
    assert "checks passed on 1 ranks" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fused_wire_dispatch_on_two_gpus():
    out = run_ranks(2, "tests.ranks.moe_wire_fused", "nccl", timeout=300, env={"NCCL_NVLS_ENABLE": "0"})
    assert "checks passed on 2 ranks" in out
