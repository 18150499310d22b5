"""Issue 32, item 2 ("fault tails") on real MPI ranks (run by tests/test_peer_failures.py):

* every rank refusing the same bad argument (before anything moves, or after an agreement
  that told every rank) raises its own error and leaves the communicator usable: the next
  call works, also after many such calls in a row;
* one rank (or two) refusing an argument the others accepted: the others raise
  PeerFailedError naming it and quoting its error within seconds (the timeout is 30 s),
  whether they wait for counts, rows, a host agreement, an async call's ``wait()``, a 2DH
  exchange or a pipeline stage, and are aborted; the rank that refused raises its own error at
  once, and its next call raises PeerFailedError (its peers gave up on it) before anything
  moves; after that every call raises CommunicatorClosedError at once.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from mpi4py import MPI

import moecomm
import moecomm.functional as F
from moecomm import CommunicatorClosedError, PeerFailedError
from tests.mpi_util import collective_assert, rank_main
from tests.ranks.data import as_bytes, count_matrix, expected_bytes, input_for

W = MPI.COMM_WORLD.size
R = MPI.COMM_WORLD.rank
TIMEOUT = 30.0
PROMPT_S = 5.0  # "far less than the timeout", with room for a loaded 2-core machine


def _make(**kwargs) -> moecomm.Communicator:
    return moecomm.init(backend="mpi", timeout=TIMEOUT, set_default=False, **kwargs)


def _works(c: moecomm.Communicator, seed: int, what: str) -> None:
    """A flat exchange with counts exchanged, one with counts known, and (on 4 ranks with
    hierarchy groups) a 2DH one: exact bytes on every rank."""
    problems = []
    m = count_matrix(seed, W, 4, 0.3)
    x = input_for(seed, R, m, (3,), torch.float32)
    send, recv = [int(v) for v in m[R]], [int(v) for v in m[:, R]]
    want = expected_bytes(seed, R, m, (3,), torch.float32)
    algorithms = ["flat"] + (["2dh"] if c.topology is not None and c.topology.hierarchy is not None else [])
    for algorithm in algorithms:
        for known in (None, recv):
            out, got = c.all_to_all_v(x, send, known, algorithm=algorithm)
            if got != recv or not np.array_equal(as_bytes(out), want):
                problems.append(f"{algorithm}, recv_splits {'given' if known else 'exchanged'}: wrong rows")
    collective_assert(not problems and not c.closed, f"{what}: {problems} closed={c.closed}")


def _alike_cases(c: moecomm.Communicator) -> list:
    """(name, call, exception type): arguments every rank refuses alike."""
    x = torch.zeros(W, 2)
    send = [1] * W
    nan = torch.full((W, 128), float("nan"))

    def fn(rows, chunk):
        return rows

    return [
        ("send_splits that do not sum", lambda: c.all_to_all_v(x, [2] * W), ValueError),
        ("an unknown algorithm", lambda: c.all_to_all_v(x, send, algorithm="nope"), ValueError),
        ("an output too small", lambda: c.all_to_all_single(torch.empty(1, 2), x), ValueError),
        ("a list of the wrong length", lambda: c.all_to_all([torch.empty(1)], [torch.empty(1)]), ValueError),
        ("an unknown reduce op", lambda: c.allreduce(torch.zeros(2), op="mean"), ValueError),
        ("values that are not ints", lambda: c.allreduce_ints(["a"]), TypeError),
        ("a src out of range", lambda: c.broadcast(torch.zeros(2), src=W), ValueError),
        ("a negative color", lambda: c.split(-1), ValueError),
        ("degree 0", lambda: c.scatter_compute_gather(x, send, fn, degree=0), ValueError),
        ("an integer grad_wire_dtype", lambda: F.all_to_all_v(x, send, comm=c, grad_wire_dtype=torch.int8),
         (TypeError, ValueError)),
        ("packed rows of another dtype", lambda: c.all_to_all_v_packed(x, send, row_shape=(2,), dtype=torch.float32,
                                                                        wire_dtype=torch.float8_e4m3fn), TypeError),
        # refused after an agreement that told every rank (validate=True, non-finite rows under wire_dtype)
        ("NaN rows under wire_dtype, validate=True",
         lambda: c.all_to_all_v(nan, send, send, wire_dtype=torch.float8_e4m3fn) if c.validate else
         c.all_to_all_v(x, [2] * W), ValueError),
    ]


def _raises_alike(c: moecomm.Communicator, name: str, call, kind) -> str:
    try:
        call()
        return f"{name}: the call returned"
    except PeerFailedError as exc:
        return f"{name}: PeerFailedError although every rank refused it: {exc}"
    except kind:
        return "" if not c.closed else f"{name}: the communicator was closed"
    except Exception as exc:  # noqa: BLE001
        return f"{name}: {exc!r}"


def check_alike_failures_keep_the_communicator() -> None:
    """Every alike refusal raises the rank's own error, leaves the communicator open, and the
    next call works; then 100 refusals in a row (notices pile up on every rank) and the
    communicator still works, promptly; then one rank alone refusing is still told."""
    for validate in (False, True):
        c = _make(validate=validate, local_size=2 if W == 4 else None, hierarchy=True if W == 4 else None)
        for i, (name, call, kind) in enumerate(_alike_cases(c)):
            problem = _raises_alike(c, name, call, kind)
            collective_assert(not problem, f"validate={validate}: {problem}")
            _works(c, 10 + i, f"validate={validate}, after {name}")
        x = torch.zeros(W, 2)
        for _ in range(100):
            try:
                c.all_to_all_v(x, [2] * W)
            except ValueError:
                pass
        start = time.monotonic()
        _works(c, 5, f"validate={validate}, after 100 refusals")
        took = time.monotonic() - start
        collective_assert(took < PROMPT_S, f"the calls after 100 refusals took {took:.1f} s")
        _one_rank_refuses(c, 1, lambda: c.all_to_all_v(x, [1] * W), lambda: c.all_to_all_v(x, [2] * W),
                          "send_splits must sum", f"validate={validate}, after the refusals")


def _one_rank_refuses(c: moecomm.Communicator, victims, good, bad, words: str, what: str,
                      victim_kind=ValueError) -> None:
    """Ranks in ``victims`` call ``bad`` (raising ``victim_kind`` with ``words``), the others
    ``good``: the others raise PeerFailedError naming a victim and quoting ``words`` within
    :data:`PROMPT_S`, and are closed; a victim raises its own error at once, its communicator
    open (unless the call aborted it itself: the pipeline), and its next call (``good``)
    raises PeerFailedError promptly (its peers gave up on it); then every rank is closed and
    its next call raises CommunicatorClosedError at once."""
    victims = (victims,) if isinstance(victims, int) else tuple(victims)
    victim = R in victims
    problem = ""
    start = time.monotonic()
    try:
        (bad if victim else good)()
        problem = "the call returned"
    except PeerFailedError as exc:
        named = any(f"rank {v} failed its call" in str(exc) or f"rank {v} aborted" in str(exc) for v in victims)
        if victim or not named or words not in str(exc):
            problem = f"PeerFailedError: {exc}"
    except victim_kind as exc:
        if not victim or words not in str(exc):
            problem = repr(exc)
    except Exception as exc:  # noqa: BLE001
        problem = repr(exc)
    took = time.monotonic() - start
    if took > (1.0 if victim else PROMPT_S):  # the victim raises at once, whatever its peers do
        problem += f"; it took {took:.1f} s"
    if not victim and not c.closed:
        problem += "; not closed"
    collective_assert(not problem, f"{what}: rank {R}: {problem}")
    if victim and not c.closed:
        start = time.monotonic()
        try:
            good()
            problem = "the victim's next call returned"
        except PeerFailedError as exc:
            problem = "" if words in str(exc) and "this rank failed its call" in str(exc) else \
                f"the victim's next call: {exc}"
        except Exception as exc:  # noqa: BLE001
            problem = f"the victim's next call: {exc!r}"
        took = time.monotonic() - start
        if took > PROMPT_S:
            problem += f"; it took {took:.1f} s"
    problem += "" if c.closed else "; not closed at the end"
    start = time.monotonic()
    try:
        good()
        problem += "; a call on the closed communicator returned"
    except CommunicatorClosedError:
        problem += "" if time.monotonic() - start < 1.0 else "; CommunicatorClosedError was slow"
    except Exception as exc:  # noqa: BLE001
        problem += f"; the next call raised {exc!r}"
    collective_assert(not problem, f"{what}: rank {R}: {problem}")


def check_one_rank_refuses() -> None:
    """Rank 1 (rank W-1 too, on 3 or more ranks) passes send_splits that do not sum to its rows,
    the others good ones: waiting for counts, for rows, in a host agreement (validate=True), in
    an async call's wait(), and through the differentiable all_to_all_v."""
    if W == 1:
        return
    m = count_matrix(7, W, 3, 0.0) + 1
    x = input_for(7, R, m, (3,), torch.float32)
    send, recv = [int(v) for v in m[R]], [int(v) for v in m[:, R]]
    wrong = [v + 1 for v in send]
    words = "send_splits must sum"
    for victims in ([1], [1, W - 1]) if W > 2 else ([1],):
        for name, validate, good, bad in (
            ("counts exchanged", False, lambda c: c.all_to_all_v(x, send), lambda c: c.all_to_all_v(x, wrong)),
            ("counts known", False, lambda c: c.all_to_all_v(x, send, recv), lambda c: c.all_to_all_v(x, wrong, recv)),
            ("validate=True", True, lambda c: c.all_to_all_v(x, send, recv), lambda c: c.all_to_all_v(x, wrong, recv)),
            ("async wait()", False, lambda c: c.all_to_all_v(x, send, recv, async_op=True).wait(),
             lambda c: c.all_to_all_v(x, wrong, recv, async_op=True)),
            ("functional", False, lambda c: F.all_to_all_v(x, send, comm=c),
             lambda c: F.all_to_all_v(x, wrong, comm=c)),
        ):
            c = _make(validate=validate)
            _one_rank_refuses(c, victims, lambda: good(c), lambda: bad(c), words, f"{name}, victims {victims}")


