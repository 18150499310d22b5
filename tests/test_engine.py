"""The internal engine (moecomm.engine.engine): one timeout, per-call timeouts on stream-ordered
backends, sub-engines owned by their parent, and the init option that replaced a module knob."""

from __future__ import annotations

import types

import pytest
import torch

import moecomm
from moecomm.engine.engine import Engine
from moecomm.pool import StagingPool


def test_one_timeout_kept_by_the_backend():
    c = moecomm.init(backend="self", timeout=7, set_default=False)
    assert c.timeout == c.engine.timeout == c.engine.backend.timeout_s == 7.0
    c.timeout = 3
    assert c.engine.backend.timeout_s == 3.0  # what the backend's own waits (NCCL's watchdog) use
    with pytest.raises(ValueError, match="timeout must be > 0"):
        c.timeout = 0
    assert c.timeout == 3.0
    c.close()


class _StreamOrdered:
    """A stand-in for a stream-ordered backend (NCCL): records what the engine asks of it."""

    name, rank, size, device = "fake", 0, 1, torch.device("cpu")
    stream_ordered = True
    progress_on_test = False

    def __init__(self) -> None:
        self.watched: list = []

    def watch_stream(self, op, timeout_s, problem=None):
        self.watched.append((op, timeout_s))

    def check_health(self):
        pass


def test_per_call_timeout_reaches_a_stream_ordered_backend():
    backend = _StreamOrdered()
    engine = Engine(backend, StagingPool(0), timeout=60, validate=False)
    joined = []
    request = types.SimpleNamespace(join=lambda: joined.append(1), test=lambda: True)
    engine.complete(request, "all_to_all_v", None)
    assert joined == [1] and backend.watched == []  # the default: the watchdog of the issue
    engine.complete(request, "all_to_all_v", 2.5)
    assert joined == [1, 1] and backend.watched == [("all_to_all_v", 2.5)]


def test_owned_sub_engines_close_and_abort_with_their_parent():
    for end in ("close", "abort"):
        c = moecomm.init(backend="mpi", hierarchy=True, set_default=False)
        h = c.topology.hierarchy
        assert h is not None and not h.intra.closed
        free, _ = c.engine.split(0, 0)  # not owned: outlives its parent
        getattr(c, end)()
        assert h.intra.closed and h.rail.closed and not free.closed
        assert h.intra.engine.closed_as == ("closed" if end == "close" else "aborted")
        free.close()


def test_p2p_min_bytes_is_checked():
    for bad in (-1, 1.5, True, "16M"):
        with pytest.raises(ValueError, match="p2p_min_bytes must be an int >= 0"):
            moecomm.init(backend="self", p2p_min_bytes=bad, set_default=False)
    c = moecomm.init(backend="self", p2p_min_bytes=0, set_default=False)  # no peer memory: no effect
    assert c.engine.peer is None
    out, recv = c.all_to_all_v(torch.arange(6.0).reshape(3, 2), [3])
    assert recv == [3] and torch.equal(out, torch.arange(6.0).reshape(3, 2))
    c.close()
