"""moecomm.quant against an independent numpy reference (its own FP8 encoder), native vs torch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecomm import quant

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WIRES = [torch.float8_e4m3fn, torch.float8_e5m2]


# -- an FP8 codec written from the formats' definitions (no torch casts) ----------------------

def _fp8_table(wire: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative finite values of the format, ascending, and their codes."""
    ebits, mbits, bias = (4, 3, 7) if wire == torch.float8_e4m3fn else (5, 2, 15)
    vals, codes = [], []
    for code in range(128):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        if wire == torch.float8_e4m3fn and e == 15 and m == 7:
            continue  # NaN
        if wire == torch.float8_e5m2 and e == 31:
            continue  # inf / NaN
        v = (m / (1 << mbits)) * 2.0 ** (1 - bias) if e == 0 else (1 + m / (1 << mbits)) * 2.0 ** (e - bias)
        vals.append(v)
        codes.append(code)
    order = np.argsort(vals)
    return np.asarray(vals)[order], np.asarray(codes)[order]


def _encode(v: np.ndarray, wire: torch.dtype) -> np.ndarray:
    """Round to nearest, ties to the even code; values are within range (at most a rounding above max)."""
    vals, codes = _fp8_table(wire)
    a = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo = hi - 1
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi] % 2 == 0))
    idx = np.where(a >= vals[-1], len(vals) - 1, np.where(pick_hi, hi, lo))
    assert np.all(a <= vals[-1] * 1.0001), "value out of the format's range"
    return (codes[idx] | (np.signbit(v) * 128)).astype(np.uint8)


def _decode(c: np.ndarray, wire: torch.dtype) -> np.ndarray:
    vals, codes = _fp8_table(wire)
    lut = np.zeros(128)
    lut[codes] = vals
    return np.where(c & 128, -1.0, 1.0) * lut[c & 127]