def check_other_collectives() -> None:
    """One rank refuses the arguments of allreduce, allreduce_ints, a split (its peers wait in
    the host agreement) or all_to_all: the others are told."""
    if W == 1:
        return
    t = torch.ones(3)
    outs, ins = [torch.empty(2) for _ in range(W)], [torch.ones(2) for _ in range(W)]
    for name, good, bad, words, kind in (
        ("allreduce", lambda c: c.allreduce(t), lambda c: c.allreduce(t, op="mean"), "op must be one of", ValueError),
        ("allreduce_ints", lambda c: c.allreduce_ints([1]), lambda c: c.allreduce_ints([True]), "values", TypeError),
        ("split", lambda c: c.split(0), lambda c: c.split(-1), "color must be", ValueError),
        ("all_to_all", lambda c: c.all_to_all(outs, ins), lambda c: c.all_to_all(outs[:1], ins), "output_tensor_list",
         ValueError),
    ):
        c = _make()
        _one_rank_refuses(c, 1, lambda: good(c), lambda: bad(c), words, name, victim_kind=kind)


def check_2dh_and_pipeline() -> None:
    """On 4 ranks with two per node: rank 1 refuses its send_splits in a 2DH all_to_all_v;
    on every world size: fn of scatter_compute_gather raises on rank W-1 at its second stage
    (the pipeline aborts that rank's communicator: the others are told, and it is closed)."""
    if W == 1:
        return
    m = count_matrix(9, W, 3, 0.0) + 1
    x = input_for(9, R, m, (3,), torch.float32)
    send, recv = [int(v) for v in m[R]], [int(v) for v in m[:, R]]
    if W == 4:
        c = _make(local_size=2, hierarchy=True)
        _one_rank_refuses(c, 1, lambda: c.all_to_all_v(x, send, recv, algorithm="2dh"),
                          lambda: c.all_to_all_v(x, [v + 1 for v in send], recv, algorithm="2dh"),
                          "send_splits must sum", "2dh")

    class Boom(Exception):
        pass

    def fn(rows, chunk):
        if R == W - 1 and chunk.index == 1:
            raise Boom(f"stage {chunk.index} of rank {R}")
        return rows * 2

    c = _make()
    _one_rank_refuses(c, W - 1, lambda: c.scatter_compute_gather(x, send, fn, degree=2, recv_splits=recv),
                      lambda: c.scatter_compute_gather(x, send, fn, degree=2, recv_splits=recv),
                      f"stage 1 of rank {W - 1}", "scatter_compute_gather", victim_kind=Boom)


