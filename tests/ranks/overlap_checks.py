"""scatter_compute_gather on real ranks (run by tests/test_overlap.py; on GPUs by hand).

    mpiexec -n K python -m tests.ranks.overlap_checks [mpi|nccl|torch] [check,check,...]

Every result is compared with the non-overlapped path (``all_to_all_v -> fn -> all_to_all_v``
back, or ``moecomm.functional.all_to_all_v`` for gradients): bit for bit for the data
movement and for row-wise element-wise ``fn``; gradients of ``input`` bit for bit for
element-wise ``fn``, parameter gradients (sums over rows, in another order) to rounding.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moecomm
from moecomm.graphs import capture
from moecomm.functional import all_to_all_v
from moecomm.overlap import Chunk
from moecomm.profile import Profile, ProfileEntry
from tests.mpi_util import collective_assert, init_gloo_over_mpi, rank_main

# "nccl-p2p": the NCCL backend with peer memory (init(p2p_bytes=)): every stage moves by copy engines
P2P_BYTES = (64 << 20) if len(sys.argv) > 1 and sys.argv[1] == "nccl-p2p" else None
BACKEND = "nccl" if P2P_BYTES else (sys.argv[1] if len(sys.argv) > 1 else "mpi")

ONLY = sys.argv[2].split(",") if len(sys.argv) > 2 else None
SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=12,
                    suppress_health_check=list(HealthCheck))


def make_comm(**kw):
    if BACKEND == "torch":
        import torch.distributed as dist

        init_gloo_over_mpi()
        return moecomm.init(process_group=dist.group.WORLD, **kw)
    if BACKEND == "nccl":  # "nccl": NCCL alone (init's default would add peer memory on one node)
        kw.setdefault("p2p_bytes", P2P_BYTES or 0)
    if kw.get("p2p_bytes"):  # the copy engines for every known-counts exchange, however small
        kw.setdefault("p2p_min_bytes", 0)
    return moecomm.init(backend=BACKEND, **kw)


torch.set_num_threads(1)


def auto_profile(comm) -> Profile:
    """A topology profile whose measured degrees make degree="auto" cut these tiny exchanges
    into 1 to 4 pieces, a different count per pair (the built-in rule leaves anything under
    hundreds of MiB unchunked: tests/test_overlap_unit.py)."""
    degrees = ((32, 1), (64, 2), (96, 3), (128, 4))  # bytes per rank -> pieces (nearest, log scale)
    return Profile(comm.topology.fingerprint, tuple(ProfileEntry(b, "flat", {}, d) for b, d in degrees))


_probe = make_comm(timeout=60, set_default=False)
AUTO_PROFILE = auto_profile(_probe)
_probe.close()
COMM = make_comm(timeout=60, profile=AUTO_PROFILE)
W, R = COMM.size, COMM.rank
assert W == 1 or moecomm.overlap.auto_stages(COMM) == 4, "the profile's degrees must reach degree='auto'"
DEV = COMM.device
DEGREES = [1, 2, 3, 4, 8, "auto"]
# (degree, own): every degree; own rows first (own: own_split) with a few
MODES = [(d, None) for d in DEGREES] + [(1, 1.0), (1, 0.5), (2, 0.5), (2, 0.0), (3, 1.0), ("auto", 0.5)]


def own_kw(own) -> dict:
    """Keyword arguments of an own mode: None (own rows not first) or own_split."""
    return {} if own is None else {"own_first": True, "own_split": own}


# -- data -------------------------------------------------------------------------------------


def counts(seed: int, max_rows: int, zero_fraction: float, empty_rank: bool = False) -> np.ndarray:
    """``m[src, dst]`` (the same on every rank); ``empty_rank``: the last rank sends and gets nothing."""
    rng = np.random.default_rng([seed, 11])
    m = rng.integers(0, max_rows + 1, size=(W, W))
    m[rng.random((W, W)) < zero_fraction] = 0
    if empty_rank and W > 1:
        m[-1, :] = 0
        m[:, -1] = 0
    return m


def rows_for(seed: int, m: np.ndarray, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + R)
    n = int(m[R].sum())
    if dtype.is_floating_point:
        x = torch.randn((n,) + row_shape, generator=g).to(dtype)
    else:
        x = torch.randint(-100, 100, (n,) + row_shape, generator=g).to(dtype)
    return x.to(DEV)


def splits(m: np.ndarray) -> tuple[list[int], list[int]]:
    return m[R].tolist(), m[:, R].tolist()


# -- fns ----------------------------------------------------------------------------------------


def fn_identity(rows, chunk):
    return rows


def fn_tag(rows, chunk):
    """Element-wise, different out shape: [rows, 2, *row] with the source rank added to copy 2."""
    src = chunk.source_ranks().to(rows.dtype).reshape((-1,) + (1,) * (rows.dim() - 1))
    return torch.stack([rows * 2, rows + src], dim=1)


class Problems:
    """Collects per-rank failures inside fn (asserting there would desynchronise the ranks)."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def check(self, ok: bool, msg: str) -> None:
        if not ok:
            self.items.append(msg)


