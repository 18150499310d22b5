"""moecomm_ext kernels: native (CPU) against the pure-torch reference, and input validation."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moecomm_ext as me
from moecomm_ext import reference as ref

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
RAW = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.complex64]


@pytest.fixture(scope="module", autouse=True)
def native_cpu():
    """Build/load the CPU extension once; fail loudly if a compiler exists but the build fails."""
    mod = me.load_native("cpu")
    if mod is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is present but the native CPU extension failed to build")
        pytest.skip("no C++ compiler: native CPU kernels unavailable")
    return mod


def _rand(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def _index(n_rows, shape, gen, p_missing=0.2):
    if n_rows == 0:
        return torch.full(shape, -1, dtype=torch.int64)
    idx = torch.randint(0, n_rows, shape, generator=gen)
    return torch.where(torch.rand(shape, generator=gen) < p_missing, torch.full_like(idx, -1), idx)


def _close(actual, expected, dtype):
    # float16/bfloat16: one rounding of an fp32 value computed in another order
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-6, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# --------------------------------------------------------------------------
# native vs reference


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 17),
    d=st.integers(0, 19),
    m=st.integers(0, 23),
    dtype=st.sampled_from(FLOATS),
    scaled=st.booleans(),
    scale_dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_gather_rows_matches_reference(n, d, m, dtype, scaled, scale_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _rand((n, d), dtype, gen)
    index = _index(n, (m,), gen)
    scale = torch.randn(m, generator=gen).to(scale_dtype) if scaled else None
    out = me.gather_rows(x, index, scale, use_native=True)
    expected = ref.gather_rows(x, index, scale)
    assert out.dtype == dtype and out.shape == (m, d)
    # the same single multiply and rounding on both paths: bit-exact
    assert torch.equal(out, expected)
    assert torch.equal(out, me.gather_rows(x, index, scale, use_native=False))


@pytest.mark.parametrize("dtype", RAW + FLOATS)
def test_gather_rows_any_dtype_without_scale(dtype):
    gen = torch.Generator().manual_seed(1)
    x = _rand((9, 5), dtype, gen)
    index = torch.tensor([8, -1, 0, 3, 3, -1, 7], dtype=torch.int64)
    out = me.gather_rows(x, index, use_native=True)
    assert out.dtype == dtype
    assert torch.equal(out, ref.gather_rows(x, index))
    assert not out[1].any() and not out[5].any()
    assert torch.equal(out[0], x[8])


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(0, 17),
    d=st.integers(0, 19),
    t=st.integers(0, 13),
    k=st.integers(0, 4),
    dtype=st.sampled_from(FLOATS),
    weighted=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_gather_reduce_rows_matches_reference(m, d, t, k, dtype, weighted, seed):
    gen = torch.Generator().manual_seed(seed)
    y = _rand((m, d), dtype, gen)
    index = _index(m, (t, k), gen)
    weight = torch.rand(t, k, generator=gen) if weighted else None
    out = me.gather_reduce_rows(y, index, weight, use_native=True)
    assert out.dtype == dtype and out.shape == (t, d)
    _close(out, ref.gather_reduce_rows(y, index, weight), dtype)


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(0, 17),
    d=st.integers(0, 37),
    t=st.integers(0, 13),
    k=st.integers(0, 4),
    dtype=st.sampled_from(FLOATS),
    seed=st.integers(0, 2**31 - 1),
)
def test_gather_rowdot_matches_reference(m, d, t, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    a = _rand((t, d), dtype, gen)
    b = _rand((m, d), dtype, gen)
    index = _index(m, (t, k), gen)
    out = me.gather_rowdot(a, b, index, use_native=True)
    op = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.dtype == op and out.shape == (t, k)
    expected = ref.gather_rowdot(a, b, index)
    torch.testing.assert_close(out, expected, rtol=1e-5 if op == torch.float32 else 1e-12, atol=1e-5)
    assert not out[index == -1].any()


def test_large_rows_parallel_path():
    """Big enough for at::parallel_for to split the work across threads."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3000, 256, generator=gen).to(torch.bfloat16)
    index = _index(3000, (5000,), gen)
    scale = torch.rand(5000, generator=gen)
    assert torch.equal(me.gather_rows(x, index, use_native=True), ref.gather_rows(x, index))
    assert torch.equal(me.gather_rows(x, index, scale, use_native=True), ref.gather_rows(x, index, scale))
    idx2 = _index(3000, (2500, 2), gen)
    w = torch.rand(2500, 2, generator=gen)
    _close(me.gather_reduce_rows(x, idx2, w, use_native=True), ref.gather_reduce_rows(x, idx2, w), torch.bfloat16)
    a = torch.randn(2500, 256, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(
        me.gather_rowdot(a, x, idx2, use_native=True), ref.gather_rowdot(a, x, idx2), rtol=1e-5, atol=1e-4
    )


def test_noncontiguous_inputs():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 12, generator=gen)[:, ::2]  # [7, 6], strided
    index = torch.tensor([[6, -1], [0, 2], [1, 1]])
    assert torch.equal(me.gather_rows(x, index[:, 0], use_native=True), ref.gather_rows(x, index[:, 0]))
    w = torch.rand(2, 3, generator=gen).t()  # [3, 2], transposed
    _close(me.gather_reduce_rows(x, index, w, use_native=True), ref.gather_reduce_rows(x, index, w), torch.float32)
    a = torch.randn(6, 3, generator=gen).t()
    torch.testing.assert_close(me.gather_rowdot(a, x, index, use_native=True), ref.gather_rowdot(a, x, index))


