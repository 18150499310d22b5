"""FP8 row quantization with per-block float32 scales: the rule of ``wire_dtype`` exchanges.

Each row of ``x`` (``[N, *row_shape]``, flattened to ``D`` elements per row) is cut into
blocks of ``block`` elements (the last block of a row may be shorter). Per block:

* ``amax = max |x|`` in float32;
* ``scale = amax / FP8_MAX`` (an IEEE float32 division; ``FP8_MAX`` is 448 for
  ``torch.float8_e4m3fn`` and 57344 for ``torch.float8_e5m2``), and ``scale = 1`` where
  ``amax == 0``;
* ``q = (x.float() / scale).to(wire_dtype)`` (torch's cast: round to nearest even; values
  are within range by construction);
* back: ``(q.float() * scale).to(dtype)``.

Non-finite inputs give undefined results (``Communicator.all_to_all_v(..., validate=True)``
refuses them). So do blocks whose ``amax`` is so small (below about ``1e-36``) that
``amax / FP8_MAX`` underflows to zero.

:func:`quantize_rows` / :func:`dequantize_rows` run the native kernels of
:mod:`moecomm_ext` (C++ on the CPU, CUDA on the GPU) when they can be built, else the
pure-torch reference of this module (:func:`quantize_rows_reference`,
:func:`dequantize_rows_reference`); both give the same bits.

The *packed* form (:func:`pack_rows` / :func:`unpack_rows`) is what ``wire_dtype``
exchanges send (:func:`gather_pack_rows`: the MoE dispatch gather and the packing in one
pass): one ``uint8`` row per input row holding the row's ``D`` FP8 bytes, zero
bytes up to a multiple of 4, its ``ceil(D / block)`` float32 scales (native byte order),
and zero bytes up to a multiple of 16 (the peer-memory transport moves 16-byte vectors).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = [
    "FP8_MAX",
    "WIRE_DTYPES",
    "INPUT_DTYPES",
    "WIRE_BLOCK",
    "quantize_rows",
    "dequantize_rows",
    "quantize_rows_reference",
    "dequantize_rows_reference",
    "num_blocks",
    "packed_row_bytes",
    "pack_rows",
    "pack_rows_into",
    "gather_pack_rows",
    "gather_pack_rows_reference",
    "unpack_rows",
    "check_wire_dtype",
    "GRAD_WIRE_DTYPES",
    "check_grad_wire_dtype",
    "check_block",
]

FP8_MAX: dict = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
"""Largest finite value of each wire dtype."""

WIRE_DTYPES: tuple = tuple(FP8_MAX)
"""The FP8 dtypes rows may be sent in."""

INPUT_DTYPES: tuple = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes that can be quantized (and that dequantization produces)."""

WIRE_BLOCK = 128
"""Elements per scale block of a ``wire_dtype`` exchange (:mod:`moecomm.wire`, the overlap
pipeline's stages, the MoE layer's dispatch); also ``moecomm.wire.WIRE_BLOCK``."""

_PACK_ALIGN = 16


def check_wire_dtype(wire_dtype: object, name: str = "wire_dtype") -> torch.dtype:
    """``wire_dtype`` if it is one of :data:`WIRE_DTYPES`, else ``TypeError`` naming ``name``."""
    if wire_dtype not in FP8_MAX:
        raise TypeError(f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {wire_dtype!r}")
    return wire_dtype  # type: ignore[return-value]


GRAD_WIRE_DTYPES: tuple = WIRE_DTYPES + INPUT_DTYPES
"""The dtypes a gradient may travel in (``grad_wire_dtype``): an FP8 dtype (block-scaled, as
``wire_dtype``) or a floating dtype the gradient is cast to for the exchange and back."""


def check_grad_wire_dtype(grad_wire_dtype: object, name: str = "grad_wire_dtype") -> Optional[torch.dtype]:
    """``grad_wire_dtype`` if it is None or one of :data:`GRAD_WIRE_DTYPES`, else
    ``TypeError`` naming ``name``."""
    if grad_wire_dtype is not None and grad_wire_dtype not in GRAD_WIRE_DTYPES:
        raise TypeError(f"{name} must be None, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, "
                        f"torch.float16 or torch.float32, got {grad_wire_dtype!r}")
    return grad_wire_dtype  # type: ignore[return-value]


def check_block(block: object, name: str = "block") -> int:
    """``block`` if it is a positive multiple of 16, else ``TypeError``/``ValueError``."""
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"{name} must be an int (a positive multiple of 16), got {block!r}")
    if block <= 0 or block % 16:
        raise ValueError(f"{name} must be a positive multiple of 16, got {block}")
    return block


