"""How much peer memory ``moecomm.init`` gives a communicator: ``p2p_bytes`` resolved.

``init(p2p_bytes=None)`` (the default) turns the peer-memory transport
(:mod:`moecomm.backends.p2p`) on where it can work: an NCCL communicator of two or more ranks
over the whole launch (not one over a smaller torch group), on one node, where every rank's GPU
can map the memory of every other rank's GPU. The ranks decide together, so that none is left
on another path than its peers: each rank probes what it can see itself (the transport's
extension loads; its GPU has peer access to each peer's GPU; it can open each peer's small probe
buffer through CUDA IPC; the free memory of its GPU), and all ranks vote (two small
all-gathers). The transport is on only where every rank voted yes, with the smallest size any
rank proposed; otherwise the exchanges go through NCCL as without it. Rank 0 logs the outcome
once (``logging.INFO``, logger ``moecomm``); nothing is raised and nothing is warned.

The size rule (:func:`default_bytes`): ``4 * size * 128 MiB`` per rank, which gives every
source a region of about 128 MiB per exchange (``p2p_bytes / (4 * size)``): 1 GiB per rank on
2 ranks (the size the README's peer-memory measurements used), 4 GiB on 8. It is capped at
1/16 of the GPU's free memory when ``init`` runs and rounded down to 2 MiB; if the cap leaves a
region under 8 MiB the transport stays off.

``p2p_bytes=0`` turns it off on any backend; a positive ``p2p_bytes`` is used as given (and
raises where the transport cannot work, as before).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Optional, Sequence

import numpy as np
import torch

__all__ = ["resolve_p2p_bytes", "default_bytes", "REGION_BYTES", "FREE_FRACTION", "MIN_REGION_BYTES"]

_log = logging.getLogger("moecomm")

REGION_BYTES = 128 << 20
"""The default region per source and exchange: ``p2p_bytes = 4 * size * REGION_BYTES``."""
FREE_FRACTION = 16
"""The default takes at most ``1 / FREE_FRACTION`` of the GPU's free memory at ``init``."""
MIN_REGION_BYTES = 8 << 20
"""Below this region per source the default leaves the transport off."""
_ALIGN = 2 << 20
_PROBE_BYTES = 1 << 20
_HANDLE_INTS = 8  # a cudaIpcMemHandle_t is 64 bytes

# votes: 0 is yes; the others say why not (the detail: a rank, or MiB)
_YES, _NO_EXTENSION, _TOO_MANY_RANKS, _NO_PEER_ACCESS, _NO_IPC, _LOW_MEMORY, _PROBE_FAILED = range(7)


