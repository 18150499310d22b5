"""MoELayer(cuda_graph=...): argument checks, the CPU path, and the eager fallback when a
capture fails (the graphs themselves are checked on a GPU in test_moe_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import moecomm
from moecomm.moe import MoELayer, _graphed


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

    def broken(layer, x, call):
        calls.append(1)
        call(x)  # the warm-up ran, then the capture failed: its outputs must not be used
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(_graphed, "_Step", broken)
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(1))
    with pytest.warns(RuntimeWarning, match="capturing the step for input shape"):
        assert lay._graphed.run(lay, x, 0, 2, 1.0, 1, False, None, True, "expert") is None
    assert lay.aux_loss is None and lay.last_routing is None
    assert len(lay._graphed.failed) == 1 and "previous error" in next(iter(lay._graphed.failed.values()))
    assert lay._graphed.run(lay, x, 0, 2, 1.0, 1, False, None, True, "expert") is None
    assert len(calls) == 1  # not tried again for the same key
    assert torch.equal(lay(x), ref(x))
