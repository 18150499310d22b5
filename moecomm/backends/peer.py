"""The peer-memory backend: the ranks of one node exchange rows through each other's GPU
memory (CUDA IPC), with no NCCL; several ranks may share one GPU.

``moecomm.init(backend="peer")`` makes it; ``backend="auto"`` picks it where ranks of one
launch share a GPU (NCCL refuses two ranks on one GPU). Every rank owns an arena
(:class:`moecomm.backends.p2p.PeerTransport`, ``p2p_bytes`` of device memory) that the
others map. An exchange moves each block through the destination's arena, in rounds of at
most a region's capacity per pair (:mod:`moecomm.backends.peer_rounds`: the ranks agree on
the number of rounds over the host channel), so any size goes through buffers of a fixed
size. The rank's own block is one device copy. Small host agreements (the rounds, the
counts, barriers) go over the host channel (MPI or gloo).

*Direct exchanges*: where a block between two ranks is :data:`DIRECT_MIN_BYTES` or more,
its receiver shares its output (the IPC handle of the allocation it lies in, and the
offset), and senders write their rows straight into it (the allocation mapped once per peer
and kept, :meth:`moecomm.backends.p2p.PeerTransport.map_output`): rows cross the GPU's
memory once instead of twice (into the arena, then out), in one round whatever the size.
Before any row moves the ranks all-gather one record each (call number, row size, rounds,
where their output lies, their counts and displacements:
:mod:`moecomm.backends.peer_rounds`), so every rank names a count disagreement before
anything moves. Memory that cannot be shared that way (torch's expandable segments) goes
through the arenas in rounds, as before.

*Equal blocks* (``all_to_all_single`` without split sizes, where every rank passes the same
block by contract; the MoE layer's capacity exchanges): every rank knows every block, so
concurrent ranks skip the agreement (:meth:`PeerBackend.alltoall_equal`): the blocks go
through the arenas in rounds, and what the exchange is travels in the GPU headers, compared
where the rows land; a disagreement is raised when the exchange completes.

How a round waits for the peers depends on whether the ranks' kernels run at the same time
(:attr:`PeerBackend.concurrent`, measured at creation, below):

* concurrent (one GPU per rank, or ranks sharing a GPU under MPS): the GPU waits for the
  peers' headers (a one-block kernel spins with a timeout); exchanges can be captured in a
  CUDA graph; ``all_to_all_v`` with counts on the GPU takes one kernel round
  (:meth:`PeerTransport.start`);
* not concurrent (ranks sharing a GPU without MPS, where the GPU time-slices between
  processes and a spinning kernel holds its slice, about 4.5 ms a round trip on an H200):
  the host waits for its copies, then an all-gather on the host channel tells every rank
  that its peers' rows have landed (0.5-1 ms an exchange on an H200). No kernel ever spins on a peer;
  capture is refused. Rank 0 says once (logger ``moecomm``) that MPS makes it fast.

Whether the ranks run concurrently is measured, not guessed: at creation the ranks time a
few empty GPU rounds (their kernels spin on each other's headers); a round trip under a
millisecond on every rank means concurrent (about 10 us under MPS, 4.5 ms without). Ranks
on distinct GPUs are concurrent without a probe.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple, Optional, Sequence

import torch

from ..errors import CommunicatorClosedError, CountMismatchError
from ..splits import split_offsets
from ._p2p_limits import BAD_COUNTS, OVERFLOWS
from ._stream import StreamOrdered
from .base import Backend, DoneRequest, Request
from .peer_rounds import (META_INTS, SHARED_INTS, agreement_record, direct_destinations, disagreement, is_direct,
                          most_rounds, round_blocks, rounds_needed)

try:
    from . import _cudart
except Exception:  # noqa: BLE001 - no CUDA runtime bindings: then no peer backend (create raises)
    _cudart = None

__all__ = ["PeerBackend", "CountsRound", "FixedRows", "rows_gatherable", "DEFAULT_REGION_BYTES", "DIRECT_MIN_BYTES", "CONCURRENT_ROUND_S", "default_arena_bytes", "shared_gpus"]

_LOG = logging.getLogger("moecomm")

DEFAULT_REGION_BYTES = 32 << 20
"""Default region per (source, buffer half) in each rank's arena: an arena of
``4 * size * 32 MiB`` plus headers (256 MiB per rank at 2 ranks, 1 GiB at 8), capped so
that the ranks of one GPU together take at most a quarter of its free memory."""

CONCURRENT_ROUND_S = 1e-3
"""A probe round trip below this on every rank: the ranks' kernels run concurrently."""