def default_bytes(size: int, free_bytes: int) -> int:
    """The default ``p2p_bytes`` for ``size`` ranks on a GPU with ``free_bytes`` free (0: off)."""
    n = min(4 * size * REGION_BYTES, free_bytes // FREE_FRACTION) // _ALIGN * _ALIGN
    return n if n >= 4 * size * MIN_REGION_BYTES else 0


def resolve_p2p_bytes(engine: Any, num_nodes: int, requested: Optional[int], hosts: Sequence[str],
                      whole_launch: bool) -> int:
    """The ``p2p_bytes`` to build the peer-memory transport of a communicator with (0: none):
    ``engine`` is its :class:`moecomm.engine.engine.Engine` (without a transport), ``num_nodes`` its
    node count.

    ``requested`` is ``init``'s argument (checked already): an int is returned as it is;
    None means the default rule of this module. ``hosts``: every rank's host name;
    ``whole_launch``: ``comm`` spans every rank of the launch (not a torch sub-group).

    Collective where the rule needs the probe (an NCCL communicator of 2 or more ranks over
    the whole launch on one node): every rank of ``comm`` must call it; elsewhere it sends
    nothing. Every rank returns the same value.
    """
    if requested is not None:
        return requested
    if engine.backend.name != "nccl" or engine.size < 2:
        return 0
    if not whole_launch or num_nodes > 1 or len(set(hosts)) > 1:
        if engine.rank == 0:
            _log.info("moecomm: peer-memory transport off (%s); exchanges go through NCCL",
                      "a communicator over part of the launch" if not whole_launch else
                      f"ranks on {max(num_nodes, len(set(hosts)))} nodes")
        return 0
    nbytes, why = _vote(engine)
    if engine.rank == 0:
        if nbytes:
            _log.info("moecomm: peer-memory transport on, p2p_bytes=%d (%d MiB of GPU memory per rank; "
                      "init(p2p_bytes=0) turns it off)", nbytes, nbytes >> 20)
        else:
            _log.info("moecomm: peer-memory transport off (%s); exchanges go through NCCL", why)
    return nbytes


def _vote(engine: Any) -> tuple[int, str]:
    """Probe this rank, vote, and return (the agreed size or 0, why it is 0)."""
    me, size = engine.rank, engine.size
    dev = engine.device.index
    ext: Any = None
    base = 0
    vote, detail = _YES, 0
    handle = [0] * _HANDLE_INTS
    try:
        ext = _load_ext()
        if size > ext.max_copy_engine_ranks():
            vote, detail = _TOO_MANY_RANKS, ext.max_copy_engine_ranks()
        else:
            base = ext.alloc(dev, _PROBE_BYTES)
            handle = _handle_ints(ext.ipc_handle(base))
    except Exception:  # noqa: BLE001 - any failure to load or allocate is a "no"
        _clear_cuda_error()
        vote = _NO_EXTENSION
    try:
        table = engine.gather_ints([vote, dev] + handle, "moecomm.init (peer-memory probe)")
        proposal = 0
        try:  # whatever fails here, this rank still votes: its peers wait for the vote
            if all(row[0] == _YES for row in table):
                vote, detail = _check_peers(ext, me, dev, table)
            if vote == _YES:
                free = _free_bytes(engine.device)
                proposal = default_bytes(size, free)
                if not proposal:
                    vote, detail = _LOW_MEMORY, free >> 20
        except Exception:  # noqa: BLE001
            vote, detail, proposal = _PROBE_FAILED, 0, 0
        votes = engine.gather_ints([vote, detail, proposal], "moecomm.init (peer-memory vote)")
    finally:
        if base:  # every peer closed its mapping of it before it voted
            ext.free(base)
    for r, (v, d, _) in enumerate(votes):
        if v != _YES:
            return 0, f"rank {r}: {_why(v, d)}"
    return min(p for _, _, p in votes), ""


def _check_peers(ext: Any, me: int, dev: int, table: list) -> tuple[int, int]:
    """Peer access to every peer's GPU, and each peer's probe buffer opened (and closed) through IPC."""
    for p, row in enumerate(table):
        if p == me:
            continue
        try:  # raises for an index this process does not see (CUDA_VISIBLE_DEVICES differing by rank)
            ok = ext.can_access_peer(dev, row[1])
        except Exception:  # noqa: BLE001
            _clear_cuda_error()
            ok = False
        if not ok:
            return _NO_PEER_ACCESS, p
    for p, row in enumerate(table):
        if p == me:
            continue
        try:
            ext.ipc_close(ext.ipc_open(dev, np.array(row[2:], dtype=np.int64).tobytes()))
        except Exception:  # noqa: BLE001
            _clear_cuda_error()
            return _NO_IPC, p
    return _YES, 0


def _why(vote: int, detail: int) -> str:
    return {
        _NO_EXTENSION: "the peer-memory CUDA extension cannot be loaded or its probe buffer allocated",
        _TOO_MANY_RANKS: f"the peer-memory transport serves at most {detail} ranks",
        _NO_PEER_ACCESS: f"its GPU cannot map the memory of rank {detail}'s GPU",
        _NO_IPC: f"it cannot open rank {detail}'s memory through CUDA IPC",
        _LOW_MEMORY: f"{detail} MiB of GPU memory free, too little for the default size",
        _PROBE_FAILED: "its probe of the peers failed",
    }.get(vote, f"vote {vote}")


def _handle_ints(raw: bytes) -> list[int]:
    if len(raw) != 8 * _HANDLE_INTS:
        raise ValueError(f"an IPC handle of {len(raw)} bytes")
    return np.frombuffer(raw, dtype=np.int64).tolist()


def _load_ext() -> Any:
    from ._ext import load_p2p

    return load_p2p()


def _free_bytes(device: torch.device) -> int:
    return int(torch.cuda.mem_get_info(device)[0])


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error that a failed ``cudaIpcOpenMemHandle`` left, which
    torch's next kernel launch would otherwise report as its own failure."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass
