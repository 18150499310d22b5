"""torchtitan's MoE with and without moecomm: the ``torchtitan`` section of :mod:`bench.frameworks`.

torchtitan's own ``MoE`` module (router, ``AllToAllTokenDispatcher``, ``GroupedExperts``; the
experts compute in bf16, as torchtitan's do) with ``--experts`` experts, each rank keeping its
slice of the expert weights (what ``parallelize`` leaves the experts after ``to_local()``) and
the EP mesh wired with ``wire_meshes``. Methods ``native`` (torchtitan's own exchanges, under
``--titan-spmd-backend``) and ``moecomm`` (:func:`moecomm.integrations.torchtitan.enable`).
``a2a_ms``: the forward dispatch and combine exchanges (CUDA events around them); ``step_ms``:
the layer's forward + backward. Ratio: moecomm / native.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import random
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["add_arguments", "bench_torchtitan", "summary", "unsupported"]

SPMD_BACKENDS = ("spmd_types", "partial_dtensor")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The torchtitan section's options."""
    p.add_argument("--titan-k", type=int, default=2, help="torchtitan top-k")
    p.add_argument("--titan-spmd-backend", choices=SPMD_BACKENDS, default=None,
                   help="torchtitan's parallelism.spmd_backend for the native path; default: spmd_types (its own "
                        "default) on cuda, partial_dtensor on cpu (gloo's list all_to_all takes equal sizes only)")


@contextlib.contextmanager
def spmd_backend(name: str, mesh: Any) -> Iterator[None]:
    """torchtitan's ``parallelism.spmd_backend`` set to ``name`` (one of :data:`SPMD_BACKENDS`)
    on ``mesh`` for the block, the previous one restored after it."""
    from torchtitan.distributed import spmd_types as tt_spmd
    from torchtitan.distributed import utils

    saved = utils.get_spmd_backend()
    utils.set_spmd_backend(name)
    tt_spmd.set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh if name == "spmd_types" else None)
    try:
        yield
    finally:
        utils.set_spmd_backend(saved)


def build_moe(experts: int, dim: int, hidden: int, top_k: int, seed: int, mesh: Any,
              scale: Optional[float] = None, wire: bool = True) -> Any:
    """torchtitan's MoE (softmax top-``top_k`` router, ``experts`` grouped SwiGLU experts of
    ``dim`` x ``hidden``), the same weights on every rank (``seed``; each scaled by ``scale``, or
    by ``1/sqrt(fan-in)`` when None), this rank's slice of the experts kept, the expert-parallel
    ``mesh`` wired (``wire``; else the caller wires it, after moving the module): what
    ``parallelize()`` leaves the experts as. On the CPU, in float32."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    W, R = dist.get_world_size(), dist.get_rank()
    local = experts // W
    cfg = MoE.Config(
        num_experts=experts,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=experts, top_k=top_k)),
        router=TokenChoiceTopKRouter.Config(num_experts=experts,
                                            gate=Linear.Config(in_features=dim, out_features=experts),
                                            top_k=top_k, score_func="softmax"),
        load_balance_coeff=None)
    moe = cfg.build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if scale is None else scale))
    inner = moe.routed_experts.inner_experts
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        full = getattr(inner, name)
        setattr(inner, name, torch.nn.Parameter(full.detach()[R * local:(R + 1) * local].clone()))
    if wire:
        moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return moe


def _build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, mesh: Any) -> Any:
    moe = build_moe(args.experts, args.model_dim, args.hidden, args.titan_k, args.seed, mesh, wire=False)
    moe = moe.to(device, dtype)
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return moe


def _time_exchanges(dispatcher: Any, span: Callable[[], Any]) -> None:
    """Time the dispatcher's forward dispatch and combine exchanges, whichever implementation the
    class holds at call time (torchtitan's own, or moecomm's while enabled)."""
    cls = type(dispatcher)
    for name in ("_dispatch_token_exchange", "_combine_token_exchange"):
        def timed(*a: Any, _name: str = name) -> torch.Tensor:
            with span():
                return getattr(cls, _name)(dispatcher, *a)

        setattr(dispatcher, name, timed)


def bench_torchtitan(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, rng: random.Random,
                     span_type: type, clock_type: type, rounds: Callable[..., dict]) -> dict:
    """Native and moecomm timings of torchtitan's MoE (``span_type``, ``clock_type``, ``rounds``:
    :mod:`bench.frameworks`' ``_Span``, ``_Clock`` and ``_rounds``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from moecomm.integrations import torchtitan

    backend = args.titan_spmd_backend or ("spmd_types" if device.type == "cuda" else "partial_dtensor")
    W, R = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (W,), mesh_dim_names=("ep",))
    with spmd_backend(backend, mesh):
        moe = _build(args, device, dtype, mesh)
        g = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + R)
        x = torch.randn(1, args.tokens, args.model_dim, generator=g).to(device, dtype).requires_grad_(True)
        grad = torch.randn(1, args.tokens, args.model_dim, generator=g).to(device, dtype)

        def step(clock: Any) -> dict:
            span = span_type(device)
            _time_exchanges(moe.routed_experts.token_dispatcher, span)

            def run() -> None:
                moe(x).backward(grad)
                x.grad = None
                moe.zero_grad(set_to_none=True)

            step_ms = clock.run(run)
            return {"step_ms": step_ms, "a2a_ms": clock.max_over_ranks(span.total())}

        def with_moecomm(clock: Any) -> dict:
            torchtitan.enable()
            try:
                return step(clock)
            finally:
                torchtitan.disable()

        res = rounds({"native": step, "moecomm": with_moecomm}, clock=clock_type(device), args=args, rng=rng)
    ratios = {key: res["moecomm"][key]["median_ms"] / res["native"][key]["median_ms"] for key in ("a2a_ms", "step_ms")}
    return {"config": {"k": args.titan_k, "tokens": args.tokens, "model_dim": args.model_dim, "hidden": args.hidden,
                       "experts": args.experts, "dtype": str(dtype), "spmd_backend": backend},
            "methods": res, "ratio_moecomm_over_native": ratios}


def unsupported() -> Optional[str]:
    """Why torchtitan's own MoE cannot run under this torch (None: it can). torchtitan 0.3.0's
    token dispatcher calls ``torch.compiler._is_non_strict_tracing``, which torch 2.11 lacks."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed (pip install torchtitan==0.3.0; see moecomm.integrations.torchtitan)"
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        return (f"torchtitan's token dispatcher needs torch.compiler._is_non_strict_tracing (torch >= 2.12); "
                f"this torch is {torch.__version__}")
    return None


def summary(result: dict) -> str:
    """The line :mod:`bench.frameworks` prints for this section."""
    if "skipped" in result:
        return f"torchtitan MoE: skipped: {result['skipped']}"
    r = result["ratio_moecomm_over_native"]
    return (f"torchtitan MoE ({result['config']['spmd_backend']}): a2a (dispatch + combine) moecomm/native = "
            f"{r['a2a_ms']:.3f}, step = {r['step_ms']:.3f}")
