"""``moecomm.init``: make a :class:`Communicator` for however this process was launched."""

from __future__ import annotations

import datetime
import weakref
from typing import Any, Optional, Union

import torch

from . import _exit, _topology, env
from ._engine import Engine
from ._flat import COPY_ENGINE_MIN_BYTES
from ._p2p_default import resolve_p2p_bytes
from .communicator import Communicator
from .launch import detect_launcher, host_name, mpi_agree, mpi_world
from .layout import Layout
from .pool import StagingPool

__all__ = ["init", "default_communicator", "set_default_communicator", "communicator_for", "BACKENDS"]

BACKENDS = ("auto", "mpi", "nccl", "torch", "self")

_default: dict[str, Communicator] = {}  # explicit registry: the communicator ``group=None`` means


def default_communicator() -> Communicator:
    """The communicator made by the last :func:`init` with ``set_default=True``.

    Without one, when ``torch.distributed`` is initialized: the communicator bound to its
    default process group (made on first use, a collective call, and kept).

    Raises:
        RuntimeError: neither exists.
    """
    comm = _default.get("default")
    if comm is not None and not comm.closed:
        return comm
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return communicator_for(dist.group.WORLD)
    raise RuntimeError("moecomm: no default communicator: call moecomm.init() first, or pass group= "
                       "(a moecomm.Communicator or a torch ProcessGroup)")


_bound: "weakref.WeakKeyDictionary[Any, Communicator]" = weakref.WeakKeyDictionary()
"""Explicit cache: the communicator made for each torch ProcessGroup."""


def communicator_for(group: Any = None) -> Communicator:
    """The communicator that ``group`` means: None the default communicator (see
    :func:`default_communicator`), a :class:`Communicator` itself, a torch ``ProcessGroup``
    the communicator bound to it (made on first use, a collective call, and kept).

    Raises:
        RuntimeError: ``group`` is None and there is neither a default communicator nor an
            initialized torch.distributed.
        TypeError: ``group`` is of another type.
    """
    if group is None:
        return default_communicator()
    if isinstance(group, Communicator):
        return group
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        comm = _bound.get(group)
        if comm is None or comm.closed:
            comm = init(process_group=group, set_default=False)
            _bound[group] = comm
        return comm
    raise TypeError(f"group must be None, a moecomm.Communicator or a torch ProcessGroup, got {type(group).__name__}")


def set_default_communicator(comm: Optional[Communicator]) -> None:
    """Make ``comm`` what ``group=None`` means in :mod:`moecomm.distributed` (None clears it)."""
    if comm is None:
        _default.pop("default", None)
    elif not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a moecomm.Communicator or None, got {type(comm).__name__}")
    else:
        _default["default"] = comm


