"""moecomm_ext's per-segment bias and column sums (seg_bias_act, seg_colsum) against a float64
loop over the segments written here, and against moecomm_ext.reference bit for bit (CPU; the
CUDA kernels under the ``gpu`` mark); the dropless layer with them against the torch ops they
replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import moecomm_ext
from moecomm.moe import MoELayer
from moecomm.moe._ops import seg_gemm
from moecomm_ext import _loader, reference

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
EPS = {torch.float64: 1e-15, torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _layout(counts, cols, dtype, extra, seed, device="cpu"):
    """Rows for ``counts`` (segments in row order) plus ``extra`` rows in no segment."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    rows = int(ends[-1]) + extra
    h = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 2).to(device, dtype)
    return h, ends.to(device)


def _expert_rows(counts, El):
    """For each local expert, its rows (row indices), from the counts alone."""
    out, start = [[] for _ in range(El)], 0
    for s, n in enumerate(counts):
        out[s % El].extend(range(start, start + n))
        start += n
    return out


def _bias_definition(h, bias, counts, relu):
    out = h.double().numpy().copy()
    b = bias.double().numpy()
    for e, rows in enumerate(_expert_rows(counts, bias.shape[0])):
        for r in rows:
            out[r] += b[e]
            if relu:
                out[r] = np.maximum(out[r], 0)
    return out


def _sum_definition(g, counts, El):
    x = g.double().numpy()
    return np.stack([x[rows].sum(0) if rows else np.zeros(x.shape[1]) for rows in _expert_rows(counts, El)])


layouts = st.tuples(st.integers(1, 5), st.integers(1, 4)).flatmap(lambda eb: st.tuples(
    st.just(eb[0]), st.lists(st.integers(0, 6), min_size=eb[0] * eb[1], max_size=eb[0] * eb[1])))


@settings(max_examples=60, deadline=None)
@given(layout=layouts, cols=st.integers(1, 19), extra=st.integers(0, 2), dtype=st.sampled_from(DTYPES),
       relu=st.booleans(), seed=st.integers(0, 2**16))
def test_bias_matches_the_definition_and_the_reference_cpu(layout, cols, extra, dtype, relu, seed):
    El, counts = layout
    h, ends = _layout(counts, cols, dtype, extra, seed)
    bias = torch.randn(El, cols, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)
    want = _bias_definition(h, bias, counts, relu)
    ref = reference.seg_bias_act(h, bias, ends, relu)
    for use_native in (None, False):
        got = h.clone()
        assert moecomm_ext.seg_bias_act(got, bias, ends, relu=relu, use_native=use_native) is got  # in place
        assert torch.equal(got, ref)  # one rounding of the float32 sum: the reference's bits
        np.testing.assert_allclose(got.double().numpy(), want, rtol=EPS[dtype], atol=EPS[dtype] * 4)
    if extra:  # rows in no segment are left alone
        assert torch.equal(got[-extra:], h[-extra:])


@settings(max_examples=60, deadline=None)
@given(layout=layouts, cols=st.integers(1, 19), extra=st.integers(0, 2), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_sums_match_the_definition_and_the_reference_cpu(layout, cols, extra, dtype, seed):
    El, counts = layout
    g, ends = _layout(counts, cols, dtype, extra, seed)
    want = _sum_definition(g, counts, El)
    ref = reference.seg_colsum(g, ends, El)
    got = moecomm_ext.seg_colsum(g, ends, El)
    assert got.shape == (El, cols) and got.dtype == dtype
    assert torch.equal(got, ref)  # the CPU sums each expert's rows in row order, as index_add_
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got.double().numpy(), want, rtol=EPS[dtype] * 4, atol=EPS[dtype] * 4 * scale)


def test_ends_out_of_order_or_range_are_safe():
    h = torch.randn(6, 4)
    bias = torch.randn(2, 4)
    for ends in ([3, 1, 9, 2], [-4, 2, 100, 100], [0, 0, 0, 0]):
        e = torch.tensor(ends, dtype=torch.int32)
        out = moecomm_ext.seg_bias_act(h.clone(), bias, e, relu=True)
        assert out.shape == h.shape and torch.isfinite(out).all()
        assert moecomm_ext.seg_colsum(h, e, 2).shape == (2, 4)
    # ends past the rows: clamped, every row in a segment counted once
    e = torch.tensor([2, 100], dtype=torch.int32)
    torch.testing.assert_close(moecomm_ext.seg_colsum(h, e, 2), torch.stack([h[:2].sum(0), h[2:].sum(0)]))


def test_bias_on_a_strided_view_is_in_place_with_the_same_bits():
    h = torch.randn(4, 5).t()  # [5, 4], not contiguous
    ends, bias = torch.tensor([2, 5], dtype=torch.int32), torch.randn(2, 4)
    want = reference.seg_bias_act(h.contiguous(), bias, ends, True)
    assert moecomm_ext.seg_bias_act(h, bias, ends, relu=True) is h and torch.equal(h, want)


