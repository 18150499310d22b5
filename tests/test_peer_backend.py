"""The peer-memory backend's host-side logic, on the CPU: rounds through buffers smaller
than an exchange (against a reference exchange), the arena's default size, and the choice
of backend on shared GPUs (the GPUs faked). The backend itself runs in the device suites
(tests/ranks/peer_gpu.py, bench/gpu_session.sh)."""

from __future__ import annotations

import logging
import re

import numpy as np
import torch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moecomm
from moecomm.backends import _select as _make_backend
from moecomm.backends.peer import default_arena_bytes, shared_gpus
from moecomm.backends.peer_rounds import (SHARED_INTS, agreement_record, direct_destinations, disagreement,
                                          is_direct, most_rounds, round_blocks, rounds_needed)


@st.composite
def exchanges(draw):
    world = draw(st.integers(1, 7))
    counts = draw(st.lists(st.lists(st.integers(0, 23) | st.just(0), min_size=world, max_size=world),
                           min_size=world, max_size=world))
    cap = draw(st.integers(1, 9))
    gaps = draw(st.lists(st.integers(0, 3), min_size=2 * world * world, max_size=2 * world * world))
    return world, counts, cap, gaps


def _displs(counts, gaps):
    out, at = [], 0
    for n, g in zip(counts, gaps):
        at += g
        out.append(at)
        at += n
    return out, at


@settings(max_examples=300, deadline=None)
@given(exchanges())
def test_rounds_move_every_row_once_and_agree_pairwise(case):
    world, C, cap, gaps = case
    rows = {}  # every rank's input (rows tagged src, dst, index) and output, with gaps between blocks
    plan = {}
    for me in range(world):
        send = C[me]
        recv = [C[p][me] for p in range(world)]
        sd, send_len = _displs(send, gaps[2 * world * me: 2 * world * me + world])
        rd, recv_len = _displs(recv, gaps[2 * world * me + world: 2 * world * (me + 1)])
        x = np.full((send_len, 3), -1, dtype=np.int64)
        for p in range(world):
            for i in range(send[p]):
                x[sd[p] + i] = (me, p, i)
        rows[me] = (x, np.full((recv_len, 3), -7, dtype=np.int64))
        plan[me] = (send, sd, recv, rd)
    rounds = max(rounds_needed(plan[me][0], plan[me][2], me, cap) for me in range(world))
    for me in range(world):  # the own block: one copy, outside the rounds
        send, sd, recv, rd = plan[me]
        x, out = rows[me]
        out[rd[me]:rd[me] + recv[me]] = x[sd[me]:sd[me] + send[me]]
    for r in range(rounds):
        parts = {me: round_blocks(*plan[me][:4], me, cap, r) for me in range(world)}
        for s in range(world):
            for d in range(world):
                n = parts[s].send[d]
                assert n == parts[d].recv[s], "sender and receiver disagree on a round's block"
                assert n <= cap and (s != d or n == 0)
                if n:
                    src = rows[s][0][parts[s].send_displs[d]:parts[s].send_displs[d] + n]
                    rows[d][1][parts[d].recv_displs[s]:parts[d].recv_displs[s] + n] = src
    for me in range(world):
        _, out = rows[me]
        _, _, recv, rd = plan[me]
        for p in range(world):
            block = out[rd[p]:rd[p] + recv[p]]
            expected = np.array([(p, me, i) for i in range(recv[p])], dtype=np.int64).reshape(-1, 3)
            np.testing.assert_array_equal(block, expected)
        # nothing written into the gaps between blocks
        mask = np.ones(len(out), dtype=bool)
        for p in range(world):
            mask[rd[p]:rd[p] + recv[p]] = False
        assert (out[mask] == -7).all()


def test_rounds_needed_counts_peers_only():
    assert rounds_needed([100, 3, 0], [100, 0, 7], 0, 4) == 2  # the own block (100) is no round's
    assert rounds_needed([5], [5], 0, 1) == 0
    assert rounds_needed([0, 0], [0, 0], 1, 3) == 0
    assert rounds_needed([0, 9], [0, 9], 0, 3) == 3
    with pytest.raises(ValueError, match="cap"):
        rounds_needed([1], [1], 0, 0)


def test_default_arena_fits_a_quarter_of_the_free_memory():
    full = default_arena_bytes(2, 2, 140 << 30)
    assert full == 4 * 2 * (32 << 20) + (1 << 20)
    eight = default_arena_bytes(8, 8, 140 << 30)
    assert eight * 8 <= (140 << 30) // 4
    small = default_arena_bytes(8, 8, 2 << 30)
    assert small * 8 <= (2 << 30) // 4 and (small - (1 << 20)) % (4 * 8 << 20) == 0
    with pytest.raises(ValueError, match="free"):
        default_arena_bytes(8, 8, 64 << 20)


def test_shared_gpus_names_each_gpu_and_its_ranks():
    hosts = ["a", "a", "a", "b", "b"]
    uuids = ["G0", "G0", "G1", "G0", "G2"]
    assert shared_gpus(uuids, hosts) == {("a", "G0"): [0, 1]}
    assert shared_gpus(["G0", "G1"], ["a", "a"]) == {}


