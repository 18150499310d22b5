"""Issue 14 on real MPI ranks (run by tests/test_nothing_lost.py): the staging pool across
shapes, dtypes and algorithms, and ranks that disagree on counts, dtype or row shape. Every
rank either raises CountMismatchError or holds exactly the reference bytes, and nobody hangs:

* default (validate=False): a call without recv_splits carries the per-peer records in its
  count exchange (a dtype or row shape that differs is named on the ranks that see it);
* validate=True: every disagreement raises on every rank before anything moves, also when
  ranks mix recv_splits and None (the records keep their collectives in step);
* known counts, by default (issue 32): every MPI exchange travels tagged (moecomm.engine.tags):
  the two ranks of a disagreeing pair raise, the others complete, the communicator stays
  usable (also where one side sends no rows: an empty message still carries its tag);
  ranks mixing recv_splits and None raise; gloo with records beside compares before the rows.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

import moecomm
from moecomm import CountMismatchError
from tests.mpi_util import collective_assert, rank_main
from tests.ranks.data import as_bytes, count_matrix, expected_bytes, input_for

W = MPI.COMM_WORLD.size
LOCAL = 2 if W % 2 == 0 and W > 2 else 1


def _make(validate: bool = False) -> moecomm.Communicator:
    return moecomm.init(backend="mpi", timeout=30, local_size=LOCAL, hierarchy=True, validate=validate)


COMM = _make()
COMMV = _make(validate=True)
R = COMM.rank


def _outcome(fn):
    """('ok', value) or ('mismatch', message); anything else propagates."""
    try:
        return "ok", fn()
    except CountMismatchError as exc:
        return "mismatch", str(exc)


def _still_usable(comm, seed: int = 99) -> None:
    m = count_matrix(seed, W, 3, 0.3)
    x = input_for(seed, R, m, (3,), torch.float32)
    out, recv = comm.all_to_all_v(x, [int(v) for v in m[R]])
    collective_assert(np.array_equal(as_bytes(out), expected_bytes(seed, R, m, (3,), torch.float32)),
                      "the communicator lost its message matching after a mismatch")


def check_pool_across_shapes_dtypes_algorithms() -> None:
    """The sequence from the issue: alternating flat and 2DH over row shapes and dtypes, known
    and unknown counts, 2 rounds; each result against the reference, nothing left in use."""
    shapes = [(300,), (128,), (7, 40), (5,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    call = 0
    for _ in range(2):
        for shape in shapes:
            for dtype in dtypes:
                for algorithm in ("flat", "2dh"):
                    call += 1
                    m = count_matrix(1000 + call, W, 5, 0.2)
                    x = input_for(1000 + call, R, m, shape, dtype)
                    recv = [int(v) for v in m[:, R]] if call % 3 == 0 else None
                    out, got = COMM.all_to_all_v(x, [int(v) for v in m[R]], recv, algorithm=algorithm)
                    ok = np.array_equal(as_bytes(out), expected_bytes(1000 + call, R, m, shape, dtype))
                    collective_assert(ok and got == [int(v) for v in m[:, R]], f"call {call} {algorithm} {shape} {dtype}")
                    s = COMM.pool_stats()
                    collective_assert(s.in_use_bytes == 0 and s.cached_bytes <= s.capacity_bytes, f"call {call}: {s}")


def _run_case(comm, seed, shape, dtype, send_of, recv_of, algorithm="flat", kind="v", m=None):
    """Every rank runs one exchange with its (possibly wrong) arguments; returns its outcome
    and the reference bytes of what the senders actually sent it. Counts are >= 1 unless
    ``m`` is given."""
    m = count_matrix(seed, W, 4, 0.0) + 1 if m is None else m
    x = input_for(seed, R, m, shape, dtype)
    send = send_of(m)
    recv = recv_of(m)
    if kind == "v":
        res = _outcome(lambda: comm.all_to_all_v(x, send, recv, algorithm=algorithm)[0])
    elif kind == "single":
        out = torch.empty((sum(recv),) + shape, dtype=dtype)
        res = _outcome(lambda: (comm.all_to_all_single(out, x, recv, send), out)[1])
    else:  # list form: slots of the sizes this rank believes in
        ins = list(torch.split(x, send))
        outs = [torch.empty((n,) + shape, dtype=dtype) for n in recv]
        res = _outcome(lambda: (comm.all_to_all(outs, ins), torch.cat(outs))[1])
    return res, expected_bytes(seed, R, m, shape, dtype)


def _expect(res, reference, must_raise: bool, words: list) -> None:
    kind, value = res
    if kind == "ok":
        ok = (not must_raise) and np.array_equal(as_bytes(value), reference)
        collective_assert(ok, "silently wrong data" if not must_raise else "no CountMismatchError")
    else:
        collective_assert(all(w in value for w in words), f"message {value!r} lacks {words}")


def _send(m):
    return [int(v) for v in m[R]]


def check_dtype_and_row_shape_by_default() -> None:
    """validate=False, no recv_splits: the count exchange's records name a dtype or row shape
    that differs (every rank exchanges with rank 1, so every rank raises)."""
    if W == 1:
        return
    for comm, recvs in ((COMM, (None, "known")), (COMMV, (None, "known"))):
        for what in ("dtype", "shape"):
            m = count_matrix(9, W, 4, 0.0) + 1
            x = input_for(9, R, m, (2, 4), torch.float32)
            if R == 1:
                x = x.view(torch.float16) if what == "dtype" else x.reshape(x.shape[0], 4, 2)
            for recv in recvs:
                r = None if recv is None else [int(v) for v in m[:, R]]
                kind, value = _outcome(lambda: comm.all_to_all_v(x, _send(m), r))
                words = ("dtype", "another dtype") if what == "dtype" else ("row shape", "another shape")
                collective_assert(kind == "mismatch" and any(w in value for w in words), f"{what}: {kind} {value!r}")
                _still_usable(comm)


def check_mixed_known_and_unknown_agree() -> None:
    """validate=True: one rank passes (right) recv_splits, the others None: the same
    collectives in the same order, the right rows."""
    for comm in (COMMV,):
        res, ref = _run_case(comm, 6, (2, 3), torch.int32, _send, lambda m: [int(v) for v in m[:, R]] if R == 0 else None)
        _expect(res, ref, False, [])
        res, ref = _run_case(comm, 7, (5,), torch.float16, _send,
                             lambda m: [int(v) for v in m[:, R]] if R == W - 1 else None, algorithm="2dh")
        _expect(res, ref, False, [])


def check_flat_recv_splits_wrong() -> None:
    if W == 1:
        return
    for comm in (COMMV, COMM):
        for delta in (-1, +2):
            for others_known in (True, False):
                def recv_of(m, delta=delta, others_known=others_known):
                    r = [int(v) for v in m[:, R]]
                    if R == 0:
                        r[1] = r[1] + delta if r[1] + delta > 0 else r[1] + 1
                        return r
                    return r if others_known else None
                res, ref = _run_case(comm, 5, (3,), torch.float32, _send, recv_of)
                if comm is COMM and not others_known:  # by default a mix of recv_splits and None is refused
                    _expect(res, ref, True, ["recv_splits"])
                else:
                    _expect(res, ref, comm is COMMV or R in (0, 1), ["rank 1 sends", "to rank 0, which expects"])
                _still_usable(comm)


def check_single_and_list_wrong_sizes() -> None:
    if W == 1:
        return
    for comm in (COMMV, COMM):
        for kind in ("single", "list"):
            def recv_of(m):
                r = [int(v) for v in m[:, R]]
                if R == W - 1:
                    r[0] += 1
                return r
            res, ref = _run_case(comm, 8, (4,), torch.float32, _send, recv_of, kind=kind)
            unit = "bytes" if kind == "list" and comm is COMM else "rows"
            _expect(res, ref, comm is COMMV or R in (0, W - 1), ["rank 0 sends", f"{unit} to rank {W - 1}, which expects"])
            _still_usable(comm)


def check_2dh_recv_splits_wrong() -> None:
    if W < 4 or LOCAL == 1:
        return
    for comm in (COMMV, COMM):
        def recv_of(m):
            r = [int(v) for v in m[:, R]]
            if R == 0:
                r[W - 1] += 1  # a rank on another node: its rows reach rank 0 along the rail
            return r
        res, ref = _run_case(comm, 11, (3,), torch.float32, _send, recv_of, algorithm="2dh")
        if R == 0 or comm is COMMV:
            _expect(res, ref, True, ["which expects"])
        else:
            _expect(res, ref, res[0] == "mismatch", ["which expects"])
        _still_usable(comm)


def check_mixed_known_and_unknown_named_by_default() -> None:
    """Issue 32: rank 0 passes recv_splits, the others None (validate=False): every rank
    exchanges with rank 0, so every rank raises naming it (flat); nobody reads rows as counts."""
    if W == 1:
        return
    res, ref = _run_case(COMM, 14, (3,), torch.float32, _send, lambda m: [int(v) for v in m[:, R]] if R == 0 else None)
    _expect(res, ref, True, ["passed recv_splits" if R else "passed no recv_splits"])
    _still_usable(COMM)


def check_empty_side_named_not_stuck() -> None:
    """A rank expecting rows from a peer that sends none: the peer's empty message still
    carries its tag, so both raise where the rows land; the others complete and the
    communicator stays usable (before issue 32 this needed records and aborted it)."""
    if W == 1:
        return
    m = np.zeros((W, W), dtype=np.int64)
    m[0, 0] = 2

    def recv_of(m):
        r = [int(v) for v in m[:, R]]
        if R == 1:
            r[0] = 3
        return r
    res, ref = _run_case(COMM, 12, (3,), torch.float32, _send, recv_of, m=m)
    if R in (0, 1):
        _expect(res, ref, True, ["rank 0 sends 0 rows to rank 1, which expects"])
    else:
        _expect(res, ref, False, [])
    collective_assert(not COMM.closed, f"closed={COMM.closed}")
    _still_usable(COMM)


def _raises_on(ranks, fn, words) -> None:
    """``fn()`` raises CountMismatchError naming ``words`` on ``ranks`` (all: None); elsewhere returns."""
    kind, value = _outcome(fn)
    if ranks is None or R in ranks:
        collective_assert(kind == "mismatch" and all(w in value for w in words), f"{kind}: {value!r} (want {words})")
    else:
        collective_assert(kind == "ok", f"rank {R} raised {value!r}")


def check_issue32_cases_by_default() -> None:
    """Issue 32's table with the defaults: each case raises CountMismatchError where the
    disagreeing rows land, naming what differs (the rest of the table is above: recv_splits
    too large, mixes of recv_splits and None, 2DH recv_splits, all_to_all_single sizes)."""
    if W == 1:
        return
    import moecomm.distributed as mdist

    m = count_matrix(21, W, 3, 0.0) + 1
    send, recv = _send(m), [int(v) for v in m[:, R]]
    x = input_for(21, R, m, (8,), torch.float32)
    # the torch drop-in with another dtype on rank 1 (every rank exchanges with it)
    xd = x.view(torch.int32) if R == 1 else x
    out = torch.empty((sum(recv), 8), dtype=xd.dtype)
    _raises_on(None, lambda: mdist.all_to_all_single(out, xd, recv, send, group=COMM), ["another dtype"])
    # issue 34, item 7: one output tensor in every slot of the drop-in all_to_all is refused
    y = torch.empty(2, 8)
    try:
        mdist.all_to_all([y] * W, [torch.ones(2, 8)] * W, group=COMM)
        problem = "the same output in every slot was accepted"
    except ValueError as exc:
        problem = "" if "output_tensor_list[1] overlaps output_tensor_list[0]" in str(exc) else str(exc)
    collective_assert(not problem, problem)
    # wire dtypes that differ: e4m3 on rank 0, e5m2 elsewhere
    wire = torch.float8_e4m3fn if R == 0 else torch.float8_e5m2
    xf = torch.randn(sum(send), 128)
    _raises_on(None, lambda: COMM.all_to_all_v(xf, send, recv, wire_dtype=wire), ["another wire dtype"])
    # known counts with the same wire dtype, counts that disagree (rank 0 expects one more from rank 1)
    bad = list(recv)
    if R == 0:
        bad[1] += 1
    _raises_on((0, 1), lambda: COMM.all_to_all_v(xf, send, bad, wire_dtype=torch.float8_e4m3fn),
               ["rank 1 sends", "to rank 0, which expects"])
    _still_usable(COMM)
    # scatter_compute_gather whose fn returns another dtype, then another row width, on rank 1
    # (a disagreement inside the pipeline aborts the communicator: a fresh one each time)
    for what in ("dtype", "width"):
        c = _make()

        def fn(rows, chunk, what=what):
            if R != 1:
                return rows * 2
            return (rows * 2).double() if what == "dtype" else torch.cat([rows, rows], 1)
        words = ["another dtype"] if what == "dtype" else ["rank"]
        _raises_on(None, lambda c=c, fn=fn: c.scatter_compute_gather(x, send, fn, recv_splits=recv), words)
        c.abort()


def check_skipped_backward_does_not_pair() -> None:
    """Issue 34, item 5: rank 0 runs a backward while the others start a forward of the same
    shape and counts; before, both finished with each other's data (also with validate)."""
    if W == 1:
        return
    import moecomm.functional as F

    for comm in (COMM, COMMV):
        m = count_matrix(23, W, 3, 0.0) + 1
        m = np.minimum(m, m.T)  # symmetric: the backward's counts are the forward's
        send = _send(m)
        x = input_for(23, R, m, (4,), torch.float32).requires_grad_(True)
        out, _ = F.all_to_all_v(x, send, send, comm=comm)
        if R == 0:
            _raises_on(None, lambda: out.sum().backward(), ["another exchange"])
        else:
            _raises_on(None, lambda: comm.all_to_all_v(x.detach(), send, send), ["another exchange"])
        _still_usable(comm)


