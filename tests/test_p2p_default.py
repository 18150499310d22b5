"""The default choice of the peer-memory transport (``init(p2p_bytes=None)``), capability faked.

Each case runs every rank of a fake communicator in its own thread: the ranks' all-gathers
meet at a barrier, and the CUDA extension is a fake whose peer access, IPC and memory the
case sets per GPU. Every rank must come to the same answer.
"""

from __future__ import annotations

import importlib
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import moecomm
from moecomm.backends import _p2p_default as pd

init_mod = importlib.import_module("moecomm.init")  # the module (moecomm.init is the function)

MiB, GiB = 1 << 20, 1 << 30


class FakeExt:
    """The transport's extension on one host: ``access[a][b]``: GPU a can map GPU b's memory."""

    def __init__(self, access, ipc_ok=True, loads=True, max_ranks=128):
        self.access, self.ipc_ok, self.loads, self.max_ranks = access, ipc_ok, loads, max_ranks
        self.lock = threading.Lock()
        self.live = {}  # pointer -> (device, opened by peers now)
        self.opened = 0

    def max_copy_engine_ranks(self):
        return self.max_ranks

    def alloc(self, device, nbytes):
        assert nbytes == pd._PROBE_BYTES
        with self.lock:
            ptr = 0x1000 * (len(self.live) + 1)
            self.live[ptr] = [device, 0]
        return ptr

    def ipc_handle(self, ptr):
        return np.array([ptr] + [7] * 7, dtype=np.int64).tobytes()

    def ipc_open(self, device, raw):
        if not self.ipc_ok:
            raise RuntimeError("moecomm p2p: cudaIpcOpenMemHandle failed: fake")
        ptr = int(np.frombuffer(raw, dtype=np.int64)[0])
        with self.lock:
            assert self.live[ptr][0] != device, "a rank opened its own buffer"
            self.live[ptr][1] += 1
            self.opened += 1
        return ptr

    def ipc_close(self, ptr):
        with self.lock:
            self.live[ptr][1] -= 1

    def free(self, ptr):
        with self.lock:
            assert self.live[ptr][1] == 0, "a probe buffer freed while a peer maps it"
            del self.live[ptr]

    def can_access_peer(self, a, b):
        if max(a, b) >= len(self.access):
            raise RuntimeError("moecomm p2p: cudaDeviceCanAccessPeer failed: invalid device ordinal (fake)")
        return a != b and bool(self.access[a][b])


class FakeWorld:
    """``size`` ranks on ``hosts`` with GPUs ``devices``; ``free[r]``: free bytes on rank r's GPU."""

    def __init__(self, size, devices=None, hosts=None, free=None, num_nodes=None, backend="nccl"):
        self.size = size
        self.devices = list(range(size)) if devices is None else devices
        self.hosts = ["h"] * size if hosts is None else hosts
        self.free = [140 * GiB] * size if free is None else free
        self.num_nodes = len(set(self.hosts)) if num_nodes is None else num_nodes
        self.backend = backend
        self.barrier = threading.Barrier(size, timeout=20)
        self.rows = [None] * size
        self.gathers = 0

    def comm(self, rank):
        world = self

        def gather(values, op):
            assert world.backend == "nccl", "a collective on a communicator the rule leaves alone"
            world.rows[rank] = list(values)
            world.barrier.wait()
            table = [list(r) for r in world.rows]
            world.barrier.wait()
            if rank == 0:
                world.gathers += 1
            return table

        return SimpleNamespace(rank=rank, size=self.size, backend=SimpleNamespace(name=self.backend),
                               device=torch.device("cuda", self.devices[rank]), gather_ints=gather)


def resolve_on_every_rank(world, requested=None, whole_launch=True) -> list:
    """Each rank's resolved p2p_bytes, the ranks running as threads (the fakes set up already)."""
    out, errors = [None] * world.size, []

    def rank_main(r):
        try:
            out[r] = pd.resolve_p2p_bytes(world.comm(r), world.num_nodes, requested, world.hosts, whole_launch)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            world.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def run(monkeypatch, world, ext, requested=None, whole_launch=True):
    """Every rank's resolved p2p_bytes (asserting that they agree)."""
    monkeypatch.setattr(pd, "_load_ext", lambda: _load(ext))
    monkeypatch.setattr(pd, "_free_bytes", lambda dev: world.free[world.devices.index(dev.index)])
    out = resolve_on_every_rank(world, requested, whole_launch)
    assert len(set(out)) == 1, f"ranks disagree: {out}"
    if ext is not None:
        assert not ext.live, "probe buffers left allocated"
    return out[0]


