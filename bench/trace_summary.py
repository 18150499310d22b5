"""Summarise a torch.profiler chrome trace: GPU busy time per stream, overlap, idle gaps.

    python -m bench.trace_summary TRACE.json [--top 25]

For each CUDA stream: kernels, busy time (union of its kernel intervals) and what share
of it overlaps work on other streams. For the device: the span from the first kernel to
the last, the time some stream was busy, and the idle time (a GPU idle inside the span
waits on the host or on a peer). Then the kernels with the largest total time.

With ``--merge``: the traces are processes that shared one GPU (ranks under MPS): their
kernels on one time line (each trace's ``baseTimeNanoseconds`` added), over the span every
trace covers: the time some process ran real work, the time only exchange waits
(``--wait-kernel``, a name fragment) ran, the idle time; and each process's waits in order
(start and end against the span's start), which show who reached each exchange last.

With ``--host``: the host side too. Per thread (the caller's, and the autograd engine's
for CUDA backward passes), the time inside profiled calls; then the calls with the largest
*self* time (their time minus the calls nested in them), over all threads. Python
functions appear when the trace was recorded with ``with_stack=True``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Iterable, Optional

from ._common import prog

__all__ = ["main", "summarize", "summarize_host", "summarize_shared", "union_length", "intersection_length"]

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CATS = ("cpu_op", "python_function", "cuda_runtime", "cuda_driver", "user_annotation")


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals."""
    return sum(b - a for a, b in _merge(intervals))


def intersection_length(xs: Iterable[tuple[float, float]], ys: Iterable[tuple[float, float]]) -> float:
    """Length covered by both interval sets."""
    mx, my = _merge(xs), _merge(ys)
    i = j = 0
    total = 0.0
    while i < len(mx) and j < len(my):
        a, b = max(mx[i][0], my[j][0]), min(mx[i][1], my[j][1])
        if b > a:
            total += b - a
        if mx[i][1] < my[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(trace: dict, top: int = 25) -> str:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in _GPU_CATS]
    if not events:
        return "no GPU events in the trace"
    by_stream: dict[str, list[tuple[float, float]]] = defaultdict(list)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        stream = str(e.get("args", {}).get("stream", e.get("tid")))
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        by_stream[stream].append((start, start + dur))
        by_name[e.get("name", "?")].append(dur)
    everything = [iv for ivs in by_stream.values() for iv in ivs]
    span = max(b for _, b in everything) - min(a for a, _ in everything)
    busy = union_length(everything)
    lines = [f"span {span / 1e3:.3f} ms, some stream busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms "
             f"({100 * (span - busy) / span:.1f}%)", f"{'stream':>8} {'kernels':>8} {'busy_ms':>9} {'overlapped':>11}"]
    for stream, ivs in sorted(by_stream.items(), key=lambda kv: -union_length(kv[1])):
        others = [iv for s, o in by_stream.items() if s != stream for iv in o]
        own = union_length(ivs)
        shared = intersection_length(ivs, others)
        lines.append(f"{stream:>8} {len(ivs):>8} {own / 1e3:>9.3f} {100 * shared / own if own else 0:>10.1f}%")
    lines.append(f"{'total_ms':>9} {'count':>6}  kernel")
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{sum(durs) / 1e3:>9.3f} {len(durs):>6}  {name[:110]}")
    return "\n".join(lines)


