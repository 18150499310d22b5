"""Experts: the built-in feed-forward experts (a grouped GEMM over variable row counts) and
adapters for user modules.

The rows an expert rank receives are *blocks* (one per source rank, or one in data-parallel
mode), each holding the local experts' rows one expert after the other:
:class:`Segments` describes that layout, so the experts run straight on the received buffer
without reordering it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import moecomm_ext

from ._wide_gemm import wide_gemm_available

__all__ = ["Segments", "WeightGradSum", "FFNExperts", "ACTIVATIONS", "resolve_activation", "BatchedExperts",
           "ExpertList", "grouped_mm_available"]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "identity": lambda x: x,
}


def resolve_activation(act: Union[str, Callable[[Tensor], Tensor], None]) -> Callable[[Tensor], Tensor]:
    if act is None:
        return F.relu
    if isinstance(act, str):
        fn = ACTIVATIONS.get(act)
        if fn is None:
            raise ValueError(f"activation {act!r} is unknown; known: {sorted(ACTIVATIONS)} (or pass a callable)")
        return fn
    if callable(act):
        return act
    raise TypeError(f"activation must be a name ({sorted(ACTIVATIONS)}) or a callable, got {act!r}")


@dataclass
class Segments:
    """Row layout of an expert input: ``len(counts)`` blocks, block ``b`` holding
    ``counts[b][e]`` rows of local expert ``e`` for ``e = 0..num_local-1``, in that order."""

    counts: list[list[int]]
    num_local: int
    uniform: Optional[int] = None
    """Every count equals this (the padded capacity layout)."""
    counts_dev: Optional[Tensor] = None
    """The counts as an int64 ``[blocks, num_local]`` tensor on the rows' device, if at hand."""
    wgrad_sum: Optional["WeightGradSum"] = field(default=None, compare=False)
    """Shared by the stages of one pipelined call: see :class:`WeightGradSum`."""
    rows: int = field(init=False)
    _row_expert: Optional[Tensor] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.rows = sum(sum(b) for b in self.counts)

    @classmethod
    def uniform_blocks(cls, blocks: int, num_local: int, capacity: int,
                       wgrad_sum: Optional["WeightGradSum"] = None) -> "Segments":
        return cls([[capacity] * num_local for _ in range(blocks)], num_local, uniform=capacity,
                   wgrad_sum=wgrad_sum)

    def block_rows(self) -> list[int]:
        return [sum(b) for b in self.counts]

    def items(self):
        """``(expert, first_row, rows)`` of every non-empty segment, in row order."""
        start = 0
        for block in self.counts:
            for e, n in enumerate(block):
                if n:
                    yield e, start, n
                start += n

    def per_expert(self) -> list[int]:
        return [sum(b[e] for b in self.counts) for e in range(self.num_local)]

    def row_expert(self, device: torch.device) -> Tensor:
        """``[rows]`` int64 local expert of every row (on ``device``, no host sync; kept for
        the next call on the same device)."""
        cached = self._row_expert
        if cached is None or cached.device != device:
            cached = self._row_expert = self._make_row_expert(device)
        return cached

    def _make_row_expert(self, device: torch.device) -> Tensor:
        if self.uniform is not None:  # built on the device: no host copy (safe in CUDA graph capture)
            ids = torch.arange(self.num_local, device=device).repeat_interleave(self.uniform)
            return ids.repeat(len(self.counts))
        if self.counts_dev is not None:
            ids = torch.arange(self.num_local, device=device).repeat(self.counts_dev.shape[0])
            return torch.repeat_interleave(ids, self.counts_dev.reshape(-1), output_size=self.rows)
        counts = torch.tensor(self.counts, dtype=torch.int64).reshape(-1)
        ids = torch.arange(self.num_local, dtype=torch.int64).repeat(len(self.counts))
        flat = torch.repeat_interleave(ids, counts, output_size=self.rows)
        return flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat


# -- grouped GEMM over segments -------------------------------------------------------------

_GROUPED_MM_OK: dict = {}


def _gmm_shapes_ok(*dims: int, esize: int = 2) -> bool:
    return all(d > 0 and (d * esize) % 16 == 0 for d in dims)


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here for this dtype (bf16 only; tried once, then cached)."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16:
        return False
    key = (device.index, dtype)
    ok = _GROUPED_MM_OK.get(key)
    if ok is None:
        try:
            a = torch.randn(32, 16, device=device, dtype=dtype)
            w = torch.randn(2, 16, 16, device=device, dtype=dtype)
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


