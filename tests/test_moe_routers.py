"""moecomm.moe's router options in one process (issue 27): ``select_experts`` against the
token-by-token reference (tests/ranks/moe_reference.py ``route_token``) over random options,
the sequence-level loss by input layout, the expert-bias update, the per-call k check. The
option errors are in tests/test_moe_config.py, the cross-rank checks in
tests/ranks/moe_layer_checks.py (group ``routers``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moecomm.moe import MoELayer
from moecomm.moe.scoring import RouterOptions, loss_scores, select_experts, seq_switch_loss, switch_loss
from tests.ranks.moe_reference import RefRouter, elementwise_scores, route_token, switch_ref
from tests.test_moe_config import SETTINGS, comm  # noqa: F401 - the one-rank communicator fixture

pytestmark = pytest.mark.timeout(120)



@st.composite
def router_cases(draw):
    groups = draw(st.sampled_from([None, 1, 2, 4]))
    E = draw(st.sampled_from([4, 8])) if groups in (None, 1, 2, 4) else 8
    fn = draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]))
    pre = draw(st.booleans()) if fn == "softmax" else True
    if groups is None:
        gk = None
        k = draw(st.integers(1, E))
    else:
        gk = draw(st.integers(1, groups))
        k = draw(st.integers(gk, gk * (E // groups)))
    return dict(E=E, k=k, fn=fn, pre=pre, groups=groups, gk=gk, normalize=draw(st.booleans()),
                scaling=draw(st.sampled_from([None, 2.5])), bias=draw(st.booleans()),
                T=draw(st.integers(0, 7)), seed=draw(st.integers(0, 2 ** 16)))


@SETTINGS
@given(router_cases())
def test_select_experts_matches_reference(c):
    g = torch.Generator().manual_seed(c["seed"])
    E, k = c["E"], c["k"]
    logits = torch.randn(c["T"], E, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(E, generator=g, dtype=torch.float64) * 0.1 if c["bias"] else None
    opts = RouterOptions(c["fn"], c["pre"], c["normalize"], c["scaling"], c["groups"], c["gk"])
    gates, idx = select_experts(logits, k, opts, bias)
    ref = RefRouter(c["fn"], c["pre"], c["scaling"], bias, c["groups"], c["gk"])
    lr = logits.detach().clone().requires_grad_(True)
    want_idx, want_g = [], []
    for t in range(c["T"]):
        ch, gt = route_token(lr[t], k, ref, c["normalize"])
        want_idx.append(ch)
        want_g.append(torch.stack(gt))
    assert idx.tolist() == want_idx
    if c["T"]:
        wg = torch.stack(want_g)
        torch.testing.assert_close(gates, wg, rtol=1e-12, atol=1e-12)
        w = torch.randn(c["T"], k, generator=g, dtype=torch.float64)
        (gates * w).sum().backward()
        (wg * w).sum().backward()
        torch.testing.assert_close(logits.grad, lr.grad, rtol=1e-10, atol=1e-12)
        scores = loss_scores(logits.detach(), c["fn"])
        rows = [elementwise_scores(logits[t].detach(), c["fn"]) for t in range(c["T"])]
        want_s = torch.stack([r if c["fn"] == "softmax" else r / (r.sum() + 1e-20) for r in rows])
        torch.testing.assert_close(scores, want_s, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(switch_loss(scores, k), switch_ref(want_s, k), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("seq_dim", [0, 1])
def test_sequence_loss_by_layout(comm, seq_dim):
    """seq_aux_loss: the switch loss of each sequence, averaged; [S, B] (seq_dim=0) or [B, S]."""
    torch.manual_seed(0)
    layer = MoELayer(8, 12, 4, k=2, comm=comm, seed=1, dtype=torch.float64, score_function="sigmoid",
                     balance_loss=None, seq_aux_loss_weight=0.5, seq_dim=seq_dim, dropless=True, fp32_gate=False)
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    layer(x)
    logits = x.reshape(-1, 8) @ layer.gates[0].wg.weight.t()
    s = loss_scores(logits, "sigmoid").view(5, 3, 4)
    seqs = [s[:, b] for b in range(3)] if seq_dim == 0 else [s[b] for b in range(5)]
    want = sum(switch_ref(q, 2) for q in seqs) / len(seqs)
    torch.testing.assert_close(layer.seq_aux_loss, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(layer.aux_loss, 0.5 * want, rtol=1e-12, atol=0)
    by_seq = s if seq_dim == 0 else s.transpose(0, 1)
    torch.testing.assert_close(seq_switch_loss(by_seq, 2), want, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="seq_aux_loss_weight"):
        layer(torch.randn(2, 2, 2, 8, dtype=torch.float64))


def test_expert_bias_counts_and_update(comm):
    """Counts accumulate over training forwards only; the update is rate * sign(mean - n)."""
    layer = MoELayer(8, 12, 4, k=2, comm=comm, seed=1, score_function="sigmoid", expert_bias=True, dropless=True)
    x = torch.randn(9, 8)
    layer.train()
    layer(x)
    layer(x)
    n = torch.zeros(4)
    for row in layer.last_routing.topk_idx.tolist():
        for e in row:
            n[e] += 2
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    assert layer.tokens_per_expert.tolist() == n.tolist()
    before = layer.expert_bias.clone()
    got = layer.update_expert_bias(0.25)
    torch.testing.assert_close(got, before + 0.25 * torch.sign(n.mean() - n))
    assert not layer.tokens_per_expert.any()
    assert "expert_bias" in layer.state_dict() and "tokens_per_expert" not in layer.state_dict()
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        MoELayer(8, 12, 4, comm=comm, seed=1).update_expert_bias(0.1)
    with pytest.raises(TypeError, match="rate"):
        layer.update_expert_bias("fast")


def test_per_call_k_checked_against_groups(comm):
    layer = MoELayer(8, 12, 4, k=2, comm=comm, seed=1, num_groups=2, group_topk=2)
    with pytest.raises(ValueError, match="k=1"):
        layer(torch.randn(3, 8), k=1)


def test_checkpoint_keeps_expert_bias_and_shared_expert(comm, tmp_path):
    from moecomm.moe import checkpoint

    kw = dict(comm=comm, score_function="sigmoid", expert_bias=True, shared_expert_size=6, shared_expert_gate=True)
    a = MoELayer(8, 12, 4, seed=1, **kw)
    with torch.no_grad():
        a.expert_bias.copy_(torch.tensor([0.5, -0.25, 0.0, 1.0]))
    checkpoint.save(a, str(tmp_path / "ck_{rank}.pt"))
    b = MoELayer(8, 12, 4, seed=2, **kw)
    checkpoint.load(b, str(tmp_path / "ck_{rank}.pt"))
    x = torch.randn(5, 8)
    assert torch.equal(a.expert_bias, b.expert_bias) and torch.equal(a(x), b(x))


def test_shared_expert_on_the_fused_step(comm, monkeypatch):
    """Tutel's router with a shared expert still takes the fused step, and adds the shared output."""
    kw = dict(comm=comm, seed=4, shared_expert_size=6, shared_expert_gate=True)
    fused, plain = MoELayer(8, 12, 4, **kw), MoELayer(8, 12, 4, fused_step=False, **kw)
    calls = []
    orig = MoELayer._fused
    monkeypatch.setattr(MoELayer, "_fused", lambda self, *a: calls.append(1) or orig(self, *a))
    x = torch.randn(9, 8)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [m(xi) for m, xi in zip((fused, plain), xs)]
    assert calls == [1]
    for m, y in zip((fused, plain), ys):
        (y.square().sum() + m.aux_loss).backward()
    torch.testing.assert_close(ys[0], ys[1])
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    torch.testing.assert_close(fused.shared_experts.fc1_weight.grad, plain.shared_experts.fc1_weight.grad)


