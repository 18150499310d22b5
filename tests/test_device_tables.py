"""moecomm.engine.device_tables: host tables on the device, also during CUDA graph capture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecomm.engine.device_tables import _runs, int64_table

_ints = st.lists(st.integers(-5, 40), max_size=60)


@settings(deadline=None, max_examples=200)
@given(values=_ints, ranges=st.lists(st.tuples(st.integers(-3, 30), st.integers(0, 9)), max_size=8))
def test_runs_rebuild_any_table(values, ranges):
    a = np.array(values + [v for s, n in ranges for v in range(s, s + n)], dtype=np.int64)
    rebuilt = np.empty_like(a)
    covered = 0
    for start, stop, step in _runs(a):
        assert start == covered and stop > start and step in (0, 1)
        rebuilt[start:stop] = a[start] + step * np.arange(stop - start)
        covered = stop
    assert covered == a.size
    np.testing.assert_array_equal(rebuilt, a)


def test_runs_are_maximal():
    a = np.array([3, 4, 5, 5, 5, 9, 2, 3], dtype=np.int64)
    assert _runs(a) == [(0, 3, 1), (3, 5, 0), (5, 6, 0), (6, 8, 1)]


def test_cpu_table_is_the_array():
    a = np.array([4, 1, 1, 7], dtype=np.int64)
    t = int64_table(a, torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [4, 1, 1, 7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_table_survives_reuse_of_pinned_memory():
    rng = np.random.default_rng(3)
    a = np.concatenate([np.arange(5, 40), np.full(7, 2), rng.integers(0, 100, 20), np.arange(-4, 3)])
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int64_table(a, dev) * 1
    for i in range(3):  # other tables through pinned memory between replays
        int64_table(rng.integers(0, 100, a.size), dev)
        graph.replay()
        torch.cuda.synchronize()
        assert out.cpu().tolist() == a.tolist(), f"replay {i}"
