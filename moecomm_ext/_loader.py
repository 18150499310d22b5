"""Loading of native extensions: the modules built at install, else a just-in-time build.

This package's four extensions (:mod:`moecomm_ext._specs` lists their sources and flags):

* ``"cpu"``  -> ``csrc/rows_cpu.cpp`` (C++, ``at::parallel_for``);
* ``"cuda"`` -> ``csrc/rows_cuda.cu`` + ``csrc/rows_cuda_bind.cpp`` (nvcc, sm_90 plus
  compute_90 PTX, plus the current GPU's own architecture when it is older than Hopper);
* ``"quant-cpu"`` / ``"quant-cuda"`` -> the FP8 kernels of :mod:`moecomm.quant`
  (``csrc/quant_cpu.cpp``, ``csrc/quant_cuda.cu``), loaded through :mod:`moecomm_ext._quant`.

The same machinery loads the transports' extensions for ``moecomm.backends`` through
:func:`load_extension` (no reference fallback there: the caller reports the failure).

``pip install`` builds them (``setup.py``, torch's ``BuildExtension``) as
``moecomm_ext._rows_cpu`` etc.; loading imports those and never compiles, as long as the
module's ``source_hash`` matches the sources beside it (an edited checkout never runs a
stale library).  Only where no such module is there (a checkout used through
``PYTHONPATH``, an install made without torch or without a compiler) does the first use
build just in time (:mod:`moecomm_ext._jit`), printing a line to stderr first.  That build
goes to ``<cache dir>/<name>-<tag>-pyXY-<hash of sources, flags and torch version>``; the
default cache directory is keyed by the interpreter's environment (torch version and
flavour, Python version, a hash of ``sys.prefix``), so two virtual environments never
rebuild each other's libraries.  Concurrent builders (MPI ranks) are serialised by a lock
file (:mod:`moecomm_ext._build_lock`).

Module-level mutable state: ``_LOADED`` (a dict, device type or :func:`load_extension`'s
kind -> outcome of the first load attempt in this process: the module, or ``None`` plus the
failure reason) and ``_LOCK``
(the lock that guards it).  Nothing else in the package is mutable at module level.  A
failed attempt is cached too, so the :class:`NativeBuildWarning` is emitted once per
device type and process.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Callable

import torch

from . import _specs
from ._build_lock import LOCK_NAME, LOCK_STALE_S  # noqa: F401  (the lock's names, as before the split)
from ._build_lock import build_lock as _build_lock  # noqa: F401
from ._jit import LoadOutcome as _LoadOutcome
from ._jit import jit_build
from ._jit import summarise as _summarise

__all__ = [
    "NativeBuildWarning",
    "ENV_CACHE",
    "ENV_DISABLE",
    "default_cache_dir",
    "default_use_native",
    "load_native",
    "load_extension",
    "native_available",
    "implementation",
]

logger = logging.getLogger("moecomm_ext")

ENV_CACHE = "MOECOMM_EXT_CACHE"
ENV_DISABLE = "MOECOMM_EXT_DISABLE"

DEVICE_TYPES = ("cpu", "cuda")

_CSRC = _specs.CSRC
_TRUE_STRINGS = frozenset({"1", "true", "yes", "on"})


class NativeBuildWarning(UserWarning):
    """Emitted once per device type and process when a native extension could
    not be built or loaded; the pure-torch reference is used instead."""


# The explicit cache of loaded modules (see module docstring).
_LOADED: dict[str, _LoadOutcome] = {}
_LOCK = threading.RLock()


def _torch_flavour() -> str:
    cuda = torch.version.cuda
    if cuda:
        return "cu" + cuda.replace(".", "")
    return "cpu"


def environment_key() -> str:
    """``<torch version>-<cpu|cuXY>-pyXY-<8 hex digits of sys.prefix>``: the interpreter's
    environment, the name of the default cache directory."""
    version = torch.__version__.split("+")[0]
    prefix = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    return f"{version}-{_torch_flavour()}-py{sys.version_info.major}{sys.version_info.minor}-{prefix}"


def default_cache_dir() -> Path:
    """Default for the ``cache_dir`` argument of :func:`load_native`.

    ``$MOECOMM_EXT_CACHE`` when that variable is set and non-empty, else
    ``~/.cache/moecomm_ext/<environment_key()>`` (for example
    ``~/.cache/moecomm_ext/2.13.0-cpu-py311-1a2b3c4d``).
    """
    env = os.environ.get(ENV_CACHE, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "moecomm_ext" / environment_key()


def default_use_native() -> bool:
    """Default for every ``use_native`` argument: ``False`` when
    ``$MOECOMM_EXT_DISABLE`` is one of ``1/true/yes/on`` (any case), else ``True``."""
    return os.environ.get(ENV_DISABLE, "").strip().lower() not in _TRUE_STRINGS


def resolve_use_native(use_native: bool | None) -> bool:
    """``use_native`` checked, None replaced by :func:`default_use_native`."""
    if use_native is None:
        return default_use_native()
    if not isinstance(use_native, bool):
        raise TypeError(f"argument 'use_native' must be a bool or None; got {use_native!r}")
    return use_native


def _check_device_type(device_type: str) -> None:
    if device_type not in DEVICE_TYPES:
        raise ValueError(
            f"argument 'device_type' must be one of {DEVICE_TYPES}; got {device_type!r}"
        )


SpecFactory = Callable[..., _specs.Spec]
"""``factory(kind, *, openmp, device_capability) -> Spec``, as :func:`moecomm_ext._specs.spec`."""


def _build_spec(kind: str, factory: SpecFactory = _specs.spec, cuda: bool | None = None) -> _specs.Spec:
    """Sources and flags of the extension of ``kind`` for this torch and GPU."""
    capability = None
    if (kind in _specs.CUDA_KINDS if cuda is None else cuda) and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    return factory(kind, openmp=torch.backends.openmp.is_available(), device_capability=capability)


def _import_installed(spec: _specs.Spec) -> tuple[types.ModuleType | None, str]:
    """The module built at install, or ``None`` and why it cannot be used."""
    try:
        module = importlib.import_module(spec.installed)
    except ModuleNotFoundError as exc:
        if exc.name == spec.installed:
            return None, "not built at install"
        return None, f"the module built at install does not import: {exc}"
    except (ImportError, OSError) as exc:
        return None, f"the module built at install does not import: {exc}"
    try:
        want = _specs.source_hash(spec, torch.__version__)
    except OSError:  # sources not shipped: nothing to compare with
        want = getattr(module, "source_hash", None)
    have = getattr(module, "source_hash", None)
    if have != want:
        return None, (f"the module built at install ({have}) is older than its sources or was "
                      f"built for another torch ({want})")
    missing = [fn for fn in spec.functions if not hasattr(module, fn)]
    if missing:
        return None, f"the module built at install lacks {missing}"
    return module, ""


def _stacklevel() -> int:
    """stacklevel that attributes a warning to the first frame outside this package."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == pkg:
        frame = frame.f_back
        level += 1
    return level