def test_auto_takes_the_peer_backend_where_ranks_share_a_gpu(caplog):
    with caplog.at_level(logging.INFO, logger="moecomm"):
        assert _make_backend._gpu_backend("nccl", True, ["G0", "G0", "G1"], ["h"] * 3, 0) == "peer"
    assert "ranks [0, 1] share GPU G0" in caplog.text
    assert _make_backend._gpu_backend("nccl", True, ["G0", "G0"], ["h"] * 2, 1) == "peer"
    assert _make_backend._gpu_backend("peer", False, ["G0", "G1"], ["h"] * 2, 0) == "peer"
    assert _make_backend._gpu_backend("nccl", False, ["G0", "G1"], ["h"] * 2, 0) == "nccl"


def test_auto_without_shared_gpus_is_nccl_or_mpi(monkeypatch):
    from moecomm.backends import nccl

    monkeypatch.setattr(nccl, "nccl_available", lambda: True)
    assert _make_backend._gpu_backend("nccl", True, ["G0", "G1"], ["h", "h"], 0) == "nccl"
    monkeypatch.setattr(nccl, "nccl_available", lambda: False)
    assert _make_backend._gpu_backend("nccl", True, ["G0", "G0"], ["h", "k"], 0) == "mpi"


def test_nccl_on_a_shared_gpu_is_refused_with_the_gpu_ranks_and_remedy():
    with pytest.raises(ValueError) as info:
        _make_backend._gpu_backend("nccl", False, ["G0", "G1", "G0"], ["h"] * 3, 2)
    text = str(info.value)
    assert "ranks [0, 2]" in text and "G0" in text and "backend='peer'" in text and "host h" in text


class _FakeHost:
    """A host channel whose allgather answers as if the other ranks sent ``others``."""

    def __init__(self, others: list[list[int]]) -> None:
        self.others, self.aborted = others, False

    def allgather(self, values, what=""):
        return [list(values), *self.others]

    def abort(self):
        self.aborted = True


def _backend_with(others: list[list[int]]):
    from types import SimpleNamespace

    from moecomm.backends.peer import PeerBackend

    b = object.__new__(PeerBackend)  # the agreement only: no GPU, no transport's rounds
    b.rank, b.size, b._calls, b._aborted, b._host_failure, b.concurrent = 0, 2, 0, False, None, True
    b._host = _FakeHost(others)
    b._watchdog = SimpleNamespace(stop=lambda: None, failure=None)
    b.transport = SimpleNamespace(capacity_rows=lambda row_bytes: 1 << 20, region_bytes=1 << 30)
    b.begin = lambda *tensors: 0  # (the own block's copy is issued on "stream 0" before the agreement)
    return b


def _record(call, row_bytes, send, recv):
    return agreement_record(call, row_bytes, 0, 0, [0] * SHARED_INTS, send, recv, [0, recv[0]], _described().codes)


def _described(label=None, wire=None, dtype=torch.float32, shape=(4,)):
    from moecomm.engine import tags

    with tags.labelled(label, wire):
        return tags.exchange_meta(dtype, shape)


def _record_of(meta, send=(1, 1)):
    return agreement_record(1, 16, 0, 0, [0] * SHARED_INTS, list(send), [1, 1], [0, 1], meta.codes)


@pytest.mark.parametrize("other, words, aborted", [
    (_record(2, 16, [1, 1], [1, 1]), "different exchanges", True),         # the peer is one exchange ahead
    (_record(1, 32, [1, 1], [1, 1]), "rows differ in size (16 to 32 bytes", False),
    (_record(1, 16, [2, 1], [1, 1]), "rank 0 expected 1 rows from rank 1, but rank 1 sent 2", False),
    # what the exchange is, named before its counts (issue 32: the table's cases on the peer backend)
    (_record_of(_described(dtype=torch.int32), (2, 1)), "rank(s) [1] pass another dtype than rank 0 (torch.float32)",
     False),
    (_record_of(_described(shape=(2, 2))), "another row shape than rank 0 ((4,))", False),
    (_record_of(_described(wire=torch.float8_e5m2)), "another wire dtype than rank 0 (None)", False),
    (_record_of(_described(label="all_to_all_v backward")), "another kind of exchange than rank 0 (all_to_all_v)",
     False),
])
def test_ranks_that_disagree_raise_before_any_row_moves(other, words, aborted, monkeypatch):
    from types import SimpleNamespace

    from moecomm.backends import peer
    from moecomm.errors import CountMismatchError

    copies = []
    monkeypatch.setattr(peer, "_cudart", SimpleNamespace(D2D=0, copy_async=lambda *args: copies.append(args)))
    b = _backend_with([other])
    x = torch.zeros(2, 4)
    with pytest.raises(CountMismatchError, match=re.escape(words)):
        b.alltoallv(x, [1, 1], x, [1, 1], 16, meta=_described())
    assert b._host.aborted is aborted and b._aborted is aborted
    assert len(copies) == 1 and copies[0][2] == 16  # the own block only: no peer's row moved


