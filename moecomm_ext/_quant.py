"""Loading of the FP8 quantization kernels of :mod:`moecomm.quant` (``csrc/quant_cpu.cpp``,
``csrc/quant_cuda.cu``), one extension per device type, with the reference as fallback.

The outcome of the first load per device type is kept in ``_loader._LOADED`` (the
package's one explicit cache); a build failure warns once (:class:`NativeBuildWarning`)
and the pure-torch reference runs from then on.
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path
from typing import Optional

from ._loader import (
    _LOADED,
    _LOCK,
    NativeBuildWarning,
    _attempt,
    _stacklevel,
    default_cache_dir,
    resolve_use_native,
)
from ._specs import QUANT_CPU, QUANT_CUDA

__all__ = ["quant_module"]

_KINDS = {"cpu": QUANT_CPU, "cuda": QUANT_CUDA}


def quant_module(device_type: str, use_native: Optional[bool]) -> Optional[types.ModuleType]:
    """The quantization extension for tensors on ``device_type``, or None for the reference
    (``use_native`` False, another device type, or a build that failed)."""
    kind = _KINDS.get(device_type)
    if kind is None or not resolve_use_native(use_native):
        return None
    outcome = _LOADED.get(kind)
    if outcome is not None:
        return outcome.module
    with _LOCK:
        outcome = _LOADED.get(kind)
        if outcome is None:
            outcome = _LOADED[kind] = _attempt(kind, default_cache_dir(), False)
            if outcome.module is None and outcome.build_dir is not None:
                warnings.warn(
                    f"moecomm_ext: could not build or load the FP8 quantization extension "
                    f"'{Path(outcome.build_dir).name}' for {device_type}; moecomm.quant uses the pure-torch "
                    f"reference (same results, slower). Reason: {outcome.reason}",
                    NativeBuildWarning, stacklevel=_stacklevel())
    return outcome.module