def _torch_load(**kwargs) -> types.ModuleType:
    # Indirection so that tests can force a failure by monkeypatching.
    from torch.utils.cpp_extension import load

    return load(**kwargs)


def _jit(spec: _specs.Spec, cache_dir: Path, verbose: bool, why: str) -> _LoadOutcome:
    """Build (under the lock, unless already built) and load ``spec`` just in time."""
    return jit_build(spec, cache_dir, verbose, why, _torch_load)


def _attempt(kind: str, cache_dir: Path, verbose: bool, factory: SpecFactory = _specs.spec,
             cuda: bool | None = None) -> _LoadOutcome:
    """The installed module of ``kind`` (made by ``factory``) if usable, else a just-in-time
    build. ``cuda``: whether it needs CUDA (default: ``kind in _specs.CUDA_KINDS``)."""
    if kind in _specs.CUDA_KINDS if cuda is None else cuda:
        if torch.version.cuda is None or not torch.cuda.is_available():
            # No CUDA tensor can exist, so nothing can silently go wrong:
            # report unavailability without a warning.
            why = (
                "this torch build has no CUDA support"
                if torch.version.cuda is None
                else "no CUDA device is available"
            )
            return _LoadOutcome(None, why, None, 0.0)
    try:
        spec = _build_spec(kind, factory, cuda)
    except Exception as exc:  # pragma: no cover - defensive
        return _LoadOutcome(None, _summarise(exc, []), None, 0.0)
    start = time.perf_counter()
    module, why = _import_installed(spec)
    if module is not None:
        logger.info("moecomm_ext: loaded %s (built at install)", spec.installed)
        return _LoadOutcome(module, None, None, time.perf_counter() - start, "installed")
    return _jit(spec, cache_dir, verbose, why)


