"""moecomm.moe.tutel_functional against a plain-torch reference of Tutel's fast_dispatcher."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moecomm.moe import tutel_functional as tf

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=20,
                    suppress_health_check=list(HealthCheck))


def reference_encode(x, idx, loc, gates, E, C, postscore):
    """Tutel's encode, route by route in (k, t) order (later routes overwrite)."""
    work = torch.float16 if x.dtype == torch.float16 else torch.float32
    xw = x.to(work)
    out = torch.zeros(E * C, x.shape[1], dtype=work)
    for k in range(len(idx)):
        for t in range(x.shape[0]):
            e, l = int(idx[k][t]), int(loc[k][t])
            if e >= 0 and l < C:
                row = xw[t] if postscore else gates[k][t].to(work) * xw[t]
                out = out.index_put((torch.tensor([e * C + l]),), row.unsqueeze(0))
    return out


def reference_decode(y, idx, loc, gates, C, postscore, S):
    work = torch.float16 if y.dtype == torch.float16 else torch.float32
    yw = y.to(work)
    rows = []
    for t in range(S):
        acc = torch.zeros(y.shape[1], dtype=work)
        for k in range(len(idx)):
            e, l = int(idx[k][t]), int(loc[k][t])
            if e >= 0 and l < C:
                acc = acc + (gates[k][t].to(work) * yw[e * C + l] if postscore else yw[e * C + l])
        rows.append(acc)
    return torch.stack(rows) if rows else torch.zeros(0, y.shape[1], dtype=work)


