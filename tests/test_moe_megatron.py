"""Parity with Megatron-core 0.19's MoE layer on the CPU (tests/ranks/megatron_parity.py, in a
process of its own), skipped where megatron-core (and the triton it imports) is absent; and
the option mapping's errors, which need no Megatron."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch.nn.functional as F

from moecomm.moe.megatron import megatron_options

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_megatron_core_parity():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.ranks.megatron_parity"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr[-3000:]
    if proc.returncode == 77:
        pytest.skip(out.strip().splitlines()[0])
    assert proc.returncode == 0 and "parity passed" in proc.stdout, out


def _cfg(**kw):
    base = dict(hidden_size=8, moe_ffn_hidden_size=12, num_moe_experts=8, moe_router_topk=2,
                moe_router_score_function="softmax", moe_router_pre_softmax=False,
                moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
                moe_router_num_groups=None, moe_router_group_topk=None, moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=0.01, moe_z_loss_coeff=None, activation_func=F.gelu, gated_linear_unit=False,
                add_bias_linear=False, moe_router_dtype="fp32", moe_expert_capacity_factor=None,
                moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_megatron_options_mapping():
    got = megatron_options(_cfg(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                                moe_aux_loss_coeff=[0.01, 0.02], moe_router_score_function="sigmoid",
                                gated_linear_unit=True, activation_func=F.silu,
                                moe_shared_expert_intermediate_size=16))
    assert got["balance_loss"] == "switch" and got["balance_loss_weight"] == 0.01
    assert got["seq_aux_loss_weight"] == 0.02 and got["dropless"] and got["normalize_gate"]
    assert got["activation"] == "swiglu" and got["shared_expert_activation"] == "swiglu"
    assert megatron_options(_cfg(moe_router_pre_softmax=True))["normalize_gate"] is False


@pytest.mark.parametrize("kw, words", [
    (dict(moe_router_load_balancing_type="global_aux_loss"), ["global_aux_loss"]),
    (dict(moe_expert_capacity_factor=1.0), ["moe_expert_capacity_factor"]),
    (dict(activation_func=F.tanh), ["activation_func"]),
])
def test_megatron_options_errors(kw, words):
    with pytest.raises(ValueError) as info:
        megatron_options(_cfg(**kw))
    for w in words:
        assert w in str(info.value)
