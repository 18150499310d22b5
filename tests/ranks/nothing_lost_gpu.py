"""Issue 14 on 2 GPUs over NCCL (run by tests/test_nothing_lost.py, marked gpu): the staging
pool across shapes, dtypes and algorithms on the device, the count records of a call without
recv_splits (counts in a GPU tensor) naming another dtype, validate=True with ranks mixing
recv_splits and None, and a conjugate input."""

from __future__ import annotations

import numpy as np
import torch

import moecomm
from moecomm import CountMismatchError
from tests.mpi_util import collective_assert, rank_main
from tests.ranks.data import as_bytes, count_matrix, expected_bytes, input_for


def _make(**kw) -> moecomm.Communicator:
    return moecomm.init(backend="nccl", timeout=60, local_size=1, hierarchy=True, **kw)


COMM = _make()
W, R, DEV = COMM.size, COMM.rank, COMM.device


def check_pool_on_the_device() -> None:
    call = 0
    for shape in [(300,), (128,), (7, 40), (5,)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for algorithm in ("flat", "2dh"):
                call += 1
                m = count_matrix(2000 + call, W, 5, 0.2)
                x = input_for(2000 + call, R, m, shape, dtype).to(DEV)
                counts = torch.tensor([int(v) for v in m[R]], device=DEV)
                out, got = COMM.all_to_all_v(x, counts if algorithm == "flat" else [int(v) for v in m[R]],
                                             algorithm=algorithm)
                ok = np.array_equal(as_bytes(out), expected_bytes(2000 + call, R, m, shape, dtype))
                collective_assert(ok, f"call {call}")
                collective_assert(COMM.pool_stats().in_use_bytes == 0, repr(COMM.pool_stats()))


def check_dtype_named_by_default() -> None:
    global COMM
    m = count_matrix(3, W, 4, 0.0) + 1
    x = input_for(3, R, m, (2, 4), torch.float32).to(DEV)
    if R == 1:
        x = x.view(torch.float16)
    try:
        COMM.all_to_all_v(x, torch.tensor([int(v) for v in m[R]], device=DEV))
        kind, msg = "ok", ""
    except CountMismatchError as exc:
        kind, msg = "mismatch", str(exc)
    collective_assert(kind == "mismatch" and "another dtype" in msg and COMM.closed, f"{kind} {msg!r}")
    COMM = _make()


def check_validate_mixed_and_wrong() -> None:
    v = _make(validate=True)
    m = count_matrix(4, W, 4, 0.0) + 1
    x = input_for(4, R, m, (3,), torch.float32).to(DEV)
    send, recv = [int(v_) for v_ in m[R]], [int(v_) for v_ in m[:, R]]
    out, _ = v.all_to_all_v(x, send, recv if R == 0 else None)
    torch.cuda.synchronize()
    collective_assert(np.array_equal(as_bytes(out), expected_bytes(4, R, m, (3,), torch.float32)), "mixed")
    wrong = list(recv)
    if R == 0:
        wrong[1] += 1
    try:
        v.all_to_all_v(x, send, wrong if R == 0 else None)
        kind = "ok"
    except CountMismatchError as exc:
        kind = "mismatch" if "which expects" in str(exc) else str(exc)
    collective_assert(kind == "mismatch", kind)
    v.close()


def check_conjugate_input() -> None:
    z = torch.randn(2 * W, 3, dtype=torch.complex64, device=DEV)
    out, _ = COMM.all_to_all_v(z.conj(), [2] * W)
    torch.cuda.synchronize()
    collective_assert(out.shape == (2 * W, 3) and not out.is_conj(), "conj")


if __name__ == "__main__":
    rank_main([check_pool_on_the_device, check_dtype_named_by_default, check_validate_mixed_and_wrong,
               check_conjugate_input])
