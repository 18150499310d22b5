"""The built-in experts' weight-gradient sum over pipelined stages (moecomm.moe.experts.WeightGradSum)."""

import pytest
import torch

from moecomm.moe.experts import FFNExperts, Segments, WeightGradSum


def _stages(layout: str):
    """Two stages' row layouts (and the whole) for the uniform and the variable path."""
    if layout == "uniform":
        return [lambda s: Segments.uniform_blocks(1, 3, 4, s), lambda s: Segments.uniform_blocks(2, 3, 4, s)]
    return [lambda s: Segments([[2, 0, 3]], 3, wgrad_sum=s), lambda s: Segments([[1, 4, 0], [0, 2, 5]], 3, wgrad_sum=s)]


@pytest.mark.parametrize("layout", ["uniform", "variable"])
@pytest.mark.parametrize("retain", [False, True])
def test_stages_sum_weight_gradients_once(layout, retain):
    torch.manual_seed(0)
    ex = FFNExperts(5, 6, 3, dtype=torch.float64)
    makers = _stages(layout)
    rows = [m(None).rows for m in makers]
    xs = [torch.randn(n, 5, dtype=torch.float64, requires_grad=True) for n in rows]
    gys = [torch.randn(n, 5, dtype=torch.float64) for n in rows]

    def run(share):
        for p in ex.parameters():
            p.grad = None
        for x in xs:
            x.grad = None
        outs = [ex(x, m(share)) for x, m in zip(xs, makers)]
        torch.autograd.backward(outs, gys, retain_graph=retain)
        if retain:  # a second backward through the same graph starts the sums afresh
            for p in ex.parameters():
                p.grad = None
            torch.autograd.backward(outs, gys)
        return [p.grad.clone() for p in ex.parameters()] + [x.grad.clone() for x in xs]

    ref = run(None)  # autograd adds the stages' gradients
    got = run(WeightGradSum())
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_one_stage_without_rows_still_returns_the_sum():
    torch.manual_seed(1)
    ex = FFNExperts(4, 4, 2, dtype=torch.float64)
    share = WeightGradSum()
    x0 = torch.randn(0, 4, dtype=torch.float64, requires_grad=True)
    x1 = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = [ex(x0, Segments.uniform_blocks(0, 2, 3, share)), ex(x1, Segments.uniform_blocks(1, 2, 3, share))]
    torch.autograd.backward(y, [torch.ones_like(t) for t in y])
    got = ex.fc1_weight.grad.clone()
    ex.fc1_weight.grad = None
    ex(x1, Segments.uniform_blocks(1, 2, 3)).sum().backward()
    torch.testing.assert_close(got, ex.fc1_weight.grad)


# -- gated experts (SwiGLU, GeGLU) against a per-row dense reference --------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# the reference's own gate functions (not moecomm's): SiLU and the exact GELU
_REF_GATE = {"swiglu": lambda h: h * torch.sigmoid(h), "geglu": lambda h: 0.5 * h * (1 + torch.erf(h / 2 ** 0.5))}


def _dense_gated(x, counts, ex, fn):
    """Row by row: ``(fn(x W1 + b1) * (x W3 + b3)) W2 + b2`` with the row's expert's weights,
    read from ``fc1_weight [El, D, 2, H]`` (W1 = [:, :, 0], W3 = [:, :, 1])."""
    experts = [e for block in counts for e, n in enumerate(block) for _ in range(n)]
    out = []
    for row, e in zip(x, experts):
        w1, w3 = ex.fc1_weight[e, :, 0], ex.fc1_weight[e, :, 1]
        g, u = row @ w1, row @ w3
        if ex.fc1_bias is not None:
            g, u = g + ex.fc1_bias[e, 0], u + ex.fc1_bias[e, 1]
        o = (fn(g) * u) @ ex.fc2_weight[e]
        out.append(o + ex.fc2_bias[e] if ex.fc2_bias is not None else o)
    return torch.stack(out) if out else x.new_zeros(0, ex.output_dim)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(act=st.sampled_from(["swiglu", "geglu"]), El=st.integers(1, 4), D=st.integers(1, 6), H=st.integers(1, 5),
       blocks=st.integers(1, 3), bias=st.booleans(), uniform=st.booleans(), data=st.data())
def test_gated_experts_match_dense_rows(act, El, D, H, blocks, bias, uniform, data):
    """Forward and every gradient of gated experts, on the padded (uniform) and the variable
    layouts with zero-row experts and blocks, equal a row-by-row float64 reference."""
    cap = data.draw(st.integers(0, 3))
    counts = [[cap] * El for _ in range(blocks)] if uniform else \
        data.draw(st.lists(st.lists(st.integers(0, 3), min_size=El, max_size=El), min_size=blocks, max_size=blocks))
    seg = Segments.uniform_blocks(blocks, El, cap) if uniform else Segments(counts, El)
    ex = FFNExperts(D, H, El, activation=act, fc1_bias=bias, fc2_bias=bias, seed=data.draw(st.integers(0, 99)),
                    dtype=torch.float64)
    assert ex.fc1_weight.shape == (El, D, 2, H) and (ex.fc1_bias is None or ex.fc1_bias.shape == (El, 2, H))
    x = torch.randn(seg.rows, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seg.rows))
    gy = torch.randn(seg.rows, D, dtype=torch.float64)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    got = ex(xs[0], seg)
    got.backward(gy)
    grads = [p.grad.clone() for p in ex.parameters()]
    ex.zero_grad(set_to_none=True)
    want = _dense_gated(xs[1], counts, ex, _REF_GATE[act])
    if want.requires_grad:
        want.backward(gy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xs[0].grad if xs[0].grad is not None else torch.zeros_like(x),
                               xs[1].grad if xs[1].grad is not None else torch.zeros_like(x), rtol=1e-12, atol=1e-12)
    for g, p in zip(grads, ex.parameters()):
        torch.testing.assert_close(g, p.grad if p.grad is not None else torch.zeros_like(p), rtol=1e-12, atol=1e-12)


def test_gated_defaults_and_custom_gated_callable():
    """Gated experts default to no biases (plain ones to biases); a GatedActivation of any
    callable (its backward through torch.autograd) equals the named one it spells."""
    from moecomm.moe.experts import GatedActivation, is_gated

    assert FFNExperts(4, 3, 2, activation="swiglu").fc1_bias is None
    assert FFNExperts(4, 3, 2, activation="geglu").fc2_bias is None
    assert FFNExperts(4, 3, 2, activation="silu").fc1_bias is not None
    assert is_gated("swiglu") and not is_gated("silu") and is_gated(GatedActivation(torch.tanh))
    seg = Segments([[2, 0, 3], [1, 1, 0]], 3)
    x = torch.randn(seg.rows, 4, dtype=torch.float64)
    outs = []
    for act in ("swiglu", GatedActivation(lambda h: h * torch.sigmoid(h))):
        ex = FFNExperts(4, 3, 3, activation=act, seed=5, dtype=torch.float64)
        xx = x.clone().requires_grad_(True)
        ex(xx, seg).square().sum().backward()
        outs.append([xx.grad] + [p.grad for p in ex.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
