"""GEMMs over the expert segments of a :class:`~moecomm.moe._ops.segments.Segments` layout: the
forward product, the weight gradient and the bias gradient, each as batched GEMMs for the
padded (uniform) layout, ``torch._grouped_mm`` where it runs (bf16 on a GPU), else a loop
over the segments; the dropless layout's bias (and ReLU) and bias gradient by the native
per-segment kernels (``moecomm_ext.seg_bias_act``, ``seg_colsum``) from the grouped GEMMs' segment
ends; and :class:`WeightGradSum`, which sums weight gradients over the stages
of one pipelined call inside those GEMMs."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import moecomm_ext
from moecomm_ext import unchecked

from .segments import Segments
from .wide_gemm import wide_gemm_available

__all__ = ["grouped_mm_available", "seg_mm", "seg_wgrad", "seg_sum", "WeightGradSum"]

# An explicit cache: whether torch._grouped_mm ran correctly, per (device index, dtype).
_GROUPED_MM_OK: dict = {}


def _gmm_shapes_ok(*dims: int, esize: int = 2) -> bool:
    for d in dims:
        if d <= 0 or (d * esize) % 16:
            return False
    return True


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here for this dtype: bf16 on a GPU; float32, bf16
    and float16 on the CPU where this torch has the CPU kernel (tried once, then cached)."""
    known = _GROUPED_MM_OK.get((device.type, device.index, dtype))
    if known is not None:  # (the common case: asked before every grouped GEMM)
        return known
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return False
    elif device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    key = (device.type, device.index, dtype)
    ok = _GROUPED_MM_OK.get(key)
    if ok is None:
        try:
            a = torch.randn(32, 16, device=device).to(dtype)
            w = torch.randn(2, 16, 16, device=device).to(dtype)
            offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
            out = torch._grouped_mm(a, w, offs=offs)
            ref = torch.cat([a[:16] @ w[0], a[16:] @ w[1]])
            g = torch._grouped_mm(a.t(), a, offs=offs)
            gref = torch.stack([a[:16].t() @ a[:16], a[16:].t() @ a[16:]])
            ok = bool(torch.allclose(out.float(), ref.float(), atol=1e-1, rtol=5e-2)) and bool(
                torch.allclose(g.float(), gref.float(), atol=1e-1, rtol=5e-2))
        except Exception:  # noqa: BLE001 - any failure means "use the loop"
            ok = False
        _GROUPED_MM_OK[key] = ok
    return ok


def _grouped(t: Tensor, *dims: int) -> bool:
    return grouped_mm_available(t.device, t.dtype) and _gmm_shapes_ok(*dims, esize=t.element_size())


def _block_views(t: Tensor, seg: Segments) -> list[Tensor]:
    if seg.num_blocks == 1 and t.shape[0] == seg.rows:  # (one rank: the whole tensor)
        return [t]
    out, start = [], 0
    for n in seg.block_rows():
        out.append(t[start:start + n])
        start += n
    return out


def _offsets(seg: Segments, b: Optional[int], device: torch.device) -> Tensor:
    """int32 ends of block ``b``'s expert segments (of all blocks' segments, in row order,
    for ``b=None``), on ``device`` without a host sync (kept on ``seg`` for its next GEMM)."""
    if b is None and seg.num_blocks == 1:  # the same ends: one cumsum serves both
        b = 0
    key = (b, device)
    t = seg.offsets_cache.get(key)
    if t is None:
        t = seg.offsets_cache[key] = _make_offsets(seg, b, device)
    return t


def _make_offsets(seg: Segments, b: Optional[int], device: torch.device) -> Tensor:
    if seg.counts_dev is not None:
        return torch.cumsum(seg.counts_dev[b] if b is not None else seg.counts_dev.reshape(-1), 0,
                            dtype=torch.int32)
    ends, acc = [], 0
    counts = seg.host_counts()
    for n in (counts[b] if b is not None else [n for block in counts for n in block]):
        acc += n
        ends.append(acc)
    t = torch.tensor(ends, dtype=torch.int32)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _seg_bias_ops(out: Tensor, bias: Tensor, bias_scale: float):
    """The native per-segment bias (``moecomm_ext.seg_bias_act``) where it gives the bits of
    a gather of the bias rows and an add: the bias unscaled and of the rows' dtype; else None."""
    if bias_scale != 1.0 or bias.dtype != out.dtype or not out.is_contiguous():
        return None
    return unchecked.seg_ops(out.device, None)


