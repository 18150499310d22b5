"""The MoE layer's decode path (``MoELayer(..., decode_tokens=N)``): a ``torch.no_grad()``
call with at most ``N`` tokens per rank routes as usual, then moves its tokens through a
:class:`moecomm.LowLatencyBuffer` (preallocated, no host synchronisation, capturable) and runs
the experts on the buffer's expert-major rows (``[local_experts, W * N, model_dim]``, padded:
the experts compute on every row, the combine reads the used ones).

Every route is kept (dropless), so a layer whose normal path drops tokens (a capacity too
small) gives other results. Ranks must agree on taking the path: with
``inequivalent_tokens=True`` (default) the largest token count of any rank decides (the
layer's one-integer ``allreduce``, taken from the warm-up while a CUDA graph is captured);
with ``False`` each rank's own count does, and the caller promises the ranks agree.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from moecomm import quant
from moecomm.low_latency import LowLatencyBuffer

from .._ops.segments import Segments

__all__ = ["DecodePath"]


class DecodePath:
    """The decode path of :class:`~moecomm.moe.MoELayer` (a mixin: it uses the layer's ``comm``,
    expert layout, routing step, ``_run_experts`` and constants)."""

    comm: Any
    shards: int
    num_experts: int
    model_dim: int
    output_dim: int
    k: int
    is_postscore: bool
    _decode: Optional[LowLatencyBuffer]

    def _make_decode_buffer(self, decode_tokens: Optional[int], wire: Optional[torch.dtype],
                            dtype: Optional[torch.dtype]) -> Optional[LowLatencyBuffer]:
        """The layer's buffer for ``decode_tokens`` tokens per rank, or None (the option off).

        Raises:
            ValueError: the experts are sharded over ranks (fewer experts than ranks).
        """
        if decode_tokens is None:
            return None
        if self.shards > 1:
            raise ValueError(f"decode_tokens={decode_tokens} needs num_experts={self.num_experts} to be a multiple "
                             f"of the world size {self.comm.size} (experts sharded over ranks are not supported)")
        fp8 = wire if wire is not None and self.comm.size > 1 else False  # one rank: nothing is quantized
        return LowLatencyBuffer(self.comm, decode_tokens, self.model_dim, self.num_experts, self.k,
                                dtype if dtype is not None else torch.get_default_dtype(), fp8_dispatch=fp8,
                                combine_hidden=self.output_dim)

    def _decode_forward(self, x: Tensor, gate: Any, k: int, mode: str, ineq: bool,
                        wire: Optional[torch.dtype]) -> Optional[Tensor]:
        """``[..., output_dim]`` through the layer's buffer, or None when the call does not qualify
        (autograd on, autocast, another ``k``, dtype or ``wire_dtype`` than the buffer's, not
        expert-parallel, prescore gates, or more than ``decode_tokens`` tokens on some rank)."""
        buf: LowLatencyBuffer = self._decode
        d = self.__dict__  # plain attributes: skip nn.Module.__setattr__
        d["last_decode"] = False
        x2 = x.reshape(-1, self.model_dim)
        if torch.is_grad_enabled() or mode != "expert" or k != buf.k or x2.dtype != buf.dtype \
                or not self.is_postscore or torch.is_autocast_enabled(x2.device.type) \
                or (wire if self.comm.size > 1 else None) != buf.fp8_dtype:
            return None
        T = x2.shape[0]
        if (self._agreed_tokens(T, x2.device) if ineq else T) > buf.max_tokens_per_rank:
            return None
        r = self._route(x2, gate, k)
        out = buf.dispatch(x2.contiguous(), r.topk_idx)
        L, R, H = buf.local_experts, buf.max_rows, buf.hidden
        rows = out.x.reshape(L * R, H)
        if out.scales is not None:
            rows = quant.dequantize_rows(rows, out.scales.reshape(L * R, -1), buf.dtype)
        y_rows = self._run_experts(rows, Segments.uniform_blocks(1, L, R, consts=self._consts))
        y = buf.combine(y_rows.reshape(L, R, buf.combine_hidden).contiguous(), r.gates, out.handle)
        d["_last_route"], d["_last_routing"], d["last_parallel_mode"], d["last_decode"] = r, None, "expert", True
        return y.clone().reshape(*x.shape[:-1], buf.combine_hidden)
