"""Megatron-core's ``MoELayer.forward`` on moecomm's fused step (``megatron.enable(layer="moecomm")``).

Megatron's router runs as Megatron's own (its probabilities, routing map, aux losses, z-loss
and expert-bias counts are Megatron's); the permutation, the exchanges, the experts and the
unpermutation are replaced by moecomm's routed fused step
(:func:`moecomm.moe._step.fused_step.routed_step`): the routes' rows gathered by a native
kernel, exchanged over the expert-parallel group's communicator, run through the local
experts as grouped GEMMs (in place of ``SequentialMLP``'s per-expert loop with its host
split), and summed back per token weighted by Megatron's probabilities. Megatron's shared
experts run as Megatron's own and are added.

The experts' weights are stacked from Megatron's own ``linear_fc1`` / ``linear_fc2``
parameters at every call (a differentiable ``torch.stack``), so the parameters the
optimizer holds stay Megatron's and their gradients reach them. The stacked copy lives only
while the forward's GEMMs use it; the backward stacks the weights again (one more copy of the
layer's local expert weights, read and written, per backward) rather than keep it alive from
the forward to the backward.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

from ._patch import any_forward_hooks, module_tree

__all__ = ["plan", "layer_forward", "fallback_reason"]

_log = logging.getLogger("moecomm")


def _activation(cfg: Any) -> Union[str, Callable]:
    """moecomm's activation for Megatron's ``activation_func`` / ``gated_linear_unit``, or why not."""
    from ..moe.experts import ACTIVATIONS, GatedActivation

    fn = cfg.activation_func
    plain = {F.gelu: "gelu", F.silu: "silu", F.relu: "relu"}.get(fn)
    if plain is None:
        return f"its activation_func {getattr(fn, '__name__', fn)!r} is not F.gelu, F.silu or F.relu"
    if getattr(cfg, "glu_linear_offset", 0.0) or getattr(cfg, "activation_func_clamp_value", None) is not None:
        return "glu_linear_offset or activation_func_clamp_value is set"
    if cfg.gated_linear_unit:
        return GatedActivation(ACTIVATIONS[plain], {"gelu": "geglu", "silu": "swiglu", "relu": "reglu"}[plain])
    return ACTIVATIONS[plain]


def _size(group: Any) -> int:
    return 1 if group is None else group.size()


def plan(layer: Any, hidden_states: torch.Tensor, intermediate_tensors: Any, padding_mask: Any) -> Union[str, tuple]:
    """``(activation, fc1 list, fc2 list)`` when moecomm can run ``layer`` on ``hidden_states``,
    else the reason it cannot (a sentence)."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP

    cfg = layer.config
    if intermediate_tensors is not None:
        return "it is called with intermediate_tensors (a partial CUDA graph)"
    if padding_mask is not None:
        return "it is called with a padding_mask"
    if list(getattr(layer, "fwd_execution_map", ())) != ["route", "expert_compute", "postprocess"]:
        return f"its fwd_execution_map is {getattr(layer, 'fwd_execution_map', None)!r}"
    if getattr(cfg, "cuda_graph_impl", "none") not in (None, "none"):
        return f"cuda_graph_impl={cfg.cuda_graph_impl!r}"
    if getattr(cfg, "transformer_impl", None) == "inference_optimized":
        return "transformer_impl='inference_optimized' (its inference token dispatcher)"
    if layer.training and layer.moe_layer_recompute:
        return "moe_layer_recompute is on"
    for name in ("moe_latent_size", "moe_expert_capacity_factor"):
        if getattr(cfg, name, None) is not None:
            return f"{name}={getattr(cfg, name)!r}"
    for name in ("fp8", "fp4"):
        if getattr(cfg, name, None):
            return f"{name}={getattr(cfg, name)!r}"
    for name in ("moe_apply_probs_on_input", "moe_shared_expert_overlap",
                 "overlap_dispatch_backward_with_experts_wgrad", "use_te_activation_func"):
        if getattr(cfg, name, False):
            return f"{name} is on"
    if _size(layer.tp_group) > 1 or _size(getattr(layer.experts, "tp_group", None)) > 1:
        return "it is tensor-parallel (moecomm runs expert-parallel layers only)"
    if torch.is_autocast_enabled(hidden_states.device.type):
        return "autocast is on"
    experts = layer.experts
    if type(experts) is not SequentialMLP:
        return f"its experts are {type(experts).__name__}, not SequentialMLP (Transformer Engine absent)"
    mods = list(experts.local_experts)
    if len(mods) != layer.num_local_experts or not mods:
        return f"it holds {len(mods)} experts for num_local_experts={layer.num_local_experts}"
    if any(type(m) is not MLP for m in mods):
        return "an expert is not megatron.core.transformer.mlp.MLP"
    act = _activation(cfg)
    if isinstance(act, str):
        return act
    if layer.use_shared_expert and layer.shared_experts_recompute and layer.training:
        return "the shared experts are recomputed (moe_layer_recompute / recompute_modules)"
    fc1 = [m.linear_fc1 for m in mods]
    fc2 = [m.linear_fc2 for m in mods]
    modules, params = module_tree(experts)  # (experts.parameters() and .modules() take 3x longer, every call)
    dtype, device = hidden_states.dtype, hidden_states.device
    for p in params:
        if p.dtype != dtype or p.device != device:
            return f"an expert parameter is {p.dtype} on {p.device}, the input {dtype} on {device}"
    if any_forward_hooks(modules):
        return "its experts have forward hooks"
    return act, fc1, fc2


