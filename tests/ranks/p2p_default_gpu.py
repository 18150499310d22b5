"""Issue 16 (4) on GPUs of one node (run by tests/test_p2p_default.py, marked gpu): ``moecomm.init()``
with no options turns the peer-memory transport on, with the documented size; the counts-on-the-GPU
exchange and the torch.distributed drop-in then take it and equal the numpy reference;
``p2p_bytes=0`` leaves it off. Also runs under torchrun (``init()`` finds the launcher)."""

from __future__ import annotations

import numpy as np
import torch

import moecomm
import moecomm.distributed as mdist
from moecomm.backends import _p2p_default
from tests.mpi_util import collective_assert, rank_main
from tests.ranks.data import as_bytes, count_matrix, expected_bytes, input_for

COMM = moecomm.init()  # no options: the defaults under test
W, R, DEV = COMM.size, COMM.rank, COMM.device


def _spy(transport, name: str) -> list:
    """Count the calls of ``transport.name`` (the path an exchange took)."""
    calls: list = []
    real = getattr(transport, name)

    def wrapped(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    setattr(transport, name, wrapped)
    return calls


def check_on_by_default() -> None:
    t = COMM.engine.peer
    collective_assert(COMM.backend == "nccl" and t is not None, f"{COMM!r}: transport {t!r}")
    total = torch.cuda.mem_get_info(DEV)[1]
    rule = 4 * W * _p2p_default.REGION_BYTES  # the default before the cap at 1/16 of the free memory
    collective_assert(0 < t.arena_bytes <= rule and t.arena_bytes % (2 << 20) == 0, f"arena {t.arena_bytes} bytes")
    if total >= 2 * _p2p_default.FREE_FRACTION * rule:  # the cap cannot bind on an otherwise idle GPU this big
        collective_assert(t.arena_bytes == rule, f"arena {t.arena_bytes} bytes, expected {rule}")
    sizes = [row[0] for row in COMM._gather_ints([t.arena_bytes], "test")]
    collective_assert(len(set(sizes)) == 1, f"ranks disagree on the size: {sizes}")


def check_counts_on_gpu() -> None:
    calls = _spy(COMM.engine.peer, "start")
    n = 0
    for i in range(10):
        seed = 900 + i
        m = count_matrix(seed, W, [0, 5, 300, 4000][i % 4], 0.3)
        for dtype, shape in ((torch.bfloat16, (2048,)), (torch.float32, (4, 2)), (torch.float16, (24,))):
            x = input_for(seed, R, m, shape, dtype).to(DEV)
            counts = torch.tensor(m[R], device=DEV, dtype=torch.int32 if i % 2 else torch.int64)
            out, recv = COMM.all_to_all_v(x, counts)
            n += 1
            collective_assert(recv == m[:, R].tolist(), f"call {i} {dtype}{shape}: counts {recv}")
            same = np.array_equal(as_bytes(out), expected_bytes(seed, R, m, shape, dtype))
            collective_assert(same, f"call {i} {dtype}{shape}: data")
    collective_assert(len(calls) == n, f"{len(calls)} of {n} exchanges took the peer-memory path")


def check_drop_in() -> None:
    """moecomm.distributed.all_to_all_single on the default communicator (made by init()), known
    splits: small ones through NCCL, from 16 MiB a rank by copy engines through the peer memory."""
    calls = _spy(COMM.engine.peer, "exchange")
    for i, max_rows in enumerate((7, 9000)):  # rows of 4 KiB: ~0 and ~18 MiB a rank
        seed = 950 + i
        m = count_matrix(seed, W, max_rows, 0.2)
        if i == 1:
            m[:, :] = np.maximum(m, 4500)
        x = input_for(seed, R, m, (2048,), torch.bfloat16).to(DEV)
        out = torch.empty(int(m[:, R].sum()), 2048, dtype=torch.bfloat16, device=DEV)
        mdist.all_to_all_single(out, x, m[:, R].tolist(), m[R].tolist())
        same = np.array_equal(as_bytes(out), expected_bytes(seed, R, m, (2048,), torch.bfloat16))
        collective_assert(same, f"all_to_all_single {max_rows}: data")
    collective_assert(len(calls) == 1, f"copy-engine exchanges: {len(calls)} (expected the large one only)")


def check_zero_is_off() -> None:
    off = moecomm.init(p2p_bytes=0, set_default=False)
    collective_assert(off.engine.peer is None, "p2p_bytes=0")
    m = count_matrix(990, W, 50, 0.3)
    x = input_for(990, R, m, (8,), torch.bfloat16).to(DEV)
    out, recv = off.all_to_all_v(x, torch.tensor(m[R], device=DEV))
    collective_assert(np.array_equal(as_bytes(out), expected_bytes(990, R, m, (8,), torch.bfloat16)), "off: data")
    off.close()


def check_close() -> None:
    moecomm.set_default_communicator(None)
    COMM.close()
    collective_assert(COMM.engine.peer is None, "closed")


if __name__ == "__main__":
    rank_main([check_on_by_default, check_counts_on_gpu, check_drop_in, check_zero_is_off, check_close])
