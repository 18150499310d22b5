"""moecomm.moe._ops.wide_gemm: float32 results from bfloat16 GEMMs (the gate, the experts' bias sums)."""

from __future__ import annotations

import pytest
import torch

from moecomm.moe._ops.wide_gemm import wide_linear, wide_linear_applies
from moecomm.moe.gates import LinearTopKGate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _operands(T, D, E, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(E, D, generator=g) / D ** 0.5).to("cuda", torch.bfloat16).requires_grad_()
    gl = torch.randn(T, E, generator=g).cuda() * 1e-3
    return x, w, gl


@pytest.mark.parametrize("T,D,E", [(512, 256, 8), (1000, 2048, 16), (3, 64, 5)])
def test_matches_the_float32_gemm(T, D, E):
    x, w, gl = _operands(T, D, E, T + D + E)
    assert wide_linear_applies(x, w)
    got = wide_linear(x, w)
    got.backward(gl)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = torch.nn.functional.linear(xr.double(), wr.double())  # exact products, exact sums
    want.backward(gl.double())
    assert got.dtype == torch.float32
    scale = (xr.double().abs() @ wr.double().abs().t()).max().item()
    assert (got.double() - want).abs().max().item() <= 1e-6 * scale  # float32 sums, in another order
    gd, xd, wd = gl.double().abs(), xr.double().abs(), wr.double().abs()
    for name, a, b, sums in (("x", x.grad, xr.grad, gd @ wd), ("w", w.grad, wr.grad, gd.t() @ xd)):
        assert a.dtype == torch.bfloat16
        # one bfloat16 ulp (2**-7 relative: the float32 path rounds once too, so either may land a
        # half ulp off) of a float32 sum of g = hi + lo (within 2**-16 of g)
        err = (a.double() - b.double()).abs()
        bound = b.double().abs() * 2 ** -7 + sums * 2 ** -15
        assert (err <= bound).all(), f"{name}.grad: max err {err.max().item():.3g}"


def test_the_gate_uses_it_for_bfloat16_and_not_otherwise():
    gate = LinearTopKGate(256, 8, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda").bfloat16()
    want = torch.nn.functional.linear(x.float(), gate.wg.weight.float())
    got = gate(x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not wide_linear_applies(x.float(), gate.wg.weight)
    assert not wide_linear_applies(x.half(), gate.wg.weight.half())


@pytest.mark.parametrize("blocks,El,C,B", [(2, 8, 64, 256), (3, 1, 5, 24)])
def test_expert_bias_sums(blocks, El, C, B):
    from moecomm.moe.experts import Segments, seg_sum

    g = torch.randn(blocks * El * C, B, generator=torch.Generator().manual_seed(C)).cuda().bfloat16()
    got = seg_sum(g, Segments.uniform_blocks(blocks, El, C))
    want = g.double().view(blocks, El, C, B).sum(dim=(0, 2))
    assert got.dtype == torch.bfloat16 and got.shape == (El, B)
    bound = want.abs() * 2 ** -8 + g.double().abs().view(blocks, El, C, B).sum(dim=(0, 2)) * 2 ** -20
    assert ((got.double() - want).abs() <= bound).all()
