"""``moe_layer``: build a :class:`~moecomm.moe.MoELayer` from Tutel's configuration keys
(translated by :func:`tutel_config` into a :class:`~moecomm.moe.config.MoEConfig`).

A Tutel user changes ``from tutel import moe as tutel_moe`` to ``from moecomm import moe as
tutel_moe``; ``tutel_moe.moe_layer(gate_type={...}, model_dim=..., experts={...}, ...)`` then
builds the same kind of layer. Unknown keys raise (listing the known ones); nothing is
silently ignored. ``moecomm/moe/README.md`` lists every difference from Tutel.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ._ops.comm import resolve_comm
from .config import MoEConfig
from .gates import make_gate
from .layer import MoELayer

__all__ = ["moe_layer", "tutel_config", "GATE_KEYS", "FFN_EXPERT_KEYS", "CUSTOM_EXPERT_KEYS", "LAYER_KEYS"]

GATE_KEYS = ("type", "k", "capacity_factor", "gate_noise", "fp32_gate", "proj_dim", "init_t")
"""Keys of a ``gate_type`` dict (``proj_dim`` and ``init_t`` only for ``'cosine_top'``)."""

FFN_EXPERT_KEYS = ("type", "count_per_node", "hidden_size_per_expert", "activation_fn", "output_dim",
                   "has_fc1_bias", "has_fc2_bias")
"""Keys of an ``experts`` dict with ``type='ffn'``."""

CUSTOM_EXPERT_KEYS = ("type", "count_per_node", "module")
"""Keys of an ``experts`` dict with ``type='custom'`` (any other key goes to the module's class)."""

LAYER_KEYS = ("gate_type", "model_dim", "experts", "scan_expert_func", "result_func", "group", "seeds",
              "a2a_ffn_overlap_degree", "is_postscore", "batch_prioritized_routing", "normalize_gate",
              "is_gshard_loss", "parallel_type", "use_2dh",
              # moecomm's own
              "dropless", "z_loss_weight", "algorithm", "inequivalent_tokens", "dtype", "device", "wire_dtype",
              "grad_wire_dtype")
"""Arguments of :func:`moe_layer` (Tutel's, then moecomm's own)."""

_OWN_KEYS = ("dropless", "z_loss_weight", "algorithm", "inequivalent_tokens", "dtype", "device", "wire_dtype",
             "grad_wire_dtype")
_PARALLEL = {"adaptive:1": "expert", "expert": "expert", "adaptive:0": "data", "data": "data", "auto": "auto"}


def _gate_dicts(gate_type: Any) -> list:
    if isinstance(gate_type, str):
        m = re.fullmatch(r"[Tt]op(\d+)[Gg]ate", gate_type)
        if m is None:
            raise ValueError(f"gate_type={gate_type!r}: pass a dict such as {{'type': 'top', 'k': 2}} (or Tutel's "
                             f"legacy 'Top<k>Gate' string)")
        return [{"type": "top", "k": int(m.group(1))}]
    if isinstance(gate_type, dict):
        return [dict(gate_type)]
    if isinstance(gate_type, (list, tuple)) and gate_type and all(isinstance(g, dict) for g in gate_type):
        return [dict(g) for g in gate_type]
    raise TypeError(f"gate_type must be a dict (or a list of dicts), got {type(gate_type).__name__}")


def _check_keys(what: str, d: dict, known: Sequence[str]) -> None:
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {unknown}; known keys: {list(known)}")


def moe_layer(
    gate_type: Any,
    model_dim: int,
    experts: Optional[dict] = None,
    scan_expert_func: Optional[Callable[[str, nn.Parameter], Any]] = None,
    result_func: Optional[Callable] = None,
    group: Any = None,
    seeds: Optional[Sequence[Optional[int]]] = None,
    a2a_ffn_overlap_degree: Union[int, str] = 1,
    is_postscore: bool = True,
    batch_prioritized_routing: bool = False,
    normalize_gate: bool = True,
    is_gshard_loss: bool = True,
    parallel_type: str = "adaptive:1",
    use_2dh: bool = False,
    **kwargs: Any,
) -> MoELayer:
    """Tutel's ``moe_layer`` signature, building a :class:`MoELayer`.

    ``gate_type``: ``{'type': 'top' | 'cosine_top', 'k': 2, 'capacity_factor': 1.0,
    'gate_noise': 0.0, 'fp32_gate': True, 'proj_dim': 256, 'init_t': 0.5}`` or a list of
    those (``forward(x, gate_index=i)`` picks one). ``experts``: ``{'type': 'ffn',
    'count_per_node': n, 'hidden_size_per_expert': h, 'activation_fn': fn, 'output_dim': d,
    'has_fc1_bias': True, 'has_fc2_bias': True}``; ``count_per_node=-s`` shards each expert
    over ``s`` ranks. ``{'type': 'custom', 'module': M, 'count_per_node': n, **rest}``: ``M``
    an ``nn.Module`` class (built as ``M(model_dim=, local_experts=, sharded_count=1, **rest)``
    and called on ``[local_experts, N, model_dim]``), an ``nn.Module`` instance (called the
    same way) or a function ``f(global_expert_index) -> nn.Module`` (one module per expert,
    called on ``[n, model_dim]``).

    ``seeds = (gate_seed, expert_seed, seed_after)``: the gate's and the experts' weights,
    and ``torch.manual_seed(seed_after)`` once the layer is built. ``parallel_type``:
    ``'adaptive:1'``/``'expert'`` (expert-parallel), ``'adaptive:0'``/``'data'``
    (data-parallel), ``'auto'``. ``use_2dh=True`` means ``algorithm='2dh'``.
    moecomm's own keys: ``dropless``, ``z_loss_weight``, ``algorithm``, ``inequivalent_tokens``,
    ``dtype``, ``device``, ``wire_dtype``, ``grad_wire_dtype``.

    Raises:
        TypeError, ValueError: an unknown key or argument (listing the known ones), or a bad
            value (named); see :func:`tutel_config` and :class:`MoELayer`.
    """
    config = tutel_config(gate_type, model_dim, experts, scan_expert_func, result_func, group, seeds,
                          a2a_ffn_overlap_degree, is_postscore, batch_prioritized_routing, normalize_gate,
                          is_gshard_loss, parallel_type, use_2dh, **kwargs)
    layer = MoELayer.from_config(config)
    if seeds is not None and len(seeds) > 2 and seeds[2] is not None:
        torch.manual_seed(seeds[2])
    return layer


def tutel_config(
    gate_type: Any,
    model_dim: int,
    experts: Optional[dict] = None,
    scan_expert_func: Optional[Callable[[str, nn.Parameter], Any]] = None,
    result_func: Optional[Callable] = None,
    group: Any = None,
    seeds: Optional[Sequence[Optional[int]]] = None,
    a2a_ffn_overlap_degree: Union[int, str] = 1,
    is_postscore: bool = True,
    batch_prioritized_routing: bool = False,
    normalize_gate: bool = True,
    is_gshard_loss: bool = True,
    parallel_type: str = "adaptive:1",
    use_2dh: bool = False,
    **kwargs: Any,
) -> MoEConfig:
    """The :class:`~moecomm.moe.config.MoEConfig` of :func:`moe_layer`'s arguments (Tutel's
    keys translated; ``seeds[2]``, applied once the layer is built, is not part of it). The
    communicator (``group``) is resolved here, since Tutel counts experts per rank; a list of
    gates and a custom expert module class are built here.

    Raises:
        TypeError, ValueError: as :func:`moe_layer`.
    """
    unknown = sorted(set(kwargs) - set(_OWN_KEYS))
    if unknown:
        raise ValueError(f"moe_layer: unknown argument(s) {unknown}; known: {list(LAYER_KEYS)}")
    gates = _gate_dicts(gate_type)
    experts, count = _expert_dict(experts)
    if parallel_type not in _PARALLEL:
        raise ValueError(f"parallel_type={parallel_type!r} is not supported; supported: {sorted(_PARALLEL)} "
                         f"(Tutel's 'model' and 'adaptive:r' for r > 1 are not implemented)")
    comm = resolve_comm(group)
    num_experts = _num_experts(count, comm.size)
    for i, g in enumerate(gates):
        _check_keys(f"gate_type[{i}]" if len(gates) > 1 else "gate_type", g, GATE_KEYS)
        if "type" not in g:
            raise ValueError(f"gate_type: missing 'type' (one of 'top', 'cosine_top'), got {g}")
        if g["type"] != "cosine_top" and ("proj_dim" in g or "init_t" in g):
            raise ValueError(f"gate_type: 'proj_dim'/'init_t' apply to the 'cosine_top' gate only, got type "
                             f"{g['type']!r}")
    if seeds is not None and (not isinstance(seeds, (list, tuple)) or not 1 <= len(seeds) <= 3):
        raise ValueError(f"seeds must be a tuple (gate_seed, expert_seed, seed_after), got {seeds!r}")
    gate_seed = seeds[0] if seeds else None
    g0 = gates[0]
    options: dict = dict(
        k=g0.get("k", 1), capacity_factor=g0.get("capacity_factor", 1.0), gate_noise=g0.get("gate_noise", 0.0),
        fp32_gate=g0.get("fp32_gate", True), normalize_gate=normalize_gate,
        batch_prioritized_routing=batch_prioritized_routing, is_postscore=is_postscore,
        balance_loss="gshard" if is_gshard_loss else "load_importance",
        overlap_degree=a2a_ffn_overlap_degree, parallel_mode=_PARALLEL[parallel_type],
        algorithm=kwargs.pop("algorithm", "2dh" if use_2dh else None), seed=gate_seed,
        expert_seed=seeds[1] if seeds and len(seeds) > 1 else None,
        scan_expert_func=scan_expert_func, result_func=result_func, comm=comm, **kwargs)
    if use_2dh and options["algorithm"] != "2dh":
        raise ValueError(f"use_2dh=True contradicts algorithm={options['algorithm']!r}")
    options.update(_gate_options(gates, model_dim, num_experts, gate_seed, kwargs.get("dtype"),
                                 kwargs.get("device", comm.device)))
    options.update(_expert_options(experts, count, model_dim))
    return MoEConfig(model_dim=model_dim, num_experts=num_experts, **options)


def _expert_dict(experts: Any) -> tuple[dict, int]:
    """A copy of ``experts`` (its type and keys checked) and its ``count_per_node``."""
    if experts is None:
        raise ValueError("moe_layer: experts is required, e.g. {'type': 'ffn', 'count_per_node': 1, "
                         "'hidden_size_per_expert': 2048}")
    if not isinstance(experts, dict):
        raise TypeError(f"experts must be a dict, got {type(experts).__name__}")
    experts = dict(experts)
    etype = experts.get("type")
    if etype not in ("ffn", "custom"):
        raise ValueError(f"experts['type']={etype!r} is unknown; known: ['ffn', 'custom']")
    if etype == "ffn":
        _check_keys("experts (type 'ffn')", experts, FFN_EXPERT_KEYS)
    count = experts.get("count_per_node", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count == 0:
        raise ValueError(f"experts['count_per_node'] must be a non-zero int (negative: shard each expert over "
                         f"that many ranks), got {count!r}")
    return experts, count


def _num_experts(count: int, world: int) -> int:
    """The total of ``count`` experts per rank, or of experts sharded over ``-count`` ranks."""
    if count > 0:
        return count * world
    if world % (-count):
        raise ValueError(f"experts['count_per_node']={count}: each expert sharded over {-count} ranks needs a "
                         f"world size divisible by {-count}, got {world}")
    num_experts = world // (-count)
    if num_experts * (-count) != world or (-count) > 1 and num_experts >= world:
        raise ValueError(f"experts['count_per_node']={count} is not possible on {world} ranks")
    return num_experts


def _gate_options(gates: list, model_dim: int, num_experts: int, gate_seed: Optional[int], dtype: Any,
                  device: Any) -> dict:
    """``gate`` (and the cosine gate's options) of the layer: one gate by name, several built."""
    if len(gates) == 1:
        gtype = gates[0]["type"]
        if gtype not in ("top", "cosine_top"):
            raise ValueError(f"gate_type['type']={gtype!r} is unknown; known: ['top', 'cosine_top']")
        if gtype == "cosine_top":
            return {"gate": gtype, "proj_dim": gates[0].get("proj_dim", 256), "init_t": gates[0].get("init_t", 0.5)}
        return {"gate": gtype}
    built = []
    for i, g in enumerate(gates):
        if g["type"] not in ("top", "cosine_top"):
            raise ValueError(f"gate_type[{i}]['type']={g['type']!r} is unknown; known: ['top', 'cosine_top']")
        base = gate_seed if gate_seed is not None else 0
        kw = {kk: v for kk, v in g.items() if kk != "type"}
        built.append(make_gate(g["type"], model_dim, num_experts, generator=torch.Generator().manual_seed(
            base + 7919 * i), dtype=dtype, device=device, **kw))
    return {"gate": built}


def _expert_options(experts: dict, count: int, model_dim: int) -> dict:
    """``hidden_size`` and the FFN options, or ``experts=`` the user's module (a class built here)."""
    if experts["type"] == "ffn":
        if "hidden_size_per_expert" not in experts:
            raise ValueError("experts: 'hidden_size_per_expert' is required for type 'ffn'")
        return dict(hidden_size=experts["hidden_size_per_expert"], activation=experts.get("activation_fn", "relu"),
                    output_dim=experts.get("output_dim"), fc1_bias=experts.get("has_fc1_bias"),
                    fc2_bias=experts.get("has_fc2_bias"))
    if count < 0:
        raise ValueError("experts: a 'custom' expert module cannot be sharded (count_per_node must be > 0)")
    if "module" not in experts:
        raise ValueError("experts: 'module' is required for type 'custom'")
    module = experts.pop("module")
    rest = {kk: v for kk, v in experts.items() if kk not in ("type", "count_per_node")}
    if isinstance(module, type) and issubclass(module, nn.Module):
        return {"experts": module(model_dim=model_dim, local_experts=count, sharded_count=1, **rest)}
    if isinstance(module, nn.Module) or callable(module):
        if rest:
            raise ValueError(f"experts: unknown key(s) {sorted(rest)} for a module instance or factory; known "
                             f"keys: {list(CUSTOM_EXPERT_KEYS)}")
        return {"experts": module}
    raise TypeError(f"experts['module'] must be an nn.Module class, instance or factory, got "
                    f"{type(module).__name__}")