def _block_views(t: Tensor, seg: Segments) -> list[Tensor]:
    out, start = [], 0
    for n in seg.block_rows():
        out.append(t[start:start + n])
        start += n
    return out


def _offsets(seg: Segments, b: int, device: torch.device) -> Tensor:
    if seg.counts_dev is not None:
        return torch.cumsum(seg.counts_dev[b], 0).to(torch.int32)
    ends, acc = [], 0
    for n in seg.counts[b]:
        acc += n
        ends.append(acc)
    t = torch.tensor(ends, dtype=torch.int32)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def seg_mm(x: Tensor, w: Tensor, seg: Segments, bias: Optional[Tensor] = None, bias_scale: float = 1.0,
           transpose_w: bool = False) -> Tensor:
    """``out[rows of expert e] = x[rows] @ w[e] (+ bias[e] * bias_scale)``; ``w``: ``[El, A, B]``
    (``[El, B, A]`` used transposed with ``transpose_w``)."""
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
            return out
        out = torch.empty(R, B, dtype=x.dtype, device=x.device)
        ob = out.view(-1, El, C, B)
        for b in range(xb.shape[0]):
            if bias is not None:
                torch.baddbmm(bias.unsqueeze(1) * bias_scale if bias_scale != 1.0 else bias.unsqueeze(1),
                              xb[b], wt, out=ob[b])
            else:
                torch.bmm(xb[b], wt, out=ob[b])
        return out
    if x.is_cuda and grouped_mm_available(x.device, x.dtype) and _gmm_shapes_ok(wt.shape[1], B):
        outs = []
        for b, xb in enumerate(_block_views(x, seg)):
            if xb.shape[0]:
                outs.append(torch._grouped_mm(xb, wt, offs=_offsets(seg, b, x.device)))
        out = torch.cat(outs) if len(outs) != 1 else outs[0]
        if not outs:
            out = x.new_empty(0, B)
        if bias is not None:
            out += bias.index_select(0, seg.row_expert(x.device)) * bias_scale
        return out
    out = torch.empty(R, B, dtype=x.dtype, device=x.device)
    for e, s, n in seg.items():
        if bias is not None:
            torch.addmm(bias[e], x[s:s + n], wt[e], beta=bias_scale, out=out[s:s + n])
        else:
            torch.mm(x[s:s + n], wt[e], out=out[s:s + n])
    return out


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
    if a.is_cuda and grouped_mm_available(a.device, a.dtype) and _gmm_shapes_ok(A, B):
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
            ones = torch.ones(blocks.shape[0], 1, C, dtype=g.dtype, device=g.device)
            return torch.bmm(ones, blocks, out_dtype=acc).view(-1, El, B).sum(0).to(g.dtype)
        return g.view(-1, El, C, B).sum(dim=(0, 2), dtype=acc).to(g.dtype)
    if g.is_cuda:
        lengths = seg.counts_dev.reshape(-1) if seg.counts_dev is not None else \
            torch.tensor(seg.counts, dtype=torch.int64).reshape(-1).pin_memory().to(g.device, non_blocking=True)
        try:
            sums = torch.segment_reduce(g, "sum", lengths=lengths, axis=0)  # [blocks * El, B]
            return sums.view(-1, El, B).sum(0, dtype=acc).to(g.dtype)
        except (RuntimeError, NotImplementedError):
            out = torch.zeros(El, B, dtype=acc, device=g.device)
            out.index_add_(0, seg.row_expert(g.device), g.to(acc))
            return out.to(g.dtype)
    out = torch.zeros(El, B, dtype=acc, device=g.device)
    for e, s, n in seg.items():
        out[e] += g[s:s + n].sum(0, dtype=acc)
    return out.to(g.dtype)


