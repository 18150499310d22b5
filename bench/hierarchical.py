"""Flat vs 2D-hierarchical all-to-all: median and p99 per message size.

Run under MPI (or torchrun), e.g. on 2 GPUs as one node of 2 and as two nodes of 1::

    mpiexec -n 2 python -m bench.hierarchical --local-size 2
    mpiexec -n 2 python -m bench.hierarchical --local-size 1

``size`` is the bytes each rank sends in one exchange (all peers together). Times are per
exchange, the slowest rank's, over ``--iters`` timed runs after ``--warmup`` untimed ones.
By default the counts are exchanged in every call (``recv_splits`` unknown, as in MoE);
``--known-counts`` passes them. ``--skew s`` draws variable splits (Dirichlet(1/s)).
Every size is checked once: the 2DH output must equal the flat one byte for byte.

Flat, 2DH and ``copies`` are timed round-robin in one loop. ``copies`` is the two layout
copies (pack and regroup, ``moecomm.collectives.blocks.permute_blocks`` on a 2 x 2 block grid of this
rank's data) that a layout with several nodes *and* several ranks per node adds to the 2DH
exchange. On layouts where either is 1 (all that 2 GPUs allow) 2DH needs no copy, so the
column ``2dh+copies/flat`` is what those copies would cost on top, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import moecomm
from moecomm.collectives import blocks as _blocks
from ._common import prog
from ._topology import RankZeroParser, alltoall_input, format_bytes, format_seconds, parse_bytes, time_collectives

__all__ = ["main"]


def main(argv=None) -> int:
    p = RankZeroParser(prog=prog(__spec__.name), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,16M,256M", help="bytes per rank (default 1M,16M,256M)")
    p.add_argument("--local-size", type=int, default=None, help="ranks per node (default: from host names)")
    p.add_argument("--backend", default=None, help="moecomm backend (default: $MOECOMM_BACKEND or auto)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "int8"])
    p.add_argument("--row-bytes", type=int, default=4096, help="bytes per row (default 4096: a 2048-wide bf16 token)")
    p.add_argument("--skew", type=float, default=0.0, help="0: equal splits; s > 0: variable splits")
    p.add_argument("--known-counts", action="store_true", help="pass recv_splits (no count exchange)")
    p.add_argument("--json", default=None, help="also write the results here (rank 0)")
    args = p.parse_args(argv)
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    dtype = getattr(torch, args.dtype)

    comm = moecomm.init(backend=args.backend, local_size=args.local_size, hierarchy=True, set_default=False)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"# {comm.size} ranks as {comm.num_nodes} node(s) x {comm.local_size}, backend {comm.backend}, "
        f"device {comm.device}, {args.dtype} rows of {args.row_bytes} B, "
        f"{'known' if args.known_counts else 'exchanged'} counts, skew {args.skew:g}, "
        f"{args.iters} iters (+{args.warmup} warmup)")
    say(f"{'size':>10s} {'flat median':>12s} {'flat p99':>10s} {'2dh median':>12s} {'2dh p99':>10s} "
        f"{'flat/2dh':>9s} {'copies':>10s} {'2dh+copies/flat':>16s} {'2dh algbw':>11s}  check")
    results = []
    for size in sizes:
        x, send = alltoall_input(comm, size, row_bytes=args.row_bytes, dtype=dtype, skew=args.skew, seed=size)
        flat_out, recv = comm.all_to_all_v(x, send)
        hdh_out, _ = comm.all_to_all_v(x, send, algorithm="2dh")
        same = torch.tensor([int(torch.equal(flat_out.view(torch.uint8), hdh_out.view(torch.uint8)))],
                            dtype=torch.int64, device=comm.device)
        comm.allreduce(same, "min")
        del flat_out, hdh_out
        known = recv if args.known_counts else None
        rows = x.shape[0]
        grid = [[rows // 4, rows // 4], [rows // 4, rows - 3 * (rows // 4)]]

        def copies() -> None:
            _blocks.permute_blocks(_blocks.permute_blocks(x, grid), grid, inverse=True)

        fns = {alg: (lambda alg=alg: comm.all_to_all_v(x, send, known, algorithm=alg)) for alg in ("flat", "2dh")}
        t = time_collectives(comm, {**fns, "copies": copies}, iters=args.iters, warmup=args.warmup)
        nbytes = x.numel() * x.element_size()
        ok = bool(same.item())
        say(f"{format_bytes(nbytes):>10s} {format_seconds(t['flat'].median_s):>12s} {format_seconds(t['flat'].p99_s):>10s} "
            f"{format_seconds(t['2dh'].median_s):>12s} {format_seconds(t['2dh'].p99_s):>10s} "
            f"{t['flat'].median_s / t['2dh'].median_s:9.2f} {format_seconds(t['copies'].median_s):>10s} "
            f"{(t['2dh'].median_s + t['copies'].median_s) / t['flat'].median_s:16.2f} "
            f"{nbytes / t['2dh'].median_s / 1e9:8.2f} GB/s  "
            f"{'ok' if ok else 'MISMATCH'}")
        results.append({"bytes_per_rank": nbytes, "check": ok, **{a: v.to_json() for a, v in t.items()}})
        if not ok:
            break
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": comm.size, "num_nodes": comm.num_nodes, "local_size": comm.local_size,
                       "backend": comm.backend, "device": str(comm.device), "results": results}, f, indent=2)
    comm.close()
    return 0 if all(r["check"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
