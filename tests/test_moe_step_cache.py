"""The MoE layer's cache of constant index tensors (moecomm.moe._ops.step_cache.StepConstants)."""

from __future__ import annotations

import torch

from moecomm.moe._ops.step_cache import StepConstants


def test_kept_per_key_bounded_and_not_in_inference_mode():
    c = StepConstants(limit=3)
    cpu = torch.device("cpu")
    a = c.arange(5, cpu)
    assert torch.equal(a, torch.arange(5)) and c.arange(5, cpu) is a
    o = c.ones(4, torch.float32, cpu)
    assert torch.equal(o, torch.ones(4)) and c.ones(4, torch.float32, cpu) is o
    assert c.ones(4, torch.float64, cpu) is not o and len(c) == 3
    c.arange(6, cpu)  # full: all dropped, then this one kept
    assert len(c) == 1 and c.arange(5, cpu) is not a
    with torch.inference_mode():
        t = c.arange(9, cpu)
    assert len(c) == 2 and torch.equal(t, torch.arange(9))
    assert c.arange(9, cpu) is not t  # a tensor for autograd, not the inference one


def test_a_layer_step_reuses_its_constants():
    import moecomm
    from moecomm.moe import MoELayer

    layer = MoELayer(16, 16, 4, k=2, seed=0, comm=moecomm.init())
    x = torch.randn(12, 16)
    y1 = layer(x)
    kept = len(layer._consts)
    assert kept > 0
    y2 = layer(x)
    assert len(layer._consts) == kept and torch.equal(y1, y2)
