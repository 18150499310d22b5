"""MoE layer benchmark: forward + backward step time, tokens/s, TFLOP/s and peak memory.

Run one rank per GPU (or CPU ranks)::

    mpirun -np 2 python -m bench.moe_layer                        # GPUs: NCCL, bf16, the target sizes
    mpiexec -n 2 python -m bench.moe_layer --device cpu           # CPU: MPI, fp32, small sizes, quick

GPU defaults: 8192 tokens per rank, model_dim 2048, expert hidden 2048, 16 experts,
capacity factor 1.0, top-2 and top-3, bf16. One *step* is ``y = layer(x)`` and the backward
of ``y`` and the auxiliary loss (``x`` requires grad, parameter grads are reset to None).
``--steps`` steps run back to back between two synchronisations (the host runs ahead of the
GPU, as in training); the slowest rank's time per step; median and 10th/90th percentiles
over ``--iters`` samples. ``host_ms`` is the time the host took to issue a step (median, over
the steps of a sample): close to the step time means the step is bound by the host, or that
the host ran ahead until CUDA's launch queue was full and then waited for the GPU at each
launch. ``host1_ms`` (``host_first_ms`` in JSON) is the issue time of a sample's first step,
right after a synchronisation, when the queue is empty: the host's own cost of a step. ``--cuda-graph``
also times each configuration captured once into a CUDA graph and replayed (mode
``graph``, beside ``eager``): the step's GPU work without the host's cost of issuing it.
``--activation swiglu --dropless --reference`` (one rank) also times a plain-torch layer
written like torchtitan's (:mod:`bench.torch_moe`) on the same tokens and shapes and prints
the layer's step time over the reference's, and the expert GEMMs alone (the reference's grouped
GEMMs forward and backward with the routes spread evenly: what any layer on them spends at least).
``--layer-cuda-graph`` builds the layer with ``cuda_graph=True`` (rows ``"cuda_graph": true``,
mode ``eager``): the layer replays its own per-shape graphs inside each eager step.

TFLOP/s counts the expert matmuls actually run per rank (``12 * rows * model_dim * hidden``
for forward + backward, 18 for gated experts, rows = the slots this rank's experts process, padding included);
``useful`` counts only the routed tokens (``T * k`` rows per rank). Peak memory: ``torch.cuda.max_memory_allocated`` on GPUs, the
process's peak resident set on CPUs.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any, Optional

import numpy as np
import torch

import moecomm
from moecomm.graphs import capture
from moecomm.moe import MoELayer
from ._common import DTYPES, FLOAT_DTYPES, prog
from ._topology import RankZeroParser

from .alltoall import parse_size
from .host_profile import host_profile, sync_report

__all__ = ["main", "build_parser"]


def _own_first(text: str) -> list:
    values = [v.strip() for v in text.split(",")]
    if not values or any(v not in ("0", "1", "auto") for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of 0, 1 and auto, got {text!r}")
    return [v if v == "auto" else v == "1" for v in values]


_MODERN_ROUTING = dict(score_function="sigmoid", expert_bias=True, num_groups=4, group_topk=2)

ROUTERS = {
    "softmax": lambda args: {},
    "modern": lambda args: dict(_MODERN_ROUTING, shared_expert_size=args.hidden),
    "modern-routing": lambda args: dict(_MODERN_ROUTING),
    "softmax-shared": lambda args: dict(shared_expert_size=args.hidden),
}
"""``--router``: the layer's routing options of each preset (a function of the arguments)."""


def _activation(name: str) -> Any:
    """``--activation``: a name the layer knows, or ``lambda:F`` for ``lambda x: torch.nn.functional.F(x)``
    (Tutel's examples spell their activations so: issue 27 asks the fused step to take them)."""
    if not name.startswith("lambda:"):
        return name
    fn = getattr(torch.nn.functional, name[len("lambda:"):], None)
    if fn is None:
        raise SystemExit(f"--activation {name!r}: torch.nn.functional has no {name[len('lambda:'):]!r}")
    return lambda x: fn(x)


