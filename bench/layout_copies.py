"""The 2DH layout copies on one device: time per call and where the host time goes.

    python -m bench.layout_copies [--sizes 1M,16M,256M] [--grid 2x2] [--device cuda]

For each size: the median time of one ``moecomm.collectives.blocks.permute_blocks`` over a grid of
equal blocks (issue and finish: synchronized), the host time to issue it, and a device
copy of the same bytes for scale. Then a cProfile of the issuing at the first size.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Optional

import numpy as np
import torch

from moecomm.collectives import blocks as _blocks
from ._common import prog
from ._topology import RankZeroParser, format_bytes, parse_bytes

__all__ = ["main"]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev: torch.device, iters: int) -> tuple[float, float]:
    for _ in range(5):
        fn()
    _sync(dev)
    total, issue = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        _sync(dev)
        total.append(time.perf_counter() - t0)
        issue.append(t1 - t0)
    return float(np.median(total)), float(np.median(issue))


def main(argv: Optional[list[str]] = None) -> None:
    p = RankZeroParser(prog=prog(__spec__.name), description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,16M,256M")
    p.add_argument("--grid", default="2x2", help="A x B blocks (2x2)")
    p.add_argument("--row-bytes", type=int, default=4096)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    A, B = (int(v) for v in args.grid.lower().split("x"))
    print(f"# layout copies on {dev}: permute_blocks over {A} x {B} equal blocks, rows of {args.row_bytes} B")
    print(f"{'size':>8} {'permute':>10} {'issue':>10} {'copy_':>10}")
    first = None
    for text in args.sizes.split(","):
        nbytes = parse_bytes(text)
        rows = max(A * B, nbytes // args.row_bytes)
        x = torch.empty(rows, args.row_bytes, dtype=torch.uint8, device=dev)
        base, extra = divmod(rows, A * B)
        flat = [base + (1 if i < extra else 0) for i in range(A * B)]
        counts = [flat[a * B:(a + 1) * B] for a in range(A)]
        y = torch.empty_like(x)
        perm, issue = _time(lambda: _blocks.permute_blocks(x, counts), dev, args.iters)
        copy, _ = _time(lambda: y.copy_(x), dev, args.iters)
        print(f"{format_bytes(rows * args.row_bytes):>8} {perm * 1e6:>8.1f}us {issue * 1e6:>8.1f}us {copy * 1e6:>8.1f}us")
        if first is None:
            first = (x, counts)
    x, counts = first
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        _blocks.permute_blocks(x, counts)
    prof.disable()
    _sync(dev)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    print("# where the host time of 200 calls goes (tottime):")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])


if __name__ == "__main__":
    main()
