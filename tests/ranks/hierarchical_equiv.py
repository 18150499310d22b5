"""2DH against flat on real MPI ranks (run by tests/test_hierarchical_mpi.py).

Arguments: layouts to check, each ``NxL`` (``N`` nodes of ``L`` ranks through the
``local_size=`` override), ``rrN`` (``N`` nodes with ranks dealt round robin, so that
ranks of a node are not consecutive) or ``uneq`` (nodes of unequal size).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moecomm
import moecomm.functional as F
from moecomm import hierarchical
from moecomm.collectives import topology as _topology
from moecomm.engine.engine import Engine
from moecomm.communicator import Communicator
from moecomm.layout import Layout
from tests.mpi_util import collective_assert, rank_main
from tests.ranks.data import DTYPES, ROW_SHAPES, as_bytes, count_matrix, expected_bytes, input_for

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=6,
                    suppress_health_check=list(HealthCheck))

BASE = moecomm.init(backend="mpi", timeout=60, set_default=False, hierarchy=False)
W, R = BASE.size, BASE.rank


def _custom(node_of_rank: tuple, hierarchy) -> Communicator:
    """A communicator over BASE's ranks with an arbitrary node layout."""
    layout = Layout._from_node_of_rank(R, node_of_rank)
    engine = Engine(BASE.engine.backend, BASE.engine.pool, timeout=BASE.timeout, validate=False)
    topology = _topology.build(engine, layout, sub_communicator=Communicator, hierarchy=hierarchy, profile=None,
                               hosts=["h"] * W, local_size_given=True)
    return Communicator(engine, layout, topology=topology)


def make(spec: str) -> Communicator:
    if spec.startswith("rr"):
        n = int(spec[2:])
        comm = _custom(tuple(r % n for r in range(W)), True)
        collective_assert(not comm.topology.hierarchy.contiguous, "round robin layout should not be contiguous")
        return comm
    n, l = (int(v) for v in spec.split("x"))
    assert n * l == W, f"layout {spec} does not fit {W} ranks"
    comm = moecomm.init(backend="mpi", local_size=l, timeout=60, set_default=False)
    collective_assert((comm.num_nodes, comm.local_size) == (n, l), f"{spec}: got {comm!r}")
    h = comm.topology.hierarchy
    collective_assert(h is not None and h.contiguous, f"{spec}: no hierarchy")
    collective_assert((h.intra.size, h.rail.size, h.intra.rank, h.rail.rank) ==
                      (l, n, comm.local_rank, comm.node_rank), f"{spec}: sub-communicators {h.intra!r} {h.rail!r}")
    return comm


