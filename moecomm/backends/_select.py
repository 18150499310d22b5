"""The backend under a new communicator, for however this process was launched: an MPI
launcher, torchrun, an explicit torch ``process_group``, or a single process without a
launcher; ``backend="auto"`` resolved there.

Every path joins an agreement among the ranks before a backend is created, so that a rank
whose arguments :func:`moecomm.init` refused (``problem``) makes every peer raise instead of
waiting for it.

Beside the backend it makes the host channel of the short integer agreements
(:mod:`moecomm.backends._host_channel`), where the launch has one: under an MPI launcher a duplicate of
``COMM_WORLD`` for NCCL, a duplicate of the MPI backend's own communicator for MPI (so that an
agreement on one rank never meets an exchange of the backend on another: ranks that disagree
on what comes next wait and time out instead of reading each other's messages); over a torch
group whose CPU collectives run on gloo, that group. An NCCL-only group (and a single process)
has none.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Optional, Union

import torch

from . import _exit
from ._host_channel import GlooHostChannel, HostChannel, MpiHostChannel, gloo_capable
from .base import Backend
from ..launch import detect_launcher, host_name, mpi_agree, mpi_world
from ..layout import Layout

__all__ = ["make_backend"]

_LOG = logging.getLogger("moecomm")


Made = tuple[Backend, list[str], int, Optional[HostChannel]]


def make_backend(backend: str, process_group: Any, device: Any, timeout_s: float, local_size: Optional[int],
                 max_ctas: Optional[int], p2p_bytes: Optional[int], problem: Optional[Exception]) -> Made:
    """The backend, every rank's host name, this rank and the host channel (None: none), over
    ``process_group`` when given, else over the launch. ``problem``: what this rank's own
    checks refused (raised to every rank through the agreement, or here where there are no
    peers).

    Raises:
        TypeError, ValueError: this rank's arguments were refused (``problem``), or the
            backend does not fit the launch (``backend="mpi"`` under torchrun, ...).
        RuntimeError: another rank's arguments were refused; no CUDA device for NCCL.
        TimeoutError: some rank did not join within ``timeout_s``.
    """
    if process_group is not None:
        return _from_process_group(process_group, backend, device, timeout_s, None, max_ctas, p2p_bytes, problem)
    return _from_launcher(backend, device, timeout_s, local_size, max_ctas, p2p_bytes, problem)


def _cuda_device(device: Union[None, int, str, torch.device], local_rank: int) -> torch.device:
    """The CUDA device of an NCCL communicator: ``device`` as given (an index, a name, a
    device), or ``cuda:<local_rank modulo the GPU count>`` where no index is given."""
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("moecomm: backend 'nccl' needs a CUDA device, and none is available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device for backend 'nccl', got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    return dev


def _local_rank(rank: int, hosts: list[str], local_size: Optional[int]) -> int:
    """The rank's index on its real host (a simulated ``local_size`` must not pick the GPU)."""
    return Layout.from_hosts(rank, hosts).local_rank


def _nccl_only(options: dict, backend: str) -> None:
    """Refuse the options (name -> value, None: not given) that only the NCCL backend takes."""
    for name, value in options.items():
        if value is not None and backend != "nccl":
            raise ValueError(f"{name} applies to the NCCL backend only; this communicator's backend is {backend!r}")


