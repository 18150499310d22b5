"""moecomm.overlap's host-side pieces, in process (no MPI): chunk plans, Chunk helpers, auto degree."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecomm.collectives import overlap_plan as ovp
from moecomm import overlap as ov

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=6), stages=st.integers(1, 16),
       data=st.data())
def test_plan_pieces_cover_each_block_in_order(counts, stages, data):
    pieces = data.draw(st.lists(st.integers(1, stages), min_size=len(counts), max_size=len(counts)))
    b = ovp._bounds(np.array(counts), np.array(pieces), stages)
    assert b.shape == (stages + 1, len(counts))
    assert (b[0] == 0).all() and (b[-1] == np.array(counts)).all()
    sizes = np.diff(b, axis=0)
    assert (sizes >= 0).all()
    for p, (n, k) in enumerate(zip(counts, pieces)):
        used = sizes[:k, p]
        assert used.max() - used.min() <= 1  # balanced pieces
        assert (sizes[k:, p] == 0).all()  # nothing after the pair's last piece
    plan = ovp.Plan(counts, counts, pieces, pieces, stages, torch.device("cpu"))
    x = torch.arange(sum(counts) * 2).reshape(-1, 2)
    parts = [plan.pack(x, c) for c in range(stages)]
    assert sum(p.shape[0] for p in parts) == x.shape[0]
    assert torch.equal(plan.unpack(parts, (2,), x.dtype), x)
    # stage c's rows are grouped by destination, each a contiguous sub-block of that block
    offsets = np.cumsum(counts) - np.array(counts)
    for c, part in enumerate(parts):
        expect = np.concatenate([np.arange(offsets[p] + b[c, p], offsets[p] + b[c + 1, p]) for p in range(len(counts))])
        assert part[:, 0].div(2, rounding_mode="floor").tolist() == expect.tolist()


@settings(max_examples=60, deadline=None)
@given(send=st.lists(st.integers(0, 30), min_size=2, max_size=6), degree=st.integers(1, 5), data=st.data())
def test_own_first_plan(send, degree, data):
    """own_first: stage 0 holds the own block's first ``round(own_split * n)`` rows and (with
    ``own_last``) the last stage the rest; the peers' blocks fill the stages between in
    ``degree`` balanced pieces; packing then unpacking gives the input back."""
    W = len(send)
    own = data.draw(st.integers(0, W - 1))
    recv = data.draw(st.lists(st.integers(0, 30), min_size=W, max_size=W))
    recv[own] = send[own]
    own_last = data.draw(st.booleans())
    split = data.draw(st.sampled_from([0.0, 0.25, 0.5, 0.7, 0.99])) if own_last else 1.0
    stages = degree + 1 + own_last
    plan = ovp.Plan(send, recv, [degree] * W, [degree] * W, degree, torch.device("cpu"), own, split)
    assert plan.stages == stages and plan.own_last == own_last
    n = send[own]
    first = min(n, max(0, round(split * n)))
    own_stages = [0, stages - 1] if own_last else [0]
    for counts, total in ((plan.send_counts, send), (plan.recv_counts, recv)):
        assert counts[0] == [first if p == own else 0 for p in range(W)]
        if own_last:
            assert counts[-1] == [n - first if p == own else 0 for p in range(W)]
        peers = [counts[c] for c in range(stages) if c not in own_stages]
        assert len(peers) == degree and all(stage[own] == 0 for stage in peers)
        for p in range(W):
            if p != own:
                piece = [stage[p] for stage in peers]
                assert sum(piece) == total[p] and max(piece) - min(piece) <= 1
    assert [c for c in range(stages) if plan.is_local(c)] == own_stages
    x = torch.arange(sum(send) * 2).reshape(-1, 2)
    block = x[sum(send[:own]):sum(send[:own + 1])]
    assert torch.equal(torch.cat([plan.own_rows(x, c) for c in own_stages]), block)
    parts = [plan.pack(x, c) for c in range(plan.stages)]
    for c in own_stages:
        assert torch.equal(parts[c], plan.own_rows(x, c))
    assert torch.equal(plan.unpack(parts, (2,), x.dtype), x)


def test_chunk_helpers():
    recv = [3, 0, 4]
    counts = [[1, 2], [0, 0], [3, 1]]  # [source][group]
    ch = ov.Chunk(1, 2, [2, 0, 2], [1, 0, 2], recv, torch.device("cpu"))
    assert ch.rows == 4
    assert ch.source_ranks().tolist() == [0, 0, 2, 2]
    assert ch.positions().tolist() == [1, 2, 5, 6]
    full = torch.arange(7) * 10
    assert ch.take(full).tolist() == [10, 20, 50, 60]
    assert ch.group_splits(counts) == [[0, 2], [0, 0], [1, 1]]
    order, sizes = ch.group_order(counts)
    assert sizes == [1, 3]
    assert order.tolist() == [2, 0, 1, 3]  # group 0: source 2's row; group 1: source 0's two, source 2's
    go = ch.group_order(torch.tensor(counts))
    assert torch.equal(go.inverse[go.order], torch.arange(4))
    with pytest.raises(ValueError):
        ch.group_splits([[1, 1], [0, 0], [3, 1]])  # does not sum to recv_splits
    whole = ov.Chunk.full(recv)
    assert whole.take(full) is full and whole.source_ranks().tolist() == [0, 0, 0, 2, 2, 2, 2]


@pytest.mark.parametrize("bad", [0, 17, -1, 2.0, "max", True, None])
def test_degree_validation(bad):
    with pytest.raises(ValueError):
        ov._check_degree(bad)


def test_auto_degree_rule():
    mib = 1 << 20
    nccl = SimpleNamespace(size=8, backend="nccl")
    stages, per_stage = ov._AUTO_RULES["nccl"]
    assert ov.auto_stages(nccl) == stages
    assert ov.auto_pieces(nccl, [0, 1, 100], 1024) == [1, 1, 1]  # small pairs are not cut
    pair = lambda nbytes: nbytes // 8 // 1024  # rows of a pair when a rank exchanges nbytes  # noqa: E731
    assert ov.auto_pieces(nccl, [pair(128 * mib)], 1024) == [1]  # measured: degree 1 wins at 128 MiB/rank
    assert ov.auto_pieces(nccl, [pair(stages * per_stage * 4)], 1024) == [stages]
    assert ov.auto_pieces(nccl, [pair(2 * per_stage)], 1024) == [min(2, stages)]
    assert ov.auto_stages(SimpleNamespace(size=1, backend="nccl")) == 1
    assert ov.auto_pieces(SimpleNamespace(size=1, backend="mpi"), [10**9], 4) == [1]
    # with peer memory the copy engines move the stages: their own rule (2 stages from 256 MiB/rank)
    ce = SimpleNamespace(size=2, backend="nccl", engine=SimpleNamespace(peer=object()))
    assert ov._AUTO_RULES["nccl-copy-engines"] == (2, 128 * mib)
    half = lambda nbytes: nbytes // 2 // 8192  # rows of 8 KiB of a pair when a rank exchanges nbytes  # noqa: E731
    assert ov.auto_stages(ce) == 2
    assert ov.auto_pieces(ce, [half(256 * mib), half(64 * mib), 0], 8192) == [2, 1, 1]
    plain = SimpleNamespace(size=2, backend="nccl", engine=SimpleNamespace(peer=None))
    assert ov.auto_pieces(plain, [half(256 * mib)], 8192) == [1]
    # while a CUDA graph is captured: more stages (the host pays nothing per stage at a replay)
    ce_graph = SimpleNamespace(size=2, backend="nccl", engine=SimpleNamespace(peer=object(), capturing=lambda: True))
    assert ov.auto_stages(ce_graph) == 4
    assert ov.auto_pieces(ce_graph, [half(256 * mib), half(128 * mib), half(32 * mib)], 8192) == [4, 2, 1]
    nccl_graph = SimpleNamespace(size=2, backend="nccl", engine=SimpleNamespace(peer=None, capturing=lambda: True))
    assert ov.auto_pieces(nccl_graph, [half(256 * mib), half(64 * mib)], 8192) == [2, 1]
    eager = SimpleNamespace(size=2, backend="nccl", engine=SimpleNamespace(peer=object(), capturing=lambda: False))
    assert ov.auto_pieces(eager, [half(256 * mib)], 8192) == [2]
    mpi = SimpleNamespace(size=2, backend="mpi", engine=SimpleNamespace(capturing=lambda: True))  # no graph rule
    assert ov.auto_stages(mpi) == ov._AUTO_RULES["mpi"][0]

    # a profile's measured degrees win: the entry nearest to rows * row_bytes * size
    entries = [SimpleNamespace(bytes_per_rank=mib, degree=1), SimpleNamespace(bytes_per_rank=64 * mib, degree=3)]

    class Prof:
        def __init__(self):
            self.entries = entries

        def entry_for(self, nbytes):
            return min(self.entries, key=lambda e: abs(np.log2(e.bytes_per_rank) - np.log2(max(nbytes, 1))))

    with_prof = SimpleNamespace(size=4, backend="nccl", topology=SimpleNamespace(profile=Prof()))
    assert ov.auto_stages(with_prof) == 3
    assert ov.auto_pieces(with_prof, [(16 * mib) // 1024, 100], 1024) == [3, 1]
