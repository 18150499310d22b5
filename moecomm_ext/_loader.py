"""Loading of native extensions: the modules built at install, else a just-in-time build.

This package's two extensions (:mod:`moecomm_ext._specs` lists their sources and flags):

* ``"cpu"``  -> ``csrc/rows_cpu.cpp`` (C++, ``at::parallel_for``);
* ``"cuda"`` -> ``csrc/rows_cuda.cu`` + ``csrc/rows_cuda_bind.cpp`` (nvcc, sm_90 plus
  compute_90 PTX, plus the current GPU's own architecture when it is older than Hopper).

The same machinery loads the transports' extensions for ``moecomm.backends`` through
:func:`load_extension` (no reference fallback there: the caller reports the failure).

``pip install`` builds them (``setup.py``, torch's ``BuildExtension``) as
``moecomm_ext._rows_cpu`` etc.; loading imports those and never compiles, as long as the
module's ``source_hash`` matches the sources beside it (an edited checkout never runs a
stale library).  Only where no such module is there (a checkout used through
``PYTHONPATH``, an install made without torch or without a compiler) does the first use
build just in time, with :func:`torch.utils.cpp_extension.load`, printing a line to stderr
first.  That build goes to ``<cache dir>/<name>-<tag>-pyXY-<hash of sources, flags and
torch version>``; the default cache directory is keyed by the interpreter's environment
(torch version and flavour, Python version, a hash of ``sys.prefix``), so two virtual
environments never rebuild each other's libraries.  Concurrent builders (MPI ranks) are
serialised by a lock file holding the builder's pid and host (:func:`_build_lock`); a lock
whose holder has died, or older than :data:`LOCK_STALE_S`, is broken.

Module-level mutable state: ``_LOADED`` (a dict, device type or :func:`load_extension`'s
kind -> outcome of the first load attempt in this process: the module, or ``None`` plus the
failure reason) and ``_LOCK``
(the lock that guards it).  Nothing else in the package is mutable at module level.  A
failed attempt is cached too, so the :class:`NativeBuildWarning` is emitted once per
device type and process.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import re
import socket
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import _specs
from ._specs import QUANT_CPU, QUANT_CUDA

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
LOCK_NAME = "moecomm-build.lock"
LOCK_STALE_S = 1800.0  # a build lock this old is broken even if its holder still runs

_CSRC = _specs.CSRC
_TRUE_STRINGS = frozenset({"1", "true", "yes", "on"})


class NativeBuildWarning(UserWarning):
    """Emitted once per device type and process when a native extension could
    not be built or loaded; the pure-torch reference is used instead."""


@dataclass(frozen=True)
class _LoadOutcome:
    module: types.ModuleType | None
    reason: str | None  # why module is None; None on success
    build_dir: str | None  # the just-in-time build's directory; None for an installed module
    seconds: float
    origin: str | None = None  # "installed" or "jit" when module is not None


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


def _spec_hash(spec: _specs.Spec) -> str:
    h = hashlib.sha256()
    h.update(_specs.source_hash(spec, torch.__version__).encode())
    h.update(_specs.flags_hash(spec).encode())
    return h.hexdigest()[:12]


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_is_stale(path: Path, stale_after: float) -> tuple[bool, str]:
    """Whether the lock at ``path`` may be broken, and its content."""
    try:
        content = path.read_text()
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return False, ""
    if age > stale_after:
        return True, content
    fields = content.split()
    if len(fields) >= 2 and fields[0].isdigit():
        pid, host = int(fields[0]), fields[1]
        return host == socket.gethostname() and not _pid_alive(pid), content
    return age > 30.0, content  # empty or garbled: its writer died between create and write


@contextlib.contextmanager
def _build_lock(path: Path, stale_after: float = LOCK_STALE_S, poll: float = 0.2) -> Iterator[None]:
    """Hold the file lock ``path`` (content: ``<pid> <host> <unix time>``).

    Waits while another live process holds it; breaks it when the holder (on this host) has
    died or the lock is older than ``stale_after`` seconds, so no wait is endless.
    """
    mine = f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n"
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            stale, content = _lock_is_stale(path, stale_after)
            if stale:
                broken = path.with_name(f"{path.name}.broken-{os.getpid()}")
                with contextlib.suppress(FileNotFoundError):
                    os.rename(path, broken)
                    if broken.read_text() != content:  # not the one judged stale: put it back
                        with contextlib.suppress(FileExistsError):
                            os.link(broken, path)
                    else:
                        logger.warning("moecomm_ext: broke the stale build lock %s (%s)", path, content.strip())
                    broken.unlink()
                continue
            time.sleep(poll)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(mine)
        break
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            if path.read_text() == mine:
                path.unlink()


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


def _jit(spec: _specs.Spec, cache_dir: Path, verbose: bool, why: str) -> _LoadOutcome:
    """Build (under the lock, unless already built) and load ``spec`` just in time."""
    start = time.perf_counter()
    try:
        py = f"py{sys.version_info.major}{sys.version_info.minor}"
        digest = _spec_hash(spec)
        build_dir = cache_dir / f"{spec.base}-{spec.tag}-{py}-{digest}"
    except Exception as exc:  # pragma: no cover - defensive
        return _LoadOutcome(None, _summarise(exc, []), None, time.perf_counter() - start)

    records: list = []
    capture = _CaptureLogs()
    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    old_propagate = torch_logger.propagate
    if not verbose:  # keep torch's own log lines out of the user's way
        torch_logger.addHandler(capture)
        torch_logger.propagate = False
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with _build_lock(build_dir / LOCK_NAME):
            building = not (build_dir / f"{spec.base}.so").exists()
            if building:
                print(f"moecomm_ext: building {spec.base} (first use, about {spec.build_seconds} s; "
                      f"{why}) in {build_dir}", file=sys.stderr, flush=True)
            # torch's own baton; one left by a builder killed mid-build would block forever,
            # and while this process holds the lock above no other builder is running.
            with contextlib.suppress(FileNotFoundError):
                (build_dir / "lock").unlink()
            with warnings.catch_warnings(record=True) as rec:
                records = rec
                warnings.simplefilter("always")
                module = _torch_load(
                    name=spec.base,
                    sources=[str(p) for p in spec.source_paths()],
                    extra_cflags=[*spec.cflags, f"-D{_specs.HASH_MACRO}={digest}"],
                    extra_cuda_cflags=[*spec.cuda_cflags, f"-D{_specs.HASH_MACRO}={digest}"] if spec.with_cuda else None,
                    extra_ldflags=list(spec.ldflags),
                    extra_include_paths=[str(d) for d in spec.include_dirs()] or None,
                    build_directory=str(build_dir),
                    with_cuda=spec.with_cuda,
                    verbose=verbose,
                )
            if building:
                print(f"moecomm_ext: built {spec.base} in {time.perf_counter() - start:.0f} s",
                      file=sys.stderr, flush=True)
        for msg in _first_lines(records) + capture.messages:
            logger.debug("torch.utils.cpp_extension warned while building %s: %s", spec.base, msg)
        for fn in spec.functions:
            if not hasattr(module, fn):
                raise ImportError(f"loaded module {module!r} lacks function {fn!r}")
    except Exception as exc:
        reason = f"{why}, and building it just in time failed: " + _summarise(exc, _first_lines(records) + capture.messages)
        return _LoadOutcome(None, reason, str(build_dir), time.perf_counter() - start)
    finally:
        if not verbose:
            torch_logger.removeHandler(capture)
            torch_logger.propagate = old_propagate
    seconds = time.perf_counter() - start
    logger.info("moecomm_ext: loaded %s from %s in %.1f s", spec.base, build_dir, seconds)
    return _LoadOutcome(module, None, str(build_dir), seconds, "jit")


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
    """
    _check_device_type(device_type)
    return module_for(device_type, use_native) is not None


def implementation(device_type: str = "cpu", *, use_native: bool | None = None) -> str:
    """``"native"`` or ``"reference"``: which implementation ops on
    ``device_type`` tensors use (building the extension on first use)."""
    return "native" if native_available(device_type, use_native=use_native) else "reference"
