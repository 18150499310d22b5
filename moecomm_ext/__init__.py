"""moecomm_ext: native row-gather kernels for MoE dispatch/combine, with torch references.

Kernels (C++ for CPU tensors, CUDA for GPU tensors), compiled by ``pip install``;
importing never compiles.  Where no module built at install matches the sources (a
checkout used through ``PYTHONPATH``), the first use builds them just in time with
``torch.utils.cpp_extension.load``, says so on stderr and caches them on disk
(:mod:`moecomm_ext._loader`):

* :func:`gather_rows`        ``out[i] = x[index[i]] * scale[i]``            ``[M, D]``
* :func:`gather_reduce_rows` ``out[t] = sum_j w[t, j] * y[index[t, j]]``    ``[T, D]``
* :func:`gather_rowdot`      ``out[t, j] = dot(a[t], b[index[t, j]])``      ``[T, K]``
* :func:`route_capacity`     the router's capacity routing: gates, queue positions and
  both slot maps from the top-k scores (:class:`CapacityRoutes`); :func:`route_dropless`
  the same with every route kept
* :func:`route_backward`     the router logits' gradient from the gates' (and the GShard
  loss's), through the top-k selection and the softmax
* :func:`glu_forward`        ``out = f(h[:, :H]) * h[:, H:]`` (SwiGLU, GeGLU, ReGLU)      ``[N, H]``;
  :func:`glu_backward` its gradient ``[N, 2H]`` and the output again, in one pass
* :func:`seg_bias_act`       ``h[r] += bias[expert of r]`` (then ReLU) over dropless segments, in place;
  :func:`seg_colsum` each expert's row sums ``[num_local, cols]``: from the segment ends on the device
  (native on CPU tensors; CUDA tensors take the reference until the CUDA kernels' tests have run on
  a GPU: ``moecomm_ext._seg.NATIVE_DEVICE_TYPES``)
* :func:`select_experts`     the router's choice (sigmoid / sqrt-softplus / softmax scores, an
  expert bias, group-limited top-k) and its gates ``[T, k]``, differentiable; None where not covered

An index entry of ``-1`` always means "no row".  Arithmetic is done in float32
(float64 for float64 inputs) and rounded once to the output dtype.

Autograd wrappers built only from those kernels: :func:`dispatch` and
:func:`combine` (with the slot maps of :func:`invert_slots` /
:func:`slot_positions`); :func:`dispatch_backward` is dispatch's backward on its own, for a
forward gather fused with something else (moecomm's FP8 dispatch). The 2D hierarchical all-to-all's block reordering is
``moecomm``'s own (``moecomm/collectives/blocks.py``, on :func:`gather_rows`).

Every op has a pure-torch reference in :mod:`moecomm_ext.reference`.  When the
native extension is neither installed nor can be built (no compiler, failed build) one
:class:`NativeBuildWarning` per device type and process names the extension and
the reason, and the reference is used from then on.  :func:`implementation`
reports which one is in use; :func:`load_native` loads (or builds) explicitly.

Environment variables (each only provides the default of an explicit argument):

``MOECOMM_EXT_CACHE``
    default of ``load_native(cache_dir=...)``: the directory of the just-in-time
    build cache.  Unset: ``~/.cache/moecomm_ext/<torch version>-<cpu|cuXY>-pyXY-<hash
    of sys.prefix>`` (one per environment).
``MOECOMM_EXT_DISABLE``
    ``1`` (or ``true``/``yes``/``on``) makes ``use_native`` default to
    ``False`` in every op, so the pure-torch reference runs and nothing is built.

Module-level state: the only mutable state is the cache of loaded extension
modules in ``moecomm_ext._loader._LOADED`` (device type or extension kind -> module or failure),
filled by the first load per device type and kept for the life of the process.
"""

from __future__ import annotations

from . import reference
from ._loader import (
    ENV_CACHE,
    ENV_DISABLE,
    NativeBuildWarning,
    default_cache_dir,
    default_use_native,
    implementation,
    load_native,
    native_available,
)
from ._autograd import combine, dispatch, dispatch_backward
from ._ops import gather_reduce_rows, gather_rowdot, gather_rows
from ._slots import invert_slots, slot_positions
from ._route import CapacityRoutes, route_backward, route_capacity, route_dropless
from ._glu import GLU_CODES, glu_backward, glu_forward
from ._seg import seg_bias_act, seg_colsum
from ._select import SELECT_SCORES, select_experts
from . import unchecked

__all__ = [
    "gather_rows",
    "gather_reduce_rows",
    "gather_rowdot",
    "dispatch",
    "dispatch_backward",
    "combine",
    "invert_slots",
    "slot_positions",
    "route_capacity",
    "route_dropless",
    "route_backward",
    "CapacityRoutes",
    "glu_forward",
    "glu_backward",
    "GLU_CODES",
    "seg_bias_act",
    "seg_colsum",
    "select_experts",
    "SELECT_SCORES",
    "unchecked",
    "native_available",
    "implementation",
    "load_native",
    "default_cache_dir",
    "default_use_native",
    "NativeBuildWarning",
    "ENV_CACHE",
    "ENV_DISABLE",
    "reference",
]