def test_zero_sizes():
    for n, d, m in [(0, 4, 0), (0, 4, 3), (5, 0, 3), (5, 4, 0), (0, 0, 0)]:
        x = torch.randn(n, d)
        index = torch.full((m,), -1, dtype=torch.int64) if n == 0 else torch.zeros(m, dtype=torch.int64)
        out = me.gather_rows(x, index, torch.ones(m), use_native=True)
        assert out.shape == (m, d) and not out.any()
    for m, d, t, k in [(0, 3, 0, 2), (4, 3, 0, 2), (4, 0, 3, 2), (4, 3, 3, 0), (0, 3, 2, 1)]:
        y = torch.randn(m, d)
        index = torch.full((t, k), -1, dtype=torch.int64)
        out = me.gather_reduce_rows(y, index, torch.ones(t, k), use_native=True)
        assert out.shape == (t, d) and not out.any()
        a = torch.randn(t, d)
        dots = me.gather_rowdot(a, y, index, use_native=True)
        assert dots.shape == (t, k) and not dots.any()


def test_minus_one_rows_are_zero_even_if_source_has_nan():
    x = torch.tensor([[float("nan"), 1.0], [2.0, 3.0]])
    index = torch.tensor([-1, 1, -1])
    out = me.gather_rows(x, index, torch.tensor([float("inf")] * 3), use_native=True)
    assert torch.equal(out[0], torch.zeros(2)) and torch.equal(out[2], torch.zeros(2))
    red = me.gather_reduce_rows(x, torch.tensor([[-1, 1]]), torch.tensor([[5.0, 1.0]]), use_native=True)
    assert torch.equal(red, torch.tensor([[2.0, 3.0]]))


# --------------------------------------------------------------------------
# validation: errors name the argument


@pytest.mark.parametrize("use_native", [True, False])
def test_gather_rows_bad_inputs(use_native):
    x = torch.randn(5, 3)
    idx = torch.tensor([0, 4, -1])
    cases = [
        (dict(x=torch.randn(5), index=idx), ValueError, "'x'"),
        (dict(x=x, index=idx.int()), TypeError, "'index'"),
        (dict(x=x, index=idx.view(3, 1)), ValueError, "'index'"),
        (dict(x=x, index=torch.tensor([0, 5])), ValueError, "'index'"),
        (dict(x=x, index=torch.tensor([-2, 1])), ValueError, "'index'"),
        (dict(x=x, index=idx, scale=torch.ones(4)), ValueError, "'scale'"),
        (dict(x=x, index=idx, scale=torch.ones(3, dtype=torch.int32)), TypeError, "'scale'"),
        (dict(x=x.int(), index=idx, scale=torch.ones(3)), TypeError, "'x'"),
        (dict(x=[[1.0]], index=idx), TypeError, "'x'"),
    ]
    for kwargs, exc, name in cases:
        with pytest.raises(exc, match=name):
            me.gather_rows(**kwargs, use_native=use_native)


