"""Segments whose per-expert counts stay on the device (:meth:`Segments.on_device`): the same
layout as host counts, checked when the host asks for them; and the one-rank dropless step
(fused, and data-parallel) runs its grouped GEMMs from them without reading the counts on
the host, with the same results as host counts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import moecomm
from moecomm.moe import MoELayer
from moecomm.moe._ops.seg_gemm import grouped_mm_available, seg_mm, seg_sum, seg_wgrad
from moecomm.moe._ops.segments import Segments


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=3), min_size=1, max_size=3))
def test_on_device_layout_equals_host_layout(counts):
    host = Segments(counts, 3)
    dev = Segments.on_device(torch.tensor(counts, dtype=torch.int64), [sum(b) for b in counts], 3)
    assert dev.counts is None and dev.rows == host.rows and dev.num_blocks == host.num_blocks
    assert dev.block_rows() == host.block_rows()
    assert torch.equal(dev.row_expert(torch.device("cpu")), host.row_expert(torch.device("cpu")))
    assert list(dev.items()) == list(host.items()) and dev.per_expert() == host.per_expert()
    assert dev.counts == counts  # read once, then kept


@pytest.mark.skipif(not grouped_mm_available(torch.device("cpu"), torch.float32), reason="no CPU grouped GEMM")
def test_on_device_gemms_never_read_the_counts_on_the_host(monkeypatch):
    counts = [[3, 0, 5], [0, 2, 6]]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g)
    w = torch.randn(3, 8, 8, generator=g)
    gy = torch.randn(16, 8, generator=g)
    ref = (seg_mm(x, w, Segments(counts, 3)), seg_wgrad(x, gy, Segments(counts, 3)), seg_sum(gy, Segments(counts, 3)))
    monkeypatch.setattr(Segments, "host_counts", lambda self: pytest.fail("host_counts read"))
    dev = Segments.on_device(torch.tensor(counts), [8, 8], 3)
    got = (seg_mm(x, w, dev), seg_wgrad(x, gy, dev), seg_sum(gy, dev))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_on_device_checks_its_arguments():
    with pytest.raises(ValueError, match="counts_dev must be"):
        Segments.on_device(torch.zeros(2, 3, dtype=torch.int64), [0], 3)
    with pytest.raises(ValueError, match="needs counts_dev and block_totals"):
        Segments(None, 3)
    bad = Segments.on_device(torch.tensor([[1, 2, 3]]), [5], 3)  # the counts add up to 6 rows
    with pytest.raises(ValueError, match="block_totals"):
        bad.host_counts()
    neg = Segments.on_device(torch.tensor([[1, -1, 3]]), [3], 3)
    with pytest.raises(ValueError, match="negative"):
        neg.host_counts()


@pytest.fixture(scope="module")
def comm():
    return moecomm.init()


@pytest.mark.skipif(not grouped_mm_available(torch.device("cpu"), torch.float32), reason="no CPU grouped GEMM")
@pytest.mark.parametrize("mode", ["fused", "data"])
@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_one_rank_dropless_keeps_counts_on_the_device(comm, monkeypatch, mode, activation):
    kw = dict(k=2, dropless=True, seed=1, comm=comm, activation=activation)
    if mode == "data":
        kw["parallel_mode"] = "data"
    layer = MoELayer(16, 16, 4, **kw)
    ref = MoELayer(16, 16, 4, fused_step=False, **{**kw, "parallel_mode": "expert"})
    ref.load_state_dict(layer.state_dict())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 16, generator=g)
    x[:10] = x[0]  # tokens that pick the same experts: one expert with many rows, others with none
    gy = torch.randn(40, 16, generator=g)

    def step(m):
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        torch.autograd.backward([y, m.aux_loss], [gy, torch.ones_like(m.aux_loss)])
        return [y.detach(), xx.grad] + [p.grad for p in m.parameters()]

    want = step(ref)
    with monkeypatch.context() as mp:
        mp.setattr(Segments, "host_counts", lambda self: pytest.fail("the one-rank dropless step read its counts"))
        mp.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("the one-rank dropless step read a tensor"))
        got = step(layer)
    if mode == "fused":
        assert layer.last_step_path.path == "fused"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
