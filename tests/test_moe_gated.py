"""moecomm.moe in one process: gated experts through the layer (checkpoint round trip, Tutel's
keys) and which path a call takes (``last_step_path``, the one-time log line)."""

from __future__ import annotations

import logging

import pytest
import torch

import moecomm
from moecomm import moe
from moecomm.moe import MoELayer, checkpoint
from moecomm.moe.experts import FFNExperts

pytestmark = pytest.mark.timeout(120)

D, H, E = 6, 8, 4


@pytest.fixture(scope="module")
def comm():
    return moecomm.init(backend="mpi")


class Model(torch.nn.Module):
    def __init__(self, comm, **kw):
        super().__init__()
        self.inp = torch.nn.Linear(D, D)
        self.moe = MoELayer(D, H, E, k=2, comm=comm, **kw)

    def forward(self, x):
        return self.moe(self.inp(x))


def test_gated_checkpoint_round_trip_and_shards(comm, tmp_path):
    """A SwiGLU layer saved, scattered to 1, 2, 4 and 8 ranks (8: every expert sharded over 2
    along its hidden dimension, W1 and W3 alike) and gathered back is the same file; the
    shards of an expert add up to the whole expert; the file loads into a new model."""
    torch.manual_seed(0)
    m = Model(comm, activation="swiglu", fc1_bias=True, seed=3)
    path = checkpoint.save(m, f"{tmp_path}/m.{{rank}}-of-{{size}}.pt")
    full = checkpoint.read(path)
    sd = full["state_dict"]
    assert sd["moe.experts.fc1_weight"].shape == (E, D, 2, H) and sd["moe.experts.fc1_bias"].shape == (E, 2, H)
    assert "moe.experts.fc2_bias" not in sd  # gated: off unless asked for
    for size in (1, 2, 4, 8):
        out = f"{tmp_path}/s{size}/x.{{rank}}-of-{{size}}.pt"
        checkpoint.scatter(path, out, size)
        back = checkpoint.gather(out)["state_dict"]
        assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    x = torch.randn(5, D, dtype=torch.float64)
    seg = moe.experts.Segments([[5]], 1)
    for e in range(E):
        whole = FFNExperts(D, H, 1, activation="swiglu", fc1_bias=True, dtype=torch.float64)
        whole.load_state_dict({k.split("experts.")[1]: v[e:e + 1].double() for k, v in sd.items() if ".experts." in k})
        parts = torch.zeros(5, D, dtype=torch.float64)
        for s in range(2):
            rank_sd = checkpoint.read(f"{tmp_path}/s8/x.{2 * e + s}-of-8.pt")["state_dict"]
            shard = FFNExperts(D, H, 1, activation="swiglu", fc1_bias=True, shards=2, shard_index=s,
                               dtype=torch.float64)
            shard.load_state_dict({k.split("experts.")[1]: v.double() for k, v in rank_sd.items() if ".experts." in k})
            parts += shard(x, seg)
        torch.testing.assert_close(parts, whole(x, seg), rtol=1e-12, atol=1e-12)
    m2 = Model(comm, activation="swiglu", fc1_bias=True, seed=4)
    checkpoint.load(m2, f"{tmp_path}/s1/x.{{rank}}-of-{{size}}.pt")
    xin = torch.randn(7, D)
    assert torch.equal(m(xin), m2(xin))


def test_tutel_keys_build_gated_experts(comm):
    """Tutel's expert keys take a gated activation name: fc1 as [El, model_dim, 2, hidden],
    biases off unless has_fc1_bias / has_fc2_bias say otherwise."""
    ffn = dict(type="ffn", count_per_node=2, hidden_size_per_expert=H, activation_fn="swiglu")
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=D, experts=ffn, group=comm)
    ex = layer.experts
    assert ex.fc1_weight.shape == (2, D, 2, H) and ex.fc1_bias is None and ex.fc2_bias is None
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=D, experts=dict(ffn, has_fc1_bias=True),
                          group=comm)
    assert layer.experts.fc1_bias.shape == (2, 2, H) and layer.experts.fc2_bias is None
    y = layer(torch.randn(3, 5, D))
    assert y.shape == (3, 5, D) and layer.last_step_path.path == "fused"


def test_last_step_path_and_one_log_line(comm, caplog):
    """``last_step_path`` names the path of the last call and why it was not fused; the first
    call that runs op by op with fused_step=True logs why once (per process and reason) on
    the ``moecomm`` logger; fused_step=False is the user's choice and logs nothing."""
    x = torch.randn(9, D)
    lam = MoELayer(D, H, E, comm=comm, activation=lambda h: torch.relu(h) * 2.0)
    assert lam.last_step_path is None
    lam(x)
    assert lam.last_step_path == ("fused", None)
    with caplog.at_level(logging.WARNING, logger="moecomm"):
        layers = [MoELayer(D, H, E, comm=comm, activation="swiglu", overlap_degree=2) for _ in range(2)]
        for layer in layers:
            layer(x)
            layer(x)
            assert layer.last_step_path.path == "op_by_op"
            assert "overlap_degree=2" in layer.last_step_path.reason
        lam(x, capacity_factor=-0.37)
        assert "capacity_factor=-0.37" in lam.last_step_path.reason
        lam(x)
        assert lam.last_step_path.path == "fused"
        off = MoELayer(D, H, E, comm=comm, fused_step=False)
        off(x)
        assert off.last_step_path == ("op_by_op", "fused_step=False")
    said = [r.getMessage() for r in caplog.records if r.name == "moecomm"]
    assert sum("overlap_degree=2" in m for m in said) <= 1  # once per process (an earlier test may have said it)
    assert sum("capacity_factor=-0.37" in m for m in said) == 1
    assert not any("fused_step=False" in m for m in said)
