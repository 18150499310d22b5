"""Every core collective against a numpy reference, on real MPI ranks (run by tests/test_core_mpi.py)."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moecomm
import moecomm.functional as F
from tests.mpi_util import collective_assert, init_gloo_over_mpi, rank_main, under_torchrun, world_barrier
from tests.ranks.data import DTYPES, ROW_SHAPES, as_bytes, count_matrix, expected_bytes, input_for

# "nccl-p2p": the NCCL backend with peer memory (init(p2p_bytes=)), so that every known-counts
# exchange of the suite moves by copy engines
P2P_BYTES = (64 << 20) if len(sys.argv) > 1 and sys.argv[1] == "nccl-p2p" else None
# "peer-one-round": the peer backend with counts on the GPU in one host round where the ranks share
# a GPU without MPS (PeerBackend.one_host_round, off by default until this suite has passed with it)
ONE_ROUND = len(sys.argv) > 1 and sys.argv[1] == "peer-one-round"
BACKEND = "nccl" if P2P_BYTES else "peer" if ONE_ROUND else (sys.argv[1] if len(sys.argv) > 1 else "mpi")
if ONE_ROUND:
    from moecomm.backends.peer import PeerBackend

    PeerBackend.one_host_round = True  # (this process's every peer backend, sub-communicators' too)
ONLY = sys.argv[2] if len(sys.argv) > 2 else None  # run one check (by name), or "-name" to skip one
SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=25,
                    suppress_health_check=list(HealthCheck))


def make_comm(**kw):
    if BACKEND == "torch" and not under_torchrun():
        import torch.distributed as dist

        if not dist.is_initialized():
            init_gloo_over_mpi()
        return moecomm.init(process_group=dist.group.WORLD, **kw)
    if BACKEND == "nccl":  # "nccl": NCCL alone (init's default would add peer memory on one node)
        kw.setdefault("p2p_bytes", P2P_BYTES or 0)
    if kw.get("p2p_bytes"):  # the copy engines for every known-counts exchange, however small
        kw.setdefault("p2p_min_bytes", 0)
    return moecomm.init(backend=BACKEND, **kw)


COMM = make_comm(timeout=60)
W, R = COMM.size, COMM.rank
DEV = COMM.device


def check_layout() -> None:
    collective_assert(COMM.backend == BACKEND, f"backend {COMM.backend}")
    collective_assert((COMM.num_nodes, COMM.local_size, COMM.local_rank) == (1, W, R), repr(COMM))


@SETTINGS
@given(seed=st.integers(0, 2**31), max_rows=st.integers(0, 6), zero_fraction=st.sampled_from([0.0, 0.3, 1.0]),
       dtype=st.sampled_from(DTYPES), row_shape=st.sampled_from(ROW_SHAPES),
       form=st.sampled_from(["list", "tensor", "numpy", "int32", "device"]), known=st.booleans(), async_op=st.booleans())
def check_all_to_all_v(seed, max_rows, zero_fraction, dtype, row_shape, form, known, async_op) -> None:
    m = count_matrix(seed, W, max_rows, zero_fraction)
    x = input_for(seed, R, m, row_shape, dtype).to(DEV)
    send = [int(v) for v in m[R]]
    send_arg = {"list": send, "tensor": torch.tensor(send), "numpy": np.array(send),
                "int32": torch.tensor(send, dtype=torch.int32), "device": torch.tensor(send, device=DEV)}[form]
    recv_arg = [int(v) for v in m[:, R]] if known else None
    result = COMM.all_to_all_v(x, send_arg, recv_arg, async_op=async_op)
    if async_op:
        collective_assert(isinstance(result, moecomm.Work), f"async_op returned {type(result)}")
        result = result.wait()
    out, recv = result
    ok = (recv == [int(v) for v in m[:, R]] and out.dtype == dtype and tuple(out.shape[1:]) == tuple(row_shape)
          and out.shape[0] == sum(recv) and np.array_equal(as_bytes(out), expected_bytes(seed, R, m, row_shape, dtype)))
    collective_assert(ok, f"all_to_all_v mismatch seed={seed} dtype={dtype} shape={row_shape} counts={m.tolist()}")


@SETTINGS
@given(seed=st.integers(0, 2**31), per_peer=st.integers(0, 4), equal=st.booleans(), async_op=st.booleans())
def check_all_to_all_single(seed, per_peer, equal, async_op) -> None:
    m = np.full((W, W), per_peer) if equal else count_matrix(seed, W, 4, 0.3)
    x = input_for(seed, R, m, (2,), torch.float32).to(DEV)
    out = torch.full((int(m[:, R].sum()), 2), -1.0, device=DEV)
    in_splits = None if equal else [int(v) for v in m[R]]
    out_splits = None if equal else [int(v) for v in m[:, R]]
    work = COMM.all_to_all_single(out, x, out_splits, in_splits, async_op=async_op)
    if async_op:
        collective_assert(work.wait() is True, "Work.wait() must return True like torch's")
    else:
        collective_assert(work is None, f"sync all_to_all_single returned {work!r}")
    collective_assert(np.array_equal(as_bytes(out), expected_bytes(seed, R, m, (2,), torch.float32)), "a2a_single")


def check_all_to_all_lists() -> None:
    seed = 11
    ins = [torch.full((R + 1, p + 1), float(R * 100 + p), device=DEV) for p in range(W)]
    outs = [torch.empty((p + 1, R + 1), device=DEV) for p in range(W)]
    COMM.all_to_all(outs, ins)
    ok = all(torch.equal(outs[p].cpu(), torch.full((p + 1, R + 1), float(p * 100 + R))) for p in range(W))
    collective_assert(ok, f"all_to_all lists: {[o.tolist() for o in outs]}")
    del seed


@SETTINGS
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(DTYPES), row_shape=st.sampled_from(ROW_SHAPES))
def check_all_gather_v(seed, dtype, row_shape) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 5, size=W)
    m = np.zeros((W, W), dtype=np.int64)
    m[:, :] = sizes[:, None]  # rank src "sends" its rows to everyone
    x = input_for(seed, R, np.diag(sizes), row_shape, dtype).to(DEV)
    out, got = COMM.all_gather_v(x)
    expect = np.concatenate([expected_bytes(seed, src, np.diag(sizes), row_shape, dtype) for src in range(W)])
    collective_assert(got == sizes.tolist() and np.array_equal(as_bytes(out), expect), f"all_gather_v sizes={sizes}")


def check_allreduce_broadcast_barrier() -> None:
    rng = np.random.default_rng(5)
    table = rng.standard_normal((W, 7))
    for dtype, op, ref in [(torch.float64, "sum", table.sum(0)), (torch.float64, "max", table.max(0)),
                           (torch.float32, "min", table.min(0)), (torch.bfloat16, "sum", None)]:
        t = torch.from_numpy(table[R].copy()).to(dtype).to(DEV)
        COMM.allreduce(t, op)
        t = t.cpu()
        if ref is None:
            ref = sum(torch.from_numpy(table[r].copy()).to(dtype).float() for r in range(W)).numpy()
            ok = np.allclose(t.float().numpy(), ref, rtol=2e-2, atol=2e-2)
        else:
            ok = np.allclose(t.double().numpy(), ref, rtol=1e-6)
        collective_assert(ok, f"allreduce {dtype} {op}: {t} vs {ref}")
    ints = torch.tensor([R, -R, 3], dtype=torch.int64, device=DEV)
    import torch.distributed as dist

    COMM.allreduce(ints, dist.ReduceOp.SUM)
    ints = ints.cpu()
    collective_assert(ints.tolist() == [W * (W - 1) // 2, -W * (W - 1) // 2, 3 * W], f"int allreduce {ints}")
    root = W - 1
    b = (torch.arange(5, dtype=torch.bfloat16) * (R + 1)).to(DEV)
    COMM.broadcast(b, src=root)
    collective_assert(torch.equal(b.cpu(), torch.arange(5, dtype=torch.bfloat16) * W), f"broadcast {b}")
    COMM.barrier()


def check_split() -> None:
    colors = [None if (W > 2 and r == 1) else r % 2 for r in range(W)]
    keys = [r if BACKEND == "torch" else -r for r in range(W)]
    sub = COMM.split(colors[R], keys[R])
    if colors[R] is None:
        collective_assert(sub is None, "color None must give None")
        return
    members = sorted((keys[r], r) for r in range(W) if colors[r] == colors[R])
    ranks = [r for _, r in members]
    ok = sub.size == len(ranks) and sub.rank == ranks.index(R) and sub.num_nodes == 1
    seed = 99 + (colors[R] or 0)
    m = count_matrix(seed, sub.size, 3, 0.2)
    x = input_for(seed, sub.rank, m, (4,), torch.int64).to(DEV)
    out, _ = sub.all_to_all_v(x, [int(v) for v in m[sub.rank]])
    ok = ok and np.array_equal(as_bytes(out), expected_bytes(seed, sub.rank, m, (4,), torch.int64))
    sub.close()
    collective_assert(ok, f"split: {sub!r} expected members {ranks}")


def check_gradients() -> None:
    seed = 3
    m = count_matrix(seed, W, 4, 0.25)
    x = torch.from_numpy(np.random.default_rng([seed, R]).standard_normal((int(m[R].sum()), 3))).to(DEV).requires_grad_()
    out, recv = F.all_to_all_v(x, [int(v) for v in m[R]], comm=COMM)
    g = torch.from_numpy(np.random.default_rng([seed, R, 1]).standard_normal(tuple(out.shape))).to(DEV)
    out.backward(g)
    # Adjoint (dot-product) test: <A x, g> summed over ranks equals <x, A^T g>.
    lhs = torch.tensor([float((out.detach() * g).sum()), float((x.detach() * x.grad).sum())], dtype=torch.float64, device=DEV)
    COMM.allreduce(lhs)
    collective_assert(abs(lhs[0] - lhs[1]) <= 1e-9 * max(1.0, abs(float(lhs[0]))), f"adjoint test {lhs}")
    # The gradient of each input row is the gradient of the row it became (numpy reference).
    sent_back, _ = COMM.all_to_all_v(g.contiguous(), recv)
    collective_assert(torch.equal(x.grad, sent_back), "backward must return grad rows to their origin")


def check_validate_mode() -> None:
    if W == 1:
        return
    strict = make_comm(timeout=60, validate=True, set_default=False)
    recv = [1] * W
    if R == 0:
        recv[W - 1] = 2  # rank 0 expects 2 rows from the last rank, which sends 1
    try:
        strict.all_to_all_v(torch.zeros(W, 2, device=DEV), [1] * W, recv)
        raised = ""
    except moecomm.CountMismatchError as exc:
        raised = str(exc)
    collective_assert(f"rank {W - 1} sends 1 rows to rank 0, which expects 2" in raised, f"validate: {raised!r}")
    bad_dtype = torch.zeros(W, 2, dtype=torch.float64 if R == 0 else torch.float32, device=DEV)
    try:
        strict.all_to_all_v(bad_dtype, [1] * W, [1] * W)
        raised = ""
    except moecomm.CountMismatchError as exc:
        raised = str(exc)
    collective_assert("different dtype" in raised, f"validate dtype: {raised!r}")
    out, _ = strict.all_to_all_v(torch.full((W, 2), float(R), device=DEV), [1] * W)
    collective_assert(out[:, 0].tolist() == [float(r) for r in range(W)], "validate mode data")
    strict.close()


def check_timeout() -> None:
    if W == 1 or BACKEND == "torch" or under_torchrun():
        return
    import faulthandler

    faulthandler.dump_traceback_later(40, exit=True)  # a hang here prints every thread's stack
    short = make_comm(timeout=1.0, set_default=False)
    message = ""
    if R == 0:
        try:
            short.all_to_all_v(torch.zeros(W, 1, device=DEV), [1] * W, [1] * W)
            short.barrier()  # on NCCL the exchange is stream-ordered: the host waits here
        except TimeoutError as exc:
            message = str(exc)
        try:
            short.barrier()
        except moecomm.CommunicatorClosedError:
            message += " | closed"
    world_barrier()
    if R != 0:
        if BACKEND == "mpi":  # match rank 0's abandoned exchange so that nothing stays in flight
            short.all_to_all_v(torch.zeros(W, 1), [1] * W, [1] * W)
            short.close()
        else:
            short.abort()
    faulthandler.cancel_dump_traceback_later()
    ok = R != 0 or ("did not complete within 1 s" in message and message.endswith("| closed"))
    collective_assert(ok, f"timeout message: {message!r}")


def check_max_ctas() -> None:
    """An NCCL communicator limited to a few CTAs per kernel moves the same bytes."""
    if BACKEND != "nccl":
        return
    small = make_comm(timeout=60, max_ctas=2, set_default=False)
    m = count_matrix(33, W, 7, 0.3)
    x = input_for(33, R, m, (5,), torch.bfloat16).to(DEV)
    out, recv = small.all_to_all_v(x, torch.tensor(m[R], device=DEV))
    collective_assert(recv == m[:, R].tolist(), f"max_ctas counts {recv}")
    collective_assert(np.array_equal(as_bytes(out), expected_bytes(33, R, m, (5,), torch.bfloat16)), "max_ctas data")
    small.close()


def check_peer_memory() -> None:
    """init(p2p_bytes=): counts on the GPU, rows through peer memory, equal the numpy reference,
    over many calls (both arena halves), with rows beyond a region's capacity (through NCCL)
    and rows that are not a multiple of 16 bytes (NCCL path)."""
    if BACKEND != "nccl" or under_torchrun():
        if BACKEND not in ("nccl", "peer"):  # (the peer backend takes p2p_bytes: its arena)
            try:
                make_comm(p2p_bytes=1 << 20, set_default=False)
                raised = None
            except ValueError as exc:
                raised = str(exc)
            collective_assert(raised is not None and "p2p_bytes applies to the NCCL backend only" in raised,
                              f"p2p_bytes on {BACKEND}: {raised!r}")
        return
    for arena in (1 << 24, 24 << 10):  # ample; and small enough that big blocks overflow into NCCL
        peer = make_comm(timeout=60, p2p_bytes=arena, set_default=False)
        for i in range(12):
            seed = 400 + i
            m = count_matrix(seed, W, 40 if i % 3 else 3, 0.3)
            for dtype, shape in ((torch.bfloat16, (8,)), (torch.float32, (4, 2)), (torch.float32, (10,))):
                x = input_for(seed, R, m, shape, dtype).to(DEV)
                counts = torch.tensor(m[R], device=DEV, dtype=torch.int32 if i % 2 else torch.int64)
                if i % 4 == 3:
                    out, recv = peer.all_to_all_v(x, counts, async_op=True).wait()
                else:
                    out, recv = peer.all_to_all_v(x, counts)
                collective_assert(recv == m[:, R].tolist(), f"p2p {arena} call {i} {dtype}{shape}: counts {recv}")
                same = np.array_equal(as_bytes(out), expected_bytes(seed, R, m, shape, dtype))
                collective_assert(same, f"p2p {arena} call {i} {dtype}{shape}: data")
                # the same exchange with the counts known: copy engines (any row size)
                if i % 4 == 1:
                    out, _ = peer.all_to_all_v(x, m[R].tolist(), m[:, R].tolist(), async_op=True).wait()
                else:
                    out = torch.empty_like(out)
                    peer.all_to_all_single(out, x, m[:, R].tolist(), m[R].tolist())
                same = np.array_equal(as_bytes(out), expected_bytes(seed, R, m, shape, dtype))
                collective_assert(same, f"copy engines {arena} call {i} {dtype}{shape}: data")
        peer.close()
    check_peer_memory_mismatch()


def check_peer_gpu_counts() -> None:
    """The peer backend, counts on the GPU: blocks that fit the inline capacity travel in the
    kernel's round, larger ones whole in the exchange that follows (run only where some rank
    has one); both equal the reference over many calls. A rank whose rows have another dtype
    or row shape of the same size, or whose counts do not add up to its rows, is named on
    every rank (CountMismatchError; itself a ValueError), and the communicator stays usable."""
    if BACKEND != "peer":
        return
    from moecomm.backends.p2p import INLINE_BYTES

    # regions of 1 KiB, so that inline means at most 64 rows of 16 bytes: mixed rounds
    arena = 4096 + 4 * W * 1024
    peer = make_comm(timeout=30, p2p_bytes=arena, set_default=False)
    transport = peer._engine.peer  # (None where the ranks share a GPU without MPS: counts cross the host)
    collective_assert(transport is None or transport.inline_bytes == min(1024, INLINE_BYTES), "inline capacity")
    for i in range(10):
        seed = 900 + i
        m = count_matrix(seed, W, (3, 40, 90)[i % 3], 0.3)
        for dtype, shape in ((torch.bfloat16, (8,)), (torch.float32, (4, 2))):
            x = input_for(seed, R, m, shape, dtype).to(DEV)
            out, recv = peer.all_to_all_v(x, torch.tensor(m[R], device=DEV))
            collective_assert(recv == m[:, R].tolist(), f"peer gpu counts call {i}: counts {recv}")
            same = np.array_equal(as_bytes(out), expected_bytes(seed, R, m, shape, dtype))
            collective_assert(same, f"peer gpu counts call {i} {dtype}{shape} (max {m.max()} rows): data")
    if W > 1:
        m = count_matrix(950, W, 20, 0.0) + 1
        for odd, even, what in (((torch.float32, (4,)), (torch.bfloat16, (8,)), "dtype"),
                                ((torch.float32, (4, 2)), (torch.float32, (8,)), "shape")):
            dtype, shape = odd if R == W - 1 else even
            x = input_for(950, R, m, shape, dtype).to(DEV)
            try:
                peer.all_to_all_v(x, torch.tensor(m[R], device=DEV))
                got = None
            except Exception as exc:  # noqa: BLE001
                got = exc
            ok = isinstance(got, moecomm.CountMismatchError) and f"another {what}" in str(got) and not peer.closed
            collective_assert(ok, f"peer gpu counts, {what} on rank {W - 1} differs: rank {R} got {got!r}")
        # counts on the GPU that do not add up to the rows (more: the kernel must not read past x;
        # fewer; negative): no row moves, every rank raises, the communicator stays usable
        for what, delta in (("more", (0, 5)), ("fewer", (0, -1)), ("negative", (-1 - m[R, 0], 1 + m[R, 0]))):
            x = input_for(952, R, m, (8,), torch.bfloat16).to(DEV)
            c = m[R].copy()
            if R == W - 1:  # (negative: the same total)
                c[0] += delta[0]
                c[-1] += delta[1]
            try:
                peer.all_to_all_v(x, torch.tensor(c, device=DEV))
                got = None
            except Exception as exc:  # noqa: BLE001
                got = exc
            if R == W - 1:
                ok = type(got) is ValueError and "send_splits" in str(got) and "nothing was sent" in str(got)
            elif transport is not None:  # every rank read every GPU header
                ok = isinstance(got, moecomm.CountMismatchError) and f"rank {W - 1}'s send_splits" in str(got)
            else:  # the counts crossed the host: rank W - 1 joined the row exchange sending nothing
                ok = isinstance(got, moecomm.CountMismatchError) and (
                    f"rank {W - 1}'s send_splits" in str(got) or f"rank(s) [{W - 1}]'s send_splits" in str(got)
                    or f"from rank {W - 1}, but rank {W - 1} sent 0" in str(got))
            collective_assert(ok and not peer.closed, f"peer gpu counts, {what} rows on rank {W - 1}: rank {R} "
                                                      f"got {got!r}")
        x = input_for(951, R, m, (8,), torch.bfloat16).to(DEV)
        out, _ = peer.all_to_all_v(x, torch.tensor(m[R], device=DEV))
        collective_assert(np.array_equal(as_bytes(out), expected_bytes(951, R, m, (8,), torch.bfloat16)),
                          "the call after a mismatch")
    peer.close()


def _outcome(fn) -> object:
    try:
        fn()
        return None
    except Exception as exc:  # noqa: BLE001
        return exc


def check_peer_issue32() -> None:
    """Issue 32's table on the peer backend with the defaults: what an exchange is (dtype,
    row shape, wire dtype, kind) travels in its records or GPU headers, so a rank that passes
    another is named on every rank (CountMismatchError) before its rows are used, and the
    communicator stays usable (a disagreement inside scatter_compute_gather aborts it)."""
    if BACKEND != "peer" or W == 1:
        return
    import moecomm.distributed as mdist

    m = count_matrix(31, W, 3, 0.0) + 1
    send, recv = m[R].tolist(), m[:, R].tolist()
    x = input_for(31, R, m, (8,), torch.float32).to(DEV)
    cases = [
        ("drop-in, int32 on the last rank", "another dtype",
         lambda: mdist.all_to_all_single(torch.empty((sum(recv), 8), dtype=torch.int32 if R == W - 1 else x.dtype,
                                                     device=DEV), x.view(torch.int32) if R == W - 1 else x,
                                         recv, send, group=COMM)),
        ("known counts, e5m2 on the last rank", "another wire dtype",
         lambda: COMM.all_to_all_v(torch.randn(sum(send), 128, device=DEV), send, recv,
                                   wire_dtype=torch.float8_e5m2 if R == W - 1 else torch.float8_e4m3fn)),
        # (GPU headers under MPS name the three together; without MPS the counts cross the host and
        # the backend's records name the wire dtype)
        ("counts on the GPU, e5m2 on the last rank", ("another dtype, wire dtype or kind of exchange",
                                                      "another wire dtype"),
         lambda: COMM.all_to_all_v(torch.randn(sum(send), 128, device=DEV), torch.tensor(send, device=DEV),
                                   wire_dtype=torch.float8_e5m2 if R == W - 1 else torch.float8_e4m3fn)),
    ]
    for name, words, fn in cases:
        got = _outcome(fn)
        words = (words,) if isinstance(words, str) else words
        ok = isinstance(got, moecomm.CountMismatchError) and any(w in str(got) for w in words) and not COMM.closed
        collective_assert(ok, f"peer, {name}: rank {R} got {got!r}")
        out, _ = COMM.all_to_all_v(x, send, recv)  # the next call works
        collective_assert(np.array_equal(as_bytes(out), expected_bytes(31, R, m, (8,), torch.float32)),
                          f"peer, the call after {name}")
    c = make_comm(timeout=30, set_default=False)

    def fn(rows, chunk):
        return (rows * 2).double() if R == W - 1 else rows * 2
    got = _outcome(lambda: c.scatter_compute_gather(x, send, fn, recv_splits=recv))
    collective_assert(isinstance(got, moecomm.CountMismatchError) and "another dtype" in str(got),
                      f"peer, scatter_compute_gather fn returns float64 on the last rank: rank {R} got {got!r}")
    c.abort()
    world_barrier()


def check_peer_memory_mismatch() -> None:
    """Copy engines: a rank sending another count than its peer expects is named by the peer
    (CountMismatchError at its next call, the communicator aborted), not silently truncated."""
    if W == 1:
        return
    peer = make_comm(timeout=3, p2p_bytes=1 << 24, set_default=False)
    m = count_matrix(77, W, 6, 0.0) + 1
    sent = m.copy()
    sent[0, 1] += 1  # rank 0 sends one row more to rank 1 than rank 1 expects
    x = input_for(77, R, sent, (4,), torch.float32).to(DEV)
    if BACKEND == "peer":  # its records travel before the rows: every rank raises at the call, the
        try:               # communicator stays usable
            peer.all_to_all_v(x, sent[R].tolist(), m[:, R].tolist())
            got = None
        except Exception as exc:  # noqa: BLE001
            got = exc
        ok = isinstance(got, moecomm.CountMismatchError) and f"rank 1 expected {m[0, 1]} rows from rank 0, but " \
            f"rank 0 sent {m[0, 1] + 1}" in str(got) and not peer.closed
        collective_assert(ok, f"count mismatch through the peer backend: rank {R} got {got!r}")
        y = input_for(77, R, m, (4,), torch.float32).to(DEV)  # and the next call works
        out, _ = peer.all_to_all_v(y, m[R].tolist(), m[:, R].tolist())
        collective_assert(np.array_equal(as_bytes(out), expected_bytes(77, R, m, (4,), torch.float32)),
                          "the call after a mismatch")
        peer.close()
        world_barrier()
        return
    peer.all_to_all_v(x, sent[R].tolist(), m[:, R].tolist())
    torch.cuda.synchronize(DEV)
    time.sleep(0.5)  # the watchdog looks every 50 ms
    try:
        peer.barrier()
        got = None
    except Exception as exc:  # noqa: BLE001
        got = exc
    if R == 1:
        ok = isinstance(got, moecomm.CountMismatchError) and f"expected {m[0, 1]} rows from rank 0, but rank 0 sent " \
            f"{m[0, 1] + 1}" in str(got) and peer.closed
    else:
        ok = got is None or isinstance(got, (TimeoutError, moecomm.CommunicatorClosedError))
    collective_assert(ok, f"count mismatch through copy engines: rank {R} got {got!r}")
    peer.abort()
    world_barrier()


def check_peer_equal_blocks() -> None:
    """Equal blocks (all_to_all_single without split sizes) on the peer backend: under MPS no
    host agreement, the blocks in rounds of a region (an arena small enough for three rounds),
    equal to the reference, eagerly and replayed from a CUDA graph with new data; a rank that
    passes another block size (also one that needs another number of rounds) or another dtype
    of the same size is named on every rank by the next call (CountMismatchError). Without
    MPS the ranks agree on the host first and raise at the call."""
    if BACKEND != "peer" or W == 1:
        return
    arena = 4096 + 4 * W * (8 << 10)  # regions of 8 KiB: 256 rows of 32 bytes
    c = make_comm(timeout=20, p2p_bytes=arena, set_default=False)
    concurrent = c.engine.backend.concurrent
    for i, per_peer in enumerate((0, 1, 7, 256, 257, 600)):
        m = np.full((W, W), per_peer)
        for dtype, shape in ((torch.bfloat16, (16,)), (torch.float32, (2, 4))):
            seed = 900 + 10 * i + len(shape)
            x = input_for(seed, R, m, shape, dtype).to(DEV)
            out = torch.empty_like(x)
            work = c.all_to_all_single(out, x, async_op=bool(i % 2))
            if work is not None:
                work.wait()
            collective_assert(np.array_equal(as_bytes(out), expected_bytes(seed, R, m, shape, dtype)),
                              f"equal blocks of {per_peer} rows {dtype}{shape}: data")
    if concurrent:
        m = np.full((W, W), 300)
        x = torch.zeros((300 * W, 16), dtype=torch.bfloat16, device=DEV)
        out = torch.empty_like(x)
        torch.cuda.synchronize(DEV)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c.all_to_all_single(out, x)
        for seed in (960, 961, 962):
            x.copy_(input_for(seed, R, m, (16,), torch.bfloat16).to(DEV))
            graph.replay()
            c.watch_stream("check_peer_equal_blocks replay", timeout=30)
            collective_assert(np.array_equal(as_bytes(out), expected_bytes(seed, R, m, (16,), torch.bfloat16)),
                              f"equal blocks replayed (seed {seed}): data")
        del graph
    c.close()
    last = R == W - 1
    cases = (("block size", 5 + last, torch.bfloat16), ("block size and rounds", 256 + last, torch.bfloat16),
             ("dtype", 5, torch.float16 if last else torch.bfloat16))
    for name, rows, dtype in cases:
        c = make_comm(timeout=20, p2p_bytes=arena, set_default=False)
        x = torch.zeros((rows * W, 16), dtype=dtype, device=DEV)
        got = _outcome(lambda: c.all_to_all_single(torch.empty_like(x), x))
        if got is None:
            torch.cuda.synchronize(DEV)
            time.sleep(0.3)  # the watchdog looks every 50 ms
            got = _outcome(lambda: c.all_to_all_single(torch.empty_like(x), x))
        words = ("another dtype",) if name == "dtype" else ("another block size", "expected")
        ok = isinstance(got, moecomm.CountMismatchError) and any(w in str(got) for w in words)
        collective_assert(ok, f"equal blocks, {name} differs on the last rank: rank {R} got {got!r}")
        c.abort()
        world_barrier()


def check_peer_mixed_split_sizes() -> None:
    """Concurrent ranks on the peer backend: rank 0 passes equal split sizes to
    all_to_all_single while its peers pass none (equal blocks, no host agreement). Every rank
    times out within the communicator's timeout with a message that names this case: rank 0 in
    the host agreement its peers never join, the peers in the GPU wait for rank 0's headers
    (raised at the first synchronising call after the watchdog saw it)."""
    if BACKEND != "peer" or W == 1:
        return
    import faulthandler

    faulthandler.dump_traceback_later(60, exit=True)  # a hang here prints every thread's stack
    c = make_comm(timeout=2.0, set_default=False)
    if not c.engine.backend.concurrent:
        c.close()
        faulthandler.cancel_dump_traceback_later()
        return
    x = torch.zeros((4 * W, 16), dtype=torch.bfloat16, device=DEV)
    out = torch.empty_like(x)
    splits = [4] * W if R == 0 else None
    got = _outcome(lambda: c.all_to_all_single(out, x, splits, splits))
    for _ in range(3):  # the peers: the GPU wait gives up after the timeout, the watchdog reports it
        if got is not None:
            break
        torch.cuda.synchronize(DEV)
        time.sleep(0.3)  # the watchdog looks every 50 ms
        got = _outcome(lambda: c.all_to_all_single(out, x))
    faulthandler.cancel_dump_traceback_later()
    words = "without split sizes" if R == 0 else "passed split sizes where rank"
    ok = isinstance(got, (TimeoutError, moecomm.CommunicatorClosedError, RuntimeError)) and words in str(got)
    collective_assert(ok, f"split sizes on rank 0 only: rank {R} got {got!r}")
    c.abort()
    world_barrier()


def check_cuda_graph() -> None:
    """Known-counts exchanges captured into a CUDA graph: every replay moves the bytes the
    static input holds then (new data each replay, against the numpy reference), also with
    eager exchanges between replays; an exchange that must learn its counts is refused
    during capture, naming recv_splits; a replay is put under the watchdog by watch_stream.
    With peer memory the captured exchanges move by copy engines: three in the graph, so
    that consecutive replays reuse a buffer half back to back."""
    if DEV.type != "cuda" or BACKEND not in ("nccl", "peer"):
        return
    if BACKEND == "peer" and not COMM.engine.backend.concurrent:  # ranks sharing a GPU without MPS
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                COMM.all_to_all_v(torch.zeros(W, 16, device=DEV), [1] * W, [1] * W)
            refused = ""
        except RuntimeError as exc:
            refused = str(exc)
        collective_assert("run the ranks under MPS" in refused, f"capture without MPS: {refused!r}")
        return
    m = count_matrix(91, W, 9, 0.3)
    send, recv = m[R].tolist(), m[:, R].tolist()
    shape, dtype = (6,), torch.bfloat16
    x = torch.zeros((sum(send),) + shape, dtype=dtype, device=DEV)
    single = torch.empty((sum(recv),) + shape, dtype=dtype, device=DEV)
    counts = torch.tensor(send, device=DEV)
    refused = ""
    torch.cuda.synchronize(DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = COMM.all_to_all_v(x, send, recv)
        COMM.all_to_all_single(single, x, recv, send)
        work = COMM.all_to_all_v(x, send, recv, async_op=True)
        try:
            work.is_completed()
        except RuntimeError as exc:
            refused = str(exc)
        out_async, _ = work.wait()
        try:
            COMM.all_to_all_v(x, counts)
        except RuntimeError as exc:
            refused += " | " + str(exc)
    collective_assert("captured into a CUDA graph" in refused and "recv_splits must be given" in refused,
                      f"capture refusals: {refused!r}")
    for seed in (92, 93, 94):
        x.copy_(input_for(seed, R, m, shape, dtype).to(DEV))
        graph.replay()
        COMM.watch_stream("check_cuda_graph replay", timeout=30)
        want = expected_bytes(seed, R, m, shape, dtype)
        same = all(np.array_equal(as_bytes(t), want) for t in (out, single, out_async))
        collective_assert(same, f"captured exchange, replay with seed {seed}: data")
        if seed != 93:  # an eager exchange after this replay (none after seed 93: replays back to back)
            m2 = count_matrix(seed + 50, W, 9, 0.3)
            x2 = input_for(seed + 50, R, m2, shape, dtype).to(DEV)
            eager, _ = COMM.all_to_all_v(x2, m2[R].tolist(), m2[:, R].tolist())
            same = np.array_equal(as_bytes(eager), expected_bytes(seed + 50, R, m2, shape, dtype))
            collective_assert(same, f"eager exchange after replay {seed}: data")
    del graph
    world_barrier()


def check_torch_dropin() -> None:
    """moecomm.distributed vs torch.distributed (gloo) on the same data, in the same ranks."""
    import torch.distributed as tdist

    import moecomm.distributed as mdist

    if not tdist.is_initialized():
        init_gloo_over_mpi()
    # ranks sharing a GPU (the peer backend): NCCL cannot run there, so torch's reference runs
    # on gloo with CPU copies, and the drop-in's group is the communicator itself
    shared = BACKEND == "peer"
    group = tdist.new_group(backend="nccl") if DEV.type == "cuda" and not shared else tdist.group.WORLD
    ref_dev = torch.device("cpu") if shared else DEV
    ours_group = COMM if shared else group
    seed = 21
    m = count_matrix(seed, W, 5, 0.3)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = input_for(seed, R, m, (3,), dtype).to(DEV)
        n_out = int(m[:, R].sum())
        ref = torch.empty((n_out, 3), dtype=dtype, device=DEV)
        ours = torch.empty_like(ref)
        ours_pg = torch.empty_like(ref)
        ref = ref.to(ref_dev)
        tdist.all_to_all_single(ref, x.to(ref_dev), m[:, R].tolist(), m[R].tolist(), group=group)
        mdist.all_to_all_single(ours, x, m[:, R].tolist(), m[R].tolist())
        work = mdist.all_to_all_single(ours_pg, x, m[:, R].tolist(), m[R].tolist(), group=ours_group, async_op=True)
        work.wait()
        same = np.array_equal(as_bytes(ref), as_bytes(ours)) and np.array_equal(as_bytes(ref), as_bytes(ours_pg))
        collective_assert(same, f"drop-in all_to_all_single {dtype}")  # bytes: random bits hold NaNs
    ins = [torch.full((2, 3), float(R * 10 + p), device=DEV) for p in range(W)]  # gloo needs equal shapes
    ref = [torch.empty((2, 3), device=ref_dev) for _ in range(W)]
    ours = [torch.empty((2, 3), device=DEV) for _ in range(W)]
    if shared:  # (gloo has no list all_to_all in every torch: what each peer sent, by construction)
        ref = [torch.full((2, 3), float(p * 10 + R)) for p in range(W)]
    else:
        tdist.all_to_all(ref, [t.to(ref_dev) for t in ins], group=group)
    mdist.all_to_all(ours, ins)
    collective_assert(all(torch.equal(a, b.to(ref_dev)) for a, b in zip(ref, ours)), "drop-in all_to_all")


if __name__ == "__main__":
    ALL = [check_layout, check_all_to_all_v, check_all_to_all_single, check_all_to_all_lists, check_all_gather_v,
               check_allreduce_broadcast_barrier, check_split, check_gradients, check_validate_mode, check_timeout,
               check_max_ctas, check_peer_memory, check_peer_gpu_counts, check_peer_issue32, check_peer_equal_blocks,
               check_peer_mixed_split_sizes, check_cuda_graph, check_torch_dropin]
    if ONLY and ONLY.startswith("-"):
        ALL = [c for c in ALL if c.__name__ != ONLY[1:]]
    elif ONLY:
        ALL = [c for c in ALL if c.__name__ == ONLY]
    rank_main(ALL)