def check_slow_ranks() -> None:
    """Rank W-1 reaches the call 1 s after the others: refusing alike, the fast ranks raise at
    once and their next call waits for it to fail too, then works; rank 1 refusing alone while
    the others come 1 s late, it raises at once and they are told as they arrive."""
    if W == 1:
        return
    c = _make()
    x = torch.zeros(W, 2)
    if R == W - 1:
        time.sleep(1.0)
    start = time.monotonic()
    try:
        c.all_to_all_v(x, [2] * W)
        problem = "the call returned"
    except ValueError:
        problem = "" if time.monotonic() - start < 1.0 else f"it took {time.monotonic() - start:.1f} s"
    collective_assert(not problem and not c.closed, f"alike, rank {W - 1} late: {problem} closed={c.closed}")
    _works(c, 21, "alike, one rank late")
    c = _make()
    m = count_matrix(23, W, 3, 0.0) + 1
    y = input_for(23, R, m, (3,), torch.float32)
    send = [int(v) for v in m[R]]

    delay = [1.0]  # the first call only

    def late():
        time.sleep(delay.pop() if delay else 0.0)
        return c.all_to_all_v(y, send)
    _one_rank_refuses(c, 1, late, lambda: c.all_to_all_v(y, [v + 1 for v in send]), "send_splits must sum",
                      "the others late")


if __name__ == "__main__":
    rank_main([check_alike_failures_keep_the_communicator, check_one_rank_refuses, check_other_collectives,
               check_2dh_and_pipeline, check_slow_ranks])
