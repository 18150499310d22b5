"""moecomm.moe in one process: bad configurations, Tutel's configuration keys, routing properties."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moecomm
from moecomm import moe
from moecomm.moe import MoELayer
from moecomm.moe.routing import capacity_slots, dropless_slots, route

pytestmark = pytest.mark.timeout(120)

SETTINGS = settings(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck),
                    max_examples=30)


@pytest.fixture(scope="module")
def comm():
    return moecomm.init(backend="mpi")


def ffn(**kw):
    return dict(type="ffn", count_per_node=kw.pop("count_per_node", 4), hidden_size_per_expert=16, **kw)


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(k=5), ValueError, ["k", "5", "num_experts=4"]),
    (dict(k=0), ValueError, ["k", "0"]),
    (dict(k=2.0), TypeError, ["k", "2.0"]),
    (dict(gate="foo"), ValueError, ["gate", "'foo'", "cosine"]),
    (dict(gate=3), TypeError, ["gate", "int"]),
    (dict(capacity_factor="1"), TypeError, ["capacity_factor", "'1'"]),
    (dict(parallel_mode="model"), ValueError, ["parallel_mode", "'model'"]),
    (dict(overlap_degree=0), ValueError, ["overlap_degree", "0"]),
    (dict(overlap_degree=17), ValueError, ["overlap_degree", "17"]),
    (dict(algorithm="ring"), ValueError, ["algorithm", "'ring'"]),
    (dict(balance_loss="switches"), ValueError, ["balance_loss", "'switches'"]),
    (dict(balance_loss="load_importance"), ValueError, ["gate_noise", "load_importance"]),
    (dict(activation="swoosh"), ValueError, ["activation", "'swoosh'"]),
    (dict(hidden_size=None), TypeError, ["hidden_size"]),
    (dict(num_experts=None), TypeError, ["num_experts"]),
    (dict(model_dim=0), ValueError, ["model_dim", "0"]),
    (dict(experts=42), TypeError, ["experts", "int"]),
    (dict(experts=torch.nn.Identity(), parallel_mode="data"), ValueError, ["parallel_mode", "'data'"]),
    (dict(gate_noise=-1.0), ValueError, ["gate_noise", "-1"]),
    # router and shared-expert options (issue 27)
    (dict(score_function="tanh"), ValueError, ["score_function", "'tanh'"]),
    (dict(pre_softmax=1), TypeError, ["pre_softmax"]),
    (dict(expert_bias="yes"), TypeError, ["expert_bias"]),
    (dict(topk_scaling_factor=float("inf")), ValueError, ["topk_scaling_factor"]),
    (dict(num_groups=2), ValueError, ["num_groups", "group_topk"]),
    (dict(num_groups=3, group_topk=1), ValueError, ["num_groups=3", "num_experts=4"]),
    (dict(num_groups=2, group_topk=3), ValueError, ["group_topk", "3"]),
    (dict(num_groups=4, group_topk=1, k=2), ValueError, ["k=2", "group_topk=1"]),
    (dict(num_groups=2, group_topk=2, k=1), ValueError, ["k=1", "group_topk=2"]),
    (dict(seq_dim=2), ValueError, ["seq_dim", "2"]),
    (dict(balance_loss_weight="1"), TypeError, ["balance_loss_weight"]),
    (dict(shared_expert_size=0), ValueError, ["shared_expert_size", "0"]),
    (dict(shared_expert_size=4, shared_expert_activation=3), TypeError, ["shared_expert_activation"]),
    (dict(score_function="sigmoid", balance_loss="load_importance", gate_noise=1.0), ValueError,
     ["load_importance", "'sigmoid'"]),
])
def test_bad_layer_arguments(comm, kwargs, exc, words):
    args = dict(model_dim=8, hidden_size=16, num_experts=4, comm=comm)
    args.update(kwargs)
    with pytest.raises(exc) as info:
        MoELayer(**args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_bad_forward_arguments(comm):
    layer = MoELayer(8, 16, 4, comm=comm, seed=0)
    with pytest.raises(ValueError, match=r"model_dim=8.*\(3, 7\)"):
        layer(torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\].*got 5"):
        layer(torch.randn(3, 8), k=5)
    with pytest.raises(ValueError, match="disagree"):
        layer(torch.randn(3, 8), k=1, top_k=2)
    with pytest.raises(TypeError, match="capacity_factor"):
        layer(torch.randn(3, 8), capacity_factor=None or "x")
    with pytest.raises(ValueError, match="gate_index"):
        layer(torch.randn(3, 8), gate_index=1)
    with pytest.raises(TypeError):
        layer(torch.randn(3, 8), megablocks_size=4)


def test_per_call_overrides_match_a_layer_built_that_way(comm):
    x = torch.randn(2, 9, 8)
    base = MoELayer(8, 16, 4, k=1, capacity_factor=2.0, comm=comm, seed=5).eval()
    other = MoELayer(8, 16, 4, k=3, capacity_factor=0.5, comm=comm, seed=5, dropless=True).eval()
    torch.testing.assert_close(base(x, k=3, capacity_factor=0.5, dropless=True), other(x))
    torch.testing.assert_close(base(x, top_k=3, capacity_factor=0.5, a2a_ffn_overlap_degree=2),
                               other(x, dropless=False, overlap_degree=2))
    assert base.last_routing.topk_idx.shape[1] == 3


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(gate_type={"type": "top", "k": 2, "noise": 1}), ValueError, ["noise", "known keys", "gate_noise"]),
    (dict(gate_type={"type": "topk", "k": 2}), ValueError, ["'topk'", "cosine_top"]),
    (dict(gate_type={"k": 2}), ValueError, ["type"]),
    (dict(gate_type={"type": "top", "k": 9}), ValueError, ["k", "9"]),
    (dict(gate_type=5), TypeError, ["gate_type"]),
    (dict(gate_type={"type": "top", "proj_dim": 4}), ValueError, ["proj_dim", "cosine_top"]),
    (dict(experts=ffn(hidden=3)), ValueError, ["hidden", "hidden_size_per_expert"]),
    (dict(experts={"type": "moe"}), ValueError, ["'moe'", "ffn", "custom"]),
    (dict(experts={"type": "ffn", "count_per_node": 1}), ValueError, ["hidden_size_per_expert"]),
    (dict(experts=ffn(count_per_node=0)), ValueError, ["count_per_node"]),
    (dict(parallel_type="model"), ValueError, ["parallel_type", "'model'", "adaptive:1"]),
    (dict(parallel_type="adaptive:2"), ValueError, ["adaptive:2"]),
    (dict(pad_samples=True), ValueError, ["pad_samples", "known", "a2a_ffn_overlap_degree"]),
    (dict(seeds=(1, 2, 3, 4)), ValueError, ["seeds"]),
    (dict(experts={"type": "custom"}), ValueError, ["module"]),
])
def test_bad_tutel_configs(comm, kwargs, exc, words):
    args = dict(gate_type={"type": "top", "k": 2}, model_dim=8, experts=ffn(), group=comm)
    args.update(kwargs)
    with pytest.raises(exc) as info:
        moe.moe_layer(**args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_tutel_config_keys(comm):
    seen = []
    layer = moe.moe_layer(
        gate_type={"type": "top", "k": 2, "capacity_factor": 1.5, "gate_noise": 0.5, "fp32_gate": True},
        model_dim=8,
        experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 16,
                 "activation_fn": lambda x: F.gelu(x), "output_dim": 6, "has_fc1_bias": False,
                 "has_fc2_bias": True},
        scan_expert_func=lambda name, p: seen.append(name),
        result_func=lambda y: y * 2,
        seeds=(1, 2, 3), a2a_ffn_overlap_degree=2, is_postscore=False, batch_prioritized_routing=True,
        normalize_gate=False, is_gshard_loss=False, parallel_type="adaptive:1", group=comm)
    assert layer.num_experts == 2 and layer.k == 2 and layer.gates[0].capacity_factor == 1.5
    assert layer.experts.fc1_bias is None and layer.output_dim == 6
    assert sorted(seen) == ["fc1_weight", "fc2_bias", "fc2_weight"]
    assert all(getattr(p, "skip_allreduce", False) for p in layer.experts.parameters())
    assert layer.balance_loss_type == "load_importance" and not layer.is_postscore
    x = torch.randn(4, 3, 8)
    y = layer(x)
    assert y.shape == (4, 3, 6) and y.l_aux is layer.aux_loss and layer.l_aux is layer.aux_loss
    half = layer.result_func
    layer.result_func = None
    layer.eval()
    torch.testing.assert_close(half(layer(x)), layer(x) * 2)
    # the same seeds give the same weights
    again = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=8, seeds=(1, 2, 3), group=comm,
                          experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 16,
                                   "output_dim": 6, "has_fc1_bias": False})
    torch.testing.assert_close(again.gates[0].wg.weight, layer.gates[0].wg.weight)
    torch.testing.assert_close(again.experts.fc1_weight, layer.experts.fc1_weight)
    # legacy gate string, list of gates, cosine gate keys, data parallel / auto
    assert moe.moe_layer(gate_type="Top3Gate", model_dim=8, experts=ffn(), group=comm).k == 3
    multi = moe.moe_layer(gate_type=[{"type": "top", "k": 1}, {"type": "cosine_top", "k": 2, "proj_dim": 4,
                                                                "init_t": 0.3}],
                          model_dim=8, experts=ffn(), group=comm, parallel_type="adaptive:0")
    assert multi.parallel_mode == "data"
    multi(x, gate_index=1)
    assert multi.last_routing.topk_idx.shape[1] == 2
    assert moe.moe_layer(gate_type={"type": "top"}, model_dim=8, experts=ffn(), group=comm,
                         parallel_type="auto", dropless=True, z_loss_weight=0.1).parallel_mode == "auto"


class TutelStyleExperts(torch.nn.Module):
    """A custom expert class in Tutel's convention."""

    def __init__(self, model_dim, local_experts, sharded_count, hidden):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(local_experts, model_dim, hidden) * 0.1)
        self.v = torch.nn.Parameter(torch.randn(local_experts, hidden, model_dim) * 0.1)

    def forward(self, x):
        return torch.bmm(torch.relu(torch.bmm(x, self.w)), self.v)