class _GroupedFFN(torch.autograd.Function):
    """``y = act(x @ w1[e] + b1[e]) @ w2[e] + b2[e] * b2_scale`` per segment, with a
    hand-written backward (the activation is recomputed from the saved pre-activation).

    ``b2``'s gradient is *not* multiplied by ``b2_scale``: with an expert sharded over S
    ranks each shard adds ``b2 / S`` and every shard's copy gets the full gradient, so the
    copies stay equal and the layer equals the unsharded expert exactly.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, seg, act, b2_scale):  # type: ignore[override]
        h = seg_mm(x, w1, seg, b1)
        # ReLU's gradient needs only its output: keep that (in place of h), nothing to recompute
        relu = act is F.relu
        a = h.relu_() if relu else act(h)
        y = seg_mm(a, w2, seg, b2, b2_scale)
        if seg.wgrad_sum is not None:
            seg.wgrad_sum.join()
        ctx.seg, ctx.act, ctx.relu = seg, act, relu
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        ctx.save_for_backward(x, a if relu else h, w1, w2)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):  # type: ignore[override]
        x, h, w1, w2 = ctx.saved_tensors
        seg = ctx.seg
        gy = gy.contiguous()
        if ctx.relu:
            a = h  # the saved ReLU output
        else:
            with torch.enable_grad():
                hh = h.detach().requires_grad_(True)
                a = ctx.act(hh)
        need = ctx.needs_input_grad
        share = seg.wgrad_sum

        def wgrad(key: str, rows: Tensor, grad: Tensor) -> Tensor:
            return seg_wgrad(rows, grad, seg) if share is None else share.add(key, rows, grad, seg)

        gw2 = wgrad("w2", a.detach(), gy) if need[3] else None
        gb2 = seg_sum(gy, seg) if ctx.has_b2 and need[4] else None
        ga = seg_mm(gy, w2, seg, transpose_w=True)
        if ctx.relu:
            gh = torch.ops.aten.threshold_backward(ga, a, 0)
        else:
            (gh,) = torch.autograd.grad(a, hh, ga)
            del hh
        del a, ga
        gw1 = wgrad("w1", x, gh) if need[1] else None
        gb1 = seg_sum(gh, seg) if ctx.has_b1 and need[2] else None
        gx = seg_mm(gh, w1, seg, transpose_w=True) if need[0] else None
        if share is not None and not share.finish():
            gw1 = gw2 = None  # the stage whose backward runs last returns the sums
        return gx, gw1, gb1, gw2, gb2, None, None, None


def _uniform_init(shape: Sequence[int], fan_in: int, generator: torch.Generator) -> Tensor:
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(*shape).uniform_(-bound, bound, generator=generator)


class FFNExperts(nn.Module):
    """``num_local`` feed-forward experts ``fc2(act(fc1(x)))``, or shard ``shard_index`` of
    ``shards`` of one expert along its hidden dimension.

    Parameters (``El`` local experts, ``Hl = hidden_size / shards``):
    ``fc1_weight [El, model_dim, Hl]``, ``fc1_bias [El, Hl]``, ``fc2_weight [El, Hl, output_dim]``,
    ``fc2_bias [El, output_dim]`` (a copy on every shard, added once overall).

    Weights are initialised per *global* expert from ``seed + expert_index`` (uniform in
    ``+-1/sqrt(fan_in)``), so they do not depend on the number of ranks.
    """

    def __init__(self, model_dim: int, hidden_size: int, num_local: int, *, output_dim: Optional[int] = None,
                 activation: Union[str, Callable, None] = "relu", fc1_bias: bool = True, fc2_bias: bool = True,
                 shards: int = 1, shard_index: int = 0, first_expert: int = 0, seed: int = 0,
                 dtype: Optional[torch.dtype] = None, device=None) -> None:
        super().__init__()
        if hidden_size % shards:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by the {shards} shards of each expert")
        self.model_dim, self.hidden_size, self.num_local = model_dim, hidden_size, num_local
        self.output_dim = model_dim if output_dim is None else output_dim
        self.shards, self.shard_index, self.first_expert = shards, shard_index, first_expert
        self.activation = activation
        self.act = resolve_activation(activation)
        Hl = hidden_size // shards
        h0, h1 = shard_index * Hl, (shard_index + 1) * Hl
        w1, b1, w2, b2 = [], [], [], []
        for i in range(num_local):
            g = torch.Generator().manual_seed((seed * 1_000_003 + first_expert + i) % (2 ** 63))
            full_w1 = _uniform_init((model_dim, hidden_size), model_dim, g)
            full_b1 = _uniform_init((hidden_size,), model_dim, g)
            full_w2 = _uniform_init((hidden_size, self.output_dim), hidden_size, g)
            full_b2 = _uniform_init((self.output_dim,), hidden_size, g)
            w1.append(full_w1[:, h0:h1])
            b1.append(full_b1[h0:h1])
            w2.append(full_w2[h0:h1])
            b2.append(full_b2)
        kw = dict(dtype=dtype, device=device)
        self.fc1_weight = nn.Parameter(torch.stack(w1).to(**kw).contiguous())
        self.fc1_bias = nn.Parameter(torch.stack(b1).to(**kw).contiguous()) if fc1_bias else None
        self.fc2_weight = nn.Parameter(torch.stack(w2).to(**kw).contiguous())
        self.fc2_bias = nn.Parameter(torch.stack(b2).to(**kw).contiguous()) if fc2_bias else None

    # checkpoint layout: (expert axis, shard axis or None, replicated over shards)
    def checkpoint_spec(self) -> dict:
        spec = {"fc1_weight": (0, 2, False), "fc2_weight": (0, 1, False)}
        if self.fc1_bias is not None:
            spec["fc1_bias"] = (0, 1, False)
        if self.fc2_bias is not None:
            spec["fc2_bias"] = (0, None, True)
        return spec

    def params(self, dtype: torch.dtype) -> tuple:
        """The parameters cast to ``dtype`` (differentiable casts; no copies when equal)."""
        def cast(p):
            return None if p is None else (p if p.dtype == dtype else p.to(dtype))
        return cast(self.fc1_weight), cast(self.fc1_bias), cast(self.fc2_weight), cast(self.fc2_bias)

    @staticmethod
    def run(x: Tensor, seg: Segments, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
            act: Callable, b2_scale: float = 1.0) -> Tensor:
        return _GroupedFFN.apply(x, w1, b1, w2, b2, seg, act, b2_scale)

    def forward(self, x: Tensor, seg: Segments) -> Tensor:
        w1, b1, w2, b2 = self.params(x.dtype)
        return self.run(x, seg, w1, b1, w2, b2, self.act, 1.0 / self.shards)

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, hidden_size={self.hidden_size}, num_local={self.num_local}, "
                f"output_dim={self.output_dim}, shards={self.shards}, shard_index={self.shard_index}, "
                f"fc1_bias={self.fc1_bias is not None}, fc2_bias={self.fc2_bias is not None}")


class BatchedExperts(nn.Module):
    """Adapter for a user module in Tutel's custom-expert convention: ``module(x)`` maps
    ``[num_local, N, model_dim]`` to ``[num_local, N, output_dim]``. Variable row counts
    are padded to the largest local count (dropless mode)."""

    def __init__(self, module: nn.Module, num_local: int) -> None:
        super().__init__()
        self.module = module
        self.num_local = num_local

    def forward(self, x: Tensor, seg: Segments) -> Tensor:
        El, D = seg.num_local, x.shape[1]
        if seg.uniform is not None:
            C = seg.uniform
            nb = len(seg.counts)
            xb = x.view(nb, El, C, D).transpose(0, 1).reshape(El, nb * C, D)
            y = self.module(xb)
            self._check(y, El, nb * C)
            return y.reshape(El, nb, C, y.shape[-1]).transpose(0, 1).reshape(nb * El * C, y.shape[-1])
        per = seg.per_expert()
        width = max(per) if per else 0
        # padded position of every row: expert e's rows fill [e, 0..per[e])
        index = torch.full((El * width,), x.shape[0], dtype=torch.int64)
        back = torch.empty(x.shape[0], dtype=torch.int64)
        fill = [0] * El
        for e, s, n in seg.items():
            dst = e * width + fill[e]
            index[dst:dst + n] = torch.arange(s, s + n)
            back[s:s + n] = torch.arange(dst, dst + n)
            fill[e] += n
        index, back = index.to(x.device), back.to(x.device)
        xp = torch.cat([x, x.new_zeros(1, D)]).index_select(0, index).view(El, width, D)
        y = self.module(xp)
        self._check(y, El, width)
        return y.reshape(El * width, y.shape[-1]).index_select(0, back)

    @staticmethod
    def _check(y, El, n) -> None:
        if not isinstance(y, Tensor) or y.dim() != 3 or y.shape[0] != El or y.shape[1] != n:
            got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"custom experts module must return [num_local={El}, {n}, output_dim], got {got}")


class ExpertList(nn.Module):
    """Adapter for one user module per expert, each mapping ``[n, model_dim]`` to ``[n, output_dim]``."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.local = nn.ModuleList(modules)
        self.num_local = len(self.local)

    def forward(self, x: Tensor, seg: Segments) -> Tensor:
        outs = []
        for e, s, n in seg.items():
            y = self.local[e](x[s:s + n])
            if not isinstance(y, Tensor) or y.dim() != 2 or y.shape[0] != n:
                got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
                raise ValueError(f"expert module {e} must map [n, model_dim] to [n, output_dim]; got {got}")
            outs.append(y)
        if not outs:
            probe = self.local[0](x[:0]) if self.num_local else x[:0]
            return probe
        return torch.cat(outs) if len(outs) > 1 else outs[0]
