"""moecomm_ext dispatch/combine autograd and the slot maps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moecomm_ext as me
from moecomm_ext import reference as ref
from moecomm_ext.testing import random_routing

IMPLS = [pytest.param(True, id="native"), pytest.param(False, id="reference")]


@pytest.fixture(scope="module", autouse=True)
def native_cpu():
    if me.load_native("cpu") is None:
        pytest.skip("native CPU extension unavailable (test_ext_kernels reports why)")


def _routing(T, K, E, C, seed, drop=0.2):
    gen = torch.Generator().manual_seed(seed)
    return random_routing(T, K, E, C, drop_prob=drop, generator=gen)


def test_random_routing_maps_are_inverse():
    token_slots, slot_token = _routing(50, 3, 6, 7, seed=0)
    assert token_slots.shape == (50, 3) and slot_token.shape == (42,)
    for t in range(50):
        for j in range(3):
            m = int(token_slots[t, j])
            if m >= 0:
                assert int(slot_token[m]) == t
    assert int((slot_token >= 0).sum()) == int((token_slots >= 0).sum())
    assert torch.equal(me.invert_slots(token_slots, 42), slot_token)


def test_invert_slots_and_positions():
    ts = torch.tensor([[0, 3], [1, -1], [2, 5]])
    assert me.invert_slots(ts, 7).tolist() == [0, 1, 2, 0, -1, 2, -1]
    pos = me.slot_positions(ts, 7)
    assert pos.tolist() == [0, 2, 4, 1, -1, 5, -1]
    valid = pos >= 0
    assert torch.equal(me.invert_slots(ts, 7)[valid], pos[valid] // 2)
    w = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    slot_w = me.gather_rows(w.reshape(-1, 1), pos).reshape(-1)
    assert torch.allclose(slot_w, torch.tensor([0.1, 0.3, 0.5, 0.2, 0.0, 0.6, 0.0]))
    with pytest.raises(ValueError, match="'token_slots'.*more than once"):
        me.invert_slots(torch.tensor([[1, 1]]), 3)
    with pytest.raises(ValueError, match="'token_slots'"):
        me.invert_slots(ts, 5)
    with pytest.raises(ValueError, match="'num_slots'"):
        me.slot_positions(ts, -1)
    with pytest.raises(TypeError, match="'token_slots'"):
        me.invert_slots(ts.int(), 7)


@pytest.mark.parametrize("use_native", IMPLS)
@pytest.mark.parametrize("scaled", [False, True])
def test_dispatch_gradcheck(use_native, scaled):
    token_slots, slot_token = _routing(7, 2, 4, 3, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    scale = torch.rand(12, dtype=torch.float64, generator=gen, requires_grad=True) if scaled else None
    inputs = (x, scale) if scaled else (x,)

    def f(x, scale=None):
        return me.dispatch(x, slot_token, token_slots, scale, use_native=use_native)

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("use_native", IMPLS)
@pytest.mark.parametrize("weighted", [False, True])
def test_combine_gradcheck(use_native, weighted):
    token_slots, slot_token = _routing(6, 3, 4, 3, seed=3)
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(12, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(6, 3, dtype=torch.float64, generator=gen, requires_grad=True) if weighted else None
    inputs = (y, w) if weighted else (y,)

    def f(y, w=None):
        return me.combine(y, token_slots, w, slot_token, use_native=use_native)

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("use_native", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_slot_route_gives_the_same_gradients(use_native, dtype):
    """``slot_route`` (each slot's flat route, -1 when empty) only changes how the backward
    finds each slot's weight: the gradients are the same bits."""
    token_slots, slot_token = _routing(40, 3, 5, 9, seed=5)
    flat = token_slots.reshape(-1)
    slot_route = torch.full((slot_token.shape[0],), -1, dtype=torch.int64)
    kept = flat >= 0
    slot_route[flat[kept]] = torch.arange(flat.numel())[kept]
    gen = torch.Generator().manual_seed(6)
    y0 = torch.randn(slot_token.shape[0], 7, generator=gen).to(dtype)
    w0 = torch.rand(40, 3, generator=gen)
    g = torch.randn(40, 7, generator=gen).to(dtype)
    grads = []
    for sr in (None, slot_route):
        y, w = y0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        out = me.combine(y, token_slots, w, slot_token, use_native=use_native, slot_route=sr)
        out.backward(g)
        grads.append((out.detach(), y.grad, w.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="slot_route"):
        me.combine(y0, token_slots, w0, slot_token, slot_route=slot_route[:-1])


@settings(max_examples=15, deadline=None)
@given(
    T=st.integers(0, 12),
    K=st.integers(1, 3),
    E=st.integers(3, 5),
    C=st.integers(0, 4),
    D=st.integers(0, 9),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_dispatch_combine_grads_match_torch_autograd_of_reference(T, K, E, C, D, dtype, seed):
    """Hand-written backward (native and reference kernels) vs torch autograd through reference ops."""
    token_slots, slot_token = _routing(T, K, E, C, seed)
    M = E * C
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(T, D, generator=gen).to(dtype)
    s0 = torch.rand(M, generator=gen)
    y0 = torch.randn(M, D, generator=gen).to(dtype)
    w0 = torch.rand(T, K, generator=gen)
    gd = torch.randn(M, D, generator=gen).to(dtype)
    gc = torch.randn(T, D, generator=gen).to(dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)

    def run(fd, fc):
        x, s, y, w = (t.clone().requires_grad_() for t in (x0, s0, y0, w0))
        out_d = fd(x, slot_token, token_slots, s)
        out_c = fc(y, token_slots, w, slot_token)
        torch.autograd.backward([out_d, out_c], [gd, gc])
        # (torch autograd leaves .grad None for a source with no rows)
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (x, s, y, w)]
        return out_d.detach(), out_c.detach(), *grads

    expected = run(ref.dispatch, ref.combine)
    for use_native in (True, False):
        got = run(
            lambda *a: me.dispatch(*a, use_native=use_native),
            lambda *a: me.combine(*a, use_native=use_native),
        )
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape
            torch.testing.assert_close(g, e, **tol)


def test_weightless_combine_and_scaleless_dispatch_grads():
    token_slots, slot_token = _routing(9, 2, 3, 5, seed=5)
    x = torch.randn(9, 4, requires_grad=True)
    y = torch.randn(15, 4, requires_grad=True)
    (me.dispatch(x, slot_token, token_slots).sum() + me.combine(y, token_slots, None, slot_token).sum()).backward()
    # every kept copy contributes exactly once
    assert torch.equal(x.grad, (token_slots >= 0).sum(1, keepdim=True).float().expand(9, 4))
    assert torch.equal(y.grad, (slot_token >= 0).float().unsqueeze(1).expand(15, 4))


def test_dispatch_combine_roundtrip_bf16():
    token_slots, slot_token = _routing(64, 2, 8, 16, seed=6)
    x = torch.randn(64, 32).to(torch.bfloat16)
    w = torch.rand(64, 2)
    buf = me.dispatch(x, slot_token, token_slots)
    out = me.combine(buf, token_slots, w, slot_token)
    expected = ref.gather_reduce_rows(ref.gather_rows(x, slot_token), token_slots, w)
    assert torch.equal(out, expected) or torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_dispatch_combine_bad_inputs():
    token_slots, slot_token = _routing(5, 2, 3, 4, seed=7)
    x = torch.randn(5, 3)
    y = torch.randn(12, 3)
    with pytest.raises(ValueError, match="'token_slots'"):
        me.dispatch(x, slot_token, token_slots[:4])
    with pytest.raises(TypeError, match="'slot_token'"):
        me.dispatch(x, slot_token.int(), token_slots)
    with pytest.raises(ValueError, match="'slot_scale'"):
        me.dispatch(x, slot_token, token_slots, torch.ones(11))
    with pytest.raises(TypeError, match="'x'"):
        me.dispatch(x.long(), slot_token, token_slots)
    with pytest.raises(ValueError, match="'slot_token'"):
        me.combine(y[:11], token_slots, None, slot_token)
    with pytest.raises(ValueError, match="'token_weight'"):
        me.combine(y, token_slots, torch.ones(5, 3), slot_token)
    bad = slot_token.clone()
    m = int((bad >= 0).nonzero()[0])
    bad[m] = (bad[m] + 1) % 5
    with pytest.raises(ValueError, match="not inverse"):
        me.combine(y, token_slots, None, bad)
    with pytest.raises(ValueError, match="not inverse"):
        me.dispatch(x, bad, token_slots)
    # check=False skips the (host-syncing) consistency check
    me.dispatch(x, bad, token_slots, check=False)