def fn_checking_chunk(full_ref: torch.Tensor, recv: list[int], problems: Problems):
    """Identity that verifies what fn is told against the non-overlapped output ``full_ref``."""

    def fn(rows, chunk):
        problems.check(chunk.recv_splits == recv, f"recv_splits {chunk.recv_splits} != {recv}")
        problems.check(sum(chunk.source_splits) == rows.shape[0], "source_splits do not sum to rows")
        problems.check(torch.equal(chunk.take(full_ref), rows), f"chunk {chunk.index}: take(full) != rows")
        src = chunk.source_ranks().cpu()
        exp = torch.repeat_interleave(torch.arange(W), torch.tensor(chunk.source_splits, dtype=torch.int64))
        problems.check(torch.equal(src, exp), f"chunk {chunk.index}: source_ranks")
        for p in range(W):
            lo = chunk.source_offsets[p]
            problems.check(0 <= lo and lo + chunk.source_splits[p] <= recv[p], f"offsets of source {p}")
        return rows

    return fn


def reference(x, send, recv, fn, **kw):
    """The non-overlapped computation (no autograd)."""
    rows, r = COMM.all_to_all_v(x, send, recv, **kw)
    y = fn(rows, Chunk.full(r, DEV)).contiguous()
    out, _ = COMM.all_to_all_v(y, r, send, **kw)
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.detach().cpu().contiguous().view(-1).view(torch.uint8),
                       b.detach().cpu().contiguous().view(-1).view(torch.uint8))


# -- checks -------------------------------------------------------------------------------------


def check_equivalence() -> None:
    """Degrees 1..8 and auto, known and unknown recv_splits, zeros and an empty rank, several dtypes."""
    cases = [(1, 7, 0.3, False, (3,), torch.float32), (2, 5, 0.0, True, (2, 3), torch.bfloat16),
             (3, 9, 0.5, False, (), torch.int64), (4, 1, 0.2, False, (4,), torch.float64),
             (5, 0, 0.0, False, (2,), torch.float32)]
    for seed, max_rows, zf, empty, shape, dtype in cases:
        m = counts(seed, max_rows, zf, empty)
        send, recv = splits(m)
        x = rows_for(seed, m, shape, dtype)
        full_ref, _ = COMM.all_to_all_v(x, send, recv)
        ref_tag = reference(x, send, recv, fn_tag)
        for d, own in MODES:
            for known in (True, False):
                problems = Problems()
                rs = recv if known else None
                out = COMM.scatter_compute_gather(x, send, fn_checking_chunk(full_ref, recv, problems), degree=d,
                                                  recv_splits=rs, **own_kw(own))
                collective_assert(bits_equal(out, x), f"round trip, degree {d} own_first {own}, case {seed}")
                collective_assert(not problems.items, f"degree {d} own_first {own} case {seed}: {problems.items[:3]}")
                out = COMM.scatter_compute_gather(x, send, fn_tag, degree=d, recv_splits=rs, **own_kw(own))
                collective_assert(bits_equal(out, ref_tag), f"fn_tag, degree {d} own_first {own}, case {seed}, {dtype}")
                collective_assert(bits_equal(x, rows_for(seed, m, shape, dtype)), "input left unchanged")