@st.composite
def direct_exchanges(draw):
    world = draw(st.integers(1, 7))
    counts = draw(st.lists(st.lists(st.integers(0, 9) | st.just(0), min_size=world, max_size=world),
                           min_size=world, max_size=world))
    flags = draw(st.lists(st.sampled_from([0, 1]), min_size=world, max_size=world))
    gaps = draw(st.lists(st.integers(0, 3), min_size=world * world, max_size=world * world))
    return world, counts, flags, gaps


@settings(max_examples=300, deadline=None)
@given(direct_exchanges())
def test_direct_destinations_put_every_block_where_its_receiver_expects_it(case):
    """Outputs laid out in one flat "device memory" (each rank's output at an address of its
    own, mapped at another address in every other rank, with gaps between blocks): the
    blocks each sender writes at the addresses of direct_destinations land exactly where the
    receiver's displacements say, and nothing lands elsewhere."""
    world, C, flags, gaps = case
    row_bytes = 8
    memory = {}  # address (bytes, multiple of row_bytes) -> (src, dst, i)
    outputs = {}  # rank -> (address of its output in its own process, recv displs, recv counts)
    at = 1 << 20
    for r in range(world):
        recv = [C[p][r] for p in range(world)]
        rd, length = _displs(recv, gaps[world * r: world * (r + 1)])
        outputs[r] = (at + 4096 * r, rd, recv)  # the offset of the output in its allocation: 4096 * r
    table = []
    for r in range(world):
        recv = outputs[r][2]
        shared = [r + 1, 7, 0, 0, 0, 0, 0, 0, 4096 * r] if flags[r] else [0] * SHARED_INTS
        table.append(agreement_record(5, row_bytes, 1, flags[r], shared, C[r], recv, outputs[r][1]))
    for me in range(world):
        assert disagreement(table, me) is None
    mapped = {}

    def map_output(peer, shared):  # the peer's allocation, seen from rank `me` at an address of its own
        assert list(shared[:8]) == [peer + 1, 7, 0, 0, 0, 0, 0, 0]
        mapped[(me, peer)] = (me + 1) * (1 << 32) + peer * (1 << 24)
        return mapped[(me, peer)] + shared[8]

    for me in range(world):
        dst = direct_destinations(table, me, row_bytes, map_output)
        for p in range(world):
            if p == me or not flags[p] or not C[me][p]:
                assert dst[p] == 0
                continue
            assert is_direct(table)
            for i in range(C[me][p]):  # translate back into the receiver's own addresses
                addr = dst[p] - mapped[(me, p)] + at + i * row_bytes
                assert addr not in memory
                memory[addr] = (me, p, i)
    for r in range(world):
        if not flags[r]:
            continue
        base, rd, recv = outputs[r]
        for s in range(world):
            if s == r:
                continue
            for i in range(recv[s]):
                assert memory.pop(base + (rd[s] + i) * row_bytes) == (s, r, i)
    assert not memory, "rows written outside the receivers' blocks"


def test_exchange_is_direct_only_if_someone_shares_and_nobody_cannot():
    def table(*flags):
        return [agreement_record(1, 8, 1, f, [0] * SHARED_INTS, [0] * len(flags), [0] * len(flags),
                                 [0] * len(flags)) for f in flags]

    assert is_direct(table(1, 0, 1)) and is_direct(table(1))
    assert not is_direct(table(0, 0)) and not is_direct(table(1, -1)) and not is_direct(table(-1, 0))
    assert most_rounds([agreement_record(1, 8, r, 0, [0] * SHARED_INTS, [0], [0], [0]) for r in (2, 5, 0)]) == 5
    with pytest.raises(ValueError, match="9 ints"):
        agreement_record(1, 8, 1, 0, [0] * 8, [0], [0], [0])


def _peer_transport_class():
    """``moecomm.backends.p2p.PeerTransport`` for its host-side planning, importable without
    cuda-bindings (absent on a CPU machine): the CUDA runtime module stands in empty while
    it imports."""
    import importlib
    import sys
    import types

    name = "moecomm.backends._cudart"
    try:
        return importlib.import_module("moecomm.backends.p2p").PeerTransport
    except ImportError:
        pass
    saved = {k: sys.modules.get(k) for k in (name, "moecomm.backends.p2p")}
    sys.modules[name] = types.ModuleType(name)
    try:
        return importlib.import_module("moecomm.backends.p2p").PeerTransport
    finally:
        package = sys.modules["moecomm.backends"]
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
                package.__dict__.pop(k.rsplit(".", 1)[1], None)
            else:
                sys.modules[k] = v


def _inline_rows(count: int, cap: int) -> int:
    """The counts-on-the-GPU kernels' rule (p2p_cuda.cu, inline_rows): a block travels in the
    kernel round whole when it fits ``cap`` rows, else not at all."""
    return count if 0 <= count <= cap else 0


