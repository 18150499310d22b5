"""The trace summariser's interval arithmetic and report (bench/trace_summary.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.trace_summary import intersection_length, summarize, union_length

intervals = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1])), max_size=12)


def _covered(ivs) -> set:
    return {x for a, b in ivs for x in range(a, b)}


@settings(max_examples=200, deadline=None)
@given(intervals, intervals)
def test_union_and_intersection_match_unit_cells(xs, ys):
    assert union_length(xs) == len(_covered(xs))
    assert intersection_length(xs, ys) == len(_covered(xs) & _covered(ys))


def test_summary_reports_streams_overlap_and_idle():
    def k(stream, ts, dur, name="k"):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}

    trace = {"traceEvents": [k(7, 0, 100, "gemm"), k(7, 100, 100, "gemm"), k(13, 150, 100, "nccl"),
                             k(13, 400, 100, "nccl"), {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 999}]}
    text = summarize(trace)
    assert "span 0.500 ms, some stream busy 0.350 ms, idle 0.150 ms (30.0%)" in text
    lines = text.splitlines()
    assert any(line.split()[:4] == ["7", "2", "0.200", "25.0%"] for line in lines)
    assert any(line.split()[:4] == ["13", "2", "0.200", "25.0%"] for line in lines)
    assert summarize({"traceEvents": []}) == "no GPU events in the trace"