def check_own_first() -> None:
    """own_first: stage 0 holds only this rank's first ``round(own_split * n)`` own rows and,
    with own_split < 1, the last stage the rest, as views of the input (no copy); the peers'
    stages hold none of them; fn sees every stage exactly once."""
    m = counts(41, 6, 0.2)
    m[np.arange(W), np.arange(W)] = np.maximum(m[np.arange(W), np.arange(W)], 1)  # every rank keeps a row
    send, recv = splits(m)
    x = rows_for(41, m, (3,), torch.float32)
    own_at = x[sum(send[:R]):].data_ptr()
    n_own = send[R]
    for split in (1.0, 0.5, 0.0):
        seen: list = []

        def fn(rows, chunk):
            seen.append((chunk.index, list(chunk.source_splits), rows.data_ptr()))
            return rows * 3

        out = COMM.scatter_compute_gather(x, send, fn, degree=2, recv_splits=recv, own_first=True, own_split=split)
        collective_assert(bits_equal(out, x * 3), f"own_first result, own_split {split}")
        stages = sorted(seen)
        last = W > 1 and split < 1
        ok = [s[0] for s in stages] == list(range(2 + (W > 1) + last))
        if W > 1:
            first = round(split * n_own)
            own_only = [[first if p == R else 0 for p in range(W)]]
            ends = [stages[0]]
            if last:
                own_only.append([n_own - first if p == R else 0 for p in range(W)])
                ends.append(stages[-1])
            ok = ok and [e[1] for e in ends] == own_only
            ok = ok and all(e[2] == own_at + (first * 3 * 4 if k else 0) for k, e in enumerate(ends) if e[1][R])
            ok = ok and all(s[1][R] == 0 for s in stages[1:len(stages) - last])
        collective_assert(ok, f"own_first stages, own_split {split}: {[(s[0], s[1]) for s in stages]}")
    for bad, exc, name in (({"own_first": 1}, TypeError, "own_first"), ({"own_first": True, "own_split": 1.5},
                                                                           ValueError, "own_split"),
                           ({"own_first": True, "own_split": "half"}, ValueError, "own_split")):
        with_errors = False
        try:
            COMM.scatter_compute_gather(x, send, fn, degree=2, recv_splits=recv, **bad)
        except exc as e:
            with_errors = name in str(e)
        collective_assert(with_errors, f"{bad} raises {exc.__name__} naming {name}")


def check_split_forms() -> None:
    """send_splits as a tensor (on the device) and numpy; degree 16 (more chunks than rows)."""
    m = counts(7, 6, 0.3)
    send, recv = splits(m)
    x = rows_for(7, m, (5,), torch.float32)
    ref = reference(x, send, recv, fn_tag)
    for form in (torch.tensor(send, device=DEV), np.array(send)):
        out = COMM.scatter_compute_gather(x, form, fn_tag, degree=3)
        collective_assert(bits_equal(out, ref), f"send_splits as {type(form).__name__}")
    out = COMM.scatter_compute_gather(x, send, fn_tag, degree=16, recv_splits=recv)
    collective_assert(bits_equal(out, ref), "degree 16")


class ElementwiseFn:
    """tanh(rows) * w + source rank: element-wise, so input gradients are bitwise reproducible."""

    def __init__(self, width: int, dtype=torch.float32) -> None:
        g = torch.Generator().manual_seed(5)
        self.w = torch.randn(width, generator=g).to(DEV, dtype).requires_grad_()

    def __call__(self, rows, chunk):
        return torch.tanh(rows) * self.w + chunk.source_ranks().to(rows.dtype)[:, None]


class MatmulFn:
    """A small two-layer FFN (not bitwise across row subsets: compared to rounding)."""

    def __init__(self, d: int, h: int) -> None:
        g = torch.Generator().manual_seed(6)
        self.w1 = (torch.randn(d, h, generator=g) / d ** 0.5).to(DEV).requires_grad_()
        self.w2 = (torch.randn(h, d + 1, generator=g) / h ** 0.5).to(DEV).requires_grad_()

    def __call__(self, rows, chunk):
        return torch.nn.functional.gelu(rows @ self.w1) @ self.w2


def _plain(x, send, recv, fn):
    rows, r = all_to_all_v(x, send, recv, comm=COMM)
    y = fn(rows, Chunk.full(r, DEV))
    out, _ = all_to_all_v(y, r, send, comm=COMM)
    return out


