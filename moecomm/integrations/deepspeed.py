"""DeepSpeed's MoE layer, its exchange and its ``use_tutel=True`` path on moecomm: ``enable()`` / ``disable()``.

``enable()`` (the default, ``layer="moecomm"``) runs every DeepSpeed ``MOELayer`` on moecomm's
dispatch, grouped experts and combine, and its exchanges on moecomm (both described below):
on one H200 this took 0.79x (top-2) and 0.70x (top-3) of DeepSpeed's own step, on one H100
(a slower host, where DeepSpeed's own step was faster) 0.92x and 0.88x (issue 28,
``bench.frameworks``, world size 1, sessions 75-76; ``bench/results/README.md``). ``enable(layer="deepspeed")``
keeps DeepSpeed's forward and changes only the exchange (and, with ``tutel_kernels=True``, the
Tutel path's kernels): its results are DeepSpeed's bit for bit.

The exchange: ``enable()`` replaces the ``forward`` of ``deepspeed.moe.sharded_moe._AllToAll``, the
autograd Function ``MOELayer`` sends its capacity-padded ``[E, C, M]`` buffers with (both
exchanges, forward and backward), so its equal-split ``all_to_all_single`` runs on the
moecomm communicator of the expert-parallel group
(:func:`moecomm.integrations.communicator_for_group`).

``enable(tutel_kernels=True)`` also binds ``sharded_moe.tutel_moe`` to
:mod:`moecomm.moe.tutel_functional` and sets ``sharded_moe.TUTEL_INSTALLED = True``, so that
``deepspeed.moe.layer.MoE(..., use_tutel=True)`` runs its Tutel path (``fast_cumsum_sub_one``
in the top-1 gate, ``fast_dispatcher`` ``update`` / ``encode`` / ``decode`` in ``MOELayer``)
on moecomm's dispatch/combine kernels, with no package named ``tutel`` installed. The
dispatchers it makes skip the route check (``check_routes=False``, the default): DeepSpeed's
gates only give experts in ``[-1, E)`` and locations in ``[0, C)``, and the check costs a host
sync per step (issue 28's profile: it and the maps' extra launches made the Tutel path slower
than DeepSpeed's native one). DeepSpeed
reads ``TUTEL_INSTALLED`` when a layer is built: enable first, then build the model.
``disable()`` restores every name it changed.

The layer: ``enable(layer="moecomm")`` also replaces ``sharded_moe.MOELayer.forward`` (every
layer, built before or after the call): the gate runs as DeepSpeed's own (its ``l_aux``, ``exp_counts`` and
routes are DeepSpeed's), then the tokens are dispatched into the capacity-padded ``[E, C, M]``
buffer by moecomm's dispatch kernel (:class:`moecomm.moe.tutel_functional.FastDispatcher`),
exchanged by ``_AllToAll`` (moecomm's exchange with ``exchange=True``), run through all local
experts as one grouped FFN (:meth:`moecomm.moe.experts.FFNExperts.run`: one batched GEMM per
source rank and layer, a hand-written backward) instead of DeepSpeed's per-expert loop with
its chunk and cat, exchanged back and combined by moecomm's combine kernel. The experts'
weights are stacked from DeepSpeed's own ``nn.Linear`` parameters at every call, so the
parameters the optimizer holds stay DeepSpeed's and their gradients reach them.

Supported: ``Experts`` (not subclassed) of identical ``nn.Sequential(nn.Linear, activation,
nn.Linear)`` experts, the activation one of ``nn.ReLU``, ``nn.GELU`` (``approximate`` "none"
or "tanh"), ``nn.SiLU``, ``nn.Sigmoid``, ``nn.Tanh``, ``nn.Identity``; biases on or off; the
parameters in the input's dtype and device. A layer outside that (another expert module,
tensor-parallel experts, ZeRO-3 partitioned parameters or hooks on the experts, autocast, the
wall-clock timers) runs DeepSpeed's own ``MOELayer.forward``, with one log line per layer
(logger ``"moecomm"``) naming why (:func:`layer_fallback_reason` tells it for a layer).

Results equal DeepSpeed's own layer up to float rounding: the gate, the dispatch and the
exchange are exact; the experts' GEMMs are batched (``bmm`` over ``[E_local, C, M]``) where
DeepSpeed runs one ``addmm`` per expert, so their sums are blocked differently, and the
combine sums the k routes in another order. Measured in float32 on 1 and 2 CPU ranks (the
tests): the output, the input's gradient and every expert weight's and bias's gradient within
6e-7 of each result's largest magnitude (a few ulps); the gate's weight gradient, a sum of
softmax-Jacobian terms that cancel, within 2e-4, as far as DeepSpeed's own float32 result is
from its float64 one there.

A layer whose ``set_deepspeed_parallelism()`` was never called exchanges over the group
``None``, which DeepSpeed (and torch) read as the world group; so does moecomm here.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ._groups import communicator_for_group
from ._patch import any_forward_hooks, module_tree, patch_all_to_all

__all__ = ["enable", "disable", "is_enabled", "tutel_kernels_enabled", "layer_enabled", "layer_fallback_reason",
           "LAYERS"]

_log = logging.getLogger("moecomm")

_state: dict[str, Any] = {}
"""Explicit registry while enabled: "all_to_all" -> Patch, "tutel" -> the names it replaced,
"layer" -> DeepSpeed's own ``MOELayer.forward``."""