def seg_mm(x: Tensor, w: Tensor, seg: Segments, bias: Optional[Tensor] = None, bias_scale: float = 1.0,
           transpose_w: bool = False, relu: bool = False) -> Tensor:
    """``out[rows of expert e] = x[rows] @ w[e] (+ bias[e] * bias_scale)``, then ReLU where
    ``relu`` (in place); ``w``: ``[El, A, B]`` (``[El, B, A]`` used transposed with ``transpose_w``)."""
    wt = w.transpose(1, 2) if transpose_w else w
    R = x.shape[0]
    B = wt.shape[2]
    if seg.uniform is not None:
        C, El = seg.uniform, seg.num_local
        if C == 0:
            return torch.empty(R, B, dtype=x.dtype, device=x.device)
        xb = x.view(-1, El, C, x.shape[1])
        if bias is not None and bias_scale == 1.0:
            # every row starts as its expert's bias (one vectorised row gather: baddbmm would
            # broadcast it with a slow strided copy per block), then each block adds its GEMM in place
            out = moecomm_ext.gather_rows(bias, seg.row_expert(x.device), check=False)
            ob = out.view(-1, El, C, B)
            for b in range(xb.shape[0]):
                ob[b].baddbmm_(xb[b], wt)
            return out.relu_() if relu else out
        out = torch.empty(R, B, dtype=x.dtype, device=x.device)
        ob = out.view(-1, El, C, B)
        for b in range(xb.shape[0]):
            if bias is not None:
                torch.baddbmm(bias.unsqueeze(1) * bias_scale if bias_scale != 1.0 else bias.unsqueeze(1),
                              xb[b], wt, out=ob[b])
            else:
                torch.bmm(xb[b], wt, out=ob[b])
        return out.relu_() if relu else out
    if _grouped(x, wt.shape[1], B):
        outs = []
        for b, xb in enumerate(_block_views(x, seg)):
            if xb.shape[0]:
                outs.append(torch._grouped_mm(xb, wt, offs=_offsets(seg, b, x.device)))
        out = x.new_empty(0, B) if not outs else (outs[0] if len(outs) == 1 else torch.cat(outs))
        if bias is not None:
            ops = _seg_bias_ops(out, bias, bias_scale)
            if ops is not None:  # the bias (and ReLU) in one pass, from the GEMMs' own segment ends
                return ops.seg_bias_act(out, bias.contiguous(), _offsets(seg, None, x.device), relu)
            rows_bias = bias.index_select(0, seg.row_expert(x.device))
            out += rows_bias if bias_scale == 1.0 else rows_bias * bias_scale
        return out.relu_() if relu else out
    out = torch.empty(R, B, dtype=x.dtype, device=x.device)
    for e, s, n in seg.items():
        if bias is not None:
            torch.addmm(bias[e], x[s:s + n], wt[e], beta=bias_scale, out=out[s:s + n])
        else:
            torch.mm(x[s:s + n], wt[e], out=out[s:s + n])
    return out.relu_() if relu else out


def seg_wgrad(a: Tensor, g: Tensor, seg: Segments, acc: Optional[Tensor] = None) -> Tensor:
    """``out[e] = sum over segments of e of a[rows].T @ g[rows]``: ``[El, A, B]``; added into
    ``acc`` (returned) when given."""
    El, A, B = seg.num_local, a.shape[1], g.shape[1]
    if seg.uniform is not None:
        C = seg.uniform
        if C == 0 or a.shape[0] == 0:
            return acc if acc is not None else torch.zeros(El, A, B, dtype=a.dtype, device=a.device)
        ab = a.view(-1, El, C, A)
        gb = g.view(-1, El, C, B)
        out = acc if acc is not None else torch.bmm(ab[0].transpose(1, 2), gb[0])
        for b in range(0 if acc is not None else 1, ab.shape[0]):
            out.baddbmm_(ab[b].transpose(1, 2), gb[b])
        return out
    if _grouped(a, A, B):
        out = acc
        av, gv = _block_views(a, seg), _block_views(g, seg)
        for b in range(len(av)):
            if av[b].shape[0] == 0:
                continue
            part = torch._grouped_mm(av[b].t(), gv[b], offs=_offsets(seg, b, a.device))
            out = part if out is None else out.add_(part)
        return out if out is not None else torch.zeros(El, A, B, dtype=a.dtype, device=a.device)
    out = acc if acc is not None else torch.zeros(El, A, B, dtype=a.dtype, device=a.device)
    for e, s, n in seg.items():
        out[e].addmm_(a[s:s + n].t(), g[s:s + n])
    return out


