"""The host channel of the short integer agreements (moecomm.backends._host_channel), on real MPI ranks
(run by tests/test_host_channel.py): against a numpy reference on channels of every size from
1 to the world's, timeouts, ``Communicator.allreduce_ints``, and the channel each construction
path gives (MPI launch with NCCL faked by a CPU stand-in, a torch gloo group)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import moecomm
from moecomm.backends._host_channel import GlooHostChannel, MpiHostChannel
from moecomm.errors import CountMismatchError
from tests.mpi_util import collective_assert, init_gloo_over_mpi, rank_main, world_barrier

WORLD = MPI.COMM_WORLD
W, R = WORLD.Get_size(), WORLD.Get_rank()
_REDUCE = {"max": np.max, "min": np.min, "sum": np.sum}


def _values(seed: int, rank: int, n: int) -> list[int]:
    """Rank ``rank``'s values of case ``seed``: negatives, zeros and large magnitudes."""
    rng = np.random.default_rng([seed, rank])
    v = rng.integers(-(1 << 40), 1 << 40, size=n)
    v[rng.random(n) < 0.3] = 0
    small = rng.random(n) < 0.3
    v[small] = rng.integers(-3, 4, size=int(small.sum()))
    return [int(x) for x in v]


def _check_against_numpy(chan, members: list[int], seed: int) -> None:
    """Every op and the allgather on ``chan`` (over the world ranks ``members``, in channel
    rank order) equal numpy's over the values every member generates."""
    me = members.index(R)
    for n in (0, 1, 2, 5, 17, 40):
        for op in ("max", "min", "sum"):
            mine = _values(seed + n, R, n)
            table = np.array([_values(seed + n, r, n) for r in members], dtype=np.int64).reshape(len(members), n)
            got = chan.allreduce(mine, op)
            want = _REDUCE[op](table, axis=0).tolist() if n else []
            assert got == want, (op, n, got, want)
        got = chan.allgather(mine)
        assert got == table.tolist(), (n, got)
        assert got[me] == mine


def check_channel_every_size() -> None:
    """A channel over COMM_WORLD duplicated, then split into channels of 1, 2, ... W ranks
    (the first k ranks, ordered by a key that reverses them), each against numpy."""
    chan = MpiHostChannel(WORLD, 60.0)
    assert MPI.Comm.Compare(chan.mpi_comm, WORLD) == MPI.CONGRUENT  # a duplicate, not COMM_WORLD itself
    try:
        _check_against_numpy(chan, list(range(W)), seed=1)
        for k in range(1, W + 1):
            sub = chan.split(0 if R < k else None, key=-R)
            if R >= k:
                assert sub is None
                continue
            assert (sub.size, sub.rank) == (k, k - 1 - R)
            _check_against_numpy(sub, list(range(k - 1, -1, -1)), seed=100 + k)
            sub.close()
        with pytest.raises(ValueError, match="op must be one of"):
            chan.allreduce([1], "prod")
        with pytest.raises(TypeError, match=r"values\[1\] must be an int"):
            chan.allreduce([1, 2.0])
        with pytest.raises(TypeError, match="values must be a sequence"):
            chan.allgather(3)
    finally:
        chan.close()
    collective_assert(True)


def check_channel_timeout() -> None:
    """Rank 0 calls a collective no other rank calls: ``TimeoutError`` naming it within about
    the timeout, the channel refuses further calls; the late ranks then complete it."""
    if W == 1:
        return
    chan = MpiHostChannel(WORLD, 60.0)
    late = None
    if R == 0:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"token agreement did not complete within 0\.3 s on rank 0"):
            chan.allreduce([5, -5], "max", timeout=0.3, what="token agreement")
        took = time.monotonic() - start
        assert 0.3 <= took < 10, took
        with pytest.raises(RuntimeError, match="cannot run allgather on the host channel"):
            chan.allgather([1])
    world_barrier()
    if R != 0:
        late = chan.allreduce([R, -R], "max", timeout=60)
    world_barrier()  # rank 0's MPI progresses its abandoned request in here
    if R == 0:
        req, buf = chan._abandoned[0]
        deadline = time.monotonic() + 60
        while not req.Test():
            assert time.monotonic() < deadline
        late = buf.tolist()
    assert late == [max(5, W - 1), -1], late  # rank 0 sent [5, -5]
    chan.close()  # after a timeout the communicator stays allocated (no free under a request)
    collective_assert(True)