def _ints(text: str) -> list:
    out = []
    for part in text.split(","):
        part = part.strip()
        if part:
            out.append(part if part == "auto" else int(part))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = RankZeroParser(prog=prog(__spec__.name), description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--backend", default=None, help="moecomm backend (default: nccl on GPUs, mpi on CPUs)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (GPU 8192, CPU 256)")
    p.add_argument("--model-dim", type=int, default=None, help="GPU 2048, CPU 128")
    p.add_argument("--hidden", type=int, default=None, help="expert hidden size (GPU 2048, CPU 256)")
    p.add_argument("--experts", type=int, default=None, help="experts in total (GPU 16, CPU 2 per rank)")
    p.add_argument("--top-k", type=_ints, default=None, help="comma list of k (GPU 2,3; CPU 2)")
    p.add_argument("--capacity-factor", type=float, default=1.0, help="(1.0); 0 = just enough; < 0 bounded")
    p.add_argument("--dropless", action="store_true", help="route exactly the tokens each expert gets")
    p.add_argument("--equal-tokens", action="store_true",
                   help="inequivalent_tokens=False: promise equal token counts, no per-call agreement on them")
    p.add_argument("--overlap-degree", type=_ints, default=[1], help="comma list of degrees or 'auto' (1)")
    p.add_argument("--own-first", type=_own_first, default=["auto"],
                   help="comma list of 0, 1, auto: the layer's own_first (experts start on the own rows; auto)")
    p.add_argument("--algorithm", default=None, help="all_to_all_v algorithm: flat, 2dh, auto (default: core's)")
    p.add_argument("--parallel-mode", default="expert", choices=("expert", "data", "auto"))
    p.add_argument("--gate", default="linear", choices=("linear", "cosine"))
    p.add_argument("--activation", default="relu",
                   help="expert activation: relu (the layer's default), gelu, silu, swiglu, geglu, ...; "
                        "lambda:relu (any torch.nn.functional name) passes lambda x: F.relu(x)")
    p.add_argument("--router", default="softmax", choices=sorted(ROUTERS),
                   help="softmax (the layer's default); modern: sigmoid scores, an expert bias (aux-loss-free "
                        "balancing), 4 groups of which the best 2, and one shared SwiGLU expert of the experts' "
                        "hidden size (DeepSeek-V3's routing); modern-routing: the same without the shared "
                        "expert; softmax-shared: softmax with the shared expert (the two apart, to tell the "
                        "router's cost from the shared expert's work); rows say 'router'")
    p.add_argument("--reference", action="store_true",
                   help="one rank: also time bench.torch_moe.TorchMoE (plain torch, torchtitan's way: argsort "
                        "permutation, torch._grouped_mm) with the same shapes and activation (rows impl "
                        "'torch_reference'), and print the layer's step time over the reference's")
    p.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default=None, help="GPU bfloat16, CPU float32")
    p.add_argument("--autocast", action="store_true", help="fp32 parameters under torch.autocast(dtype)")
    p.add_argument("-n", "--iters", type=int, default=None, help="timed samples (GPU 20, CPU 5)")
    p.add_argument("--steps", type=int, default=None, help="steps per sample (GPU 10, CPU 2)")
    p.add_argument("-w", "--warmup", type=int, default=None, help="untimed steps first (GPU 5, CPU 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--max-ctas", type=int, default=None, help="NCCL: most CTAs per communication kernel (init(max_ctas=))")
    p.add_argument("--p2p-bytes", type=parse_size, default=None,
                   help="GPUs of one node: peer memory per rank (init(p2p_bytes=)); exchanges then move by copy engines")
    p.add_argument("--layer-cuda-graph", action="store_true",
                   help="MoELayer(cuda_graph=True): the layer replays per-shape graphs of its capacity step "
                        "inside each eager step (rows say cuda_graph: true)")
    p.add_argument("--op-by-op", action="store_true",
                   help="MoELayer(fused_step=False): the capacity step op by op, as before the fused step "
                        "(rows say fused_step: false)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="GPU: time every configuration also as a captured CUDA graph (mode 'graph')")
    p.add_argument("--profile", metavar="PATH", help="write a torch profiler trace of a few steps (rank 0; every rank where PATH "
                   "has {rank}, formatted with the rank)")
    p.add_argument("--sync-report", action="store_true",
                   help="GPU: list the host synchronisations of one step (torch.cuda.set_sync_debug_mode), rank 0")
    p.add_argument("--host-profile", action="store_true",
                   help="print a cProfile of the host work of 10 steps at the first k and degree (rank 0)")
    p.add_argument("--stamps", type=int, default=0, metavar="N",
                   help="then N steps with GPU time stamps around every exchange, every rank's on one time line "
                        "(bench.exchange_stamps; rank 0 prints where the exchanges' time goes)")
    p.add_argument("--peer-copy-engines", action="store_true",
                   help="peer backend: move the exchanges' rows with copy engines (as before), not SM kernels")
    p.add_argument("--peer-agree-equal", action="store_true",
                   help="diagnostic, peer backend: the capacity exchanges (equal blocks) agree on the host first, "
                        "as before they skipped it (to compare side by side)")
    p.add_argument("--seg-kernels", choices=("default", "on", "off"), default="default",
                   help="diagnostic: the dropless experts' biases (and ReLU) and bias gradients by moecomm_ext's "
                        "segment kernels on every device (on; the library's default runs them on CPU tensors only "
                        "until their CUDA tests have run on a GPU: moecomm_ext._seg.NATIVE_DEVICE_TYPES), or by the "
                        "torch ops they replace (off: a row gather and an add, a grouped GEMM with ones), to compare")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rank 0)")
    return p


