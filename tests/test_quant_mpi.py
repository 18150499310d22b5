"""``wire_dtype`` exchanges on real MPI ranks (K = 1, 2, 3, 4, 8): tests/ranks/quant_checks.py (on CPU
in the shared launch of each world size, tests/conftest.py)."""

import pytest
import torch

from tests.mpi_util import run_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 8])
@pytest.mark.ranks_job("tests.ranks.quant_checks", timeout=240)
def test_wire_dtype_exchanges(nprocs, ranks_job):
    assert f"checks passed on {nprocs} ranks" in ranks_job()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("mode", ["nccl", "nccl-p2p"])
def test_wire_dtype_exchanges_on_gpus(mode):
    """The same checks through NCCL and through peer memory (copy engines, and the one-round
    exchange with counts on the GPU), plus a captured wire exchange replayed with new data."""
    out = run_ranks(2, "tests.ranks.quant_checks", mode, timeout=300, env={"NCCL_NVLS_ENABLE": "0"})
    assert "checks passed on 2 ranks" in out