def _load(ext):
    if ext is None or not ext.loads:
        raise RuntimeError("peer-memory (p2p) CUDA extension: no nvcc (fake)")
    return ext


def full(n):
    return [[1] * n for _ in range(n)]


def reference_bytes(size, free):
    """The documented rule, written out: 128 MiB a source region, at most free/16, 2 MiB steps."""
    n = min(size * 4 * 128 * MiB, free // 16)
    n -= n % (2 * MiB)
    return n if n >= size * 4 * 8 * MiB else 0


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_one_node_every_pair_capable_is_on_with_the_rule_size(monkeypatch, size):
    ext = FakeExt(full(size))
    world = FakeWorld(size)
    got = run(monkeypatch, world, ext)
    assert got == size * 512 * MiB == reference_bytes(size, 140 * GiB)
    assert ext.opened == size * (size - 1)  # every rank opened every peer's buffer once
    assert world.gathers == 2


def test_size_is_the_smallest_proposal_capped_by_free_memory(monkeypatch):
    free = [80 * GiB, 9 * GiB + 3 * MiB, 40 * GiB, 80 * GiB]
    got = run(monkeypatch, FakeWorld(4, free=free), FakeExt(full(4)))
    assert got == reference_bytes(4, min(free)) == (9 * GiB + 3 * MiB) // 16 // (2 * MiB) * (2 * MiB)
    assert got < 4 * 512 * MiB


def test_too_little_free_memory_anywhere_is_off(monkeypatch, caplog):
    free = [80 * GiB, 80 * GiB, 500 * MiB]  # 500/16 MiB < 3 * 4 * 8 MiB
    with caplog.at_level("INFO", logger="moecomm"):
        assert run(monkeypatch, FakeWorld(3, free=free), FakeExt(full(3))) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "moecomm: peer-memory transport off (rank 2: 500 MiB of GPU memory free, too little for the default size); "
        "exchanges go through NCCL"]


@pytest.mark.parametrize("a,b", [(0, 1), (2, 0), (3, 2)])
def test_one_incapable_pair_is_off_everywhere(monkeypatch, caplog, a, b):
    access = full(4)
    access[a][b] = 0  # one direction of one pair only
    with caplog.at_level("INFO", logger="moecomm"):
        assert run(monkeypatch, FakeWorld(4), FakeExt(access)) == 0
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [f"moecomm: peer-memory transport off (rank {a}: its GPU cannot map the memory of rank {b}'s GPU); "
                    f"exchanges go through NCCL"]
    assert all(r.levelname == "INFO" for r in caplog.records)


def test_ranks_sharing_a_gpu_or_seeing_one_gpu_each_are_off(monkeypatch):
    # two ranks on GPU 1; and CUDA_VISIBLE_DEVICES set per rank (every rank sees its GPU as 0)
    assert run(monkeypatch, FakeWorld(3, devices=[0, 1, 1]), FakeExt(full(3))) == 0
    assert run(monkeypatch, FakeWorld(2, devices=[0, 0]), FakeExt(full(2))) == 0
    # a rank naming a GPU another rank does not see: that rank's probe fails, not hangs
    assert run(monkeypatch, FakeWorld(3, devices=[0, 1, 5]), FakeExt(full(3))) == 0


def test_a_probe_that_raises_on_one_rank_is_off_everywhere(monkeypatch):
    world = FakeWorld(3)

    def free_bytes(dev):
        if dev.index == 2:
            raise RuntimeError("cudaMemGetInfo failed (fake)")
        return 140 * GiB

    ext = FakeExt(full(3))
    monkeypatch.setattr(pd, "_load_ext", lambda: ext)
    monkeypatch.setattr(pd, "_free_bytes", free_bytes)
    out = resolve_on_every_rank(world)
    assert out == [0, 0, 0] and not ext.live


def test_no_ipc_or_no_extension_or_too_many_ranks_is_off(monkeypatch):
    assert run(monkeypatch, FakeWorld(2), FakeExt(full(2), ipc_ok=False)) == 0
    assert run(monkeypatch, FakeWorld(2), FakeExt(full(2), loads=False)) == 0
    assert run(monkeypatch, FakeWorld(3), FakeExt(full(3), max_ranks=2)) == 0


