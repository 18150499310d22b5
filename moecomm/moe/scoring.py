"""Router scoring: from logits to the chosen experts and their gate weights, with the options of
Megatron-core's ``TopKRouter`` (score function, softmax before or after the top-k, top-k
scaling, an expert bias for choosing only, group-limited routing), and the aux losses that
use those scores (the Switch/Megatron load-balancing loss, its sequence-level variant).

Everything runs on the logits' device without host synchronisation: the choice and the gates
(:func:`select_experts`) as one native kernel each way where ``moecomm_ext`` has them
(:func:`select_experts_torch` is the reference), the losses as torch operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from moecomm_ext import reference
from moecomm_ext import select_experts as select_native
from moecomm_ext.reference import group_limited_topk

__all__ = ["SCORE_FUNCTIONS", "RouterOptions", "select_experts", "select_experts_torch", "loss_scores", "switch_loss",
           "seq_switch_loss", "group_limited_topk", "updated_expert_bias"]

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
"""Score functions (Megatron-core's names): ``softmax`` over the experts, or per expert
``sigmoid(l)`` or ``sqrt(softplus(l))``."""


@dataclass(frozen=True)
class RouterOptions:
    """How the layer turns logits into choices and gate weights (see :func:`select_experts`)."""

    score_function: str = "softmax"
    pre_softmax: bool = True
    normalize: bool = True
    scaling_factor: Optional[float] = None
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None

    @property
    def plain(self) -> bool:
        """Tutel's router (softmax, then top-k, then renormalised or not; no groups, no scaling)."""
        return (self.score_function == "softmax" and self.pre_softmax and self.scaling_factor is None
                and self.num_groups is None)


def select_experts(logits: Tensor, k: int, opts: RouterOptions,
                   expert_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``(gates [T, k], topk_idx [T, k] int64)`` from float ``logits`` ``[T, E]``.

    - ``softmax``, ``pre_softmax``: ``s = softmax(l)``, the top-k of ``s + bias``, gates
      ``s[idx]``, divided by their sum when ``normalize`` (and ``k > 1``);
    - ``softmax``, not ``pre_softmax``: the top-k of ``l + bias``, gates ``softmax(l[idx])``
      (normalised by construction);
    - ``sigmoid``/``sqrtsoftplus``: ``s`` elementwise, the top-k of ``s + bias``, gates
      ``s[idx]``, divided by ``sum + 1e-20`` when ``normalize`` and ``k > 1``;

    then times ``scaling_factor`` if set. ``expert_bias`` (``[E]``, float32) only shifts the
    choice, never the gates; groups (``num_groups``) limit it as :func:`group_limited_topk`.
    Gradients flow to ``logits`` through the gates.
    """
    T, E = logits.shape
    if T == 0:
        idx = torch.empty(0, k, dtype=torch.int64, device=logits.device)
        return logits.gather(1, idx), idx
    native = select_native(logits, k, opts.score_function, opts.pre_softmax, opts.normalize, opts.scaling_factor,
                           opts.num_groups, opts.group_topk, expert_bias)
    if native is not None:  # one kernel each way in place of the operations below (same values)
        return native
    return select_experts_torch(logits, k, opts, expert_bias)


def select_experts_torch(logits: Tensor, k: int, opts: RouterOptions,
                         expert_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """:func:`select_experts` as torch operations (``moecomm_ext.reference.select_experts``,
    the native kernels' reference; ties between equal scores as ``torch.topk`` breaks them)."""
    return reference.select_experts(logits, k, opts.score_function, opts.pre_softmax, opts.normalize,
                                    opts.scaling_factor, opts.num_groups, opts.group_topk, expert_bias)


def loss_scores(logits: Tensor, score_function: str) -> Tensor:
    """``[T, E]`` per-token probabilities for the balance losses: ``softmax(l)``, or the
    elementwise scores divided by their sum over the experts (``+ 1e-20``), as Megatron-core's
    ``compute_routing_scores_for_aux_loss``."""
    s = reference.router_scores(logits, score_function)
    if score_function != "softmax":
        s = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    return s


def switch_loss(scores: Tensor, k: int) -> Tensor:
    """Switch/Megatron-core load-balancing loss (its ``aux_loss``) of this rank's ``T`` tokens:
    ``E / (k T^2) * sum_e (sum_t scores[t, e]) * n_e`` where ``n_e`` counts the tokens whose
    top-k of ``scores`` (``[T, E]``, :func:`loss_scores`; no bias, no groups) holds ``e``.
    Gradient through ``scores`` only; 0 for ``T == 0``."""
    T, E = scores.shape
    if T == 0:
        return scores.sum() * 0.0
    idx = torch.topk(scores.detach(), k, dim=1).indices
    n = torch.zeros(E, dtype=scores.dtype, device=scores.device).scatter_add_(
        0, idx.reshape(-1), torch.ones(idx.numel(), dtype=scores.dtype, device=scores.device))
    return (scores.sum(0) * n).sum() * (E / (k * T * T))


def seq_switch_loss(scores: Tensor, k: int) -> Tensor:
    """Megatron-core's ``seq_aux_loss``: :func:`switch_loss` of each sequence on its own,
    averaged over the sequences. ``scores``: ``[S, B, E]`` (``S`` positions of ``B``
    sequences). 0 for no tokens."""
    S, B, E = scores.shape
    if S == 0 or B == 0:
        return scores.sum() * 0.0
    idx = torch.topk(scores.detach(), k, dim=2).indices  # [S, B, k]
    n = torch.zeros(B, E, dtype=scores.dtype, device=scores.device).scatter_add_(
        1, idx.permute(1, 0, 2).reshape(B, S * k), torch.ones(B, S * k, dtype=scores.dtype, device=scores.device))
    return (scores.sum(0) * n).sum() * (E / (k * S * S * B))


def updated_expert_bias(expert_bias: Tensor, tokens_per_expert: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3's aux-loss-free update (Megatron-core's ``get_updated_expert_bias``):
    ``bias + rate * sign(mean(n) - n)`` for the ``[E]`` loads ``n`` (already summed over ranks):
    an overloaded expert's bias goes down by ``rate``, an underloaded one's up."""
    n = tokens_per_expert.to(expert_bias.dtype)
    return expert_bias + torch.sign(n.sum() / n.numel() - n) * rate
