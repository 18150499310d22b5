"""Routers: a gate maps tokens ``[T, model_dim]`` to expert logits ``[T, num_experts]``.

A gate also carries its routing defaults (``k``, ``capacity_factor``, ``gate_noise``),
which :class:`~moecomm.moe.MoELayer` uses unless a call overrides them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._ops.args import float_arg, int_arg
from ._ops.wide_gemm import wide_linear, wide_linear_applies

__all__ = ["TopKGate", "LinearTopKGate", "CosineTopKGate", "GATE_TYPES", "make_gate"]


class TopKGate(nn.Module):
    """Base of the routers: holds ``k``, ``capacity_factor``, ``gate_noise`` and ``fp32_gate``.

    Subclasses implement :meth:`logits`. With ``fp32_gate`` the logits are computed in
    float32 with autocast off, whatever the input and parameter dtypes.
    """

    def __init__(self, model_dim: int, num_experts: int, *, k: int = 2, capacity_factor: float = 1.0,
                 gate_noise: float = 0.0, fp32_gate: bool = True) -> None:
        super().__init__()
        self.model_dim = int_arg("model_dim", model_dim, 1)
        self.num_experts = int_arg("num_experts", num_experts, 1)
        self.k = int_arg("k", k, 1, num_experts, f" (num_experts={num_experts})")
        self.capacity_factor = float_arg("capacity_factor", capacity_factor)
        self.gate_noise = float_arg("gate_noise", gate_noise)
        if self.gate_noise < 0:
            raise ValueError(f"gate_noise must be >= 0, got {gate_noise}")
        if not isinstance(fp32_gate, bool):
            raise TypeError(f"fp32_gate must be a bool, got {fp32_gate!r}")
        self.fp32_gate = fp32_gate

    # Tutel spells it top_k
    @property
    def top_k(self) -> int:
        return self.k

    def logits(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2 or x.shape[1] != self.model_dim:
            raise ValueError(f"gate input must be [tokens, model_dim={self.model_dim}], got {tuple(x.shape)}")
        if self.fp32_gate:
            if torch.is_autocast_enabled(x.device.type):  # entering the context costs more than the check
                with torch.autocast(device_type=x.device.type, enabled=False):
                    return self.logits(x.float())
            return self.logits(x.float())
        return self.logits(x)


class LinearTopKGate(TopKGate):
    """``logits = x @ wg.weight.T`` (Tutel's ``'top'`` gate; no bias)."""

    def __init__(self, model_dim: int, num_experts: int, *, k: int = 2, capacity_factor: float = 1.0,
                 gate_noise: float = 0.0, fp32_gate: bool = True, generator: Optional[torch.Generator] = None,
                 dtype: Optional[torch.dtype] = None, device=None) -> None:
        super().__init__(model_dim, num_experts, k=k, capacity_factor=capacity_factor, gate_noise=gate_noise,
                         fp32_gate=fp32_gate)
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        bound = 1.0 / math.sqrt(model_dim)
        with torch.no_grad():
            w = torch.empty(num_experts, model_dim).uniform_(-bound, bound, generator=generator)
            self.wg.weight.copy_(w)
        self.wg.to(device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        w = self.wg.weight
        if self.fp32_gate and x.dim() == 2 and x.shape[1] == self.model_dim and wide_linear_applies(x, w):
            if torch.is_autocast_enabled(x.device.type):
                with torch.autocast(device_type=x.device.type, enabled=False):
                    return wide_linear(x, w)
            return wide_linear(x, w)  # the same float32 logits, without a float32 copy of x
        return super().forward(x)

    def logits(self, x: Tensor) -> Tensor:
        w = self.wg.weight
        if self.fp32_gate:
            w = w.float()
        elif x.dtype != w.dtype:
            x = x.to(w.dtype)
        return F.linear(x, w)


class CosineTopKGate(TopKGate):
    """Cosine router (Tutel's ``'cosine_top'``): ``cos(proj(x), sim[:, e]) * exp(min(t, log 100))``."""

    def __init__(self, model_dim: int, num_experts: int, *, k: int = 2, capacity_factor: float = 1.0,
                 gate_noise: float = 0.0, fp32_gate: bool = True, proj_dim: int = 256, init_t: float = 0.5,
                 generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
                 device=None) -> None:
        super().__init__(model_dim, num_experts, k=k, capacity_factor=capacity_factor, gate_noise=gate_noise,
                         fp32_gate=fp32_gate)
        self.proj_dim = int_arg("proj_dim", proj_dim, 1)
        init_t = float_arg("init_t", init_t)
        if init_t <= 0:
            raise ValueError(f"init_t must be > 0, got {init_t}")
        self.cosine_projector = nn.Linear(model_dim, proj_dim)
        self.sim_matrix = nn.Parameter(torch.empty(proj_dim, num_experts))
        self.temperature = nn.Parameter(torch.log(torch.full([1], 1.0 / init_t)))
        self.clamp_max = math.log(1.0 / 0.01)
        bound = 1.0 / math.sqrt(model_dim)
        with torch.no_grad():
            self.cosine_projector.weight.copy_(torch.empty(proj_dim, model_dim).uniform_(-bound, bound,
                                                                                     generator=generator))
            self.cosine_projector.bias.copy_(torch.empty(proj_dim).uniform_(-bound, bound, generator=generator))
            self.sim_matrix.copy_(torch.empty(proj_dim, num_experts).normal_(0.0, 0.01, generator=generator))
        self.to(device=device, dtype=dtype)

    def logits(self, x: Tensor) -> Tensor:
        w, b, sim, t = self.cosine_projector.weight, self.cosine_projector.bias, self.sim_matrix, self.temperature
        if self.fp32_gate:
            w, b, sim, t = w.float(), b.float(), sim.float(), t.float()
        elif x.dtype != w.dtype:
            x = x.to(w.dtype)
        proj = F.normalize(F.linear(x, w, b), dim=1)
        logits = proj @ F.normalize(sim, dim=0)
        return logits * torch.clamp(t, max=self.clamp_max).exp()


GATE_TYPES = {"top": LinearTopKGate, "linear": LinearTopKGate, "cosine_top": CosineTopKGate,
              "cosine": CosineTopKGate}
"""Gate type names (Tutel's ``'top'`` and ``'cosine_top'``, plus the aliases ``'linear'``, ``'cosine'``)."""


def make_gate(gate_type: str, model_dim: int, num_experts: int, **kwargs) -> TopKGate:
    if not isinstance(gate_type, str):
        raise TypeError(f"gate type must be a str (one of {sorted(GATE_TYPES)}), got {gate_type!r}")
    cls = GATE_TYPES.get(gate_type)
    if cls is None:
        raise ValueError(f"unknown gate type {gate_type!r}; known: {sorted(GATE_TYPES)}")
    return cls(model_dim, num_experts, **kwargs)
