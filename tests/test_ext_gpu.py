"""moecomm_ext CUDA kernels against the reference (needs a CUDA GPU)."""

from __future__ import annotations

import pytest
import torch

import moecomm_ext as me
from moecomm_ext import reference as ref
from moecomm_ext.testing import random_routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-6, torch.float64: 1e-12}


@pytest.fixture(scope="module", autouse=True)
def native_cuda():
    mod = me.load_native("cuda", strict=True)  # a GPU machine must build it
    assert me.implementation("cuda") == "native"
    return mod


def _rows(shape, dtype, gen, device="cuda"):
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _index(n, shape, gen, p_missing=0.1):
    idx = torch.randint(0, max(n, 1), shape, generator=gen)
    idx = torch.where(torch.rand(shape, generator=gen) < p_missing, -1, idx)
    if n == 0:
        idx.fill_(-1)
    return idx.cuda()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8192, 2048, 16384), (1000, 1000, 3001), (64, 7, 100), (300, 4096, 10)])
def test_gather_rows_large(dtype, shape):
    n, d, m = shape
    gen = torch.Generator().manual_seed(n + d + m)
    x = _rows((n, d), dtype, gen)
    index = _index(n, (m,), gen)
    scale = torch.rand(m, generator=gen).cuda()
    assert torch.equal(me.gather_rows(x, index), ref.gather_rows(x, index))
    out = me.gather_rows(x, index, scale)
    torch.testing.assert_close(out, ref.gather_rows(x, index, scale), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16384, 2048, 8192, 2), (3001, 1000, 1000, 3), (100, 7, 64, 8), (50, 2048, 9, 1)])
def test_gather_reduce_rows_large(dtype, shape):
    m, d, t, k = shape
    gen = torch.Generator().manual_seed(m + d + t + k)
    y = _rows((m, d), dtype, gen)
    index = _index(m, (t, k), gen)
    w = torch.rand(t, k, generator=gen).cuda()
    for weight in (w, None):
        out = me.gather_reduce_rows(y, index, weight)
        torch.testing.assert_close(out, ref.gather_reduce_rows(y, index, weight), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8192, 2048, 16384, 2), (1000, 1000, 3001, 3), (64, 7, 100, 8), (5, 40000, 9, 2)])
def test_gather_rowdot_large(dtype, shape):
    t, d, m, k = shape
    gen = torch.Generator().manual_seed(t + d + m + k)
    a = _rows((t, d), dtype, gen)
    b = _rows((m, d), dtype, gen)
    index = _index(m, (t, k), gen)
    out = me.gather_rowdot(a, b, index)
    assert out.dtype == torch.float32
    expected = ref.gather_rowdot(a, b, index)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * d**0.5)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8, torch.int64, torch.float64])
@pytest.mark.parametrize("d", [1, 3, 8, 33, 2048])
def test_gather_rows_any_dtype_and_width(dtype, d):
    gen = torch.Generator().manual_seed(d)
    x = torch.randint(0, 100, (257, d), generator=gen).to(dtype).cuda()
    index = _index(257, (1000,), gen)
    assert torch.equal(me.gather_rows(x, index), ref.gather_rows(x, index))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_misaligned_views_use_scalar_path(dtype):
    gen = torch.Generator().manual_seed(5)
    base = _rows((513 * 64 + 1,), dtype, gen)
    x = base[1:].view(513, 64)  # storage offset of one element: not 16-byte aligned
    index = _index(513, (700,), gen)
    scale = torch.rand(700, generator=gen).cuda()
    assert torch.equal(me.gather_rows(x, index), ref.gather_rows(x, index))
    torch.testing.assert_close(me.gather_rows(x, index, scale), ref.gather_rows(x, index, scale), rtol=TOL[dtype], atol=TOL[dtype])
    idx2 = _index(513, (300, 2), gen)
    torch.testing.assert_close(me.gather_reduce_rows(x, idx2), ref.gather_reduce_rows(x, idx2), rtol=TOL[dtype], atol=TOL[dtype])
    a = base[1 : 1 + 300 * 64].view(300, 64)
    torch.testing.assert_close(me.gather_rowdot(a, x, idx2), ref.gather_rowdot(a, x, idx2), rtol=1e-4, atol=1e-3)


