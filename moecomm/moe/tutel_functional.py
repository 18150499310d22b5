"""Tutel's low-level dispatch ops on moecomm's kernels: ``fast_cumsum_sub_one``, ``fast_dispatcher``.

Code written against ``from tutel import moe as tutel_moe`` for these two names (DeepSpeed's
``use_tutel=True`` path is such code) runs unchanged with ``tutel_moe`` bound to this module;
:func:`moecomm.integrations.deepspeed.enable` (``tutel_kernels=True``) does that for DeepSpeed.
No package named ``tutel`` is needed or imported.

Semantics (Tutel's, for ``K`` routes of ``S`` tokens into ``E`` experts of ``C`` slots):

* route ``(k, t)`` goes to expert ``indices_[k][t]`` at position ``locations_[k][t]``, i.e. to
  row ``e * C + l`` of the ``[E * C, M]`` expert buffer; it is dropped when ``e < 0`` or
  ``l >= C``;
* ``encode(x)``: ``buffer[e * C + l] = x[t]`` (times ``gates_[k][t]`` when
  ``is_postscore=False``), zero rows where nothing is routed; when two routes name one row,
  the later one (larger ``k``, then larger ``t``) is kept;
* ``decode(y)``: ``out[t] = sum_k gates_[k][t] * y[e * C + l]`` over the kept routes (without
  the gates when ``is_postscore=False``);
* both are differentiable in the data and, where they use them, in the gates; the
  arithmetic is float32 (float16 when the dispatch dtype is float16, where Tutel's CUDA
  kernels compute in half precision, moecomm's accumulate in float32) and the results come
  back in the dispatch dtype.

Differences from Tutel: encode/decode read the routes given to the last ``update`` before
them, also in their backward (Tutel's backward reads the dispatcher's routes at backward
time); routes that Tutel's kernels would write outside the buffer (expert ``>= E``, or a
negative location of a kept route) raise ``ValueError`` in ``update`` (``check=True``, one
host sync) or are dropped (``check=False``).

The rows move through :func:`moecomm_ext.dispatch` / :func:`moecomm_ext.combine` (native
CPU/CUDA gather kernels; their backward passes are gathers too, without atomics).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

import moecomm_ext

__all__ = ["fast_cumsum_sub_one", "fast_dispatcher", "FastDispatcher"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fast_cumsum_sub_one(data: Tensor, dim: int = 0) -> Tensor:
    """``cumsum(data, dim=0) - 1`` of a 2-D mask: each routed token's position in its expert.

    Args:
        data: ``[S, E]`` integer (or bool/float) one-hot mask.
        dim: must be 0 (as in Tutel).

    Returns:
        ``[S, E]`` tensor (int64 for integer/bool masks), on ``data``'s device.

    Raises:
        TypeError: ``data`` is not a tensor.
        ValueError: ``data`` is not 2-D or ``dim`` is not 0.
    """
    if not isinstance(data, Tensor):
        raise TypeError(f"fast_cumsum_sub_one: data must be a torch.Tensor, got {type(data).__name__}")
    if data.dim() != 2 or dim != 0:
        raise ValueError(f"fast_cumsum_sub_one: data must be 2-D [S, E] and dim 0; got shape "
                         f"{tuple(data.shape)} and dim {dim!r}")
    return torch.cumsum(data, dim=0) - 1


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, Tensor) and value.numel() == 1:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"fast_dispatcher: {name} must be a non-negative int, got {value!r}")
    return value


def _route_list(name: str, values: object, count: Optional[int]) -> list[Tensor]:
    if not isinstance(values, (list, tuple)) or not values or not all(isinstance(v, Tensor) for v in values):
        raise TypeError(f"fast_dispatcher.update: {name} must be a non-empty list of tensors (one per k), "
                        f"got {type(values).__name__}")
    if count is not None and len(values) != count:
        raise ValueError(f"fast_dispatcher.update: {name} must hold one tensor per k ({count}), got {len(values)}")
    return [v.reshape(-1) for v in values]


class FastDispatcher:
    """Tutel's ``fast_dispatcher``: encode tokens into ``[E * C, M]`` expert rows and back.

    Args:
        num_global_experts: ``E``, experts over all ranks.
        capacity: ``C``, rows per expert (``update(capacity=)`` may change it).
        model_dim: ``M``, features per token.
        dispatch_dtype: the dtype encode/decode return.
        check: validate the routes in :meth:`update` (one host sync; see the module docstring).

    Raises:
        ValueError: a size is negative or not an int; ``dispatch_dtype`` is not floating.
    """

    def __init__(self, num_global_experts: int, capacity: int, model_dim: int,
                 dispatch_dtype: torch.dtype = torch.float32, *, check: bool = True) -> None:
        self.num_global_experts = _positive_int("num_global_experts", num_global_experts)
        self.capacity = _positive_int("capacity", capacity)
        self.model_dim = _positive_int("model_dim", model_dim)
        if dispatch_dtype not in _FLOAT:
            raise ValueError(f"fast_dispatcher: dispatch_dtype must be one of {_FLOAT}, got {dispatch_dtype!r}")
        self.original_dtype = dispatch_dtype
        self.dtype = torch.float16 if dispatch_dtype == torch.float16 else torch.float32
        self.check = bool(check)
        self.sample_size = 0
        self.is_postscore = True
        self._maps: Optional[tuple[Tensor, Tensor, Tensor, Tensor]] = None
        self._weight: Optional[Tensor] = None
        self._cache_key: Optional[tuple] = None
        self._cache: tuple[Tensor, Tensor, Tensor] = ()  # type: ignore[assignment]
        self.gates_: list[Tensor] = []

    def update(self, indices_: Sequence[Tensor], locations_: Sequence[Tensor], gates_: Sequence[Tensor],
               capacity: Optional[int] = None, is_postscore: bool = True) -> None:
        """Set the routes (one ``[S]`` tensor per k in each list) for the next encode/decode.

        Args:
            indices_: expert of each route (``< 0``: dropped).
            locations_: position in the expert (``>= capacity``: dropped).
            gates_: floating gate weight of each route (differentiable).
            capacity: new ``C`` (None or 0 keeps the current one).
            is_postscore: gates applied in decode (True) or in encode (False).

        Raises:
            TypeError: a list is empty or holds non-tensors; gates are not floating.
            ValueError: the lists differ in length, the tensors in size or device, or (with
                ``check``) a route would fall outside the expert buffer.
        """
        idx = _route_list("indices_", indices_, None)
        loc = _route_list("locations_", locations_, len(idx))
        gts = _route_list("gates_", gates_, len(idx))
        K = len(idx)
        # one [K, S] block each (DeepSpeed passes the rows of one): the checks below are per block
        e, l, g = (v[0].unsqueeze(0) if K == 1 else torch.stack(v) for v in (idx, loc, gts))
        S = e.shape[1]
        dev = e.device
        for name, t in (("locations_", l), ("gates_", g)):
            if t.shape != e.shape or t.device != dev:
                raise ValueError(f"fast_dispatcher.update: every {name}[k] must have {S} entries on {dev} like "
                                 f"indices_[0], got {[v.numel() for v in (loc if name == 'locations_' else gts)]} "
                                 f"on {t.device}")
        if not g.dtype.is_floating_point:
            raise TypeError(f"fast_dispatcher.update: gates_ must be floating, got {g.dtype}")
        for name, t in (("indices_", e), ("locations_", l)):
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise TypeError(f"fast_dispatcher.update: {name} must be integer, got {t.dtype}")
        if capacity is not None and _positive_int("capacity", capacity):
            self.capacity = int(capacity)
        E, C = self.num_global_experts, self.capacity
        e, l = e.long(), l.long()
        if self.check and bool(((e >= E) | ((e >= 0) & (l < 0))).any()):
            raise ValueError(f"fast_dispatcher.update: some route names an expert >= num_global_experts ({E}) or a "
                             f"negative location; Tutel's kernels would write outside the [E * C, M] buffer")
        kept = (e >= 0) & (e < E) & (l >= 0) & (l < C)
        # dropped routes park on a spare row E * C; the route owning each row is the last one
        # naming it in (k, t) order (order value k * S + t), found with one amax scatter
        parked = torch.where(kept, e * C + l, E * C)
        order, tokens, routes = self._constants(K, S, dev)
        owner = torch.full((E * C + 1,), -1, dtype=torch.long, device=dev)
        owner.scatter_reduce_(0, parked.view(-1), order, reduce="amax", include_self=True)
        owner = owner[:E * C]
        # -1 (an empty row) reads the tables' last entry, -1
        self._maps = (torch.where(kept, parked, -1).t().contiguous(), tokens[owner], owner, routes[owner])
        gk = g.to(self.dtype)
        self.gates_ = list(gk.unbind(0))
        self._weight = gk.t().contiguous()  # [S, K]: the combine's weights
        self.sample_size = S
        self.is_postscore = bool(is_postscore)

    def _constants(self, K: int, S: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """Per (K, S, device), made once: the order value ``k * S + t`` of each route, and the
        token ``t`` and flat ``[S, K]`` position ``t * K + k`` of each order value (then -1)."""
        key = (K, S, device)
        if self._cache_key != key:
            order = torch.arange(K * S, device=device)
            minus = torch.full((1,), -1, dtype=torch.long, device=device)
            tokens = torch.cat([order % max(S, 1), minus])
            routes = torch.cat([(order % max(S, 1)) * K + order // max(S, 1), minus])
            self._cache = (order, tokens, routes)
            self._cache_key = key
        return self._cache

    def _routes(self, fn: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if self._maps is None:
            raise RuntimeError(f"fast_dispatcher.{fn}: call update() first")
        return self._maps

    def _data(self, fn: str, data: Tensor, rows: int, what: str) -> Tensor:
        if not isinstance(data, Tensor):
            raise TypeError(f"fast_dispatcher.{fn}: data must be a torch.Tensor, got {type(data).__name__}")
        if data.dim() != 2 or data.shape[0] != rows or data.shape[1] != self.model_dim:
            raise ValueError(f"fast_dispatcher.{fn}: data must have shape [{what}, model_dim] = "
                             f"[{rows}, {self.model_dim}], got {tuple(data.shape)}")
        if data.dtype not in _FLOAT:
            raise TypeError(f"fast_dispatcher.{fn}: data must be floating, got {data.dtype}")
        return data

    def encode(self, data: Tensor) -> Tensor:
        """``[S, M]`` tokens -> ``[E * C, M]`` expert rows (differentiable).

        Raises:
            RuntimeError: no :meth:`update` yet.
            TypeError, ValueError: ``data`` is not a floating ``[S, M]`` tensor.
        """
        token_slots, slot_token, owner, _ = self._routes("encode")
        x = self._data("encode", data, self.sample_size, "S")
        scale = None
        if not self.is_postscore:
            flat = torch.stack(self.gates_).reshape(-1)
            if flat.numel():
                scale = torch.where(owner >= 0, flat[owner.clamp(min=0)], flat.new_zeros(()))
            else:  # no tokens: every row is empty
                scale = flat.new_zeros(owner.shape)
        out = moecomm_ext.dispatch(x, slot_token, token_slots, scale, check=False)
        return out.to(self.original_dtype)

    def decode(self, data: Tensor) -> Tensor:
        """``[E * C, M]`` expert rows -> ``[S, M]`` tokens, gate-weighted (differentiable).

        Raises:
            RuntimeError: no :meth:`update` yet.
            TypeError, ValueError: ``data`` is not a floating ``[E * C, M]`` tensor.
        """
        token_slots, slot_token, _, slot_route = self._routes("decode")
        y = self._data("decode", data, self.num_global_experts * self.capacity, "E * C")
        if self.is_postscore:
            out = moecomm_ext.combine(y, token_slots, self._weight, slot_token, check=False, slot_route=slot_route)
        else:
            out = moecomm_ext.combine(y, token_slots, None, slot_token, check=False)
        return out.to(self.original_dtype)


fast_dispatcher = FastDispatcher