def check_gradients() -> None:
    """Backward against moecomm.functional's non-overlapped autograd path."""
    for seed, zf, empty in ((11, 0.3, False), (12, 0.0, True)):
        m = counts(seed, 6, zf, empty)
        send, recv = splits(m)
        x0 = rows_for(seed, m, (4,), torch.float32)
        gout = rows_for(seed + 100, m, (4,), torch.float32)
        f = ElementwiseFn(4)
        xr = x0.clone().requires_grad_()
        _plain(xr, send, recv, f).backward(gout)
        gx_ref, gw_ref = xr.grad, f.w.grad
        for d, own in MODES:
            f.w.grad = None
            xo = x0.clone().requires_grad_()
            out = COMM.scatter_compute_gather(xo, send, f, degree=d, recv_splits=recv if d != 3 else None,
                                              **own_kw(own))
            out.backward(gout)
            collective_assert(bits_equal(xo.grad, gx_ref), f"x.grad, degree {d} own_first {own}, seed {seed}")
            collective_assert(torch.allclose(f.w.grad, gw_ref, rtol=1e-5, atol=1e-5),
                              f"w.grad, degree {d} own_first {own}")
        # only the parameters need gradients; autograd.grad instead of backward; retain_graph twice
        f.w.grad = None
        out = COMM.scatter_compute_gather(x0, send, f, degree=2, recv_splits=recv)
        out.backward(gout)
        collective_assert(torch.allclose(f.w.grad, gw_ref, rtol=1e-5, atol=1e-5), "w.grad, input without grad")
        for d, own in ((4, None), (2, 0.5), (2, 1.0)):
            xo = x0.clone().requires_grad_()
            out = COMM.scatter_compute_gather(xo, send, f, degree=d, recv_splits=recv, **own_kw(own))
            gx, gw = torch.autograd.grad(out, (xo, f.w), gout, retain_graph=True)
            collective_assert(bits_equal(gx, gx_ref) and torch.allclose(gw, gw_ref, rtol=1e-5, atol=1e-5),
                              f"autograd.grad, own_first {own}")
            gx2, = torch.autograd.grad(out, (xo,), gout)
            collective_assert(bits_equal(gx2, gx_ref), f"second backward through a retained graph, own_first {own}")

    m = counts(13, 5, 0.2)
    send, recv = splits(m)
    x0 = rows_for(13, m, (6,), torch.float32)
    gout = rows_for(113, m, (7,), torch.float32)
    f = MatmulFn(6, 5)
    xr = x0.clone().requires_grad_()
    _plain(xr, send, recv, f).backward(gout)
    ref = (xr.grad, f.w1.grad, f.w2.grad)
    for d, own in ((2, None), (3, None), (8, None), (1, 1.0), (3, 0.5)):
        f.w1.grad = f.w2.grad = None
        xo = x0.clone().requires_grad_()
        COMM.scatter_compute_gather(xo, send, f, degree=d, recv_splits=recv, **own_kw(own)).backward(gout)
        got = (xo.grad, f.w1.grad, f.w2.grad)
        ok = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, ref))
        collective_assert(ok, f"matmul fn gradients, degree {d} own_first {own}")


