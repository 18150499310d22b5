"""Overlapped scatter/compute/gather benchmark: an expert FFN layer, forward + backward.

Run under MPI (one rank per GPU, or CPU ranks)::

    mpirun -np 2 python -m bench.overlap                       # GPUs: NCCL, bf16
    mpiexec -n 2 python -m bench.overlap --device cpu --small  # CPU: MPI, fp32, quick

Each rank holds ``--tokens`` rows of ``--model-dim`` (already routed: rows grouped by
destination rank, then by local expert), sends them to the experts' ranks, runs
``--experts-per-rank`` expert FFNs (``gelu(x @ W1) @ W2``, hidden ``--hidden``) and sends
the results back; then the backward pass. One *step* is that forward + backward.

Rows of the table:
  plain      moecomm.functional.all_to_all_v -> fn -> all_to_all_v back (no overlap)
  degree D   comm.scatter_compute_gather(..., degree=D); D=1 is the same computation, unchunked
  auto       degree="auto" (the stage count it chose in parentheses)
  oD, oauto  the same with own_first=True: fn starts on the rank's own rows while the peers'
             rows (in D stages) are in flight
  oD:F       own_first=True, own_split=F: the first F of the own rows first, the rest last
             (oD: the library's default own_split)

Times are per step: ``--steps`` steps are run back to back between two synchronisations
(as in training, where the host runs ahead of the GPU), the slowest rank's time divided by
``--steps``; median, 10th and 90th percentile over ``--iters`` such samples. ``vs_1`` is
the median over degree 1's. The header also gives the compute alone (fn forward +
backward on the same rows, no exchange) and the exchange alone (the layer with an
identity fn): overlap can save at most the smaller of the two.

Sizing: every stage costs the host a fixed time to issue (measured on 2 x H200: about
1 ms per extra stage for this layer, forward + backward), so chunking pays only when each
stage's GPU work is larger than that. At 16384 rows of 4096 (128 MiB per rank, compute and
exchange about 1.1 and 1.2 ms) the layer was host-bound and degree 1 fastest; the GPU
default is therefore 32768 rows (256 MiB per rank, compute and exchange still about equal). ``host_ms`` is the time the
host took to issue a step (when it nears the step time, the run is host-bound);
``--exchange-only`` adds ``xchg_ms``, each degree's step time with an identity fn.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

import moecomm
from moecomm.graphs import capture
from moecomm.functional import all_to_all_v
from moecomm.overlap import Chunk, auto_stages
from ._common import DTYPES, FLOAT_DTYPES, prog
from ._topology import RankZeroParser

from .alltoall import parse_size
from .host_profile import host_profile, sync_report

__all__ = ["main", "build_parser"]


def _parse_degrees(text: str) -> list:
    out: list = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if part in ("auto", "plain"):
            out.append(part)
        else:
            try:
                if part.startswith("o"):
                    _own_mode(part)
                    out.append(part)
                else:
                    out.append(int(part))
            except ValueError:
                raise argparse.ArgumentTypeError(f"degrees: expected ints, 'auto', 'plain', or those of "
                                                 f"own_first as oD, oauto, oD:F and oauto:F, got {part!r}") from None
    if 1 not in out:
        out.insert(0, 1)
    return out


def _own_mode(label: str) -> tuple:
    """``"oD"`` / ``"oauto"`` / ``"oD:F"``: (degree, scatter_compute_gather's own keywords)."""
    degree, _, split = label[1:].partition(":")
    kw: dict = {"own_first": True}
    if split:
        kw["own_split"] = float(split)
        if not 0.0 <= kw["own_split"] <= 1.0:
            raise ValueError(f"own_split {split} is not in [0, 1]")
    return ("auto" if degree == "auto" else int(degree)), kw


class Layer:
    """The routed rows, the experts and the step functions for one rank."""

    def __init__(self, args: argparse.Namespace, comm: "moecomm.Communicator") -> None:
        self.args, self.comm = args, comm
        self.device = comm.device
        self.cuda = self.device.type == "cuda"
        dtype = DTYPES[args.dtype]
        W, R, E = comm.size, comm.rank, args.experts_per_rank
        rng = np.random.default_rng([args.seed, R])
        # rows for (destination rank, local expert), sorted that way
        if args.pattern == "uniform":
            per = np.full(W * E, args.tokens // (W * E))
            per[: args.tokens % (W * E)] += 1
        else:
            per = rng.multinomial(args.tokens, rng.dirichlet(np.full(W * E, 2.0)))
        counts = torch.tensor(per.reshape(W, E), dtype=torch.int64, device=self.device)
        recv_counts, _ = comm.all_to_all_v(counts, [1] * W, [1] * W)
        self.send_expert = per.reshape(W, E).tolist()
        self.recv_expert = recv_counts.tolist()  # [source][local expert]
        self.send = [int(sum(r)) for r in self.send_expert]
        self.recv = [int(sum(r)) for r in self.recv_expert]
        g = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + R)
        d, h = args.model_dim, args.hidden
        self.x = (torch.randn(sum(self.send), d, generator=g) * 0.5).to(self.device, dtype)
        self.grad_out = (torch.randn(sum(self.send), d, generator=g) * 0.5).to(self.device, dtype)
        self.w1 = [(torch.randn(d, h, generator=g) / d ** 0.5).to(self.device, dtype).requires_grad_() for _ in range(E)]
        self.w2 = [(torch.randn(h, d, generator=g) / h ** 0.5).to(self.device, dtype).requires_grad_() for _ in range(E)]

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.gelu(rows @ self.w1[e]) @ self.w2[e]

    def fn(self, rows: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        if len(self.w1) == 1:
            return self.expert(0, rows)
        order, sizes = chunk.group_order(self.recv_expert)
        grouped = rows.index_select(0, order)
        outs = [self.expert(e, part) for e, part in enumerate(grouped.split(sizes))]
        y = torch.cat(outs)
        return torch.empty_like(y).index_copy(0, order, y)

    def zero_grad(self) -> None:
        for p in self.w1 + self.w2:
            p.grad = None

    # the step functions: forward + backward of the layer
    def step_overlap(self, degree) -> Callable[[], torch.Tensor]:
        """``degree``: as ``scatter_compute_gather``'s, or ``"oD"`` / ``"oauto"`` / ``"oD:F"``
        (own rows first; ``F``: own_split)."""
        own_kw: dict = {}
        if isinstance(degree, str) and degree.startswith("o"):
            degree, own_kw = _own_mode(degree)

        def step() -> torch.Tensor:
            x = self.x.detach().requires_grad_()
            out = self.comm.scatter_compute_gather(x, self.send, self.fn, degree=degree, recv_splits=self.recv,
                                                   algorithm=self.args.algorithm, **own_kw)
            out.backward(self.grad_out)
            return out
        return step

    def step_plain(self) -> torch.Tensor:
        x = self.x.detach().requires_grad_()
        rows, _ = all_to_all_v(x, self.send, self.recv, comm=self.comm)
        y = self.fn(rows, Chunk.full(self.recv, self.device))
        out, _ = all_to_all_v(y, self.recv, self.send, comm=self.comm)
        out.backward(self.grad_out)
        return out

    def step_exchange_only(self, degree=1) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            x = self.x.detach().requires_grad_()
            out = self.comm.scatter_compute_gather(x, self.send, lambda r, c: r * 1, degree=degree,
                                                   recv_splits=self.recv, algorithm=self.args.algorithm)
            out.backward(self.grad_out)
            return out
        return step

    def step_compute_only(self) -> Callable[[], torch.Tensor]:
        rows0 = torch.zeros(sum(self.recv), self.args.model_dim, dtype=self.x.dtype, device=self.device)
        gout = torch.ones_like(rows0)

        def step() -> torch.Tensor:
            rows = rows0.detach().requires_grad_()
            y = self.fn(rows, Chunk.full(self.recv, self.device))
            y.backward(gout)
            return y
        return step


class Timer:
    def __init__(self, args: argparse.Namespace, comm: "moecomm.Communicator", world) -> None:
        self.args, self.comm, self.world = args, comm, world
        self.cuda = comm.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.comm.device)

    def time(self, step: Callable[[], object], replay: bool = False) -> dict:
        """``replay``: ``step`` replays a CUDA graph (then put under the communicator's watchdog)."""
        from mpi4py import MPI

        a = self.args
        for _ in range(a.warmup):
            step()
        self.sync()
        samples, host = [], []
        for _ in range(a.iters):
            self.world.Barrier()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            if replay:
                self.comm.watch_stream("a replay of the captured overlap step")
            t1 = time.perf_counter()
            self.sync()
            samples.append((time.perf_counter() - t0) / a.steps)
            host.append((t1 - t0) / a.steps)
        mine = np.array(samples + host, dtype=np.float64)
        slowest = np.empty_like(mine)
        self.world.Allreduce(mine, slowest, op=MPI.MAX)
        steps, host = slowest[: a.iters], slowest[a.iters:]
        return {"median_ms": float(np.median(steps)) * 1e3, "p10_ms": float(np.percentile(steps, 10)) * 1e3,
                "p90_ms": float(np.percentile(steps, 90)) * 1e3, "host_ms": float(np.median(host)) * 1e3}


def _trace(directory: str, name: str, step: Callable[[], torch.Tensor], timer: "Timer", write: bool) -> None:
    import os

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if timer.cuda else [])
    timer.sync()
    timer.world.Barrier()
    with profile(activities=acts, with_stack=True) as prof:
        for _ in range(3):
            step()
        timer.sync()
    if write:
        os.makedirs(directory, exist_ok=True)
        prof.export_chrome_trace(os.path.join(directory, name))


