"""MoELayer(cuda_graph=...): argument checks, the CPU path, and the eager fallback when a
capture fails (the graphs themselves are checked on a GPU in test_moe_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import moecomm
from moecomm.moe import MoELayer
from moecomm.moe._step import graphed as _graphed


@pytest.fixture(scope="module")
def comm():
    return moecomm.init(backend="self", set_default=False)


def _pair(comm, **kw):
    return (MoELayer(32, 64, 4, k=2, seed=3, comm=comm, **kw),
            MoELayer(32, 64, 4, k=2, seed=3, comm=comm, cuda_graph=True, **kw))


def test_cuda_graph_must_be_a_bool(comm):
    with pytest.raises(TypeError, match="cuda_graph"):
        MoELayer(32, 64, 4, comm=comm, cuda_graph="yes")


def test_cpu_calls_run_eagerly_with_the_same_results(comm):
    ref, lay = _pair(comm)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(0))
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = ref(xa), lay(xb)
    (ya.square().sum() + ref.aux_loss).backward()
    (yb.square().sum() + lay.aux_loss).backward()
    assert len(lay._graphed) == 0
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    for (n, p), (_, q) in zip(ref.named_parameters(), lay.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_a_failed_capture_falls_back_to_eager_once_warned(comm, monkeypatch):
    ref, lay = _pair(comm)
    calls = []

    def broken(access, x, call):
        calls.append(1)
        call(x)  # the warm-up ran, then the capture failed: its outputs must not be used
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(_graphed, "_Step", broken)
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(1))
    with pytest.warns(RuntimeWarning, match="capturing the step for input shape"):
        assert lay._graphed.run(lay._step_access(), x, 0, 2, 1.0, 1, False, None, True, "expert") is None
    assert lay.aux_loss is None and lay.last_routing is None
    assert len(lay._graphed.failed) == 1 and "previous error" in next(iter(lay._graphed.failed.values()))
    assert lay._graphed.run(lay._step_access(), x, 0, 2, 1.0, 1, False, None, True, "expert") is None
    assert len(calls) == 1  # not tried again for the same key
    assert torch.equal(lay(x), ref(x))


class _FakeGraph:
    """A CUDA graph stand-in on the CPU: the "capture" runs eagerly, replay does nothing."""

    def replay(self) -> None:
        pass


class _FakeStream:
    def __init__(self, *args) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


def _cpu_capture(monkeypatch):
    """torch.cuda's capture calls made harmless on the CPU, so that _Step's bookkeeping
    (warm-up, outputs and their slots, the results handed back to the layer) runs here."""
    from contextlib import nullcontext

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


@pytest.mark.parametrize("kw", [dict(), dict(gate="cosine", z_loss_weight=0.01, balance_loss=None)])
def test_a_replayed_step_hands_its_results_to_the_layer(comm, monkeypatch, kw):
    """StepGraphs talks to the layer only through StepAccess: after a (CPU stand-in) capture
    and replay, the layer's output, losses, routing and mode are the captured call's, and a
    second call of the same key replays the cached step instead of capturing again."""
    _cpu_capture(monkeypatch)
    ref, lay = _pair(comm, **kw)
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(2))
    y_ref = ref(x.clone().requires_grad_(True))
    made = []
    real_step = _graphed._Step
    monkeypatch.setattr(_graphed, "_Step", lambda *a: made.append(1) or real_step(*a))
    for _ in range(2):
        y = lay._graphed.run(lay._step_access(), x.clone().requires_grad_(True), 0, 2, 1.0, 1, False, None, True,
                             "expert")
        assert y is not None and torch.equal(y, y_ref)
        got, want = lay._call_results(), ref._call_results()
        assert lay.aux_loss is not None
        for a, b in [(got.aux_loss, want.aux_loss), (got.balance_loss, want.balance_loss), (got.z_loss, want.z_loss)]:
            assert (a is None and b is None) or torch.equal(a, b)
        assert (got.balance_loss is got.aux_loss) == (want.balance_loss is want.aux_loss)
        assert (got.z_loss is got.aux_loss) == (want.z_loss is want.aux_loss)
        assert lay.last_routing is not None and torch.equal(lay.last_routing.topk_idx, ref.last_routing.topk_idx)
        assert lay.last_parallel_mode == "expert"
        y.sum().backward()  # the replay's backward node runs (the stand-in graph leaves zeros)
    assert made == [1] and len(lay._graphed) == 1
    results = lay._call_results()
    lay._step_access().clear_losses()
    assert lay.aux_loss is None and lay.balance_loss is None and lay._call_results().z_loss is None
    assert lay.last_routing is results.routing and lay._call_results().z_logits is results.z_logits
