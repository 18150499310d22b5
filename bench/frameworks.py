"""Megatron-core's token dispatcher and DeepSpeed's MoE layer, with and without moecomm, side by side.

Run one rank per GPU under torchrun (NCCL)::

    torchrun --nproc-per-node 2 -m bench.frameworks --json bench/results/h200x2/frameworks.json
    torchrun --nproc-per-node 2 -m bench.frameworks --p2p-bytes 2G   # moecomm with peer memory

or under mpirun, also with several ranks sharing a GPU (start MPS first: ../shared/DEVICE.md)::

    mpirun -n 4 python3 -m bench.frameworks --only megatron

Where every rank has a GPU of its own, torch.distributed runs on NCCL and moecomm on that
group. Where ranks share a GPU, NCCL refuses them (``Duplicate GPU detected``): torch.distributed
then runs on gloo, so the frameworks' own exchanges (the baselines) stage through the host,
and moecomm on its peer backend (CUDA IPC, no NCCL); the report's ``launch`` says which.

CPU smoke run (gloo, tiny sizes; Megatron's CUDA-only calls get stand-ins, as in the tests)::

    torchrun --nproc-per-node 2 -m bench.frameworks --device cpu --tokens 64 --model-dim 16 \\
        --hidden 16 --experts 4 --iters 2 --warmup 1

GPU defaults: bf16, 8192 tokens per rank, model_dim = expert hidden = 2048, 16 experts,
forward + backward. Every round runs each method once, in a random order, between two
synchronisations; times are the slowest rank's, median (and 10th/90th percentiles) over
``--iters`` rounds after ``--warmup``.

* **megatron**: ``MoEAlltoAllTokenDispatcher`` (top ``--megatron-k``, dropless) with a
  two-matmul expert per local expert; methods ``nccl`` (Megatron's own
  ``torch.distributed.all_to_all_single`` and torch permute/unpermute), ``moecomm``
  (``enable(layer="megatron")``: the exchange and the permutation on moecomm) and
  ``moecomm-a2a`` (``enable(permute=False, layer="megatron")``: the exchange only). ``a2a_ms``:
  forward ``token_dispatch`` + ``token_combine`` (the tokens, probabilities and combine
  exchanges; CUDA events around them); ``step_ms``: the whole pipeline forward + backward. Ratios: moecomm / nccl (and moecomm-a2a / nccl).
* **megatron_layer**: Megatron-core's own ``MoELayer`` (its TopKRouter, alltoall dispatcher and
  ``SequentialMLP`` experts, built without Transformer Engine; top ``--megatron-k``): methods
  ``megatron``, ``moecomm`` (``enable()``, the default: the layer on moecomm's fused step) and
  ``moecomm-exchange`` (``enable(layer="megatron")``: Megatron's forward with its exchanges and
  permutation on moecomm); ``step_ms`` forward + backward. Ratios: each / megatron.
* **deepspeed**: ``deepspeed.moe.layer.MoE`` (capacity factor 1.0, a two-layer GELU expert)
  at each ``--ks``; methods ``native`` (DeepSpeed's sparse encode/decode and its exchange),
  ``tutel`` (``use_tutel=True`` on moecomm's kernels, DeepSpeed's exchange) and
  ``tutel+moecomm`` (the kernels and moecomm's exchange) and ``moecomm-layer``
  (``enable(layer="moecomm")``: the layer's dispatch, experts as one grouped FFN and combine on
  moecomm, moecomm's exchange). ``step_ms``: forward + backward of the layer and its aux loss.
  Ratios: each / native.
* **torchtitan**: torchtitan's ``MoE`` (top ``--titan-k``), native and on moecomm
  (:mod:`bench.frameworks_torchtitan`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import sys
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

import moecomm
from moecomm.launch import detect_launcher
from . import frameworks_torchtitan
from ._common import DTYPES, FLOAT_DTYPES, prog

__all__ = ["main", "build_parser"]


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog(__spec__.name), description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, default=None, help="default: bfloat16 (cuda), float32 (cpu)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--model-dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048, help="expert hidden size")
    p.add_argument("--experts", type=int, default=16, help="experts over all ranks")
    p.add_argument("--ks", default="2,3", help="DeepSpeed top-k values")
    p.add_argument("--megatron-k", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--p2p-bytes", type=_size, default=None, help="moecomm.init(p2p_bytes=) on one node")
    p.add_argument("--only", choices=("megatron", "deepspeed", "torchtitan"), default=None)
    frameworks_torchtitan.add_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    return p


class _CpuStream:
    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self) -> "_CpuStream":
        return self

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def _megatron_cpu_standins(on_cpu: bool):
    """CPU smoke runs only: Megatron's CUDA-only calls as stand-ins (never used on GPUs)."""
    if not on_cpu:
        yield
        return
    from megatron.core.transformer.moe import token_dispatcher

    stream = _CpuStream()
    saved = {n: getattr(torch.cuda, n) for n in ("current_device", "Stream", "current_stream", "stream")}
    host = token_dispatcher.maybe_move_tensor_to_cpu
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    token_dispatcher.maybe_move_tensor_to_cpu = (
        lambda t, as_numpy=False, record_stream=False: t.numpy() if as_numpy and torch.is_tensor(t) else t)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)
        token_dispatcher.maybe_move_tensor_to_cpu = host


