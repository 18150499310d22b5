"""Issue 14 ("nothing lost"): the staging pool across views, counts checked between ranks by
default, argument types of validate/pool_bytes, and clear errors for odd inputs."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecomm.pool import StagingPool

from .mpi_util import run_ranks

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int32, torch.int64]


def test_pool_give_files_the_block_under_dtype_views():
    """The reproducer from the issue: a dtype view of a taken block goes back as the block."""
    p = StagingPool(1 << 20)
    buf = p.take(4096, CPU, 1).view(torch.float32).view(16, 64)
    p.give(buf, CPU, 1)
    assert p.stats().in_use_bytes == 0 and p.stats().cached_bytes == 4096
    again = p.take(4000, CPU, 1)  # the same size class: the block given back
    assert again.numel() == 4000 and again.dtype == torch.uint8 and p.stats().hits == 1
    p.give(again.view(torch.float32).view(10, 100), CPU, 1)
    assert p.stats().in_use_bytes == 0


def test_pool_refuses_foreign_or_twice_given_buffers():
    p = StagingPool(1 << 20)
    with pytest.raises(ValueError, match="not a block handed out by this StagingPool"):
        p.give(torch.empty(16, dtype=torch.uint8), CPU, 1)
    b = p.take(64, CPU, 1)
    with pytest.raises(ValueError, match="stream_key"):
        p.give(b, CPU, 2)
    p.give(b, CPU, 1)
    with pytest.raises(ValueError, match="given back already"):
        p.give(b, CPU, 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.sampled_from(DTYPES), st.integers(1, 4)), min_size=1, max_size=12))
def test_pool_views_round_trip(requests):
    """Any sequence of take -> dtype view -> reshape -> give leaves nothing in use, and every
    block handed out is as large as asked, whatever was given back before."""
    p = StagingPool(1 << 16)
    held = []
    for n, dtype, cols in requests:
        esize = torch.empty((), dtype=dtype).element_size()
        count = (n // (esize * cols)) * cols
        raw = p.take(count * esize, CPU, "s")
        assert raw.dtype == torch.uint8 and raw.numel() == count * esize
        view = raw.view(dtype).view(-1, cols) if count else raw.view(dtype)
        held.append(view)
        if len(held) > 2:
            p.give(held.pop(0), CPU, "s")
    for v in held:
        p.give(v, CPU, "s")
    s = p.stats()
    assert s.in_use_bytes == 0 and s.cached_bytes <= s.capacity_bytes


def test_pool_ten_thousand_calls_bounded():
    rng = random.Random(14)
    p = StagingPool(1 << 20)
    held = []
    peak_in_use = 0
    for _ in range(10_000):
        dtype = rng.choice(DTYPES)
        esize = torch.empty((), dtype=dtype).element_size()
        rows, cols = rng.randint(0, 64), rng.choice([1, 5, 40, 128, 300])
        buf = p.take(rows * cols * esize, CPU, rng.randint(0, 1)).view(dtype).view(rows, cols)
        held.append((buf, buf.untyped_storage().data_ptr()))
        if len(held) > 3 or rng.random() < 0.5:
            b, _ = held.pop(rng.randrange(len(held)))
            p.give(b, CPU, _stream_of(p, b))
        peak_in_use = max(peak_in_use, p.stats().in_use_bytes)
    for b, _ in held:
        p.give(b, CPU, _stream_of(p, b))
    s = p.stats()
    assert s.in_use_bytes == 0 and s.cached_bytes <= (1 << 20)
    assert peak_in_use <= 4 * 262144  # at most 4 held, each at most 64 * 300 * 8 bytes, in a 256 KiB class
    assert s.hits > 9000, s  # the size classes are reused, not leaked


def _stream_of(p: StagingPool, b: torch.Tensor):
    return p._out[b.untyped_storage().data_ptr()][1][1]


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(validate="no"), TypeError, "validate must be True, False or None"),
    (dict(validate=1), TypeError, "validate must be True, False or None"),
    (dict(pool_bytes=-1), ValueError, "pool_bytes must be >= 0"),
    (dict(pool_bytes="1M"), TypeError, "pool_bytes must be an int"),
    (dict(pool_bytes=1.5), TypeError, "pool_bytes must be an int"),
    (dict(pool_bytes=True), TypeError, "pool_bytes must be an int"),
])
def test_init_argument_types(kwargs, exc, words):
    import moecomm

    with pytest.raises(exc, match=words.replace("(", r"\(")):
        moecomm.init(backend="mpi", set_default=False, **kwargs)


def test_init_accepts_bools_and_pool_bytes():
    import moecomm

    c = moecomm.init(backend="mpi", set_default=False, validate=True, pool_bytes=0)
    assert c.validate is True and c.pool_stats().capacity_bytes == 0
    c.close()


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
@pytest.mark.ranks_job("tests.ranks.nothing_lost", timeout=120, env={"MOECOMM_TIMEOUT": "30"})
def test_ranks_nothing_lost(nprocs, ranks_job):  # in the shared launch of its world size (tests/conftest.py)
    assert f"checks passed on {nprocs} ranks" in ranks_job()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ranks_nothing_lost_nccl():
    out = run_ranks(2, "tests.ranks.nothing_lost_gpu", timeout=300, env={"NCCL_NVLS_ENABLE": "0"})
    assert "checks passed on 2 ranks" in out


# -- finding 7: clear errors, on one rank (no peers needed) -----------------------------------


@pytest.fixture(scope="module")
def comm1():
    import moecomm

    c = moecomm.init(backend="mpi", timeout=30, set_default=False)
    yield c


def test_conjugate_and_negative_views_are_resolved(comm1):
    z = torch.randn(4, 3, dtype=torch.complex64)
    out, recv = comm1.all_to_all_v(z.conj(), [4])
    assert recv == [4] and torch.equal(out, z.conj().resolve_conj())
    neg = z.conj().imag  # a negative view
    assert neg.is_neg()
    out, _ = comm1.all_to_all_v(neg, [4])
    assert torch.equal(out, -z.imag)
    y = torch.empty(4, 3, dtype=torch.complex64)
    with pytest.raises(ValueError, match="output is a conjugate view"):
        comm1.all_to_all_single(y.conj(), z)
    comm1.all_to_all_single(y, z.conj())
    assert torch.equal(y, z.conj().resolve_conj())


def test_huge_recv_splits_named(comm1):
    with pytest.raises(ValueError, match=r"recv_splits sums to .* beyond the .* rows \(2\*\*62 bytes\)"):
        comm1.all_to_all_v(torch.zeros(2, 3), [2], [2**62 + 2])


def test_all_to_all_single_wrong_output_named(comm1):
    with pytest.raises(ValueError, match=r"^output \(shape \(6, 3\)\) must hold"):
        comm1.all_to_all_single(torch.empty(6, 3), torch.zeros(4, 3))


def test_functional_comm_type(comm1):
    import moecomm.functional as F

    with pytest.raises(TypeError, match="comm must be a moecomm.Communicator"):
        F.all_to_all_v(torch.zeros(2, 3), [2], comm="world")


def test_sparse_input_named(comm1):
    sp = torch.zeros(4, 3).to_sparse()
    with pytest.raises(TypeError, match="input is a sparse tensor"):
        comm1.all_to_all_v(sp, [4])


def test_requires_grad_warns_once(comm1):
    import warnings

    x = torch.zeros(2, 3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            comm1.all_to_all_v(x, [2])
        with torch.no_grad():
            comm1.all_to_all_v(x, [2])
        comm1.all_to_all_v(x.detach(), [2])
    msgs = [str(w.message) for w in caught if "not differentiable" in str(w.message)]
    assert len(msgs) == 1 and "moecomm.functional" in msgs[0]


# -- issue 34, item 7: our errors, not torch's -------------------------------------------------


@pytest.mark.parametrize("arg", ["send_splits", "recv_splits"])
def test_meta_counts_named(comm1, arg):
    meta = torch.tensor([2], device="meta")
    kw = {"send_splits": [2], "recv_splits": [2]}
    kw[arg] = meta
    with pytest.raises(ValueError, match=f"^{arg} is a tensor on the meta device"):
        comm1.all_to_all_v(torch.zeros(2, 3), **kw)


def test_recv_splits_that_cannot_be_allocated_named(comm1):
    with pytest.raises(ValueError, match=r"^recv_splits sums to 35184372088832 rows .* cannot be allocated"):
        comm1.all_to_all_v(torch.zeros(2, 3), [2], [2**45])