def _from_launcher(backend: str, device: Any, timeout_s: float, local_size: Optional[int], max_ctas: Optional[int],
                   p2p_bytes: Optional[int], problem: Optional[Exception]) -> Made:
    """Under an MPI launcher: MPI or NCCL (its unique id agreed over MPI); under torchrun or
    in a process that made a torch.distributed group: :func:`_from_process_group`; alone:
    :func:`_single_process`."""
    nccl_only = {"max_ctas": max_ctas, "p2p_bytes": p2p_bytes or None}  # p2p_bytes=0 (off) fits any backend
    from .nccl import NcclBackend, nccl_available

    launcher = detect_launcher()
    if launcher == "single" and backend == "auto" and _torch_dist_initialized():
        # processes started without a launcher's variables (torch.multiprocessing, say) that
        # made a torch.distributed group: build on it rather than on this process alone
        import torch.distributed as dist

        return _from_process_group(dist.group.WORLD, backend, device, timeout_s, local_size, max_ctas, p2p_bytes,
                                   problem)
    if launcher == "single" and problem is not None:
        raise problem  # no peers to tell
    gpu_auto = False  # under an MPI launcher with CUDA: NCCL, or peer memory where ranks share a GPU
    if problem is None and backend == "auto":
        if launcher == "mpi" and torch.cuda.is_available() and _peer_available():
            backend, gpu_auto = "nccl", True
        elif nccl_available():
            backend = "nccl"
        else:
            backend = {"torchrun": "torch", "single": "self"}.get(launcher, "mpi")
    if backend == "self" and launcher != "single":
        raise ValueError(f"backend='self' is for a single process without a launcher; this one runs under {launcher}")
    if launcher == "single" and backend in ("self", "torch", "nccl"):
        return _single_process(backend, device, timeout_s, nccl_only)
    if launcher == "torchrun":
        if problem is None and backend == "mpi":
            problem = ValueError(
                "backend='mpi' needs an MPI launcher (mpirun/mpiexec); under torchrun use 'torch' or 'nccl'"
            )
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return _from_process_group(dist.group.WORLD, backend, device, timeout_s, local_size, max_ctas, p2p_bytes,
                                   problem)

    world = mpi_world()
    _exit.arm(world, timeout_s)
    rank = world.Get_rank()
    try:
        if problem is not None:
            raise problem
        _nccl_only(nccl_only, "nccl" if backend == "peer" else backend)
        if backend == "torch":
            raise ValueError("backend='torch' needs process_group= (or a torchrun launch)")
        if backend == "peer" and p2p_bytes == 0:
            raise ValueError("p2p_bytes=0 turns peer memory off, and the peer backend is made of it: give a size "
                             "(bytes) or None (the default)")
        outcome: Union[bytes, Exception] = host_name().encode()
    except (TypeError, ValueError) as exc:
        outcome = exc
    hosts = [h.decode() for h in mpi_agree(world, outcome, timeout_s=timeout_s, what="moecomm.init")]
    if backend == "mpi":
        return _mpi_backend(world, timeout_s, hosts, rank)
    try:
        dev = _cuda_device(device, _local_rank(rank, hosts, local_size))
        outcome = _gpu_uuid(dev).encode()
    except Exception as exc:  # noqa: BLE001 - named to every rank by the agreement
        outcome = exc
    uuids = [u.decode() for u in mpi_agree(world, outcome, timeout_s=timeout_s, what="moecomm.init (GPUs)")]
    backend = _gpu_backend(backend, gpu_auto, uuids, hosts, rank)  # the same on every rank, or the same error
    if backend == "mpi":
        return _mpi_backend(world, timeout_s, hosts, rank)
    if backend == "peer":
        from .peer import PeerBackend

        host = MpiHostChannel(world, timeout_s)
        try:
            peer = PeerBackend.create(MpiHostChannel(world, timeout_s), dev, timeout_s, p2p_bytes, uuids)
        except BaseException:
            host.abort()
            raise
        return peer, hosts, rank, host
    try:
        outcome = NcclBackend.new_unique_id() if rank == 0 else b""
    except Exception as exc:  # noqa: BLE001 - named to every rank by the agreement
        outcome = exc
    uid = mpi_agree(world, outcome, timeout_s=timeout_s, what="moecomm.init (NCCL unique id)")[0]
    host = MpiHostChannel(world, timeout_s)  # every rank passed the agreement: all make it
    try:
        nccl = NcclBackend.create(world.Get_size(), rank, uid, dev, timeout_s, max_ctas)
    except BaseException:
        host.abort()
        raise
    return nccl, hosts, rank, host


def _mpi_backend(world: Any, timeout_s: float, hosts: list[str], rank: int) -> Made:
    from .mpi import MpiBackend

    mpi = MpiBackend(world, timeout_s)
    try:  # a duplicate: agreements never meet the backend's own collectives
        return mpi, hosts, rank, MpiHostChannel(mpi.mpi_comm, timeout_s)
    except BaseException:
        mpi.abort()
        raise


def _peer_available() -> bool:
    """True where the peer backend can be made: CUDA runtime bindings import."""
    try:
        from . import _cudart  # noqa: F401  (import check only)
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def _gpu_uuid(dev: torch.device) -> str:
    """The GPU's UUID (what tells two ranks that they share one), else its PCI bus id; where
    the device cannot be queried (no CUDA: a stand-in device in tests), a name no other
    process has, so that no sharing is claimed."""
    if not torch.cuda.is_available():
        return f"unqueried-{os.getpid()}-{dev}"
    props = torch.cuda.get_device_properties(dev)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"pci-{props.pci_bus_id}-{props.pci_device_id}"


def _gpu_backend(backend: str, auto: bool, uuids: list[str], hosts: list[str], rank: int) -> str:
    """The GPU backend once every rank's GPU is known: ``"auto"`` (``auto``) takes the peer
    backend where ranks share a GPU, else NCCL where nccl4py is there, else MPI. NCCL asked
    for on a shared GPU is refused (NCCL cannot run two ranks on one GPU).

    Raises:
        ValueError: ``backend="nccl"`` while ranks share a GPU (the message names the GPU,
            the ranks and the backend to use); the same on every rank.
    """
    from .nccl import nccl_available
    from .peer import shared_gpus

    shared = shared_gpus(uuids, hosts)
    if auto:
        if shared:
            if rank == 0:
                (host, gpu), ranks = next(iter(shared.items()))
                _LOG.info("moecomm: backend 'auto' chose 'peer' (peer memory, no NCCL): ranks %s share GPU %s on %s",
                          ranks, gpu, host)
            return "peer"
        return "nccl" if nccl_available() else "mpi"
    if backend == "nccl" and shared:
        (host, gpu), ranks = next(iter(shared.items()))
        raise ValueError(f"backend='nccl' cannot run ranks {ranks} on one GPU ({gpu} on host {host}): NCCL needs a "
                         f"GPU per rank. Use backend='peer' (peer memory, several ranks per GPU; 'auto' picks it), "
                         f"or give each rank its own GPU (device=)")
    return backend


def _torch_dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _single_process(backend: str, device: Any, timeout_s: float, nccl_only: dict) -> Made:
    """A communicator of size 1 without a launcher and without mpi4py."""
    _nccl_only(nccl_only, backend)
    if backend == "nccl":
        from .nccl import NcclBackend

        dev = _cuda_device(device, 0)
        return NcclBackend.create(1, 0, NcclBackend.new_unique_id(), dev, timeout_s, nccl_only["max_ctas"]), \
            [host_name()], 0, None
    if device is not None and torch.device(device if not isinstance(device, int) else "cuda").type != "cpu":
        raise ValueError(f"device: a single-process {backend!r} communicator runs on the CPU, got {device!r}")
    if backend == "self":
        from .single import SelfBackend

        return SelfBackend(), [host_name()], 0, None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return _from_process_group(dist.group.WORLD, backend, None, timeout_s, None, None, None, None)


def _from_process_group(group: Any, backend: str, device: Any, timeout_s: float, local_size: Optional[int],
                        max_ctas: Optional[int], p2p_bytes: Optional[int], problem: Optional[Exception]) -> Made:
    """Over a torch.distributed ``group``: NCCL (unique id broadcast through the group) for
    an NCCL group under ``"auto"``, else the torch backend; the host-name exchange is the
    agreement that every rank's arguments passed. The host channel: ``group`` itself where
    its CPU collectives run on gloo (so never for an NCCL-only group)."""
    nccl_only = {"max_ctas": max_ctas, "p2p_bytes": p2p_bytes or None}  # p2p_bytes=0 (off) fits any backend
    import torch.distributed as dist

    from .nccl import NcclBackend
    from .torch_dist import TorchBackend

    if not dist.is_initialized():
        raise RuntimeError("process_group given, but torch.distributed is not initialized")
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    pg_backend = str(dist.get_backend(group)).lower()
    try:
        if problem is not None:
            raise problem
        if backend == "auto":
            backend = "nccl" if "nccl" in pg_backend else "torch"
        if backend == "mpi":
            raise ValueError("backend='mpi' cannot be built on a torch process_group; use 'torch' or 'nccl'")
        if backend == "peer":
            raise ValueError("backend='peer' is made under an MPI launcher (mpirun/mpiexec), not on a torch "
                             "process_group or under torchrun")
        _nccl_only(nccl_only, backend)
        mine: tuple = (host_name(), None)
    except (TypeError, ValueError) as exc:
        mine = (None, exc)
    # The host-name exchange doubles as the agreement that every rank's arguments passed.
    rows: list[Any] = [None] * size
    dist.all_gather_object(rows, (mine[0], None if mine[1] is None else f"{type(mine[1]).__name__}: {mine[1]}"),
                           group=group)
    if mine[1] is not None:
        raise mine[1]
    failed = [(r, msg) for r, (_, msg) in enumerate(rows) if msg is not None]
    if failed:
        raise RuntimeError("moecomm.init failed on " + "; ".join(f"rank {r}: {msg}" for r, msg in failed))
    hosts = [h for h, _ in rows]
    host = GlooHostChannel(group, timeout_s) if gloo_capable(group) else None
    if backend == "torch":
        dev = torch.device("cpu") if "nccl" not in pg_backend else _cuda_device(device, _local_rank(rank, hosts, local_size))
        return TorchBackend(group, dev), hosts, rank, host
    dev = _cuda_device(device, _local_rank(rank, hosts, local_size))
    box = [NcclBackend.new_unique_id() if rank == 0 else None]
    if "nccl" in pg_backend:
        torch.cuda.set_device(dev)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return NcclBackend.create(size, rank, box[0], dev, timeout_s, max_ctas), hosts, rank, host

