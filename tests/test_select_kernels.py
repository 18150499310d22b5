"""moecomm_ext.select_experts (the router's choice and gates in one native pass, and its backward)
against moecomm.moe.scoring's torch operations (select_experts_torch), over random router
options, both dtypes, zero tokens included (CPU here; the same on the GPU under ``gpu``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import moecomm_ext
from moecomm.moe.scoring import RouterOptions, select_experts, select_experts_torch


@st.composite
def cases(draw):
    E = draw(st.sampled_from([4, 8, 16, 64]))
    groups = draw(st.sampled_from([None, 1, 2, 4]))
    fn = draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]))
    if groups is None or groups == 1:
        gk, k = None if groups is None else 1, draw(st.integers(1, min(E, 12)))
    else:
        gk = draw(st.integers(1, groups))
        k = draw(st.integers(gk, min(32, gk * (E // groups))))  # (the kernels keep at most 32 routes)
    return dict(E=E, k=k, fn=fn, groups=groups, gk=gk, normalize=draw(st.booleans()),
                scaling=draw(st.sampled_from([None, 2.5])), bias=draw(st.booleans()), T=draw(st.integers(0, 40)),
                dtype=draw(st.sampled_from([torch.float32, torch.float64])), seed=draw(st.integers(0, 2 ** 16)))


def _compare(c, device="cpu"):
    g = torch.Generator().manual_seed(c["seed"])
    dt = c["dtype"]
    logits = (torch.randn(c["T"], c["E"], generator=g, dtype=torch.float64) * 2).to(device, dt)
    bias = (torch.randn(c["E"], generator=g) * 0.1).to(device) if c["bias"] else None
    opts = RouterOptions(c["fn"], True, c["normalize"], c["scaling"], c["groups"], c["gk"])
    got_l = logits.clone().requires_grad_(True)
    native = moecomm_ext.select_experts(got_l, c["k"], c["fn"], True, c["normalize"], c["scaling"], c["groups"],
                                        c["gk"], bias)
    assert native is not None, "a covered configuration fell back to the torch operations"
    want_l = logits.clone().requires_grad_(True)
    want = select_experts_torch(want_l, c["k"], opts, bias)
    assert torch.equal(native[1], want[1])
    tol = dict(rtol=1e-5, atol=1e-6) if dt == torch.float32 else dict(rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(native[0], want[0], **tol)
    w = torch.randn(c["T"], c["k"], generator=g, dtype=torch.float64).to(device, dt)
    if c["T"]:
        (native[0] * w).sum().backward()
        (want[0] * w).sum().backward()
        torch.testing.assert_close(got_l.grad, want_l.grad, **tol)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_native_selection_matches_torch_operations(c):
    _compare(c)


def test_uncovered_configurations_fall_back():
    logits = torch.randn(5, 8)
    assert moecomm_ext.select_experts(logits, 2, "softmax", False, True, None, None, None, None) is None
    assert moecomm_ext.select_experts(logits.half(), 2, "sigmoid", True, True, None, None, None, None) is None
    assert moecomm_ext.select_experts(logits, 1, "sigmoid", True, True, None, 4, 2, None) is None  # k < group_topk
    assert moecomm_ext.select_experts(logits, 2, "sigmoid", True, True, None, None, None, None,
                                      use_native=False) is None
    # the scoring front takes the torch operations then, with the same results
    opts = RouterOptions("softmax", False, True, None, None, None)
    g1, i1 = select_experts(logits, 2, opts)
    g2, i2 = select_experts_torch(logits, 2, opts)
    assert torch.equal(i1, i2) and torch.equal(g1, g2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fn", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("groups,gk,k", [(None, None, 8), (8, 4, 8), (4, 2, 2), (None, None, 1)])
def test_cuda_selection_matches_torch_operations(fn, groups, gk, k):
    for dtype in (torch.float32, torch.float64):
        _compare(dict(E=64, k=k, fn=fn, groups=groups, gk=gk, normalize=True, scaling=2.5, bias=True, T=4096,
                      dtype=dtype, seed=k), device="cuda")


@pytest.mark.parametrize("fn", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("groups,gk", [(None, None), (4, 2)])
def test_nan_logits_stay_in_their_row(fn, groups, gk):
    """A NaN logit ranks above every value (as in torch.topk): the chosen experts stay in range
    and the other tokens' gates and gradients are the torch operations' ones."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 8, generator=g, dtype=torch.float64)
    logits[1, 0] = float("nan")
    logits[3, 5] = float("nan")
    lg = logits.clone().requires_grad_(True)
    gates, idx = moecomm_ext.select_experts(lg, 2, fn, True, True, None, groups, gk, None)
    assert int(idx.min()) >= 0 and int(idx.max()) < 8
    opts = RouterOptions(fn, True, True, None, groups, gk)
    lt = logits.clone().requires_grad_(True)
    want_g, want_i = select_experts_torch(lt, 2, opts)
    clean = [0, 2, 4, 5]
    assert torch.equal(idx[clean], want_i[clean]) or fn == "softmax"  # (softmax: NaN spreads over the row only)
    w = torch.randn(6, 2, generator=g, dtype=torch.float64)
    (torch.nan_to_num(gates) * w).sum().backward()
    (torch.nan_to_num(want_g) * w).sum().backward()
    torch.testing.assert_close(lg.grad[clean], lt.grad[clean])


def test_a_bias_of_another_shape_takes_the_torch_operations():
    logits = torch.randn(4, 8)
    assert moecomm_ext.select_experts(logits, 2, "sigmoid", True, True, None, None, None, torch.zeros(1, 8)) is None