def test_bad_arguments_are_named():
    h, ends = torch.randn(5, 4), torch.tensor([2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="argument 'h' must be a 2-D"):
        moecomm_ext.seg_bias_act(torch.randn(5), torch.randn(2, 4), ends)
    with pytest.raises(ValueError, match=r"argument 'bias' must be \[num_local, 4\]"):
        moecomm_ext.seg_bias_act(h, torch.randn(2, 3), ends)
    with pytest.raises(ValueError, match="argument 'bias'"):
        moecomm_ext.seg_bias_act(h, torch.randn(2, 4, dtype=torch.float64), ends)
    with pytest.raises(ValueError, match="argument 'ends'.*num_local = 3"):  # ends for 2 experts, bias for 3
        moecomm_ext.seg_bias_act(h, torch.randn(3, 4), ends)
    with pytest.raises(ValueError, match="argument 'ends' must be 1-D int32"):
        moecomm_ext.seg_colsum(h, ends.long(), 2)
    with pytest.raises(ValueError, match="argument 'ends'.*num_local = 3"):
        moecomm_ext.seg_colsum(h, ends, 3)
    with pytest.raises(ValueError, match="num_local must be an int >= 1"):
        moecomm_ext.seg_colsum(h, ends, 0)
    with pytest.raises(TypeError, match="argument 'g' must be float16"):
        moecomm_ext.seg_colsum(h.long(), ends, 2)


def _dropless_step(layer, x, gy):
    xx = x.clone().requires_grad_(True)
    y = layer(xx)
    torch.autograd.backward([y, layer.aux_loss], [gy, torch.ones_like(layer.aux_loss)])
    return [y.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_dropless_layer_with_the_kernels_equals_the_torch_ops(monkeypatch, activation):
    """The dropless step's biases by the kernels (the default) against the gather-and-add and
    grouped-GEMM sums they replace (the kernels switched off)."""
    layer = MoELayer(16, 24, 4, k=2, dropless=True, seed=3, activation=activation)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 16, generator=g)
    x[:8] = x[0]  # one expert with many rows, others with none
    gy = torch.randn(40, 16, generator=g)
    calls = []
    real = moecomm_ext.unchecked.seg_ops

    def counted(device, use_native):
        calls.append(device)
        return real(device, use_native)

    monkeypatch.setattr(seg_gemm.unchecked, "seg_ops", counted)
    got = _dropless_step(layer, x, gy)
    if moecomm_ext.native_available("cpu"):
        assert calls  # (the kernels ran)
    monkeypatch.setattr(seg_gemm.unchecked, "seg_ops", lambda device, use_native: None)
    layer.zero_grad()
    want = _dropless_step(layer, x, gy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("El,blocks,cols", [(16, 1, 2048), (4, 3, 2048), (3, 2, 7), (1, 1, 64), (8, 2, 12)])
def test_cuda_kernels_match_the_reference(dtype, El, blocks, cols):
    """The CUDA kernels themselves (the native module's, which the library does not use on CUDA
    tensors until this has passed on a device: moecomm_ext._seg.NATIVE_DEVICE_TYPES)."""
    native = _loader.module_for("cuda", True)
    if native is None or not hasattr(native, "seg_colsum"):
        pytest.skip("the CUDA row kernels are not built here")
    g = torch.Generator().manual_seed(El * 100 + cols)
    counts = torch.randint(0, 200, (blocks * El,), generator=g).tolist()
    counts[1 % len(counts)] = 0
    h, ends = _layout(counts, cols, dtype, 3, El + cols, "cuda")
    bias = torch.randn(El, cols, generator=g, dtype=torch.float64).to("cuda", dtype)
    for relu in (False, True):
        got = native.seg_bias_act(h.clone(), bias, ends, relu)
        assert torch.equal(got, reference.seg_bias_act(h, bias, ends, relu))
    s = native.seg_colsum(h, ends, El)
    assert torch.equal(s, native.seg_colsum(h, ends, El))  # deterministic
    want = torch.tensor(_sum_definition(h.cpu(), counts, El))
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(s.double().cpu(), want, rtol=EPS[dtype] * 4, atol=EPS[dtype] * 8 * scale)
    # an offset view (not 16-byte aligned) takes the narrower loads: the same bias bits, the same sums
    def offset_copy():
        return torch.cat([h.new_zeros(1), h.reshape(-1)])[1:].view_as(h)

    assert torch.equal(native.seg_colsum(offset_copy(), ends, El), s)
    assert torch.equal(native.seg_bias_act(offset_copy(), bias, ends, True), reference.seg_bias_act(h, bias, ends, True))
    # rows in no segment and empty segments: untouched, and no sum from them
    assert torch.equal(native.seg_bias_act(h.clone(), bias, ends, True)[-3:], h[-3:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_cuda_dropless_layer_with_the_kernels_equals_the_torch_ops(monkeypatch, activation):
    """On a GPU (bf16, grouped GEMMs): the dropless step with the CUDA segment kernels switched on
    against the torch ops the library runs there until this passes (the forward and the input
    gradient the same bits, the bias gradients to bfloat16 rounding: summed in another order)."""
    import moecomm
    from moecomm_ext import _seg

    layer = MoELayer(256, 512, 8, k=2, dropless=True, seed=5, activation=activation, dtype=torch.bfloat16,
                     device="cuda", comm=moecomm.init())
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1000, 256, generator=g).to("cuda", torch.bfloat16)
    x[:100] = x[0]
    gy = torch.randn(1000, 256, generator=g).to("cuda", torch.bfloat16)
    want = _dropless_step(layer, x, gy)
    layer.zero_grad()
    monkeypatch.setattr(_seg, "NATIVE_DEVICE_TYPES", ("cpu", "cuda"))
    got = _dropless_step(layer, x, gy)
    names = ["y", "x.grad"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, got, want):
        if name.endswith("bias"):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        else:
            assert torch.equal(a, b), name