class _Clock:
    """Wall time of a callable between synchronisations, maxed over ranks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reduce_on = device if dist.get_backend() != "gloo" else torch.device("cpu")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, fn: Callable[[], Any]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.reduce_on)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt) * 1e3

    def max_over_ranks(self, ms: float) -> float:
        t = torch.tensor([ms], dtype=torch.float64, device=self.reduce_on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)


class _Span:
    """Milliseconds spent inside ``with span:`` blocks (CUDA events on GPUs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pairs: list = []
        self.host = 0.0

    @contextlib.contextmanager
    def __call__(self):
        if self.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self.pairs.append((a, b))
        else:
            t0 = time.perf_counter()
            yield
            self.host += (time.perf_counter() - t0) * 1e3

    def total(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return sum(a.elapsed_time(b) for a, b in self.pairs)
        return self.host


def _stats(samples: list) -> dict:
    a = np.asarray(samples, dtype=np.float64)
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "samples": len(samples)}


def _rounds(methods: dict, clock: _Clock, args: argparse.Namespace, rng: random.Random) -> dict:
    """Each round: every method once, in an order all ranks agree on."""
    out: dict = {name: {} for name in methods}
    for i in range(args.warmup + args.iters):
        order = list(methods)
        rng.shuffle(order)
        for name in order:
            result = methods[name](clock)
            if i >= args.warmup:
                for key, value in result.items():
                    out[name].setdefault(key, []).append(value)
    return {name: {key: _stats(v) for key, v in per.items()} for name, per in out.items()}


# ---------------------------------------------------------------------------------------
# Megatron-core


def bench_megatron(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, rng: random.Random) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moecomm.integrations import megatron

    W, R = dist.get_world_size(), dist.get_rank()
    E, M, H, T, k = args.experts, args.model_dim, args.hidden, args.tokens, args.megatron_k
    local = E // W
    cfg = TransformerConfig(num_layers=1, hidden_size=M, num_attention_heads=1, num_moe_experts=E,
                            moe_router_topk=k, moe_token_dispatcher_type="alltoall", moe_permute_fusion=False,
                            expert_model_parallel_size=W, add_bias_linear=False, moe_router_pre_softmax=k == 1,
                            params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    pgs = ProcessGroupCollection(ep=dist.group.WORLD, tp_ep=dist.group.WORLD)
    dispatcher = MoEAlltoAllTokenDispatcher(local, list(range(R * local, (R + 1) * local)), cfg, pg_collection=pgs)
    g = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + R)
    hidden = torch.randn(T, 1, M, generator=g).to(device, dtype).requires_grad_(True)
    scores = torch.randn(T, E, generator=g)
    routing = torch.zeros(T, E, dtype=torch.bool).scatter_(1, scores.topk(k, dim=1).indices, True).to(device)
    probs = (torch.softmax(scores, 1).to(device) * routing).requires_grad_(True)
    w1 = (torch.randn(local, M, H, generator=g) / M ** 0.5).to(device, dtype).requires_grad_(True)
    w2 = (torch.randn(local, H, M, generator=g) / H ** 0.5).to(device, dtype).requires_grad_(True)
    grad = torch.randn(T, 1, M, generator=g).to(device, dtype)

    def step(clock: _Clock) -> dict:
        span = _Span(device)

        def run() -> None:
            tokens, p = dispatcher.dispatch_preprocess(hidden, routing, probs)
            with span():
                tokens, p = dispatcher.token_dispatch(tokens, p)
            tokens, per_expert, p = dispatcher.dispatch_postprocess(tokens, p)
            chunks = torch.split(tokens, [int(c) for c in per_expert])
            y = torch.cat([torch.nn.functional.gelu(c @ w1[e]) @ w2[e] for e, c in enumerate(chunks)])
            y = dispatcher.combine_preprocess(y * p.unsqueeze(-1).to(y.dtype))
            with span():
                y = dispatcher.token_combine(y)
            out = dispatcher.combine_postprocess(y)
            out.backward(grad)
            for t in (hidden, probs, w1, w2):
                t.grad = None

        step_ms = clock.run(run)
        return {"step_ms": step_ms, "a2a_ms": clock.max_over_ranks(span.total())}

    def routed(permute: bool) -> Callable[[_Clock], dict]:
        def timed(clock: _Clock) -> dict:
            megatron.enable(permute=permute, layer="megatron")
            try:
                return step(clock)
            finally:
                megatron.disable()

        return timed

    res = _rounds({"nccl": step, "moecomm": routed(True), "moecomm-a2a": routed(False)}, clock=_Clock(device),
                  args=args, rng=rng)
    ratios = {key: res["moecomm"][key]["median_ms"] / res["nccl"][key]["median_ms"] for key in ("a2a_ms", "step_ms")}
    ratios_a2a = {key: res["moecomm-a2a"][key]["median_ms"] / res["nccl"][key]["median_ms"]
                  for key in ("a2a_ms", "step_ms")}
    return {"config": {"k": k, "tokens": T, "model_dim": M, "hidden": H, "experts": E, "dtype": str(dtype)},
            "methods": res, "ratio_moecomm_over_nccl": ratios, "ratio_moecomm_a2a_over_nccl": ratios_a2a}


def bench_megatron_layer(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                         rng: random.Random) -> dict:
    """Megatron-core's own ``MoELayer`` (TopKRouter, alltoall dispatcher, ``SequentialMLP``
    GELU experts, built without Transformer Engine), forward + backward: ``megatron`` (its own
    forward), ``moecomm`` (``enable()``, the default: the layer's step on moecomm) and
    ``moecomm-exchange`` (``enable(layer="megatron")``: Megatron's forward, its exchanges and
    permutation on moecomm)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moecomm.integrations import megatron

    W, R = dist.get_world_size(), dist.get_rank()
    E, M, H, T, k = args.experts, args.model_dim, args.hidden, args.tokens, args.megatron_k
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=W)
    cfg = TransformerConfig(num_layers=1, hidden_size=M, num_attention_heads=1, num_moe_experts=E,
                            ffn_hidden_size=H, moe_ffn_hidden_size=H, moe_router_topk=k,
                            moe_token_dispatcher_type="alltoall", moe_permute_fusion=False,
                            expert_model_parallel_size=W, add_bias_linear=False, moe_router_pre_softmax=k == 1,
                            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                            params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                            use_cpu_initialization=True)  # (GPU initialization needs Megatron's CUDA RNG tracker)
    torch.manual_seed(args.seed)
    layer = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)(
        config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    layer.set_layer_number(1)
    layer = layer.to(device, dtype).train()
    g = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + R)
    x = torch.randn(T, 1, M, generator=g).to(device, dtype).requires_grad_(True)
    grad = torch.randn(T, 1, M, generator=g).to(device, dtype)

    def method(enabled: bool = True, **kw: Any) -> Callable[[_Clock], dict]:
        def timed(clock: _Clock) -> dict:
            if enabled:
                megatron.enable(**kw)
            try:
                def run() -> None:
                    y, _ = layer(x)
                    y.backward(grad)
                    x.grad = None
                    for p in layer.parameters():
                        p.grad = None
                return {"step_ms": clock.run(run)}
            finally:
                megatron.disable()
        return timed

    methods = {"megatron": method(enabled=False), "moecomm": method(), "moecomm-exchange": method(layer="megatron")}
    res = _rounds(methods, clock=_Clock(device), args=args, rng=rng)
    why = megatron.layer_fallback_reason(layer)
    return {"config": {"k": k, "tokens": T, "model_dim": M, "hidden": H, "experts": E, "dtype": str(dtype),
                       "experts_module": type(layer.experts).__name__},
            "methods": res, "moecomm_layer_fallback": why,
            "ratio_over_megatron": {n: res[n]["step_ms"]["median_ms"] / res["megatron"]["step_ms"]["median_ms"]
                                    for n in ("moecomm", "moecomm-exchange")}}


# ---------------------------------------------------------------------------------------
# DeepSpeed


def bench_deepspeed(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, rng: random.Random) -> dict:
    import deepspeed
    from deepspeed.moe.layer import MoE

    from moecomm.integrations import deepspeed as ds

    if device.type == "cpu":  # the CPU accelerator would JIT-build a shared-memory all-reduce op
        import importlib

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    W, R = dist.get_world_size(), dist.get_rank()
    E, M, H, T = args.experts, args.model_dim, args.hidden, args.tokens
    results: dict = {}
    modes = {"native": dict(use_tutel=False, kernels=False, exchange=False, layer="deepspeed"),
             "tutel": dict(use_tutel=True, kernels=True, exchange=False, layer="deepspeed"),
             "tutel+moecomm": dict(use_tutel=True, kernels=True, exchange=True, layer="deepspeed"),
             "moecomm-layer": dict(use_tutel=False, kernels=False, exchange=True, layer="moecomm")}
    for k in [int(v) for v in args.ks.split(",") if v.strip()]:
        layers = {}
        for name, m in modes.items():
            if m["kernels"]:
                ds.enable(tutel_kernels=True, exchange=False)  # DeepSpeed reads TUTEL_INSTALLED at build
            torch.manual_seed(args.seed)
            expert = torch.nn.Sequential(torch.nn.Linear(M, H), torch.nn.GELU(), torch.nn.Linear(H, M))
            layer = MoE(M, expert, num_experts=E, ep_size=W, k=k, capacity_factor=1.0, use_tutel=m["use_tutel"])
            layer.set_deepspeed_parallelism()
            layers[name] = layer.to(device, dtype)
            ds.disable()
            assert layer.deepspeed_moe.use_tutel == m["use_tutel"], "use_tutel was not taken"
        g = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + R)
        x = torch.randn(T, M, generator=g).to(device, dtype).requires_grad_(True)
        grad = torch.randn(T, M, generator=g).to(device, dtype)

        def method(name: str) -> Callable[[_Clock], dict]:
            m, layer = modes[name], layers[name]

            def run() -> None:
                out, l_aux, _ = layer(x)
                torch.autograd.backward([out, l_aux], [grad, torch.ones_like(l_aux)])
                x.grad = None
                layer.zero_grad(set_to_none=True)

            def timed(clock: _Clock) -> dict:
                if m["kernels"] or m["exchange"] or m["layer"] != "deepspeed":
                    ds.enable(tutel_kernels=m["kernels"], exchange=m["exchange"], layer=m["layer"])
                try:
                    return {"step_ms": clock.run(run)}
                finally:
                    ds.disable()
                    if m["layer"] != "deepspeed" and ds.layer_fallback_reason(layer.deepspeed_moe) is not None:
                        raise RuntimeError(f"bench: {name} ran DeepSpeed's own layer: "
                                           f"{ds.layer_fallback_reason(layer.deepspeed_moe)}")

            return timed

        res = _rounds({name: method(name) for name in modes}, clock=_Clock(device), args=args, rng=rng)
        base = res["native"]["step_ms"]["median_ms"]
        results[f"k{k}"] = {"methods": res,
                            "ratio_over_native": {n: res[n]["step_ms"]["median_ms"] / base for n in modes if n != "native"}}
    return {"config": {"tokens": T, "model_dim": M, "hidden": H, "experts": E, "dtype": str(dtype),
                       "capacity_factor": 1.0}, "by_k": results}


def _mpi_environment() -> tuple[int, int]:
    """Under mpirun: torch.distributed's variables from MPI (rank 0's host and a free port
    broadcast). Returns (local rank, ranks on this node)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    where = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        where = ("127.0.0.1" if local_size == world.Get_size() else socket.gethostname(), port)
    host, port = world.bcast(where, root=0)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(world.Get_rank()),
                      WORLD_SIZE=str(world.Get_size()), LOCAL_RANK=str(local_rank))
    return local_rank, local_size


