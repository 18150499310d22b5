"""moecomm_ext.route_capacity / route_backward (the MoE router's kernels): native CPU and
CUDA against the torch reference, the reference against an independent python-loop queue
and torch autograd of the router's op chain, and argument validation; the fused capacity
step's coverage rule (moecomm.moe._step.fused_step.applies)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moecomm_ext as me
from moecomm_ext import reference as ref

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


def _router(seed: int, T: int, E: int, k: int, dtype=torch.float32, ties: bool = False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=dtype)
    if ties and T:
        logits[: T // 2] = 0  # all scores equal: topk's tie order decides
        logits[T // 2:, : E // 2] = 1.0
    logits = logits.to(device).requires_grad_(True)
    scores = torch.softmax(logits, 1)
    topv, topi = torch.topk(scores, k, dim=1)
    return logits, scores, topv, topi


def _loop_queue(topi: torch.Tensor, E: int, C: int):
    """Queue positions, counts and slots by plain python loops (every first choice in token
    order, then every second choice, ...)."""
    T, k = topi.shape
    idx = topi.tolist()
    cnt = [0] * E
    loc = [[0] * k for _ in range(T)]
    slots = [[-1] * k for _ in range(T)]
    slot_token = [-1] * (E * C)
    for j in range(k):
        for t in range(T):
            e = idx[t][j]
            loc[t][j] = cnt[e]
            if cnt[e] < C:
                slots[t][j] = e * C + cnt[e]
                slot_token[e * C + cnt[e]] = t
            cnt[e] += 1
    return loc, cnt, slots, slot_token


shapes = st.tuples(st.integers(0, 70), st.integers(1, 19), st.integers(1, 6), st.integers(0, 12),
                   st.booleans(), st.booleans(), st.sampled_from([torch.float32, torch.float64]))


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(0, 2 ** 16))
def test_route_capacity_native_equals_reference_and_loops(shape, seed):
    T, E, k, C, normalize, ties, dtype = shape
    k = min(k, E)
    _, _, topv, topi = _router(seed, T, E, k, dtype, ties)
    topv = topv.detach()
    nat = me.route_capacity(topv, topi, E, C, normalize=normalize)
    refr = me.route_capacity(topv, topi, E, C, normalize=normalize, use_native=False)
    for name, a, b in zip(nat._fields, nat, refr):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    loc, cnt, slots, slot_token = _loop_queue(topi, E, C)
    assert nat.locations.tolist() == loc and nat.counts.tolist() == cnt
    assert nat.token_slots.tolist() == slots and nat.slot_token.tolist() == slot_token
    assert nat.first_counts.tolist() == torch.bincount(topi[:, 0], minlength=E).tolist() if T else True
    kept = nat.token_slots.reshape(-1) >= 0
    assert nat.slot_route[nat.token_slots.reshape(-1)[kept]].tolist() == torch.arange(T * k)[kept].tolist()
    assert torch.equal(nat.slot_gate[nat.token_slots.reshape(-1)[kept]], nat.gates.reshape(-1)[kept])
    assert not nat.slot_gate[nat.slot_token < 0].any()
    if normalize and k > 1 and T:
        torch.testing.assert_close(nat.gates.sum(1), torch.ones(T, dtype=dtype))
    else:
        assert torch.equal(nat.gates, topv)


@settings(max_examples=40, deadline=None)
@given(shapes, st.integers(0, 2 ** 16), st.booleans())
def test_route_backward_matches_autograd(shape, seed, with_aux):
    """The reference and the native kernel against torch autograd of the op chain they
    replace: topk values, renormalisation, GShard loss, softmax."""
    T, E, k, C, normalize, ties, dtype = shape
    k, T = min(k, E), max(T, 1)
    logits, scores, topv, topi = _router(seed, T, E, k, dtype, ties)
    gates = topv
    if normalize and k > 1:
        gates = topv / topv.sum(1, keepdim=True).clamp(min=torch.finfo(dtype).eps)
    first = torch.bincount(topi[:, 0], minlength=E).to(dtype)
    aux = (scores.sum(0) * first).sum() * (E / (T * T))
    g = torch.Generator().manual_seed(seed + 1)
    gg = torch.randn(T, k, generator=g, dtype=dtype)
    ga = torch.randn((), generator=g, dtype=dtype)
    outs, grads = ([gates, aux], [gg, ga]) if with_aux else ([gates], [gg])
    (want,) = torch.autograd.grad(outs, [logits], grads)
    kw = dict(normalize=normalize, aux_grad=ga if with_aux else None, aux_counts=first if with_aux else None,
              aux_scale=E / (T * T))
    tol = dict(rtol=0, atol=2e-6 * float(want.abs().max()) + 1e-30) if dtype == torch.float32 else \
        dict(rtol=0, atol=1e-14 * float(want.abs().max()) + 1e-300)
    for native in (True, False):
        got = me.route_backward(gg, topv.detach(), topi, scores.detach(), use_native=native, **kw)
        torch.testing.assert_close(got, want, **tol)
    if dtype == torch.float32:
        split = me.route_backward(gg, topv.detach(), topi, scores.detach(), split_bf16=True, **kw)
        assert split.dtype == torch.bfloat16 and split.shape == (T, 2 * E)
        gl = me.route_backward(gg, topv.detach(), topi, scores.detach(), **kw)  # the same kernel, unsplit
        hi = gl.to(torch.bfloat16)
        assert torch.equal(split[:, :E], hi) and torch.equal(split[:, E:], (gl - hi.float()).to(torch.bfloat16))


def test_route_argument_errors():
    topv = torch.rand(5, 2)
    topi = torch.randint(0, 4, (5, 2))
    cases = [
        (TypeError, "topk_scores", lambda: me.route_capacity(topv.half(), topi, 4, 3)),
        (TypeError, "topk_idx", lambda: me.route_capacity(topv, topi.int(), 4, 3)),
        (ValueError, "topk_idx", lambda: me.route_capacity(topv, topi[:4], 4, 3)),
        (ValueError, "num_experts", lambda: me.route_capacity(topv, topi, 0, 3)),
        (ValueError, "capacity", lambda: me.route_capacity(topv, topi, 4, -1)),
        (ValueError, "out of range", lambda: me.route_capacity(topv, topi, 3, 3) if int(topi.max()) == 3 else
         me.route_capacity(topv, topi + 4, 4, 3)),
        (ValueError, "scores", lambda: me.route_backward(topv, topv, topi, torch.rand(4, 4))),
        (TypeError, "scores", lambda: me.route_backward(topv, topv, topi, torch.rand(5, 4).double())),
        (ValueError, "aux_counts", lambda: me.route_backward(topv, topv, topi, torch.rand(5, 4),
                                                             aux_grad=torch.tensor(1.0))),
        (ValueError, "aux_counts", lambda: me.route_backward(topv, topv, topi, torch.rand(5, 4),
                                                             aux_grad=torch.tensor(1.0), aux_counts=torch.ones(3))),
        (TypeError, "split_bf16", lambda: me.route_backward(topv.double(), topv.double(), topi,
                                                            torch.rand(5, 4).double(), split_bf16=True)),
    ]
    for exc, word, fn in cases:
        with pytest.raises(exc, match=word):
            fn()


@pytest.mark.parametrize("T,E,k,C", [(0, 4, 2, 3), (1, 1, 1, 0), (5000, 7, 3, 900), (40000, 64, 8, 5000)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_route_sizes_native_vs_reference(T, E, k, C, device):
    """Empty inputs, one expert, zero capacity, and sizes that give the CUDA kernels many chunks."""
    _, scores, topv, topi = _router(T + E, T, E, k, device=device)
    topv, scores = topv.detach(), scores.detach()
    nat = me.route_capacity(topv, topi, E, C)
    cpu = me.route_capacity(topv.cpu(), topi.cpu(), E, C, use_native=False)
    for name, a, b in zip(nat._fields, nat, cpu):
        assert torch.equal(a.cpu(), b), name
    gg = torch.randn(T, k, device=device)
    args = (gg, topv, topi, scores)
    scale = E / (T * T) if T else 1.0  # GShard's
    kw = dict(aux_grad=torch.tensor(0.5, device=device), aux_counts=nat.first_counts, aux_scale=scale)
    got = me.route_backward(*args, **kw)
    want = me.route_backward(*(a.cpu() for a in args), use_native=False, aux_grad=kw["aux_grad"].cpu(),
                             aux_counts=cpu.first_counts, aux_scale=scale)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=2e-6 * max(1.0, float(want.abs().max())) if want.numel() else 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@settings(max_examples=30, deadline=None)
@given(shapes, st.integers(0, 2 ** 16))
def test_route_cuda_equals_cpu(shape, seed):
    T, E, k, C, normalize, ties, dtype = shape
    k = min(k, E)
    _, scores, topv, topi = _router(seed, T, E, k, dtype, ties, device="cuda")
    topv, scores = topv.detach(), scores.detach()
    gpu_r = me.route_capacity(topv, topi, E, C, normalize=normalize)
    cpu_r = me.route_capacity(topv.cpu(), topi.cpu(), E, C, normalize=normalize)
    for name, a, b in zip(gpu_r._fields, gpu_r, cpu_r):
        assert torch.equal(a.cpu(), b), name
    if T:
        gg = torch.randn(T, k, dtype=dtype, device="cuda")
        got = me.route_backward(gg, topv, topi, scores, normalize=normalize)
        want = me.route_backward(gg.cpu(), topv.cpu(), topi.cpu(), scores.cpu(), normalize=normalize)
        atol = (2e-6 if dtype == torch.float32 else 1e-14) * float(want.abs().max())
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=atol + 1e-30)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1.6e-2 if a.dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    return True


def _step_case(seed, W, El, C, D, H, k, dtype, bias, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    E, T = W * El, 3 * C + 1

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    x, wg = rnd(T, D), rnd(E, D) * 0.3
    w1, w2 = rnd(El, D, H) * 0.3, rnd(El, H, D) * 0.3
    b1, b2 = (rnd(El, H), rnd(El, D)) if bias else (None, None)
    return x, wg, w1, b1, w2, b2, k, E, T


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("W,El,C,k,bias", [(1, 4, 5, 2, True), (3, 2, 4, 3, False), (2, 3, 0, 1, True),
                                           (1, 1, 7, 1, False)])
def test_step_ops_native_equal_reference(device, dtype, W, El, C, k, bias):
    """The fused step's five native calls (C++ glue) against the reference's (torch): the same
    bits except the router's backward, whose sum over experts runs in another order."""
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 experts run the same glue as float32 on CUDA")
    x, wg, w1, b1, w2, b2, k, E, T = _step_case(W * 100 + El * 10 + C, W, El, C, 8, 16, k, dtype, bias, device)
    wide = device == "cuda" and dtype == torch.bfloat16
    nat = me.unchecked.step_ops(x.device, E, None)
    assert nat is not ref
    fwd = [ops.step_route(x, wg, k, C, True, True, wide, True) for ops in (nat, ref)]
    for name, a, b in zip(("send", "logits", "scores", "topv", "topi", "gates", "locations", "counts", "first",
                           "token_slots", "slot_token", "slot_gate", "aux"), *fwd):
        assert torch.equal(a, b), name
    for ops in (nat, ref):  # without the gather (the FP8 dispatch packs the rows itself)
        assert ops.step_route(x, wg, k, C, True, True, wide, False)[0] is None
    send = fwd[0][0]
    row_expert = torch.arange(El, device=device).view(1, El, 1).expand(W, El, C).reshape(-1)
    ffn = [ops.step_ffn(send, w1, b1, w2, b2, row_expert, El, C) for ops in (nat, ref)]
    assert all(torch.equal(a, b) for a, b in zip(*ffn))
    h, back = ffn[0]
    token_slots, slot_token, slot_gate = fwd[0][9], fwd[0][10], fwd[0][11].to(me.reference.opmath_dtype(dtype))
    gy = torch.randn(T, back.shape[1], dtype=dtype, device=device)
    cb = [ops.step_combine_backward(gy, slot_token, slot_gate, back, token_slots, torch.float32) for ops in (nat, ref)]
    same = torch.equal if device == "cpu" else close  # the CUDA row kernels sum in another order than torch
    assert all(same(a, b) for a, b in zip(*cb))
    ones = torch.ones(send.shape[0], dtype=dtype, device=device) if wide else None
    fb = [ops.step_ffn_backward(cb[0][0], h, send, w1, w2, bias, bias, [True] * 5, El, C, ones) for ops in (nat, ref)]
    for a, b in zip(*fb):
        assert (a is None and b is None) or same(a, b)
    scores, topv, topi, first = fwd[0][2], fwd[0][3], fwd[0][4], fwd[0][8]
    rb = [ops.step_route_backward(fb[0][0], token_slots, cb[0][1], topv, topi, scores, True,
                                  torch.tensor(0.7, device=device), first, E / (T * T), x, wg, wide, True, True)
          for ops in (nat, ref)]
    for a, b in zip(*rb):
        torch.testing.assert_close(a, b, rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_fused_step_covers_the_defaults_only():
    """Which layer calls take the fused step: the defaults and the options it implements
    (capacity mode and dropless, with any activation: named, gated, a lambda); every other
    configuration the op-by-op path, with the option that sends it there named."""
    import moecomm
    from moecomm.moe import MoELayer
    from moecomm.moe._step.fused_step import applies, uncovered

    comm = moecomm.init()
    x = torch.randn(6, 8)

    def covered(layer_kw=None, cf=1.0, dropless=False, degree=1, own=False, wire=None, training=True, xx=x):
        layer = MoELayer(8, 8, 4, comm=comm, seed=0, **(layer_kw or {}))
        layer.train(training)
        return applies(layer, layer.gates[0], xx, cf, dropless, degree, own, wire, 1)

    assert covered() and covered({"k": 3, "fc1_bias": False, "fc2_bias": False, "balance_loss": None})
    assert covered({"normalize_gate": False}) and covered({"gate_noise": 1.0}, training=False)
    assert covered(xx=x.double(), layer_kw={"dtype": torch.float64})
    assert covered(dropless=True) and covered({"activation": "gelu"}, dropless=True, cf=0.0)
    assert not covered(cf=0.0) and not covered(cf=-1.0) and not covered(degree=2)
    assert not covered(dropless=True, degree=2) and not covered({"gate": "cosine"}, dropless=True)
    for kw in ({"gate": "cosine"}, {"gate_noise": 1.0}, {"fp32_gate": False}, {"z_loss_weight": 0.1},
               {"balance_loss": "load_importance", "gate_noise": 1.0}, {"batch_prioritized_routing": True},
               {"is_postscore": False}, {"dtype": torch.float64}):
        assert not covered(kw), kw
    for act in ("gelu", "silu", "swiglu", "geglu", lambda h: torch.relu(h)):
        assert covered({"activation": act}) and covered({"activation": act}, dropless=True), act
    layer = MoELayer(8, 8, 4, comm=comm, seed=0, z_loss_weight=0.1)
    assert "z_loss_weight=0.1" in uncovered(layer, layer.gates[0], x, 1.0, False, 1, False, None, 1)
    assert "overlap_degree=2" in uncovered(layer, layer.gates[0], x, 1.0, False, 2, False, None, 1)
    layer = MoELayer(8, 8, 4, comm=comm, seed=0)
    layer._run_experts = lambda rows, seg: rows  # noqa: SLF001 - a wrapped expert call is honoured
    assert not applies(layer, layer.gates[0], x, 1.0, False, 1, False, None, 1)


def test_step_ops_take_strided_inputs():
    """Issue 34 item 1: the fused step's native glue copies strided inputs instead of refusing
    them (a zero-stride row map of one local expert, a transposed input, a strided bias), and
    the uniform row map is contiguous at its source."""
    from moecomm.moe._ops.segments import uniform_row_expert
    from moecomm_ext import unchecked

    assert uniform_row_expert(3, 1, 4, torch.device("cpu")).is_contiguous()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=g)
    wg = torch.randn(4, 8, generator=g)
    w1, w2 = torch.randn(1, 8, 5, generator=g), torch.randn(1, 5, 8, generator=g)
    b1 = torch.randn(5, 1, generator=g).t()  # [1, 5], not contiguous
    b2 = torch.randn(1, 8, generator=g)
    row_expert = torch.zeros(1, dtype=torch.int64).expand(2 * 3)  # zero stride
    reference = unchecked.step_ops(x.device, 4, False).step_route(x.t(), wg, 2, 3, True, True, False, True)
    for native in (True, False):
        ops = unchecked.step_ops(x.device, 4, native)
        got = ops.step_route(x.t(), wg, 2, 3, True, True, False, True)
        # the same bits as the reference on the same strided input (a GEMM's bits may depend on
        # its operands' layout, so against a contiguous copy only to rounding)
        for a, b in zip(got, reference):
            assert torch.equal(a, b)
        for a, b in zip(got, ops.step_route(x.t().contiguous(), wg, 2, 3, True, True, False, True)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) if a.is_floating_point() else torch.equal(a, b)
        rows = torch.randn(6, 8, generator=g)
        for a, b in zip(ops.step_ffn(rows, w1, b1, w2, b2, row_expert, 1, 3),
                        ops.step_ffn(rows, w1, b1.contiguous(), w2, b2, row_expert.contiguous(), 1, 3)):
            assert torch.equal(a, b)