@settings(max_examples=200, deadline=None)
@given(exchanges(), st.booleans())
def test_counts_on_the_gpu_inline_blocks_and_the_exchange_after_move_every_row_once(case, collective):
    """The counts-on-the-GPU exchange, planned on the host: the kernel round carries the blocks
    that fit whole (rows placed by the received counts, as copy_out does), ``finish``'s second
    exchange (``_overflow(whole=True)``) the others whole; together every row arrives once,
    where a plain all-to-all puts it. The second exchange is needed exactly where some
    block does not fit (the headers' flag), and NCCL's pairwise one is skipped where none of
    this rank's does."""
    PeerTransport = _peer_transport_class()
    world, C, cap, _ = case
    calls = {}

    class Backend:
        def __init__(self, me):
            self.me = me

        def alltoallv(self, x, send, out, recv, row_bytes, sd, rd):
            calls[self.me] = (list(send), list(sd), list(recv), list(rd))
            return "rest"

    inputs = [[(s, d, i) for d in range(world) for i in range(C[s][d])] for s in range(world)]
    outputs = [[None] * sum(C[s][d] for s in range(world)) for d in range(world)]
    overflows = any(C[s][d] > cap for s in range(world) for d in range(world))
    for me in range(world):
        t = PeerTransport.__new__(PeerTransport)
        t.collective, t._backend = collective, Backend(me)
        send, recv = list(C[me]), [C[s][me] for s in range(world)]
        rest = t._overflow(None, send, None, None, recv, None, 1, None, cap, whole=True)
        assert (rest is not None) == (collective or max(send + recv) > cap)
        # the kernel round: rows from source s land at the prefix of the received counts
        for s in range(world):
            n = _inline_rows(recv[s], cap)
            start = sum(C[q][me] for q in range(s))
            src_start = sum(C[s][q] for q in range(me))
            for i in range(n):
                assert outputs[me][start + i] is None
                outputs[me][start + i] = inputs[s][src_start + i]
        assert any(n > cap for n in send + recv) <= overflows
    for me, (send, sd, _, _) in calls.items():  # the second exchange, as the backend would move it
        for d in range(world):
            if d not in calls:  # (NCCL: a rank with no block beyond cap joins no second exchange)
                assert send[d] == 0
                continue
            _, _, recv_d, rd_d = calls[d]
            assert send[d] == recv_d[me]
            for i in range(send[d]):
                assert outputs[d][rd_d[me] + i] is None
                outputs[d][rd_d[me] + i] = inputs[me][sd[d] + i]
    want = [[(s, d, i) for s in range(world) for i in range(C[s][d])] for d in range(world)]
    assert outputs == want


def test_header_mismatch_names_the_first_peer_with_another_dtype_or_shape():
    """The counts-on-the-GPU headers' check (every rank reads every header, so each names the
    disagreement): another dtype first, then another row shape; None where all agree."""
    from moecomm.collectives.flat import _header_mismatch

    from moecomm.engine.tags import exchange_meta

    bf16, f32 = exchange_meta(torch.bfloat16, (8,)), exchange_meta(torch.float32, (4,))
    table = np.array([[5, 7, 16, 0], [5, 7, 16, 1], [5, 7, 16, 0]])
    assert _header_mismatch(1, table, (5, 7), 16, bf16) is None
    table[2] = [5, 8, 16, 0]
    assert "rank 2 sent rows of another shape than rank 0" in _header_mismatch(0, table, (5, 7), 16, f32)
    table[1] = [9, 7, 32, 0]
    got = _header_mismatch(0, table, (5, 7), 16, bf16)
    assert ("rank 1 sent rows of another dtype, wire dtype or kind of exchange than rank 0's (torch.bfloat16, wire "
            "dtype None, all_to_all_v; rows of 32 bytes against 16)") in got
    # the odd rank itself names the first peer that differs from it
    assert "rank 0 sent rows of another dtype" in _header_mismatch(1, table, (9, 7), 32, f32)


def test_header_codes_tell_wire_dtypes_and_kinds_of_exchange_apart():
    """The counts-on-the-GPU headers' first code covers the dtype, the wire dtype and the kind
    of exchange (a backward meeting a forward); the second the row shape alone."""
    from moecomm.collectives.flat import _kind_code
    from moecomm.engine import tags

    def code(dtype=torch.uint8, label=None, wire=None):
        with tags.labelled(label, wire):
            return _kind_code(tags.exchange_meta(dtype, (8,)))

    codes = {code(), code(torch.int8), code(wire=torch.float8_e4m3fn), code(wire=torch.float8_e5m2),
             code(label="all_to_all_v backward"), code(label="all_to_all_single")}
    assert len(codes) == 6 and code() == code() and all(0 <= c < 2 ** 31 for c in codes)


