"""Just-in-time build and loading of the native row-gather extensions.

Two extensions exist, one per device type:

* ``"cpu"``  -> ``csrc/rows_cpu.cpp`` (C++, ``at::parallel_for``), built with
  the host C++ compiler (``$CXX`` or ``c++``).
* ``"cuda"`` -> ``csrc/rows_cuda.cu`` + ``csrc/rows_cuda_bind.cpp``, built with
  ``nvcc`` for sm_90 (plus compute_90 PTX, plus the current GPU's own
  architecture when it is older than Hopper).

Both are built with :func:`torch.utils.cpp_extension.load` into a build
directory below the cache directory.  The build directory name contains the
extension name, the Python version and a hash of the sources and flags, so a
changed source never overwrites a library that another process has loaded.
``torch.utils.cpp_extension`` serialises concurrent builds of one directory
through a file baton (``<build dir>/lock``); processes that lose the race wait
for the winner and then import its result.  If a process is killed in the
middle of a build the ``lock`` file stays behind and later loads of that
directory wait forever; delete the file to recover.

Module-level mutable state: ``_LOADED`` (a dict, device type -> outcome of the
first load attempt in this process: the module, or ``None`` plus the failure
reason) and ``_LOCK`` (the lock that guards it).  Nothing else in the package
is mutable at module level.  A failed attempt is cached too, so the
:class:`NativeBuildWarning` is emitted once per device type and process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "NativeBuildWarning",
    "ENV_CACHE",
    "ENV_DISABLE",
    "default_cache_dir",
    "default_use_native",
    "load_native",
    "load_p2p",
    "native_available",
    "implementation",
]

logger = logging.getLogger("moecomm_ext")

ENV_CACHE = "MOECOMM_EXT_CACHE"
ENV_DISABLE = "MOECOMM_EXT_DISABLE"

DEVICE_TYPES = ("cpu", "cuda")
P2P = "cuda-p2p"  # the peer-memory transport's own extension (moecomm/backends/p2p.py)
NCCL_ISSUE = "nccl-issue"  # the NCCL backend's grouped send/recv, issued natively (moecomm/backends/nccl.py)
QUANT_CPU, QUANT_CUDA = "quant-cpu", "quant-cuda"  # moecomm.quant's FP8 kernels (moecomm_ext/_quant.py)

_CSRC = Path(__file__).resolve().parent / "csrc"
_TRUE_STRINGS = frozenset({"1", "true", "yes", "on"})


class NativeBuildWarning(UserWarning):
    """Emitted once per device type and process when a native extension could
    not be built or loaded; the pure-torch reference is used instead."""


@dataclass(frozen=True)
class _LoadOutcome:
    module: types.ModuleType | None
    reason: str | None  # why module is None; None on success
    build_dir: str | None
    seconds: float


# The explicit cache of loaded modules (see module docstring).
_LOADED: dict[str, _LoadOutcome] = {}
_LOCK = threading.RLock()


def _torch_flavour() -> str:
    cuda = torch.version.cuda
    if cuda:
        return "cu" + cuda.replace(".", "")
    return "cpu"


def default_cache_dir() -> Path:
    """Default for the ``cache_dir`` argument of :func:`load_native`.

    ``$MOECOMM_EXT_CACHE`` when that variable is set and non-empty, else
    ``~/.cache/moecomm_ext/<torch version>-<cpu|cuXY>`` (for example
    ``~/.cache/moecomm_ext/2.13.0-cpu`` or ``.../2.11.0-cu130``).
    """
    env = os.environ.get(ENV_CACHE, "").strip()
    if env:
        return Path(env).expanduser()
    version = torch.__version__.split("+")[0]
    return Path.home() / ".cache" / "moecomm_ext" / f"{version}-{_torch_flavour()}"


def default_use_native() -> bool:
    """Default for every ``use_native`` argument: ``False`` when
    ``$MOECOMM_EXT_DISABLE`` is one of ``1/true/yes/on`` (any case), else ``True``."""
    return os.environ.get(ENV_DISABLE, "").strip().lower() not in _TRUE_STRINGS


def resolve_use_native(use_native: bool | None) -> bool:
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


def _cuda_arch_flags() -> tuple[list[str], str]:
    """nvcc -gencode flags: sm_90 SASS + compute_90 PTX, plus the current GPU's
    own architecture when it is older than Hopper (PTX only runs on the same
    or newer GPUs; newer ones JIT-compile the compute_90 PTX)."""
    archs = {(9, 0)}
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        if cap < (9, 0):
            archs.add(cap)
    flags = []
    for major, minor in sorted(archs):
        flags.append(f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}")
    flags.append("-gencode=arch=compute_90,code=compute_90")
    tag = "sm" + "_".join(f"{a}{b}" for a, b in sorted(archs))
    return flags, tag


def _build_spec(device_type: str) -> dict:
    """Name, sources and flags of the extension for ``device_type``."""
    cflags = ["-O3", "-DNDEBUG"]
    ldflags: list[str] = []
    if torch.backends.openmp.is_available():
        # at::parallel_for is header-inline: without -fopenmp it runs serially.
        # libgomp.so.1 resolves to the copy torch has already loaded.
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    if device_type == "cpu":
        return dict(
            base="moecomm_ext_rows_cpu",
            sources=[_CSRC / "rows_cpu.cpp"],
            extra_cflags=cflags,
            extra_cuda_cflags=None,
            extra_ldflags=ldflags,
            with_cuda=False,
            tag="cpu",
            functions=("gather_rows", "gather_reduce_rows", "gather_rowdot"),
        )
    if device_type == QUANT_CPU:
        # -fno-trapping-math: lets the selects of the FP8 codec vectorize (no result changes)
        return dict(base="moecomm_ext_quant_cpu", sources=[_CSRC / "quant_cpu.cpp"],
                    extra_cflags=cflags + ["-fno-trapping-math"],
                    extra_cuda_cflags=None, extra_ldflags=ldflags, with_cuda=False, tag="cpu",
                    functions=("quantize_rows", "dequantize_rows", "quantize_pack", "unpack_dequantize"))
    if device_type == NCCL_ISSUE:
        return dict(
            base="moecomm_ext_nccl_issue",
            sources=[_CSRC / "nccl_issue.cpp"],
            extra_cflags=["-O2", "-DNDEBUG"],
            extra_cuda_cflags=None,
            extra_ldflags=["-ldl"],
            with_cuda=False,
            tag="host",
            functions=("NcclCalls",),
        )
    arch_flags, tag = _cuda_arch_flags()
    if device_type == QUANT_CUDA:
        return dict(base="moecomm_ext_quant_cuda", sources=[_CSRC / "quant_cuda.cu", _CSRC / "quant_cuda_bind.cpp"],
                    extra_cflags=["-O3", "-DNDEBUG"], extra_cuda_cflags=["-O3", "-lineinfo", *arch_flags],
                    extra_ldflags=[], with_cuda=True, tag=tag,
                    functions=("quantize_rows", "dequantize_rows", "quantize_pack", "unpack_dequantize"))
    if device_type == P2P:
        return dict(
            base="moecomm_ext_p2p_cuda",
            sources=[_CSRC / "p2p_cuda.cu"],
            extra_cflags=["-O3", "-DNDEBUG"],
            extra_cuda_cflags=["-O3", "-lineinfo", *arch_flags],
            extra_ldflags=[],
            with_cuda=True,
            tag=tag,
            functions=("alloc", "free", "ipc_handle", "ipc_open", "ipc_close", "gpu_counts_exchange",
                       "launch_copy_out", "ce_exchange", "new_event", "destroy_event",
                       "max_copy_engine_ranks", "can_access_peer"),
        )
    return dict(
        base="moecomm_ext_rows_cuda",
        sources=[_CSRC / "rows_cuda.cu", _CSRC / "rows_cuda_bind.cpp"],
        extra_cflags=["-O3", "-DNDEBUG"],
        # No --use_fast_math: the kernels accumulate in fp32 and must match
        # the reference closely.
        extra_cuda_cflags=["-O3", "-lineinfo", *arch_flags],
        extra_ldflags=[],
        with_cuda=True,
        tag=tag,
        functions=("gather_rows", "gather_reduce_rows", "gather_rowdot"),
    )


def _spec_hash(spec: dict) -> str:
    h = hashlib.sha256()
    for src in spec["sources"]:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    for header in sorted(_CSRC.glob("*.h")):
        h.update(header.name.encode())
        h.update(header.read_bytes())
    for key in ("extra_cflags", "extra_cuda_cflags", "extra_ldflags"):
        h.update(repr(spec[key]).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:12]


_ERROR_LINE = re.compile(r"error|not found|no such file|fatal|undefined|cannot|permission denied", re.I)


def _summarise(exc: BaseException, notes: list[str]) -> str:
    """A few informative lines: the exception's first line and the compiler's
    error lines (command lines are dropped), plus what torch warned."""
    lines = [ln.rstrip() for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
    head = lines[0] if lines else type(exc).__name__
    head = re.split(r": \[\d+/\d+\] ", head)[0]  # drop ninja's echoed command line
    if len(head) > 200:
        head = head[:200] + " ..."
    errors = [ln.strip()[:300] for ln in lines[1:] if _ERROR_LINE.search(ln) and len(ln) < 400]
    if not errors:
        errors = [ln.strip()[:300] for ln in lines[1:][-4:]]
    parts = [head, *errors[:8]]
    parts += [f"(torch: {n[:300]})" for n in notes[:3]]
    return "\n  ".join(parts)


def _stacklevel() -> int:
    """stacklevel that attributes a warning to the first frame outside this package."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == pkg:
        frame = frame.f_back
        level += 1
    return level