def load_native(
    device_type: str = "cpu",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    verbose: bool = False,
    strict: bool = False,
) -> types.ModuleType | None:
    """Load the native extension for ``device_type``: the module built at install, or,
    where there is none usable, one built just in time (printing a line to stderr first).

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        cache_dir: directory holding the just-in-time build directories; defaults to
            :func:`default_cache_dir` (``$MOECOMM_EXT_CACHE`` or
            ``~/.cache/moecomm_ext/<environment_key()>``).
        verbose: show the compiler's command lines and output.
        strict: raise ``RuntimeError`` instead of returning ``None`` when the
            extension cannot be built or loaded.

    Returns:
        The extension module, or ``None`` when it could not be built/loaded.
        On the first failure for a device type in this process a single
        :class:`NativeBuildWarning` naming the extension and the reason is
        emitted (not when CUDA is simply absent).  The outcome of the first
        attempt is cached per device type for the life of the process, so a
        later call with another ``cache_dir`` returns the module already loaded.

    Raises:
        ValueError: ``device_type`` is not ``"cpu"`` or ``"cuda"``.
        RuntimeError: ``strict`` and the extension cannot be built or loaded (the message
            says why).
    """
    _check_device_type(device_type)
    with _LOCK:
        outcome = _LOADED.get(device_type)
        if outcome is None:
            cdir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
            outcome = _attempt(device_type, cdir, verbose)
            _LOADED[device_type] = outcome
            if outcome.module is None and outcome.build_dir is not None:
                name = Path(outcome.build_dir).name
                warnings.warn(
                    f"moecomm_ext: could not build or load the native {device_type} extension "
                    f"'{name}' (build directory {outcome.build_dir}); falling back to the "
                    f"pure-torch reference implementation (same results, slower). "
                    f"Reason: {outcome.reason}",
                    NativeBuildWarning,
                    stacklevel=_stacklevel(),
                )
    if outcome.module is None and strict:
        raise RuntimeError(
            f"moecomm_ext: native {device_type} extension unavailable: {outcome.reason}"
        )
    return outcome.module


def load_extension(kind: str, factory: SpecFactory, *, cuda: bool, what: str) -> types.ModuleType:
    """Build (if needed) and load the extension ``factory(kind, openmp=..., device_capability=...)``
    describes, once per process (the outcome is cached under ``kind``, which must differ from
    ``"cpu"``/``"cuda"``): the module built at install when it matches its sources, else a
    just-in-time build in :func:`default_cache_dir`.

    Args:
        kind: the extension's key, passed on to ``factory``.
        factory: returns the :class:`moecomm_ext._specs.Spec` (sources, flags, names).
        cuda: the extension needs a CUDA torch and device (and nvcc to build).
        what: the extension's name in the error message.

    Raises:
        ValueError: ``kind`` is one of this package's own device types.
        RuntimeError: it cannot be built or loaded (the message names ``what`` and the reason).
    """
    if kind in DEVICE_TYPES:
        raise ValueError(f"argument 'kind' must not be one of {DEVICE_TYPES} (load_native's); got {kind!r}")
    with _LOCK:
        outcome = _LOADED.get(kind)
        if outcome is None:
            outcome = _LOADED[kind] = _attempt(kind, default_cache_dir(), False, factory, cuda)
    if outcome.module is None:
        raise RuntimeError(f"moecomm: the {what} extension is unavailable: {outcome.reason}")
    return outcome.module


def module_for(device_type: str, use_native: bool | None) -> types.ModuleType | None:
    """The native module to run an op on ``device_type`` with, or ``None`` for
    the reference path (device types other than cpu/cuda always use it)."""
    if device_type not in DEVICE_TYPES or not resolve_use_native(use_native):
        return None
    outcome = _LOADED.get(device_type)
    if outcome is not None:  # fast path, no lock
        return outcome.module
    return load_native(device_type)


def native_available(device_type: str = "cpu", *, use_native: bool | None = None) -> bool:
    """Whether ops on ``device_type`` tensors run the native kernels.

    Builds/loads the extension on first use (see :func:`load_native`).
    ``use_native`` defaults to ``not $MOECOMM_EXT_DISABLE``.

    Raises:
        ValueError: ``device_type`` is not ``"cpu"`` or ``"cuda"``.
        TypeError: ``use_native`` is not a bool or None.
    """
    _check_device_type(device_type)
    return module_for(device_type, use_native) is not None


def implementation(device_type: str = "cpu", *, use_native: bool | None = None) -> str:
    """``"native"`` or ``"reference"``: which implementation ops on
    ``device_type`` tensors use (building the extension on first use).

    Raises:
        ValueError, TypeError: as :func:`native_available`.
    """
    return "native" if native_available(device_type, use_native=use_native) else "reference"