def test_header_error_bad_counts_raise_on_every_rank_before_any_disagreement():
    """A sender whose counts on the GPU were bad (the kernel flagged them and moved none of its
    rows) makes every rank raise: itself a ValueError naming its send_splits, the others a
    CountMismatchError naming it; a dtype disagreement comes after; no flags, no error."""
    from moecomm.backends._p2p_limits import BAD_COUNTS, OVERFLOWS
    from moecomm.collectives.flat import _header_error

    from moecomm.engine.tags import exchange_meta

    f32 = exchange_meta(torch.float32, (4,))
    table = np.array([[5, 7, 16, OVERFLOWS], [5, 7, 16, 0], [5, 7, 16, 0]])
    assert _header_error(0, table, (5, 7), 16, f32, [1, 2, 3], 6) is None
    table[2, 3] = BAD_COUNTS | OVERFLOWS
    table[1] = [9, 7, 32, 0]
    for me in (0, 1):
        err = _header_error(me, table, (5, 7), 16, f32, [1, 2, 3], 6)
        assert isinstance(err, moecomm.CountMismatchError) and "rank 2's send_splits" in str(err), err
    err = _header_error(2, table, (5, 7), 16, f32, [1, 2, 4], 6)
    assert type(err) is ValueError and "sum to the 6 rows of input" in str(err) and "sums to 7" in str(err)
    err = _header_error(2, table, (5, 7), 16, f32, [1, -2, 7], 6)
    assert type(err) is ValueError and "must be >= 0, got [1, -2, 7]" in str(err)
    table[2, 3] = OVERFLOWS
    err = _header_error(0, table, (5, 7), 16, f32, [1, 2, 3], 6)
    assert isinstance(err, moecomm.CountMismatchError) and "another dtype" in str(err)


def test_fixed_blocks_share_each_output_once_and_write_straight_into_the_peers(monkeypatch):
    """LowLatencyBuffer's exchanges on the peer backend: setting up shares the receive buffer
    once (one all-gather) and keeps the peers' mappings; each exchange copies the own block and
    issues one direct round (no host agreement, no copy out of an arena); ranks that pass
    other block sizes or a buffer that cannot be shared are named."""
    from types import SimpleNamespace

    from moecomm.backends import peer
    from moecomm.errors import CountMismatchError

    B = 4096
    handle = list(range(1, 9))
    b = _backend_with([[B, 1, *[10 + i for i in range(8)], 256]])
    maps, rounds, copies = [], [], []
    b.transport = SimpleNamespace(
        export_output=lambda t: [*handle, 64],
        map_output=lambda p, shared, keep=False: maps.append((p, list(shared), keep)) or 1_000_000 * (p + 1) + shared[8],
        issue_direct=lambda *args: rounds.append(args), problem=None)
    b.end = lambda op, problem=None: ("request", op)
    monkeypatch.setattr(peer, "_cudart", SimpleNamespace(D2D=0, copy_async=lambda *args: copies.append(args)))
    recv = torch.zeros(2 * B, dtype=torch.uint8)
    dst = b.fixed_destinations(recv, B)
    assert dst == [0, 2_000_000 + 256 + 0 * B] and maps == [(1, [10 + i for i in range(8)] + [256], True)]
    send = torch.zeros(2 * B, dtype=torch.uint8)
    assert b.fixed_alltoall(send, recv, B, dst)[0] == "request"
    assert len(copies) == 1 and copies[0][2] == B  # the own block, from block 0 of send to block 0 of recv
    (stream, x, sc, sd, out, rc, rd, row_bytes, destinations, copy_out), = rounds
    assert (sc, sd, rc, rd, row_bytes, destinations, copy_out) == ([0, 1], [0, 1], [0, 1], [0, 1], B, dst, False)

    b._host = _FakeHost([[2 * B, 1, *handle, 0]])
    with pytest.raises(CountMismatchError, match=r"bytes per rank: \[4096, 8192\]"):
        b.fixed_destinations(recv, B)
    b._host = _FakeHost([[B, 0, *[0] * 9]])
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] cannot be shared"):
        b.fixed_destinations(recv, B)


def test_low_latency_buffer_takes_the_peer_transport_on_the_peer_backend():
    from types import SimpleNamespace

    from moecomm.low_latency import AllToAllTransport, PeerMemoryTransport, default_transport

    peer_like = SimpleNamespace(fixed_alltoall=None, fixed_destinations=None)
    comm = SimpleNamespace(size=2, backend="peer", engine=SimpleNamespace(backend=peer_like))
    assert isinstance(default_transport(comm), PeerMemoryTransport)
    assert isinstance(default_transport(SimpleNamespace(size=1, engine=comm.engine)), AllToAllTransport)
    mpi = SimpleNamespace(size=2, backend="mpi", engine=SimpleNamespace(backend=object()))
    assert isinstance(default_transport(mpi), AllToAllTransport)
    with pytest.raises(TypeError, match="peer-memory backend"):
        PeerMemoryTransport(mpi)


@st.composite
def _agreement_tables(draw):
    """Records of 1-8 ranks that agree, then perhaps one field of one rank changed."""
    W = draw(st.integers(1, 8))
    C = np.array(draw(st.lists(st.integers(0, 9), min_size=W * W, max_size=W * W))).reshape(W, W)
    meta = tuple(draw(st.lists(st.integers(0, 2 ** 31 - 1), min_size=4, max_size=4)))
    table = [agreement_record(3, 16, 1, 0, [0] * SHARED_INTS, C[r].tolist(), C[:, r].tolist(),
                              np.concatenate([[0], np.cumsum(C[:, r])[:-1]]).tolist(), meta) for r in range(W)]
    field = draw(st.sampled_from(["none", "call", "row_bytes", "meta", "sent", "expected"]))
    r, p, i = draw(st.integers(0, W - 1)), draw(st.integers(0, W - 1)), draw(st.integers(0, 3))
    at = {"call": 0, "row_bytes": 1, "meta": 4 + SHARED_INTS + 3 * W + i, "sent": 4 + SHARED_INTS + p,
          "expected": 4 + SHARED_INTS + W + p}.get(field)
    if at is not None:
        table[r][at] += draw(st.integers(1, 5))
    return table, field if at is not None else "none"