def _seconds(timeout: Union[None, float, int, datetime.timedelta]) -> float:
    if timeout is None:
        return env.default_timeout()
    if isinstance(timeout, datetime.timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds (float) or a datetime.timedelta, got {timeout!r}")
    if not value > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {value}")
    return value


def init(
    backend: Optional[str] = None,
    *,
    process_group: Any = None,
    device: Union[None, int, str, torch.device] = None,
    timeout: Union[None, float, datetime.timedelta] = None,
    validate: Optional[bool] = None,
    local_size: Optional[int] = None,
    pool_bytes: Optional[int] = None,
    set_default: bool = True,
    hierarchy: Optional[bool] = None,
    profile: Any = None,
    max_ctas: Optional[int] = None,
    p2p_bytes: Optional[int] = None,
    p2p_min_bytes: Optional[int] = None,
) -> Communicator:
    """Create a communicator over every rank of this launch (or of ``process_group``).

    Args:
        backend: ``"auto"`` (NCCL where CUDA and nccl4py are available, else MPI under an
            MPI launcher, torch.distributed/gloo under torchrun, ``"self"`` in a single
            process; without a launcher but with torch.distributed initialized, its default
            group, as ``process_group=``), ``"mpi"``, ``"nccl"``, ``"torch"`` or ``"self"`` (one process without a
            launcher, CPU: collectives are copies; needs no mpi4py). In a single process
            ``"torch"`` makes a one-rank gloo group on an in-process store if
            torch.distributed is not initialized. Default: ``$MOECOMM_BACKEND`` or "auto".
        process_group: an initialized torch.distributed group to build on (same ranks). An
            NCCL group gets an nccl4py communicator bootstrapped through it; any other group
            runs the collectives through torch.distributed (``backend="torch"``).
        device: the CUDA device for NCCL (default: ``cuda:local_rank``).
        timeout: seconds (or a timedelta) any wait may last before the communicator is
            aborted and ``TimeoutError`` raised. Default: ``$MOECOMM_TIMEOUT`` or 600.
        validate: True or False. True: every exchange checks, before anything moves, that
            the ranks agree on counts, dtype and row shape (one all-gather that blocks the
            host), also where all counts are given; False checks only what the count exchange
            of a call without ``recv_splits`` carries (see the README, "Bad input and
            faults"). Default (None): ``$MOECOMM_VALIDATE`` or False.
        local_size: ranks per node, overriding host-name discovery (tests, simulations).
        pool_bytes: staging-pool capacity, an int of bytes >= 0. Default (None):
            ``$MOECOMM_POOL_BYTES`` or 256 MiB.
        set_default: make it the communicator that ``group=None`` means.
        hierarchy: build the intra-node and rail sub-communicators that
            ``all_to_all_v(algorithm="2dh")`` needs (collective, once, here). Default: when
            ``num_nodes > 1 and local_size > 1``, or when ``local_size`` is given. True with
            nodes of unequal size raises ValueError naming the node sizes.
        profile: the topology profile ``algorithm="auto"`` follows: a path or a
            :class:`moecomm.profile.Profile`. Default: ``<dir>/<fingerprint>.json`` if it
            exists, ``<dir>`` = ``$MOECOMM_PROFILE_DIR`` or ``~/.cache/moecomm/profiles``;
            without one, "auto" follows the rule in :mod:`moecomm.hierarchical`.
        max_ctas: NCCL backend only: the most thread blocks (CTAs, one per SM) each of the
            communicator's kernels may occupy, 1 to 32 (NCCL's ``ncclConfig_t.maxCTAs``).
            Fewer leave more SMs to compute that runs beside the exchanges (overlap), at
            some cost in bandwidth. Default: NCCL's own choice.
        p2p_bytes: NCCL backend on one node: device memory (bytes, per rank, allocated
            outside torch's caching allocator) for the peer-memory transport
            (:mod:`moecomm.backends.p2p`), which moves the rows of ``all_to_all_v`` with its
            counts still on the GPU in one round instead of two, and moves exchanges with
            known counts (from 16 MiB a rank, and every stage of ``scatter_compute_gather``)
            by copy engines instead of NCCL's kernels. Each source gets ``p2p_bytes / (4 *
            size)`` of it per exchange; rows beyond go through NCCL. Default (None): on where
            it can work (an NCCL communicator of 2 or more ranks over the whole launch, one
            node, every GPU able to map every other's memory; the ranks probe and agree),
            with ``4 * size * 128 MiB`` capped at 1/16 of the GPU's free memory (see
            :mod:`moecomm._p2p_default`); elsewhere off, without error. 0: off. A positive
            int: that size; it needs every GPU pair to map the other's memory (NVLink or
            PCIe peer access), otherwise ValueError.
        p2p_min_bytes: with ``p2p_bytes``: a plain ``all_to_all_v`` (or ``all_to_all_single``,
            ``all_to_all``) with known counts moves by copy engines when this rank sends or
            receives at least this many bytes, through NCCL below (the stages of
            ``scatter_compute_gather`` always use the copy engines). An int >= 0; 0: always.
            Default (None): 16 MiB.

    Collective: every rank of the launch (or of ``process_group``) must call it. Under an MPI
    launcher it also registers, once per process, the exit hook of :mod:`moecomm._exit`
    (a process that failed does not wait in MPI finalization for a stuck peer).

    Raises:
        TypeError: ``validate`` not a bool or None; ``pool_bytes`` not an int or None;
            another argument of the wrong type (the message names it), before anything is sent.
        ValueError: an argument out of range (the message names it), before anything is sent.
        RuntimeError: ``moecomm.init failed on rank R: ...``: another rank's arguments were
            refused (every rank raises; none waits for the failed one).
        TimeoutError: some rank did not join a step of the creation within ``timeout``
            (named: ``moecomm.init``, ``MPI_Comm_idup``, ``ncclCommInitRank``, ...).
    """
    # Every check that needs no peer comes first; under a launcher a rank whose check failed
    # still joins the agreement that follows, so that its peers raise instead of waiting.
    problem: Optional[Exception] = None
    try:
        backend = env.default_backend() if backend is None else backend
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        timeout_s, validate, pool = _check_options(timeout, validate, pool_bytes, max_ctas, p2p_bytes, p2p_min_bytes,
                                                   hierarchy, local_size)
    except (TypeError, ValueError) as exc:
        problem = exc
        timeout_s = _fallback_seconds(timeout)

    if process_group is not None:
        backend_obj, hosts, rank = _from_process_group(process_group, backend, device, timeout_s, None, max_ctas,
                                                       p2p_bytes, problem)
    else:
        backend_obj, hosts, rank = _from_launcher(backend, device, timeout_s, local_size, max_ctas, p2p_bytes, problem)
    layout = (
        Layout.from_local_size(rank, len(hosts), local_size) if local_size is not None
        else Layout.from_hosts(rank, hosts)
    )
    engine = Engine(backend_obj, pool, timeout=timeout_s, validate=validate)
    try:
        p2p_bytes = resolve_p2p_bytes(engine, layout.num_nodes, p2p_bytes, hosts, _whole_launch(process_group))
        if p2p_bytes:
            min_bytes = COPY_ENGINE_MIN_BYTES if p2p_min_bytes is None else p2p_min_bytes
            engine = Engine(backend_obj, pool, timeout=timeout_s, validate=validate,
                            peer=_peer_transport(engine, p2p_bytes, hosts), copy_engine_min_bytes=min_bytes)
        topology = _topology.build(engine, layout, sub_communicator=Communicator, hierarchy=hierarchy,
                                   profile=profile, hosts=hosts, local_size_given=local_size is not None)
    except BaseException:
        engine.abort()
        raise
    comm = Communicator(engine, layout, topology=topology)
    if set_default:
        set_default_communicator(comm)
    return comm


def _check_options(timeout: Any, validate: Any, pool_bytes: Any, max_ctas: Any, p2p_bytes: Any, p2p_min_bytes: Any,
                   hierarchy: Any, local_size: Any) -> tuple[float, bool, StagingPool]:
    """The checks of :func:`init` that need no peer (``TypeError``/``ValueError`` naming the
    argument): the timeout in seconds, ``validate`` and the staging pool."""
    timeout_s = _seconds(timeout)
    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate must be True, False or None (None: $MOECOMM_VALIDATE or False), "
                        f"got {validate!r} ({type(validate).__name__})")
    validate = env.default_validate() if validate is None else validate
    if pool_bytes is not None and (isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int)):
        raise TypeError(f"pool_bytes must be an int (bytes) or None, got {pool_bytes!r} "
                        f"({type(pool_bytes).__name__})")
    if pool_bytes is not None and pool_bytes < 0:
        raise ValueError(f"pool_bytes must be >= 0 (bytes), got {pool_bytes}")
    pool = StagingPool(env.default_pool_bytes() if pool_bytes is None else pool_bytes)
    if max_ctas is not None and (isinstance(max_ctas, bool) or not isinstance(max_ctas, int)
                                 or not 1 <= max_ctas <= 32):
        raise ValueError(f"max_ctas must be an int from 1 to 32 (or None), got {max_ctas!r}")
    if p2p_bytes is not None and (isinstance(p2p_bytes, bool) or not isinstance(p2p_bytes, int) or p2p_bytes < 0):
        raise ValueError(f"p2p_bytes must be an int of bytes >= 0 (0: off) or None (the default rule), "
                         f"got {p2p_bytes!r}")
    if p2p_min_bytes is not None and (isinstance(p2p_min_bytes, bool) or not isinstance(p2p_min_bytes, int)
                                      or p2p_min_bytes < 0):
        raise ValueError(f"p2p_min_bytes must be an int >= 0 (bytes) or None, got {p2p_min_bytes!r}")
    if hierarchy is not None and not isinstance(hierarchy, bool):
        raise TypeError(f"hierarchy must be True, False or None, got {hierarchy!r}")
    if local_size is not None and (isinstance(local_size, bool) or not isinstance(local_size, int)
                                   or local_size < 1):
        raise ValueError(f"local_size must be a positive int or None, got {local_size!r}")
    return timeout_s, validate, pool


