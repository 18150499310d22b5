"""A plain-torch MoE layer on one device, written as torchtitan writes its MoE: the reference
that ``bench.moe_layer --reference`` times beside :class:`moecomm.moe.MoELayer`.

Router: a linear gate (no bias) in float32, softmax, ``torch.topk``, the top-k weights
renormalised. Dispatch: the ``T * k`` routes sorted by expert with ``torch.argsort(stable=True)``
(the permutation), the tokens gathered in that order. Experts: ``torch._grouped_mm`` over the
experts' row offsets where it runs (bf16 on GPUs; float32/bf16 on CPUs whose torch has it),
else one matmul per expert; SwiGLU ``(silu(x W1^T) * (x W3^T)) W2^T`` (torchtitan's
``GroupedExperts``: ``w1, w3 [E, hidden, dim]``, ``w2 [E, dim, hidden]``), GeGLU, or a plain
``act(x W1^T) W2^T``; no biases. Combine: the expert rows times their weights, added into
their tokens with ``index_add_``. Dropless (no capacity); no auxiliary loss.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TorchMoE", "REFERENCE_ACTIVATIONS", "gemm_floor_step"]

# name -> (the activation, gated)
REFERENCE_ACTIVATIONS = {"swiglu": (F.silu, True), "geglu": (F.gelu, True), "relu": (F.relu, False),
                         "gelu": (F.gelu, False), "silu": (F.silu, False)}

_GROUPED_OK: dict = {}


def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs for this device and dtype (tried once)."""
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        ok = hasattr(torch, "_grouped_mm") and (device.type == "cpu" or dtype == torch.bfloat16)
        if ok:
            try:
                a = torch.ones(4, 16, device=device, dtype=dtype)
                w = torch.ones(2, 16, 16, device=device, dtype=dtype)
                torch._grouped_mm(a, w, offs=torch.tensor([2, 4], device=device, dtype=torch.int32))
            except Exception:  # noqa: BLE001 - any failure means "use the loop"
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


class TorchMoE(nn.Module):
    """``forward(x [T, dim]) -> [T, dim]``: top-``k`` of ``num_experts`` experts per token
    (see the module's docstring). ``activation``: a key of :data:`REFERENCE_ACTIVATIONS`.

    Raises:
        ValueError: an unknown ``activation``, or ``k`` outside ``1..num_experts``.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, k: int = 2, activation: str = "swiglu", *,
                 dtype: Optional[torch.dtype] = None, device=None) -> None:
        super().__init__()
        if activation not in REFERENCE_ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is unknown; known: {sorted(REFERENCE_ACTIVATIONS)}")
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k} must be in 1..num_experts={num_experts}")
        self.k, self.num_experts = k, num_experts
        self.act, self.gated = REFERENCE_ACTIVATIONS[activation]
        kw = dict(dtype=dtype, device=device)
        self.router = nn.Linear(dim, num_experts, bias=False, **kw)

        def w(*shape: int, fan_in: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, **kw).uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in)))

        self.w1 = w(num_experts, hidden, dim, fan_in=dim)
        self.w3 = w(num_experts, hidden, dim, fan_in=dim) if self.gated else None
        self.w2 = w(num_experts, dim, hidden, fan_in=hidden)

    def _mm(self, x: Tensor, w: Tensor, offs: Tensor, counts: list) -> Tensor:
        """``x``'s rows of expert ``e`` times ``w[e]^T`` (``w``: ``[E, out, in]``)."""
        if _grouped_mm_runs(x.device, x.dtype):
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        outs, start = [], 0
        for e, n in enumerate(counts):
            outs.append(x[start:start + n] @ w[e].t())
            start += n
        return torch.cat(outs)

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[0]
        scores = F.softmax(self.router(x).float(), dim=-1)
        top_scores, top_idx = torch.topk(scores, self.k, dim=-1)
        top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        flat = top_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the permutation: routes grouped by expert
        token = order // self.k
        counts_t = torch.bincount(flat, minlength=self.num_experts)
        offs = torch.cumsum(counts_t, 0, dtype=torch.int32)
        counts = [] if _grouped_mm_runs(x.device, x.dtype) else counts_t.tolist()
        rows = x.index_select(0, token)
        h = self._mm(rows, self.w1, offs, counts)
        h = self.act(h) * self._mm(rows, self.w3, offs, counts) if self.gated else self.act(h)
        out = self._mm(h, self.w2, offs, counts)
        out = out * top_scores.reshape(-1)[order].unsqueeze(1).to(out.dtype)
        return torch.zeros(T, out.shape[1], dtype=out.dtype, device=out.device).index_add_(0, token, out)

    def gemm_floor_step(self, tokens: int, grad_rows: bool = True) -> Callable[[], None]:
        """One training step of this layer's expert GEMMs alone, at its shapes with ``tokens *
        k`` routes spread evenly over the experts: the forward's grouped GEMMs (x W1^T, x W3^T
        when gated, then W2^T applied to the first's output) and their backward (autograd: the
        input and weight gradients), no router, permutation, activation or combine. What any
        layer built on these GEMMs spends at least (``bench.moe_layer --reference``)."""
        E, dev, dt = self.num_experts, self.w1.device, self.w1.dtype
        rows = tokens * self.k
        counts = [rows // E + (e < rows % E) for e in range(E)]
        offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
        x = torch.randn(rows, self.w1.shape[2], device=dev, dtype=dt, requires_grad=grad_rows)
        gy = torch.randn(rows, self.w2.shape[1], device=dev, dtype=dt)
        gh = torch.randn(rows, self.w1.shape[1], device=dev, dtype=dt)
        params = [q for q in (self.w1, self.w3, self.w2, x) if q is not None and q.requires_grad]

        def step() -> None:
            for q in params:
                q.grad = None
            h = self._mm(x, self.w1, offs, counts)
            outs, grads = [self._mm(h, self.w2, offs, counts)], [gy]
            if self.gated:
                outs.append(self._mm(x, self.w3, offs, counts))
                grads.append(gh)
            torch.autograd.backward(outs, grads)

        return step

    @torch.no_grad()
    def load_from(self, layer: nn.Module) -> "TorchMoE":
        """Copy a one-rank :class:`moecomm.moe.MoELayer`'s gate and expert weights (no biases;
        gated experts for a gated reference) into this layer; returns it."""
        ex = layer.experts
        if ex.fc1_bias is not None or ex.fc2_bias is not None or ex.gated != self.gated:
            raise ValueError("load_from needs a layer without expert biases, gated exactly when this one is")
        self.router.weight.copy_(layer.gates[0].wg.weight)
        w1 = ex.fc1_weight
        if self.gated:
            self.w1.copy_(w1[:, :, 0].transpose(1, 2))
            self.w3.copy_(w1[:, :, 1].transpose(1, 2))
        else:
            self.w1.copy_(w1.transpose(1, 2))
        self.w2.copy_(ex.fc2_weight.transpose(1, 2))
        return self