def routes(seed, S, E, C, K, drop):
    """Top-K routing with locations as DeepSpeed/Tutel make them (distinct rows), some dropped."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(S, E, generator=g)
    top = scores.topk(min(K, E), dim=1).indices.t()  # [K, S]
    idx, loc, base = [], [], torch.zeros(E, dtype=torch.long)
    for k in range(top.shape[0]):
        mask = torch.nn.functional.one_hot(top[k], E)
        where = tf.fast_cumsum_sub_one(mask) + base
        base = base + mask.sum(0)
        l = (where * mask).sum(1)
        e = top[k].clone()
        gone = torch.rand(S, generator=g) < drop
        e[gone] = -1
        l[gone & (torch.rand(S, generator=g) < 0.5)] = 0
        idx.append(e.to(torch.int32))
        loc.append(l.to(torch.int32))
    gates = [torch.rand(S, generator=g, requires_grad=True) for _ in idx]
    return idx, loc, gates


@SETTINGS
@given(seed=st.integers(0, 2**31), S=st.integers(0, 9), E=st.integers(1, 5), C=st.integers(1, 6),
       K=st.integers(1, 3), M=st.integers(1, 5), drop=st.sampled_from([0.0, 0.3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), postscore=st.booleans())
def test_encode_decode_match_reference(seed, S, E, C, K, M, drop, dtype, postscore):
    idx, loc, gates = routes(seed, S, E, C, K, drop)  # locations may reach >= C: dropped by capacity
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(S, M, generator=g).to(dtype).requires_grad_(True)
    y = torch.randn(E * C, M, generator=g).to(dtype).requires_grad_(True)
    d = tf.fast_dispatcher(E, C, M, dispatch_dtype=dtype)
    d.update(idx, loc, gates, capacity=C, is_postscore=postscore)
    enc, dec = d.encode(x), d.decode(y)
    assert enc.shape == (E * C, M) and enc.dtype == dtype and dec.shape == (S, M) and dec.dtype == dtype
    rgates = [t.detach().clone().requires_grad_(True) for t in gates]
    rx, ry = x.detach().clone().requires_grad_(True), y.detach().clone().requires_grad_(True)
    renc = reference_encode(rx, idx, loc, rgates, E, C, postscore).to(dtype)
    rdec = reference_decode(ry, idx, loc, rgates, C, postscore, S).to(dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(enc, renc, **tol)
    torch.testing.assert_close(dec, rdec, **tol)
    w1 = torch.randn(enc.shape, generator=g).to(dtype)
    w2 = torch.randn(dec.shape, generator=g).to(dtype)
    ((enc.float() * w1.float()).sum() + (dec.float() * w2.float()).sum()).backward()
    linked = sum(t.sum() for t in (rx, ry, *rgates)) * 0  # a graph even where nothing is routed
    ((renc.float() * w1.float()).sum() + (rdec.float() * w2.float()).sum() + linked).backward()
    torch.testing.assert_close(x.grad if x.grad is not None else torch.zeros_like(x), rx.grad, **tol)
    torch.testing.assert_close(y.grad if y.grad is not None else torch.zeros_like(y), ry.grad, **tol)
    for a, b in zip(gates, rgates):
        ga = a.grad if a.grad is not None else torch.zeros_like(a)
        gb = b.grad if b.grad is not None else torch.zeros_like(b)
        torch.testing.assert_close(ga, gb, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=2e-2 if
                                   dtype == torch.bfloat16 else 1e-6)


def test_later_route_wins_a_shared_row():
    x = torch.tensor([[1.0], [2.0], [3.0]])
    idx = [torch.tensor([0, 0, -1]), torch.tensor([1, 0, 0])]
    loc = [torch.tensor([0, 0, 5]), torch.tensor([0, 1, 0])]  # rows 0 and 0 (k=0), then 2, 1, 0 (k=1)
    d = tf.fast_dispatcher(2, 2, 1, torch.float32)
    d.update(idx, loc, [torch.ones(3), torch.ones(3)], capacity=2)
    # row 0 is named by (0, 0), (0, 1) and (1, 2): the last, token 2, is kept
    assert d.encode(x).reshape(-1).tolist() == [3.0, 2.0, 1.0, 0.0]


def test_cumsum_and_errors():
    mask = torch.tensor([[1, 0], [1, 0], [0, 1], [1, 0]])
    assert tf.fast_cumsum_sub_one(mask).tolist() == (torch.cumsum(mask, 0) - 1).tolist()
    with pytest.raises(ValueError, match="2-D"):
        tf.fast_cumsum_sub_one(mask.reshape(-1))
    with pytest.raises(ValueError, match="dim"):
        tf.fast_cumsum_sub_one(mask, dim=1)
    d = tf.fast_dispatcher(2, 2, 3, torch.float32)
    with pytest.raises(RuntimeError, match="update"):
        d.encode(torch.zeros(4, 3))
    one = [torch.zeros(4, dtype=torch.int32)]
    with pytest.raises(ValueError, match="one tensor per k"):
        d.update(one, one * 2, [torch.ones(4)])
    with pytest.raises(ValueError, match="outside"):
        d.update([torch.tensor([0, 2, 0, 0])], one, [torch.ones(4)])
    with pytest.raises(ValueError, match="outside"):
        d.update([torch.tensor([0, 1, 0, 0])], [torch.tensor([0, -1, 0, 0])], [torch.ones(4)])
    d.update(one, one, [torch.ones(4)])
    with pytest.raises(ValueError, match=r"\[4, 3\]"):
        d.encode(torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"E \* C"):
        d.decode(torch.zeros(5, 3))
    with pytest.raises(ValueError, match="dispatch_dtype"):
        tf.fast_dispatcher(2, 2, 3, torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("postscore", [True, False])
def test_cuda_matches_reference(dtype, postscore):
    """The CUDA kernels behind encode/decode against the plain-torch reference (on the CPU)."""
    S, E, C, K, M = 300, 8, 48, 3, 64
    idx, loc, gates = routes(11, S, E, C, K, 0.2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(S, M, generator=g).to(dtype)
    y = torch.randn(E * C, M, generator=g).to(dtype)
    d = tf.fast_dispatcher(E, C, M, dispatch_dtype=dtype)
    cg = [t.detach().cuda().requires_grad_(True) for t in gates]
    cx, cy = x.cuda().requires_grad_(True), y.cuda().requires_grad_(True)
    d.update([t.cuda() for t in idx], [t.cuda() for t in loc], cg, capacity=C, is_postscore=postscore)
    enc, dec = d.encode(cx), d.decode(cy)
    (enc.float().sum() + dec.float().pow(2).sum()).backward()
    rg = [t.detach().clone().requires_grad_(True) for t in gates]
    rx, ry = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    renc = reference_encode(rx, idx, loc, rg, E, C, postscore).to(dtype)
    rdec = reference_decode(ry, idx, loc, rg, C, postscore, S).to(dtype)
    (renc.float().sum() + rdec.float().pow(2).sum()).backward()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(enc.cpu(), renc, **tol)
    torch.testing.assert_close(dec.cpu(), rdec, **tol)
    torch.testing.assert_close(cx.grad.cpu(), rx.grad, **tol)
    torch.testing.assert_close(cy.grad.cpu(), ry.grad, **tol)
    for a, b in zip(cg, rg):  # a gate none of whose routes fit has no gradient in the reference: zero
        want = b.grad if b.grad is not None else torch.zeros_like(b)
        torch.testing.assert_close(a.grad.cpu(), want, rtol=5e-2, atol=5e-2)
