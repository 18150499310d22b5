"""Every core collective on real MPI ranks (K = 1, 2, 3, 4, 8), MPI and torch (gloo) backends.

The ranks_job tests run in the shared launch of their world size (tests/conftest.py)."""

import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 8])
@pytest.mark.ranks_job("tests.ranks.core_collectives", "mpi")
def test_collectives_mpi_backend(nprocs, ranks_job):
    assert f"checks passed on {nprocs} ranks" in ranks_job()


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.ranks_job("tests.ranks.core_collectives", "torch")
def test_collectives_torch_backend(nprocs, ranks_job):
    assert f"checks passed on {nprocs} ranks" in ranks_job()


def test_collectives_under_torchrun():
    """``torchrun`` on CPU: moecomm.init() finds torchrun's variables and runs over gloo, and no
    rank warns (``init`` once raised torch's ``all_gather_into_tensor`` FutureWarning)."""
    import os
    import subprocess
    import sys

    from tests.mpi_util import RANKS_COMM_TIMEOUT_S, RANKS_TIMEOUT_S, ROOT

    env = dict(os.environ, MOECOMM_TIMEOUT=RANKS_COMM_TIMEOUT_S, PYTHONPATH=ROOT)
    for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.ranks.core_collectives", "torch"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RANKS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "checks passed on 2 ranks" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr[-6000:]