def check_2dh_timeout_closes_everything() -> None:
    """Issue 34, item 4: a 2DH call that times out (rank 1 never joins) leaves the communicator
    closed on the ranks that timed out; their next 2DH and flat calls raise a named error at
    once, and the messages name world ranks."""
    if W < 4 or LOCAL == 1:
        return
    from moecomm.errors import CommunicatorClosedError

    c = _make()
    c.timeout = 1.5
    x = torch.ones(W, 3)
    problem = ""
    if R != 1:  # recv_splits None: the first wait is the intra-node count exchange, on a sub-communicator
        try:
            c.all_to_all_v(x, [1] * W, None, algorithm="2dh")
            problem = "the 2dh call returned"
        except TimeoutError as exc:
            if f"world rank {R}" not in str(exc) and f"on rank {R} " not in str(exc):
                problem = f"the timeout does not name world rank {R}: {exc}"
        if not c.closed:
            problem += "; a 2dh timeout left the communicator open"
        for algorithm in ("2dh", "flat"):
            try:
                c.all_to_all_v(x, [1] * W, [1] * W, algorithm=algorithm)
                problem += f"; {algorithm} after the timeout returned"
            except CommunicatorClosedError:
                pass
    collective_assert(not problem, problem)
    c.abort()


def check_gloo_compares_before_rows() -> None:
    """gloo aborts the process on rows of another size than expected: the records are compared
    first, both ranks raise, and a mix of known and unknown counts gets the right rows."""
    if W != 2:
        return
    import torch.distributed as dist

    from tests.mpi_util import init_gloo_over_mpi

    init_gloo_over_mpi()
    g = moecomm.init(process_group=dist.group.WORLD, timeout=30, set_default=False, validate=True)
    g.engine.records_beside = True
    m = count_matrix(13, W, 4, 0.0) + 1
    x = input_for(13, R, m, (3,), torch.float32)
    send, recv = _send(m), [int(v) for v in m[:, R]]
    out, _ = g.all_to_all_v(x, send, recv if R == 0 else None)
    collective_assert(np.array_equal(as_bytes(out), expected_bytes(13, R, m, (3,), torch.float32)), "gloo mixed")
    g.validate = False  # the records alone (beside), no all-gather first
    wrong = list(recv)
    if R == 1:
        wrong[0] += 1
    kind, value = _outcome(lambda: g.all_to_all_v(x, send, wrong if R == 1 else None))
    collective_assert(kind == "mismatch" and "which expects" in value and "no rows were exchanged" in value,
                      f"{kind} {value!r}")


if __name__ == "__main__":
    rank_main([check_pool_across_shapes_dtypes_algorithms, check_dtype_and_row_shape_by_default,
               check_mixed_known_and_unknown_agree, check_flat_recv_splits_wrong, check_single_and_list_wrong_sizes,
               check_2dh_recv_splits_wrong, check_mixed_known_and_unknown_named_by_default,
               check_empty_side_named_not_stuck, check_issue32_cases_by_default, check_skipped_backward_does_not_pair,
               check_2dh_timeout_closes_everything, check_gloo_compares_before_rows])
