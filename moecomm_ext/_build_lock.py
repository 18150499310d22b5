"""The lock file that serialises just-in-time builders of one build directory (MPI ranks
of one job, several jobs sharing a cache): it holds ``<pid> <host> <unix time>``, and a lock
whose holder on this host has died, or one older than :data:`LOCK_STALE_S`, is broken, so
no builder waits forever."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from pathlib import Path
from typing import Iterator

__all__ = ["LOCK_NAME", "LOCK_STALE_S", "build_lock"]

logger = logging.getLogger("moecomm_ext")

LOCK_NAME = "moecomm-build.lock"
LOCK_STALE_S = 1800.0  # a build lock this old is broken even if its holder still runs


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
def build_lock(path: Path, stale_after: float = LOCK_STALE_S, poll: float = 0.2) -> Iterator[None]:
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