@given(_agreement_tables(), st.integers(0, 7))
@settings(max_examples=300, deadline=None)
def test_disagreement_finds_exactly_the_tables_that_disagree(case, me):
    """disagreement() against a plain comparison of the records (numpy): None exactly where
    every rank is in the same call with the same row size and description, and every block's
    sender and receiver count it alike; else an answer naming what differs."""
    table, changed = case
    W = len(table)
    me %= W
    t = np.array(table)
    meta_at = 4 + SHARED_INTS + 3 * W
    sent = t[:, 4 + SHARED_INTS:4 + SHARED_INTS + W]             # [s, r]
    expected = t[:, 4 + SHARED_INTS + W:4 + SHARED_INTS + 2 * W]  # [r, s]
    agree = (t[:, :2] == t[0, :2]).all() and (t[:, meta_at:] == t[0, meta_at:]).all() and (sent == expected.T).all()
    got = disagreement(table, me)
    assert (got is None) == bool(agree), (changed, got)
    if got is not None:
        assert got[0] == (changed == "call")
        word = {"call": "different exchanges", "row_bytes": "differ in size", "sent": "splits disagree",
                "expected": "splits disagree", "meta": "pass another"}[changed]
        assert word in got[1], got


@settings(max_examples=80, deadline=None)
@given(world=st.integers(2, 7), rows=st.integers(0, 20) | st.just(0), cap=st.integers(1, 8))
def test_equal_blocks_move_every_row_once_in_rounds_with_no_host_agreement(world, rows, cap):
    """all_to_all_single without split sizes on the peer backend (``alltoall_equal``): every
    rank issues the same rounds from its own arguments alone (no host collective), each
    round's headers carry the block size, and replaying the rounds as the copy engines move
    them (the own block whole, at most ``cap`` rows of every other block a round, each block
    from where its sender's displacements say to where its receiver's say) gives every
    rank what a numpy all-to-all of equal blocks gives."""
    from types import SimpleNamespace

    from moecomm.backends.peer import PeerBackend

    class NoHost:
        def __getattr__(self, name):
            raise AssertionError(f"the host channel was used ({name})")

    meta = _described(shape=(1,))
    issued = []
    for me in range(world):
        b = object.__new__(PeerBackend)
        b.rank, b.size, b._calls, b.concurrent, b._host = me, world, 0, True, NoHost()
        rounds = []
        b.transport = SimpleNamespace(capacity_rows=lambda row_bytes: cap, problem=lambda *a: None,
                                      issue_round=lambda *args: rounds.append(args))
        b.begin = lambda *tensors: 0
        b.end = lambda op, problem=None: ("request", op)
        assert b.alltoall_equal(None, None, rows, 8, meta)[0] == "request" and b._calls == 1
        issued.append(rounds)
    assert len({len(r) for r in issued}) == 1 and len(issued[0]) == max(1, -(-rows // cap))
    data = [np.arange(world * rows) + 1000 * me for me in range(world)]  # row i of rank me's input
    out = [np.full(world * rows, -1) for _ in range(world)]
    for r in range(len(issued[0])):
        for me in range(world):
            _, _, send, sd, _, recv, rd, row_bytes, words = issued[me][r]
            assert row_bytes == 8 and tuple(words) == (*meta.codes, rows)
            for p in range(world):
                n = send[p]
                assert n == issued[p][r][5][me]  # what p expects from me this round: what I send
                assert n <= cap or p == me
                at = issued[p][r][6][me]
                out[p][at:at + n] = data[me][sd[p]:sd[p] + n]
    for me in range(world):
        want = np.concatenate([data[q][me * rows:(me + 1) * rows] for q in range(world)])
        assert np.array_equal(out[me], want)


@pytest.mark.parametrize("status, words", [
    ([0, 0, 0, 3, 1, 77], "all_to_all_single (peer memory): rank 1 passes another dtype than rank 0 (torch.bfloat16)"),
    ([0, 0, 0, 3, 4, 6], "rank 1 passes another block size (rows per rank) than rank 0 (5)"),
    ([0, 0, 0, 2, 6, 5], "rank 0 expected 5 rows from rank 1, but rank 1 sent 6"),
])
def test_copy_engine_round_problems_name_the_peer_and_what_differs(status, words, monkeypatch):
    """What the copy-engine round's wait kernel reports (``status``: code, then two words, per
    source), as the error the request raises: another meta word (equal blocks: dtype, block
    size, ...) or another count, naming the peer; nothing reported: None."""
    import importlib
    import sys
    from types import SimpleNamespace

    import moecomm.backends
    from moecomm.errors import CountMismatchError

    # the transport's module needs cuda-bindings only to run exchanges: a stand-in lets it import here
    monkeypatch.setitem(sys.modules, "moecomm.backends._cudart", SimpleNamespace())
    monkeypatch.delitem(sys.modules, "moecomm.backends.p2p", raising=False)
    monkeypatch.setattr(moecomm.backends, "p2p", None, raising=False)
    t = object.__new__(importlib.import_module("moecomm.backends.p2p").PeerTransport)
    t.rank, t._backend = 0, SimpleNamespace(timeout_s=5.0)
    t._status = np.zeros(6, dtype=np.int64)
    assert t.problem() is None
    t._status[:] = status
    mine = ("all_to_all_single", "torch.bfloat16", "(16,)", "None", "5")
    err = t.problem("all_to_all_single (peer memory)", mine)
    assert isinstance(err, CountMismatchError) and words in str(err) and "aborted" in str(err)
    t._status[:] = [0, 0, 0, 1, 0, 5]
    assert isinstance(t.problem(), TimeoutError) and "split sizes" not in str(t.problem())
    late = t.problem("all_to_all_single (peer memory)", mine)  # equal blocks: the mixed-call hint
    assert isinstance(late, TimeoutError) and "rank 1 is gone or stuck, or passed split sizes" in str(late)


@pytest.mark.parametrize("copy_kernels, send, row_bytes, want", [
    (True, [4, 0, 3], 4096, True),                      # 28 KiB: SM kernels
    (True, [2048, 2048, 4096], 4096, True),             # 32 MiB exactly: still kernels
    (True, [2048, 2048, 4097], 4096, False),            # one row more: copy engines
    (False, [4, 0, 3], 4096, False),                    # copy engines asked for (the NCCL backend's default)
])
def test_copy_engine_round_moves_small_rounds_by_kernels(copy_kernels, send, row_bytes, want, monkeypatch):
    """A known-counts round goes to SM kernels only where the transport allows them and the
    rank sends at most COPY_KERNELS_MAX_BYTES in it (own block included)."""
    import importlib
    import sys
    from types import SimpleNamespace

    import moecomm.backends

    monkeypatch.setitem(sys.modules, "moecomm.backends._cudart", SimpleNamespace())
    monkeypatch.delitem(sys.modules, "moecomm.backends.p2p", raising=False)
    monkeypatch.setattr(moecomm.backends, "p2p", None, raising=False)
    p2p = importlib.import_module("moecomm.backends.p2p")
    assert p2p.COPY_KERNELS_MAX_BYTES == 32 << 20
    calls = []
    t = object.__new__(p2p.PeerTransport)
    t._ext = SimpleNamespace(ce_exchange=lambda *args: calls.append(args))
    t._aux, t._fork, t._join = SimpleNamespace(cuda_stream=0), 0, 0
    t._device, t.rank, t._base_list, t._ptrs, t._ce_half = 0, 0, [0, 0, 0], [0], 0
    t._ce_state = t._status_t = SimpleNamespace(data_ptr=lambda: 0)
    t.region_bytes = t.ce_data_off = t.ce_header_off = t.ce_ack_off = 0
    t._backend = SimpleNamespace(timeout_s=5.0)
    t.copy_kernels = copy_kernels
    x = SimpleNamespace(data_ptr=lambda: 0)
    t._ce_exchange(0, x, send, None, x, send, None, row_bytes, -1, (), True)
    assert len(calls) == 1 and calls[0][-1] is want


@pytest.mark.parametrize("concurrent", [True, False])
def test_agreement_timeout_names_a_peer_that_passed_no_split_sizes(concurrent, monkeypatch):
    """Concurrent ranks: a peer in all_to_all_single without split sizes (equal blocks) never
    joins the known-counts agreement; its timeout says so (and aborts, as any host timeout)."""
    from types import SimpleNamespace

    from moecomm.backends import peer

    monkeypatch.setattr(peer, "_cudart", SimpleNamespace(D2D=0, copy_async=lambda *args: None))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    b = _backend_with([])
    b.concurrent = concurrent
    b.abort = lambda: setattr(b, "_aborted", True)

    def late(values, what=""):
        raise TimeoutError(f"moecomm: {what} did not complete within 5 s on rank 0: some rank has not reached it")

    b._host.allgather = late
    x = torch.zeros(2, 4)
    with pytest.raises(TimeoutError) as info:
        b.alltoallv(x, [1, 1], x, [1, 1], 16, meta=_described())
    assert ("without split sizes" in str(info.value)) is concurrent and b._aborted


class _ThreadHost:
    """A host channel for ``world`` threads, one per rank: allgather gathers every rank's values."""

    def __init__(self, world: int) -> None:
        import threading

        self.world, self.values, self.aborted = world, [None] * world, [False] * world
        self.barrier = threading.Barrier(world, timeout=10)

    def channel(self, rank: int):
        from types import SimpleNamespace

        def allgather(values, what=""):
            self.values[rank] = list(values)
            self.barrier.wait()
            table = [list(v) for v in self.values]
            self.barrier.wait()
            return table

        return SimpleNamespace(allgather=allgather, abort=lambda: self.aborted.__setitem__(rank, True))


def _counts_round_ranks(world, counts, cap, codes, calls, monkeypatch):
    """Every rank's PeerBackend.counts_round and finish_counts_round, one thread a rank, on
    stand-ins of the transport (it records what it is asked to move) and of the host channel."""
    import threading
    from types import SimpleNamespace

    from moecomm.backends import peer
    from moecomm.backends.peer import PeerBackend
    from moecomm.collectives import flat

    monkeypatch.setattr(peer, "_cudart", SimpleNamespace(current_stream=lambda index: 0))
    host = _ThreadHost(world)
    results, moved = [None] * world, [dict(copies=None, rest=None) for _ in range(world)]

    def run(me):
        sent = list(counts[me])
        t = SimpleNamespace(inline_bytes=cap * 16, start=lambda x, c, rb, cd, wait=True: None,
                            wait_stream=lambda stream, op: None, counts=lambda: (sent, None, False),
                            copy_out_regions=lambda h, out, recv, rb: moved[me].update(copies=list(recv)),
                            rest_whole=lambda x, out, s, r, rb: moved[me].update(rest=(list(s), list(r))) or "rest")
        b = object.__new__(PeerBackend)
        b.rank, b.size, b._calls, b._aborted, b._host_failure, b.concurrent = me, world, calls[me], False, None, False
        b.one_host_round, b.transport, b._host = True, t, host.channel(me)
        b.device = torch.device("cpu")
        b._watchdog = SimpleNamespace(stop=lambda: None, failure=None)
        b.begin = lambda *tensors: 0
        b.end = lambda op, problem=None: "copied"
        rows = sum(max(0, v) for v in sent) if me != 99 else 0
        x = torch.zeros(rows, 8)
        try:  # as moecomm.collectives.flat's counts-round path: the round, the heads checked, the copy out
            rnd = b.counts_round(x, None, 16, codes[me])
            flat._check_heads(me, rnd.heads, codes[me], 16, _described(shape=(8,)), rnd.send, rows)
            results[me] = (rnd, b.finish_counts_round(x, torch.zeros(sum(rnd.recv), 8), rnd, 16), b._aborted)
        except Exception as exc:  # noqa: BLE001 - the test looks at what each rank raised
            results[me] = (exc, None, b._aborted)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    return results, moved


@settings(max_examples=30, deadline=None)
@given(exchanges())
def test_counts_round_gives_every_rank_its_column_and_the_whole_blocks_after(case):
    """Ranks sharing a GPU without MPS, counts on the GPU, one host round: each rank receives
    the counts its peers send it, copies out the blocks that fit the inline capacity, and
    every rank joins the exchange of the whole blocks where any block anywhere exceeds it."""
    world, C, cap, _ = case
    with pytest.MonkeyPatch.context() as mp:
        results, moved = _counts_round_ranks(world, C, cap, [(5, 7)] * world, [3] * world, mp)
    overflows = any(v > cap for row in C for v in row)
    for me in range(world):
        rnd, request, aborted = results[me]
        assert not isinstance(rnd, Exception), rnd
        assert rnd.send == C[me] and rnd.recv == [C[s][me] for s in range(world)] and not aborted
        assert rnd.heads == [[5, 7, 16, int(max(C[s]) > cap)] for s in range(world)]  # (OVERFLOWS is flag 1)
        assert moved[me]["copies"] == (rnd.recv if sum(rnd.recv) else None)
        assert (moved[me]["rest"] is not None) == overflows and request == ("rest" if overflows else "copied")


@pytest.mark.parametrize("bad, words", [
    ("counts", "rank 1's send_splits are negative or do not add up"),
    ("dtype", "rank 1 sent rows of another dtype, wire dtype or kind of exchange than rank"),
    ("shape", "rank 1 sent rows of another shape than rank"),
    ("step", "different exchanges"),
])
def test_counts_round_names_a_disagreement_on_every_rank_before_any_row_is_copied(bad, words, monkeypatch):
    from moecomm.errors import CountMismatchError

    world = 3
    C = [[1, 2, 0], [0, 1, 1], [2, 0, 3]]
    codes = [(5, 7)] * world
    calls = [3] * world
    if bad == "counts":
        C[1] = [1, -1, 2]
    elif bad == "dtype":
        codes[1] = (6, 7)
    elif bad == "shape":
        codes[1] = (5, 8)
    else:
        calls[1] = 4
    results, moved = _counts_round_ranks(world, C, 4, codes, calls, monkeypatch)
    for me in range(world):
        exc, _, aborted = results[me]
        assert moved[me]["copies"] is None  # nothing copied out anywhere
        assert aborted is (bad == "step")  # out of step: aborted; else the communicator stays usable
        if bad == "counts" and me == 1:
            assert isinstance(exc, ValueError) and "send_splits must be >= 0" in str(exc)
        elif bad == "step":
            assert isinstance(exc, CountMismatchError) and words in str(exc)
        else:  # each rank names a rank that differs from it: the odd one, or (on the odd one) rank 0
            assert isinstance(exc, CountMismatchError), exc
            assert words.replace("rank 1", "rank 0" if me == 1 else "rank 1") in str(exc), exc