class _CaptureLogs(logging.Handler):
    """Collects torch.utils.cpp_extension's log records during a build."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = " ".join(record.getMessage().replace("!", " ").split())
        if msg:
            self.messages.append(msg)


def _first_lines(records: list) -> list[str]:
    return [str(w.message).strip().splitlines()[0] for w in records if str(w.message).strip()]


def _torch_load(**kwargs) -> types.ModuleType:
    # Indirection so that tests can force a failure by monkeypatching.
    from torch.utils.cpp_extension import load

    return load(**kwargs)


def _attempt(device_type: str, cache_dir: Path, verbose: bool) -> _LoadOutcome:
    start = time.perf_counter()
    if device_type in ("cuda", P2P, QUANT_CUDA):
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
        spec = _build_spec(device_type)
        py = f"py{sys.version_info.major}{sys.version_info.minor}"
        build_dir = cache_dir / f"{spec['base']}-{spec['tag']}-{py}-{_spec_hash(spec)}"
    except Exception as exc:  # pragma: no cover - defensive
        reason = _summarise(exc, [])
        return _LoadOutcome(None, reason, None, time.perf_counter() - start)

    records: list = []
    capture = _CaptureLogs()
    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    old_propagate = torch_logger.propagate
    if not verbose:  # keep torch's own log lines out of the user's way
        torch_logger.addHandler(capture)
        torch_logger.propagate = False
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings(record=True) as rec:
            records = rec
            warnings.simplefilter("always")
            module = _torch_load(
                name=spec["base"],
                sources=[str(s) for s in spec["sources"]],
                extra_cflags=spec["extra_cflags"],
                extra_cuda_cflags=spec["extra_cuda_cflags"],
                extra_ldflags=spec["extra_ldflags"],
                build_directory=str(build_dir),
                with_cuda=spec["with_cuda"],
                verbose=verbose,
            )
        for msg in _first_lines(records) + capture.messages:
            logger.debug("torch.utils.cpp_extension warned while building %s: %s", spec["base"], msg)
        for fn in spec["functions"]:
            if not hasattr(module, fn):
                raise ImportError(f"loaded module {module!r} lacks function {fn!r}")
    except Exception as exc:
        reason = _summarise(exc, _first_lines(records) + capture.messages)
        return _LoadOutcome(None, reason, str(build_dir), time.perf_counter() - start)
    finally:
        if not verbose:
            torch_logger.removeHandler(capture)
            torch_logger.propagate = old_propagate
    seconds = time.perf_counter() - start
    logger.info("moecomm_ext: loaded %s from %s in %.1f s", spec["base"], build_dir, seconds)
    return _LoadOutcome(module, None, str(build_dir), seconds)


def load_native(
    device_type: str = "cpu",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    verbose: bool = False,
    strict: bool = False,
) -> types.ModuleType | None:
    """Build (if needed) and load the native extension for ``device_type``.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        cache_dir: directory holding the build directories; defaults to
            :func:`default_cache_dir` (``$MOECOMM_EXT_CACHE`` or
            ``~/.cache/moecomm_ext/<torch version>-<cpu|cuXY>``).
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