DIRECT_MIN_BYTES = 1 << 20
"""A block between two ranks of at least this many bytes (or a region's capacity) makes the
exchange direct: rows go straight into the receiver's output, crossing the GPU's memory once
(through an arena they cross it twice), for one more wait on the GPU (every peer's stream
has reached the exchange)."""

_PROBE_ROUNDS = 5
_MIN_REGION_BYTES = 1 << 20
_NOT_SHARED = [0] * SHARED_INTS


class _Setup:
    """What :class:`PeerTransport` needs of an engine while it sets up: the backend, an
    all-gather of ints and a barrier, over the host channel."""

    def __init__(self, backend: "PeerBackend", host: Any) -> None:
        self.backend = backend
        self._host = host

    def gather_ints(self, values: list[int], op: str) -> list[list[int]]:
        return self._host.allgather(values, what=op)

    def barrier(self) -> None:
        self._host.allreduce([0], "max", what="peer-memory setup (barrier)")


def default_arena_bytes(size: int, ranks_per_gpu: int, free_bytes: int) -> int:
    """The arena per rank when ``p2p_bytes`` is not given: ``4 * size`` regions of
    :data:`DEFAULT_REGION_BYTES` and 1 MiB of headers, shrunk (in steps of 1 MiB per
    region) so that ``ranks_per_gpu`` arenas take at most a quarter of ``free_bytes``.

    Raises:
        ValueError: not even 1 MiB regions fit.
    """
    budget = free_bytes // 4 // max(1, ranks_per_gpu)
    region = min(DEFAULT_REGION_BYTES, (budget - (1 << 20)) // (4 * size) >> 20 << 20)
    if region < _MIN_REGION_BYTES:
        raise ValueError(f"the peer-memory backend needs at least {4 * size} MiB + 1 MiB of GPU memory per rank "
                         f"for {size} ranks ({ranks_per_gpu} on this GPU); {free_bytes >> 20} MiB are free")
    return 4 * size * region + (1 << 20)


class PeerBackend(StreamOrdered, Backend):
    """Collectives of one node's ranks through CUDA IPC peer memory (see the module)."""

    name = "peer"
    stream_ordered = True
    supports_displacements = True
    collective_exchanges = True
    """Every rank takes part in every exchange, also with nothing to move (rounds are collective)."""
    carries_meta = True

    def __init__(self, host: Any, device: torch.device, timeout_s: float) -> None:
        if _cudart is None:
            raise RuntimeError("moecomm: the peer backend needs cuda-bindings (pip install cuda-bindings)")
        self._host = host
        self.rank, self.size = host.rank, host.size
        self.device = device
        self.timeout_s = float(timeout_s)
        self._init_stream(device)
        self._aborted = False
        self._host_failure: Optional[BaseException] = None
        self.concurrent = True
        self.transport: Any = None
        self.arena_bytes = 0
        self._calls = 0

    @classmethod
    def create(cls, host: Any, device: torch.device, timeout_s: float, arena_bytes: Optional[int] = None,
               devices: Optional[Sequence[str]] = None) -> "PeerBackend":
        """Collective over ``host``'s ranks: map every rank's arena, and measure whether the
        ranks run concurrently. ``devices``: every rank's GPU (its UUID), when known.

        Raises:
            ValueError: ``arena_bytes`` too small, or GPUs that cannot map each other's memory.
            RuntimeError: the transport's extension cannot be built or loaded.
        """
        from .p2p import PeerTransport

        torch.cuda.set_device(device)
        backend = cls(host, device, timeout_s)
        try:
            if devices is None:
                uuid = str(torch.cuda.get_device_properties(device).uuid)
                devices = [bytes(v).decode() for v in
                           host.allgather(list(uuid.encode()), what="peer backend (GPUs)")]
            ranks_per_gpu = max(list(devices).count(d) for d in devices)
            if arena_bytes is None:
                free = min(v[0] for v in host.allgather([torch.cuda.mem_get_info(device)[0]],
                                                         what="peer backend (free memory)"))
                arena_bytes = default_arena_bytes(backend.size, ranks_per_gpu, free)
            backend.arena_bytes = arena_bytes
            backend.transport = PeerTransport(_Setup(backend, host), arena_bytes)
            backend.concurrent = ranks_per_gpu == 1 or backend.probe_concurrency()
        except BaseException:
            backend.abort()
            raise
        if not backend.concurrent and backend.rank == 0:
            _LOG.warning("moecomm: %d ranks share a GPU without MPS: the peer backend coordinates every exchange "
                         "on the host (0.5-1 ms an exchange); start the MPS control daemon "
                         "(nvidia-cuda-mps-control -d) before the launch to make it GPU-driven and capturable",
                         ranks_per_gpu)
        return backend

    def probe_concurrency(self) -> bool:
        """Time empty GPU rounds (each rank's kernel spins until the peers' headers land):
        True when the fastest takes under :data:`CONCURRENT_ROUND_S` on every rank."""
        zeros = [0] * self.size
        empty = torch.empty(0, dtype=torch.uint8, device=self.device)
        best = float("inf")
        for _ in range(_PROBE_ROUNDS):
            h = self.begin()
            t0 = time.perf_counter()
            self.transport.issue_round(h, empty, zeros, None, empty, zeros, None, 1)
            self.transport.wait_stream(h, "peer backend (concurrency probe)")
            best = min(best, time.perf_counter() - t0)
        slowest = self._host.allreduce([int(best * 1e9)], "max", what="peer backend (concurrency probe)")[0]
        return slowest < CONCURRENT_ROUND_S * 1e9

    # -- what the engine uses --------------------------------------------------------------

    one_host_round = False
    """Ranks that share a GPU without MPS: ``all_to_all_v`` with counts on the GPU in one host
    round (:meth:`counts_round`: one synchronisation and one all-gather) instead of a count
    exchange and then an agreed exchange (two synchronisations, three all-gathers, each
    synchronisation waiting for the GPU's time slice). Off until it has run on a GPU: the
    device suites (``bench/gpu_session.sh shared``, no MPS) turn it on to check and time it."""

    @property
    def counts_in_one_host_round(self) -> bool:
        """Whether ``all_to_all_v`` with counts on the GPU takes :meth:`counts_round`."""
        return self.one_host_round and not self.concurrent

    def counts_round(self, x: torch.Tensor, counts: torch.Tensor, row_bytes: int,
                     codes: tuple[int, int]) -> "CountsRound":
        """``all_to_all_v`` of ``x`` (contiguous, 16-byte aligned rows grouped by destination)
        with ``counts`` (contiguous int64 on the device) on ranks whose kernels do not run at
        the same time: the counts-on-the-GPU kernel sends this rank's rows into the peers'
        regions without waiting for theirs; once it is done (one synchronisation) the ranks
        all-gather on the host what each sent: its counts, and what the kernel's headers
        carry (the ``codes`` of what the exchange is, row bytes, the flags ``BAD_COUNTS``,
        where its kernel moved none of its rows, and ``OVERFLOWS``), which also tells each rank
        that its peers' rows have landed. The caller checks the heads as those of the concurrent
        path (every rank sees the same) before :meth:`finish_counts_round` copies out.

        Raises:
            CountMismatchError: the ranks are in different exchanges (the communicator is aborted).
            TimeoutError: the kernel or a peer did not reach the round within the timeout (the
                communicator is aborted).
        """
        t, me = self.transport, self.rank
        op = "all_to_all_v (peer memory, counts on the GPU)"
        self._calls += 1
        t.start(x, counts, row_bytes, codes, wait=False)
        t.wait_stream(_cudart.current_stream(self.device.index), op)
        send = t.counts()[0]
        flags = (BAD_COUNTS if min(send, default=0) < 0 or sum(send) != x.shape[0] else 0) | (
            OVERFLOWS if max(send, default=0) > t.inline_bytes // row_bytes else 0)
        table = self._agree(self._host.allgather, [self._calls, codes[0], codes[1], row_bytes, flags, *send], what=op)
        calls = [row[0] for row in table]
        if min(calls) != max(calls):
            self.abort()
            raise CountMismatchError(f"moecomm: {op}: the ranks are in different exchanges (numbers {min(calls)} to "
                                     f"{max(calls)}; rank {me} is in {self._calls}); the communicator was aborted")
        return CountsRound(send, [row[5 + me] for row in table], [row[1:5] for row in table])

    def finish_counts_round(self, x: torch.Tensor, out: torch.Tensor, rnd: "CountsRound", row_bytes: int) -> Request:
        """The copy out of :meth:`counts_round`'s rows into ``out`` (on the backend's stream,
        after the caller's; the next exchange's kernel waits for it), then the blocks over the
        inline capacity, whole (an agreed exchange every rank joins where some rank's overflowed)."""
        h = self.begin(x, out)
        if out.numel():
            self.transport.copy_out_regions(h, out, rnd.recv, row_bytes)
        request = self.end("all_to_all_v (peer memory, copy out)")
        if not any(head[3] & OVERFLOWS for head in rnd.heads):
            return request
        rest = self.transport.rest_whole(x, out, rnd.send, rnd.recv, row_bytes)
        return request if rest is None else rest

    def gpu_counts_transport(self) -> Any:
        """The transport for ``all_to_all_v`` with counts on the GPU in one kernel round
        (concurrent ranks only), else None (the counts then cross the host first)."""
        return self.transport if self.concurrent else None

    def alltoallv(self, send, send_counts, recv, recv_counts, row_bytes, send_displs=None, recv_displs=None,
                  meta=None) -> Request:
        t, me = self.transport, self.rank
        send_counts, recv_counts = list(send_counts), list(recv_counts)
        sd = split_offsets(send_counts) if send_displs is None else list(send_displs)
        rd = split_offsets(recv_counts) if recv_displs is None else list(recv_displs)
        cap = t.capacity_rows(row_bytes) if row_bytes else 1  # (rows of 0 bytes: nothing moves, any cap)
        self._calls += 1
        if not self.concurrent and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moecomm: the peer backend cannot capture exchanges of ranks that share a GPU without "
                               "MPS (each round waits on the host); run the ranks under MPS")
        h = self.begin(send, recv)
        own = min(send_counts[me], recv_counts[me])
        if own and row_bytes:  # issued first: the GPU copies it while the ranks agree on the rest
            _cudart.copy_async(recv.data_ptr() + rd[me] * row_bytes, send.data_ptr() + sd[me] * row_bytes,
                               own * row_bytes, _cudart.D2D, h)
        flag, shared = self._share_output(recv, recv_counts, row_bytes)
        record = agreement_record(self._calls, row_bytes, rounds_needed(send_counts, recv_counts, me, cap), flag,
                                  shared, send_counts, recv_counts, rd, *(() if meta is None else (meta.codes,)))
        try:
            table = self._agree(self._host.allgather, record, what="all_to_all_v (peer memory)")
        except TimeoutError as exc:
            if not self.concurrent:
                raise
            # equal blocks (all_to_all_single without split sizes) skip this agreement on concurrent ranks
            raise TimeoutError(f"{exc}; a rank that called all_to_all_single without split sizes (equal blocks) "
                               f"while this one passed them never joins it") from exc
        found = disagreement(table, me, None if meta is None else meta.words)
        if found is not None:
            out_of_step, what = found
            if out_of_step:
                self.abort()
            raise CountMismatchError(f"moecomm: all_to_all_v (peer memory): {what}"
                                     + ("; the communicator was aborted" if out_of_step else ""))
        if row_bytes and is_direct(table):  # one round (see _share_output)
            try:
                dst = direct_destinations(table, me, row_bytes, t.map_output)
            except RuntimeError as exc:  # a peer's output cannot be mapped here: its peers would wait in vain
                self.abort()
                raise RuntimeError(f"moecomm: all_to_all_v (peer memory): rank {me} cannot map a peer's output "
                                   f"through CUDA IPC ({exc}); the communicator was aborted") from exc
            part = round_blocks(send_counts, sd, recv_counts, rd, me, max(send_counts + recv_counts + [1]), 0)
            copy_out = table[me][3] != 1
            if self.concurrent:
                t.issue_direct(h, send, part.send, part.send_displs, recv, part.recv, part.recv_displs, row_bytes,
                               dst, copy_out)
            else:
                t.issue_round_host(h, send, part.send, part.send_displs, recv, part.recv, part.recv_displs,
                                   row_bytes, self._handshake, dst, copy_out)
            return self.end("all_to_all_v (peer memory)", t.problem if self.concurrent else None)
        rounds = most_rounds(table) if row_bytes else 0
        for r in range(rounds):
            part = round_blocks(send_counts, sd, recv_counts, rd, me, cap, r)
            if self.concurrent:
                t.issue_round(h, send, part.send, part.send_displs, recv, part.recv, part.recv_displs, row_bytes)
            else:
                t.issue_round_host(h, send, part.send, part.send_displs, recv, part.recv, part.recv_displs,
                                   row_bytes, self._handshake)
        return self.end("all_to_all_v (peer memory)", t.problem if self.concurrent and rounds else None)

    def alltoall_equal(self, send: torch.Tensor, recv: torch.Tensor, rows: int, row_bytes: int,
                       meta: Any = None, op: str = "all_to_all_single") -> Optional[Request]:
        """An all-to-all of equal blocks, as torch's ``all_to_all_single`` without split sizes:
        ``rows`` rows of ``row_bytes`` from row ``p * rows`` of ``send`` to every rank ``p``,
        into row ``q * rows`` of ``recv`` from every rank ``q``, every rank passing the same
        ``rows`` (the contract of an equal split). So every rank knows every block and the
        rounds they need: no host agreement. The blocks go through the arenas (rounds of a
        region's capacity) and what the exchange is (``meta``'s codes and ``rows``) travels in
        the GPU headers, compared where they land: a rank that passes another block size,
        dtype, row shape or wire dtype is named on every rank by the request's completion
        (``CountMismatchError``; the communicator is then aborted, as after any error the GPU
        reports). Capturable. None where the ranks' kernels do not run concurrently (ranks
        sharing a GPU without MPS): :meth:`alltoallv` then agrees on the host first."""
        if not self.concurrent:
            return None
        t, me, W = self.transport, self.rank, self.size
        self._calls += 1  # (every rank counts it: the agreement records' call numbers stay in step)
        h = self.begin(send, recv)
        cap = t.capacity_rows(row_bytes)
        words = (*(meta.codes if meta is not None else (0,) * META_INTS), rows)
        displs = [p * rows for p in range(W)]
        for r in range(max(1, -(-rows // cap))):  # one round at least: its headers compare the blocks
            n = min(cap, max(0, rows - r * cap))
            counts = [n] * W
            counts[me] = rows if r == 0 else 0  # the own block whole, in the first round
            at = [d + r * cap for d in displs]
            at[me] = displs[me]
            t.issue_round(h, send, counts, at, recv, counts, at, row_bytes, words)
        described = (*(meta.words if meta is not None else ("",) * META_INTS), str(rows))
        return self.end(op, lambda: t.problem(f"{op} (peer memory)", described))

    def fixed_destinations(self, recv: torch.Tensor, block_bytes: int) -> list[int]:
        """Set up all-to-alls of equal blocks of ``block_bytes`` into ``recv`` on every call (a
        buffer kept for good, such as :class:`moecomm.LowLatencyBuffer`'s): every rank shares
        its ``recv`` once (one host all-gather: collective) and gets, for each peer, the address
        in this process where its block goes in that peer's ``recv`` (mapped for the
        transport's life; 0 for itself): what :meth:`fixed_alltoall` takes.

        Raises:
            CountMismatchError: ranks pass blocks of different sizes (on every rank).
            RuntimeError: some rank's ``recv`` cannot be shared through CUDA IPC (torch's
                expandable segments), named on every rank.
        """
        me = self.rank
        shared = self.transport.export_output(recv)
        record = [block_bytes, 0 if shared is None else 1, *(_NOT_SHARED if shared is None else shared)]
        table = self._agree(self._host.allgather, record, what="all-to-all of fixed blocks (peer memory, setup)")
        sizes = [row[0] for row in table]
        if len(set(sizes)) > 1:
            raise CountMismatchError(f"moecomm: all-to-all of fixed blocks (peer memory): the ranks' blocks differ in "
                                     f"size (bytes per rank: {sizes})")
        unshared = [p for p, row in enumerate(table) if not row[1]]
        if unshared:
            raise RuntimeError(f"moecomm: all-to-all of fixed blocks (peer memory): the receive buffer of rank(s) "
                               f"{unshared} cannot be shared through CUDA IPC (not from cudaMalloc: torch's "
                               f"expandable segments?)")
        return [0 if p == me else self.transport.map_output(p, row[2:], keep=True) + me * block_bytes
                for p, row in enumerate(table)]

    def fixed_rows(self, outputs: Sequence[torch.Tensor]) -> Optional["FixedRows"]:
        """Set up used-rows exchanges into ``outputs`` (buffers kept for good; collective, one
        host all-gather per buffer and one for the flags): a :class:`FixedRows`, or None where
        the ranks' kernels do not run concurrently (ranks sharing a GPU without MPS: a kernel
        must not spin on a peer there)."""
        if not self.concurrent:
            return None
        return FixedRows(self, outputs)

    def fixed_alltoall(self, send: torch.Tensor, recv: torch.Tensor, block_bytes: int,
                       destinations: Sequence[int]) -> Request:
        """An all-to-all of equal blocks set up by :meth:`fixed_destinations` (the same
        ``recv``): block ``p`` of ``send`` (``block_bytes`` from byte ``p * block_bytes``) goes
        straight into rank ``p``'s ``recv`` at ``destinations[p]``, with no host agreement:
        the GPU waits for every peer's stream to reach the exchange (so that nothing still
        reads what it overwrites), copies, and checks the peers' headers. Ranks that share a
        GPU without MPS coordinate on the host instead (and cannot capture it)."""
        me, W = self.rank, self.size
        self._calls += 1
        if not self.concurrent and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moecomm: the peer backend cannot capture exchanges of ranks that share a GPU without "
                               "MPS (each round waits on the host); run the ranks under MPS")
        h = self.begin(send, recv)
        if block_bytes:
            _cudart.copy_async(recv.data_ptr() + me * block_bytes, send.data_ptr() + me * block_bytes, block_bytes,
                               _cudart.D2D, h)
        if W > 1 and block_bytes:
            ones = [int(p != me) for p in range(W)]  # one "row" of block_bytes per peer; the own block went above
            blocks = list(range(W))
            if self.concurrent:
                self.transport.issue_direct(h, send, ones, blocks, recv, ones, blocks, block_bytes, destinations,
                                            False)
            else:  # the peers write into recv once every rank's earlier work on it is done
                self.transport.wait_stream(h, "all-to-all of fixed blocks (peer memory)")
                self._handshake([self._calls])
                self.transport.issue_round_host(h, send, ones, blocks, recv, ones, blocks, block_bytes,
                                                self._handshake, destinations, False)
        return self.end("all-to-all of fixed blocks (peer memory)", self.transport.problem if self.concurrent else None)

    def _share_output(self, recv: torch.Tensor, recv_counts: list[int], row_bytes: int) -> tuple[int, list[int]]:
        """Whether the peers write their rows straight into ``recv`` (this rank's output):
        (1, where it lies) where some peer's block is at least :data:`DIRECT_MIN_BYTES` (or
        fills a region) and ``recv`` can be shared; (0, zeros) where every block is smaller
        (through the arena, in one round); (-1, zeros) where it cannot be shared (then every
        rank goes through the arenas, in rounds). An exchange is direct when some rank says
        1 and none -1: one round, each block into its receiver's output or, for receivers
        that said 0, into their regions (where it fits). Ranks that share a GPU without MPS
        sync their stream before they say 1, so that no earlier work still uses ``recv``."""
        largest = max((n for p, n in enumerate(recv_counts) if p != self.rank), default=0) * row_bytes
        if largest < min(DIRECT_MIN_BYTES, self.transport.region_bytes):
            return 0, _NOT_SHARED
        if not self.concurrent:
            self.transport.wait_stream(self._stream, "all_to_all_v (peer memory, before a direct exchange)")
        shared = self.transport.export_output(recv)
        return (-1, _NOT_SHARED) if shared is None else (1, shared)

    def _handshake(self, sent: list[int]) -> list[list[int]]:
        return self._agree(self._host.allgather, sent, what="all_to_all_v (peer memory, host round)")

    def _agree(self, call: Any, *args: Any, **kw: Any) -> Any:
        """A host-channel collective; one that times out (a peer gone or stuck) aborts the
        backend, and every later call raises that failure (then the communicator is closed)."""
        try:
            return call(*args, **kw)
        except (TimeoutError, RuntimeError) as exc:
            if self._host_failure is None:
                self._host_failure = exc
            self.abort()
            raise

    def check_health(self) -> None:
        if self._host_failure is not None:  # the call that met it raised it; every later one says closed
            raise CommunicatorClosedError(f"moecomm: the communicator was aborted: {self._host_failure}")
        super().check_health()

    def allgatherv(self, send, recv, recv_counts, row_bytes) -> Request:
        me = self.rank
        mine = recv_counts[me]
        return self.alltoallv(send, [mine] * self.size, recv, list(recv_counts), row_bytes,
                              [0] * self.size, split_offsets(list(recv_counts)))

    def exchange_counts(self, send, dev, host) -> Request:
        n = host.numel() // 2
        if send is not None:
            torch.cuda.current_stream(self.device).synchronize()
            host[:n].copy_(send)
        values = host[:n].tolist()
        per = n // self.size
        table = self._agree(self._host.allgather, values, what="all_to_all_v (count exchange)")
        me = self.rank
        host[n:] = torch.tensor([v for row in table for v in row[me * per:(me + 1) * per]], dtype=torch.int64)
        return DoneRequest()

    def alltoall(self, send, recv) -> Request:
        n = send.numel() * send.element_size() // self.size
        return self.alltoallv(send, [n] * self.size, recv, [n] * self.size, 1)

    def allgather(self, send, recv) -> Request:
        n = send.numel() * send.element_size()
        return self.allgatherv(send, recv, [1] * self.size, n)

    def allreduce(self, tensor, op) -> Request:
        if not tensor.numel():
            return self.barrier()
        gathered = torch.empty((self.size,) + tuple(tensor.shape), dtype=tensor.dtype, device=self.device)
        flat = tensor.contiguous()
        request = self.allgather(flat, gathered)
        request.join()
        reduce = {"sum": torch.sum, "prod": torch.prod}
        if op in reduce:
            result = reduce[op](gathered, dim=0, dtype=tensor.dtype)
        else:
            result = getattr(gathered, "amax" if op == "max" else "amin")(dim=0)
        tensor.copy_(result)
        return self.end_after_current("allreduce")

    def end_after_current(self, op: str) -> Request:
        """A request done once the caller's current stream has done what was issued on it."""
        self.begin()
        return self.end(op)

    def broadcast(self, tensor, root) -> Request:
        n = tensor.numel() * tensor.element_size()
        me, W = self.rank, self.size
        send = [n if me == root and p != root else 0 for p in range(W)]
        recv = [n if p == root and me != root else 0 for p in range(W)]
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        return self.alltoallv(flat.view(torch.uint8), send, flat.view(torch.uint8), recv, 1, [0] * W, [0] * W)

    def barrier(self) -> Request:
        torch.cuda.current_stream(self.device).synchronize()
        self._agree(self._host.allreduce, [0], "max", what="barrier")
        return DoneRequest()

    def split(self, color: Optional[int], key: int, table: Sequence[Sequence[int]]) -> Optional["PeerBackend"]:
        self.check_health()
        torch.cuda.current_stream(self.device).synchronize()
        sub_host = self._host.split(color, key)
        if color is None:
            return None
        if sub_host is None:
            raise RuntimeError(f"moecomm: the peer backend splits over an MPI host channel; this one is "
                               f"{self._host.kind!r} (launch with mpirun/mpiexec)")
        return PeerBackend.create(sub_host, self.device, self.timeout_s, self.arena_bytes)

    def close(self) -> None:
        self._watchdog.stop()
        if self.transport is not None and not self._aborted:
            self.transport.close(_Setup(self, self._host))
        self.transport = None
        _cudart.destroy_event(self._ready)
        self._host.close()

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        self._watchdog.stop()
        self._host.abort()


class CountsRound(NamedTuple):
    """What :meth:`PeerBackend.counts_round` gathered: this rank's counts sent and received, and
    every rank's head (``[size]`` rows of dtype code, row-shape code, row bytes, flags), as
    :meth:`moecomm.backends.p2p.PeerTransport.senders` gives the concurrent path's."""

    send: list[int]
    recv: list[int]
    heads: list[list[int]]


def shared_gpus(devices: Sequence[str], hosts: Sequence[str]) -> dict[tuple[str, str], list[int]]:
    """(host, GPU) -> the ranks on it, for every GPU that two or more ranks share."""
    where: dict[tuple[str, str], list[int]] = {}
    for r, key in enumerate(zip(hosts, devices)):
        where.setdefault(key, []).append(r)
    return {k: v for k, v in where.items() if len(v) > 1}


def rows_gatherable(send: torch.Tensor, row_bytes: int) -> bool:
    """Whether :meth:`FixedRows.exchange` can gather rows of ``row_bytes`` from ``send``:
    contiguous, 16-byte rows at a 16-byte aligned address."""
    return (send.is_contiguous() and row_bytes > 0 and row_bytes % 16 == 0 and send.nbytes % row_bytes == 0
            and send.data_ptr() % 16 == 0)


class FixedRows:
    """Used-rows exchanges into fixed output buffers (:meth:`PeerBackend.fixed_rows`): each
    block's used rows (a count on the device) are written by the GPU straight into the
    receiver's output, mapped through CUDA IPC, then a flag; the receiver's GPU waits for the
    flags. No host agreement, nothing padded crosses the GPU, capturable (the sequence numbers
    live on the device). Concurrent ranks only."""

    def __init__(self, backend: PeerBackend, outputs: Sequence[torch.Tensor]) -> None:
        W, me, dev = backend.size, backend.rank, backend.device
        self.backend = backend
        # this rank's flag slots (rows, seq) per source, then its ready slots per source
        self._sync = torch.zeros(3 * W, dtype=torch.int64, device=dev)
        # zeroed on the GPU before any peer can write into it (they may, once the all-gather returns)
        torch.cuda.current_stream(dev).synchronize()
        flags = backend.fixed_destinations(self._sync, 16)  # (each rank's sync tensor: one all-gather)
        base = self._sync.data_ptr()
        flag_dst = [base + 16 * me if p == me else flags[p] for p in range(W)]
        ready_dst = [f - 16 * me + 16 * W + 8 * me for f in flag_dst]
        self._tables = []
        for out in outputs:
            block = out.nbytes // W
            dst = backend.fixed_destinations(out, block)
            dst[me] = out.data_ptr() + me * block
            self._tables.append((out, torch.tensor([dst, flag_dst, ready_dst], dtype=torch.int64, device=dev)))
        self._state = torch.zeros((), dtype=torch.int64, device=dev)
        self._done = torch.zeros(W + 1, dtype=torch.int32, device=dev)
        self._status = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # the kernels write [0] = 1 on a timeout
        self._status_np = self._status.numpy()  # read per call without a torch op

    def check(self) -> None:
        """Raise where an earlier exchange's wait gave up (read from mapped host memory: no
        synchronisation; an exchange still in flight is seen at a later call)."""
        if self._status_np[0]:
            self.backend.abort()
            raise TimeoutError(f"moecomm: a used-rows exchange (peer memory) did not see every peer within the "
                               f"timeout on rank {self.backend.rank}; the communicator was aborted")

    def exchange(self, index: int, send: torch.Tensor, counts: torch.Tensor, scale: int, row_bytes: int,
                 recv_rows: Optional[torch.Tensor] = None, gather: Optional[torch.Tensor] = None) -> None:
        """Enqueue on the current stream: ``counts[p] * scale`` rows of ``row_bytes`` from block
        ``p`` of ``send`` (``send.nbytes / size`` bytes a block) into rank ``p``'s output
        ``index`` (the same block layout); ``recv_rows`` (int64 ``[size]`` on the device, or
        None) gets the rows each rank sent here. With ``gather`` (int64, one per row of the
        output), the blocks are ``send[gather]``, gathered on the way (``send``: any rows of
        ``row_bytes``; an index outside them copies nothing)."""
        self.check()
        self.backend.check_health()
        out, tables = self._tables[index]
        W = self.backend.size
        if gather is None:
            if send.nbytes != out.nbytes:  # (the kernel also never copies more than a block)
                raise ValueError(f"send must have the bytes of output {index} ({out.nbytes}), got {send.nbytes}")
            src_index = src_rows = 0
        else:
            if gather.dtype != torch.int64 or not gather.is_contiguous() or gather.device != send.device or \
                    gather.numel() * row_bytes != out.nbytes:
                raise ValueError(f"gather must be contiguous int64 on {send.device} with one index per row of "
                                 f"output {index} ({out.nbytes // row_bytes} rows of {row_bytes} bytes), got "
                                 f"{gather.dtype} {tuple(gather.shape)} on {gather.device}")
            if not rows_gatherable(send, row_bytes):
                raise ValueError(f"send must be contiguous rows of {row_bytes} bytes (a multiple of 16) at a 16-byte "
                                 f"aligned address to gather from, got {send.nbytes} bytes at {send.data_ptr():#x}")
            src_index, src_rows = gather.data_ptr(), send.nbytes // row_bytes
        self.backend.transport.launch_rows_exchange(
            send.data_ptr(), out.nbytes // W, row_bytes, counts.data_ptr(), scale, tables.data_ptr(),
            self._sync.data_ptr(), self._state.data_ptr(), self._done.data_ptr(),
            0 if recv_rows is None else recv_rows.data_ptr(), self._status.data_ptr(), src_index, src_rows)