def check_allreduce_ints_mpi_backend() -> None:
    comm = moecomm.init(backend="mpi", timeout=60, set_default=False)
    try:
        assert comm.host_channel == "mpi"
        # a duplicate of the backend's communicator (issue 34: an agreement must never meet an exchange)
        host_comm, backend_comm = comm.engine.host.mpi_comm, comm.engine.backend.mpi_comm
        assert host_comm is not backend_comm and host_comm.Get_size() == backend_comm.Get_size()
        from mpi4py import MPI

        assert MPI.Comm.Compare(host_comm, backend_comm) == MPI.CONGRUENT
        for n in (0, 1, 3, 16, 17, 35):
            for op in ("max", "min", "sum"):
                table = np.array([_values(7 + n, r, n) for r in range(W)], dtype=np.int64).reshape(W, n)
                got = comm.allreduce_ints(tuple(np.array(_values(7 + n, R, n), dtype=np.int64)), op)
                assert got == (_REDUCE[op](table, axis=0).tolist() if n else []), (n, op, got)
                assert all(type(v) is int for v in got)
        assert comm.allreduce_ints([R]) == [W - 1]  # op defaults to max
        if W > 1:  # different lengths: every rank raises, nothing reduced out of step
            for op in ("max", "min", "sum"):
                for n in (1, 20):
                    with pytest.raises(CountMismatchError, match="different lengths"):
                        comm.allreduce_ints([1] * (n + (R == W - 1)), op)
        assert comm.allreduce_ints([4, 5], "sum") == [4 * W, 5 * W]  # still in step
        with pytest.raises(TypeError, match=r"values\[0\] must be an int, got a bool"):
            comm.allreduce_ints([True])
        with pytest.raises(ValueError, match=r"values\[0\] = 9223372036854775808 is outside int64"):
            comm.allreduce_ints([1 << 63])
        with pytest.raises(ValueError, match="op must be one of"):
            comm.allreduce_ints([1], op="mean")
        sub = comm.split(R % 2, key=-R)
        members = sorted((r for r in range(W) if r % 2 == R % 2), reverse=True)
        assert sub.host_channel == "mpi" and sub.rank == members.index(R)
        table = np.array([_values(3, r, 4) for r in members], dtype=np.int64)
        assert sub.allreduce_ints(_values(3, R, 4), "min") == table.min(axis=0).tolist()
        assert comm.engine.gather_ints([R, -R], "check") == [[r, -r] for r in range(W)]
        sub.close()
    finally:
        comm.close()
    if W > 1:  # the engine's timeout aborts the communicator
        comm = moecomm.init(backend="mpi", timeout=60, set_default=False)
        world_barrier()
        comm.timeout = 0.3
        if R == 0:
            with pytest.raises(TimeoutError, match="allreduce_ints did not complete.*the communicator was aborted"):
                comm.allreduce_ints([1])
            assert comm.closed
        world_barrier()
        if R != 0:
            comm.timeout = 60
            assert comm.allreduce_ints([1]) == [1]
            comm.close()
        world_barrier()
    collective_assert(True)