def check_group_order() -> None:
    """Per-expert grouping across sources: fn scales each row by (its local expert + 1)."""
    experts = 3
    rng = np.random.default_rng(21)
    per = rng.integers(0, 4, size=(W, W, experts))  # [src, dst, local expert]
    per[rng.random(per.shape) < 0.3] = 0
    m = per.sum(axis=2)
    send, recv = splits(m)
    recv_expert = per[:, R, :].tolist()  # [source][local expert], rows of a source sorted by expert
    x = rows_for(21, m, (2,), torch.float32)

    def fn(rows, chunk):
        order, sizes = chunk.group_order(recv_expert)
        grouped = rows.index_select(0, order)
        scale = torch.repeat_interleave(torch.arange(1, experts + 1, dtype=rows.dtype, device=rows.device),
                                        torch.tensor(sizes, device=rows.device), output_size=rows.shape[0])
        y = grouped * scale[:, None]
        return torch.empty_like(y).index_copy(0, order, y)

    # the expected: each source's rows sorted by expert -> scale by expert index + 1
    full_scale = torch.tensor(np.concatenate([np.repeat(np.arange(1, experts + 1), per[p, R]) for p in range(W)])
                              if m[:, R].sum() else np.zeros(0), dtype=torch.float32, device=DEV)
    expected = reference(x, send, recv, lambda rows, ch: rows * full_scale[:, None])
    for d, own in ((1, None), (2, None), (3, None), (8, None), (1, 1.0), (2, 0.5)):
        out = COMM.scatter_compute_gather(x, send, fn, degree=d, recv_splits=recv, **own_kw(own))
        collective_assert(bits_equal(out, expected), f"group_order, degree {d} own_first {own}")

    def fn_splits(rows, chunk):
        gs = chunk.group_splits(recv_expert)
        ok = [sum(r) for r in gs] == chunk.source_splits
        return rows * (1.0 if ok else float("nan"))

    out = COMM.scatter_compute_gather(x, send, fn_splits, degree=3, recv_splits=recv)
    collective_assert(bits_equal(out, x), "group_splits sums")


def check_algorithm_passthrough() -> None:
    """algorithm='flat' always; '2dh' on a hierarchy (4 ranks as 2 nodes x 2) when the core has it."""
    m = counts(31, 5, 0.3)
    send, recv = splits(m)
    x = rows_for(31, m, (3,), torch.float32)
    ref = reference(x, send, recv, fn_tag)
    out = COMM.scatter_compute_gather(x, send, fn_tag, degree=3, recv_splits=recv, algorithm="flat")
    collective_assert(bits_equal(out, ref), "algorithm='flat'")
    # validate=True: every stage goes through all_to_all_v (packed), with its cross-checks
    checked = make_comm(timeout=60, validate=True, set_default=False)
    f = ElementwiseFn(3)
    xr = x.clone().requires_grad_()
    _plain(xr, send, recv, f).backward(x)
    for d, own in ((1, None), (3, None), (2, 0.5)):
        out = checked.scatter_compute_gather(x, send, fn_tag, degree=d, recv_splits=recv, **own_kw(own))
        collective_assert(bits_equal(out, ref), f"validate=True, degree {d} own_first {own}")
        xo = x.clone().requires_grad_()
        checked.scatter_compute_gather(xo, send, f, degree=d, recv_splits=recv, **own_kw(own)).backward(x)
        collective_assert(bits_equal(xo.grad, xr.grad), f"validate=True gradients, degree {d} own_first {own}")
    checked.close()
    import inspect

    if "algorithm" not in inspect.signature(COMM.all_to_all_v).parameters or W % 2 or BACKEND != "mpi":
        return
    hier = moecomm.init(backend="mpi", local_size=2, hierarchy=True, timeout=60, set_default=False)
    f = ElementwiseFn(3)
    xr = x.clone().requires_grad_()
    _plain(xr, send, recv, f).backward(x)
    gref = xr.grad
    for alg in ("2dh", "auto"):
        for d in (1, 2, 3):
            xo = x.clone().requires_grad_()
            out = hier.scatter_compute_gather(xo, send, fn_tag, degree=d, recv_splits=recv, algorithm=alg)
            collective_assert(bits_equal(out, ref), f"algorithm={alg}, degree {d}")
            out = hier.scatter_compute_gather(xo, send, f, degree=d, recv_splits=recv, algorithm=alg)
            out.backward(x)
            collective_assert(bits_equal(xo.grad, gref), f"algorithm={alg} gradients, degree {d}")
        xo = x.clone().requires_grad_()
        out = hier.scatter_compute_gather(xo, send, f, degree=2, recv_splits=recv, algorithm=alg, own_first=True)
        out.backward(x)
        collective_assert(bits_equal(xo.grad, gref), f"algorithm={alg} gradients, own_first")
    hier.close()


@SETTINGS
@given(seed=st.integers(0, 2**31), max_rows=st.integers(0, 9), zero_fraction=st.sampled_from([0.0, 0.4, 0.9]),
       degree=st.sampled_from([1, 2, 3, 4, 5, 8, 16, "auto"]), known=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int32, torch.uint8]),
       row_shape=st.sampled_from([(), (1,), (3,), (2, 2)]), grad=st.booleans(),
       own=st.sampled_from([None, 0.0, 0.3, 0.5, 1.0]))
