"""Auxiliary losses of the router (all computed on this rank's tokens, as Tutel does)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["gshard_loss", "load_importance_loss", "router_z_loss", "BALANCE_LOSSES"]

BALANCE_LOSSES = ("gshard", "switch", "load_importance", None)


def gshard_loss(scores: Tensor, top1: Tensor, ones: Optional[Tensor] = None) -> Tensor:
    """GShard balance loss: ``E * sum_e mean_t(scores[t, e]) * frac_t(top1 == e)``.

    ``scores``: ``[T, E]`` router probabilities (with noise, if any); ``top1``: ``[T]``
    int64 first choices; ``ones``: ``[T]`` ones of ``scores``' dtype, if at hand (a cached
    constant). Gradient flows through ``scores`` only. 0 for ``T == 0``.
    """
    T, E = scores.shape
    if T == 0:
        return scores.sum() * 0.0
    counts = torch.zeros(E, dtype=scores.dtype, device=scores.device).scatter_add_(
        0, top1, ones if ones is not None else torch.ones_like(top1, dtype=scores.dtype))
    return (scores.sum(0) * counts).sum() * (E / (T * T))


def _cv_squared(v: Tensor) -> Tensor:
    v = v if v.dtype == torch.float64 else v.float()
    if v.numel() <= 1:
        return v.sum() * 0.0
    return v.var() / (v.mean() ** 2 + 1e-10)


def load_importance_loss(scores_clean: Tensor, logits_noisy: Tensor, topk_idx: Tensor, gate_noise: float) -> Tensor:
    """Importance + load loss of Shazeer et al. (2017), as Tutel's ``is_gshard_loss=False``.

    importance = CV^2 of ``sum_t scores_clean``; load = CV^2 of ``sum_t P(expert in top-k)``
    with ``P = Phi((logits_clean - kth_noisy_logit) / (gate_noise / E))``. Needs
    ``gate_noise > 0``. Returns their mean.
    """
    T, E = scores_clean.shape
    if gate_noise <= 0:
        raise ValueError(f"balance_loss='load_importance' needs gate_noise > 0, got gate_noise={gate_noise}")
    acc = torch.float64 if scores_clean.dtype == torch.float64 else torch.float32
    importance = _cv_squared(scores_clean.to(acc).sum(0))
    if T == 0:
        return importance
    threshold = logits_noisy.to(acc).gather(1, topk_idx[:, -1:])  # k-th largest noisy logit
    # logits_clean are recovered up to a per-token constant from the softmax; Tutel compares
    # softmax probabilities to the k-th noisy *logit*; keep exactly that convention.
    diff = scores_clean.to(acc) - threshold
    sigma = gate_noise / E
    prob = 0.5 * (1.0 + torch.erf(diff / (sigma * 2.0 ** 0.5)))
    load = _cv_squared(prob.sum(0))
    return (importance + load) / 2.0


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss: ``mean_t logsumexp(logits[t])^2`` (0 for no tokens)."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.logsumexp(logits.to(acc), dim=1).pow(2).mean()