def summarize_host(trace: dict, top: int = 25) -> str:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in _HOST_CATS]
    if not events:
        return "no host events in the trace"
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    self_time: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    lines = [f"{'thread':>24} {'events':>7} {'inside_ms':>10}"]
    for thread, evs in sorted(by_thread.items(), key=lambda kv: -len(kv[1])):
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack: list[list] = []  # [end, name, time of nested calls, duration]
        outer: list[tuple[float, float]] = []

        def pop() -> None:
            end, name, child, dur = stack.pop()
            self_time[name] += dur - child
            if stack:
                stack[-1][2] += dur

        for e in evs:
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
            while stack and stack[-1][0] <= start:
                pop()
            if not stack:
                outer.append((start, start + dur))
            name = f"[{e['cat']}] {e.get('name', '?')}"
            calls[name] += 1
            stack.append([start + dur, name, 0.0, dur])
        while stack:
            pop()
        lines.append(f"{str(thread)[:24]:>24} {len(evs):>7} {union_length(outer) / 1e3:>10.3f}")
    lines.append(f"{'self_ms':>9} {'calls':>7}  host call")
    for name, t in sorted(self_time.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{t / 1e3:>9.3f} {calls[name]:>7}  {name[:120]}")
    return "\n".join(lines)


def _gpu_intervals(trace: dict, wait: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(work, waits): the trace's GPU intervals in microseconds on the machine's clock."""
    base = float(trace.get("baseTimeNanoseconds", 0)) / 1e3
    work, waits = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in _GPU_CATS:
            a = float(e["ts"]) + base
            (waits if wait in e.get("name", "") else work).append((a, a + float(e.get("dur", 0.0))))
    return work, waits


def _clip(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def summarize_shared(traces: list[dict], wait: str = "signal_wait", show: int = 16) -> str:
    """The processes' GPU work on one time line (see the module's docstring, ``--merge``)."""
    per = [_gpu_intervals(t, wait) for t in traces]
    if any(not (w or x) for w, x in per):
        return "a trace without GPU events"
    lo = max(min(a for a, _ in w + x) for w, x in per)
    hi = min(max(b for _, b in w + x) for w, x in per)
    if hi <= lo:
        return "the traces do not overlap in time"
    span = hi - lo
    work = [iv for w, _ in per for iv in _clip(w, lo, hi)]
    waits = [iv for _, x in per for iv in _clip(x, lo, hi)]
    busy = union_length(work)
    only_wait = union_length(work + waits) - busy
    lines = [f"{len(traces)} processes, common span {span / 1e3:.3f} ms: some process's work running "
             f"{busy / 1e3:.3f} ms ({100 * busy / span:.1f}%), only waits {only_wait / 1e3:.3f} ms, idle "
             f"{(span - busy - only_wait) / 1e3:.3f} ms",
             f"{'process':>8} {'work_ms':>8} {'wait_ms':>8} {'waits':>6}  first waits: start-end (us from the span's start)"]
    for i, (w, x) in enumerate(per):
        cw, cx = _clip(w, lo, hi), sorted(_clip(x, lo, hi))
        first = " ".join(f"{a - lo:.0f}-{b - lo:.0f}" for a, b in cx[:show])
        lines.append(f"{i:>8} {union_length(cw) / 1e3:>8.3f} {union_length(cx) / 1e3:>8.3f} {len(cx):>6}  {first}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog=prog(__spec__.name), description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="chrome trace JSON files (torch.profiler export_chrome_trace)")
    p.add_argument("--top", type=int, default=25, help="kernels (and host calls) to list (25)")
    p.add_argument("--host", action="store_true", help="also summarise the host threads' calls")
    p.add_argument("--merge", action="store_true", help="the traces are processes sharing one GPU: one time line")
    p.add_argument("--wait-kernel", default="signal_wait", help="with --merge: the exchange's wait kernel (a name "
                   "fragment; default signal_wait)")
    args = p.parse_args(argv)
    if args.merge:
        traces = []
        for path in args.traces:
            with open(path) as fh:
                traces.append(json.load(fh))
        print(f"# {' '.join(args.traces)}\n{summarize_shared(traces, args.wait_kernel)}", flush=True)
        return
    for path in args.traces:
        with open(path) as fh:
            trace = json.load(fh)
        print(f"# {path}\n{summarize(trace, args.top)}", flush=True)
        if args.host:
            print(f"# {path}: host\n{summarize_host(trace, args.top)}", flush=True)


if __name__ == "__main__":
    main()
