"""The just-in-time build of one extension with :func:`torch.utils.cpp_extension.load`,
under the build lock, into ``<cache dir>/<name>-<tag>-pyXY-<hash>`` (the hash covers the
sources, the flags and torch's version), with a short summary of the compiler's errors
when it fails."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import sys
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import _specs
from ._build_lock import LOCK_NAME, build_lock

__all__ = ["LoadOutcome", "jit_build", "summarise"]

logger = logging.getLogger("moecomm_ext")


@dataclass(frozen=True)
class LoadOutcome:
    """What one attempt to load an extension gave: the module, or ``None`` and why."""

    module: types.ModuleType | None
    reason: str | None  # why module is None; None on success
    build_dir: str | None  # the just-in-time build's directory; None for an installed module
    seconds: float
    origin: str | None = None  # "installed" or "jit" when module is not None


def _spec_hash(spec: _specs.Spec) -> str:
    h = hashlib.sha256()
    h.update(_specs.source_hash(spec, torch.__version__).encode())
    h.update(_specs.flags_hash(spec).encode())
    return h.hexdigest()[:12]


_ERROR_LINE = re.compile(r"error|not found|no such file|fatal|undefined|cannot|permission denied", re.I)


def summarise(exc: BaseException, notes: list[str]) -> str:
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


class _CaptureLogs(logging.Handler):
    """Collects torch.utils.cpp_extension's log records during a build."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = " ".join(record.getMessage().replace("!", " ").split())
        if msg:
            self.messages.append(msg)


@contextlib.contextmanager
def _torch_logs(verbose: bool) -> Iterator[_CaptureLogs]:
    """Collect torch.utils.cpp_extension's log lines during a build instead of showing them
    (unless ``verbose``), to keep them out of the user's way."""
    capture = _CaptureLogs()
    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    old_propagate = torch_logger.propagate
    if not verbose:
        torch_logger.addHandler(capture)
        torch_logger.propagate = False
    try:
        yield capture
    finally:
        if not verbose:
            torch_logger.removeHandler(capture)
            torch_logger.propagate = old_propagate


def _first_lines(records: list) -> list[str]:
    return [str(w.message).strip().splitlines()[0] for w in records if str(w.message).strip()]


def _load_arguments(spec: _specs.Spec, build_dir: Path, digest: str, verbose: bool) -> dict:
    """The keyword arguments of :func:`torch.utils.cpp_extension.load` for ``spec``; the
    sources' hash is compiled in (``MOECOMM_EXT_SOURCE_HASH``)."""
    define = f"-D{_specs.HASH_MACRO}={digest}"
    return dict(
        name=spec.base,
        sources=[str(p) for p in spec.source_paths()],
        extra_cflags=[*spec.cflags, define],
        extra_cuda_cflags=[*spec.cuda_cflags, define] if spec.with_cuda else None,
        extra_ldflags=list(spec.ldflags),
        extra_include_paths=[str(d) for d in spec.include_dirs()] or None,
        build_directory=str(build_dir),
        with_cuda=spec.with_cuda,
        verbose=verbose,
    )


def jit_build(spec: _specs.Spec, cache_dir: Path, verbose: bool, why: str,
              load: Callable[..., types.ModuleType]) -> LoadOutcome:
    """Build (under the lock, unless already built) and load ``spec`` just in time with
    ``load`` (:func:`torch.utils.cpp_extension.load`'s signature); a failure is returned,
    not raised."""
    start = time.perf_counter()
    try:
        py = f"py{sys.version_info.major}{sys.version_info.minor}"
        digest = _spec_hash(spec)
        build_dir = cache_dir / f"{spec.base}-{spec.tag}-{py}-{digest}"
    except Exception as exc:  # pragma: no cover - defensive
        return LoadOutcome(None, summarise(exc, []), None, time.perf_counter() - start)

    records: list = []
    with _torch_logs(verbose) as capture:
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            with build_lock(build_dir / LOCK_NAME):
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
                    module = load(**_load_arguments(spec, build_dir, digest, verbose))
                if building:
                    print(f"moecomm_ext: built {spec.base} in {time.perf_counter() - start:.0f} s",
                          file=sys.stderr, flush=True)
            for msg in _first_lines(records) + capture.messages:
                logger.debug("torch.utils.cpp_extension warned while building %s: %s", spec.base, msg)
            for fn in spec.functions:
                if not hasattr(module, fn):
                    raise ImportError(f"loaded module {module!r} lacks function {fn!r}")
        except Exception as exc:
            notes = _first_lines(records) + capture.messages
            reason = f"{why}, and building it just in time failed: " + summarise(exc, notes)
            return LoadOutcome(None, reason, str(build_dir), time.perf_counter() - start)
    seconds = time.perf_counter() - start
    logger.info("moecomm_ext: loaded %s from %s in %.1f s", spec.base, build_dir, seconds)
    return LoadOutcome(module, None, str(build_dir), seconds, "jit")
