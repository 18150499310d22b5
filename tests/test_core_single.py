"""Single-process checks of the core: argument validation, layouts, pool, gradcheck."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moecomm
import moecomm.functional as F
from moecomm.collectives import flat as _flat
from moecomm.layout import Layout
from moecomm.pool import StagingPool
from moecomm.splits import normalize_splits


@pytest.fixture(scope="module")
def comm():
    c = moecomm.init(backend="mpi", timeout=30)
    yield c


def test_identity(comm):
    assert (comm.rank, comm.size, comm.backend, comm.device.type) == (0, 1, "mpi", "cpu")
    assert (comm.local_rank, comm.local_size, comm.node_rank, comm.num_nodes) == (0, 1, 0, 1)
    assert moecomm.default_communicator() is comm


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(input=torch.zeros(4, 2), send_splits=[3]), ValueError, "send_splits must sum to the 4 rows of input"),
        (dict(input=torch.zeros(4, 2), send_splits=[4, 0]), ValueError, "send_splits must have one entry per rank (1)"),
        (dict(input=torch.zeros(4, 2), send_splits=[-4]), ValueError, "send_splits[0] must be >= 0"),
        (dict(input=torch.zeros(4, 2), send_splits=[4.0]), TypeError, "send_splits[0] must be an int"),
        (dict(input=torch.zeros(4, 2), send_splits=torch.tensor([4.0])), TypeError, "send_splits must be an integer tensor"),
        (dict(input=torch.zeros(4, 2), send_splits=torch.tensor([[4]])), ValueError, "send_splits must be 1-D"),
        (dict(input=torch.zeros(4, 2), send_splits="4"), TypeError, "send_splits must be a sequence of ints"),
        (dict(input=torch.zeros(4, 2), send_splits=[4], recv_splits=[-1]), ValueError, "recv_splits[0] must be >= 0"),
        (dict(input=torch.zeros(4, 2), send_splits=[4], recv_splits=[3]), ValueError,
         "send_splits[0] (4) and recv_splits[0] (3) must be equal: both count the rows rank 0 sends itself"),
        (dict(input=torch.zeros(4, 0), send_splits=[4], recv_splits=[5]), ValueError,
         "send_splits[0] (4) and recv_splits[0] (5) must be equal"),
        (dict(input=torch.zeros(4, 2).t(), send_splits=[2]), ValueError, "input must be contiguous"),
        (dict(input=torch.zeros(()), send_splits=[0]), ValueError, "input must have at least 1 dimension"),
        (dict(input=[1, 2], send_splits=[2]), TypeError, "input must be a torch.Tensor"),
        (dict(input=torch.zeros(2, dtype=torch.uint32) if hasattr(torch, "uint32") else None, send_splits=[2]),
         TypeError, "input has unsupported dtype"),
    ],
)
def test_all_to_all_v_bad_input(comm, kwargs, exc, words):
    if kwargs["input"] is None:
        pytest.skip("this torch has no uint32")
    with pytest.raises(exc) as info:
        comm.all_to_all_v(**kwargs)
    assert words in str(info.value)


def test_wrong_device(comm):
    meta = torch.zeros(2, 2, device="meta")
    with pytest.raises(ValueError, match="input must be on cpu"):
        comm.all_to_all_v(meta, [2])


def test_all_to_all_single_bad_input(comm):
    with pytest.raises(TypeError, match="output must have input's dtype"):
        comm.all_to_all_single(torch.zeros(2, dtype=torch.int32), torch.zeros(2))
    with pytest.raises(ValueError, match="output rows must hold as many elements"):
        comm.all_to_all_single(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="output_split_sizes must sum to the 2 rows of output"):
        comm.all_to_all_single(torch.zeros(2, 2), torch.zeros(2, 2), [3], [2])
    with pytest.raises(ValueError, match=r"^output \(shape \(3, 2\)\) must hold, in block 0, the 2 rows input sends"):
        comm.all_to_all_single(torch.zeros(3, 2), torch.zeros(2, 2), [3], [2])
    with pytest.raises(ValueError, match=r"send_splits\[0\] \(2\) and recv_splits\[0\] \(1\) must be equal"):
        comm.scatter_compute_gather(torch.zeros(2, 2), [2], lambda rows, chunk: rows, recv_splits=[1])
    with pytest.raises(ValueError, match="input_tensor_list must be a list of 1 tensors"):
        comm.all_to_all([torch.zeros(1)], [])
    with pytest.raises(TypeError, match=r"output_tensor_list\[0\] must have dtype"):
        comm.all_to_all([torch.zeros(1, dtype=torch.int64)], [torch.zeros(1)])


def test_other_bad_input(comm):
    with pytest.raises(ValueError, match="src must be a rank in"):
        comm.broadcast(torch.zeros(2), src=1)
    with pytest.raises(ValueError, match="op must be one of"):
        comm.allreduce(torch.zeros(2), "mean")
    with pytest.raises(ValueError, match="color must be a non-negative int"):
        comm.split(-2)
    with pytest.raises(ValueError, match="backend must be one of"):
        moecomm.init(backend="gloo")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        moecomm.init(backend="mpi", timeout=0)
    with pytest.raises(ValueError, match="local_size=2 does not divide"):
        moecomm.init(backend="mpi", local_size=2, set_default=False)
    for bad in (0, 33, 2.0, True):
        with pytest.raises(ValueError, match=f"max_ctas must be an int from 1 to 32 \\(or None\\), got {bad!r}"):
            moecomm.init(backend="mpi", max_ctas=bad, set_default=False)
    with pytest.raises(ValueError, match="max_ctas applies to the NCCL backend only; .* backend is 'mpi'"):
        moecomm.init(backend="mpi", max_ctas=8, set_default=False)
    for bad in (-1, -5, True, 1.5):
        with pytest.raises(ValueError, match=f"p2p_bytes must be an int of bytes >= 0 \\(0: off\\) or None \\(the default "
                                             f"rule\\), got {bad!r}"):
            moecomm.init(backend="mpi", p2p_bytes=bad, set_default=False)
    with pytest.raises(ValueError, match="p2p_bytes applies to the NCCL backend only; .* backend is 'mpi'"):
        moecomm.init(backend="mpi", p2p_bytes=1 << 20, set_default=False)


def test_env_defaults(monkeypatch):
    monkeypatch.setenv("MOECOMM_TIMEOUT", "12.5")
    monkeypatch.setenv("MOECOMM_VALIDATE", "1")
    c = moecomm.init(backend="mpi", set_default=False)
    assert (c.timeout, c.validate) == (12.5, True)
    assert moecomm.init(backend="mpi", timeout=3, validate=False, set_default=False).timeout == 3
    monkeypatch.setenv("MOECOMM_VALIDATE", "maybe")
    with pytest.raises(ValueError, match="MOECOMM_VALIDATE must be 0 or 1"):
        moecomm.init(backend="mpi", set_default=False)


def test_closed_communicator():
    c = moecomm.init(backend="mpi", set_default=False)
    with c:
        c.all_to_all_v(torch.zeros(1), [1])
    with pytest.raises(moecomm.CommunicatorClosedError, match="the communicator is closed"):
        c.all_to_all_v(torch.zeros(1), [1])


@settings(deadline=None, max_examples=30)
@given(rows=st.integers(0, 6), cols=st.integers(1, 3))
def test_gradcheck_single_rank(rows, cols):
    comm = moecomm.init(backend="mpi", set_default=False)
    x = torch.randn(rows, cols, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: F.all_to_all_v(t, [rows], comm=comm)[0], (x,))


@settings(deadline=None, max_examples=60)
@given(values=st.lists(st.integers(0, 10**9), min_size=1, max_size=6), kind=st.sampled_from(["list", "tensor", "numpy"]))
def test_normalize_splits(values, kind):
    arg = {"list": values, "tensor": torch.tensor(values), "numpy": np.array(values)}[kind]
    assert normalize_splits(arg, "s", len(values)) == values
    with pytest.raises(ValueError, match=f"s must have one entry per rank \\({len(values) + 1}\\)"):
        normalize_splits(arg, "s", len(values) + 1)


@settings(deadline=None, max_examples=60)
@given(hosts=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=9), data=st.data())
def test_layout_from_hosts(hosts, data):
    rank = data.draw(st.integers(0, len(hosts) - 1))
    lay = Layout.from_hosts(rank, hosts)
    same = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    assert lay.local_rank == same.index(rank) and lay.local_size == len(same)
    assert lay.num_nodes == len(set(hosts))
    assert sorted(r for m in lay.node_members for r in m) == list(range(len(hosts)))


def test_layout_local_size_and_subset():
    lay = Layout.from_local_size(5, 8, 4)
    assert (lay.node_rank, lay.local_rank, lay.num_nodes, lay.local_size) == (1, 1, 2, 4)
    sub = lay.subset(1, [1, 5])  # one rank from each node
    assert (sub.num_nodes, sub.local_size, sub.node_rank) == (2, 1, 1)


def test_pool_reuse_and_bound():
    pool = StagingPool(capacity_bytes=4096)
    dev = torch.device("cpu")
    a = pool.take(1000, dev, "s")
    assert a.numel() == 1000 and pool.stats().misses == 1
    pool.give(a, dev, "s")
    b = pool.take(700, dev, "s")
    assert pool.stats().hits == 1 and b.data_ptr() == a.data_ptr()
    pool.give(b, dev, "s")
    big = pool.take(10000, dev, "s")
    pool.give(big, dev, "s")
    st_ = pool.stats()
    assert st_.cached_bytes <= 4096 and st_.in_use_bytes == 0


def test_work_handle(comm):
    x = torch.arange(6.0).reshape(3, 2)
    work = comm.all_to_all_v(x, [3], async_op=True)
    out, recv = work.synchronize(timeout=10)
    assert work.is_completed() and recv == [3] and torch.equal(out, x)
    assert work.wait() == (out, recv)  # waiting again returns the same result
    y = torch.empty_like(x)
    assert comm.all_to_all_single(y, x, async_op=True).wait() is True and torch.equal(y, x)
    t = torch.ones(3)
    assert comm.allreduce(t, async_op=True).wait() is True and torch.equal(t, torch.ones(3))


def test_pool_stats_after_calls(comm):
    before = comm.pool_stats()
    for _ in range(3):
        comm.all_to_all_v(torch.zeros(4, 3), [4])
    after = comm.pool_stats()
    assert after.in_use_bytes == 0 and after.capacity_bytes == before.capacity_bytes


def test_counts_checked_after_an_exchange():
    """Counts that reach the host only after going out (GPU counts): a bad one aborts the
    communicator and names what the peers received; with validate=True it is returned for the
    cross-check instead."""
    c = moecomm.init(backend="mpi", set_default=False)
    assert _flat.check_exchanged_counts(c.engine, [3], [3], 3, "the rows") is None
    with pytest.raises(ValueError, match=r"send_splits .*3.* \(the communicator was aborted: peers had received the rows\)"):
        _flat.check_exchanged_counts(c.engine, [3], [3], 4, "the rows")
    assert c.closed
    v = moecomm.init(backend="mpi", validate=True, set_default=False)
    assert "must be >= 0" in _flat.check_exchanged_counts(v.engine, [0], [-1], 0, "the counts")
    assert not v.closed


def test_asynchronous_backend_failure_closes_the_communicator(monkeypatch):
    """A failure the backend found on its own (the NCCL watchdog: a timeout or a CUDA error)
    is raised by the next call, and the communicator counts as aborted after it."""
    c = moecomm.init(backend="mpi", set_default=False)

    def failed() -> None:
        raise RuntimeError("moecomm: the NCCL watchdog on rank 0 could not poll the GPU (boom)")

    monkeypatch.setattr(c.engine.backend, "check_health", failed)
    with pytest.raises(RuntimeError, match="could not poll the GPU"):
        c.barrier()
    assert c.closed
    with pytest.raises(moecomm.CommunicatorClosedError):
        c.barrier()


def test_watch_stream_on_a_host_waiting_backend(comm):
    """MPI waits on the host with its own timeouts: watch_stream validates and does nothing else."""
    comm.watch_stream()
    comm.watch_stream("a replay", timeout=5)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"timeout must be > 0 seconds"):
            comm.watch_stream(timeout=bad)
    assert not comm.engine.capturing()  # a CPU communicator never sees a capture
    c = moecomm.init(backend="mpi", set_default=False)
    c.close()
    with pytest.raises(moecomm.CommunicatorClosedError, match="cannot run a replay"):
        c.watch_stream("a replay")


def test_capture_refuses_what_needs_the_host(monkeypatch):
    """While a capture is in progress (simulated: the check is the same on every backend), an
    exchange that must learn its counts, or read them from a device tensor, is refused before
    anything is issued, naming recv_splits; any other wait on the host is refused too."""
    c = moecomm.init(backend="mpi", set_default=False)
    monkeypatch.setattr(c.engine, "capturing", lambda: True)
    x = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match=r"recv_splits must be given, and both splits on the host"):
        c.all_to_all_v(x, [2])
    on_device = torch.tensor([2], device="meta")  # any device but the CPU
    with pytest.raises(RuntimeError, match=r"recv_splits must be given, and both splits on the host"):
        c.all_to_all_v(x, on_device, [2])
    with pytest.raises(RuntimeError, match=r"barrier waits on the host, which a CUDA graph capture cannot include"):
        c.barrier()
    monkeypatch.setattr(c.engine, "capturing", lambda: False)
    out, recv = c.all_to_all_v(x, [2], [2])  # known host counts pass the check
    assert recv == [2] and torch.equal(out, x)
    c.close()


def test_all_to_all_v_backward_equals_autograd(comm):
    """The public backward alone gives what autograd gives through all_to_all_v, in every
    grad_wire_dtype rule (as is, a cast, FP8); bad arguments are named."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 130, generator=g, dtype=torch.float32)
    grad = torch.randn(5, 130, generator=g, dtype=torch.float32)
    for gw in (None, torch.bfloat16, torch.float8_e4m3fn):
        xx = x.clone().requires_grad_()
        y, recv = F.all_to_all_v(xx, [5], [5], comm=comm, grad_wire_dtype=gw)
        y.backward(grad)
        got = F.all_to_all_v_backward(grad, [5], recv, comm=comm, grad_wire_dtype=gw)
        assert torch.equal(got, xx.grad), gw
    assert not torch.equal(F.all_to_all_v_backward(grad, [5], [5], comm=comm, grad_wire_dtype=torch.float8_e4m3fn), grad)
    with pytest.raises((TypeError, ValueError), match="grad_wire_dtype"):
        F.all_to_all_v_backward(grad, [5], [5], comm=comm, grad_wire_dtype=torch.int8)
    with pytest.raises(TypeError, match="comm"):
        F.all_to_all_v_backward(grad, [5], [5], comm="world")
    with pytest.raises(ValueError, match="recv_splits"):
        F.all_to_all_v_backward(grad, [5], [5, 1], comm=comm)
