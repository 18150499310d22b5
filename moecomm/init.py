"""``moecomm.init``: make a :class:`Communicator` for however this process was launched.

The checks that need no peer are here; the backend for the launch is made by
:mod:`moecomm.backends._select`, then the engine (:mod:`moecomm.engine.engine`, with the peer-memory
transport where it is on, and the host channel of :mod:`moecomm.backends._host_channel` where the
launch gives one) and the topology (:mod:`moecomm.collectives.topology`).
"""

from __future__ import annotations

import datetime
import weakref
from typing import Any, Optional, Union

import torch

from . import env
from .collectives import topology as _topology
from .engine.engine import COPY_ENGINE_MIN_BYTES, Engine
from .backends._host_channel import HostChannel
from .backends._select import make_backend
from .backends._p2p_default import resolve_p2p_bytes
from .communicator import Communicator
from .layout import Layout
from .pool import StagingPool

__all__ = ["init", "default_communicator", "set_default_communicator", "communicator_for", "BACKENDS"]

BACKENDS = ("auto", "mpi", "nccl", "peer", "torch", "self")

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
            group, as ``process_group=``; under an MPI launcher with CUDA, ``"peer"`` where ranks
            share a GPU), ``"mpi"``, ``"nccl"``, ``"peer"`` (ranks of one node through CUDA IPC
            peer memory, several per GPU allowed, no NCCL: :mod:`moecomm.backends.peer`; MPI
            launch only), ``"torch"`` or ``"self"`` (one process without a
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
        p2p_bytes: the peer backend: its arena per rank (bytes; default: ``4 * size`` regions
            of 32 MiB, see :func:`moecomm.backends.peer.default_arena_bytes`). NCCL backend on one node: device memory (bytes, per rank, allocated
            outside torch's caching allocator) for the peer-memory transport
            (:mod:`moecomm.backends.p2p`), which moves the rows of ``all_to_all_v`` with its
            counts still on the GPU in one round instead of two, and moves exchanges with
            known counts (from 16 MiB a rank, and every stage of ``scatter_compute_gather``)
            by copy engines instead of NCCL's kernels. Each source gets ``p2p_bytes / (4 *
            size)`` of it per exchange; rows beyond go through NCCL. Default (None): on where
            it can work (an NCCL communicator of 2 or more ranks over the whole launch, one
            node, every GPU able to map every other's memory; the ranks probe and agree),
            with ``4 * size * 128 MiB`` capped at 1/16 of the GPU's free memory (see
            :mod:`moecomm.backends._p2p_default`); elsewhere off, without error. 0: off. A positive
            int: that size; it needs every GPU pair to map the other's memory (NVLink or
            PCIe peer access), otherwise ValueError.
        p2p_min_bytes: with ``p2p_bytes``: a plain ``all_to_all_v`` (or ``all_to_all_single``,
            ``all_to_all``) with known counts moves by copy engines when this rank sends or
            receives at least this many bytes, through NCCL below (the stages of
            ``scatter_compute_gather`` always use the copy engines). An int >= 0; 0: always.
            Default (None): 16 MiB.

    Collective: every rank of the launch (or of ``process_group``) must call it. Under an MPI
    launcher it also registers, once per process, the exit hook of :mod:`moecomm.backends._exit`
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
    backend, timeout_s, validate, pool, problem = _first_checks(
        backend, timeout, validate, pool_bytes, max_ctas, p2p_bytes, p2p_min_bytes, hierarchy, local_size)
    backend_obj, hosts, rank, host = make_backend(backend, process_group, device, timeout_s, local_size, max_ctas,
                                                  p2p_bytes, problem)
    layout = (
        Layout.from_local_size(rank, len(hosts), local_size) if local_size is not None
        else Layout.from_hosts(rank, hosts)
    )
    engine, topology = _engine_and_topology(
        backend_obj, layout, hosts, pool, timeout_s, validate, host=host, p2p_bytes=p2p_bytes, p2p_min_bytes=p2p_min_bytes,
        process_group=process_group, hierarchy=hierarchy, profile=profile,
        local_size_given=local_size is not None)
    comm = Communicator(engine, layout, topology=topology)
    if set_default:
        set_default_communicator(comm)
    return comm


def _first_checks(backend: Optional[str], timeout: Any, validate: Any, pool_bytes: Any, max_ctas: Any,
                  p2p_bytes: Any, p2p_min_bytes: Any, hierarchy: Any, local_size: Any
                  ) -> tuple[str, float, bool, Optional[StagingPool], Optional[Exception]]:
    """Every check of :func:`init` that needs no peer: the backend's name, the timeout in
    seconds, ``validate``, the staging pool, and what was refused (None: nothing). Under a
    launcher a rank whose check failed still joins the agreement that follows, so that its
    peers raise instead of waiting; its timeout then falls back to the default."""
    try:
        backend = env.default_backend() if backend is None else backend
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        timeout_s, validate, pool = _check_options(timeout, validate, pool_bytes, max_ctas, p2p_bytes, p2p_min_bytes,
                                                   hierarchy, local_size)
    except (TypeError, ValueError) as exc:
        return backend, _fallback_seconds(timeout), False, None, exc
    return backend, timeout_s, validate, pool, None


def _engine_and_topology(backend_obj: Any, layout: Layout, hosts: list[str], pool: StagingPool, timeout_s: float,
                         validate: bool, *, host: Optional[HostChannel], p2p_bytes: Optional[int],
                         p2p_min_bytes: Optional[int],
                         process_group: Any, hierarchy: Optional[bool], profile: Any, local_size_given: bool
                         ) -> tuple[Engine, Optional[_topology.Topology]]:
    """The engine over ``backend_obj`` (with the peer-memory transport where
    :func:`moecomm.backends._p2p_default.resolve_p2p_bytes` gives it bytes) and the topology (the
    hierarchy groups); ``host``: the host channel, owned by the engine. On failure the engine
    is aborted."""
    engine = Engine(backend_obj, pool, timeout=timeout_s, validate=validate, host=host)
    try:
        if backend_obj.name == "peer":  # its own transport; the counts-on-the-GPU round where ranks run concurrently
            p2p_bytes = 0
            if backend_obj.gpu_counts_transport() is not None:
                engine = Engine(backend_obj, pool, timeout=timeout_s, validate=validate, host=host,
                                peer=backend_obj.gpu_counts_transport(), copy_engine_min_bytes=0)
        else:
            p2p_bytes = resolve_p2p_bytes(engine, layout.num_nodes, p2p_bytes, hosts, _whole_launch(process_group))
        if p2p_bytes:
            min_bytes = COPY_ENGINE_MIN_BYTES if p2p_min_bytes is None else p2p_min_bytes
            engine = Engine(backend_obj, pool, timeout=timeout_s, validate=validate, host=host,
                            peer=_peer_transport(engine, p2p_bytes, hosts), copy_engine_min_bytes=min_bytes)
        topology = _topology.build(engine, layout, sub_communicator=Communicator, hierarchy=hierarchy,
                                   profile=profile, hosts=hosts, local_size_given=local_size_given)
    except BaseException:
        engine.abort()
        raise
    return engine, topology


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
