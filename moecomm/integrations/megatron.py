"""Megatron-core's MoE all-to-all (and, asked for, its MoE layer) on moecomm: ``enable()`` / ``disable()``.

``enable()`` replaces the ``forward`` of ``megatron.core.tensor_parallel.mappings._AllToAll``,
the autograd Function behind ``mappings.all_to_all`` (and ``all_to_all_sp2hp`` /
``all_to_all_hp2sp``). ``MoEAlltoAllTokenDispatcher`` sends tokens and probabilities with it
in ``token_dispatch`` and the expert outputs back in ``token_combine``; the backward passes
re-apply the same Function with the splits swapped, so forward and backward all run on
moecomm. Megatron's expert-parallel ``ProcessGroup`` is mapped to a communicator once per
group (:func:`moecomm.integrations.communicator_for_group`: the default communicator of
:func:`moecomm.init` when its ranks are the group's, else one made on the group). Nothing in
Megatron is edited; ``disable()`` puts the original ``forward`` back. The replacement keeps
Megatron's semantics: group size 1 returns the input, ``None`` splits mean equal blocks,
``use_nccl_stream`` (an async call waited on at once there) is a plain blocking call here.
The output is allocated on the input's device (Megatron's own forward uses
``torch.cuda.current_device()``, the same device in a CUDA run).

**Counts.** The dispatcher gathers every rank's per-expert token counts itself (an
all-gather over the TP x EP group in ``preprocess``) and copies the splits to the host on a
side stream, waiting on an event before the exchange (``_maybe_dtoh_and_synchronize``),
because it needs them on the host anyway: to size the output buffer, to sort the received
chunks by local expert (``sort_chunks_by_idxs``) and for the grouped GEMM's
``tokens_per_expert``. So by the time ``_AllToAll`` runs, both sides' counts are host
arrays and moecomm takes its known-counts path: one round that moves only the rows, with no
count exchange of its own. moecomm's one-round GPU-count path (``all_to_all_v`` with counts
still on the device) therefore **cannot be used without editing Megatron**: the host copy
and the event wait happen in the dispatcher before the communication call, and the host
values are needed after it; skipping them needs changes to ``preprocess``,
``_maybe_dtoh_and_synchronize`` and ``dispatch_postprocess``.

**Permutation.** ``enable()`` (``permute=True``, the default) also replaces the unfused
``moe_utils.permute`` / ``unpermute`` (the dispatcher's permutation before the dispatch
exchange and its unpermutation after the combine; the ones used without Transformer Engine,
or with ``moe_permute_fusion`` off) in ``moe_utils`` and in ``token_dispatcher``, which
imported them by name: the rows move through moecomm's gather kernels (gathers forward and
backward, no ``index_add`` / ``scatter_add_`` atomics), the index arithmetic stays Megatron's,
and the bits are Megatron's in float32/float64 (and bfloat16/float16 up to top-2 routing;
see :mod:`moecomm.integrations._permute`). Fused calls still go to Transformer Engine.

**The layer.** ``enable()`` (``layer="moecomm"``, the default) also replaces
``MoELayer.forward`` (every layer, built before or after the call): Megatron's router runs as
its own (probabilities, routing map, aux losses, z-loss, expert-bias counts), then moecomm's
fused step does the rest in place of Megatron's permutation, dispatcher, ``SequentialMLP``
per-expert loop (with its host ``tolist``) and unpermutation: the routes' rows gathered by a
native kernel, exchanged over the expert-parallel group's communicator with the counts on the
device, the local experts run as grouped GEMMs on weights stacked from Megatron's own
``linear_fc1`` / ``linear_fc2`` parameters (their gradients reach them), the outputs summed per
token weighted by Megatron's probabilities; Megatron's shared experts are added as Megatron adds
them. Results equal Megatron's own layer to float rounding (the GEMMs are blocked and the k
routes summed in another order; tested in float32 on CPU): ``enable(layer="megatron")`` keeps
Megatron's forward and bits, with only the exchanges and the permutation on moecomm. Supported:
``SequentialMLP`` experts (what Megatron builds without Transformer Engine) with ``F.gelu``,
``F.silu`` or ``F.relu``, gated (``gated_linear_unit``) or not, biases on or off; expert
parallelism without tensor parallelism; dropless routing (no ``moe_expert_capacity_factor``)
with any of Megatron's routers. A layer outside that (Transformer Engine experts, a capacity
factor, a padding mask, FP8, latent MoE, recomputation, partial CUDA graphs, shared-expert
overlap, ...) runs Megatron's own ``forward``, with one log line per layer and reason (logger
``"moecomm"``; :func:`layer_fallback_reason` tells it for a layer).

**Versions.** megatron-core 0.19 and later (:data:`SUPPORTED`; tested: 0.19.2). ``enable()``
refuses an older one with the README's install recipe (:func:`check_version`).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from ._groups import communicator_for_group
from ._patch import Patch, patch_all_to_all

__all__ = ["enable", "disable", "is_enabled", "permute_enabled", "layer_enabled", "layer_fallback_reason", "LAYERS",
           "SUPPORTED", "installed_version", "check_version"]

SUPPORTED = (0, 19)
"""The oldest megatron-core release moecomm supports (tested: 0.19.2). Older ones are not
tested: 0.16.1, what plain ``pip install megatron-core`` picks on Python 3.11, has another
``mappings.all_to_all`` (no ``use_nccl_stream``) and builds its dispatcher from other
process groups."""

INSTALL = ("pip install --no-deps --ignore-requires-python megatron-core==0.19.2 && "
           "pip install --no-deps triton")
"""The README's recipe ("Megatron-core and DeepSpeed"): 0.19 declares Python >= 3.12, but runs on 3.11."""