def check_hypothesis(seed, max_rows, zero_fraction, degree, known, dtype, row_shape, grad, own) -> None:
    m = counts(seed, max_rows, zero_fraction)
    send, recv = splits(m)
    x = rows_for(seed, m, row_shape, dtype)
    ref = reference(x, send, recv, fn_tag)
    out = COMM.scatter_compute_gather(x, send, fn_tag, degree=degree, recv_splits=recv if known else None,
                                      **own_kw(own))
    collective_assert(bits_equal(out, ref), f"hypothesis forward: degree {degree} {dtype} {row_shape} seed {seed}")
    if grad and dtype.is_floating_point:
        width = int(np.prod(row_shape)) if row_shape else 1
        f = ElementwiseFn(width, dtype)
        flat = x.reshape(x.shape[0], width)
        gout = (flat * 0.5 + 1).contiguous()
        xr = flat.clone().requires_grad_()
        _plain(xr, send, recv, f).backward(gout)
        gx, gw = xr.grad, f.w.grad
        f.w.grad = None
        xo = flat.clone().requires_grad_()
        COMM.scatter_compute_gather(xo, send, f, degree=degree, recv_splits=recv if known else None,
                                    **own_kw(own)).backward(gout)
        tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
        collective_assert(bits_equal(xo.grad, gx), f"hypothesis x.grad: degree {degree} {dtype} seed {seed}")
        collective_assert(torch.allclose(f.w.grad.float(), gw.float(), rtol=tol, atol=tol),
                          f"hypothesis w.grad: degree {degree} {dtype} seed {seed}")


def check_bad_arguments() -> None:
    """Argument errors raise before anything is exchanged: the communicator stays usable."""
    m = counts(41, 3, 0.0)
    send, recv = splits(m)
    x = rows_for(41, m, (2,), torch.float32)
    for kw, exc in (({"degree": 0}, ValueError), ({"degree": 17}, ValueError), ({"degree": "max"}, ValueError),
                    ({"degree": 2.0}, ValueError), ({"algorithm": "nope"}, ValueError)):
        try:
            COMM.scatter_compute_gather(x, send, fn_identity, recv_splits=recv, **kw)
            raised = None
        except Exception as e:  # noqa: BLE001
            raised = e
        collective_assert(isinstance(raised, exc), f"{kw}: got {raised!r}")
    for bad_send in ([1] * (W + 1), [x.shape[0] + 1] + [0] * (W - 1)):
        try:
            COMM.scatter_compute_gather(x, bad_send, fn_identity, recv_splits=recv)
            raised = None
        except ValueError as e:
            raised = e
        collective_assert(raised is not None, f"bad send_splits {bad_send} accepted")
    try:
        COMM.scatter_compute_gather(x, send, "not callable", recv_splits=recv)
        raised = None
    except TypeError as e:
        raised = e
    collective_assert(raised is not None, "non-callable fn accepted")
    out = COMM.scatter_compute_gather(x, send, fn_identity, degree=2, recv_splits=recv)
    collective_assert(not COMM.closed and bits_equal(out, x), "communicator unusable after argument errors")