def _stack(mods: list, name: str) -> Optional[torch.Tensor]:
    """``[El, in, out]``: the linears' ``name`` weights stacked (differentiable), as a
    transposed view; biases ``[El, out]``; None for absent biases."""
    ts = [getattr(m, name, None) for m in mods]
    if ts[0] is None or (name == "bias" and ts[0].numel() == 0):
        return None
    t = torch.stack(ts)
    return t.transpose(1, 2) if name == "weight" else t


def fallback_reason(layer: Any) -> Optional[str]:
    """Why ``layer`` ran Megatron's own ``MoELayer.forward`` at its last call under
    ``enable(layer="moecomm")``; None when it ran on moecomm's path (or has not run since)."""
    return getattr(layer, "moecomm_fallback", None)


def layer_forward(original: Callable, self: Any, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                  padding_mask: Optional[torch.Tensor] = None) -> tuple:
    """``MoELayer.forward`` on moecomm's routed fused step (or ``original`` with the reason logged)."""
    from ..moe._ops.step_cache import StepConstants
    from ..moe._step.fused_step import StepCall, routed_step
    from ._groups import communicator_for_group

    p = plan(self, hidden_states, intermediate_tensors, padding_mask)
    if isinstance(p, str):
        if getattr(self, "moecomm_fallback", None) != p:
            _log.warning("moecomm.integrations.megatron: layer='moecomm' runs Megatron's own MoELayer.forward for "
                         "this layer: %s", p)
        self.moecomm_fallback = p
        return original(self, hidden_states, intermediate_tensors, padding_mask)
    self.moecomm_fallback = None
    act, fc1, fc2 = p
    cfg = self.config
    shared = self.shared_experts_compute(hidden_states) if self.use_shared_expert else None
    probs, routing_map = self.route(hidden_states)
    k, E = cfg.moe_router_topk, cfg.num_moe_experts
    # each token's k experts, in ascending expert order (Megatron's routing map has exactly k
    # per token without a capacity factor or padding mask, both refused above)
    topk_idx = routing_map.to(torch.uint8).argsort(dim=1, descending=True, stable=True)[:, :k]
    gates = probs.gather(1, topk_idx)
    if gates.dtype not in (torch.float32, torch.float64):  # (moe_router_dtype unset: the router's probs in bf16)
        gates = gates.float()  # the routing kernels take float32; the gradient goes back to bf16 through autograd
    ep = self.ep_group
    comm = communicator_for_group(ep) if _size(ep) > 1 else _ONE_RANK
    consts = self.__dict__.get("_moecomm_consts")
    if consts is None:
        consts = self.__dict__["_moecomm_consts"] = StepConstants()
    call = StepCall(comm, E, self.num_local_experts, k, None, None, False, False, None, consts)
    # the backward stacks the weights again rather than keep the forward's copy alive until then
    call.weights = lambda: (_stack(fc1, "weight"), _stack(fc2, "weight"))
    experts = SimpleNamespace(fc1_weight=_stack(fc1, "weight"), fc1_bias=_stack(fc1, "bias"),
                              fc2_weight=_stack(fc2, "weight"), fc2_bias=_stack(fc2, "bias"), act=act)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    y = routed_step(call, x, gates, topk_idx, experts).view(hidden_states.shape)
    if shared is not None:
        y = y + shared
    return y, None


class _OneRank:
    """The communicator of a layer without expert parallelism: the fused step never exchanges."""

    size = 1
    rank = 0


_ONE_RANK = _OneRank()