def test_tutel_custom_experts(comm):
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=8, group=comm,
                          experts={"type": "custom", "module": TutelStyleExperts, "count_per_node": 3, "hidden": 5})
    y = layer(torch.randn(7, 8, requires_grad=True))
    y.sum().backward()
    assert layer.experts.module.w.grad is not None and layer.experts.module.w.shape == (3, 8, 5)
    with pytest.raises(ValueError, match="hidden"):
        moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=8, group=comm,
                      experts={"type": "custom", "module": torch.nn.Identity(), "count_per_node": 3, "hidden": 5})


# -- routing properties (against python loops) --------------------------------------------------


def brute_locations(idx, order):
    T, k = idx.shape
    used, loc = {}, [[0] * k for _ in range(T)]
    for j in range(k):
        for t in order:
            e = int(idx[t, j])
            loc[t][j] = used.get(e, 0)
            used[e] = used.get(e, 0) + 1
    return loc


@SETTINGS
@given(T=st.integers(0, 40), E=st.integers(1, 9), data=st.data())
def test_route_positions_and_slots(T, E, data):
    k = data.draw(st.integers(1, E))
    prio = data.draw(st.booleans())
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 20)))
    scores = torch.softmax(torch.randn(T, E, generator=g, dtype=torch.float64), dim=1)
    r = route(scores, k, batch_prioritized=prio)
    if prio:
        order = sorted(range(T), key=lambda t: (-float(scores[t].max()), t))
    else:
        order = list(range(T))
    assert r.locations.tolist() == brute_locations(r.topk_idx, order)
    assert r.counts.tolist() == [int((r.topk_idx == e).sum()) for e in range(E)]
    # slots: every kept route copy has its own slot; slot_token inverts token_slots
    S = data.draw(st.integers(1, 3))
    cap = data.draw(st.integers(0, 6))
    for sm in (capacity_slots(r, cap, E, S, 1), dropless_slots(r, S, 1)):
        ts = sm.token_slots
        valid = ts[ts >= 0]
        assert valid.unique().numel() == valid.numel() and (valid < sm.num_slots).all()
        for t in range(T):
            for m in range(ts.shape[1]):
                if ts[t, m] >= 0:
                    assert sm.slot_token[ts[t, m]] == t
        assert int((sm.slot_token >= 0).sum()) == valid.numel()
    kept = capacity_slots(r, cap, E, 1, 1).token_slots >= 0
    assert kept.tolist() == (r.locations < cap).tolist()