def build_parser() -> argparse.ArgumentParser:
    p = RankZeroParser(prog=prog(__spec__.name), description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (NCCL backend) or cpu (MPI backend); default: cuda when available")
    p.add_argument("--small", action="store_true", help="small sizes for a quick run (CPU defaults)")
    p.add_argument("--tokens", type=int, default=None, help="rows per rank after routing (GPU 32768, CPU 4096)")
    p.add_argument("--model-dim", type=int, default=None, help="row width (GPU 4096, CPU 256)")
    p.add_argument("--hidden", type=int, default=None, help="expert hidden size (GPU 1024, CPU 256)")
    p.add_argument("--experts-per-rank", type=int, default=1, help="local experts per rank (1)")
    p.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default=None, help="GPU bfloat16, CPU float32")
    p.add_argument("--pattern", choices=("uniform", "random"), default="uniform", help="routing counts (uniform)")
    p.add_argument("--degrees", type=_parse_degrees, default=_parse_degrees("plain,1,2,4,8,auto"),
                   help="comma list of degrees, 'auto' and 'plain' (plain,1,2,4,8,auto)")
    p.add_argument("--algorithm", default=None, help="all_to_all_v algorithm to pass through (default: none)")
    p.add_argument("-n", "--iters", type=int, default=None, help="timed samples per degree (GPU 30, CPU 10)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed sample (GPU 5, CPU 2)")
    p.add_argument("-w", "--warmup", type=int, default=3, help="untimed steps first (3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck exchange aborts")
    p.add_argument("--max-ctas", type=int, default=None, help="NCCL: most CTAs per communication kernel (init(max_ctas=))")
    p.add_argument("--p2p-bytes", type=parse_size, default=None,
                   help="GPUs of one node: peer memory per rank (init(p2p_bytes=)); exchanges then move by copy engines")
    p.add_argument("--exchange-only", action="store_true",
                   help="also time each degree with an identity fn (the chunked exchange's own cost)")
    p.add_argument("--trace", metavar="DIR", help="write a torch.profiler chrome trace of a few steps per degree "
                   "(rank 0) to DIR/trace_<degree>.json")
    p.add_argument("--sync-report", action="store_true",
                   help="GPU: list the host synchronisations of one step (torch.cuda.set_sync_debug_mode), rank 0")
    p.add_argument("--host-profile", action="store_true",
                   help="print a cProfile of the host work of 10 steps at the last degree (rank 0)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="GPU: time every degree also captured into a CUDA graph and replayed (rows 'D/graph')")
    p.add_argument("--no-check", action="store_true", help="skip comparing every degree's result with degree 1's")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rank 0)")
    return p