def _load_required(kind: str, what: str) -> types.ModuleType:
    """Build (if needed) and load the extension of ``kind``; ``RuntimeError`` naming ``what``
    and the reason when it cannot be built or loaded."""
    with _LOCK:
        outcome = _LOADED.get(kind)
        if outcome is None:
            outcome = _LOADED[kind] = _attempt(kind, default_cache_dir(), False)
    if outcome.module is None:
        raise RuntimeError(f"moecomm_ext: the {what} extension is unavailable: {outcome.reason}")
    return outcome.module


def load_p2p() -> types.ModuleType:
    """Build (if needed) and load the peer-memory transport's CUDA extension.

    Unlike the row kernels it has no reference fallback (it is what an explicit
    ``moecomm.init(p2p_bytes=...)`` asked for): raises ``RuntimeError`` with the reason
    when it cannot be built or loaded.
    """
    return _load_required(P2P, "peer-memory (p2p) CUDA")


def load_nccl_issue() -> types.ModuleType:
    """Build (if needed) and load the extension that issues the NCCL backend's grouped
    send/recv natively. Raises ``RuntimeError`` with the reason when it cannot; the backend
    then issues them through nccl4py's raw bindings (correct, about 1 us per call slower)."""
    return _load_required(NCCL_ISSUE, "NCCL issue")


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
    """
    _check_device_type(device_type)
    return module_for(device_type, use_native) is not None


def implementation(device_type: str = "cpu", *, use_native: bool | None = None) -> str:
    """``"native"`` or ``"reference"``: which implementation ops on
    ``device_type`` tensors use (building the extension on first use)."""
    return "native" if native_available(device_type, use_native=use_native) else "reference"
