"""The migration from torch.distributed is an import swap (issue 18).

A torch MoE script (``tests/ranks/torch_moe_script.py``: init_process_group, all_to_all_single
with split sizes, all_to_all, async_op) runs as written and with its one import line changed
to ``import moecomm.distributed as dist``, under torchrun and under mpiexec; both runs must
produce the same bytes (and each checks itself against a dense reference).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

import moecomm
import moecomm.distributed as mdist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "ranks", "torch_moe_script.py")
TORCH_IMPORT = "import torch.distributed as dist\n"
SWAPPED_IMPORT = "import moecomm.distributed as dist\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOECOMM_BACKEND")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("MOECOMM_TIMEOUT", "60")
    return env


def _run(launcher: str, nprocs: int, script: str, out_dir: str, device: str) -> None:
    env = _env()
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs),
               script, out_dir, device]
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        cmd = ["mpiexec", "-n", str(nprocs), sys.executable, script, out_dir, device]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("launcher,nprocs,device", [
    pytest.param("torchrun", 2, "cpu", marks=pytest.mark.mpi),
    pytest.param("mpiexec", 3, "cpu", marks=pytest.mark.mpi),
    pytest.param("torchrun", 2, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")]),
])
def test_import_swap_runs_the_torch_script_unchanged(tmp_path, launcher, nprocs, device):
    """On GPUs the script runs NCCL process groups, and the swapped one moecomm's NCCL backend."""
    text = open(SCRIPT).read()
    assert text.count(TORCH_IMPORT) == 1
    swapped = tmp_path / "swapped_moe_script.py"
    swapped.write_text(text.replace(TORCH_IMPORT, SWAPPED_IMPORT))
    runs = {}
    for name, script in (("torch", SCRIPT), ("moecomm", str(swapped))):
        out = tmp_path / name
        out.mkdir()
        _run(launcher, nprocs, script, str(out), device)
        runs[name] = [torch.load(out / f"rank{r}.pt") for r in range(nprocs)]
    for r in range(nprocs):
        a, b = runs["torch"][r], runs["moecomm"][r]
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"rank {r}: {key} differs after the import swap"
    assert any(not bool(run["kept"].all()) for run in runs["torch"])  # some tokens dropped by the capacity


def test_group_none_uses_torch_default_group_once():
    """Without moecomm.init, group=None means torch.distributed's default group; its
    communicator is made on first use and kept. Without either, the error says what to do."""
    import torch.distributed as dist

    assert mdist.all_to_all_single is not dist.all_to_all_single
    assert mdist.init_process_group is dist.init_process_group and mdist.group is dist.group
    assert mdist.Work is dist.Work  # torch's names are not shadowed by moecomm's
    moecomm.set_default_communicator(None)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"moecomm\.init\(\).*group="):
        mdist.all_to_all_single(torch.empty(2), torch.zeros(2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.arange(6.0).reshape(3, 2)
        out = torch.empty_like(x)
        mdist.all_to_all_single(out, x, [3], [3])
        assert torch.equal(out, x)
        first = mdist.communicator_for(None)
        assert first.backend == "torch" and first is mdist.communicator_for(None)
        assert first is mdist.communicator_for(dist.group.WORLD)
        mine = moecomm.init(backend="self")  # an explicit default wins
        assert mdist.communicator_for(None) is mine
        moecomm.set_default_communicator(None)
        mine.close()
        first.close()
    finally:
        dist.destroy_process_group()
    with pytest.raises(AttributeError, match="no_such_name"):
        mdist.no_such_name  # noqa: B018