class WeightGradSum:
    """The built-in experts' weight gradients over the stages of one pipelined call.

    Each stage of ``scatter_compute_gather`` runs the experts on its own rows, so autograd
    would receive one gradient per weight and stage and add them up: one more pass over
    every weight gradient per extra stage (each weight read twice and written once; its
    cost is in ``bench/results/README.md``). Stages whose :class:`Segments` share one ``WeightGradSum`` instead
    accumulate their weight gradients into one tensor per weight inside the GEMMs, and only
    the stage whose backward runs last hands the sums to autograd (the others hand none).
    On a GPU a stage whose backward runs on another stream than the stage before it waits
    for that stage's accumulation first.
    """

    def __init__(self) -> None:
        self._calls = 0
        self._left = 0
        self._acc: dict[str, Tensor] = {}
        self._event: Optional[torch.cuda.Event] = None

    def join(self) -> None:
        """A stage's forward: one more backward to wait for."""
        self._calls += 1
        self._left = self._calls

    def add(self, key: str, a: Tensor, g: Tensor, seg: Segments) -> Tensor:
        """``seg_wgrad(a, g, seg)`` added into the sum kept under ``key``."""
        acc = self._acc.get(key)
        if acc is not None and acc.is_cuda:
            stream = torch.cuda.current_stream(acc.device)
            if self._event is not None:
                stream.wait_event(self._event)
            acc.record_stream(stream)
        out = self._acc[key] = seg_wgrad(a, g, seg, acc)
        return out

    def finish(self) -> bool:
        """A stage's backward is done: True for the last one, which returns the sums (and the
        sums are forgotten here, so that a retained graph's next backward starts afresh)."""
        self._left -= 1
        if self._left > 0:
            if self._acc:
                acc = next(iter(self._acc.values()))
                if acc.is_cuda:
                    self._event = torch.cuda.Event()
                    self._event.record(torch.cuda.current_stream(acc.device))
            return False
        self._left = self._calls
        self._acc = {}
        self._event = None
        return True


def seg_sum(g: Tensor, seg: Segments) -> Tensor:
    """``out[e] = sum of g's rows of expert e``: ``[El, B]`` (accumulated in float32 at least)."""
    El, B = seg.num_local, g.shape[1]
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    if seg.uniform is not None:
        C = seg.uniform
        if C == 0 or g.shape[0] == 0:
            return torch.zeros(El, B, dtype=g.dtype, device=g.device)
        if g.dtype == torch.bfloat16 and wide_gemm_available(g.device):
            # each block's column sums as a GEMM with a row of ones (float32 sums): reads g once
            # at the memory's speed, where the strided reduction over two dims does not
            blocks = g.view(-1, C, B)
            nb = blocks.shape[0]
            ones = seg.consts.ones(nb * C, g.dtype, g.device) if seg.consts is not None else \
                torch.ones(nb * C, dtype=g.dtype, device=g.device)
            sums = torch.bmm(ones.view(nb, 1, C), blocks, out_dtype=acc)
            return (sums.view(El, B) if nb == El else sums.view(-1, El, B).sum(0)).to(g.dtype)
        return g.view(-1, El, C, B).sum(dim=(0, 2), dtype=acc).to(g.dtype)
    if g.shape[0] == 0:
        return torch.zeros(El, B, dtype=g.dtype, device=g.device)
    ops = unchecked.seg_ops(g.device, None)
    if ops is not None:  # one native pass from the segment ends (no host sync, deterministic)
        return ops.seg_colsum(g.contiguous(), _offsets(seg, None, g.device), El)
    width = max(1, 16 // g.element_size())  # a ones block as wide as the GEMM's alignment asks
    if _grouped(g, width, B):
        # one grouped GEMM over every (block, expert) segment: ones[width, rows] @ g, as
        # seg_wgrad's, so no host sync (torch.segment_reduce synchronises) and no atomics
        n = g.shape[0] * width
        ones = (seg.consts.ones(n, g.dtype, g.device) if seg.consts is not None else
                torch.ones(n, dtype=g.dtype, device=g.device)).view(g.shape[0], width)
        sums = torch._grouped_mm(ones.t(), g, offs=_offsets(seg, None, g.device))[:, 0]  # [blocks * El, B]
        if seg.num_blocks == 1:
            return sums
        return sums.view(-1, El, B).sum(0, dtype=acc).to(g.dtype)
    if g.is_cuda:  # no grouped GEMM for this dtype: one reduction per segment (host counts, no sync)
        out = torch.zeros(El, B, dtype=acc, device=g.device)
        for e, s, n in seg.items():
            out[e] += g[s:s + n].sum(0, dtype=acc)
        return out.to(g.dtype)
    # the CPU's index_add_ is sequential (deterministic): each expert's rows added in row order
    out = torch.zeros(El, B, dtype=acc, device=g.device)
    return out.index_add_(0, seg.row_expert(g.device), g.to(acc)).to(g.dtype)