def _fallback_seconds(timeout: Any) -> float:
    """The deadline of the agreement when this rank's own ``timeout`` was refused."""
    for candidate in (timeout, None):
        try:
            return _seconds(candidate)
        except (TypeError, ValueError):
            continue
    return 600.0


def _whole_launch(process_group: Any) -> bool:
    """Whether the communicator spans every rank of the launch (False: a torch sub-group)."""
    if process_group is None:
        return True
    import torch.distributed as dist

    return dist.get_world_size(process_group) == dist.get_world_size()


def _peer_transport(engine: Engine, p2p_bytes: int, hosts: list) -> Any:
    """The peer-memory transport, set up through ``engine`` (which has none)."""
    if len(set(hosts)) != 1:
        raise ValueError(f"p2p_bytes needs every rank on one host (peer memory), but the ranks run on "
                         f"{len(set(hosts))} hosts")
    from .backends.p2p import PeerTransport

    return PeerTransport(engine, p2p_bytes)


def _cuda_device(device: Union[None, int, str, torch.device], local_rank: int) -> torch.device:
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
    for name, value in options.items():
        if value is not None and backend != "nccl":
            raise ValueError(f"{name} applies to the NCCL backend only; this communicator's backend is {backend!r}")


def _from_launcher(backend: str, device: Any, timeout_s: float, local_size: Optional[int], max_ctas: Optional[int],
                   p2p_bytes: Optional[int], problem: Optional[Exception]):
    nccl_only = {"max_ctas": max_ctas, "p2p_bytes": p2p_bytes or None}  # p2p_bytes=0 (off) fits any backend
    from .backends.nccl import NcclBackend, nccl_available

    launcher = detect_launcher()
    if launcher == "single" and backend == "auto" and _torch_dist_initialized():
        # processes started without a launcher's variables (torch.multiprocessing, say) that
        # made a torch.distributed group: build on it rather than on this process alone
        import torch.distributed as dist

        return _from_process_group(dist.group.WORLD, backend, device, timeout_s, local_size, max_ctas, p2p_bytes,
                                   problem)
    if launcher == "single" and problem is not None:
        raise problem  # no peers to tell
    if problem is None and backend == "auto":
        if nccl_available():
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
        _nccl_only(nccl_only, backend)
        if backend == "torch":
            raise ValueError("backend='torch' needs process_group= (or a torchrun launch)")
        outcome: Union[bytes, Exception] = host_name().encode()
    except (TypeError, ValueError) as exc:
        outcome = exc
    hosts = [h.decode() for h in mpi_agree(world, outcome, timeout_s=timeout_s, what="moecomm.init")]
    if backend == "mpi":
        from .backends.mpi import MpiBackend

        return MpiBackend(world, timeout_s), hosts, rank
    try:
        dev = _cuda_device(device, _local_rank(rank, hosts, local_size))
        outcome = NcclBackend.new_unique_id() if rank == 0 else b""
    except Exception as exc:  # noqa: BLE001 - named to every rank by the agreement
        outcome = exc
    uid = mpi_agree(world, outcome, timeout_s=timeout_s, what="moecomm.init (NCCL unique id)")[0]
    return NcclBackend.create(world.Get_size(), rank, uid, dev, timeout_s, max_ctas), hosts, rank


