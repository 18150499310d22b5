"""All-to-all bandwidth benchmark, read like nccl-tests' alltoall_perf.

Run under MPI::

    mpiexec -n 4 python -m bench.alltoall -b 1K -e 64M -f 4 --compare

``size`` is the bytes each rank sends in one exchange (summed over its peers), in whole rows
of ``--row-elems`` elements: a size below one row is rounded up to one row, other sizes down
to whole rows, and the table, the JSON and the bandwidths all use those bytes. ``algbw`` is
size / time and ``busbw`` is algbw * (n-1)/n, as nccl-tests define them for alltoall. Times
are per exchange, the slowest rank's, over ``--iters`` timed runs: median and p99. Each
timed run is a barrier, then ``--batch`` exchanges (1 by default) issued back to back, then
a device synchronize, divided by ``--batch``: with 1 every exchange pays a barrier's skew and
a synchronize (about 40 us on an H200, what ``copy`` shows at small sizes); with 10 or more
the time is what nccl-tests' alltoall_perf reports (it issues its iterations back to back
and synchronizes once).

Methods (``--compare`` adds the last two; not where ranks share a GPU, which NCCL refuses):
  moecomm        ``comm.all_to_all_v(x, send_counts)`` with the counts in a tensor on the
                 communicator's device, as MoE code has them (counts exchanged each call)
  moecomm-known  ``comm.all_to_all_v(x, send, recv)`` with both sides' counts known
  moecomm-p2p    as ``moecomm``, on a communicator made with ``p2p_bytes`` (GPUs of one node:
                 the rows move through peer memory with the counts still on the GPU)
  moecomm-p2p-known  as ``moecomm-known`` on that communicator: the rows move by copy engines
  moecomm-known-unchecked  ``--check-cost``: as ``moecomm-known`` without the default check
                 (MPI: the rows as one ``Ialltoallv``, not tagged messages, see moecomm/engine/tags.py;
                 peer backend: the agreement record without what the exchange is), to time what
                 the check costs; ``moecomm-known-again`` (the same as ``moecomm-known``) beside
                 them gives the method's own noise
  moecomm-known-ce  ``--peer-copy-engines`` (peer backend): as ``moecomm-known`` with the rows
                 moved by copy engines (a copy per block) instead of SM kernels (the default);
                 with uniform splits also ``moecomm-equal`` (``all_to_all_single`` without
                 split sizes: equal blocks) and ``moecomm-equal-ce``
  moecomm-oneround  ``--peer-one-host-round`` (peer backend, ranks sharing a GPU without MPS): as
                 ``moecomm`` in one host round (the send kernel, one synchronize, one all-gather of
                 the counts, the copy out: ``PeerBackend.counts_round``) instead of a count
                 exchange and an agreed exchange (the default until it has run on a GPU)
  copy           one device copy of the same bytes (``torch.empty_like(x).copy_(x)``): the
                 floor where the ranks share one device's memory (ranks sharing a GPU)
  torch          torch.distributed's MoE pattern: counts all_to_all_single, ``.tolist()``,
                 all_to_all_single with splits (gloo on CPU, NCCL on GPU)
  raw            the backend itself: mpi4py ``Alltoallv`` (CPU), nccl4py ``ncclAlltoAll``
                 on uniform splits (GPU)

``python -m bench.plot results.json -o plot.png`` draws a ``--json`` file.

``--wire-dtype float8_e4m3fn`` (or ``float8_e5m2``) adds ``moecomm-fp8`` and
``moecomm-fp8-known`` (and the ``-p2p`` ones): the same exchanges with
``wire_dtype=``, quantization and dequantization included in the time, and two columns
(only then): ``wire``, the bytes a rank sends (rows as they travel: FP8 plus block scales for
those methods), and ``vs plain``, the time against the same method without ``wire_dtype``.
On the CPU each rank runs torch with one intra-op thread unless ``--threads`` says
otherwise: the quantization kernels run on those threads, and more threads than the cores
the rank has to itself make them far slower (ranks of one host share its cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch

import moecomm
from ._common import DTYPES, prog
from ._topology import RankZeroParser, parse_bytes

__all__ = ["main", "parse_size", "count_matrix", "plan_sizes", "build_parser"]


def parse_size(text: str) -> int:
    """'64K' -> 65536 (binary units, like nccl-tests); sizes must be > 0."""
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def count_matrix(pattern: str, size: int, rows_per_rank: int, seed: int) -> np.ndarray:
    """``m[src, dst]`` rows for ``size`` ranks, each sending ``rows_per_rank`` rows in all."""
    rng = np.random.default_rng(seed)
    if pattern == "uniform":
        m = np.full((size, size), rows_per_rank // size)
        m[:, : rows_per_rank % size] += 1
        return m
    if pattern == "random":
        weights = rng.random((size, size))
        weights[rng.random((size, size)) < 0.2] = 0.0  # some peers get nothing
    elif pattern == "skewed":
        # Expert imbalance: destination d is hot with a Zipf(1.2) weight, for every sender.
        hot = 1.0 / (1.0 + rng.permutation(size)) ** 1.2
        weights = np.tile(hot, (size, 1))
    else:
        raise ValueError(f"pattern must be uniform, random or skewed, got {pattern!r}")
    weights[weights.sum(1) == 0, 0] = 1.0
    m = np.stack([rng.multinomial(rows_per_rank, w / w.sum()) for w in weights])
    return m


def plan_sizes(minbytes: int, maxbytes: int, factor: int, row_bytes: int) -> list[tuple[int, int]]:
    """The sizes to time, as ``(requested_bytes, rows)``: each requested size (``minbytes``,
    times ``factor`` up to ``maxbytes``) in whole rows, at least one; a size that rounds to
    the rows of an earlier one is left out. The bytes timed are ``rows * row_bytes``."""
    if minbytes < 1 or maxbytes < minbytes or factor < 2 or row_bytes < 1:
        raise ValueError(f"need 1 <= minbytes <= maxbytes, factor >= 2 and row_bytes >= 1, got "
                         f"{minbytes}, {maxbytes}, {factor}, {row_bytes}")
    plan: list[tuple[int, int]] = []
    size = minbytes
    while size <= maxbytes:
        rows = max(size // row_bytes, 1)
        if not plan or plan[-1][1] != rows:
            plan.append((size, rows))
        size *= factor
    return plan


def _progress_bar(total: int, enabled: bool):
    """A tqdm bar on stderr (None when disabled or tqdm is not installed)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        sys.stderr.write("# no progress bar: pip install tqdm for one\n")
        return None
    return tqdm(total=total, unit="size", file=sys.stderr, leave=False, dynamic_ncols=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from mpi4py import MPI

        self.args = args
        self.world = MPI.COMM_WORLD
        self.comm = moecomm.init(backend=args.backend, timeout=args.timeout)
        self.device = self.comm.device
        self.cuda = self.device.type == "cuda"
        self.dtype = DTYPES[args.dtype]
        self.wire = getattr(torch, args.wire_dtype) if args.wire_dtype else None
        # NCCL (torch's MoE pattern, the raw method) cannot run ranks that share a GPU
        self.shared_gpu = self.comm.backend == "peer"
        self.pg = self._torch_group() if args.compare and not self.shared_gpu else None
        if args.compare and self.shared_gpu and self.comm.rank == 0:
            sys.stderr.write("# --compare: torch's NCCL pattern and the raw method need a GPU per rank: left out\n")
        self.p2p = None
        if self.cuda and args.p2p_bytes:
            self.p2p = moecomm.init(backend="nccl", timeout=args.timeout, p2p_bytes=args.p2p_bytes, set_default=False)

    def _torch_group(self):
        import socket

        import torch.distributed as dist

        port = None
        if self.world.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = self.world.bcast(port, root=0)
        addr = self.world.bcast(socket.gethostbyname(socket.gethostname()) if self.world.rank == 0 else None, root=0)
        if self.world.size > 1 and addr.startswith("127."):
            addr = "127.0.0.1"
        kw = {"device_id": self.device} if self.cuda else {}
        dist.init_process_group("nccl" if self.cuda else "gloo", init_method=f"tcp://{addr}:{port}",
                                rank=self.world.rank, world_size=self.world.size, **kw)
        return dist.group.WORLD

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _copy_engines(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        transport = self.comm.engine.backend.transport
        transport.copy_kernels = False
        try:
            return fn()
        finally:
            transport.copy_kernels = True

    def time_methods(self, fns: dict[str, Callable[[], torch.Tensor]]) -> dict[str, tuple[list[float], torch.Tensor]]:
        """Time every method round-robin (one exchange of each in turn), so that a noisy
        moment on a shared machine hits them all alike; per exchange, the slowest rank.
        Each round takes the methods in a new random order (the same on every rank): a
        method runs faster after one that left the GPU in the same state (measured on
        2 x H200: 10-30% for the peer-memory exchange), and a fixed order would give that
        to the same methods every round."""
        outs = {}
        for name, fn in fns.items():
            for _ in range(self.args.warmup):
                outs[name] = fn()
        self.sync()
        times: dict[str, list[float]] = {name: [] for name in fns}
        names = list(fns)
        order = np.random.default_rng(len(names))
        for _ in range(self.args.iters):
            for i in order.permutation(len(names)):
                name, fn = names[i], fns[names[i]]
                self.world.Barrier()
                t0 = time.perf_counter()
                for _ in range(self.args.batch):
                    outs[name] = fn()
                self.sync()
                times[name].append((time.perf_counter() - t0) / self.args.batch)
        result = {}
        for name in fns:
            slowest = np.array(times[name])
            self.world.Allreduce(_in_place(), slowest, op=_max_op())
            result[name] = (slowest.tolist(), outs[name])
        return result

    def row_bytes(self) -> int:
        return self.args.row_elems * torch.empty((), dtype=self.dtype).element_size()

    def run_size(self, pattern: str, rows: int) -> list[dict]:
        """Time every method on ``rows`` rows per rank (``rows * row_bytes()`` bytes)."""
        W, R = self.comm.size, self.comm.rank
        row_bytes = self.row_bytes()
        size_bytes = rows * row_bytes
        m = count_matrix(pattern, W, rows, seed=size_bytes)
        send, recv = [int(v) for v in m[R]], [int(v) for v in m[:, R]]
        # Row values encode (source, destination): exact in every dtype for W <= 11.
        tag = torch.tensor([R * W + d for d in range(W)], dtype=torch.float32)
        x = tag.repeat_interleave(torch.tensor(send)).to(self.dtype)
        x = x[:, None].expand(-1, self.args.row_elems).contiguous().to(self.device)
        expect_tag = torch.tensor([s * W + R for s in range(W)], dtype=torch.float32)
        expect = expect_tag.repeat_interleave(torch.tensor(recv)).to(self.dtype).to(self.device)
        counts_dev = torch.tensor(send, dtype=torch.int64, device=self.device)

        expect_rows = expect[:, None].expand(-1, self.args.row_elems)
        if self.wire is not None:  # what the rows become on the wire and back (moecomm.quant's reference)
            from moecomm import quant

            expect_wire = quant.dequantize_rows_reference(*quant.quantize_rows_reference(expect_rows, self.wire),
                                                          self.dtype)

        def check(out: torch.Tensor, name: str) -> bool:
            if name == "copy":
                return bool(self.world.allreduce(bool(torch.equal(out, x)), op=_land_op()))
            want = expect_wire if "fp8" in name else expect_rows
            ok = out.shape == (sum(recv), self.args.row_elems) and bool((out == want).all())
            return bool(self.world.allreduce(ok, op=_land_op()))

        methods: dict[str, Optional[Callable[[], torch.Tensor]]] = {
            "moecomm": lambda: self.comm.all_to_all_v(x, counts_dev)[0],
            "moecomm-known": lambda: self.comm.all_to_all_v(x, send, recv)[0],
            "copy": lambda: torch.empty_like(x).copy_(x),  # the floor where ranks share a device's memory
        }
        if self.args.check_cost:
            methods["moecomm-known-unchecked"] = lambda: self._unchecked(x, send, recv)
            # the same as moecomm-known under another name: the method's own noise (an A/A pair)
            methods["moecomm-known-again"] = lambda: self.comm.all_to_all_v(x, send, recv)[0]
        if self.args.peer_copy_engines and self.shared_gpu:
            methods["moecomm-known-ce"] = lambda: self._copy_engines(lambda: self.comm.all_to_all_v(x, send, recv)[0])
            if len(set(send)) == 1 and len(set(recv)) == 1 and send[0] == recv[0]:
                equal = torch.empty_like(x)
                methods["moecomm-equal"] = lambda: self.comm.all_to_all_single(equal, x) or equal
                methods["moecomm-equal-ce"] = lambda: self._copy_engines(
                    lambda: self.comm.all_to_all_single(equal, x) or equal)
        if self.args.peer_one_host_round and self.shared_gpu and not self.comm.engine.backend.concurrent:
            methods["moecomm-oneround"] = lambda: self._one_host_round(lambda: self.comm.all_to_all_v(x, counts_dev)[0])
        if self.p2p is not None:
            methods["moecomm-p2p"] = lambda: self.p2p.all_to_all_v(x, counts_dev)[0]
            methods["moecomm-p2p-known"] = lambda: self.p2p.all_to_all_v(x, send, recv)[0]
        if self.wire is not None:
            wire = self.wire
            methods["moecomm-fp8"] = lambda: self.comm.all_to_all_v(x, counts_dev, wire_dtype=wire)[0]
            methods["moecomm-fp8-known"] = lambda: self.comm.all_to_all_v(x, send, recv, wire_dtype=wire)[0]
            if self.p2p is not None:
                methods["moecomm-p2p-fp8"] = lambda: self.p2p.all_to_all_v(x, counts_dev, wire_dtype=wire)[0]
                methods["moecomm-p2p-fp8-known"] = lambda: self.p2p.all_to_all_v(x, send, recv, wire_dtype=wire)[0]
        if self.pg is not None:
            methods["torch"] = lambda: self._torch_pattern(x, counts_dev)
            methods["raw"] = self._raw_method(x, send, recv, pattern)
        results = []
        timed = self.time_methods({name: fn for name, fn in methods.items() if fn is not None})
        for name, (times, out) in timed.items():
            med = float(np.median(times))
            p99 = float(np.percentile(times, 99))
            algbw = size_bytes / med / 1e9 if med > 0 else 0.0
            wire_row = row_bytes
            if "fp8" in name:
                from moecomm.quant import packed_row_bytes

                wire_row = packed_row_bytes(self.args.row_elems)
            results.append(dict(pattern=pattern, size=size_bytes, rows=rows, method=name, time_us=med * 1e6,
                                p99_us=p99 * 1e6, algbw=algbw, busbw=algbw * (W - 1) / W, check=check(out, name),
                                wire_bytes=sum(send) * wire_row))
            if self.args.check_cost:  # every round's time, for ratios paired round by round
                results[-1]["times_us"] = [t * 1e6 for t in times]
        return results

    def _unchecked(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        self.comm.engine.row_tags = False  # private switch, for this measurement only
        try:
            return self.comm.all_to_all_v(x, send, recv)[0]
        finally:
            self.comm.engine.row_tags = True

    def _one_host_round(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        backend = self.comm.engine.backend
        backend.one_host_round = True  # (PeerBackend's switch, on this instance for this call only)
        try:
            return fn()
        finally:
            backend.one_host_round = False

    def _torch_pattern(self, x: torch.Tensor, counts_dev: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        recv_counts = torch.empty_like(counts_dev)
        dist.all_to_all_single(recv_counts, counts_dev, group=self.pg)
        recv = recv_counts.tolist()
        send = counts_dev.tolist()
        out = torch.empty((sum(recv), x.shape[1]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x, recv, send, group=self.pg)
        return out

    def _raw_method(self, x, send, recv, pattern) -> Optional[Callable[[], torch.Tensor]]:
        if not self.cuda:
            from mpi4py import MPI

            from moecomm.backends.mpi import byte_view

            row_type = MPI.BYTE.Create_contiguous(x.shape[1] * x.element_size()).Commit()
            sd = np.concatenate([[0], np.cumsum(send)[:-1]]).tolist()
            rd = np.concatenate([[0], np.cumsum(recv)[:-1]]).tolist()
            world = self.world

            def alltoallv() -> torch.Tensor:
                out = torch.empty((sum(recv), x.shape[1]), dtype=x.dtype)
                world.Alltoallv([byte_view(x), (send, sd), row_type], [byte_view(out), (recv, rd), row_type])
                return out

            return alltoallv
        if pattern != "uniform" or len(set(send)) != 1 or x.numel() == 0:
            return None
        nccl_comm = self.comm.engine.backend._comm  # the nccl4py Communicator under the backend
        stream = torch.cuda.current_stream(self.device)

        def ncclalltoall() -> torch.Tensor:
            out = torch.empty_like(x)
            nccl_comm.alltoall(x.view(torch.uint8), out.view(torch.uint8), stream=stream.cuda_stream)
            return out

        return ncclalltoall


def _max_op():
    from mpi4py import MPI

    return MPI.MAX


def _in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE


def _land_op():
    from mpi4py import MPI

    return MPI.LAND


def _fmt_size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def format_table(results: list[dict], header: str) -> str:
    """The printed table: a row per result; the ``wire`` and ``vs plain`` columns only when some
    method sent FP8 rows (``--wire-dtype``)."""
    wired = any("fp8" in r["method"] for r in results)
    lines = [header, f"{'size':>10} {'rows':>8} {'pattern':>8} {'method':>17} {'time(us)':>10} {'p99(us)':>10} "
             f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'check':>6} {'vs torch':>9} {'vs raw':>7}"
             + (f" {'wire':>10} {'vs plain':>9}" if wired else "")]
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in results:
        by_key.setdefault((r["pattern"], r["size"]), {})[r["method"]] = r
    for r in results:
        peers = by_key[(r["pattern"], r["size"])]
        ratio = lambda other: f"{r['time_us'] / peers[other]['time_us']:.2f}x" if other in peers and peers[other]["time_us"] > 0 else "-"
        wire = r.get("wire_bytes", r["size"])
        plain = r["method"].replace("-fp8", "")
        lines.append(f"{_fmt_size(r['size']):>10} {r['rows']:>8} {r['pattern']:>8} {r['method']:>17} {r['time_us']:>10.1f} "
                     f"{r['p99_us']:>10.1f} {r['algbw']:>12.3f} {r['busbw']:>12.3f} {'OK' if r['check'] else 'FAIL':>6} "
                     f"{ratio('torch') if r['method'].startswith('moecomm') else '-':>9} "
                     f"{ratio('raw') if r['method'].startswith('moecomm') else '-':>7}"
                     + (f" {wire:>10} {ratio(plain) if plain != r['method'] else '-':>9}" if wired else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = RankZeroParser(prog=prog(__spec__.name), description=__doc__.split("\n\n")[0],
                       epilog="Methods and columns: see the module docstring and the README's Benchmarks section.")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1K"),
                   help="smallest size per rank (1K); below one row it is one row")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"), help="largest size per rank (16M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="multiply the size by this each step (4)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed exchanges per size (20)")
    p.add_argument("-w", "--warmup", type=int, default=3, help="untimed exchanges first (3)")
    p.add_argument("--peer-copy-engines", action="store_true",
                   help="peer backend: add moecomm-known-ce and moecomm-equal(-ce) (see Methods)")
    p.add_argument("--peer-one-host-round", action="store_true",
                   help="peer backend, ranks sharing a GPU without MPS: add moecomm-oneround (see Methods)")
    p.add_argument("--batch", type=int, default=1,
                   help="exchanges issued back to back per timed run, one synchronize at the end (1; "
                        "nccl-tests' way: 10 or more)")
    p.add_argument("-p", "--patterns", default="uniform,random,skewed", help="comma list of uniform, random, skewed")
    p.add_argument("-d", "--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--row-elems", type=int, default=1024, help="elements per row (token); 1024")
    p.add_argument("--backend", default=None, help="moecomm backend (default: auto)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck exchange aborts")
    p.add_argument("--compare", action="store_true", help="also time torch's MoE pattern and the raw backend")
    p.add_argument("--check-cost", action="store_true",
                   help="also time moecomm-known without the default check (its cost); "
                        "the JSON then holds every round's time (times_us)")
    p.add_argument("--p2p-bytes", type=parse_size, default=None,
                   help="GPUs: also time a communicator with this much peer memory per rank (init(p2p_bytes=))")
    p.add_argument("--wire-dtype", choices=["float8_e4m3fn", "float8_e5m2"], default=None,
                   help="also time the exchanges with rows sent in this FP8 dtype (all_to_all_v(wire_dtype=))")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads per rank (the CPU quantization kernels of --wire-dtype use them); "
                        "default 1 on the CPU, where ranks share the host's cores, torch's default on a GPU")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.minbytes > args.maxbytes or args.stepfactor < 2 or args.iters < 1 or args.row_elems < 1 or args.batch < 1:
        parser.error("need -b <= -e, -f >= 2, -n >= 1, --batch >= 1 and --row-elems >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    bench = Bench(args)
    if args.threads is not None or not bench.cuda:
        torch.set_num_threads(args.threads or 1)
    row_bytes = bench.row_bytes()
    plan = plan_sizes(args.minbytes, args.maxbytes, args.stepfactor, row_bytes)
    patterns = [p for p in args.patterns.split(",") if p]
    rank0 = bench.comm.rank == 0
    rounded = [f"{_fmt_size(req)} -> {_fmt_size(rows * row_bytes)}" for req, rows in plan if req != rows * row_bytes]
    if rank0 and rounded:
        sys.stderr.write(f"# sizes in whole rows of {row_bytes} bytes: {', '.join(rounded)}\n")
    results: list[dict] = []
    bar = _progress_bar(len(plan) * len(patterns), rank0 and not args.no_progress)
    for pattern, (_, rows) in ((p, s) for p in patterns for s in plan):
        if bar is not None:
            bar.set_description(f"{pattern} {_fmt_size(rows * row_bytes)}")
        results.extend(bench.run_size(pattern, rows))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    if rank0:
        name = torch.cuda.get_device_name(bench.device) if bench.cuda else "cpu"
        header = (f"# moecomm all-to-all: {bench.comm.size} ranks, backend {bench.comm.backend}, {name}, "
                  f"dtype {args.dtype}, rows of {args.row_elems} elements, {args.iters} iters"
                  + (f" of {args.batch} exchanges back to back" if args.batch > 1 else "")
                  + f", torch {torch.__version__}, "
                  f"{torch.get_num_threads()} torch thread(s) per rank"
                  + (f", wire dtype {args.wire_dtype}" if args.wire_dtype else ""))
        print(format_table(results, header), flush=True)
        bad = [r for r in results if not r["check"]]
        if args.json:
            backend = bench.comm.engine.backend
            with open(args.json, "w") as fh:
                json.dump({"header": header, "world_size": bench.comm.size, "backend": bench.comm.backend,
                           "batch": args.batch,
                           "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) and bench.cuda,
                           "concurrent": getattr(backend, "concurrent", None), "results": results}, fh, indent=1)
        if bad:
            print(f"# {len(bad)} CHECK FAILURES", flush=True)
    if any(not r["check"] for r in results):
        sys.exit(1)
    return results


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:  # one rank failing must not leave the others waiting forever
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
