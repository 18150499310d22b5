"""How this process was launched, and the bootstrap channels used before a backend exists."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Union

import numpy as np

__all__ = ["detect_launcher", "mpi_world", "mpi_exchange", "mpi_agree", "mpi_wait"]

_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE", "PMI_RANK")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def detect_launcher() -> str:
    """``"mpi"`` under mpirun/mpiexec, ``"torchrun"`` under torchrun (or its variables), else ``"single"``."""
    if any(v in os.environ for v in _MPI_VARS):
        return "mpi"
    if "TORCHELASTIC_RUN_ID" in os.environ or all(v in os.environ for v in _TORCHRUN_VARS):
        return "torchrun"
    return "single"


def mpi_world() -> Any:
    """``MPI.COMM_WORLD``, with a clear error when mpi4py is missing."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            f"moecomm: the MPI backend and MPI launch need mpi4py and an MPI library "
            f"(pip install 'moecomm[mpi]'): {exc}"
        ) from None
    return MPI.COMM_WORLD


def mpi_exchange(comm: Any, payload: bytes, *, root_only: bool, timeout_s: float, what: str) -> list[bytes]:
    """Broadcast (``root_only``) or all-gather a short byte string over MPI, with a timeout.

    Returns the list of every rank's payload (for a broadcast, a one-element list holding
    the root's). Payloads are padded to a fixed 256 bytes.
    """
    width = 256
    if len(payload) > width - 2:
        raise ValueError(f"bootstrap payload of {len(payload)} bytes exceeds {width - 2}")
    mine = np.zeros(width, dtype=np.uint8)
    mine[:2] = np.frombuffer(len(payload).to_bytes(2, "little"), dtype=np.uint8)
    mine[2:2 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    from mpi4py import MPI

    if root_only:
        out = mine
        req = comm.Ibcast([out, MPI.BYTE], root=0)
        rows = [out]
    else:
        out = np.zeros((comm.Get_size(), width), dtype=np.uint8)
        req = comm.Iallgather([mine, MPI.BYTE], [out, MPI.BYTE])
        rows = list(out)
    mpi_wait(req, timeout_s=timeout_s, what=what, rank=comm.Get_rank())
    return [bytes(r[2:2 + int.from_bytes(bytes(r[:2]), "little")]) for r in rows]


def mpi_wait(req: Any, *, timeout_s: float, what: str, rank: int) -> None:
    """Poll an mpi4py request until it completes; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not req.Test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"moecomm: {what} did not complete within {timeout_s:g} s on rank {rank}: "
                               f"some rank has not reached it")
        time.sleep(1e-4)


_ERROR_BYTES = 240


def mpi_agree(comm: Any, outcome: Union[bytes, BaseException], *, timeout_s: float, what: str) -> list[bytes]:
    """Collective: every rank learns whether every rank got this far, before anything blocks.

    ``outcome`` is this rank's payload (at most 250 bytes), or the exception it failed with:
    a failed rank still takes part. Returns every rank's payload when none failed. Otherwise a
    failed rank raises its own exception and the others raise ``RuntimeError`` naming the
    failed ranks and their errors. ``TimeoutError`` naming ``what`` if some rank does not
    take part within ``timeout_s``.
    """
    if isinstance(outcome, BaseException):
        text = f"{type(outcome).__name__}: {outcome}".encode(errors="replace")
        mine = b"\x00" + (text if len(text) <= _ERROR_BYTES else text[:_ERROR_BYTES - 3] + b"...")
    else:
        mine = b"\x01" + outcome
    try:
        rows = mpi_exchange(comm, mine, root_only=False, timeout_s=timeout_s,
                            what=f"{what} (the agreement that every rank has started)")
    except TimeoutError:
        if isinstance(outcome, BaseException):
            raise outcome from None
        raise
    if isinstance(outcome, BaseException):
        raise outcome
    failed = [(r, row[1:].decode(errors="replace")) for r, row in enumerate(rows) if row[:1] != b"\x01"]
    if failed:
        raise RuntimeError(f"{what} failed on " + "; ".join(f"rank {r}: {msg}" for r, msg in failed))
    return [row[1:] for row in rows]


def host_name() -> str:
    return socket.gethostname()