def checks_for(spec: str) -> list:
    comm = make(spec)

    @SETTINGS
    @given(seed=st.integers(0, 2**31), max_rows=st.integers(0, 5), zero_fraction=st.sampled_from([0.0, 0.4, 1.0]),
           dtype=st.sampled_from(DTYPES), row_shape=st.sampled_from(ROW_SHAPES), known=st.booleans(),
           async_op=st.booleans(), tensor_splits=st.booleans())
    def check_equal(seed, max_rows, zero_fraction, dtype, row_shape, known, async_op, tensor_splits):
        m = count_matrix(seed, W, max_rows, zero_fraction)
        x = input_for(seed, R, m, row_shape, dtype)
        send = [int(v) for v in m[R]]
        recv = [int(v) for v in m[:, R]] if known else None
        flat, flat_recv = comm.all_to_all_v(x, send, recv)
        arg = torch.tensor(send) if tensor_splits else send
        res = comm.all_to_all_v(x, arg, recv, algorithm="2dh", async_op=async_op)
        out, out_recv = res.wait() if async_op else res
        ok = (out_recv == flat_recv == [int(v) for v in m[:, R]] and out.dtype == dtype
              and out.shape == flat.shape and np.array_equal(as_bytes(out), as_bytes(flat))
              and np.array_equal(as_bytes(out), expected_bytes(seed, R, m, row_shape, dtype)))
        collective_assert(ok, f"{spec}: 2dh != flat, seed={seed} dtype={dtype} shape={row_shape} "
                              f"known={known} async={async_op} counts={m.tolist()}")

    @SETTINGS
    @given(seed=st.integers(0, 2**31), max_rows=st.integers(0, 4),
           dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
           row_shape=st.sampled_from([(3,), (2, 2), ()]), known=st.booleans())
    def check_grad(seed, max_rows, dtype, row_shape, known):
        m = count_matrix(seed, W, max_rows, 0.3)
        send = [int(v) for v in m[R]]
        recv = [int(v) for v in m[:, R]] if known else None
        gen = torch.Generator().manual_seed(seed * 31 + R)
        x = torch.randn((sum(send),) + row_shape, generator=gen, dtype=torch.float64).to(dtype)
        grads, outs = [], []
        for alg in ("flat", "2dh"):
            xi = x.clone().requires_grad_()
            y, got = F.all_to_all_v(xi, send, recv, comm=comm, algorithm=alg)
            up = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed * 7 + R), dtype=torch.float64)
            (y * up.to(dtype)).sum().backward()
            grads.append(xi.grad)
            outs.append(y.detach())
        ok = (grads[0] is not None and grads[1] is not None and grads[1].shape == x.shape
              and np.array_equal(as_bytes(grads[0]), as_bytes(grads[1]))
              and np.array_equal(as_bytes(outs[0]), as_bytes(outs[1])))
        collective_assert(ok, f"{spec}: 2dh backward != flat backward, seed={seed} dtype={dtype} counts={m.tolist()}")

    def check_async_interleaved():
        """Several 2DH exchanges in flight at once, waited out of order, beside flat ones."""
        cases = []
        for i, dtype in enumerate([torch.float32, torch.int16, torch.bool, torch.bfloat16]):
            seed = 1000 + i
            m = count_matrix(seed, W, 4, 0.3)
            x = input_for(seed, R, m, (2,), dtype)
            send = [int(v) for v in m[R]]
            recv = [int(v) for v in m[:, R]] if i % 2 else None
            cases.append((seed, m, dtype, x, send, recv))
        works = [comm.all_to_all_v(x, send, recv, algorithm="2dh" if i != 2 else "flat", async_op=True)
                 for i, (_, _, _, x, send, recv) in enumerate(cases)]
        sync = comm.all_to_all_v(cases[0][3], cases[0][4], algorithm="2dh")
        results = {}
        for i in (3, 1, 0, 2):
            while not works[i].is_completed():
                pass
            results[i] = works[i].wait()
        ok = np.array_equal(as_bytes(sync[0]), expected_bytes(cases[0][0], R, cases[0][1], (2,), cases[0][2]))
        for i, (seed, m, dtype, *_rest) in enumerate(cases):
            ok = ok and np.array_equal(as_bytes(results[i][0]), expected_bytes(seed, R, m, (2,), dtype))
        collective_assert(ok, f"{spec}: interleaved async exchanges delivered wrong rows")

    def check_auto():
        seed = 77
        m = count_matrix(seed, W, 3, 0.2)
        x = input_for(seed, R, m, (4,), torch.float32)
        send = [int(v) for v in m[R]]
        h = comm.topology.hierarchy
        want = "2dh" if h.num_nodes > 1 and h.local_size > 1 else "flat"
        got = hierarchical.choose_algorithm(comm, x)
        out, _, _, req = hierarchical.start_all_to_all_v(comm.engine, comm.topology, x, send, None, "auto")
        comm.engine.complete(req, "all_to_all_v", None)
        ran = "2dh" if getattr(req, "plan", None) is not None else "flat"
        ok = got == want and ran == want and np.array_equal(as_bytes(out), expected_bytes(seed, R, m, (4,), torch.float32))
        collective_assert(ok, f"{spec}: auto chose {got}, ran {ran}, expected {want} (no profile)")

    def check_capture():
        """While a CUDA graph is captured (simulated: the host waits of the count exchanges
        are what capture forbids), "auto" picks flat, and an explicit "2dh" that needs a
        count exchange raises before anything moves, naming the capture, on every rank."""
        h = comm.topology.hierarchy
        m = count_matrix(79, W, 3, 0.2)
        x = input_for(79, R, m, (4,), torch.float32)
        send, recv = [int(v) for v in m[R]], [int(v) for v in m[:, R]]
        comm.engine.capturing = lambda: True
        try:
            chosen = hierarchical.choose_algorithm(comm, x)
            msg = "no error"
            if h.contiguous and (h.num_nodes == 1 or h.local_size == 1):
                msg = "single phase"  # runs as the flat exchange of a sub-communicator: capturable
            else:
                try:
                    comm.all_to_all_v(x, send, recv, algorithm="2dh")
                except RuntimeError as exc:
                    msg = str(exc)
        finally:
            del comm.engine.capturing
        ok = chosen == "flat" and (msg == "single phase" or ("CUDA graph" in msg and "2dh" in msg
                                                             and "algorithm='flat'" in msg))
        collective_assert(ok, f"{spec}: while capturing, auto chose {chosen}; 2dh gave {msg!r}")
        out, _ = comm.all_to_all_v(x, send, recv, algorithm="2dh")  # and the communicator still works
        collective_assert(np.array_equal(as_bytes(out), expected_bytes(79, R, m, (4,), torch.float32)),
                          f"{spec}: 2dh after the refused capture")

    checks = [check_equal, check_grad, check_async_interleaved, check_auto, check_capture]
    for f in checks:
        f.__name__ = f"{spec}:{getattr(f, '__name__', 'check')}"
    return checks


