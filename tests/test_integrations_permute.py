"""Megatron-core's ``permute`` / ``unpermute`` with ``moecomm.integrations.megatron.enable()``
against Megatron's own (one process, no ranks needed): forward and backward, the forms the
alltoall dispatcher uses in 0.19.2 (probs permuted alongside, dropless and ``drop_and_pad``)
and ``unpermute`` with probs. Skipped where megatron-core (and triton) are not installed::

    pip install --no-deps --ignore-requires-python megatron-core==0.19.2 && pip install --no-deps triton
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("megatron", "triton")),
    reason="megatron-core 0.19.2 / triton are not installed")


def _routing(seed: int, T: int, E: int, k: int, drop_and_pad: bool):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, E, generator=g)
    if seed % 2:
        scores[:, -1] = -float("inf")  # an expert nothing goes to
    routing = torch.zeros(T, E, dtype=torch.bool).scatter_(1, scores.topk(k, dim=1).indices, True)
    capacity = None
    if drop_and_pad:  # as the dispatcher: keep the first `capacity` tokens of each expert, pad to it
        capacity = max(1, (T * k) // E)
        pos = torch.cumsum(routing.int(), 0) - 1
        routing &= pos < capacity
    probs = torch.softmax(scores, 1) * routing
    return routing, probs, capacity


def _run(seed: int, T: int, E: int, k: int, H: int, dtype: torch.dtype, drop_and_pad: bool, unpermute_probs: bool):
    from megatron.core.transformer.moe import moe_utils

    routing, probs, capacity = _routing(seed, T, E, k, drop_and_pad)
    num_out = E * capacity if drop_and_pad else int(routing.sum())
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_(True)
    p = probs.clone().requires_grad_(True)
    out, pp, idx, _, _ = moe_utils.permute(x, routing, probs=p, num_out_tokens=num_out, drop_and_pad=drop_and_pad)
    y = out * torch.randn(out.shape, generator=g).to(dtype) + pp.unsqueeze(-1).to(dtype)
    back = moe_utils.unpermute(y, idx, restore_shape=x.shape, probs=p if unpermute_probs else None,
                               routing_map=routing, drop_and_pad=drop_and_pad)
    (back.float() * torch.randn(back.shape, generator=g)).sum().backward()
    return out.detach(), pp.detach(), idx, back.detach(), x.grad, p.grad


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return t.view(torch.int16).numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("drop_and_pad", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("unpermute_probs", [False, True])
def test_permute_unpermute_bits(dtype, drop_and_pad, k, unpermute_probs):
    from moecomm.integrations import megatron

    if dtype == torch.bfloat16 and k > 2:
        pytest.skip("bfloat16 beyond two rows per token: moecomm rounds once, Megatron after every add")
    for seed in range(3):
        args = (seed, 13 + seed, 4, k, 5, dtype, drop_and_pad, unpermute_probs)
        theirs = _run(*args)
        megatron.enable()
        try:
            assert megatron.permute_enabled()
            ours = _run(*args)
        finally:
            megatron.disable()
        assert not megatron.permute_enabled()
        for a, b, what in zip(theirs, ours, ("permuted", "permuted probs", "sorted indices", "unpermuted",
                                              "tokens grad", "probs grad")):
            assert a.dtype == b.dtype and a.shape == b.shape, what
            assert np.array_equal(_bits(a), _bits(b)), f"{what} differs (seed {seed})"


def test_enable_replaces_and_disable_restores():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from moecomm.integrations import megatron

    before = moe_utils.permute, moe_utils.unpermute, token_dispatcher.permute, token_dispatcher.unpermute
    megatron.enable(permute=False)
    try:
        assert megatron.is_enabled() and not megatron.permute_enabled()
        assert (moe_utils.permute, token_dispatcher.unpermute) == (before[0], before[3])
        megatron.enable()
        assert megatron.permute_enabled()
        assert token_dispatcher.permute is moe_utils.permute is not before[0]
        assert token_dispatcher.unpermute is moe_utils.unpermute is not before[1]
    finally:
        megatron.disable()
    assert (moe_utils.permute, moe_utils.unpermute, token_dispatcher.permute, token_dispatcher.unpermute) == before
    with pytest.raises(TypeError, match="permute must be a bool, got 'yes'"):
        megatron.enable(permute="yes")
    megatron.disable()
