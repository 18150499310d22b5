"""Experts: the built-in feed-forward experts (a grouped GEMM over variable row counts,
:mod:`moecomm.moe._ops.seg_gemm`) and adapters for user modules.

Every expert container maps the rows an expert rank received, laid out as
:class:`Segments` describe (:mod:`moecomm.moe._ops.segments`), to one output row each, in the
same order.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import moecomm_ext
from moecomm_ext import unchecked

from ._ops.activation_forms import known_form
from ._ops.seg_gemm import WeightGradSum, grouped_mm_available, seg_mm, seg_sum, seg_wgrad
from ._ops.segments import Segments

__all__ = ["Segments", "WeightGradSum", "FFNExperts", "ffn_forward", "ffn_backward", "ACTIVATIONS",
           "GatedActivation", "is_gated", "resolve_activation", "BatchedExperts", "ExpertList",
           "grouped_mm_available", "seg_mm",
           "seg_wgrad", "seg_sum"]


class GatedActivation:
    """A gated linear unit's activation: ``fn(h[:, :H]) * h[:, H:]`` of a pre-activation
    ``h`` of ``[N, 2H]`` (the gate's projection ``x W1`` first, then the linear one ``x W3``:
    Megatron-core's ``gated_linear_unit`` order). ``fn`` any callable (SiLU: SwiGLU).

    Experts built with one (``activation="swiglu"``, ``"geglu"``, ``"reglu"``, or an instance)
    hold ``fc1_weight [El, model_dim, 2, H]``: ``fc1_weight[e].view(model_dim, 2 * H)`` is
    ``[W1 | W3]``, so both projections are one GEMM.
    """

    __slots__ = ("name", "fn")

    def __init__(self, fn: Callable[[Tensor], Tensor], name: Optional[str] = None) -> None:
        if not callable(fn):
            raise TypeError(f"GatedActivation: fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "gated")

    def __call__(self, h: Tensor) -> Tensor:
        H = h.shape[-1] // 2
        return self.fn(h[..., :H]) * h[..., H:]

    def __repr__(self) -> str:
        return f"GatedActivation({self.name})"


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def _identity(x: Tensor) -> Tensor:
    return x


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": F.silu,
    "swish": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "identity": _identity,
    # gated linear units (fc1 twice as wide, biases off by default)
    "swiglu": GatedActivation(F.silu, "swiglu"),
    "geglu": GatedActivation(F.gelu, "geglu"),
    "geglu_tanh": GatedActivation(_gelu_tanh, "geglu_tanh"),
    "reglu": GatedActivation(F.relu, "reglu"),
}

# d act(h) / dh applied to a gradient, from the pre-activation (one kernel instead of autograd)
_BACKWARD: dict[Callable, Callable[[Tensor, Tensor], Tensor]] = {
    F.relu: lambda g, h: torch.ops.aten.threshold_backward(g, h, 0),
    F.silu: torch.ops.aten.silu_backward,
    F.gelu: lambda g, h: torch.ops.aten.gelu_backward(g, h, approximate="none"),
    _gelu_tanh: lambda g, h: torch.ops.aten.gelu_backward(g, h, approximate="tanh"),
    torch.sigmoid: lambda g, h: torch.ops.aten.sigmoid_backward(g, torch.sigmoid(h)),
    torch.tanh: lambda g, h: torch.ops.aten.tanh_backward(g, torch.tanh(h)),
    _identity: lambda g, h: g,
}


def resolve_activation(act: Union[str, Callable[[Tensor], Tensor], None]) -> Callable[[Tensor], Tensor]:
    """The activation function ``act`` names (a key of :data:`ACTIVATIONS`; the gated ones
    are :class:`GatedActivation`), ``act`` itself when callable (or the known activation it
    is, where its traced graph is exactly one: :mod:`moecomm.moe._ops.activation_forms`),
    ReLU for None.

    Raises:
        ValueError: an unknown name. TypeError: neither a name nor a callable.
    """
    if act is None:
        return F.relu
    if isinstance(act, str):
        fn = ACTIVATIONS.get(act)
        if fn is None:
            raise ValueError(f"activation {act!r} is unknown; known: {sorted(ACTIVATIONS)} (or pass a callable)")
        return fn
    if callable(act):
        if isinstance(act, GatedActivation) or _lookup(act) is not None:
            return act
        # a lambda or module that is one known activation (lambda x: F.relu(x), nn.GELU()):
        # that activation's one backward kernel instead of autograd through the callable
        return known_form(act, _gelu_tanh, _identity) or act
    raise TypeError(f"activation must be a name ({sorted(ACTIVATIONS)}) or a callable, got {act!r}")


def is_gated(act: Union[str, Callable, None]) -> bool:
    """Whether ``act`` (a name or a callable) is a gated linear unit (:class:`GatedActivation`)."""
    if isinstance(act, str):
        return isinstance(ACTIVATIONS.get(act), GatedActivation)
    return isinstance(act, GatedActivation)


def _lookup(act: Callable) -> Optional[Callable[[Tensor, Tensor], Tensor]]:
    try:
        return _BACKWARD.get(act)
    except TypeError:  # an unhashable callable object
        return None


# the gate functions of a GatedActivation that moecomm_ext's one-pass GLU kernels compute
_GLU_NATIVE: dict[Callable, str] = {F.silu: "silu", F.gelu: "gelu", _gelu_tanh: "gelu_tanh", F.relu: "relu"}


def _native_glu(act: Callable, h: Tensor) -> Optional[tuple]:
    """``(module, code)`` of the native one-pass kernels for a gated ``act`` whose gate they
    know, on ``h``'s device, else None (torch operations then)."""
    if not isinstance(act, GatedActivation):
        return None
    try:
        name = _GLU_NATIVE.get(act.fn)
    except TypeError:  # an unhashable callable object
        return None
    if name is None:
        return None
    mod = unchecked.glu_ops(h.device, None)
    return None if mod is None else (mod, moecomm_ext.GLU_CODES[name])


def _recompute(act: Callable, h: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``(act(h), the map from its gradient to h's)``: one aten backward kernel for the named
    activations (gated or not), torch.autograd through ``act`` for any other callable."""
    back = _lookup(act)
    if back is not None:
        return act(h), lambda ga: back(ga, h)
    inner = _lookup(act.fn) if isinstance(act, GatedActivation) else None
    if inner is not None:
        H = h.shape[1] // 2
        g, u = h[:, :H], h[:, H:]
        s = act.fn(g)

        def gated_back(ga: Tensor) -> Tensor:
            gh = torch.empty_like(h)
            torch.mul(ga, s, out=gh[:, H:])
            gh[:, :H] = inner(ga * u, g)
            return gh
        return s * u, gated_back
    with torch.enable_grad():
        hh = h.detach().requires_grad_(True)
        a = act(hh)
    return a.detach(), lambda ga: torch.autograd.grad(a, hh, ga)[0]


def _flat(w1: Tensor, b1: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """A gated layout's ``[El, D, 2, H]`` weight and ``[El, 2, H]`` bias as ``[El, D, 2H]`` and
    ``[El, 2H]`` (views); a plain layout as it is."""
    if w1.dim() == 4:
        w1 = w1.flatten(2)
        b1 = None if b1 is None else b1.flatten(1)
    return w1, b1


def ffn_forward(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], seg: Segments,
                act: Callable, b2_scale: float) -> tuple[Tensor, Tensor]:
    """``(y, kept)``: ``y = act(x @ w1[e] + b1[e]) @ w2[e] + b2[e] * b2_scale`` per segment
    (``x``: ``[rows, model_dim]``; ``w1``: ``[El, model_dim, H]``, or ``[El, model_dim, 2, H]``
    with a :class:`GatedActivation`, whose ``act`` then maps ``[rows, 2H]`` to ``[rows, H]``),
    and what :func:`ffn_backward` needs besides the inputs (ReLU's output, which its gradient
    needs alone, else the pre-activation, from which the activation is recomputed)."""
    w1, b1 = _flat(w1, b1)
    relu = act is F.relu
    h = seg_mm(x, w1, seg, b1, relu=relu)  # (ReLU in place, with the bias where that is one kernel)
    glu = None if relu else _native_glu(act, h)
    if glu is not None:
        a = glu[0].glu_forward(h.contiguous(), glu[1])
    else:
        a = h if relu else act(h)
    y = seg_mm(a, w2, seg, b2, b2_scale)
    if seg.wgrad_sum is not None:
        seg.wgrad_sum.join()
    return y, (a if act is F.relu else h)


def ffn_backward(gy: Tensor, x: Tensor, kept: Tensor, w1: Tensor, w2: Tensor, seg: Segments, act: Callable,
                 need: Sequence[bool], has_b1: bool, has_b2: bool) -> tuple:
    """:func:`ffn_forward`'s backward: ``(g_x, g_w1, g_b1, g_w2, g_b2)`` in the parameters'
    shapes, None where ``need`` (for x, w1, b1, w2, b2) is False. ``b2``'s gradient is *not*
    multiplied by ``b2_scale`` (see :class:`_GroupedFFN`)."""
    gy = gy.contiguous()
    w1_shape = w1.shape
    w1 = _flat(w1, None)[0]
    relu = act is F.relu
    share = seg.wgrad_sum

    def wgrad(key: str, rows: Tensor, grad: Tensor) -> Tensor:
        return seg_wgrad(rows, grad, seg) if share is None else share.add(key, rows, grad, seg)

    glu = None if relu else _native_glu(act, kept)
    if glu is not None and kept.dtype == gy.dtype:
        # one pass over the pre-activation gives its gradient and the activation (for w2's)
        ga = seg_mm(gy, w2, seg, transpose_w=True)
        out = glu[0].glu_backward(ga.contiguous(), kept.contiguous(), glu[1], bool(need[3]))
        gh, a = out[0], (out[1] if need[3] else None)
        gw2 = wgrad("w2", a, gy) if need[3] else None
        gb2 = seg_sum(gy, seg) if has_b2 and need[4] else None
    else:
        if relu:
            a = kept  # the saved ReLU output
        else:
            a, act_back = _recompute(act, kept)
        gw2 = wgrad("w2", a, gy) if need[3] else None
        gb2 = seg_sum(gy, seg) if has_b2 and need[4] else None
        ga = seg_mm(gy, w2, seg, transpose_w=True)
        gh = torch.ops.aten.threshold_backward(ga, a, 0) if relu else act_back(ga)
    del a, ga
    gw1 = wgrad("w1", x, gh) if need[1] else None
    gb1 = seg_sum(gh, seg) if has_b1 and need[2] else None
    gx = seg_mm(gh, w1, seg, transpose_w=True) if need[0] else None
    if share is not None and not share.finish():
        gw1 = gw2 = None  # the stage whose backward runs last returns the sums
    if len(w1_shape) == 4:  # back to the gated layout
        gw1 = None if gw1 is None else gw1.view(w1_shape)
        gb1 = None if gb1 is None else gb1.view(w1_shape[0], *w1_shape[2:])
    return gx, gw1, gb1, gw2, gb2


class _GroupedFFN(torch.autograd.Function):
    """``y = act(x @ w1[e] + b1[e]) @ w2[e] + b2[e] * b2_scale`` per segment, with a
    hand-written backward (the activation is recomputed from the saved pre-activation).

    ``b2``'s gradient is *not* multiplied by ``b2_scale``: with an expert sharded over S
    ranks each shard adds ``b2 / S`` and every shard's copy gets the full gradient, so the
    copies stay equal and the layer equals the unsharded expert exactly.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, seg, act, b2_scale):  # type: ignore[override]
        y, kept = ffn_forward(x, w1, b1, w2, b2, seg, act, b2_scale)
        ctx.seg, ctx.act = seg, act
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        ctx.save_for_backward(x, kept, w1, w2)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):  # type: ignore[override]
        x, kept, w1, w2 = ctx.saved_tensors
        grads = ffn_backward(gy, x, kept, w1, w2, ctx.seg, ctx.act, ctx.needs_input_grad, ctx.has_b1, ctx.has_b2)
        return grads + (None, None, None)


def _uniform_init(shape: Sequence[int], fan_in: int, generator: torch.Generator) -> Tensor:
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(*shape).uniform_(-bound, bound, generator=generator)


class FFNExperts(nn.Module):
    """``num_local`` feed-forward experts ``fc2(act(fc1(x)))``, or shard ``shard_index`` of
    ``shards`` of one expert along its hidden dimension; with a gated activation
    (:class:`GatedActivation`: ``"swiglu"``, ``"geglu"``, ...) ``fc2(fn(x W1) * (x W3))``.

    Parameters (``El`` local experts, ``Hl = hidden_size / shards``):
    ``fc1_weight [El, model_dim, Hl]``, ``fc1_bias [El, Hl]``, ``fc2_weight [El, Hl, output_dim]``,
    ``fc2_bias [El, output_dim]`` (a copy on every shard, added once overall). Gated:
    ``fc1_weight [El, model_dim, 2, Hl]`` (``[:, :, 0]`` is ``W1``, the activation's input,
    ``[:, :, 1]`` is ``W3``; viewed as ``[El, model_dim, 2 * Hl]`` it is one GEMM's weight) and
    ``fc1_bias [El, 2, Hl]``; biases default to off for gated experts (``fc1_bias=None``,
    ``fc2_bias=None``: on for the plain activations, off for the gated ones).

    Weights are initialised per *global* expert from ``seed + expert_index`` (uniform in
    ``+-1/sqrt(fan_in)``), so they do not depend on the number of ranks.

    Raises:
        ValueError: ``hidden_size`` not divisible by ``shards``, or an unknown ``activation``
            name. TypeError: ``activation`` neither a name nor a callable.
    """

    def __init__(self, model_dim: int, hidden_size: int, num_local: int, *, output_dim: Optional[int] = None,
                 activation: Union[str, Callable, None] = "relu", fc1_bias: Optional[bool] = None,
                 fc2_bias: Optional[bool] = None, shards: int = 1, shard_index: int = 0, first_expert: int = 0,
                 seed: int = 0, dtype: Optional[torch.dtype] = None, device=None) -> None:
        super().__init__()
        if hidden_size % shards:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by the {shards} shards of each expert")
        self.model_dim, self.hidden_size, self.num_local = model_dim, hidden_size, num_local
        self.output_dim = model_dim if output_dim is None else output_dim
        self.shards, self.shard_index, self.first_expert = shards, shard_index, first_expert
        self.activation = activation
        self.act = resolve_activation(activation)
        self.gated = gated = isinstance(self.act, GatedActivation)
        fc1_bias = not gated if fc1_bias is None else fc1_bias
        fc2_bias = not gated if fc2_bias is None else fc2_bias
        Hl = hidden_size // shards
        h0, h1 = shard_index * Hl, (shard_index + 1) * Hl
        up = (2,) if gated else ()  # the gated layout: [model_dim, 2, hidden]
        w1, b1, w2, b2 = [], [], [], []
        for i in range(num_local):
            g = torch.Generator().manual_seed((seed * 1_000_003 + first_expert + i) % (2 ** 63))
            full_w1 = _uniform_init((model_dim, *up, hidden_size), model_dim, g)
            full_b1 = _uniform_init((*up, hidden_size), model_dim, g)
            full_w2 = _uniform_init((hidden_size, self.output_dim), hidden_size, g)
            full_b2 = _uniform_init((self.output_dim,), hidden_size, g)
            w1.append(full_w1[..., h0:h1])
            b1.append(full_b1[..., h0:h1])
            w2.append(full_w2[h0:h1])
            b2.append(full_b2)
        kw = dict(dtype=dtype, device=device)
        self.fc1_weight = nn.Parameter(torch.stack(w1).to(**kw).contiguous())
        self.fc1_bias = nn.Parameter(torch.stack(b1).to(**kw).contiguous()) if fc1_bias else None
        self.fc2_weight = nn.Parameter(torch.stack(w2).to(**kw).contiguous())
        self.fc2_bias = nn.Parameter(torch.stack(b2).to(**kw).contiguous()) if fc2_bias else None

    # checkpoint layout: (expert axis, shard axis or None, replicated over shards)
    def checkpoint_spec(self) -> dict:
        spec = {"fc1_weight": (0, 3 if self.gated else 2, False), "fc2_weight": (0, 1, False)}
        if self.fc1_bias is not None:
            spec["fc1_bias"] = (0, 2 if self.gated else 1, False)
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
                f"output_dim={self.output_dim}, gated={self.gated}, shards={self.shards}, "
                f"shard_index={self.shard_index}, "
                f"fc1_bias={self.fc1_bias is not None}, fc2_bias={self.fc2_bias is not None}")


class BatchedExperts(nn.Module):
    """Adapter for a user module in Tutel's custom-expert convention: ``module(x)`` maps
    ``[num_local, N, model_dim]`` to ``[num_local, N, output_dim]``. Variable row counts
    are padded to the largest local count (dropless mode).

    Raises:
        ValueError: (forward) ``module`` returned another shape than ``[num_local, N, *]``.
    """

    def __init__(self, module: nn.Module, num_local: int) -> None:
        super().__init__()
        self.module = module
        self.num_local = num_local

    def forward(self, x: Tensor, seg: Segments) -> Tensor:
        El, D = seg.num_local, x.shape[1]
        if seg.uniform is not None:
            C = seg.uniform
            nb = seg.num_blocks
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
    """Adapter for one user module per expert, each mapping ``[n, model_dim]`` to ``[n, output_dim]``.

    Raises:
        ValueError: (forward) a module returned another shape than ``[n, *]``.
    """

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
