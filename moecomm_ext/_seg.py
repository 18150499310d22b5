"""Per-expert bias and column sums over a segmented row layout (``csrc/seg.h``): the dropless
experts' rows, one segment after another, segment ``s`` ending at row ``ends[s]`` (int32, the
grouped GEMMs' offsets) and belonging to local expert ``s % num_local``. Both work from the
segment ends on the device: no row map, no host synchronisation."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference
from ._loader import module_for

__all__ = ["seg_bias_act", "seg_colsum", "seg_module", "NATIVE_DEVICE_TYPES"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_rows(name: str, arg: str, rows: Tensor, ends: Tensor, num_local: int) -> None:
    if not isinstance(rows, Tensor) or rows.dim() != 2:
        got = tuple(rows.shape) if isinstance(rows, Tensor) else type(rows).__name__
        raise ValueError(f"{name}: argument '{arg}' must be a 2-D [rows, cols] tensor, got {got}")
    if rows.dtype not in _DTYPES:
        raise TypeError(f"{name}: argument '{arg}' must be float16, bfloat16, float32 or float64, got {rows.dtype}")
    if not isinstance(num_local, int) or isinstance(num_local, bool) or num_local < 1:
        raise ValueError(f"{name}: num_local must be an int >= 1, got {num_local!r}")
    if not isinstance(ends, Tensor) or ends.dim() != 1 or ends.dtype != torch.int32 or ends.device != rows.device \
            or ends.numel() < num_local or ends.numel() % num_local:
        got = (tuple(ends.shape), ends.dtype, ends.device) if isinstance(ends, Tensor) else type(ends).__name__
        raise ValueError(f"{name}: argument 'ends' must be 1-D int32 on {rows.device} holding blocks * num_local "
                         f"(num_local = {num_local}) segment ends, got {got}")


NATIVE_DEVICE_TYPES = ("cpu",)
"""Device types on which the library runs these kernels natively. The CUDA kernels
(``csrc/seg_cuda.cu``) are built and compile for sm_90, but have not yet run on a GPU: until
their tests (``tests/test_seg_kernels.py``, mark ``gpu``) have passed on a device, CUDA tensors
take the reference here and the torch operations in the layer."""


def seg_module(device: torch.device, use_native: Optional[bool] = None):
    """The native module whose ``seg_bias_act`` / ``seg_colsum`` run on ``device`` (contiguous
    inputs, checked as below), or None (then the reference): see :data:`NATIVE_DEVICE_TYPES`."""
    if device.type not in NATIVE_DEVICE_TYPES:
        return None
    mod = module_for(device.type, use_native)
    return mod if mod is not None and hasattr(mod, "seg_colsum") else None


def seg_bias_act(h: Tensor, bias: Tensor, ends: Tensor, *, relu: bool = False,
                 use_native: Optional[bool] = None) -> Tensor:
    """``h`` ``[rows, cols]`` with ``bias[e]`` (``bias``: ``[num_local, cols]`` of ``h``'s dtype)
    added to every row of local expert ``e``, each element rounded once from the float32 sum
    (float64 for float64), then ReLU where ``relu``; rows in no segment are left as they are.
    ``ends``: int32 ``[blocks * num_local]`` non-decreasing segment ends (other ends are safe
    but give unspecified rows). In place: returns ``h``. Not differentiable.

    Raises:
        ValueError: shapes, devices or ``ends`` as above. TypeError: ``h``'s dtype.
    """
    if not isinstance(h, Tensor) or h.dim() != 2:
        _check_rows("seg_bias_act", "h", h, ends, 1)  # (raises, naming h)
    if not isinstance(bias, Tensor) or bias.dim() != 2 or bias.shape[1] != h.shape[1] or bias.dtype != h.dtype \
            or bias.device != h.device:
        got = (tuple(bias.shape), bias.dtype, bias.device) if isinstance(bias, Tensor) else type(bias).__name__
        raise ValueError(f"seg_bias_act: argument 'bias' must be [num_local, {h.shape[1]}] {h.dtype} on {h.device}, "
                         f"got {got}")
    _check_rows("seg_bias_act", "h", h, ends, bias.shape[0])
    mod = seg_module(h.device, use_native)
    if mod is None:
        h.detach().copy_(reference.seg_bias_act(h.detach(), bias.detach(), ends, bool(relu)))
    elif h.is_contiguous():
        mod.seg_bias_act(h.detach(), bias.detach().contiguous(), ends.contiguous(), bool(relu))
    else:  # (the kernel works in place on contiguous rows)
        h.detach().copy_(mod.seg_bias_act(h.detach().contiguous(), bias.detach().contiguous(), ends.contiguous(),
                                          bool(relu)))
    return h


def seg_colsum(g: Tensor, ends: Tensor, num_local: int, *, use_native: Optional[bool] = None) -> Tensor:
    """``[num_local, cols]`` of ``g``'s dtype: the sum of the rows of each local expert's
    segments (``g``: ``[rows, cols]``; ``ends`` as in :func:`seg_bias_act`), in float32
    (float64 for float64), rounded once; in a fixed order (the same bits on every call).

    Raises:
        ValueError: shapes, devices, ``ends`` or ``num_local``. TypeError: ``g``'s dtype.
    """
    _check_rows("seg_colsum", "g", g, ends, num_local)
    mod = seg_module(g.device, use_native)
    if mod is None:
        return reference.seg_colsum(g.detach(), ends, num_local)
    return mod.seg_colsum(g.detach().contiguous(), ends.contiguous(), num_local)