def check_fn_errors() -> None:
    """fn raising on one rank mid-pipeline: that rank re-raises (communicator aborted); peers time
    out, or on MPI raise PeerFailedError quoting its error at once (its failure notice)."""
    from moecomm import CommunicatorClosedError

    timeout = 2.0
    m = counts(51, 4, 0.0)
    m = np.maximum(m, 1)
    send, recv = splits(m)
    x = rows_for(51, m, (2,), torch.float32)
    bad = W - 1

    class Boom(Exception):
        pass

    for degree, stage in ((3, 1), (2, 0)):
        c = make_comm(timeout=timeout, set_default=False)

        def fn(rows, chunk):
            if R == bad and chunk.index == stage:
                raise Boom(f"stage {chunk.index}")
            return rows * 2

        t0 = time.monotonic()
        try:
            c.scatter_compute_gather(x, send, fn, degree=degree, recv_splits=recv)
            # On a stream-ordered backend (NCCL) the peers' exchanges may still be queued on
            # the GPU when the call returns: the failure must surface at the next host wait.
            if c.backend == "nccl":
                c.barrier()
            got = None
        except Exception as e:  # noqa: BLE001
            got = e
        took = time.monotonic() - t0
        if R == bad:
            ok = isinstance(got, Boom) and c.closed and took < timeout
        elif c.backend == "mpi":  # told by rank bad's failure notice, well before the timeout
            told = isinstance(got, moecomm.PeerFailedError) and f"rank {bad} aborted" in str(got) and \
                f"Boom: stage {stage}" in str(got)
            ok = W == 1 or (told and c.closed and took < timeout)
        else:
            ok = W == 1 or (isinstance(got, TimeoutError) and c.closed and took < timeout * 3 + 5)
        collective_assert(ok, f"degree {degree}: rank {R} got {got!r} after {took:.1f} s, closed={c.closed}")
        try:
            c.scatter_compute_gather(x, send, fn_identity, recv_splits=recv)
            again = None
        except Exception as e:  # noqa: BLE001
            again = e
        collective_assert(isinstance(again, CommunicatorClosedError), f"use after the failure: {again!r}")

    # fn returning the wrong number of rows on every rank: all raise ValueError together
    c = make_comm(timeout=timeout, set_default=False)
    try:
        c.scatter_compute_gather(x, send, lambda rows, ch: rows[:-1] if rows.shape[0] else rows[:, :1],
                                 degree=2, recv_splits=recv)
        got = None
    except Exception as e:  # noqa: BLE001
        got = e
    collective_assert(isinstance(got, (ValueError, TimeoutError)), f"wrong row count: {got!r}")
    # a fresh communicator works
    c = make_comm(timeout=30, set_default=False)
    out = c.scatter_compute_gather(x, send, fn_tag, degree=2, recv_splits=recv)
    collective_assert(bits_equal(out, reference(x, send, recv, fn_tag)), "fresh communicator after failures")
    c.close()


def check_cuda_graph() -> None:
    """GPU: forward and backward captured into a CUDA graph, replayed with new data, equal the
    eager call on the same data (x.grad bitwise); eager calls between replays (which put
    tables of their own through pinned memory) do not disturb the next replay."""
    if DEV.type != "cuda":
        return
    m = counts(31, 7, 0.3)
    send, recv = splits(m)
    for d, own in ((2, None), (3, None), ("auto", None), (1, 1.0), (1, 0.5), (2, 0.5)):
        f, fe = ElementwiseFn(4), ElementwiseFn(4)
        x = rows_for(31, m, (4,), torch.float32).clone().requires_grad_()
        gout = rows_for(131, m, (4,), torch.float32)

        def step():
            x.grad = f.w.grad = None
            out = COMM.scatter_compute_gather(x, send, f, degree=d, recv_splits=recv, **own_kw(own))
            out.backward(gout)
            return out

        graph, out = capture(step, DEV, warmup=2)
        for seed in (32, 33, 34):
            with torch.no_grad():
                x.copy_(rows_for(seed, m, (4,), torch.float32))
                gout.copy_(rows_for(seed + 100, m, (4,), torch.float32))
            graph.replay()
            COMM.watch_stream("overlap check_cuda_graph replay", timeout=30)
            got = (out.detach().clone(), x.grad.clone(), f.w.grad.clone())
            xe = x.detach().clone().requires_grad_()
            fe.w.grad = None
            oute = COMM.scatter_compute_gather(xe, send, fe, degree=d, recv_splits=recv, **own_kw(own))
            oute.backward(gout)
            ok = bits_equal(got[0], oute.detach()) and bits_equal(got[1], xe.grad) and \
                torch.allclose(got[2], fe.w.grad, rtol=1e-5, atol=1e-5)
            collective_assert(ok, f"captured scatter_compute_gather, degree {d} own_first {own}, replay seed {seed}")
        del graph


CHECKS = [check_equivalence, check_own_first, check_split_forms, check_gradients, check_group_order, check_algorithm_passthrough,
          check_hypothesis, check_bad_arguments, check_fn_errors, check_cuda_graph]

if __name__ == "__main__":
    chosen = [c for c in CHECKS if ONLY is None or c.__name__.removeprefix("check_") in ONLY]
    rank_main(chosen)
