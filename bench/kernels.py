"""Benchmark of the moecomm_ext kernels against torch equivalents and a plain copy.

Run ``python -m bench.kernels [--json PATH]``.  On the current
device (CUDA when available) it times, for a top-k MoE layer (default 8192
tokens, model_dim 2048, k=2, 16 experts, capacity 1024 per expert, bf16):

* dispatch forward  = gather_rows          vs ``index_select``
* dispatch backward = gather_reduce_rows   vs ``index_add_``
* combine forward   = gather_reduce_rows (weighted) vs ``index_add_`` of scaled rows
* combine backward  = gather_rows (scaled) + gather_rowdot vs ``index_select``·w and ``bmm``
* whole dispatch / combine forward+backward through autograd
* with ``--wire-dtype float8_e4m3fn`` (or ``float8_e5m2``), the FP8 wire passes of
  ``all_to_all_v(wire_dtype=)`` and the layer's fused dispatch: ``quant.pack_rows`` (quantize
  and pack the tokens), ``quant.unpack_rows`` (unpack and dequantize them) and
  ``quant.gather_pack_rows`` (the dispatch gather writing packed rows), each against its torch
  reference (``use_native=False``)

Each result is the median of many runs (CUDA events on GPU, perf_counter on
CPU; the L2 cache is flushed before each GPU run unless ``--no-flush``).
Eager timings include Python and launch overhead, which dominates the
autograd rows at this size; ``--graph`` adds the median of CUDA-graph replays
of the same work (GPU time only).
Bandwidth counts the minimum bytes the operation must read and write (rows
actually gathered, outputs, indices and weights).  Every op is also compared
with a device-to-device copy of the same number of bytes (half read, half
written) measured in the same run; ``vs copy`` is the ratio of bandwidths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import moecomm_ext as me
from moecomm_ext.testing import random_routing

from ._common import DTYPES, FLOAT_DTYPES, prog


@dataclass
class Result:
    op: str
    impl: str
    median_ms: float
    bytes: int
    gbps: float
    copy_gbps: float
    vs_copy: float
    graph_ms: float | None = None  # CUDA-graph replay: kernels without host overhead
    graph_gbps: float | None = None


class Timer:
    def __init__(self, device: torch.device, iters: int, warmup: int, flush: bool) -> None:
        self.device = device
        self.iters = iters
        self.warmup = warmup
        self.cuda = device.type == "cuda"
        self.flush_buf = (
            torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if (self.cuda and flush) else None
        )

    def median_ms(self, fn: Callable[[], object], graph: bool = False) -> float:
        """Median time of ``fn()``; with ``graph=True`` (CUDA only) of the replay
        of a CUDA graph capturing ``fn()``, i.e. without host launch overhead."""
        if graph:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            fn = g.replay
        for _ in range(self.warmup):
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            for _ in range(self.iters):
                if self.flush_buf is not None:
                    self.flush_buf.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def run(args: argparse.Namespace) -> tuple[dict, list[Result]]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    es = torch.empty((), dtype=dtype).element_size()
    T, D, K, E, C = args.tokens, args.dim, args.k, args.experts, args.capacity
    M = E * C
    gen = torch.Generator().manual_seed(0)
    token_slots, slot_token = random_routing(T, K, E, C, generator=gen, device=device)
    x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    y = torch.randn(M, D, generator=gen).to(device=device, dtype=dtype)
    w = torch.rand(T, K, generator=gen).to(device)
    g_tok = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    g_slot = torch.randn(M, D, generator=gen).to(device=device, dtype=dtype)
    slot_w = me.gather_rows(w.reshape(-1, 1), me.slot_positions(token_slots, M)).reshape(M)
    n_slot = int((slot_token >= 0).sum())  # filled slots = kept copies
    timer = Timer(device, args.iters, args.warmup, not args.no_flush)
    impl = me.implementation(device.type)

    # torch baselines: -1 mapped to an extra zero row / a discarded row
    x_pad = torch.cat([x, x.new_zeros(1, D)])
    y_pad = torch.cat([y, y.new_zeros(1, D)])
    st_pad = torch.where(slot_token >= 0, slot_token, T)
    ts_pad = torch.where(token_slots >= 0, token_slots, M)
    w_masked = torch.where(token_slots >= 0, w, 0.0)

    copy_cache: dict[int, float] = {}

    def copy_gbps(nbytes: int) -> float:
        half = max(1, nbytes // 2)
        if half not in copy_cache:
            src = torch.empty(half, dtype=torch.uint8, device=device).random_(0, 255)
            dst = torch.empty_like(src)
            ms = timer.median_ms(lambda: dst.copy_(src))
            copy_cache[half] = 2 * half / (ms * 1e-3) / 1e9
            del src, dst
        return copy_cache[half]

    results: list[Result] = []

    def record(op: str, which: str, fn: Callable[[], object], nbytes: int) -> None:
        ms = timer.median_ms(fn)
        gbps = nbytes / (ms * 1e-3) / 1e9
        cg = copy_gbps(nbytes)
        gms = ggbps = None
        if args.graph and device.type == "cuda":
            gms = timer.median_ms(fn, graph=True)
            ggbps = nbytes / (gms * 1e-3) / 1e9
        results.append(Result(op, which, ms, nbytes, gbps, cg, gbps / cg, gms, ggbps))

    idx_b = 8
    b_disp_fwd = n_slot * D * es + M * D * es + M * idx_b
    b_disp_bwd = n_slot * D * es + T * D * es + T * K * idx_b
    b_comb_fwd = n_slot * D * es + T * D * es + T * K * (idx_b + 4)
    b_comb_bwd_y = n_slot * D * es + M * D * es + M * (idx_b + 4)
    b_rowdot = T * D * es + n_slot * D * es + T * K * (idx_b + 4)

    record("dispatch fwd: gather_rows", impl, lambda: me.gather_rows(x, slot_token, check=False), b_disp_fwd)
    record("dispatch fwd: gather_rows", "torch index_select", lambda: x_pad.index_select(0, st_pad), b_disp_fwd)

    record(
        "dispatch bwd: gather_reduce_rows",
        impl,
        lambda: me.gather_reduce_rows(g_slot, token_slots, check=False),
        b_disp_bwd,
    )

    def torch_disp_bwd():
        gx = torch.zeros(T + 1, D, device=device, dtype=dtype)
        return gx.index_add_(0, st_pad, g_slot)

    record("dispatch bwd: gather_reduce_rows", "torch index_add_", torch_disp_bwd, b_disp_bwd)

    record(
        "combine fwd: gather_reduce_rows(w)",
        impl,
        lambda: me.gather_reduce_rows(y, token_slots, w, check=False),
        b_comb_fwd,
    )

    def torch_comb_fwd():
        out = torch.zeros(T + 1, D, device=device, dtype=dtype)
        return out.index_add_(0, st_pad, y * slot_w.to(dtype).unsqueeze(1))

    record("combine fwd: gather_reduce_rows(w)", "torch index_add_", torch_comb_fwd, b_comb_fwd)

    record(
        "combine bwd dy: gather_rows(scale)",
        impl,
        lambda: me.gather_rows(g_tok, slot_token, slot_w, check=False),
        b_comb_bwd_y,
    )
    g_tok_pad = torch.cat([g_tok, g_tok.new_zeros(1, D)])
    record(
        "combine bwd dy: gather_rows(scale)",
        "torch index_select*w",
        lambda: g_tok_pad.index_select(0, st_pad) * slot_w.to(dtype).unsqueeze(1),
        b_comb_bwd_y,
    )
    record("combine bwd dw: gather_rowdot", impl, lambda: me.gather_rowdot(g_tok, y, token_slots, check=False), b_rowdot)
    record(
        "combine bwd dw: gather_rowdot",
        "torch bmm",
        lambda: torch.bmm(y_pad.index_select(0, ts_pad.reshape(-1)).view(T, K, D), g_tok.unsqueeze(-1)),
        b_rowdot,
    )

    # whole autograd round trips
    xr = x.clone().requires_grad_()
    yr = y.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    x_pad_r = x_pad.clone().requires_grad_()
    y_r2 = y.clone().requires_grad_()
    w_r2 = w_masked.clone().requires_grad_()

    def me_dispatch_fb():
        out = me.dispatch(xr, slot_token, token_slots, check=False)
        return torch.autograd.grad(out, [xr], g_slot)

    def torch_dispatch_fb():
        out = x_pad_r.index_select(0, st_pad)
        return torch.autograd.grad(out, [x_pad_r], g_slot)

    def me_combine_fb():
        out = me.combine(yr, token_slots, wr, slot_token, check=False)
        return torch.autograd.grad(out, [yr, wr], g_tok)

    def torch_combine_fb():
        rows = torch.cat([y_r2, y_r2.new_zeros(1, D)]).index_select(0, ts_pad.reshape(-1)).view(T, K, D)
        out = torch.bmm(w_r2.to(dtype).unsqueeze(1), rows).squeeze(1)
        return torch.autograd.grad(out, [y_r2, w_r2], g_tok)

    record("dispatch fwd+bwd (autograd)", impl, me_dispatch_fb, b_disp_fwd + b_disp_bwd)
    record("dispatch fwd+bwd (autograd)", "torch", torch_dispatch_fb, b_disp_fwd + b_disp_bwd)
    record("combine fwd+bwd (autograd)", impl, me_combine_fb, b_comb_fwd + b_comb_bwd_y + b_rowdot)
    record("combine fwd+bwd (autograd)", "torch", torch_combine_fb, b_comb_fwd + b_comb_bwd_y + b_rowdot)

    if args.wire_dtype is not None:
        _record_wire(record, getattr(torch, args.wire_dtype), x, slot_token, n_slot, impl)

    meta = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        implementation=impl,
        tokens=T,
        dim=D,
        k=K,
        experts=E,
        capacity=C,
        dtype=args.dtype,
        filled_slots=n_slot,
        iters=args.iters,
        flush_l2=device.type == "cuda" and not args.no_flush,
        wire_dtype=args.wire_dtype,
    )
    return meta, results


def _record_wire(record: Callable, wire: torch.dtype, x: torch.Tensor, slot_token: torch.Tensor, n_slot: int,
                 impl: str) -> None:
    """The FP8 wire passes on the layer's tokens ``x`` ``[T, D]`` and its dispatch slots."""
    from moecomm import quant

    T, D = x.shape
    es, rb, M = x.element_size(), quant.packed_row_bytes(D), slot_token.shape[0]
    packed = quant.pack_rows(x, wire)
    out = torch.empty_like(x)
    for name, native in ((impl, True), ("torch reference", False)):
        record("wire: pack_rows", name, lambda: quant.pack_rows(x, wire, use_native=native), T * D * es + T * rb)
        record("wire: unpack_rows", name,
               lambda: quant.unpack_rows(packed, (D,), x.dtype, wire, out=out, use_native=native), T * rb + T * D * es)
        record("wire: gather_pack_rows", name,
               lambda: quant.gather_pack_rows(x, slot_token, wire, use_native=native), n_slot * D * es + M * (rb + 8))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog(__spec__.name), description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default="bfloat16")
    p.add_argument("--iters", type=int, default=None, help="timed runs (default 100 on CUDA, 10 on CPU)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--no-flush", action="store_true", help="do not flush the L2 cache between GPU runs")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--graph",
        action="store_true",
        help="also time each op as a CUDA-graph replay (kernel time without Python/launch overhead)",
    )
    p.add_argument("--wire-dtype", choices=("float8_e4m3fn", "float8_e5m2"), default=None,
                   help="also time the FP8 wire passes (quant.pack_rows, unpack_rows, gather_pack_rows)")
    args = p.parse_args(argv)
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    args.iters = args.iters or (100 if cuda else 10)
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)

    meta, results = run(args)
    print(
        f"# {meta['device']} torch {meta['torch']} impl={meta['implementation']} T={meta['tokens']} "
        f"D={meta['dim']} k={meta['k']} E={meta['experts']} C={meta['capacity']} {meta['dtype']} "
        f"(filled slots {meta['filled_slots']}), median of {meta['iters']}"
        + (f", wire {meta['wire_dtype']}" if meta["wire_dtype"] else "")
    )
    graph = any(r.graph_ms is not None for r in results)
    header = f"{'operation':36s} {'implementation':21s} {'ms':>8s} {'MB':>7s} {'GB/s':>7s} {'copy GB/s':>9s} {'vs copy':>7s}"
    if graph:
        header += f" {'graph ms':>8s} {'graph GB/s':>10s}"
    print(header)
    print("-" * len(header))
    for r in results:
        line = (
            f"{r.op:36s} {r.impl:21s} {r.median_ms:8.4f} {r.bytes / 1e6:7.1f} {r.gbps:7.1f} "
            f"{r.copy_gbps:9.1f} {r.vs_copy:7.2f}"
        )
        if graph and r.graph_ms is not None:
            line += f" {r.graph_ms:8.4f} {r.graph_gbps:10.1f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=[asdict(r) for r in results]), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