@SETTINGS
@given(T=st.integers(0, 30), W=st.integers(1, 4), El=st.integers(1, 3), data=st.data())
def test_pipelined_capacity_layout(T, W, El, data):
    """Each destination block = `degree` equal chunks along the capacity: cutting it into
    `degree` equal pieces gives every piece only its own chunk's slots, expert by expert."""
    from moecomm.moe.routing import pipelined_capacity_slots

    E = W * El
    k = data.draw(st.integers(1, E))
    cap = data.draw(st.integers(0, 7))
    d = data.draw(st.integers(1, 4))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 20)))
    r = route(torch.softmax(torch.randn(T, E, generator=g), dim=1), k)
    plain = capacity_slots(r, cap, E, 1, 1)
    if d == 1:
        assert pipelined_capacity_slots(r, cap, E, 1, 1, El).token_slots.tolist() == plain.token_slots.tolist()
    sm = pipelined_capacity_slots(r, cap, E, 1, d, El)
    Cc = -(-cap // d) if cap else 0
    assert sm.num_slots == W * d * El * Cc
    ts = sm.token_slots
    assert ((ts >= 0) == (plain.token_slots >= 0)).all()
    for t in range(T):
        for j in range(k):
            s = int(ts[t, j])
            if s < 0:
                continue
            e, loc = int(r.topk_idx[t, j]), int(r.locations[t, j])
            block, off = divmod(s, d * El * Cc)
            chunk, rest = divmod(off, El * Cc)
            assert (block, chunk, rest // Cc, rest % Cc) == (e // El, loc // Cc, e % El, loc % Cc)


def test_float_arguments_fail_alike_in_layer_and_gate():
    """One check for float arguments: TypeError for what is not a number, ValueError for inf/nan."""
    from moecomm.moe._ops.args import float_arg

    assert float_arg("x", 2) == 2.0 and isinstance(float_arg("x", 2), float)
    for bad, exc in (("1.0", TypeError), (True, TypeError), (None, TypeError), (float("inf"), ValueError),
                     (float("nan"), ValueError)):
        with pytest.raises(exc, match="capacity_factor must be"):
            float_arg("capacity_factor", bad)


def test_config_holds_exactly_the_layer_arguments():
    """MoEConfig's fields are MoELayer's arguments: the same names, order and defaults."""
    import dataclasses
    import inspect

    from moecomm.moe.config import MoEConfig

    params = list(inspect.signature(MoELayer.__init__).parameters.values())[1:]
    fields = dataclasses.fields(MoEConfig)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == want, (p.name, p.default, want)
    assert [p.kind for p in params[:3]] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 3
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in params[3:])
    assert MoELayer.__init__.__kwdefaults__["inequivalent_tokens"] is True
    assert MoELayer.__init__.__kwdefaults__["grad_wire_dtype"] == torch.bfloat16


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(k=5), ValueError, ["k", "5", "num_experts=4"]),
    (dict(num_experts=None), TypeError, ["num_experts"]),
    (dict(capacity_factor=float("nan")), ValueError, ["capacity_factor", "finite"]),
    (dict(dropless=1), TypeError, ["dropless", "bool"]),
    (dict(cuda_graph="yes"), TypeError, ["cuda_graph", "bool"]),
    (dict(own_first="sometimes"), TypeError, ["own_first", "'sometimes'"]),
    (dict(overlap_degree=17), ValueError, ["overlap_degree", "17"]),
    (dict(algorithm="ring"), ValueError, ["algorithm", "'ring'"]),
    (dict(wire_dtype=torch.int8), TypeError, ["wire_dtype"]),
    (dict(grad_wire_dtype=torch.int32), TypeError, ["grad_wire_dtype"]),
    (dict(gate=[]), ValueError, ["gate", "empty"]),
    (dict(hidden_size=None), TypeError, ["hidden_size"]),
    (dict(experts=torch.nn.Identity(), parallel_mode="auto"), ValueError, ["parallel_mode", "'auto'"]),
    (dict(result_func=3), TypeError, ["result_func"]),
    (dict(seed=-1), ValueError, ["seed", "-1"]),
])
def test_config_checks_without_a_communicator(kwargs, exc, words):
    from moecomm.moe.config import MoEConfig

    args = dict(model_dim=8, hidden_size=16, num_experts=4)
    args.update(kwargs)
    with pytest.raises(exc) as info:
        MoEConfig(**args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_config_is_frozen_and_builds_the_same_layer(comm):
    import dataclasses

    from moecomm.moe.config import MoEConfig

    cfg = MoEConfig(8, 16, 4, k=1, capacity_factor=2, seed=3, z_loss_weight=1, comm=comm)
    assert cfg.capacity_factor == 2.0 and isinstance(cfg.capacity_factor, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.k = 2  # type: ignore[misc]
    a, b = MoELayer.from_config(cfg).eval(), MoELayer(8, 16, 4, k=1, capacity_factor=2, seed=3, z_loss_weight=1,
                                                      comm=comm).eval()
    assert a.config == cfg and b.config == cfg
    x = torch.randn(5, 8)
    torch.testing.assert_close(a(x), b(x))
    torch.testing.assert_close(a.aux_loss, b.aux_loss)
    with pytest.raises(TypeError, match="MoEConfig"):
        MoELayer.from_config(dict(model_dim=8))


def test_tutel_config_is_what_moe_layer_builds(comm):
    from moecomm.moe.config import MoEConfig
    from moecomm.moe.tutel import tutel_config

    kw = dict(gate_type={"type": "cosine_top", "k": 2, "proj_dim": 4, "gate_noise": 0.5}, model_dim=8,
              experts=ffn(count_per_node=2), group=comm, seeds=(4, 5), is_gshard_loss=False,
              parallel_type="adaptive:0", dropless=True)
    cfg = tutel_config(**kw)
    assert isinstance(cfg, MoEConfig)
    assert (cfg.gate, cfg.k, cfg.proj_dim, cfg.num_experts, cfg.hidden_size, cfg.seed, cfg.expert_seed) == \
        ("cosine_top", 2, 4, 2 * comm.size, 16, 4, 5)
    assert (cfg.balance_loss, cfg.parallel_mode, cfg.dropless, cfg.comm) == ("load_importance", "data", True, comm)
    layer = moe.moe_layer(**kw).eval()
    again = MoELayer.from_config(cfg).eval()
    x = torch.randn(6, 8)
    torch.testing.assert_close(layer(x), again(x))


def test_result_func_may_return_a_non_tensor_but_other_errors_pass(comm):
    layer = MoELayer(8, 16, 4, comm=comm, seed=0, result_func=lambda y: (y, "extra"))
    y, extra = layer(torch.randn(3, 8))
    assert extra == "extra" and y.shape == (3, 8)

    class Strict:
        def __setattr__(self, name, value):
            raise RuntimeError(f"no attribute {name} here")

    layer.result_func = lambda y: Strict()
    with pytest.raises(RuntimeError, match="no attribute l_aux"):
        layer(torch.randn(3, 8))
