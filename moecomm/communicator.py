"""The :class:`Communicator`: variable-length collectives over one backend.

The collectives check their arguments and build on the communicator's engine
(:mod:`moecomm.engine.engine`: waits, count exchanges, the flat exchange); ``algorithm="2dh"`` and
``"auto"`` go through :mod:`moecomm.hierarchical`, ``wire_dtype`` through :mod:`moecomm.wire`,
``scatter_compute_gather`` through :mod:`moecomm.overlap`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Union

import torch

from . import hierarchical, overlap, wire
from .collectives import flat as _flat
from .engine.dtypes import SUPPORTED_DTYPES
from .engine.engine import Engine, warn_if_graph_lost
from .engine.notices import collective
from .collectives.small import OtherCollectives
from .engine.requests import Work
from .collectives.topology import Topology
from .layout import Layout
from .pool import PoolStats
from .splits import Splits, split_sizes

__all__ = ["Communicator", "Work", "SUPPORTED_DTYPES"]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors of one storage share bytes."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class Communicator(OtherCollectives):
    """Variable-length collectives among ``size`` ranks, over MPI, NCCL or torch.distributed.

    Made by :func:`moecomm.init` (or :meth:`split`); not constructed directly. Every method
    is collective: all ranks of the communicator call it in the same order.

    Attributes:
        rank, size: this rank and the number of ranks.
        backend: ``"mpi"``, ``"nccl"``, ``"torch"`` or ``"self"`` (one process).
        device: where tensors must live (``cpu`` or this rank's ``cuda:N``).
        local_rank, local_size, node_rank, num_nodes: the node layout (from host names, or
            from the ``local_size=`` override).
        timeout: seconds any wait may last before the communicator is aborted.
        validate: check that ranks agree on counts, dtype and row shape on every exchange,
            before anything moves (without it, MPI checks every exchange where its rows land,
            NCCL and gloo only exchanges that exchange counts).
        host_channel: the kind of host channel of the integer agreements (``"mpi"``, ``"gloo"``
            or None: through the device).
        engine, topology: internal (:mod:`moecomm.engine.engine`, :mod:`moecomm.collectives.topology`).
    """

    def __init__(self, engine: Engine, layout: Layout, *, topology: Optional[Topology] = None) -> None:
        """Internal: :func:`moecomm.init` builds the engine (with its peer transport) and the
        topology (with its hierarchy groups) first, then the communicator over them."""
        self._engine = engine
        self.layout = layout
        self._topology = topology

    # -- identity ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """Internal: the engine the collectives run on (:mod:`moecomm.engine.engine`)."""
        return self._engine

    @property
    def topology(self) -> Optional[Topology]:
        """Internal: the hierarchy groups, profile and fingerprint (:mod:`moecomm.collectives.topology`);
        None for a communicator made by :meth:`split`."""
        return self._topology

    @property
    def timeout(self) -> float:
        """Seconds any wait may last before the communicator is aborted (settable)."""
        return self._engine.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._engine.timeout = value

    @property
    def validate(self) -> bool:
        return self._engine.validate

    @validate.setter
    def validate(self, value: bool) -> None:
        self._engine.validate = bool(value)

    @property
    def rank(self) -> int:
        return self._engine.rank

    @property
    def size(self) -> int:
        return self._engine.size

    @property
    def backend(self) -> str:
        return self._engine.backend.name

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def local_rank(self) -> int:
        return self.layout.local_rank

    @property
    def local_size(self) -> int:
        return self.layout.local_size

    @property
    def node_rank(self) -> int:
        return self.layout.node_rank

    @property
    def num_nodes(self) -> int:
        return self.layout.num_nodes

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def __repr__(self) -> str:
        closed_as = self._engine.closed_as
        state = f", closed ({closed_as})" if closed_as else ""
        return (
            f"<moecomm.Communicator rank={self.rank}/{self.size} backend={self.backend} "
            f"device={self.device} nodes={self.num_nodes}x{self.local_size}{state}>"
        )

    def pool_stats(self) -> PoolStats:
        """Counters of the staging-buffer pool (bytes and hits/misses)."""
        return self._engine.pool.stats()

    # -- the variable-length all-to-all -----------------------------------------------------

    @collective("all_to_all_v")
    def all_to_all_v(
        self,
        input: torch.Tensor,
        send_splits: Splits,
        recv_splits: Optional[Splits] = None,
        *,
        async_op: bool = False,
        algorithm: str = "flat",
        wire_dtype: Optional[torch.dtype] = None,
    ) -> Union[tuple[torch.Tensor, list[int]], Work]:
        """Send rows of ``input`` to every rank, ``send_splits[p]`` rows to rank ``p``.

        Args:
            input: ``[N, *row_shape]`` on :attr:`device`, contiguous; rows grouped by
                destination rank in rank order.
            send_splits: ``size`` row counts summing to ``N``: a sequence of ints or a 1-D
                integer tensor (on the CPU or on the GPU, as MoE code has them).
            recv_splits: the ``size`` row counts this rank receives, if known; otherwise they
                are exchanged first (one small all-to-all, the call then blocks the host
                until the counts have arrived).
            async_op: return a :class:`Work` whose ``wait()`` gives the result.
            algorithm: ``"flat"`` (one all-to-all), ``"2dh"`` (hierarchical: inside the
                node, then along the rail; needs ``init(hierarchy=True)`` or a multi-node
                layout) or ``"auto"`` (the topology profile's choice for this size); the
                same result either way. See :mod:`moecomm.hierarchical`.
            wire_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``: rows of a
                float32/bfloat16/float16 ``input`` travel quantized to it, in blocks of 128
                elements with a float32 scale each, and ``output`` is dequantized back to
                ``input.dtype``: exactly :func:`moecomm.quant.quantize_rows` then
                :func:`moecomm.quant.dequantize_rows`, on every path (see :mod:`moecomm.wire`).
                Non-finite values give undefined results (``validate=True`` refuses them).

        Returns:
            ``(output, recv_splits)``: ``output`` is ``[sum(recv_splits), *row_shape]`` with
            the rows from rank ``p`` in block ``p``; ``recv_splits`` a list of ints.

        Raises:
            TypeError, ValueError: bad tensors, splits, ``algorithm`` or ``wire_dtype`` (not an
                FP8 dtype, or ``input`` not floating), named, before anything is sent; with
                ``validate=True`` also non-finite rows under ``wire_dtype`` (on every rank).
                A conjugate or negative view is resolved first (a copy); sparse tensors are
                refused. An input that requires grad warns: use :mod:`moecomm.functional`.
            CountMismatchError: a peer sends another count than ``recv_splits`` says, expects
                another than ``send_splits`` says, moves another dtype, row shape or wire
                dtype, or is in another exchange (it passed no ``recv_splits`` where this rank
                did, or runs a backward); raised on both ranks of each such pair, at completion
                (``wait()`` when ``async_op``). By default on MPI (tagged messages, see
                :mod:`moecomm.engine.tags`); on NCCL and gloo, with ``recv_splits`` given, only with
                ``validate=True`` (before anything moves).
            TimeoutError: a wait outlived the communicator's timeout (it is aborted).
            PeerFailedError: (MPI) a peer raised in this call before taking its part, or
                aborted the communicator: raised as soon as its failure notice arrives, naming
                it and quoting its error; the communicator is aborted here too (see
                :mod:`moecomm.engine.notices`). Also raised by the next call of a rank that
                raised while its peers waited for it (ranks that all raised alike go on).
        """
        warn_if_graph_lost(input, "all_to_all_v")
        if wire_dtype is not None:
            out, _, recv, request, _ = wire.start_all_to_all_v(self._engine, self._topology, input, send_splits,
                                                               recv_splits, algorithm, wire_dtype)
            return self._engine.finish(request, "all_to_all_v", (out, recv), async_op)
        out, _, recv, request = hierarchical.start_all_to_all_v(self._engine, self._topology, input, send_splits,
                                                                recv_splits, algorithm)
        return self._engine.finish(request, "all_to_all_v", (out, recv), async_op)

    @collective("all_to_all_v_packed")
    def all_to_all_v_packed(
        self,
        packed: torch.Tensor,
        send_splits: Splits,
        recv_splits: Optional[Splits] = None,
        *,
        row_shape: Sequence[int],
        dtype: torch.dtype,
        wire_dtype: torch.dtype,
        async_op: bool = False,
        algorithm: str = "flat",
    ) -> Union[tuple[torch.Tensor, list[int]], Work]:
        """:meth:`all_to_all_v` with ``wire_dtype`` for rows the caller has already quantized
        and packed, e.g. by :func:`moecomm.quant.gather_pack_rows` (a gather fused with the
        quantization, as the MoE layer's dispatch does): the packed rows travel as they are and
        arrive unpacked and dequantized to ``dtype``. ``all_to_all_v(x, ..., wire_dtype=w)``
        equals ``all_to_all_v_packed(quant.pack_rows(x, w, wire.WIRE_BLOCK), ...,
        row_shape=x.shape[1:], dtype=x.dtype, wire_dtype=w)`` bit for bit. Not differentiable.

        Args:
            packed: ``[N, quant.packed_row_bytes(D, 128)]`` uint8 on :attr:`device`,
                contiguous, ``D = prod(row_shape)``: rows packed with block
                :data:`moecomm.wire.WIRE_BLOCK` (128) in ``wire_dtype``.
            send_splits, recv_splits, async_op, algorithm: as in :meth:`all_to_all_v`.
            row_shape: the shape of one unpacked row (``()`` or more dimensions).
            dtype: float32, bfloat16 or float16: the dtype the rows are dequantized to.
            wire_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, the dtype they were
                packed in.

        Returns:
            ``(output, recv_splits)``: ``output`` is ``[sum(recv_splits), *row_shape]`` in
            ``dtype``; or a :class:`Work` (``async_op``).

        Raises:
            TypeError, ValueError: ``packed`` not uint8 of that shape (named), ``row_shape``
                not a tuple of non-negative ints, ``dtype`` or ``wire_dtype`` not one of the
                above, bad splits or ``algorithm``, before anything is sent; with
                ``validate=True`` also packed rows holding non-finite values (on every rank).
            CountMismatchError, TimeoutError, PeerFailedError: as :meth:`all_to_all_v`.
        """
        op = "all_to_all_v_packed"
        self._engine.check_open(op)
        x, shape = wire.check_packed(self._engine, packed, row_shape, dtype, wire_dtype)
        if self._engine.validate:
            wire.cross_check_packed(self._engine, x, math.prod(shape), dtype, wire_dtype, op)
        out, _, recv, request, _ = wire.start_packed_all_to_all_v(self._engine, self._topology, x, shape, dtype,
                                                                  send_splits, recv_splits, algorithm, wire_dtype)
        return self._engine.finish(request, op, (out, recv), async_op)

    # -- all-to-all overlapped with compute -------------------------------------------------

    @collective("scatter_compute_gather")
    def scatter_compute_gather(
        self,
        input: torch.Tensor,
        send_splits: Splits,
        fn: Callable[[torch.Tensor, Any], torch.Tensor],
        *,
        degree: Union[int, str] = 2,
        recv_splits: Optional[Splits] = None,
        algorithm: Optional[str] = None,
        own_first: bool = False,
        own_split: float = 0.3,
        wire_dtype: Optional[torch.dtype] = None,
        packed: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``all_to_all_v -> fn -> all_to_all_v`` back, pipelined in ``degree`` chunks per peer.

        ``fn(rows, chunk)`` runs on each chunk as it arrives (rows grouped by source rank,
        ``chunk`` a :class:`moecomm.overlap.Chunk`) while later chunks are in flight; each
        result is sent back as soon as it is ready. Returns ``[N, *fn_out_shape]`` in
        ``input``'s row order, exactly the non-overlapped result; differentiable (the backward
        is pipelined too). ``degree``: 1..16 or ``"auto"``. ``own_first``: ``fn`` runs first
        on the rank's own rows (which need no exchange and are not copied) while the peers'
        rows are in flight, forward and backward; ``own_split`` of them first, the rest last,
        while the peers' results travel home. ``wire_dtype``: the input's rows travel in that FP8
        dtype, as in :meth:`all_to_all_v` (results in their own dtype); ``packed``: those rows
        already packed (``quant.gather_pack_rows``), ``input`` then read for its shape only. See
        :mod:`moecomm.overlap`.

        Raises:
            TypeError, ValueError, CountMismatchError, TimeoutError: see
                :func:`moecomm.overlap.scatter_compute_gather`.
            PeerFailedError: as :meth:`all_to_all_v` (also where ``fn`` raised on a peer).
        """
        return overlap.scatter_compute_gather(self, input, send_splits, fn, degree=degree, recv_splits=recv_splits,
                                      algorithm=algorithm, own_first=own_first, own_split=own_split,
                                      wire_dtype=wire_dtype, packed=packed)

    # -- torch.distributed-compatible all-to-all --------------------------------------------

    @collective("all_to_all_single")
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Optional[Splits] = None,
        input_split_sizes: Optional[Splits] = None,
        async_op: bool = False,
    ) -> Optional[Work]:
        """``torch.distributed.all_to_all_single`` with its arguments and semantics.

        ``output`` is filled in place; split sizes of ``None`` mean equal blocks along dim 0.
        Returns a :class:`Work` (whose ``wait()`` returns True) when ``async_op``, else None.

        Raises:
            TypeError, ValueError: bad tensors or split sizes, named (``output`` when its size
                cannot hold what ``input`` sends this rank itself), before anything is sent.
            CountMismatchError: as :meth:`all_to_all_v` (a peer disagrees on a block's size).
                Equal blocks (no split sizes) on the peer backend with concurrent ranks (one GPU
                each, or sharing one under MPS) are not agreed on first: what every rank passes
                travels with the rows and is compared where they land, so a disagreement is
                raised at completion (``Work.synchronize()``, or the next call once the watchdog
                has seen it) and the communicator is aborted, as NCCL reports asynchronous
                errors; ``validate=True`` agrees first. Every rank must then pass no split
                sizes: a rank that passes them (even equal ones) while its peers do not is in
                another kind of exchange, and both sides time out.
            TimeoutError, PeerFailedError: as :meth:`all_to_all_v`.
        """
        op = "all_to_all_single"
        self._engine.check_open(op)
        warn_if_graph_lost(input, op)
        x = self._engine.check_tensor(input, "input", min_dim=1)
        y = self._engine.check_tensor(output, "output", min_dim=1, written=True)
        if y.dtype != x.dtype:
            raise TypeError(f"output must have input's dtype {x.dtype}, got {y.dtype}")
        if math.prod(y.shape[1:]) != math.prod(x.shape[1:]):
            raise ValueError(
                f"output rows must hold as many elements as input rows ({math.prod(x.shape[1:])}, "
                f"input shape {tuple(x.shape)}), got output shape {tuple(y.shape)}"
            )
        send = split_sizes(input_split_sizes, x.shape[0], self.size, "input_split_sizes", "input")
        recv = split_sizes(output_split_sizes, y.shape[0], self.size, "output_split_sizes", "output")
        r = self.rank
        if send[r] != recv[r]:
            raise ValueError(
                f"output (shape {tuple(y.shape)}) must hold, in block {r}, the {send[r]} rows input sends rank {r} "
                f"itself (input_split_sizes{'=None: equal blocks' if input_split_sizes is None else ''}), but "
                f"output_split_sizes{'=None: equal blocks' if output_split_sizes is None else ''} gives block {r} "
                f"{recv[r]} rows")
        request = _flat.start_all_to_all_single(self._engine, op, x, send, y, recv,
                                                equal=input_split_sizes is None and output_split_sizes is None)
        return self._engine.finish(request, op, True if async_op else None, async_op)

    @collective("all_to_all")
    def all_to_all(
        self,
        output_tensor_list: Sequence[torch.Tensor],
        input_tensor_list: Sequence[torch.Tensor],
        async_op: bool = False,
    ) -> Optional[Work]:
        """``torch.distributed.all_to_all``: ``input_tensor_list[p]`` goes to rank ``p``,
        ``output_tensor_list[p]`` is filled from rank ``p``; any shapes, one dtype.

        Raises:
            TypeError, ValueError: bad lists or tensors, named, before anything is sent.
            CountMismatchError: a slot's size (in bytes) differs from what its peer sends,
                or a peer sends another dtype; on both ranks of the pair.
            TimeoutError, PeerFailedError: as :meth:`all_to_all_v`.
        """
        op = "all_to_all"
        self._engine.check_open(op)
        for t in input_tensor_list if isinstance(input_tensor_list, (list, tuple)) else ():
            warn_if_graph_lost(t, op)
        for name, lst in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
            if not isinstance(lst, (list, tuple)) or len(lst) != self.size:
                raise ValueError(f"{name} must be a list of {self.size} tensors (one per rank), got {type(lst).__name__}"
                                 + (f" of length {len(lst)}" if isinstance(lst, (list, tuple)) else ""))
        ins = [self._engine.check_tensor(t, f"input_tensor_list[{i}]", min_dim=0) for i, t in enumerate(input_tensor_list)]
        outs = [self._engine.check_tensor(t, f"output_tensor_list[{i}]", min_dim=0, written=True)
                for i, t in enumerate(output_tensor_list)]
        for i, t in enumerate(outs):
            for j in range(i):
                o = outs[j]
                if t.numel() and o.numel() and t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() and \
                        _overlap(t, o):
                    raise ValueError(f"output_tensor_list[{i}] overlaps output_tensor_list[{j}] (the same memory): "
                                     f"each rank's rows need a tensor of their own")
        dtype = ins[0].dtype
        for i, t in enumerate(ins + outs):
            if t.dtype != dtype:
                name = f"input_tensor_list[{i}]" if i < self.size else f"output_tensor_list[{i - self.size}]"
                raise TypeError(f"{name} must have dtype {dtype} like input_tensor_list[0], got {t.dtype}")
        request, unpack = _flat.start_all_to_all_list(self._engine, op, outs, ins)
        return self._engine.finish(request, op, True if async_op else None, async_op, then=unpack)

    def watch_stream(self, op: str = "CUDA graph replay", *, timeout: Optional[float] = None) -> None:
        """Put the work issued so far on the current CUDA stream under the communicator's
        watchdog: if it has not completed within ``timeout`` seconds (default: the
        communicator's), the communicator is aborted and its next call raises
        ``TimeoutError`` naming ``op``.

        Collectives captured into a CUDA graph run at each replay, where no call of this
        library sees them; call this after ``graph.replay()`` so that a replay waiting on a
        peer that never comes does not hang forever. Host-waiting backends (MPI, torch)
        time out every wait themselves: there it does nothing.

        Raises:
            ValueError: ``timeout`` not > 0. CommunicatorClosedError: closed or aborted.
        """
        self._engine.check_open(op)
        limit = self.timeout if timeout is None else float(timeout)
        if not limit > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self._engine.backend.watch_stream(op, limit, None if self._engine.peer is None else self._engine.peer.problem)

    @collective("split")
    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """Collective: a sub-communicator of the ranks that pass the same ``color``.

        Ranks are ordered by ``key``, then by rank here. ``color=None`` joins no group and
        returns None. The sub-communicator keeps this one's timeout, validation and pool.

        Raises:
            TypeError, ValueError: a bad ``color`` or ``key``, before anything is sent.
            TimeoutError: a rank did not join within the timeout (the communicator is aborted).
            PeerFailedError: as :meth:`all_to_all_v` (a peer refused its ``color``, say).
        """
        self._engine.check_open("split")
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ValueError(f"color must be a non-negative int or None, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"key must be an int, got {key!r}")
        sub, members = self._engine.split(color, key)
        if sub is None:
            return None
        return Communicator(sub, self.layout.subset(members.index(self.rank), members))

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Release the communicator (collective on NCCL). Idempotent."""
        self._engine.close()

    def abort(self) -> None:
        """Tear the communicator down at once; collectives in flight are abandoned."""
        self._engine.abort()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