@pytest.mark.parametrize("kw, words", [
    (dict(score_function="sigmoid"), "score_function='sigmoid'"),
    (dict(pre_softmax=False), "pre_softmax=False"),
    (dict(expert_bias=True), "expert_bias=True"),
    (dict(seq_aux_loss_weight=0.5), "seq_aux_loss_weight=0.5"),
])
def test_router_options_leave_the_fused_step(comm, kw, words, monkeypatch):
    """A router other than Tutel's runs op by op, and the reason names the option."""
    layer = MoELayer(8, 12, 4, comm=comm, seed=4, **kw)
    assert words in layer._router_reason
    monkeypatch.setattr(MoELayer, "_fused", lambda *a: pytest.fail("the fused step ran"))
    layer(torch.randn(5, 8))
    assert MoELayer(8, 12, 4, comm=comm, seed=4)._router_reason is None


def test_expert_bias_back_to_float32(comm):
    """After layer.to(bfloat16) the load counts and the updated bias are float32 again."""
    layer = MoELayer(8, 12, 4, comm=comm, seed=1, score_function="sigmoid", expert_bias=True).to(torch.bfloat16)
    layer.train()
    layer(torch.randn(300, 8, dtype=torch.bfloat16))
    layer(torch.randn(300, 8, dtype=torch.bfloat16))
    assert layer.tokens_per_expert.dtype == torch.float32 and float(layer.tokens_per_expert.sum()) == 1200
    assert layer.update_expert_bias(1e-4).dtype == torch.float32
    assert float(layer.expert_bias.abs().max()) == torch.tensor(1e-4).item()
