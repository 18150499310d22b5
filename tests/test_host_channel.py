"""The host channel of the short integer agreements (moecomm.backends._host_channel): real MPI ranks
run tests/ranks/host_channel_checks.py (channels of every size from 1 to the world's, against
numpy); the choice of channel for a group, without ranks."""

import types

import pytest

from tests.mpi_util import run_ranks


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [4])  # channels of 1, 2, 3 and 4 ranks, split from the 4
@pytest.mark.ranks_job("tests.ranks.host_channel_checks")  # in the shared launch of 4 ranks (tests/conftest.py)
def test_host_channel_on_ranks(nprocs, ranks_job):
    assert f"checks passed on {nprocs} ranks" in ranks_job()


def test_gloo_capable_follows_the_groups_cpu_backend(monkeypatch):
    """A group whose CPU collectives run on gloo gets a channel; an NCCL-only group, or an
    object torch does not know as a group, does not (its agreements stay on the device)."""
    import torch.distributed as dist

    from moecomm.backends._host_channel import gloo_capable

    names = {"g": "gloo", "mixed": "cpu:gloo,cuda:nccl", "n": "nccl"}

    def get_backend(group):
        if group not in names:
            raise ValueError("Invalid process group specified")
        return names[group]

    monkeypatch.setattr(dist, "get_backend", get_backend)
    assert gloo_capable("g") and gloo_capable("mixed")
    assert not gloo_capable("n") and not gloo_capable(types.SimpleNamespace())


def test_gloo_channel_allgather_raises_no_warning():
    """The gloo channel's all-gather (what ``moecomm.init`` runs under torchrun to build the
    topology profile) calls no deprecated torch function: no ``FutureWarning`` on any rank."""
    import os
    import subprocess
    import sys

    from tests.mpi_util import ROOT

    script = (
        "import warnings, torch.distributed as dist\n"
        "from moecomm.backends._host_channel import GlooHostChannel\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "warnings.simplefilter('error')\n"
        "chan = GlooHostChannel(dist.group.WORLD, 30.0)\n"
        "assert chan._allgather([3, -4], 30.0, 'test') == [[3, -4]]\n"
        "assert chan._allreduce([3, -4], 'max', 30.0, 'test') == [3, -4]\n"
        "dist.destroy_process_group()\n"
        "print('ok', flush=True)\n"
        # gloo's threads may abort the interpreter's own teardown ("terminate called without an
        # active exception", torch's, seen once in ten runs): what is checked is done by now
        "import os; os._exit(0)\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


_TWO_GPUS = pytest.mark.skipif(not __import__("torch").cuda.device_count() >= 2, reason="needs 2 CUDA GPUs")


@pytest.mark.gpu
@pytest.mark.mpi
@_TWO_GPUS
def test_nccl_agreements_skip_the_gpu_under_mpiexec():
    out = run_ranks(2, "tests.ranks.host_channel_gpu", env={"NCCL_NVLS_ENABLE": "0"})
    assert "3 checks passed on 2 ranks" in out


@pytest.mark.gpu
@_TWO_GPUS
def test_nccl_agreements_skip_the_gpu_under_torchrun():
    import os
    import subprocess
    import sys

    from tests.mpi_util import ROOT

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), NCCL_NVLS_ENABLE="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "tests.ranks.host_channel_gpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert "3 checks passed on 2 ranks" in proc.stdout
