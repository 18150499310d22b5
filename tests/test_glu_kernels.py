"""moecomm_ext's one-pass GLU kernels (glu_forward / glu_backward) against the pure-torch
reference and against autograd through the activation as the experts wrote it before
(CPU here; the same on the GPU under the ``gpu`` mark)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import moecomm_ext
from moecomm_ext import reference

ACTS = sorted(moecomm_ext.GLU_CODES)
TORCH_GATE = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "relu": F.relu}
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _inputs(n, H, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, 2 * H, generator=g, dtype=torch.float64) * 3).to(device, dtype)
    grad = torch.randn(n, H, generator=g, dtype=torch.float64).to(device, dtype)
    return h, grad


def _autograd(h, grad, act):
    """float64 autograd through ``f(g) * u``, the definition."""
    H = h.shape[1] // 2
    hh = h.double().requires_grad_(True)
    a = TORCH_GATE[act](hh[:, :H]) * hh[:, H:]
    (gh,) = torch.autograd.grad(a, hh, grad.double())
    return a.detach(), gh


def _check(h, grad, act, use_native):
    dt = h.dtype
    a = moecomm_ext.glu_forward(h, act, use_native=use_native)
    gh, again = moecomm_ext.glu_backward(grad, h, act, use_native=use_native)
    gh_only, none = moecomm_ext.glu_backward(grad, h, act, need_out=False, use_native=use_native)
    want_a, want_gh = _autograd(h, grad, act)
    assert a.dtype == dt and a.shape == (h.shape[0], h.shape[1] // 2) and gh.shape == h.shape and none is None
    scale = max(1.0, float(want_gh.abs().max())) if want_gh.numel() else 1.0
    torch.testing.assert_close(a.double(), want_a, rtol=TOL[dt], atol=TOL[dt] * scale)
    torch.testing.assert_close(gh.double(), want_gh, rtol=TOL[dt], atol=TOL[dt] * scale)
    assert torch.equal(again, a) and torch.equal(gh_only, gh)  # one pass gives both, the same bits
    return a, gh


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 9), H=st.integers(1, 19), act=st.sampled_from(ACTS),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_native_and_reference_match_the_definition_cpu(n, H, act, dtype, seed):
    h, grad = _inputs(n, H, dtype, "cpu", seed)
    native = _check(h, grad, act, None)
    ref = _check(h, grad, act, False)
    for x, y in zip(native, ref):  # native against reference: both rounded once from float32 math
        # each is within TOL of the definition, relative to the largest value (the float32 erf and
        # tanh of the two differ by an ulp or two): so the two are within twice that of each other
        scale = max(1.0, float(y.double().abs().max())) if y.numel() else 1.0
        torch.testing.assert_close(x.double(), y.double(), rtol=TOL[dtype], atol=2 * TOL[dtype] * scale)


def test_bad_arguments_are_named():
    h = torch.randn(3, 4)
    with pytest.raises(ValueError, match="argument 'h' must be a \\[N, 2H\\]"):
        moecomm_ext.glu_forward(torch.randn(3, 5))
    with pytest.raises(ValueError, match="argument 'act'"):
        moecomm_ext.glu_forward(h, "swish")
    with pytest.raises(TypeError, match="argument 'h' must be float16"):
        moecomm_ext.glu_forward(h.long())
    with pytest.raises(ValueError, match="argument 'grad' must be \\[3, 2\\]"):
        moecomm_ext.glu_backward(torch.randn(3, 3), h)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("n,H", [(0, 8), (7, 3), (33, 8), (513, 2048), (5, 12)])
def test_cuda_kernels_match_the_definition(act, dtype, n, H):
    h, grad = _inputs(n, H, dtype, "cuda", n + H)
    a, gh = _check(h, grad, act, None)
    ra, rgh = reference.glu_forward(h, act), reference.glu_backward(grad, h, act, False)[0]
    torch.testing.assert_close(a.double(), ra.double(), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(gh.double(), rgh.double(), rtol=TOL[dtype], atol=TOL[dtype] * 4)
    # an offset view (not 16-byte aligned) takes the narrower loads and gives the same values
    big = torch.cat([h.new_zeros(1, h.shape[1]), h]).reshape(-1)[h.shape[1] - 1:-1]
    if n and big.numel() == h.numel():
        off = big.view_as(h)
        off.copy_(h)
        torch.testing.assert_close(moecomm_ext.glu_forward(off, act), a)