def test_out_of_range_message_details():
    with pytest.raises(ValueError, match=r"'index'.*\[-1, 5\).*max = 7"):
        me.gather_rows(torch.randn(5, 3), torch.tensor([7, 0]))


def test_native_kernel_checks_range_even_without_host_check():
    with pytest.raises(IndexError, match="out of range"):
        me.gather_rows(torch.randn(5, 3), torch.tensor([0, 9]), check=False, use_native=True)
    with pytest.raises(IndexError, match="'index' entry 1 .* = 9 is out of range"):
        me.gather_reduce_rows(torch.randn(5, 3), torch.tensor([[0, 9]]), check=False, use_native=True)
    with pytest.raises(IndexError, match="out of range"):
        me.gather_rowdot(torch.randn(1, 3), torch.randn(5, 3), torch.tensor([[-3, 0]]), check=False, use_native=True)
    with pytest.raises(IndexError, match="out of range"):
        me.gather_rows(torch.randn(5, 3), torch.tensor([0, 5]), torch.ones(2), check=False, use_native=True)


@pytest.mark.parametrize("use_native", [True, False])
def test_gather_reduce_rows_bad_inputs(use_native):
    y = torch.randn(6, 4)
    idx = torch.tensor([[0, 5], [-1, 2]])
    cases = [
        (dict(y=y[0], index=idx), ValueError, "'y'"),
        (dict(y=y.long(), index=idx), TypeError, "'y'"),
        (dict(y=y, index=idx[0]), ValueError, "'index'"),
        (dict(y=y, index=idx.float()), TypeError, "'index'"),
        (dict(y=y, index=idx + 1), ValueError, "'index'"),
        (dict(y=y, index=idx, weight=torch.ones(2, 3)), ValueError, "'weight'"),
        (dict(y=y, index=idx, weight=torch.ones(2, 2, dtype=torch.int64)), TypeError, "'weight'"),
    ]
    for kwargs, exc, name in cases:
        with pytest.raises(exc, match=name):
            me.gather_reduce_rows(**kwargs, use_native=use_native)


@pytest.mark.parametrize("use_native", [True, False])
def test_gather_rowdot_bad_inputs(use_native):
    a = torch.randn(2, 4)
    b = torch.randn(6, 4)
    idx = torch.tensor([[0, 5], [-1, 2]])
    cases = [
        (dict(a=a[0], b=b, index=idx), ValueError, "'a'"),
        (dict(a=a, b=b[:, :3], index=idx), ValueError, "'b'"),
        (dict(a=a, b=b.double(), index=idx), TypeError, "'b'"),
        (dict(a=a, b=b, index=idx[:1]), ValueError, "'index'"),
        (dict(a=a, b=b, index=idx.int()), TypeError, "'index'"),
        (dict(a=a, b=b, index=idx * 2), ValueError, "'index'"),
    ]
    for kwargs, exc, name in cases:
        with pytest.raises(exc, match=name):
            me.gather_rowdot(**kwargs, use_native=use_native)


def test_raw_kernels_refuse_inputs_that_require_grad():
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="'x'.*dispatch"):
        me.gather_rows(x, torch.tensor([0]))
    with torch.no_grad():
        assert me.gather_rows(x, torch.tensor([0])).shape == (1, 3)


def test_implementation_reports_native():
    assert me.native_available("cpu", use_native=True)
    assert me.implementation("cpu", use_native=True) == "native"
    assert me.implementation("cpu", use_native=False) == "reference"
    with pytest.raises(ValueError, match="'device_type'"):
        me.implementation("tpu")
