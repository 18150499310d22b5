"""Megatron-core's MoE layer in moecomm terms: :func:`megatron_options` maps a Megatron-core
``TransformerConfig`` (0.19) to :class:`~moecomm.moe.MoELayer` keyword arguments, and
:func:`load_megatron_state_dict` copies the weights of its ``MoELayer`` (``SequentialMLP``
experts, ``TopKRouter``, ``SharedExpertMLP``) into a layer. The mapping is tabulated in
``moecomm/moe/README.md``. Megatron-core itself is not needed.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["megatron_options", "load_megatron_state_dict"]


def _activation(cfg: Any) -> str:
    act = getattr(cfg, "activation_func", F.gelu)
    gated = bool(getattr(cfg, "gated_linear_unit", False))
    names = {F.gelu: "gelu", F.silu: "silu", F.relu: "relu"}
    if act not in names:
        raise ValueError(f"activation_func={act!r}: only F.gelu, F.silu and F.relu map to moecomm names")
    if gated:
        if act is F.relu:
            raise ValueError("gated_linear_unit with F.relu has no moecomm name (use F.silu or F.gelu)")
        return "swiglu" if act is F.silu else "geglu"
    return names[act]


def megatron_options(cfg: Any) -> dict:
    """``MoELayer`` keyword arguments for a Megatron-core ``TransformerConfig`` ``cfg`` (its
    ``moe_*`` router, loss, expert and shared-expert fields; dropless unless
    ``moe_expert_capacity_factor`` is set). The caller adds ``comm``, ``dtype``, ``device``.

    Raises:
        ValueError: a Megatron option with no moecomm equivalent (named).
    """
    types = cfg.moe_router_load_balancing_type
    coeffs = cfg.moe_aux_loss_coeff
    if isinstance(types, str):
        types, coeffs = [types], [coeffs]
    out: dict = dict(model_dim=cfg.hidden_size, hidden_size=cfg.moe_ffn_hidden_size, num_experts=cfg.num_moe_experts,
                     k=cfg.moe_router_topk, score_function=cfg.moe_router_score_function,
                     pre_softmax=bool(cfg.moe_router_pre_softmax), normalize_gate=not cfg.moe_router_pre_softmax
                     or cfg.moe_router_score_function != "softmax",
                     topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
                     expert_bias=bool(cfg.moe_router_enable_expert_bias), num_groups=cfg.moe_router_num_groups,
                     group_topk=cfg.moe_router_group_topk, balance_loss=None, balance_loss_weight=1.0,
                     seq_aux_loss_weight=0.0, seq_dim=0, z_loss_weight=float(cfg.moe_z_loss_coeff or 0.0),
                     activation=_activation(cfg), fc1_bias=bool(cfg.add_bias_linear),
                     fc2_bias=bool(cfg.add_bias_linear), fp32_gate=cfg.moe_router_dtype == "fp32")
    for t, c in zip(types, coeffs):
        if t == "aux_loss":
            out.update(balance_loss="switch", balance_loss_weight=float(c))
        elif t == "seq_aux_loss":
            out["seq_aux_loss_weight"] = float(c)
        elif t != "none":
            raise ValueError(f"moe_router_load_balancing_type={t!r} has no moecomm equivalent "
                             f"(known: 'aux_loss', 'seq_aux_loss', 'none')")
    cf = cfg.moe_expert_capacity_factor
    if cf is None:
        out["dropless"] = True
    else:
        raise ValueError(f"moe_expert_capacity_factor={cf}: Megatron-core drops by probability per expert, "
                         f"moecomm by queue position; only dropless (None) maps exactly")
    if cfg.moe_shared_expert_intermediate_size is not None:
        out.update(shared_expert_size=cfg.moe_shared_expert_intermediate_size,
                   shared_expert_activation=out["activation"], shared_expert_gate=bool(cfg.moe_shared_expert_gate))
    return out


@torch.no_grad()
def load_megatron_state_dict(layer: Any, state_dict: Mapping[str, Tensor], prefix: str = "") -> None:
    """Copy the weights of a Megatron-core ``MoELayer`` (its ``state_dict()``, keys under
    ``prefix``) into ``layer``: ``router.weight`` -> ``gates[0].wg.weight``,
    ``router.expert_bias`` -> ``expert_bias``, ``experts.local_experts.{e}.linear_fc1/2.weight``
    (and ``.bias``) -> this rank's ``experts.fc1/fc2_weight[e - first_expert]`` transposed (gated
    experts' ``fc1_weight[e]`` ``[D, 2, F]``: ``linear_fc1.weight`` ``[2F, D]`` transposed, its
    first ``F`` rows the activation's ``W1``),
    ``shared_experts.linear_fc1/2.weight``, ``shared_experts.gate_weight`` -> ``shared_experts``.
    Expert indices are global (Megatron's with one expert-parallel rank).

    Raises:
        KeyError: a weight the layer needs is missing (named).
        ValueError: a weight of the wrong shape (named, with both shapes).
    """
    def get(name: str) -> Tensor:
        key = prefix + name
        if key not in state_dict:
            raise KeyError(f"load_megatron_state_dict: {key!r} is missing from the state dict")
        return state_dict[key]

    def put(dst: Tensor, src: Tensor, name: str) -> None:
        if dst.numel() == src.numel() and dst.dim() == src.dim() + 1 and dst.shape[-2] == 2:
            src = src.reshape(dst.shape)  # gated experts' [.., 2, F]: Megatron's [W1; W3] halves, in order
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"load_megatron_state_dict: {prefix + name} has shape {tuple(src.shape)}, the layer "
                             f"expects {tuple(dst.shape)}")
        dst.copy_(src)

    put(layer.gates[0].wg.weight, get("router.weight"), "router.weight")
    if layer.expert_bias is not None:
        put(layer.expert_bias, get("router.expert_bias").float(), "router.expert_bias")
    ex = layer.experts
    for i in range(layer.num_local_experts):
        e = layer.first_expert + i
        base = f"experts.local_experts.{e}."
        put(ex.fc1_weight[i], get(base + "linear_fc1.weight").t(), base + "linear_fc1.weight")
        put(ex.fc2_weight[i], get(base + "linear_fc2.weight").t(), base + "linear_fc2.weight")
        if ex.fc1_bias is not None:
            put(ex.fc1_bias[i], get(base + "linear_fc1.bias"), base + "linear_fc1.bias")
        if ex.fc2_bias is not None:
            put(ex.fc2_bias[i], get(base + "linear_fc2.bias"), base + "linear_fc2.bias")
    sx = layer.shared_experts
    if sx is not None:
        put(sx.fc1_weight, get("shared_experts.linear_fc1.weight"), "shared_experts.linear_fc1.weight")
        put(sx.fc2_weight, get("shared_experts.linear_fc2.weight"), "shared_experts.linear_fc2.weight")
        if sx.gate_weight is not None:
            put(sx.gate_weight, get("shared_experts.gate_weight"), "shared_experts.gate_weight")