def _start(args: argparse.Namespace) -> tuple[torch.device, dict]:
    """torch.distributed and moecomm's default communicator for this launch (see the module
    docstring). Returns the device and what was chosen."""
    launcher = detect_launcher()
    if launcher == "mpi" and not dist.is_initialized():
        local_rank, local_size = _mpi_environment()
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        torch.cuda.set_device(local_rank % gpus)
        device = torch.device("cuda", local_rank % gpus)
        shared = local_size > gpus
    else:
        device, shared = torch.device("cpu"), False
    if shared and launcher != "mpi":
        raise RuntimeError(f"bench.frameworks: {local_size} ranks on {torch.cuda.device_count()} GPU(s) need mpirun: "
                           "moecomm's peer backend for ranks sharing a GPU starts over MPI")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" and not shared else "gloo")
    if shared:
        comm = moecomm.init("peer", p2p_bytes=args.p2p_bytes)
    else:
        comm = moecomm.init(process_group=dist.group.WORLD, p2p_bytes=args.p2p_bytes)  # the default communicator
    return device, {"launcher": launcher, "ranks_per_node": local_size, "ranks_share_a_gpu": shared,
                    "torch_distributed": dist.get_backend(), "moecomm_backend": comm.backend}


def main(argv: Optional[list] = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    device, launch = _start(args)
    if args.experts % dist.get_world_size():
        raise ValueError(f"--experts ({args.experts}) must be a multiple of the world size ({dist.get_world_size()})")
    rng = random.Random(args.seed)  # the same method order on every rank
    report: dict = {"world_size": dist.get_world_size(), "device": torch.cuda.get_device_name(device)
                    if device.type == "cuda" else "cpu", "torch": torch.__version__, "launch": launch,
                    "args": vars(args)}
    if args.only in (None, "megatron"):
        with _megatron_cpu_standins(device.type == "cpu"):
            report["megatron"] = bench_megatron(args, device, dtype, rng)
            report["megatron_layer"] = bench_megatron_layer(args, device, dtype, rng)
    if args.only in (None, "deepspeed"):
        report["deepspeed"] = bench_deepspeed(args, device, dtype, rng)
    why_not = frameworks_torchtitan.unsupported()
    if args.only is None and why_not:  # (named alone, it runs and fails with torchtitan's own error)
        report["torchtitan"] = {"skipped": why_not}
    elif args.only in (None, "torchtitan"):
        report["torchtitan"] = frameworks_torchtitan.bench_torchtitan(args, device, dtype, rng, _Span, _Clock, _rounds)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks ({launch['launcher']}), torch.distributed on "
              f"{launch['torch_distributed']}, moecomm on {launch['moecomm_backend']}"
              + (", ranks sharing a GPU" if launch["ranks_share_a_gpu"] else ""), flush=True)
        if "megatron" in report:
            r = report["megatron"]["ratio_moecomm_over_nccl"]
            ra = report["megatron"]["ratio_moecomm_a2a_over_nccl"]
            base = launch["torch_distributed"]
            print(f"megatron dispatcher: a2a (dispatch + combine) moecomm/{base} = {r['a2a_ms']:.3f}, "
                  f"step = {r['step_ms']:.3f} (exchange only, permute=False: step = {ra['step_ms']:.3f})", flush=True)
        if "megatron_layer" in report:
            r = report["megatron_layer"]["ratio_over_megatron"]
            print(f"megatron MoELayer (SequentialMLP): step moecomm (enable())/megatron = {r['moecomm']:.3f}, "
                  f"layer='megatron' (exchange, permute)/megatron = {r['moecomm-exchange']:.3f}", flush=True)
        for key, res in report.get("deepspeed", {}).get("by_k", {}).items():
            ratios = ", ".join(f"{n}/native = {v:.3f}" for n, v in res["ratio_over_native"].items())
            print(f"deepspeed MoE {key}: {ratios}", flush=True)
        if "torchtitan" in report:
            print(frameworks_torchtitan.summary(report["torchtitan"]), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