def _torch_dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _single_process(backend: str, device: Any, timeout_s: float, nccl_only: dict):
    """A communicator of size 1 without a launcher and without mpi4py."""
    _nccl_only(nccl_only, backend)
    if backend == "nccl":
        from .backends.nccl import NcclBackend

        dev = _cuda_device(device, 0)
        return NcclBackend.create(1, 0, NcclBackend.new_unique_id(), dev, timeout_s, nccl_only["max_ctas"]), \
            [host_name()], 0
    if device is not None and torch.device(device if not isinstance(device, int) else "cuda").type != "cpu":
        raise ValueError(f"device: a single-process {backend!r} communicator runs on the CPU, got {device!r}")
    if backend == "self":
        from .backends.single import SelfBackend

        return SelfBackend(), [host_name()], 0
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return _from_process_group(dist.group.WORLD, backend, None, timeout_s, None, None, None, None)


def _from_process_group(group: Any, backend: str, device: Any, timeout_s: float, local_size: Optional[int],
                        max_ctas: Optional[int], p2p_bytes: Optional[int], problem: Optional[Exception]):
    nccl_only = {"max_ctas": max_ctas, "p2p_bytes": p2p_bytes or None}  # p2p_bytes=0 (off) fits any backend
    import torch.distributed as dist

    from .backends.nccl import NcclBackend
    from .backends.torch_dist import TorchBackend

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
    if backend == "torch":
        dev = torch.device("cpu") if "nccl" not in pg_backend else _cuda_device(device, _local_rank(rank, hosts, local_size))
        return TorchBackend(group, dev), hosts, rank
    dev = _cuda_device(device, _local_rank(rank, hosts, local_size))
    box = [NcclBackend.new_unique_id() if rank == 0 else None]
    if "nccl" in pg_backend:
        torch.cuda.set_device(dev)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return NcclBackend.create(size, rank, box[0], dev, timeout_s, max_ctas), hosts, rank