def _to_dtype_bits(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 values -> the bits of ``dtype`` (round to nearest even), as int64."""
    v = v.astype(np.float32)
    if dtype == torch.float32:
        return v.view(np.int32).astype(np.int64)
    if dtype == torch.float16:
        return v.astype(np.float16).view(np.int16).astype(np.int64)
    u = v.view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16).view(np.int16).astype(np.int64)


def _bits(t: torch.Tensor) -> np.ndarray:
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype]
    return t.contiguous().view(view).numpy().astype(np.int64)


def numpy_reference(x: torch.Tensor, wire: torch.dtype, block: int):
    """(q codes [N, D] uint8, scales [N, nb] float32, dequantized bits in x.dtype [N, D])."""
    n = x.shape[0]
    xf = x.float().reshape(n, math.prod(x.shape[1:])).numpy()
    d = xf.shape[1]
    nb = -(-d // block)
    fmax = np.float32(448.0 if wire == torch.float8_e4m3fn else 57344.0)
    codes = np.zeros((n, d), np.uint8)
    scales = np.zeros((n, nb), np.float32)
    back = np.zeros((n, d), np.float32)
    for r in range(n):
        for k in range(nb):
            blk = xf[r, k * block:(k + 1) * block]
            amax = np.float32(np.max(np.abs(blk)))
            s = np.float32(1.0) if amax == 0 else np.float32(amax / fmax)
            scales[r, k] = s
            c = _encode(np.float32(blk / s), wire)
            codes[r, k * block:(k + 1) * block] = c
            back[r, k * block:(k + 1) * block] = (_decode(c, wire).astype(np.float32) * s).astype(np.float32)
    return codes, scales, _to_dtype_bits(back, x.dtype)


def _make(seed: int, n: int, d: int, dtype: torch.dtype, zero_frac: float, block: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (torch.rand(n, 1, generator=g) * 6 - 3)
    x = torch.randn(n, d, generator=g) * mag
    x[:, ::7] *= 30  # outliers
    nb = -(-d // block)
    zero = torch.rand(n, nb, generator=g) < zero_frac
    x = x * (~zero).repeat_interleave(block, dim=1)[:, :d]
    big = torch.finfo(dtype).max  # finite inputs only (float16's outliers would overflow to inf: undefined)
    return x.clamp(-big, big).to(dtype)


def _check_against_numpy(x: torch.Tensor, wire: torch.dtype, block: int, use_native) -> None:
    codes, scales, back = numpy_reference(x, wire, block)
    q, s = quant.quantize_rows(x, wire, block, use_native=use_native)
    n = x.shape[0]
    assert q.dtype == wire and q.shape == x.shape and s.dtype == torch.float32
    d = math.prod(x.shape[1:])
    np.testing.assert_array_equal(q.view(torch.uint8).reshape(n, d).numpy(), codes)
    np.testing.assert_array_equal(s.numpy(), scales)
    y = quant.dequantize_rows(q, s, x.dtype, block, use_native=use_native)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(_bits(y.reshape(n, d)), back)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 4),
       d=st.sampled_from([1, 5, 16, 100, 127, 128, 129, 200, 256, 300]),
       block=st.sampled_from([16, 48, 128]), dtype=st.sampled_from(DTYPES), wire=st.sampled_from(WIRES),
       zero_frac=st.sampled_from([0.0, 0.3, 1.0]), native=st.booleans())
def test_matches_numpy_reference(seed, n, d, block, dtype, wire, zero_frac, native):
    x = _make(seed, n, d, dtype, zero_frac, block)
    _check_against_numpy(x, wire, block, native)


def test_trailing_shape_and_signed_zero():
    x = torch.randn(3, 4, 50)
    x[1, 2, 5] = -0.0
    x[2] = 0.0
    for native in (False, True):
        _check_against_numpy(x, torch.float8_e4m3fn, 128, native)
    q, s = quant.quantize_rows(x, torch.float8_e4m3fn)
    assert q.shape == (3, 4, 50) and s.shape == (3, 2)
    assert torch.all(s[2] == 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wire", WIRES)
def test_native_matches_torch_reference(dtype, wire):
    x = (torch.randn(257, 1000) * torch.logspace(-3, 3, 257).unsqueeze(1)).to(dtype)
    x[5, 128:256] = 0
    q1, s1 = quant.quantize_rows(x, wire, use_native=True)
    q2, s2 = quant.quantize_rows_reference(x, wire)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    y1 = quant.dequantize_rows(q1, s1, dtype, use_native=True)
    assert torch.equal(y1, quant.dequantize_rows_reference(q2, s2, dtype))
    p1 = quant.pack_rows(x, wire, use_native=True)
    p2 = quant.pack_rows(x, wire, use_native=False)
    assert p1.shape == (257, quant.packed_row_bytes(1000)) and torch.equal(p1, p2)
    assert torch.equal(quant.unpack_rows(p1, (1000,), dtype, wire, use_native=True), y1)
    assert torch.equal(quant.unpack_rows(p1, (1000,), dtype, wire, use_native=False), y1)


def test_packed_layout():
    assert quant.packed_row_bytes(0) == 0
    assert quant.packed_row_bytes(1) == 16  # 1 byte, pad to 4, 1 scale -> 8 -> 16
    assert quant.packed_row_bytes(128) == 144  # 128 + 4 -> 144
    assert quant.packed_row_bytes(2048) == 2048 + 64
    assert quant.packed_row_bytes(130, 16) == 132 + 36 + 8  # 9 scales, to 176
    x = torch.randn(2, 5)
    p = quant.pack_rows(x, torch.float8_e5m2, use_native=True)
    q, s = quant.quantize_rows(x, torch.float8_e5m2)
    assert torch.equal(p[:, :5], q.view(torch.uint8))
    assert torch.all(p[:, 5:8] == 0) and torch.all(p[:, 12:] == 0)
    assert torch.equal(p[:, 8:12].contiguous().view(torch.float32), s)


@pytest.mark.parametrize("native", [True, False])
def test_pack_rows_into_writes_the_packed_rows_then_zeros(native):
    """pack_rows_into: pack_rows' bytes in a wider row, zeros after them (whatever was there),
    the same tensor returned."""
    x = torch.randn(3, 300).to(torch.bfloat16)
    want = quant.pack_rows(x, torch.float8_e4m3fn, use_native=False)
    out = torch.full((3, want.shape[1] + 32), 7, dtype=torch.uint8)
    assert quant.pack_rows_into(x, torch.float8_e4m3fn, out, use_native=native) is out
    assert torch.equal(out[:, :want.shape[1]], want) and not out[:, want.shape[1]:].any()


def test_bad_input():
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match="x"):
        quant.quantize_rows(torch.ones(2, 8, dtype=torch.int32), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="x"):
        quant.quantize_rows(x.double(), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="wire_dtype"):
        quant.quantize_rows(x, torch.bfloat16)
    with pytest.raises(TypeError, match="block"):
        quant.quantize_rows(x, torch.float8_e4m3fn, block=16.0)
    for bad in (0, -16, 24, 100):
        with pytest.raises(ValueError, match="block"):
            quant.quantize_rows(x, torch.float8_e4m3fn, block=bad)
    with pytest.raises(ValueError, match="x"):
        quant.quantize_rows(torch.tensor(1.0), torch.float8_e4m3fn)
    q, s = quant.quantize_rows(x, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="q"):
        quant.dequantize_rows(q.view(torch.uint8), s, torch.float32)
    with pytest.raises(TypeError, match="scales"):
        quant.dequantize_rows(q, s.double(), torch.float32)
    with pytest.raises(ValueError, match="scales"):
        quant.dequantize_rows(q, s[:, :0], torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        quant.dequantize_rows(q, s, torch.int8)
    with pytest.raises(ValueError, match="block"):
        quant.dequantize_rows(q, s, torch.float32, block=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("d, shift", [(2100, 0), (2048, 0), (1160, 0), (2048, 8)])
def test_cuda_kernels_match_reference(dtype, wire, d, shift):
    """Rows the 8-wide kernels take (D a multiple of 8, aligned: 2048, and 1160 whose last block
    has 8 elements) and rows the element-wise kernels take (2100; rows moved off 16-byte
    alignment by ``shift`` elements)."""
    from moecomm_ext._quant import quant_module

    assert quant_module("cuda", True) is not None, "the CUDA quantization extension did not build"
    x = (torch.randn(513, d) * torch.logspace(-3, 3, 513).unsqueeze(1)).to(dtype)
    x[7, 256:384] = 0
    codes, scales, back = numpy_reference(x[:40], wire, 128)
    xc = torch.empty(513 * d + shift, dtype=dtype, device="cuda")[shift:].view(513, d)
    xc.copy_(x)
    for native in (True, False):
        q, s = quant.quantize_rows(xc, wire, use_native=native)
        np.testing.assert_array_equal(q[:40].view(torch.uint8).cpu().numpy(), codes)
        np.testing.assert_array_equal(s[:40].cpu().numpy(), scales)
        q_cpu, s_cpu = quant.quantize_rows_reference(x, wire)
        assert torch.equal(q.view(torch.uint8).cpu(), q_cpu.view(torch.uint8)) and torch.equal(s.cpu(), s_cpu)
        y = quant.dequantize_rows(q, s, dtype, use_native=native)
        np.testing.assert_array_equal(_bits(y[:40].cpu()), back)
        p = quant.pack_rows(xc, wire, use_native=native)
        assert torch.equal(p.cpu(), quant.pack_rows(x, wire, use_native=False))
        assert torch.equal(quant.unpack_rows(p, (d,), dtype, wire, use_native=native), y)


@pytest.mark.parametrize("wire", WIRES)
def test_native_codec_on_many_bit_patterns(wire):
    """Blocks whose amax is FP8_MAX have scale 1, so the kernel's encoder sees the values
    themselves: random float32 bit patterns of every exponent in range (and every FP8 code
    back), native against torch's own casts."""
    fmax = quant.FP8_MAX[wire]
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    v = bits.view(torch.float32)
    v = torch.where(v.isfinite() & (v.abs() <= fmax), v, torch.ldexp(v.abs().clamp(max=1.0).nan_to_num(0.5),
                                                                        -torch.randint(0, 30, v.shape, generator=g)))
    v = v * torch.where(torch.rand(v.shape, generator=g) < 0.5, -1.0, 1.0)
    x = v[: (v.numel() // 127) * 127].reshape(-1, 127)
    x = torch.cat([torch.full((x.shape[0], 1), fmax), x], dim=1)  # amax = FP8_MAX: scale 1
    q, s = quant.quantize_rows(x, wire, use_native=True)
    assert torch.all(s == 1.0)
    assert torch.equal(q.view(torch.uint8), x.to(wire).view(torch.uint8))
    codes = torch.arange(256, dtype=torch.uint8).view(wire)
    codes = codes[codes.float().isfinite()].reshape(1, -1)
    ones = torch.ones(1, quant.num_blocks(codes.shape[1]))
    for dtype in DTYPES:
        assert torch.equal(quant.dequantize_rows(codes, ones, dtype, use_native=True), codes.float().to(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("block, d", [(16, 520), (256, 520), (128, 64), (256, 2048)])
def test_cuda_blocks_other_than_the_wire(block, d):
    """Blocks other than 128 take the general 8-wide kernel (128: the one that holds a block
    in registers; d = 64, one short block): against the torch reference, gathered too."""
    for dtype in DTYPES:
        x = (torch.randn(37, d) * torch.logspace(-3, 3, 37).unsqueeze(1)).to(dtype)
        for wire in WIRES:
            q, s = quant.quantize_rows(x.cuda(), wire, block, use_native=True)
            q_ref, s_ref = quant.quantize_rows_reference(x, wire, block)
            assert torch.equal(q.view(torch.uint8).cpu(), q_ref.view(torch.uint8)) and torch.equal(s.cpu(), s_ref)
            back = quant.dequantize_rows(q, s, dtype, block, use_native=True)
            assert torch.equal(back.cpu(), quant.dequantize_rows_reference(q_ref, s_ref, dtype, block))


def _codec_values(wire: torch.dtype) -> torch.Tensor:
    """Values to encode with scale 1: every rounding midpoint between neighbouring FP8 values
    and the float32 values up to 2 ulps either side (ties go to even), every FP8 value,
    random float32 patterns of every exponent in range; both signs."""
    fmax = quant.FP8_MAX[wire]
    fp8 = torch.arange(256, dtype=torch.uint8).view(wire).float()
    pos = fp8[fp8.isfinite() & (fp8 >= 0)].unique()  # sorted
    mids = (pos[:-1] + pos[1:]) / 2  # exact in float32
    near = (mids.view(torch.int32)[:, None] + torch.arange(-2, 3, dtype=torch.int32)).view(torch.float32)
    g = torch.Generator().manual_seed(5)
    rand = torch.ldexp(torch.rand(20000, generator=g) + 1, torch.randint(-40, 9, (20000,), generator=g)).clamp(max=fmax)
    v = torch.cat([near.reshape(-1), pos, rand])
    v = v[v <= fmax]
    return torch.cat([v, -v])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("d", [128, 131])
def test_cuda_codec_matches_torch_casts(wire, d):
    """The CUDA encoder (the hardware conversion in the 8-wide kernels, d = 128; c10's in the
    element-wise ones, d = 131) on blocks of scale 1 (FP8_MAX at each block's start), against
    torch's own cast on the CPU; and every finite code decoded back."""
    fmax = quant.FP8_MAX[wire]
    v = _codec_values(wire)
    starts = list(range(0, d, 128))
    per_row = d - len(starts)
    v = torch.cat([v, v[: (-v.numel()) % per_row]])
    x = torch.empty(v.numel() // per_row, d)
    keep = torch.ones(d, dtype=torch.bool)
    keep[starts] = False
    x[:, ~keep] = fmax
    x[:, keep] = v.reshape(-1, per_row)
    q, s = quant.quantize_rows(x.cuda(), wire, use_native=True)
    assert torch.all(s == 1.0)
    assert torch.equal(q.view(torch.uint8).cpu(), x.to(wire).view(torch.uint8))
    codes = torch.arange(256, dtype=torch.uint8).view(wire)
    codes = codes[codes.float().isfinite()]
    codes = torch.cat([codes, codes[: (-codes.numel()) % 8]]).reshape(1, -1)  # a multiple of 8: the 8-wide kernel
    ones = torch.ones(1, quant.num_blocks(codes.shape[1]), device="cuda")
    for dtype in DTYPES:
        back = quant.dequantize_rows(codes.cuda(), ones, dtype, use_native=True)
        assert torch.equal(back.cpu(), codes.float().to(dtype))


@pytest.mark.parametrize("wire", WIRES)
def test_codec_values_cover_every_midpoint(wire):
    """The CUDA codec test's values: the CPU kernel agrees with torch's cast on them too."""
    fmax = quant.FP8_MAX[wire]
    v = _codec_values(wire)
    v = torch.cat([v, v[: (-v.numel()) % 127]]).reshape(-1, 127)
    x = torch.cat([torch.full((v.shape[0], 1), fmax), v], dim=1)
    q, s = quant.quantize_rows(x, wire, use_native=True)
    assert torch.all(s == 1.0) and torch.equal(q.view(torch.uint8), x.to(wire).view(torch.uint8))


@pytest.mark.parametrize("native", [True, False])
def test_empty_and_strided_rows(native):
    for shape in [(3, 0), (0, 5), (2, 0, 4)]:
        x = torch.empty(shape)
        q, s = quant.quantize_rows(x, torch.float8_e4m3fn, use_native=native)
        assert q.shape == shape and s.shape == (shape[0], quant.num_blocks(math.prod(shape[1:])))
        assert quant.dequantize_rows(q, s, torch.bfloat16, use_native=native).shape == shape
    x = torch.randn(4, 3, 140)[:, 1]  # not contiguous
    q, s = quant.quantize_rows(x, torch.float8_e5m2, use_native=native)
    q2, s2 = quant.quantize_rows_reference(x.contiguous(), torch.float8_e5m2)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


# -- the dispatch gather fused with the packing -----------------------------------------------

def _gather_case(seed: int, n: int, m: int, d: int, dtype: torch.dtype, scale_dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * torch.logspace(-2, 2, n).unsqueeze(1)).to(dtype)
    if n and d > 128:
        x[0, :128] = 0  # a zero block
    index = torch.randint(-1, max(n, 1), (m,), generator=g) if n else torch.full((m,), -1)
    scale = None if scale_dtype is None else (torch.rand(m, generator=g) * 3 - 1).to(scale_dtype)
    to = (lambda t: None if t is None else t.to(device))
    return x.to(device), index.to(device), to(scale)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 5), m=st.integers(0, 7),
       d=st.sampled_from([1, 100, 128, 129, 300]), dtype=st.sampled_from(DTYPES), wire=st.sampled_from(WIRES),
       scale_dtype=st.sampled_from([None, torch.float32, torch.bfloat16, torch.float64]))
def test_gather_pack_rows_matches_reference(seed, n, m, d, dtype, wire, scale_dtype):
    import moecomm_ext

    x, index, scale = _gather_case(seed, n, m, d, dtype, scale_dtype)
    want = quant.gather_pack_rows_reference(x, index, wire, scale=scale)
    assert want.shape == (m, quant.packed_row_bytes(d))
    # the reference is the composition it stands for
    gathered = moecomm_ext.gather_rows(x, index, scale, use_native=False)
    assert torch.equal(want, quant.pack_rows(gathered, wire, use_native=False))
    for native in (True, False):
        assert torch.equal(quant.gather_pack_rows(x, index, wire, scale=scale, use_native=native), want)
    # against what the layer does unfused: the native dispatch gather, then the native packing
    assert torch.equal(quant.pack_rows(moecomm_ext.gather_rows(x, index, scale, use_native=True), wire), want)


@pytest.mark.parametrize("native", [True, False])
def test_gather_pack_rows_bad_index(native):
    x = torch.randn(4, 130)
    with pytest.raises(ValueError, match=r"index has entries outside \[-1, 4\).*max = 4"):
        quant.gather_pack_rows(x, torch.tensor([0, 4]), torch.float8_e4m3fn, use_native=native)
    with pytest.raises(ValueError, match="index.*min = -2"):
        quant.gather_pack_rows(x, torch.tensor([-2]), torch.float8_e4m3fn, use_native=native)


def test_native_gather_checks_its_indices():
    """A direct call of the CPU kernel (no Python check before it) raises too, with a literal
    message (see quant_cpu.cpp's check_index)."""
    from moecomm_ext._quant import quant_module

    mod = quant_module("cpu", True)
    if mod is None:
        pytest.skip("the native CPU quantization extension is not built here")
    x = torch.randn(4, 130)
    with pytest.raises(RuntimeError, match="'index' has entries outside"):
        mod.gather_quantize_pack(x, torch.tensor([0, 4]), None, 0, 128, quant.packed_row_bytes(130))
    with pytest.raises(RuntimeError, match="row_bytes"):
        mod.quantize_pack(x, 0, 128, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("scale_dtype", [None, torch.float32, torch.bfloat16])
def test_cuda_gather_pack_rows_matches_reference(dtype, wire, scale_dtype):
    import moecomm_ext
    from moecomm_ext._quant import quant_module

    assert quant_module("cuda", True) is not None, "the CUDA quantization extension did not build"
    for seed, n, m, d in [(1, 300, 1000, 2048), (2, 7, 33, 129), (3, 5, 0, 64), (4, 0, 9, 300)]:
        x, index, scale = _gather_case(seed, n, m, d, dtype, scale_dtype, "cuda")
        want = quant.gather_pack_rows_reference(x.cpu(), index.cpu(), wire, scale=None if scale is None else scale.cpu())
        got = quant.gather_pack_rows(x, index, wire, scale=scale, use_native=True)
        assert got.is_cuda and torch.equal(got.cpu(), want)
        # the CUDA reference path and the unfused CUDA kernels give the same bytes
        assert torch.equal(quant.gather_pack_rows(x, index, wire, scale=scale, use_native=False).cpu(), want)
        unfused = quant.pack_rows(moecomm_ext.gather_rows(x, index, scale, use_native=True), wire)
        assert torch.equal(unfused.cpu(), want)
