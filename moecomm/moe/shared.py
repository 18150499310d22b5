"""Shared experts: a dense feed-forward network that every token goes through beside the routed
experts (DeepSeek, Qwen-MoE; Megatron-core's ``SharedExpertMLP``)."""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._ops.args import int_arg
from .experts import resolve_activation

__all__ = ["SharedExpertFFN", "SharedExpertStep", "GATED_ACTIVATIONS"]

GATED_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"swiglu": F.silu, "geglu": F.gelu, "reglu": F.relu}
"""Gated activations: ``act(x W1) * (x W3)`` with ``act`` SiLU (``swiglu``), GELU (``geglu``)
or ReLU (``reglu``)."""


class SharedExpertFFN(nn.Module):
    """``y = act(x W1^T) W2^T`` or, gated, ``(act(x W1^T) * (x W3^T)) W2^T`` for every token;
    times ``sigmoid(x g^T)`` per token with ``gate=True``. No biases.

    Parameters, in Megatron-core's layout: ``fc1_weight`` ``[2F, model_dim]`` when gated (rows
    ``[:F]`` are ``W1``, the activation's input; ``[F:]`` are ``W3``) else ``[F, model_dim]``;
    ``fc2_weight`` ``[output_dim, F]``; ``gate_weight`` ``[1, model_dim]`` with ``gate=True``.
    Maps ``[N, model_dim]`` to ``[N, output_dim]``.

    Raises:
        TypeError, ValueError: a bad size or activation (named).
    """

    def __init__(self, model_dim: int, hidden_size: int, *, output_dim: Optional[int] = None,
                 activation: Union[str, Callable[[Tensor], Tensor]] = "swiglu", gate: bool = False,
                 generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
                 device=None) -> None:
        super().__init__()
        self.model_dim = int_arg("model_dim", model_dim, 1)
        self.hidden_size = int_arg("shared_expert_size", hidden_size, 1)
        self.output_dim = model_dim if output_dim is None else int_arg("output_dim", output_dim, 1)
        self.gated = isinstance(activation, str) and activation in GATED_ACTIVATIONS
        self.act = GATED_ACTIVATIONS[activation] if self.gated else resolve_activation(activation)
        self.activation_name = (activation if isinstance(activation, str)
                                else getattr(activation, "__name__", "callable"))
        F_ = self.hidden_size
        b1, b2 = 1.0 / math.sqrt(model_dim), 1.0 / math.sqrt(F_)
        w1 = torch.empty((2 * F_ if self.gated else F_), model_dim).uniform_(-b1, b1, generator=generator)
        w2 = torch.empty(self.output_dim, F_).uniform_(-b2, b2, generator=generator)
        kw = dict(dtype=dtype, device=device)
        self.fc1_weight = nn.Parameter(w1.to(**kw))
        self.fc2_weight = nn.Parameter(w2.to(**kw))
        if gate:
            self.gate_weight = nn.Parameter(torch.empty(1, model_dim).uniform_(-b1, b1, generator=generator).to(**kw))
        else:
            self.gate_weight = None

    def forward(self, x: Tensor) -> Tensor:
        w1, w2 = self.fc1_weight, self.fc2_weight
        if x.dtype != w1.dtype and not torch.is_autocast_enabled(x.device.type):
            w1, w2 = w1.to(x.dtype), w2.to(x.dtype)
        h = F.linear(x, w1)
        if self.gated:
            a, b = h.chunk(2, dim=-1)
            h = self.act(a) * b
        else:
            h = self.act(h)
        y = F.linear(h, w2)
        if self.gate_weight is not None:
            g = self.gate_weight if self.gate_weight.dtype == x.dtype else self.gate_weight.to(x.dtype)
            y = y * torch.sigmoid(F.linear(x, g))
        return y

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, hidden_size={self.hidden_size}, output_dim={self.output_dim}, "
                f"activation={self.activation_name}, gate={self.gate_weight is not None}")


class SharedExpertStep:
    """The shared expert's part of :class:`~moecomm.moe.MoELayer`'s step (a mixin: it uses the
    layer's ``shared_experts``). On a GPU the shared FFN runs on a side stream from before the
    dispatch until the combine, so its compute overlaps the exchanges and the routed experts
    (and its backward likewise: autograd runs each node's backward on its forward's stream);
    on the CPU it is computed before the routing, in order."""

    shared_experts: Optional[SharedExpertFFN]

    def _start_shared(self, x2: Tensor) -> tuple:
        """Issue the shared FFN on the ``[T, model_dim]`` tokens: ``(output, its stream or None)``."""
        if not x2.is_cuda or torch.cuda.is_current_stream_capturing():
            return self.shared_experts(x2), None
        main = torch.cuda.current_stream(x2.device)
        side = self.__dict__.get("_shared_stream")
        if side is None or side.device != x2.device:
            side = self.__dict__["_shared_stream"] = torch.cuda.Stream(x2.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            y = self.shared_experts(x2)
        return y, side

    def _add_shared(self, y: Tensor, shared: Optional[tuple]) -> Tensor:
        """``y`` (``[T, output_dim]``, the routed experts' output) plus the shared FFN's."""
        if shared is None:
            return y
        ys, side = shared
        if side is not None:
            main = torch.cuda.current_stream(y.device)
            main.wait_stream(side)
            ys.record_stream(main)
        return y + ys.to(y.dtype)