def test_extension_missing_on_one_rank_only_is_off_everywhere(monkeypatch):
    ext = FakeExt(full(3))
    world = FakeWorld(3)
    calls = {"n": 0}

    def load():
        with ext.lock:
            calls["n"] += 1
            first = calls["n"] == 1
        if first:
            raise RuntimeError("no nvcc on this rank (fake)")
        return ext

    monkeypatch.setattr(pd, "_load_ext", load)
    monkeypatch.setattr(pd, "_free_bytes", lambda dev: 140 * GiB)
    out = resolve_on_every_rank(world)
    assert out == [0, 0, 0]
    assert not ext.live


def test_several_nodes_or_sub_group_or_one_rank_or_other_backend_is_off_without_a_collective(monkeypatch, caplog):
    never = FakeExt(full(4))
    with caplog.at_level("INFO", logger="moecomm"):
        assert run(monkeypatch, FakeWorld(4, hosts=["a", "a", "b", "b"]), never) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "moecomm: peer-memory transport off (ranks on 2 nodes); exchanges go through NCCL"]
    # nodes simulated by init(local_size=): off too
    assert run(monkeypatch, FakeWorld(4, num_nodes=2), never) == 0
    assert run(monkeypatch, FakeWorld(4), never, whole_launch=False) == 0
    caplog.clear()
    with caplog.at_level("INFO", logger="moecomm"):
        assert run(monkeypatch, FakeWorld(1), never) == 0
        for backend in ("mpi", "torch", "self"):
            assert run(monkeypatch, FakeWorld(3, backend=backend), never) == 0  # its gather asserts if called
    assert not caplog.records
    assert never.opened == 0 and not never.live


@pytest.mark.parametrize("requested", [0, 24 << 10, 3 * GiB])
def test_an_explicit_value_is_used_as_given(monkeypatch, requested):
    ext = FakeExt(full(2))
    world = FakeWorld(2)
    assert run(monkeypatch, world, ext, requested=requested) == requested
    assert world.gathers == 0 and ext.opened == 0


def test_default_bytes_rule():
    for size in (2, 3, 5, 8, 64):
        for free in (0, 100 * MiB, 3 * GiB + 1, 24 * GiB, 80 * GiB, 141 * GiB):
            got = pd.default_bytes(size, free)
            assert got == reference_bytes(size, free), (size, free)
            assert got == 0 or (got % (2 * MiB) == 0 and got <= free // 16 and got // (4 * size) >= 8 * MiB)


def test_init_wires_the_resolved_size(monkeypatch):
    """init() passes p2p_bytes, the host names and whether it spans the launch to the rule, and
    builds the transport with what the rule returns (only where it returns a size)."""
    seen, built = [], []

    def fake_resolve(engine, num_nodes, requested, hosts, whole):
        seen.append((engine.backend.name, num_nodes, requested, len(hosts), whole))
        return 123 << 20 if requested is None else requested

    monkeypatch.setattr(init_mod, "resolve_p2p_bytes", fake_resolve)
    monkeypatch.setattr(init_mod, "_peer_transport", lambda engine, n, hosts: built.append(n))
    moecomm.init(backend="self", set_default=False)
    assert built == [123 << 20]
    c = moecomm.init(backend="self", p2p_bytes=0, set_default=False)
    assert c.engine.peer is None and built == [123 << 20]
    assert seen == [("self", 1, None, 1, True), ("self", 1, 0, 1, True)]


def test_cpu_communicators_are_untouched():
    """The real rule on CPU backends: no transport, no error; p2p_bytes=0 is accepted on any backend."""
    for kw in ({}, {"p2p_bytes": 0}):
        assert moecomm.init(backend="self", set_default=False, **kw).engine.peer is None
        assert moecomm.init(backend="mpi", set_default=False, **kw).engine.peer is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_on_by_default_on_two_gpus():
    """mpiexec -n 2: init() with no options has the transport on; all_to_all_v with the counts
    on the GPU and moecomm.distributed.all_to_all_single take it and equal the numpy reference."""
    from tests.mpi_util import run_ranks

    out = run_ranks(2, "tests.ranks.p2p_default_gpu", timeout=300, env={"NCCL_NVLS_ENABLE": "0"})
    assert "checks passed on 2 ranks" in out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_on_by_default_on_two_gpus_under_torchrun():
    import os
    import subprocess
    import sys

    from tests.mpi_util import RANKS_COMM_TIMEOUT_S, ROOT

    env = dict(os.environ, MOECOMM_TIMEOUT=RANKS_COMM_TIMEOUT_S, PYTHONPATH=ROOT, NCCL_NVLS_ENABLE="0")
    for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.ranks.p2p_default_gpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "checks passed on 2 ranks" in proc.stdout
