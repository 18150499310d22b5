"""The ``python -m topology`` command line: probe, tune, show, simulate."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from .rank_parser import RankZeroParser

__all__ = ["main"]

DEFAULT_TUNE_SIZES = "4K,16K,64K,256K,1M,4M,16M"
DEFAULT_PROBE_SIZES = "256,4K,64K,1M,16M"  # 16M per peer: enough to see the bandwidth of NVLink
DEFAULT_SIM_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M,256M,1G"
DEFAULT_GPUS = "64,128,256,512,1024,2048,4096"

# Figures for `simulate` when neither a profile nor flags give them (assumptions, not
# measurements): an H100/H200-class node (NVLink: ~10 us per call, ~0.5 us per message,
# ~150 GB/s per GPU), a 400 Gb/s NIC per GPU (~15 us per call, ~2 us per message, ~45 GB/s)
# and HBM layout copies (~5 us, ~1.5 TB/s).
DEFAULT_LINKS = {"alpha_intra": 10e-6, "msg_intra": 0.5e-6, "beta_intra": 150e9,
                 "alpha_inter": 15e-6, "msg_inter": 2e-6, "beta_inter": 45e9,
                 "alpha_copy": 5e-6, "beta_copy": 1.5e12}


def _sizes(text: str) -> list[int]:
    from .measure import parse_bytes

    out = [parse_bytes(t) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError("give at least one size")
    return out


def _ints(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


class _UsageError(Exception):
    """A command line that cannot work in this launch (printed by rank 0; exit status 2)."""


def _launch_size() -> int:
    """How many ranks this launch has (1 without a launcher), read before any communicator exists."""
    import os

    from moecomm.launch import detect_launcher, mpi_world

    launcher = detect_launcher()
    if launcher == "mpi":
        return int(mpi_world().Get_size())
    if launcher == "torchrun":
        return int(os.environ.get("WORLD_SIZE", "1"))
    return 1


def _init(args):
    import moecomm

    size, local = _launch_size(), args.local_size
    if local is not None and local > 1 and size % local:
        example = f"mpiexec -n {2 * local} python -m topology {args.command} --local-size {local}"
        where = "one process, without a launcher" if size == 1 else f"{size} ranks"
        raise _UsageError(
            f"{args.command} is collective and --local-size {local} simulates nodes of {local} ranks, but this is "
            f"{where}: run under mpiexec -n N (N a multiple of {local}), e.g. `{example}` (or torchrun "
            f"--nproc-per-node N)")
    return moecomm.init(backend=args.backend, local_size=local, hierarchy=True, set_default=False)


def _dtype(name: str):
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise argparse.ArgumentTypeError(f"not a torch dtype: {name!r}")
    return dt


def _launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None, help="moecomm backend (default: $MOECOMM_BACKEND or auto)")
    p.add_argument("--local-size", type=int, default=None,
                   help="ranks per node, overriding host names (simulates nodes on one machine)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per point (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per point (default 3)")


# -- probe -----------------------------------------------------------------------------------


def cmd_probe(args) -> int:
    from .measure import probe_links

    comm = _init(args)
    say = print if comm.rank == 0 else (lambda s: None)
    say(f"probe: {comm.size} ranks as {comm.num_nodes} node(s) x {comm.local_size}, backend {comm.backend}, "
        f"device {comm.device}")
    if comm.size == 1:
        say("probe: one rank has no links to measure, only the layout copy: run under mpiexec -n N "
            "(or torchrun --nproc-per-node N) for the intra- and inter-node links")
    links = probe_links(comm, args.sizes, iters=args.iters, warmup=args.warmup, log=say)
    if comm.rank == 0:
        _print_links(links)
        if args.out:
            Path(args.out).write_text(json.dumps({"fingerprint": comm.topology.fingerprint.to_json(), "links": links},
                                                 indent=2) + "\n")
            print(f"wrote {args.out}")
    comm.close()
    return 0


def _print_links(links: dict) -> None:
    from .measure import format_seconds

    print(f"{'link':6s} {'alpha (per call)':>17s} {'msg (per message)':>18s} {'beta (bandwidth)':>17s}  group")
    for name in ("intra", "inter", "copy"):
        if name in links:
            fig = links[name]
            beta = fig["beta_Bps"]
            bw = "inf" if beta >= 1e29 else f"{beta / 1e9:.3f} GB/s"
            print(f"{name:6s} {format_seconds(fig['alpha_s']):>17s} {format_seconds(fig.get('msg_s', 0.0)):>18s} "
                  f"{bw:>17s}  {fig.get('group', '')}")


# -- tune ------------------------------------------------------------------------------------


def _expert_fn(hidden: int, row_bytes: int, dtype, device):
    """An expert FFN (two matmuls with a ReLU) over rows of ``row_bytes``, for the overlap
    sweep; None (identity compute) when ``hidden`` is 0."""
    if not hidden:
        return None
    import torch

    width = row_bytes // torch.empty((), dtype=dtype).element_size()
    if width < 1 or width * torch.empty((), dtype=dtype).element_size() != row_bytes:
        raise SystemExit(f"--expert-hidden needs --row-bytes to hold whole {dtype} elements, got {row_bytes}")
    if not dtype.is_floating_point:
        raise SystemExit(f"--expert-hidden needs a floating --dtype, got {dtype}")
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(width, hidden, generator=g) / width ** 0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(hidden, width, generator=g) / hidden ** 0.5).to(device=device, dtype=dtype)
    return lambda rows, chunk: torch.relu(rows @ w1) @ w2


def cmd_tune(args) -> int:
    from .tune import default_output, tune

    comm = _init(args)
    if comm.rank == 0:
        print(f"tune: {comm.size} ranks as {comm.num_nodes} node(s) x {comm.local_size}, backend {comm.backend}, "
              f"fingerprint {comm.topology.fingerprint.key()}")
    profile = tune(comm, args.sizes, iters=args.iters, warmup=args.warmup, row_bytes=args.row_bytes,
                   dtype=args.dtype, skew=args.skew, known_counts=args.known_counts,
                   probe_sizes=[] if args.no_probe else args.probe_sizes, degrees=args.degrees or (),
                   expert_fn=_expert_fn(args.expert_hidden, args.row_bytes, args.dtype, comm.device))
    if comm.rank == 0:
        out = args.out or default_output(profile)
        path = profile.save(out)
        print(f"wrote {path}")
    comm.barrier()
    comm.close()
    return 0


# -- show ------------------------------------------------------------------------------------


def cmd_show(args) -> int:
    from moecomm.profile import load_profile

    from .measure import format_bytes, format_seconds

    prof = load_profile(args.profile)
    fp = prof.fingerprint
    print(f"profile {args.profile}")
    print(f"  cluster: {fp.describe()}  (key {fp.key()})")
    if prof.created:
        print(f"  created {prof.created} with moecomm {prof.moecomm_version}")
    algs = sorted({a for e in prof.entries for a in e.timings})
    algs = [a for a in ("flat", "2dh") if a in algs] + [a for a in algs if a not in ("flat", "2dh")]
    head = f"{'bytes/rank':>10s} " + " ".join(f"{a + ' med':>12s} {a + ' p99':>12s}" for a in algs) + "  choice  speedup"
    print(head)
    for e in prof.entries:
        cells = []
        for a in algs:
            t = e.timings.get(a, {})
            cells.append(f"{_fmt(t.get('median_s'), format_seconds):>12s} {_fmt(t.get('p99_s'), format_seconds):>12s}")
        f, h = e.timings.get("flat", {}).get("median_s"), e.timings.get("2dh", {}).get("median_s")
        speed = f"{f / h:.2f}x" if f and h else "-"
        deg = f" d={e.degree}" if e.degree else ""
        print(f"{format_bytes(e.bytes_per_rank):>10s} " + " ".join(cells) + f"  {e.choice:6s}  {speed}{deg}")
    if prof.links:
        _print_links(prof.links)
    if args.no_plot:
        return 0
    from .plot import plot_profile

    png = args.png or f"{fp.key()}.png"
    try:
        plot_profile(prof, png)
    except ImportError as exc:
        if args.png:  # asked for by name: an error
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"no plot: {exc}")
        return 0
    print(f"plot: {png}")
    return 0


def _fmt(v, f) -> str:
    return "-" if v is None else f(v)


# -- simulate --------------------------------------------------------------------------------


def cmd_simulate(args) -> int:
    from moecomm.profile import load_profile

    from .measure import format_bytes, format_seconds
    from .model import Link, Links, crossover, flat_time, hdh_time, links_from_profile

    prof = load_profile(args.profile) if args.profile else None
    concurrent = None if args.flat_links == "auto" else (args.flat_links == "concurrent")
    if prof is not None:
        one_host = "-1host" in prof.fingerprint.link
        links = links_from_profile(prof.links, concurrent=concurrent, one_host=one_host)
        source = f"profile {args.profile} ({prof.fingerprint.describe()})"
    else:
        d = DEFAULT_LINKS
        links = Links(Link(d["alpha_intra"], d["beta_intra"], d["msg_intra"]),
                      Link(d["alpha_inter"], d["beta_inter"], d["msg_inter"]),
                      Link(d["alpha_copy"], d["beta_copy"]),
                      True if concurrent is None else concurrent)
        source = "built-in figures of an H100/H200-class cluster (assumed, not measured)"
    # Flags override whichever figures were loaded.
    given = {k: getattr(args, k) for k in DEFAULT_LINKS if getattr(args, k) is not None}
    if given:
        source += " overridden by " + ", ".join(f"--{k.replace('_', '-')}" for k in given)
        i, e, c = links.intra, links.inter, links.copy
        links = Links(
            Link(given.get("alpha_intra", i.alpha_s), given.get("beta_intra", i.beta_Bps), given.get("msg_intra", i.msg_s)),
            Link(given.get("alpha_inter", e.alpha_s), given.get("beta_inter", e.beta_Bps), given.get("msg_inter", e.msg_s)),
            Link(given.get("alpha_copy", c.alpha_s), given.get("beta_copy", c.beta_Bps)),
            links.concurrent,
        )
    n, l = _layout(args, prof)
    print(f"alpha-beta model: {n} node(s) x {l} rank(s) = {n * l} ranks; figures from {source}")
    for name, lk in (("intra", links.intra), ("inter", links.inter), ("copy", links.copy)):
        bw = "inf" if lk.beta_Bps >= 1e29 else f"{lk.beta_Bps / 1e9:.3f} GB/s"
        print(f"  {name:5s} alpha {format_seconds(lk.alpha_s):>9s}/call  msg {format_seconds(lk.msg_s):>9s}  beta {bw}")
    print(f"  flat: intra and inter traffic {'concurrent (max)' if links.concurrent else 'serialised (sum)'}")
    print(f"{'bytes/rank':>10s} {'flat':>10s} {'2dh':>10s} {'flat/2dh':>9s}  faster")
    for b in args.sizes:
        f, h = flat_time(links, n, l, b), hdh_time(links, n, l, b)
        print(f"{format_bytes(b):>10s} {format_seconds(f):>10s} {format_seconds(h):>10s} {f / h:9.2f}  "
              f"{'2dh' if h < f else 'flat'}")
    x = crossover(links, n, l)
    print(_crossover_text(links, n, l, x))
    print(f"\npredicted flat/2dh time ratio at {l} ranks per node (>1: 2DH faster):")
    probe_sizes = args.ratio_sizes
    print(f"{'GPUs':>6s} {'nodes':>6s} " + " ".join(f"{format_bytes(b):>9s}" for b in probe_sizes) + "   crossover")
    for g in args.gpus:
        if g % l:
            print(f"{g:6d}      -  (not a multiple of local size {l})")
            continue
        nn = g // l
        ratios = " ".join(f"{flat_time(links, nn, l, b) / hdh_time(links, nn, l, b):9.2f}" for b in probe_sizes)
        cx = crossover(links, nn, l)
        print(f"{g:6d} {nn:6d} {ratios}   {format_bytes(cx) if cx else '-'}")
    if args.wire_dtype is not None:
        _print_wire(args, links, n, l)
    print()
    print(_error_text(prof, concurrent, links if given else None))
    return 0


def _layout(args, prof) -> tuple[int, int]:
    """``--nodes`` and ``--local-size``, each defaulting to the profile's (its fingerprint's layout)."""
    fp = prof.fingerprint if prof is not None else None
    n = args.nodes if args.nodes is not None else (fp.num_nodes if fp is not None else None)
    l = args.local_size if args.local_size is not None else (fp.local_size if fp is not None else None)
    if n is None or l is None:
        missing = " and ".join(f for f, v in (("--nodes", n), ("--local-size", l)) if v is None)
        raise _UsageError(f"simulate needs {missing} (or --profile PROFILE, whose layout is the default)")
    return n, l


def _print_wire(args, links, n: int, l: int) -> None:
    """The ``--wire-dtype`` tables: each exchange with its faster algorithm, plain against FP8."""
    from .measure import format_bytes, format_seconds
    from .model import best_time, wire_ratio, wire_time

    import torch

    plain, wire = args.dtype, args.wire_dtype
    esize = torch.empty((), dtype=getattr(torch, plain)).element_size()
    w = wire_ratio(args.row_elems, esize)
    print(f"\nwire dtype {wire}: rows of {args.row_elems} {plain} ({args.row_elems * esize} B) travel as "
          f"{round(w * args.row_elems * esize)} B ({w:.3f}x), plus a quantize and a dequantize pass on the copy link; "
          f"each exchange with its faster algorithm")
    print(f"{'bytes/rank':>10s} {plain:>10s} {'':4s} {wire:>14s} {'':4s} {'ratio':>6s}")
    for b in args.sizes:
        t0, a0 = best_time(links, n, l, b)
        t1, a1 = wire_time(links, n, l, b, w)
        print(f"{format_bytes(b):>10s} {format_seconds(t0):>10s} {a0:4s} {format_seconds(t1):>14s} {a1:4s} {t1 / t0:6.2f}")
    print(f"\npredicted {wire}/{plain} time ratio at {l} ranks per node (<1: {wire} faster):")
    print(f"{'GPUs':>6s} {'nodes':>6s} " + " ".join(f"{format_bytes(b):>9s}" for b in args.ratio_sizes))
    for g in args.gpus:
        if g % l:
            continue
        nn = g // l
        ratios = " ".join(f"{wire_time(links, nn, l, b, w)[0] / best_time(links, nn, l, b)[0]:9.2f}"
                          for b in args.ratio_sizes)
        print(f"{g:6d} {nn:6d} {ratios}")


def _crossover_text(links, n, l, x) -> str:
    from .measure import format_bytes
    from .model import flat_time, hdh_time

    if x is None:
        small = hdh_time(links, n, l, 1024) < flat_time(links, n, l, 1024)
        return f"crossover: none between 1 B and 1 TiB per rank: {'2dh' if small else 'flat'} is faster at every size"
    below = hdh_time(links, n, l, x / 2) < flat_time(links, n, l, x / 2)
    return (f"crossover: {format_bytes(x)} per rank ({format_bytes(x / (n * l))} per peer): "
            f"{'2dh' if below else 'flat'} is faster below, {'flat' if below else '2dh'} above")


def _error_text(prof, concurrent, override) -> str:
    from .model import links_from_profile, model_error

    if prof is None:
        return ("model error: not checked: no measurements given (pass --profile PROFILE written by "
                "`python -m topology tune` on this cluster to compare the model with its timings)")
    if not prof.links:
        return "model error: not checked: the profile has no probe figures (tuned with --no-probe)"
    fp = prof.fingerprint
    links = override or links_from_profile(prof.links, concurrent=concurrent, one_host="-1host" in fp.link)
    measured = [(e.bytes_per_rank, a, e.timings[a]["median_s"]) for e in prof.entries for a in ("flat", "2dh")
                if a in e.timings and e.timings[a].get("median_s")]
    err = model_error(links, fp.num_nodes, fp.local_size, measured)
    if not err["n"]:
        return "model error: not checked: the profile has no timings"
    parts = ", ".join(f"{a} mean {v['mean_abs_rel'] * 100:.0f}% max {v['max_abs_rel'] * 100:.0f}%"
                      for a, v in err["per_algorithm"].items())
    from .model import flat_time, hdh_time

    agree = sum(1 for e in prof.entries
                if ("2dh" if hdh_time(links, fp.num_nodes, fp.local_size, e.bytes_per_rank)
                    < flat_time(links, fp.num_nodes, fp.local_size, e.bytes_per_rank) else "flat") == e.choice)
    return (f"model error vs the measured timings of {fp.num_nodes}x{fp.local_size} ({fp.device}, {fp.link}), "
            f"fitted from that run's own probe: mean |error| {err['mean_abs_rel'] * 100:.0f}%, max "
            f"{err['max_abs_rel'] * 100:.0f}% over {err['n']} timings ({parts}); the model picks the measured "
            f"winner at {agree} of {len(prof.entries)} sizes")


# -- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = RankZeroParser(prog="moecomm-topology" if __package__.startswith("moecomm.") else "python -m topology", description=(
        "Measure links, tune flat vs 2D-hierarchical all-to-all per cluster, show profiles, and model "
        "larger clusters. probe and tune are collective: run them under mpirun/mpiexec or torchrun."))
    sub = p.add_subparsers(dest="command", required=True)

    pr = sub.add_parser("probe", help="latency and bandwidth of intra-node, inter-node links and layout copies")
    _launch_args(pr)
    pr.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_PROBE_SIZES),
                    help=f"bytes per peer (default {DEFAULT_PROBE_SIZES})")
    pr.add_argument("--out", default=None, help="also write the figures as JSON here")
    pr.set_defaults(func=cmd_probe)

    tu = sub.add_parser("tune", help="time flat and 2dh per size; write the profile")
    _launch_args(tu)
    tu.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_TUNE_SIZES),
                    help=f"bytes per rank (default {DEFAULT_TUNE_SIZES})")
    tu.add_argument("--probe-sizes", type=_sizes, default=_sizes(DEFAULT_PROBE_SIZES),
                    help=f"bytes per peer for the link probe stored in the profile (default {DEFAULT_PROBE_SIZES})")
    tu.add_argument("--no-probe", action="store_true", help="skip the link probe (simulate then cannot use the profile)")
    tu.add_argument("--row-bytes", type=int, default=1024, help="bytes per row (default 1024)")
    tu.add_argument("--dtype", type=_dtype, default="bfloat16", help="row dtype (default bfloat16)")
    tu.add_argument("--skew", type=float, default=0.0,
                    help="0: equal splits; s > 0: Dirichlet(1/s) variable splits per rank")
    tu.add_argument("--known-counts", action="store_true", help="pass recv_splits (no count exchange timed)")
    tu.add_argument("--degrees", type=_ints, default=None,
                    help="overlap chunk counts to time through comm.scatter_compute_gather (identity compute) with each size's chosen algorithm; the best is stored as the entry's degree")
    tu.add_argument("--expert-hidden", type=int, default=0,
                    help="with --degrees: overlap an expert FFN of this hidden size (default 0: identity compute)")
    tu.add_argument("--out", default=None, help="profile path (default: <profile dir>/<fingerprint>.json)")
    tu.set_defaults(func=cmd_tune)

    sh = sub.add_parser("show", help="print a profile's table and plot time against size (matplotlib)")
    sh.add_argument("profile")
    sh.add_argument("--png", default=None,
                    help="plot path, .png (or .svg, .pdf) (default: ./<fingerprint key>.png, drawn only if "
                         "matplotlib is installed)")
    sh.add_argument("--no-plot", action="store_true")
    sh.set_defaults(func=cmd_show)

    si = sub.add_parser("simulate", help="alpha-beta model of flat vs 2dh; crossover and scaling to 4096 GPUs")
    si.add_argument("--nodes", type=int, default=None, help="nodes to model (default: the profile's)")
    si.add_argument("--local-size", type=int, default=None, help="ranks per node (default: the profile's)")
    si.add_argument("--profile", default=None,
                    help="read link figures, the node layout (unless --nodes/--local-size give it) and timings "
                         "(to state the error) from it")
    for k, v in DEFAULT_LINKS.items():
        kind = {"alpha": "seconds per call", "msg": "seconds per message", "beta": "bytes per second"}[k.split("_")[0]]
        si.add_argument(f"--{k.replace('_', '-')}", type=float, default=None, help=f"{kind} (default {v:g})")
    si.add_argument("--flat-links", choices=("auto", "concurrent", "serial"), default="auto",
                    help="flat: intra and inter traffic overlap or not (auto: serial for one-host profiles)")
    si.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_SIM_SIZES), help="bytes per rank to tabulate")
    si.add_argument("--gpus", type=_ints, default=_ints(DEFAULT_GPUS), help=f"scales (default {DEFAULT_GPUS})")
    si.add_argument("--ratio-sizes", type=_sizes, default=_sizes("1M,16M,256M"),
                    help="bytes per rank for the scaling table (default 1M,16M,256M)")
    si.add_argument("--wire-dtype", choices=("float8_e4m3fn", "float8_e5m2"), default=None,
                    help="also model all_to_all_v(wire_dtype=): rows sent in this FP8 dtype against --dtype")
    si.add_argument("--row-elems", type=int, default=2048, help="with --wire-dtype: elements per row (default 2048)")
    si.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                    help="with --wire-dtype: the rows' own dtype (default bfloat16)")
    si.set_defaults(func=cmd_simulate)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if any(v is not None and v < 1 for v in (getattr(args, "nodes", None), getattr(args, "local_size", None))):
        print("error: --nodes and --local-size must be >= 1", file=sys.stderr)
        return 2
    if getattr(args, "row_elems", 1) < 1:
        print("error: --row-elems must be >= 1", file=sys.stderr)
        return 2
    if getattr(args, "iters", 1) < 1:
        print("error: --iters must be >= 1", file=sys.stderr)
        return 2
    from moecomm.profile import ProfileError

    try:
        return args.func(args)
    except (ProfileError, _UsageError) as exc:
        from .rank_parser import launcher_rank

        if launcher_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