def _defaults(a: argparse.Namespace, cuda: bool, world: int) -> None:
    for name, gpu, cpu in (("tokens", 8192, 256), ("model_dim", 2048, 128), ("hidden", 2048, 256),
                           ("experts", 16, 2 * world), ("top_k", [2, 3], [2]), ("dtype", "bfloat16", "float32"),
                           ("iters", 20, 5), ("steps", 10, 2), ("warmup", 5, 2)):
        if getattr(a, name) is None:
            setattr(a, name, gpu if cuda else cpu)


class Bench:
    def __init__(self, args, comm):
        self.args, self.comm = args, comm
        dt = DTYPES[args.dtype]
        pdtype = torch.float32 if args.autocast else dt
        dev = comm.device
        self.layer = MoELayer(args.model_dim, args.hidden, args.experts, k=max(k for k in args.top_k),
                              capacity_factor=args.capacity_factor, dropless=args.dropless, gate=args.gate,
                              activation=_activation(args.activation), parallel_mode=args.parallel_mode,
                              algorithm=args.algorithm, seed=args.seed, comm=comm, dtype=pdtype, device=dev,
                              inequivalent_tokens=not args.equal_tokens, cuda_graph=args.layer_cuda_graph,
                              fused_step=not args.op_by_op, **ROUTERS[args.router](args))
        g = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + comm.rank)
        self.x = torch.randn(args.tokens, args.model_dim, generator=g).to(dev, dt).requires_grad_(True)
        self.gy = torch.randn(args.tokens, args.model_dim, generator=g).to(dev, dt)
        self.dtype = dt
        self.params = [p for p in self.layer.parameters()] + [self.x]

    def step(self, **kw) -> None:
        for p in self.params:
            p.grad = None
        if self.args.autocast:
            with torch.autocast(self.comm.device.type, dtype=self.dtype):
                y = self.layer(self.x, **kw)
        else:
            y = self.layer(self.x, **kw)
        torch.autograd.backward([y, self.layer.aux_loss], [self.gy.to(y.dtype), torch.ones_like(self.layer.aux_loss)])
        # as a training step's losses go out of scope: a kept graph would keep its AccumulateGrad
        # nodes (and their streams) alive into the next step, which CUDA graph capture refuses
        self.layer.aux_loss = self.layer.balance_loss = None

    def sync(self) -> None:
        if self.comm.device.type == "cuda":
            torch.cuda.synchronize(self.comm.device)

    def slowest(self, values: list) -> np.ndarray:
        t = torch.tensor(values, dtype=torch.float64, device=self.comm.device)
        if self.comm.size > 1:
            self.comm.allreduce(t, "max")
        return t.cpu().numpy()

    def capture(self, **kw) -> "torch.cuda.CUDAGraph":
        """One step captured into a CUDA graph; the parameters' grads become its outputs."""
        return capture(lambda: self.step(**kw), self.comm.device)[0]

    def time(self, step=None, replayed: bool = False, **kw) -> dict:
        """Step times of ``step`` (default: the layer's step with ``kw``); ``replayed``: ``step``
        replays a captured graph (its collectives watched)."""
        a = self.args
        run = step if step is not None else (lambda: self.step(**kw))
        for _ in range(a.warmup):
            run()
        self.sync()
        if self.comm.size > 1:
            self.comm.barrier()
        samples, issue, first = [], [], []
        for _ in range(a.iters):
            self.sync()
            t0 = time.perf_counter()
            run()
            first.append(time.perf_counter() - t0)
            for _ in range(a.steps - 1):
                run()
            if replayed:  # replayed collectives: only this watchdog entry bounds their wait
                self.comm.watch_stream("a replay of the captured MoE step")
            issue.append((time.perf_counter() - t0) / a.steps)
            self.sync()
            samples.append((time.perf_counter() - t0) / a.steps)
        s = self.slowest(samples)
        h = self.slowest(issue)
        h1 = self.slowest(first)
        return {"median_ms": float(np.median(s)) * 1e3, "p10_ms": float(np.percentile(s, 10)) * 1e3,
                "p90_ms": float(np.percentile(s, 90)) * 1e3, "host_ms": float(np.median(h)) * 1e3,
                "host_first_ms": float(np.median(h1)) * 1e3}