LAYERS = ("deepspeed", "moecomm")
"""The values of ``enable(layer=)``: DeepSpeed's own ``MOELayer.forward``, or moecomm's."""

_MISSING = object()


def _forward(ctx: Any, group: Any, input: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    ctx.group = group
    input = input.contiguous()
    output = torch.empty_like(input)
    # None is DeepSpeed's expert group until set_deepspeed_parallelism(): the world group, to it
    communicator_for_group(dist.group.WORLD if group is None else group).all_to_all_single(output, input)
    return output


def _sharded_moe() -> Any:
    try:
        from deepspeed.moe import sharded_moe
    except ImportError as exc:
        raise ImportError(
            "moecomm.integrations.deepspeed needs DeepSpeed (on CPU: DS_BUILD_OPS=0 pip install deepspeed, "
            f"and DS_ACCELERATOR=cpu); importing deepspeed.moe.sharded_moe failed: {exc}"
        ) from exc
    return sharded_moe


class _TutelOps:
    """What ``sharded_moe.tutel_moe`` names while enabled: Tutel's two ops on moecomm's kernels."""

    def __init__(self, check_routes: bool) -> None:
        from ..moe import tutel_functional

        self.check_routes = check_routes
        self.fast_cumsum_sub_one = tutel_functional.fast_cumsum_sub_one
        self._cls = tutel_functional.FastDispatcher

    def fast_dispatcher(self, num_global_experts: int, capacity: int, model_dim: int,
                        dispatch_dtype: torch.dtype = torch.float32) -> Any:
        """:class:`moecomm.moe.tutel_functional.FastDispatcher` with ``check=check_routes``."""
        return self._cls(num_global_experts, capacity, model_dim, dispatch_dtype, check=self.check_routes)


def _activation(module: nn.Module) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The function of a supported activation module (exact type), None for any other."""
    from ..moe.experts import ACTIVATIONS

    kind = type(module)
    if kind is nn.GELU:
        return {"none": ACTIVATIONS["gelu"], "tanh": ACTIVATIONS["gelu_tanh"]}.get(module.approximate)
    return {nn.ReLU: ACTIVATIONS["relu"], nn.SiLU: ACTIVATIONS["silu"], nn.Sigmoid: ACTIVATIONS["sigmoid"],
            nn.Tanh: ACTIVATIONS["tanh"], nn.Identity: ACTIVATIONS["identity"]}.get(kind)


def _plan(layer: Any, x: torch.Tensor) -> Union[str, tuple]:
    """``(activation, fc1 list, fc2 list)`` when moecomm can run ``layer``'s experts on ``x``,
    else the reason it cannot (a sentence). What the experts are made of is worked out once
    per structure (kept on the layer, keyed by the identity of every expert module and
    parameter); what can change between calls without that (the input, dtypes and devices,
    hooks, ZeRO-3 partitioning, autocast, timers) is checked at every call."""
    from deepspeed.moe.experts import Experts

    sharded_moe = _sharded_moe()
    if layer.wall_clock_breakdown:
        return "its wall_clock_breakdown timers are on"
    if torch.is_autocast_enabled(x.device.type):
        return "autocast is on"
    if sharded_moe.bwc_tensor_model_parallel_world_size(sharded_moe.groups.mpu) > 1:
        return "the non-expert part is tensor-parallel (DeepSpeed's drop_tokens/gather_tokens)"
    experts = layer.experts
    if not isinstance(experts, Experts) or type(experts).forward is not Experts.forward:
        return f"its experts are {type(experts).__name__}, not deepspeed.moe.experts.Experts"
    modules, params = module_tree(experts)
    key = (layer.num_local_experts, *map(id, modules), *map(id, params))
    cached = getattr(layer, "moecomm_structure", None)
    if cached is None or cached[0] != key:
        # (the modules and parameters kept with the key: while cached, no new object can reuse their ids)
        cached = layer.moecomm_structure = (key, _structure(layer, list(experts.deepspeed_experts)), modules, params)
    plan = cached[1]
    if isinstance(plan, str):
        return plan
    act, fc1, fc2 = plan
    M = x.shape[-1]
    a, b = fc1[0], fc2[0]
    if a.in_features != M or b.out_features != M:
        return (f"its experts map {a.in_features} -> {a.out_features} -> {b.out_features} features, "
                f"not model_dim {M} -> hidden -> {M}")
    dtype, device = x.dtype, x.device
    for q in params:
        if q.dtype != dtype or q.device != device:
            return f"an expert parameter is {q.dtype} on {q.device}, the input {dtype} on {device}"
        if "ds_id" in vars(q):  # (hasattr, without raising inside for every parameter)
            return "its expert parameters are ZeRO-3 partitioned"
    if any_forward_hooks(modules):
        return "its experts have forward hooks"
    return plan


def _structure(layer: Any, mods: list) -> Union[str, tuple]:
    """The part of :func:`_plan` that depends only on what the expert modules are."""
    if len(mods) != layer.num_local_experts or not mods:
        return f"it holds {len(mods)} experts for num_local_experts={layer.num_local_experts}"
    act, fc1, fc2 = None, [], []
    for i, m in enumerate(mods):
        if type(m) is not nn.Sequential or len(m) != 3 or type(m[0]) is not nn.Linear or type(m[2]) is not nn.Linear:
            return (f"expert {i} is {type(m).__name__} ({', '.join(type(c).__name__ for c in m.children())}), "
                    f"not nn.Sequential(nn.Linear, activation, nn.Linear)")
        fn = _activation(m[1])
        if fn is None:
            return f"expert {i}'s activation {m[1]!r} is not one of ReLU, GELU, SiLU, Sigmoid, Tanh, Identity"
        if act is not None and fn is not act:
            return f"expert {i}'s activation {m[1]!r} differs from expert 0's"
        act = fn
        fc1.append(m[0])
        fc2.append(m[2])
    a, b = fc1[0], fc2[0]
    if a.out_features != b.in_features:
        return f"its experts map {a.in_features} -> {a.out_features} -> {b.out_features} features"
    for i, (p, q) in enumerate(zip(fc1, fc2)):
        if p.weight.shape != a.weight.shape or q.weight.shape != b.weight.shape or \
                (p.bias is None) != (a.bias is None) or (q.bias is None) != (b.bias is None):
            return f"expert {i}'s shapes or biases differ from expert 0's"
    return act, fc1, fc2


def layer_fallback_reason(layer: Any) -> Optional[str]:
    """Why ``enable(layer="moecomm")`` ran ``layer`` (a ``sharded_moe.MOELayer``) on DeepSpeed's own
    path at its last forward; None when it ran on moecomm's (or has not run since enabled)."""
    return getattr(layer, "moecomm_fallback", None)


def _stack(mods: list, name: str) -> Optional[torch.Tensor]:
    """``[El, in, out]``: the modules' ``name`` weights stacked (differentiable: the gradient
    reaches each module's own parameter), as a transposed view; biases ``[El, out]``."""
    ts = [getattr(m, name) for m in mods]
    if ts[0] is None:
        return None
    t = torch.stack(ts)
    return t.transpose(1, 2) if name == "weight" else t


def _layer_forward(self: Any, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``sharded_moe.MOELayer.forward`` on moecomm's dispatch, grouped experts and combine."""
    from ..moe._ops.segments import Segments
    from ..moe.experts import FFNExperts
    from ..moe.tutel_functional import FastDispatcher

    plan = _plan(self, input[0])
    if isinstance(plan, str):
        if getattr(self, "moecomm_fallback", None) != plan:
            _log.warning("moecomm.integrations.deepspeed: layer='moecomm' runs DeepSpeed's own MOELayer.forward "
                         "for this layer: %s", plan)
        self.moecomm_fallback = plan
        return _state["layer"](self, *input, **kwargs)
    self.moecomm_fallback = None
    act, fc1, fc2 = plan
    sharded_moe = _sharded_moe()
    d_model = input[0].shape[-1]
    x = input[0].reshape(-1, d_model)
    used_token = input[1] if len(input) > 1 else None
    self.l_aux, C, E, indices_, locations_, gates_, self.exp_counts = self.gate(x, used_token, True, self.use_tutel)
    S, M = x.shape
    C = int(C)
    disp = getattr(self, "_moecomm_dispatcher", None)
    if disp is None or disp.num_global_experts != E or disp.model_dim != M or disp.original_dtype != x.dtype:
        disp = self._moecomm_dispatcher = FastDispatcher(E, C, M, x.dtype, check=False)
    disp.update(list(indices_.unbind(0)), list(locations_.unbind(0)), list(gates_.unbind(0)), capacity=C)
    buf = disp.encode(x)
    if self.ep_size > 1:
        buf = sharded_moe._AllToAll.apply(self.ep_group, buf.view(E, C, M)).view(E * C, M)
    seg = Segments.uniform_blocks(self.ep_size, self.num_local_experts, C)
    y = FFNExperts.run(buf, seg, _stack(fc1, "weight"), _stack(fc1, "bias"), _stack(fc2, "weight"),
                       _stack(fc2, "bias"), act)
    if self.ep_size > 1:
        y = sharded_moe._AllToAll.apply(self.ep_group, y.view(E, C, M)).view(E * C, M)
    return disp.decode(y).reshape(input[0].shape)


def enable(tutel_kernels: bool = False, *, exchange: bool = True, check_routes: bool = False,
           layer: str = "moecomm") -> None:
    """Route DeepSpeed's MoE all-to-all through moecomm (and its Tutel path onto moecomm's kernels).

    Args:
        tutel_kernels: also make ``use_tutel=True`` layers built from now on run on
            :mod:`moecomm.moe.tutel_functional`.
        exchange: route ``_AllToAll`` through moecomm (False: only the kernels, with
            DeepSpeed's own exchange, e.g. to compare the two separately).
        check_routes: make the Tutel dispatchers validate the routes in every ``update`` (a
            host sync per step; for debugging a gate other than DeepSpeed's own).
        layer: ``"moecomm"`` (the default): every ``MOELayer`` (built before or after) runs its
            dispatch, experts and combine on moecomm's kernels and grouped FFN (see the module
            docstring for what is supported; other layers keep DeepSpeed's path, with one log
            line naming why); results equal DeepSpeed's to float rounding. ``"deepspeed"``:
            DeepSpeed's own forward, only its exchange (and with ``tutel_kernels``, its Tutel
            path's kernels) on moecomm, bit for bit DeepSpeed's results.

    Call it on every rank. A later call adds what it asks for; ``disable()`` removes all.

    Raises:
        ImportError: DeepSpeed is not installed (the message says how to install it on CPU).
        RuntimeError: ``sharded_moe._AllToAll.forward`` is missing (an unsupported version).
        TypeError: ``check_routes`` is not a bool.
        ValueError: ``layer`` is not one of :data:`LAYERS`.
    """
    if not isinstance(check_routes, bool):
        raise TypeError(f"enable: check_routes must be a bool, got {check_routes!r}")
    if layer not in LAYERS:
        raise ValueError(f"enable: layer must be one of {LAYERS}, got {layer!r}")
    sharded_moe = _sharded_moe()
    if layer == "moecomm" and "layer" not in _state:
        cls = getattr(sharded_moe, "MOELayer", None)
        if cls is None or "forward" not in cls.__dict__:
            raise RuntimeError("deepspeed.moe.sharded_moe.MOELayer.forward not found: this DeepSpeed version is not "
                               "supported by moecomm.integrations (layer='moecomm')")
        _state["layer"] = cls.__dict__["forward"]
        cls.forward = _layer_forward
    if exchange and "all_to_all" not in _state:
        _state["all_to_all"] = patch_all_to_all(sharded_moe, _forward, "deepspeed.moe.sharded_moe._AllToAll.forward",
                                                "DeepSpeed")
    if tutel_kernels and "tutel" not in _state:
        _state["tutel"] = {n: getattr(sharded_moe, n, _MISSING) for n in ("tutel_moe", "TUTEL_INSTALLED")}
        sharded_moe.tutel_moe = _TutelOps(check_routes)
        sharded_moe.TUTEL_INSTALLED = True


def disable() -> None:
    """Restore DeepSpeed's own exchange, Tutel names and layer forward (no-op when not enabled)."""
    forward = _state.pop("layer", None)
    if forward is not None:
        _sharded_moe().MOELayer.forward = forward
    patch = _state.pop("all_to_all", None)
    if patch is not None:
        patch.disable()
    saved = _state.pop("tutel", None)
    if saved is not None:
        sharded_moe = _sharded_moe()
        for name, value in saved.items():
            if value is _MISSING:
                delattr(sharded_moe, name)
            else:
                setattr(sharded_moe, name, value)


def is_enabled() -> bool:
    """True while the exchange is routed through moecomm (``enable(exchange=True)``)."""
    patch = _state.get("all_to_all")
    return patch is not None and patch.enabled


def tutel_kernels_enabled() -> bool:
    """True while ``enable(tutel_kernels=True)`` is in effect."""
    return "tutel" in _state


def layer_enabled() -> bool:
    """True while ``enable(layer="moecomm")`` is in effect."""
    return "layer" in _state