def _check_input_dtype(dtype: object, name: str, what: str) -> None:
    if dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be {what} float32, bfloat16 or float16, got {dtype!r}")


def _check_rows(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dimension (rows along dim 0), got shape {tuple(x.shape)}")
    return x


def num_blocks(row_elems: int, block: int = 128) -> int:
    """Scale blocks per row of ``row_elems`` elements: ``ceil(row_elems / block)``."""
    return -(-row_elems // block)


def packed_row_bytes(row_elems: int, block: int = 128) -> int:
    """Bytes of one packed row (see the module docstring): a multiple of 16, 0 for empty rows."""
    if row_elems == 0:
        return 0
    scale_offset = -(-row_elems // 4) * 4
    end = scale_offset + 4 * num_blocks(row_elems, block)
    return -(-end // _PACK_ALIGN) * _PACK_ALIGN


def _native(device_type: str, use_native: Optional[bool]):
    from moecomm_ext._quant import quant_module

    return quant_module(device_type, use_native)


# -- the pure-torch reference -------------------------------------------------------------

def _blocked(x2: torch.Tensor, block: int) -> torch.Tensor:
    """``[N, D]`` float32 -> ``[N, nb, block]`` with zeros after each row's end."""
    n, d = x2.shape
    nb = num_blocks(d, block)
    if nb * block != d:
        x2 = torch.nn.functional.pad(x2, (0, nb * block - d))
    return x2.reshape(n, nb, block)


def quantize_rows_reference(x: torch.Tensor, wire_dtype: torch.dtype, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` in plain torch (no validation): the reference of the kernels."""
    n, d = x.shape[0], math.prod(x.shape[1:])
    xb = _blocked(x.reshape(n, d).float(), block)
    amax = xb.abs().amax(dim=2) if d else torch.zeros(n, 0, device=x.device)
    # A tensor divisor: torch divides by a CPU scalar as a multiplication by its reciprocal on CUDA.
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, FP8_MAX[wire_dtype]))
    q = (xb / scale.unsqueeze(2)).to(wire_dtype).reshape(n, xb.shape[1] * block)[:, :d]
    return q.reshape(x.shape), scale


def dequantize_rows_reference(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int = 128) -> torch.Tensor:
    """:func:`dequantize_rows` in plain torch (no validation): the reference of the kernels."""
    n, d = q.shape[0], math.prod(q.shape[1:])
    qb = _blocked(q.reshape(n, d).float(), block)
    out = (qb * scales.unsqueeze(2)).reshape(n, qb.shape[1] * block)[:, :d].to(dtype)
    return out.reshape(q.shape)


# -- the public functions -----------------------------------------------------------------

def quantize_rows(
    x: torch.Tensor, wire_dtype: torch.dtype, block: int = 128, *, use_native: Optional[bool] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` to ``wire_dtype`` with one float32 scale per block.

    Args:
        x: ``[N, *row_shape]`` float32, bfloat16 or float16, on the CPU or a GPU; each row is
            flattened to ``D = prod(row_shape)`` elements.
        wire_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        block: elements per scale block, a positive multiple of 16 (default 128); the last
            block of a row holds ``D - (nb - 1) * block`` elements.
        use_native: run the native kernel (default: unless ``$MOECOMM_EXT_DISABLE``); when
            it cannot be built, the reference runs (same bits).

    Returns:
        ``(q, scales)``: ``q`` of ``x``'s shape in ``wire_dtype``, ``scales`` ``[N, nb]``
        float32 with ``nb = ceil(D / block)``, on ``x``'s device. See the module docstring
        for the rule (non-finite inputs: undefined results).

    Raises:
        TypeError: ``x`` is not a tensor of one of the three float dtypes, ``wire_dtype`` is
            not an FP8 dtype, ``block`` is not an int.
        ValueError: ``x`` has no dimension, ``block`` is not a positive multiple of 16.
    """
    x = _check_rows(x, "x")
    _check_input_dtype(x.dtype, "x", "a floating tensor of dtype")
    check_wire_dtype(wire_dtype)
    check_block(block)
    mod = _native(x.device.type, use_native)
    if mod is None:
        return quantize_rows_reference(x, wire_dtype, block)
    n, d = x.shape[0], math.prod(x.shape[1:])
    q, scales = mod.quantize_rows(x.contiguous().reshape(n, d), _WIRE_CODE[wire_dtype], block)
    return q.view(wire_dtype).reshape(x.shape), scales


def dequantize_rows(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int = 128, *, use_native: Optional[bool] = None
) -> torch.Tensor:
    """Undo :func:`quantize_rows`: ``(q.float() * scale).to(dtype)`` block by block.

    Args:
        q: ``[N, *row_shape]`` in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scales: ``[N, ceil(D / block)]`` float32 on ``q``'s device (``D = prod(row_shape)``).
        dtype: float32, bfloat16 or float16: the result's dtype.
        block: as given to :func:`quantize_rows`.
        use_native: as in :func:`quantize_rows`.

    Returns:
        ``[N, *row_shape]`` in ``dtype`` on ``q``'s device.

    Raises:
        TypeError: ``q`` not FP8, ``scales`` not float32, ``dtype`` not one of the three,
            ``block`` not an int.
        ValueError: ``scales`` of the wrong shape or device, ``block`` not a positive
            multiple of 16.
    """
    q = _check_rows(q, "q")
    check_wire_dtype(q.dtype, "q.dtype")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError(f"scales must be a float32 torch.Tensor, got "
                        f"{scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__}")
    _check_input_dtype(dtype, "dtype", "one of")
    check_block(block)
    n, d = q.shape[0], math.prod(q.shape[1:])
    if tuple(scales.shape) != (n, num_blocks(d, block)):
        raise ValueError(f"scales must have shape [N, ceil(D / block)] = [{n}, {num_blocks(d, block)}] for q of "
                         f"shape {tuple(q.shape)} and block {block}, got {tuple(scales.shape)}")
    if scales.device != q.device:
        raise ValueError(f"scales must be on q's device {q.device}, got {scales.device}")
    mod = _native(q.device.type, use_native)
    if mod is None:
        return dequantize_rows_reference(q, scales, dtype, block)
    out = mod.dequantize_rows(q.contiguous().view(torch.uint8).reshape(n, d), scales.contiguous(),
                              _WIRE_CODE[q.dtype], block, dtype)
    return out.reshape(q.shape)


_WIRE_CODE = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}


# -- the packed form that wire_dtype exchanges send ---------------------------------------

def pack_rows(x: torch.Tensor, wire_dtype: torch.dtype, block: int = 128, *,
              use_native: Optional[bool] = None) -> torch.Tensor:
    """Quantize and pack each row: ``[N, packed_row_bytes(D, block)]`` uint8 (no validation:
    ``x`` of an input dtype, copied first if not contiguous; see the module docstring for the layout)."""
    n, d = x.shape[0], math.prod(x.shape[1:])
    row_bytes = packed_row_bytes(d, block)
    mod = _native(x.device.type, use_native)
    if mod is not None:
        return mod.quantize_pack(x.reshape(n, d).contiguous(), _WIRE_CODE[wire_dtype], block, row_bytes)
    out = torch.zeros(n, row_bytes, dtype=torch.uint8, device=x.device)
    if n and d:
        q, scales = quantize_rows_reference(x, wire_dtype, block)
        off = -(-d // 4) * 4
        out[:, :d] = q.reshape(n, d).view(torch.uint8)
        out[:, off:off + 4 * scales.shape[1]] = scales.view(torch.uint8)
    return out


def pack_rows_into(x: torch.Tensor, wire_dtype: torch.dtype, out: torch.Tensor, block: int = 128, *,
                   use_native: Optional[bool] = None) -> torch.Tensor:
    """:func:`pack_rows` written into ``out``, a contiguous ``[N, row_bytes]`` uint8 tensor on
    ``x``'s device with ``row_bytes >= packed_row_bytes(D, block)`` (a multiple of 4): each
    row's packed bytes, then zeros to ``row_bytes``. No allocation on the native path (the
    reference allocates its temporaries); no validation. Returns ``out``."""
    n, d = x.shape[0], math.prod(x.shape[1:])
    mod = _native(x.device.type, use_native)
    if mod is not None:
        return mod.quantize_pack(x.reshape(n, d).contiguous(), _WIRE_CODE[wire_dtype], block, out.shape[1], out=out)
    packed = pack_rows(x, wire_dtype, block, use_native=False)
    out[:, :packed.shape[1]].copy_(packed)
    out[:, packed.shape[1]:].zero_()
    return out


def gather_pack_rows(x: torch.Tensor, index: torch.Tensor, wire_dtype: torch.dtype, block: int = 128, *,
                     scale: Optional[torch.Tensor] = None, use_native: Optional[bool] = None) -> torch.Tensor:
    """:func:`pack_rows` of the gathered rows ``x[index] * scale`` (the MoE dispatch gather,
    :func:`moecomm_ext.gather_rows`) in one pass: the gathered rows are never written out.

    ``x``: ``[N, *row_shape]`` float32/bfloat16/float16 (copied first if not contiguous); ``index``: ``[M]`` int64
    on ``x``'s device, entries in ``[-1, N)`` (``-1``: a zero row; checked on the CPU,
    ``ValueError`` naming ``index``; on a GPU it is the caller's promise, as reading the
    range would wait for the GPU); ``scale``: ``[M]`` floating or None (the
    product is taken in float32 and rounded to ``x.dtype``, as ``gather_rows`` does).
    Returns ``[M, packed_row_bytes(D, block)]`` uint8, equal to
    :func:`gather_pack_rows_reference` bit for bit. No further validation (as :func:`pack_rows`).
    """
    n, d = x.shape[0], math.prod(x.shape[1:])
    if index.device.type == "cpu" and index.numel():
        lo, hi = (int(v) for v in torch.aminmax(index))
        if lo < -1 or hi >= n:
            raise ValueError(f"gather_pack_rows: index has entries outside [-1, {n}) (N = x.shape[0] = {n}): "
                             f"min = {lo}, max = {hi}")
    mod = _native(x.device.type, use_native)
    if mod is None:
        return gather_pack_rows_reference(x, index, wire_dtype, block, scale=scale)
    s = None if scale is None else scale.to(torch.float32).contiguous()
    return mod.gather_quantize_pack(x.reshape(n, d).contiguous(), index.contiguous(), s, _WIRE_CODE[wire_dtype], block,
                                    packed_row_bytes(d, block))


def gather_pack_rows_reference(x: torch.Tensor, index: torch.Tensor, wire_dtype: torch.dtype, block: int = 128, *,
                               scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`gather_pack_rows` in plain torch: ``moecomm_ext.reference.gather_rows`` then
    :func:`pack_rows` of the pure-torch reference."""
    from moecomm_ext import reference

    n, d = x.shape[0], math.prod(x.shape[1:])
    rows = reference.gather_rows(x.reshape(n, d), index, scale)
    return pack_rows(rows, wire_dtype, block, use_native=False)


def unpack_rows(packed: torch.Tensor, row_shape: tuple, dtype: torch.dtype, wire_dtype: torch.dtype,
                block: int = 128, *, out: Optional[torch.Tensor] = None,
                use_native: Optional[bool] = None) -> torch.Tensor:
    """Undo :func:`pack_rows`: ``[N, *row_shape]`` in ``dtype`` from ``[N, row_bytes]`` uint8
    (into ``out``, contiguous, when given)."""
    n, d = packed.shape[0], math.prod(row_shape)
    shape = (n,) + tuple(row_shape)
    mod = _native(packed.device.type, use_native)
    if mod is not None:
        res = mod.unpack_dequantize(packed.contiguous(), d, _WIRE_CODE[wire_dtype], block, dtype,
                                    None if out is None else out.view(n, d))
        return res.view(shape) if out is None else out
    if n == 0 or d == 0:
        res = torch.empty(shape, dtype=dtype, device=packed.device)
    else:
        nb = num_blocks(d, block)
        off = -(-d // 4) * 4
        q = packed[:, :d].contiguous().view(wire_dtype)
        scales = packed[:, off:off + 4 * nb].contiguous().view(torch.float32)
        res = dequantize_rows_reference(q, scales, dtype, block).reshape(shape)
    return res if out is None else out.copy_(res)