class _Recording:
    """Wraps a backend: counts the device-path integer collectives the engine asks of it."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.device_calls: list[str] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def allreduce(self, tensor, op):
        self.device_calls.append("allreduce")
        return self._inner.allreduce(tensor, op)

    def allgather(self, send, recv):
        self.device_calls.append("allgather")
        return self._inner.allgather(send, recv)

    def split(self, color, key, table):
        return self._inner.split(color, key, table)


def _fake_nccl(make):
    """``NcclBackend.create`` replaced by a CPU stand-in (``make(size, rank)``),
    and no CUDA device needed: the construction path of ``backend="nccl"`` without a GPU."""
    from moecomm.backends import _select as _make_backend
    from moecomm.backends.nccl import NcclBackend

    saved = (NcclBackend.__dict__["create"], NcclBackend.__dict__["new_unique_id"], _make_backend._cuda_device)
    NcclBackend.create = classmethod(lambda cls, size, rank, uid, dev, timeout_s, max_ctas: make(size, rank))
    NcclBackend.new_unique_id = staticmethod(lambda: b"fake-unique-id")
    _make_backend._cuda_device = lambda device, local_rank: torch.device("cpu")

    def restore() -> None:
        NcclBackend.create, NcclBackend.new_unique_id, _make_backend._cuda_device = saved

    return restore


def check_nccl_launch_gets_an_mpi_channel() -> None:
    """Under an MPI launcher, ``backend="nccl"`` gets an MPI channel over a duplicate of
    COMM_WORLD; the engine's integer agreements then never reach the (stand-in) backend."""
    from moecomm.backends.mpi import MpiBackend

    made: list = []

    def create(size, rank):
        made.append(_Recording(MpiBackend(WORLD, 60.0)))
        return made[-1]

    restore = _fake_nccl(create)
    try:
        comm = moecomm.init(backend="nccl", timeout=60, p2p_bytes=0, set_default=False)
    finally:
        restore()
    try:
        backend = made[0]
        assert comm.engine.backend is backend and comm.host_channel == "mpi"
        host = comm.engine.host
        assert isinstance(host, MpiHostChannel) and host._owned
        assert MPI.Comm.Compare(host.mpi_comm, WORLD) == MPI.CONGRUENT
        assert MPI.Comm.Compare(host.mpi_comm, backend.mpi_comm) == MPI.CONGRUENT  # neither is the other
        backend.device_calls.clear()
        assert comm.allreduce_ints([R, -R], "max") == [W - 1, 0]
        assert comm.engine.max_int(R * 10, "allreduce") == (W - 1) * 10
        assert comm.engine.gather_ints([R], "check") == [[r] for r in range(W)]
        sub = comm.split(0, key=R)
        assert sub.host_channel == "mpi" and sub.allreduce_ints([R], "sum") == [W * (W - 1) // 2]
        assert backend.device_calls == [], backend.device_calls
        sub.close()
    finally:
        comm.close()
    assert host.mpi_comm == MPI.COMM_NULL  # closed with the engine
    collective_assert(True)


def check_gloo_group_gets_a_gloo_channel() -> None:
    """A communicator over a torch gloo group gets a gloo channel (torch backend, and the NCCL
    path with a stand-in backend), equal to numpy; its timeout names the call."""
    import torch.distributed as dist
    from moecomm.backends.torch_dist import TorchBackend

    init_gloo_over_mpi()
    comm = moecomm.init(process_group=dist.group.WORLD, timeout=60, set_default=False)
    try:
        assert comm.backend == "torch" and comm.host_channel == "gloo"
        for n in (1, 17):
            for op in ("max", "min", "sum"):
                table = np.array([_values(11 + n, r, n) for r in range(W)], dtype=np.int64)
                assert comm.allreduce_ints(_values(11 + n, R, n), op) == _REDUCE[op](table, axis=0).tolist()
        assert comm.engine.gather_ints([R, 2 * R], "check") == [[r, 2 * r] for r in range(W)]
        _check_against_numpy(comm.engine.host, list(range(W)), seed=21)
    finally:
        comm.close()

    restore = _fake_nccl(lambda size, rank: _Recording(TorchBackend(dist.group.WORLD)))
    try:
        comm = moecomm.init(backend="nccl", process_group=dist.group.WORLD, timeout=60, p2p_bytes=0,
                            set_default=False)
    finally:
        restore()
    try:
        assert isinstance(comm.engine.host, GlooHostChannel) and comm.host_channel == "gloo"
        comm.engine.backend.device_calls.clear()
        assert comm.allreduce_ints([R], "max") == [W - 1]
        assert comm.engine.backend.device_calls == []
    finally:
        comm.close()

    if W > 1:
        chan = GlooHostChannel(dist.group.WORLD, 60.0)
        if R == 0:
            with pytest.raises(TimeoutError, match=r"late sum did not complete within 0\.3 s on rank 0"):
                chan.allreduce([1], "sum", timeout=0.3, what="late sum")
        world_barrier()
        if R != 0:
            assert chan.allreduce([1], "sum", timeout=60) == [W]
        else:
            work, t = chan._abandoned[0]
            work.wait()
            assert t.tolist() == [W]
        world_barrier()
    collective_assert(True)


ALL = [
    check_channel_every_size,
    check_channel_timeout,
    check_allreduce_ints_mpi_backend,
    check_nccl_launch_gets_an_mpi_channel,
    check_gloo_group_gets_a_gloo_channel,
]

if __name__ == "__main__":
    rank_main(ALL)
