"""2DH on CUDA: one process per GPU under torchrun, torch backend over an NCCL group
(needs 2 GPUs; skipped elsewhere)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.mpi_util import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("local_size", [1, 2])
def test_2dh_on_gpus(local_size):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
           "tests.ranks.hierarchical_gpu", "--local-size", str(local_size)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.count("2dh failures: 0 []") == 2