def check_unequal() -> None:
    """Nodes of 4 and 2 ranks (for 6 ranks): clear errors, and auto/flat still work."""
    sizes = [W - 2, 2]
    layout = (0,) * (W - 2) + (1, 1)
    comm = _custom(layout, None)
    collective_assert(comm.topology.hierarchy is None, "unequal nodes must not get hierarchy groups")
    m = count_matrix(5, W, 3, 0.2)
    x = input_for(5, R, m, (2,), torch.float32)
    send = [int(v) for v in m[R]]
    try:
        comm.all_to_all_v(x, send, algorithm="2dh")
        msg = "no error"
    except ValueError as exc:
        msg = str(exc)
    collective_assert(str(sizes) in msg and "equal size" in msg, f"2dh on unequal nodes: {msg!r}")
    out, _ = comm.all_to_all_v(x, send, algorithm="auto")
    collective_assert(np.array_equal(as_bytes(out), expected_bytes(5, R, m, (2,), torch.float32)), "auto on unequal nodes")
    try:
        _custom(layout, True)
        msg = "no error"
    except ValueError as exc:
        msg = str(exc)
    collective_assert(str(sizes) in msg, f"hierarchy=True on unequal nodes: {msg!r}")


def check_no_hierarchy() -> None:
    m = count_matrix(9, W, 2, 0.0)
    x = input_for(9, R, m, (2,), torch.float32)
    try:
        BASE.all_to_all_v(x, [int(v) for v in m[R]], algorithm="2dh")
        msg = "no error"
    except RuntimeError as exc:
        msg = str(exc)
    collective_assert("hierarchy=True" in msg, f"2dh without groups: {msg!r}")
    try:
        BASE.all_to_all_v(x, [int(v) for v in m[R]], algorithm="hierarchical")
        msg = "no error"
    except ValueError as exc:
        msg = str(exc)
    collective_assert("algorithm must be one of" in msg, f"bad algorithm name: {msg!r}")


def main() -> None:
    checks = [check_no_hierarchy]
    for spec in sys.argv[1:]:
        if spec == "uneq":
            checks.append(check_unequal)
        else:
            checks.extend(checks_for(spec))
    rank_main(checks)


if __name__ == "__main__":
    main()