def _defaults(args: argparse.Namespace, cuda: bool) -> None:
    big = cuda and not args.small
    for name, gpu, cpu in (("tokens", 32768, 4096), ("model_dim", 4096, 256), ("hidden", 1024, 256),
                           ("dtype", "bfloat16", "float32"), ("iters", 30, 10), ("steps", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if big else cpu)
    if args.small and not cuda:
        args.tokens = min(args.tokens, 2048)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    from mpi4py import MPI

    args = build_parser().parse_args(argv)
    world = MPI.COMM_WORLD
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    _defaults(args, cuda)
    if min(args.tokens, args.model_dim, args.hidden, args.experts_per_rank, args.iters, args.steps) < 1:
        raise SystemExit("--tokens, --model-dim, --hidden, --experts-per-rank, --iters and --steps must be >= 1")
    if not cuda:
        torch.set_num_threads(1)
    comm = moecomm.init(backend="nccl" if cuda else "mpi", timeout=args.timeout, max_ctas=args.max_ctas, p2p_bytes=args.p2p_bytes)
    layer = Layer(args, comm)
    timer = Timer(args, comm, world)
    rank0 = comm.rank == 0

    compute = timer.time(layer.step_compute_only())
    exchange = timer.time(layer.step_exchange_only())
    results: list[dict] = []
    reference: Optional[torch.Tensor] = None
    ok_all = True
    for d in args.degrees:
        if rank0:
            sys.stderr.write(f"degree {d} ...\n")
        step = layer.step_plain if d == "plain" else layer.step_overlap(d)
        layer.zero_grad()
        out = step().detach()
        ok = True
        if d == 1:
            reference = out
        elif reference is not None and not args.no_check:
            tol = 2e-2 if out.dtype in (torch.bfloat16, torch.float16) else 1e-4
            ok = bool(torch.allclose(out.float(), reference.float(), rtol=tol, atol=tol))
        ok = bool(world.allreduce(ok, op=MPI.LAND))
        ok_all &= ok
        t = timer.time(step)
        if args.exchange_only and d != "plain":
            t["exchange_ms"] = timer.time(layer.step_exchange_only(d))["median_ms"]
        if args.trace:
            _trace(args.trace, f"trace_{d}.json", step, timer, comm.rank == 0)
        label = str(d)
        if d == "auto" or str(d).startswith("oauto"):
            row_bytes = args.model_dim * torch.empty((), dtype=DTYPES[args.dtype]).element_size()
            from moecomm.overlap import auto_pieces
            pieces = max(auto_pieces(comm, layer.send, row_bytes) + auto_pieces(comm, layer.recv, row_bytes))
            pieces = int(world.allreduce(pieces, op=MPI.MAX))
            label = f"{d}({pieces})"
        results.append({"degree": label, "check": ok, **t})
        if args.cuda_graph and cuda:
            graph, _ = capture(step, comm.device)
            results.append({"degree": f"{label}/graph", "check": ok, **timer.time(graph.replay, replay=True)})
            del graph
    for suffix in ("", "/graph"):  # graph rows against degree 1 captured too
        base = next((r["median_ms"] for r in results if r["degree"] == "1" + suffix), None)
        for r in results:
            if r["degree"].endswith("/graph") == bool(suffix) and base is not None:
                r["vs_1"] = r["median_ms"] / base
    if rank0:
        name = torch.cuda.get_device_name(comm.device) if cuda else "cpu"
        esize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
        mib = sum(layer.send) * args.model_dim * esize / 2**20
        lines = [
            f"# moecomm overlap: {comm.size} ranks, backend {comm.backend}, {name}, {args.dtype}, "
            f"{args.tokens} rows/rank of {args.model_dim} ({mib:.1f} MiB), hidden {args.hidden}, "
            f"{args.experts_per_rank} expert(s)/rank, pattern {args.pattern}, max_ctas {args.max_ctas or 'NCCL default'}, p2p_bytes {args.p2p_bytes or 'none'}, "
            f"torch {torch.__version__}",
            f"# step = forward + backward; {args.steps} steps per sample, {args.iters} samples; "
            f"auto may use {auto_stages(comm)} stage(s)",
            f"# compute alone: {compute['median_ms']:.3f} ms   exchange alone: {exchange['median_ms']:.3f} ms",
            f"{'degree':<9} {'median_ms':>10} {'p10_ms':>9} {'p90_ms':>9} {'vs_1':>7} {'host_ms':>8} "
            f"{'xchg_ms':>8}  check",
        ]
        for r in results:
            xm = f"{r['exchange_ms']:>8.3f}" if "exchange_ms" in r else f"{'-':>8}"
            lines.append(f"{r['degree']:<9} {r['median_ms']:>10.3f} {r['p10_ms']:>9.3f} {r['p90_ms']:>9.3f} "
                         f"{r.get('vs_1', float('nan')):>7.3f} {r['host_ms']:>8.3f} {xm}  {'ok' if r['check'] else 'MISMATCH'}")
        print("\n".join(lines), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"header": lines[:3], "compute": compute, "exchange": exchange, "results": results,
                           "args": {k: v for k, v in vars(args).items() if k != "degrees"}}, fh, indent=1)
    if args.sync_report and cuda:
        d = args.degrees[-1]
        text = sync_report(layer.step_plain if d == "plain" else layer.step_overlap(d), sync=timer.sync)
        if rank0:
            print(f"# degree {d}\n{text}", flush=True)
    if args.host_profile:
        d = args.degrees[-1]
        text = host_profile(layer.step_plain if d == "plain" else layer.step_overlap(d), sync=timer.sync)
        if rank0:
            print(f"# degree {d}\n{text}", flush=True)
    comm.close()
    if not ok_all:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
