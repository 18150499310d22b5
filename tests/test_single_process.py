"""One process without a launcher needs nothing beyond torch and numpy (issue 18).

``moecomm.init()`` there gives the ``self`` backend (size 1, CPU copies). The subprocess test
makes mpi4py unimportable to prove that no path of a single process touches it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moecomm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_BLOCKER = textwrap.dedent("""
    import sys

    class _NoMpi:
        def find_spec(self, name, path=None, target=None):
            if name == "mpi4py" or name.startswith("mpi4py."):
                raise ImportError("mpi4py is not installed (blocked by the test)")

    sys.meta_path.insert(0, _NoMpi())
""")

_CHECKS = textwrap.dedent("""
    import torch
    import moecomm
    import moecomm.distributed as dist
    from moecomm.functional import all_to_all_v

    from moecomm.backends.nccl import nccl_available

    g = torch.Generator().manual_seed(0)
    auto = moecomm.init(set_default=False)
    assert (auto.backend, auto.size) == ("nccl" if nccl_available() else "self", 1), auto
    auto.close()
    comm = moecomm.init(backend="self")
    assert (comm.backend, comm.rank, comm.size, comm.device.type) == ("self", 0, 1, "cpu"), comm

    x = torch.randn(7, 3, generator=g)
    out, recv = comm.all_to_all_v(x, torch.tensor([7]))
    assert torch.equal(out, x) and list(recv) == [7], (out, recv)
    empty, recv0 = comm.all_to_all_v(x[:0], [0], [0])
    assert empty.shape == (0, 3) and list(recv0) == [0]
    try:
        comm.all_to_all_v(x, [7], [6])
    except ValueError as exc:
        assert "recv_splits" in str(exc) or "7" in str(exc), exc
    else:
        raise AssertionError("mismatched recv_splits accepted")

    # torch.distributed's calls through the import swap: group=None is the default communicator
    o = torch.empty(7, 3)
    assert dist.all_to_all_single(o, x, [7], [7]) is None and torch.equal(o, x)
    outs = [torch.empty(4, 2, dtype=torch.bfloat16)]
    ins = [torch.randn(4, 2, generator=g).to(torch.bfloat16)]
    dist.all_to_all(outs, ins, async_op=True).wait()
    assert torch.equal(outs[0], ins[0])

    rows, sizes = comm.all_gather_v(x[:5])
    assert torch.equal(rows, x[:5]) and list(sizes) == [5]
    t = torch.arange(6.0)
    comm.allreduce(t, op="max"); comm.broadcast(t, src=0); comm.barrier()
    assert torch.equal(t, torch.arange(6.0))
    sub = comm.split(0)
    assert sub.size == 1 and comm.split(None) is None

    a = x.clone().requires_grad_()
    y, _ = all_to_all_v(a, [7])
    (y * 2).sum().backward()
    assert torch.equal(a.grad, torch.full_like(x, 2.0))

    tc = moecomm.init(backend="torch", set_default=False)
    assert (tc.backend, tc.size) == ("torch", 1), tc
    o2, _ = tc.all_to_all_v(x, [7])
    assert torch.equal(o2, x)
    tc.close(); comm.close()
    import torch.distributed as tdist
    tdist.destroy_process_group()
    assert "mpi4py" not in sys.modules, "a single process imported mpi4py"
    try:  # the checks above prove nothing if the blocker let mpi4py through
        moecomm.init(backend="mpi", set_default=False)
    except ImportError as exc:
        assert "mpi4py" in str(exc), exc
    else:
        raise AssertionError("the mpi4py blocker did not block")
    print("single-process checks passed")
""")


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "MV2_", "HYDRA_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "MOECOMM_BACKEND")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_single_process_without_mpi4py():
    proc = subprocess.run([sys.executable, "-c", _BLOCKER + _CHECKS], cwd=ROOT, env=_clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "single-process checks passed" in proc.stdout


def test_self_backend_refused_under_a_launcher(monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(ValueError, match="single process"):
        moecomm.init(backend="self", set_default=False)
    monkeypatch.delenv("PMI_SIZE")
    with pytest.raises(ValueError, match="NCCL"):
        moecomm.init(backend="self", max_ctas=4, set_default=False)
    with pytest.raises(ValueError, match="device"):
        moecomm.init(backend="self", device="cuda:0", set_default=False)


_DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64, torch.int64]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 9), width=st.integers(1, 5), dtype=st.sampled_from(_DTYPES), seed=st.integers(0, 2**16))
def test_self_backend_is_a_bit_exact_copy(rows, width, dtype, seed):
    comm = moecomm.init(backend="self", set_default=False)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-100, 100, (rows, width), generator=g).to(dtype)
    out, recv = comm.all_to_all_v(x, [rows])
    assert list(recv) == [rows]
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))  # bit for bit, NaN payloads included
    o = torch.empty_like(x)
    comm.all_to_all_single(o, x, [rows], [rows])
    assert torch.equal(o, x)
    comm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_single_process_nccl_without_mpi4py():
    """With nccl4py and a GPU, ``init()`` without a launcher is NCCL of size 1, and needs no mpi4py."""
    code = _BLOCKER + textwrap.dedent("""
        import torch, moecomm
        from moecomm.backends.nccl import nccl_available
        assert nccl_available(), "nccl4py is not installed"
        comm = moecomm.init()
        assert (comm.backend, comm.size, comm.device.type) == ("nccl", 1, "cuda"), comm
        x = torch.randn(9, 5, device=comm.device)
        out, recv = comm.all_to_all_v(x, torch.tensor([9], device=comm.device))
        assert torch.equal(out, x) and list(recv) == [9]
        comm.close()
        assert "mpi4py" not in sys.modules
        print("nccl single-process checks passed")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "nccl single-process checks passed" in proc.stdout


def test_auto_without_launcher_builds_on_an_initialized_torch_group():
    """No launcher variables, but torch.distributed initialized (torch.multiprocessing, say):
    ``init()`` builds on its default group instead of a communicator of this process alone."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = moecomm.init(set_default=False)
        assert comm.backend == "torch" and comm.size == 1
        comm.close()
    finally:
        dist.destroy_process_group()
    from moecomm.backends.nccl import nccl_available

    alone = moecomm.init(set_default=False)
    assert alone.backend == ("nccl" if nccl_available() else "self")
    alone.close()