def test_matches_cpu_native():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(500, 96, generator=gen).to(torch.bfloat16)
    idx = _index(500, (800,), gen).cpu()
    w = torch.rand(400, 2, generator=gen)
    assert torch.equal(me.gather_rows(x.cuda(), idx.cuda()).cpu(), me.gather_rows(x, idx))
    red_gpu = me.gather_reduce_rows(x.cuda(), idx.view(400, 2).cuda(), w.cuda()).cpu()
    torch.testing.assert_close(red_gpu, me.gather_reduce_rows(x, idx.view(400, 2), w), rtol=1.6e-2, atol=1.6e-2)


def test_zero_sizes_cuda():
    for n, d, m in [(0, 4, 3), (5, 0, 3), (5, 4, 0)]:
        x = torch.randn(n, d, device="cuda")
        idx = torch.full((m,), -1, dtype=torch.int64, device="cuda")
        assert me.gather_rows(x, idx, torch.ones(m, device="cuda")).shape == (m, d)
        assert not me.gather_reduce_rows(x, idx.view(m, 1)).any()
        assert not me.gather_rowdot(torch.randn(m, d, device="cuda"), x, idx.view(m, 1)).any()


def test_dispatch_combine_cuda_gradcheck_and_vs_reference():
    gen = torch.Generator().manual_seed(11)
    token_slots, slot_token = random_routing(12, 2, 4, 5, drop_prob=0.2, generator=gen, device="cuda")
    x = torch.randn(12, 6, dtype=torch.float64, device="cuda", requires_grad=True)
    s = torch.rand(20, dtype=torch.float64, device="cuda", requires_grad=True)
    y = torch.randn(20, 6, dtype=torch.float64, device="cuda", requires_grad=True)
    w = torch.rand(12, 2, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, s: me.dispatch(x, slot_token, token_slots, s), (x, s))
    assert torch.autograd.gradcheck(lambda y, w: me.combine(y, token_slots, w, slot_token), (y, w))

    # bf16 at MoE size: native autograd vs torch autograd through the reference
    token_slots, slot_token = random_routing(8192, 2, 16, 1024, generator=gen, device="cuda")
    xb = torch.randn(8192, 2048, generator=gen).to("cuda", torch.bfloat16)
    wb = torch.rand(8192, 2, generator=gen).cuda()
    g = torch.randn(8192, 2048, generator=gen).to("cuda", torch.bfloat16)
    grads = []
    for disp, comb in ((me.dispatch, me.combine), (ref.dispatch, ref.combine)):
        xr, wr = xb.clone().requires_grad_(), wb.clone().requires_grad_()
        out = comb(disp(xr, slot_token, token_slots), token_slots, wr, slot_token)
        out.backward(g)
        grads.append((out.detach(), xr.grad, wr.grad))
    for got, expected in zip(*grads):
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2 * 45)


def test_out_of_range_raises_on_host():
    x = torch.randn(5, 3, device="cuda")
    with pytest.raises(ValueError, match="'index'"):
        me.gather_rows(x, torch.tensor([0, 5], device="cuda"))


@pytest.mark.parametrize("A,B", [(2, 2), (3, 5), (8, 4), (9, 8)])  # 72 blocks: the gather_rows path
def test_hierarchical_block_moves_on_gpu_match_cpu(A, B):
    from moecomm.collectives import blocks as _blocks

    g = torch.Generator().manual_seed(A * 10 + B)
    counts = torch.randint(0, 5, (A, B), generator=g).tolist()
    rows = sum(map(sum, counts))
    x = torch.randn(rows, 7, generator=g).to(torch.bfloat16)
    for inverse in (False, True):
        got = _blocks.permute_blocks(x.cuda(), counts, inverse=inverse).cpu()
        assert torch.equal(got.view(torch.int16), _blocks.permute_blocks(x, counts, inverse=inverse).view(torch.int16))
    order = torch.randperm(A * B, generator=g).tolist()
    flat = [c for r in counts for c in r]
    got = _blocks.reorder_blocks(x.cuda(), flat, order).cpu()
    assert torch.equal(got.view(torch.int16), _blocks.reorder_blocks(x, flat, order).view(torch.int16))