_state: dict[str, Any] = {}
"""Explicit registry while enabled: "all_to_all" -> Patch; "permute" -> {(module, name): original};
"layer" -> Megatron's own ``MoELayer.forward``."""

LAYERS = ("megatron", "moecomm")
"""The values of ``enable(layer=)``: Megatron's own ``MoELayer.forward``, or moecomm's."""

_PERMUTE_NAMES = ("permute", "unpermute")


def _rows(splits: Any) -> int:
    if isinstance(splits, torch.Tensor):
        return int(splits.sum())
    return int(sum(int(s) for s in splits))


def _forward(ctx: Any, group: Any, input: torch.Tensor, output_split_sizes: Any, input_split_sizes: Any,
             use_nccl_stream: bool = False) -> torch.Tensor:
    ctx.group = group
    ctx.output_split_sizes = output_split_sizes
    ctx.input_split_sizes = input_split_sizes
    ctx.use_nccl_stream = use_nccl_stream
    if group.size() == 1:
        return input
    input = input.contiguous()
    if output_split_sizes is None:
        output = torch.empty_like(input)
    else:
        output = input.new_empty((_rows(output_split_sizes),) + tuple(input.shape[1:]))
    communicator_for_group(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes)
    return output


def _mappings() -> Any:
    try:
        from megatron.core.tensor_parallel import mappings
    except ImportError as exc:
        raise ImportError(
            "moecomm.integrations.megatron needs megatron-core (pip install megatron-core); "
            f"importing megatron.core.tensor_parallel.mappings failed: {exc}"
        ) from exc
    return mappings