def _report_stamps(b: "Bench", comm: Any, steps: int, kw: dict) -> None:
    """``--stamps``: ``steps`` steps with every exchange stamped (:mod:`bench.exchange_stamps`)."""
    from .exchange_stamps import ExchangeStamps, summarize

    stamp = None if comm.device.type == "cuda" else (lambda buf, i: buf.__setitem__(i, time.perf_counter_ns()))
    stamps = ExchangeStamps(comm, stamp=stamp)
    b.step(**kw)
    b.sync()
    with stamps:
        for _ in range(steps):
            b.step(**kw)
    rows = stamps.collect()
    if comm.size > 1:
        from mpi4py import MPI

        every = MPI.COMM_WORLD.gather(rows, root=0)
    else:
        every = [rows]
    if comm.rank == 0:
        print(f"# exchange stamps, {steps} steps\n" + summarize(every, max(1, len(rows) // steps)), flush=True)


def _time_reference(args: argparse.Namespace, b: Bench) -> list:
    """``--reference``: the plain-torch layer (:mod:`bench.torch_moe`) timed as the layer is,
    per k, with the same tokens and shapes."""
    from .torch_moe import REFERENCE_ACTIVATIONS, TorchMoE

    if b.comm.size != 1:
        raise SystemExit("--reference runs on one rank (the reference has no exchange)")
    if args.activation not in REFERENCE_ACTIVATIONS:
        raise SystemExit(f"--reference: --activation {args.activation!r} has no reference; known: "
                         f"{sorted(REFERENCE_ACTIVATIONS)}")
    torch.manual_seed(args.seed)
    ref = TorchMoE(args.model_dim, args.hidden, args.experts, 1, args.activation, dtype=b.dtype,
                   device=b.comm.device)
    params = list(ref.parameters()) + [b.x]

    def step() -> None:
        for q in params:
            q.grad = None
        ref(b.x).backward(b.gy)

    out = []
    for k in args.top_k:
        ref.k = k
        t = b.time(step)
        out.append({"impl": "torch_reference", "activation": args.activation, "k": k, "mode": "eager",
                    "dropless": True, **t, "tokens_per_s": args.tokens / (t["median_ms"] / 1e3)})
        t = b.time(ref.gemm_floor_step(args.tokens))
        out.append({"impl": "gemm_floor", "activation": args.activation, "k": k, "mode": "eager", **t})
    return out


def _peak_bytes(comm) -> int:
    if comm.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(comm.device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def main(argv: Optional[list] = None) -> list:
    args = build_parser().parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    backend = args.backend or ("auto" if cuda else "mpi")
    if not cuda:
        torch.set_num_threads(1)
    comm = moecomm.init(backend=backend, timeout=args.timeout, max_ctas=args.max_ctas, p2p_bytes=args.p2p_bytes)
    _defaults(args, cuda, comm.size)
    if args.peer_agree_equal and comm.backend == "peer":
        comm.engine.backend.alltoall_equal = lambda *a, **kw: None  # (None: the backend's agreed path)
    if args.peer_copy_engines and comm.backend == "peer":
        comm.engine.backend.transport.copy_kernels = False
    if args.seg_kernels != "default":  # (this process only)
        from moecomm_ext import _seg

        _seg.NATIVE_DEVICE_TYPES = ("cpu", "cuda") if args.seg_kernels == "on" else ()
    if cuda:
        torch.cuda.set_device(comm.device)
    b = Bench(args, comm)
    L = b.layer
    rank0 = comm.rank == 0
    results = []
    modes = ["eager", "graph"] if args.cuda_graph and cuda else ["eager"]
    for k, deg, own, mode in [(k, d, o, m) for k in args.top_k for d in args.overlap_degree for o in args.own_first
                              for m in modes]:
        kw = dict(k=k, overlap_degree=deg, own_first=own)
        if cuda:
            torch.cuda.reset_peak_memory_stats(comm.device)
        if rank0:
            sys.stderr.write(f"k={k} overlap_degree={deg} own_first={own} {mode} ...\n")
        if mode == "graph":
            graph = b.capture(**kw)
            t = b.time(graph.replay, replayed=True)
        else:
            t = b.time(**kw)
        r = L.last_routing
        if r.capacity is not None:
            # slots this rank's experts process: El experts x C from each of W sources (= E * C), or
            # for an expert sharded over S ranks, C from each of the W sources
            rows = args.experts * r.capacity if L.shards == 1 else comm.size * r.capacity
        else:
            rows = args.tokens * k * L.shards  # what an average rank processes
        hidden_local = args.hidden // L.shards
        per_row = 18.0 if getattr(L.experts, "gated", False) else 12.0  # gated: three GEMMs' worth, not two
        flops = per_row * rows * args.model_dim * hidden_local
        useful = per_row * args.tokens * k * args.model_dim * args.hidden
        sec = t["median_ms"] / 1e3
        peak = int(b.slowest([float(_peak_bytes(comm))])[0])
        results.append({"impl": "moecomm", "activation": args.activation, "router": args.router, "k": k, "overlap_degree": deg, "own_first": own if own == "auto" else int(own),
                        "mode": mode, "dropless": args.dropless, "cuda_graph": args.layer_cuda_graph,
                        "fused_step": not args.op_by_op, "capacity": r.capacity, **t,
                        "tokens_per_s": args.tokens * comm.size / sec,
                        "tflops_per_rank": flops / sec / 1e12, "useful_tflops_per_rank": useful / sec / 1e12,
                        "peak_mem_gib": peak / 2 ** 30, "parallel_mode": L.last_parallel_mode})
        if mode == "graph":
            del graph
    if args.reference:
        results += _time_reference(args, b)
    if rank0:
        name = torch.cuda.get_device_name(comm.device) if cuda else "cpu"
        head = (f"# moecomm.moe layer: {comm.size} ranks, backend {comm.backend}, {name}, {args.dtype}"
                f"{' (autocast)' if args.autocast else ''}, {args.tokens} tokens/rank, model_dim {args.model_dim}, "
                f"hidden {args.hidden}, {args.experts} experts, "
                f"{'dropless' if args.dropless else f'capacity_factor {args.capacity_factor}'}"
                f"{', layer cuda_graph=True' if args.layer_cuda_graph else ''}"
                f"{', fused_step=False' if args.op_by_op else ''}, "
                f"gate {args.gate}, {args.parallel_mode}-parallel, max_ctas {args.max_ctas or 'NCCL default'}, p2p_bytes {args.p2p_bytes or 'none'}, "
                f"torch {torch.__version__}")
        lines = [head, f"# step = forward + backward; {args.steps} steps per sample, {args.iters} samples; "
                       f"slowest rank; peak memory: {'max_memory_allocated' if cuda else 'max RSS'}",
                 f"{'k':>2} {'deg':>4} {'own':>4} {'mode':>5} {'cap':>6} {'median_ms':>10} {'p10_ms':>8} {'p90_ms':>8} {'tokens/s':>11} "
                 f"{'TFLOP/s':>8} {'useful':>7} {'peak_GiB':>9} {'host_ms':>8} {'host1_ms':>8}"]
        for r in results:
            if r["impl"] != "moecomm":
                continue
            lines.append(f"{r['k']:>2} {str(r['overlap_degree']):>4} {str(r['own_first']):>4} {r['mode']:>5} {str(r['capacity']):>6} {r['median_ms']:>10.3f} "
                         f"{r['p10_ms']:>8.3f} {r['p90_ms']:>8.3f} {r['tokens_per_s']:>11.4g} "
                         f"{r['tflops_per_rank']:>8.2f} {r['useful_tflops_per_rank']:>7.2f} {r['peak_mem_gib']:>9.3f} "
                         f"{r['host_ms']:>8.3f} {r.get('host_first_ms', float('nan')):>8.3f}")
        for r in results:
            if r["impl"] == "torch_reference":
                mine = [q["median_ms"] for q in results if q["impl"] == "moecomm" and q["k"] == r["k"]
                        and q["mode"] == "eager"]
                lines.append(f"# torch reference ({args.activation}, dropless) k={r['k']}: {r['median_ms']:.3f} ms "
                             f"(host {r['host_ms']:.3f} ms); moecomm / reference = "
                             f"{min(mine) / r['median_ms']:.3f}" if mine else "")
            if r["impl"] == "gemm_floor":
                lines.append(f"# the expert GEMMs alone (grouped, routes spread evenly, forward + backward) k={r['k']}: "
                             f"{r['median_ms']:.3f} ms")
        transport = getattr(comm.engine.backend, "transport", None)
        if transport is not None and hasattr(transport, "output_maps"):  # the peer backend (ranks sharing a GPU)
            lines.append(f"# peer backend (rank 0): {transport.output_maps} peers' output allocations mapped through "
                         f"CUDA IPC in the whole run")
        print("\n".join(lines), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"header": lines[:2], "results": results, "args": vars(args)}, fh, indent=1)
    first = dict(k=args.top_k[0], overlap_degree=args.overlap_degree[0], own_first=args.own_first[0])
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        kw = first
        graph = b.capture(**kw) if args.cuda_graph and cuda else None
        run = graph.replay if graph is not None else (lambda: b.step(**kw))
        run()
        b.sync()
        # with_stack only for the host's view (not for every rank's GPU time line): it slows the host
        # enough to change the GPU's timeline
        with profile(activities=acts, with_stack=graph is None and "{rank}" not in args.profile) as prof:
            for _ in range(3):
                run()
            b.sync()
        del run, graph  # a graph holding NCCL kernels must go before its communicator closes
        if "{rank}" in args.profile:
            prof.export_chrome_trace(args.profile.format(rank=comm.rank))
        if rank0:
            if "{rank}" not in args.profile:
                prof.export_chrome_trace(args.profile)
            print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                            row_limit=30), flush=True)
    if args.stamps:
        _report_stamps(b, comm, args.stamps, first)
    if args.sync_report and cuda:
        text = sync_report(lambda: b.step(**first), sync=b.sync)
        if rank0:
            print(text, flush=True)
    if args.host_profile:
        text = host_profile(lambda: b.step(**first), sync=b.sync)
        if rank0:
            print(text, flush=True)
    comm.close()
    return results


if __name__ == "__main__":
    main()