def installed_version() -> Optional[str]:
    """The installed megatron-core's version string (``None`` when it is not installed)."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def check_version(version: Optional[str]) -> Optional[str]:
    """Why megatron-core ``version`` cannot be used with moecomm, or ``None`` when it can.

    ``None`` (not installed, or no package metadata: a source checkout) passes; an unparsable
    string or a release older than :data:`SUPPORTED` does not.
    """
    if version is None:
        return None
    release = re.match(r"(\d+)\.(\d+)", version)
    if release and (int(release[1]), int(release[2])) >= SUPPORTED:
        return None
    oldest = ".".join(map(str, SUPPORTED))
    return (f"megatron-core {version} is not supported by moecomm.integrations.megatron (supported: {oldest} and "
            f"later; tested: 0.19.2). On Python 3.11, plain `pip install megatron-core` picks 0.16.1; install 0.19 "
            f"as the README says (\"Megatron-core and DeepSpeed\"): {INSTALL}")


def _moe_modules() -> tuple:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    return moe_utils, token_dispatcher


def _enable_permute() -> None:
    from ._permute import make_permute, make_unpermute

    moe_utils, token_dispatcher = _moe_modules()
    originals = {n: getattr(moe_utils, n, None) for n in _PERMUTE_NAMES}
    if any(f is None for f in originals.values()):
        raise RuntimeError("megatron.core.transformer.moe.moe_utils.permute/unpermute not found: this megatron-core "
                           "version is not supported by moecomm.integrations (permute=False skips them)")
    replacements = {"permute": make_permute(originals["permute"]), "unpermute": make_unpermute(originals["unpermute"])}
    saved = {}
    for module in (moe_utils, token_dispatcher):
        for name in _PERMUTE_NAMES:
            if getattr(module, name, None) is originals[name]:
                saved[(module, name)] = originals[name]
                setattr(module, name, replacements[name])
    _state["permute"] = saved


def _moe_layer_class() -> Any:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if "forward" not in MoELayer.__dict__:
        raise RuntimeError("megatron.core.transformer.moe.moe_layer.MoELayer.forward not found: this megatron-core "
                           "version is not supported by moecomm.integrations (layer='moecomm')")
    return MoELayer


def _enable_layer() -> None:
    from ._megatron_layer import layer_forward

    cls = _moe_layer_class()
    original = cls.__dict__["forward"]

    def forward(self: Any, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                padding_mask: Optional[torch.Tensor] = None) -> tuple:
        return layer_forward(original, self, hidden_states, intermediate_tensors, padding_mask)

    forward.__doc__ = original.__doc__
    cls.forward = forward
    _state["layer"] = original


def enable(*, permute: bool = True, layer: str = "moecomm") -> None:
    """Route Megatron-core's ``_AllToAll`` (forward and backward) through moecomm.

    Args:
        permute: also run the dispatcher's unfused permutation and unpermutation on moecomm's
            gather kernels (see the module docstring; False: only the exchange).
        layer: ``"moecomm"`` (the default): every ``MoELayer`` (built before or after) runs its
            permutation, exchanges, experts and unpermutation as moecomm's fused step (see the
            module docstring for what is supported; other layers keep Megatron's path, with one
            log line naming why); results equal Megatron's to float rounding. ``"megatron"``:
            Megatron's own ``forward``, only its exchanges (and with ``permute``, its
            permutation) on moecomm, with Megatron's bits.

    Call it on every rank, before or after building the model (the patch is on the class, so
    existing dispatchers are covered). Idempotent. A communicator is made for a group on its
    first exchange; call :func:`moecomm.init` first to have the default one reused.
    A later call adds what it asks for (``permute=True``, ``layer="moecomm"``) and never takes
    away (``layer="megatron"`` leaves an enabled moecomm layer on): :func:`disable` removes all,
    and ``enable(layer="megatron")`` after it keeps Megatron's own layer.

    Raises:
        ImportError: megatron-core is not installed (the message says so).
        RuntimeError: the installed megatron-core is older than :data:`SUPPORTED` (the message
            gives the README's install recipe), or its ``_AllToAll`` has no ``forward`` to
            replace (or, with ``permute``, no ``moe_utils.permute`` / ``unpermute``; with
            ``layer="moecomm"``, no ``MoELayer.forward``).
        TypeError: ``permute`` is not a bool. ValueError: ``layer`` is not one of :data:`LAYERS`.
    """
    if not isinstance(permute, bool):
        raise TypeError(f"enable: permute must be a bool, got {permute!r}")
    if layer not in LAYERS:
        raise ValueError(f"enable: layer must be one of {LAYERS}, got {layer!r}")
    if "all_to_all" not in _state:
        why = check_version(installed_version())
        if why is not None:
            raise RuntimeError(why)
        mappings = _mappings()
        _state["all_to_all"] = patch_all_to_all(
            mappings, _forward, "megatron.core.tensor_parallel.mappings._AllToAll.forward", "megatron-core")
    if permute and "permute" not in _state:
        _enable_permute()
    if layer == "moecomm" and "layer" not in _state:
        _enable_layer()


def disable() -> None:
    """Put Megatron's own ``_AllToAll.forward``, ``permute`` / ``unpermute`` and ``MoELayer.forward`` back
    (no-op when not enabled)."""
    patch: Optional[Patch] = _state.pop("all_to_all", None)
    if patch is not None:
        patch.disable()
    for (module, name), original in _state.pop("permute", {}).items():
        setattr(module, name, original)
    forward = _state.pop("layer", None)
    if forward is not None:
        _moe_layer_class().forward = forward


def is_enabled() -> bool:
    """True between :func:`enable` and :func:`disable` (the exchange is routed)."""
    patch = _state.get("all_to_all")
    return patch is not None and patch.enabled


def layer_enabled() -> bool:
    """True while ``enable(layer="moecomm")`` is in effect."""
    return "layer" in _state


def layer_fallback_reason(layer: Any) -> Optional[str]:
    """Why ``layer`` (a ``MoELayer``) ran Megatron's own ``forward`` at its last call under
    ``enable(layer="moecomm")``; None when it ran on moecomm's (or has not run since)."""
    from ._megatron_layer import fallback_reason

    return fallback_reason(layer)


def permute_enabled() -> bool:
    """True while the permutation runs on moecomm's kernels (``enable(permute=True)``)."""
    return bool(_state.get("permute"))
