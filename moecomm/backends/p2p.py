"""All-to-all through NVLink peer memory, for the ranks of one node, counts read on the GPU.

The NCCL exchange of a variable all-to-all whose counts live on the GPU needs two rounds
with the host in between: the counts go first, the host reads them, then the rows go.
This transport needs one. Every rank owns an *arena* (``p2p_bytes`` of device memory)
that its node mates map through CUDA IPC. One kernel writes each destination's rows
straight into the destination's arena, reading the counts on the GPU, and then a header
(count, sequence number); a second kernel waits for every source's header (with a
timeout). The host then learns the counts (one copy to pinned memory), allocates the
output and copies the rows out of its arena. Rows beyond a region's capacity (``cap``
rows per source) follow through NCCL, counts then known on both sides.

Exchanges whose counts the host knows (``recv_splits`` given, or learned first; and every
stage of ``scatter_compute_gather``) move through the same arenas by *copy engines*
(:meth:`PeerTransport.exchange`): ``cudaMemcpyAsync`` into each peer's region, one small
kernel writing the headers, a wait for the peers' headers (with a timeout, checking each
count against what this rank expects), and copies out of the own regions; the rank's own
rows are one device-local copy (on a second stream when large). No SM moves a byte, so an
exchange beside the experts' GEMMs does not take their SMs as NCCL's kernels do (measured
against NCCL: bench/results/README.md). On the peer backend (``init(backend="peer")``) a
round in which a rank sends at most :data:`COPY_KERNELS_MAX_BYTES` moves its rows with SM
kernels instead (up to 32 ranks, every address 16-byte aligned), one launch for the sends and
the own block and one for the copies out: fewer launches, every block at once (ranks sharing a GPU: equal blocks 0.66-0.9x the time of
copy engines up to 16 MiB per rank, session-79/80). A failure the wait reports (a peer silent past the
timeout, a peer sending another count than expected) aborts the communicator; the next
call raises it, as after an NCCL timeout.

Made by ``moecomm.init(p2p_bytes=...)`` (NCCL backend, one node, every GPU pair able to
map the other's memory); used by ``all_to_all_v`` when ``send_splits`` is a GPU tensor,
``recv_splits`` is not given and rows are a multiple of 16 bytes (kernels), and for every
flat exchange with known counts (copy engines). See ``moecomm_ext/csrc/p2p_cuda.cu`` for
the arena layout and why two buffers suffice. A plain ``all_to_all_v`` with known counts uses
the copy engines only from a size on (``init(p2p_min_bytes=)``).

The copy-engine exchanges keep their sequence numbers on the GPU and check, before
writing into a peer's buffer half, that the peer has copied out the last exchange that used
it; so they can be captured into a CUDA graph and replayed (every rank capturing and
replaying the same exchanges in the same order, as with NCCL). The counts-on-the-GPU path
needs the host between its two kernels and cannot be captured.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..errors import CountMismatchError
from ..splits import split_offsets
from . import _cudart
from ._deadline import poll_yielding
from ._p2p_limits import BAD_COUNTS, OVERFLOWS, ROW_ALIGN
from .base import DoneRequest, Request

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.engine import Engine
    from .nccl import NcclBackend

__all__ = ["PeerTransport", "ROW_ALIGN", "INLINE_BYTES", "MAPPED_PER_PEER", "COPY_KERNELS_MAX_BYTES", "OVERFLOWS",
           "BAD_COUNTS", "META_WORDS", "META_WORD_NAMES"]


_HEADER_BYTES = 64

META_WORD_NAMES = ("kind of exchange", "dtype", "row shape", "wire dtype", "block size (rows per rank)")
"""What the meta words of a known-counts round's headers say (``MetaWords`` in
``csrc/p2p_cuda.cu``), word by word: the codes of :func:`moecomm.engine.tags.exchange_meta`,
then the rows of every block where blocks are equal."""

META_WORDS = len(META_WORD_NAMES)

INLINE_BYTES = 8 << 20
"""On the peer backend, the largest block the counts-on-the-GPU round carries (a larger one
goes whole in a second, direct exchange: :meth:`PeerTransport.finish`). Inline, rows cross the
GPU's memory twice (into the arena, out of it) but need no host agreement, which costs more
than a second crossing of a few MiB."""

# Thread blocks (of 512 threads) copying a used-rows exchange's rows, over all peers, at least 8 a
# peer. Ranks sharing one GPU under MPS (decode shape, 2 ranks, H100, session-69): 16 in all took
# 116-121 us (dispatch) against 218-238 us with 128; the copies are not what bounds the time.
_ROWS_BLOCKS = 16
_ROWS_MIN_BLOCKS_PER_PEER = 8

COPY_KERNELS_MAX_BYTES = 32 << 20
"""A known-counts round whose rank sends more than this (its own block included) moves its rows
with copy engines, not SM kernels: there they were as fast or faster, and leave the SMs to
compute (:attr:`PeerTransport.copy_kernels`)."""

MAPPED_PER_PEER = 16
"""Peers' output allocations a direct exchange keeps mapped, per peer (:meth:`PeerTransport.map_output`)."""


def _copy_blocks(nbytes: int, world: int, block_bytes: int, max_blocks: int) -> int:
    """Thread blocks per peer for moving ``nbytes`` in all: one per ``block_bytes``, 16 to
    ``max_blocks`` in all (each rank picks its own: the protocol does not depend on it)."""
    return max(1, min(max_blocks, max(16, nbytes // block_bytes)) // world)


class PeerTransport:
    """The arenas of one communicator's ranks and the state of their exchanges."""

    block_bytes: int = 64 << 10
    """The counts-on-the-GPU kernels (send, copy out) use one thread block of 512 threads
    per this many bytes they move, at least 16 and at most :attr:`max_blocks` in all."""
    max_blocks: int = 256

    def __init__(self, engine: "Engine", arena_bytes: int) -> None:
        """Collective: allocate this rank's arena and map every peer's, through ``engine``
        (an engine of the NCCL backend without a peer transport).

        Raises:
            ValueError: a GPU pair that cannot map each other's memory, too many ranks, or
                ``arena_bytes`` too small for one row region per peer.
        """
        from ._ext import load_p2p

        backend: "NcclBackend" = engine.backend
        self._ext = load_p2p()
        self._backend = backend
        # the peer backend (moecomm.backends.peer): every exchange is collective and cut into
        # rounds there, never left to another transport
        self.collective = backend.name == "peer"
        self.size, self.rank = backend.size, backend.rank
        self.rows_blocks = _ROWS_BLOCKS  # (bench.low_latency --rows-blocks sets another, to compare)
        # the peer backend's known-counts rounds move their rows with SM kernels (one launch for the
        # sends, one for the copies out) where a rank sends at most COPY_KERNELS_MAX_BYTES in the round
        # and addresses and rows are 16-byte aligned, else with copy engines (a copy per block):
        # measured on ranks sharing an H100 (bench/results/README.md, session-79); bench.alltoall and
        # bench.moe_layer --peer-copy-engines set False, to compare
        self.copy_kernels = self.collective
        self._device = backend.device.index
        W = self.size
        dev = backend.device
        devices = [row[0] for row in engine.gather_ints([dev.index], "p2p setup")]
        for r, d in enumerate(devices):
            # ranks that share a GPU map each other's memory through CUDA IPC alone
            if r != self.rank and d != dev.index and not self._ext.can_access_peer(dev.index, d):
                raise ValueError(f"p2p_bytes: GPU {dev.index} (rank {self.rank}) cannot map the memory of GPU {d} "
                                 f"(rank {r}); the peer-memory transport needs every pair of GPUs linked")
        # layout (moecomm_ext/csrc/p2p_cuda.cu): the counts-on-the-GPU headers, the copy-engine
        # headers and acks, then each protocol's data regions (two halves of W each)
        self.header_off = 0
        self.ce_header_off = 2 * W * _HEADER_BYTES
        self.ce_ack_off = 4 * W * _HEADER_BYTES
        self.data_off = _round_up(5 * W * _HEADER_BYTES, 4096)
        self.region_bytes = (arena_bytes - self.data_off) // (4 * W) // 256 * 256
        self.ce_data_off = self.data_off + 2 * W * self.region_bytes
        # the counts-on-the-GPU round carries blocks of at most this much; larger ones follow whole in a
        # second, known-counts exchange, which the peer backend makes direct (one crossing of the GPU's
        # memory instead of two) and runs where some rank's header says it has such a block
        self.inline_bytes = min(self.region_bytes, INLINE_BYTES) if self.collective else self.region_bytes
        if self.region_bytes < 256:
            raise ValueError(f"p2p_bytes={arena_bytes} leaves no room for rows: it needs at least "
                             f"{self.data_off + 4 * W * 256} bytes for {W} ranks")
        if W > self._ext.max_copy_engine_ranks():
            raise ValueError(f"p2p_bytes: the peer-memory transport serves at most {self._ext.max_copy_engine_ranks()} "
                             f"ranks, got {W}")
        self.arena_bytes = arena_bytes
        self._base = self._ext.alloc(dev.index, arena_bytes)
        self._opened: list[int] = []
        try:
            table = engine.gather_ints(list(self._ext.ipc_handle(self._base)), "p2p setup (IPC handles)")
            bases = []
            for r in range(W):
                if r == self.rank:
                    bases.append(self._base)
                else:
                    ptr = self._ext.ipc_open(dev.index, bytes(table[r]))
                    self._opened.append(ptr)
                    bases.append(ptr)
        except BaseException:
            self._release()
            raise
        self._bases = torch.tensor(bases, dtype=torch.int64, device=dev)  # uint64 pointers, below 2**63
        self._done = torch.zeros(W, dtype=torch.int32, device=dev)
        self._result = torch.zeros(2 * W + 1, dtype=torch.int64, device=dev)
        # pinned, so mapped for the kernel: [received W][sent W][timed out][seq of the exchange written]
        # [per source: dtype code, row-shape code, row bytes, overflows]
        self._host = torch.zeros(6 * W + 2, dtype=torch.int64, pin_memory=True)
        self._host_np = self._host.numpy()
        self._seq = 0  # counts-on-the-GPU exchanges: counted on the host (buffer half: seq % 2)
        # copy-engine exchanges: counted on the GPU ([done, last of half 0, last of half 1]); halves alternate
        self._ce_state = torch.zeros(3, dtype=torch.int64, device=dev)
        self._ce_half = 0
        self._ce_capture = 0  # the capture the last exchange was issued into (0: none)
        self._ce_captured = False  # once captured, a replay may run between any two eager exchanges
        self._ptrs = (self._bases.data_ptr(), self._done.data_ptr(), self._result.data_ptr(), self._host.data_ptr())
        # the copy-engine path: peers' bases on the host, a stream for the own block, a
        # status the wait kernel writes into host memory (code, count sent, count expected per source)
        self._base_list = bases
        self._aux = torch.cuda.Stream(dev)
        self._fork = self._ext.new_event(dev.index)
        self._join = self._ext.new_event(dev.index)
        self._order = self._ext.new_event(dev.index)  # the counts-on-the-GPU path: after the backend's stream
        self._host_event = _cudart.new_event()  # the host-coordinated rounds wait on it
        self._mapped: "OrderedDict[tuple, int]" = OrderedDict()  # (peer, IPC handle) -> its allocation, mapped here
        self.output_maps = 0  # peers' output allocations mapped so far (a steady loop maps none after its first steps)
        self._pinned: set = set()
        self._status_t = torch.zeros(3 * W, dtype=torch.int64, pin_memory=True)
        self._status = self._status_t.numpy()
        engine.barrier()  # every rank has mapped every arena before any exchange writes to one

    @property
    def _timeout_ns(self) -> int:
        """The wait kernels' deadline: the communicator's timeout (kept by the backend)."""
        return int(self._backend.timeout_s * 1e9)

    def _blocks(self, nbytes: int) -> int:
        return _copy_blocks(nbytes, self.size, self.block_bytes, self.max_blocks)

    def capacity_rows(self, row_bytes: int) -> int:
        """Rows of ``row_bytes`` one source can put in one region."""
        return self.region_bytes // row_bytes

    def start(self, x: torch.Tensor, counts: torch.Tensor, row_bytes: int, codes: tuple[int, int] = (0, 0),
              wait: bool = True) -> Request:
        """Enqueue the exchange on the caller's current stream (ordered after the backend's
        stream): one kernel sends the rows and counts, waits for the peers' and writes the
        counts into host memory; one native call.

        ``x``: contiguous, 16-byte aligned rows grouped by destination; ``counts``:
        contiguous int64 ``[size]`` on the device; ``codes``: this rank's dtype and
        row-shape codes (:func:`moecomm.engine.peer_check.row_codes`), which travel in the
        headers. A block of at most :attr:`inline_bytes` travels in this round, a larger one
        whole in :meth:`finish`'s exchange. When the request completes, :meth:`counts` holds
        (sent, received, timed out) and :meth:`senders` what each source said of itself.
        The wait kernel gives up after the communicator's timeout, so the request always
        completes. ``wait=False`` (ranks whose kernels do not run at the same time): the kernel
        only sends, reads no peer's header and spins on none; once the caller's stream has
        passed it, :meth:`counts` holds this rank's own counts (and nothing received): the
        ranks then agree on the host (:meth:`moecomm.backends.peer.PeerBackend.counts_round`)
        and :meth:`copy_out_regions` takes the rows out.
        """
        b = self._backend
        self._seq += 1
        bases, done, result, host = self._ptrs
        b.check_health()
        self._ext.gpu_counts_exchange(self._device, _cudart.current_stream(self._device), b.stream.cuda_stream, self._order,
                                      x.data_ptr(), x.numel() * x.element_size() // row_bytes, counts.data_ptr(),
                                      row_bytes, codes[0], codes[1], bases,
                                      self._base, self.rank,
                                      self.size, self._seq, self._seq % 2, self.inline_bytes, self.data_off,
                                      self.header_off, done, self._blocks(x.numel() * x.element_size()), result, host,
                                      self._timeout_ns if wait else 0)
        return _HostFlagRequest(self._host_np, 2 * self.size + 1, self._seq)

    def exchange(self, x: torch.Tensor, send: Sequence[int], send_displs: Optional[Sequence[int]], out: torch.Tensor,
                 recv: Sequence[int], recv_displs: Optional[Sequence[int]], row_bytes: int, meta: Any = None) -> Request:
        """Known-counts exchange by copy engines, on the backend's stream: ``send[p]`` rows from
        row ``send_displs[p]`` of ``x`` to rank ``p``, ``recv[p]`` rows from rank ``p`` to row
        ``recv_displs[p]`` of ``out`` (displacements None: blocks back to back). Collective:
        every rank calls it, also with nothing to move. Rows beyond a region's capacity go
        through NCCL afterwards, on the same stream. ``meta`` (what the exchange is,
        :class:`moecomm.engine.tags.ExchangeMeta`) is compared between the ranks on the peer
        backend (its records), not carried over NCCL."""
        if self.collective:
            return self._backend.alltoallv(x, send, out, recv, row_bytes, send_displs, recv_displs, meta=meta)
        me = self.rank
        b = self._backend
        # x and out are recorded on the backend's stream only: it waits for the own-block
        # copy on the second stream before its completion event, which is what frees them
        stream = b.begin(x, out)
        self.issue_round(stream, x, send, send_displs, out, recv, recv_displs, row_bytes)
        request = b.end("all_to_all_v (copy engines)", self.problem)
        # the rank's own block went whole (input to output): only the peers' overflow remains
        rest = self._overflow(x, send, send_displs, out, recv, recv_displs, row_bytes, me,
                              self.capacity_rows(row_bytes))
        return request if rest is None else rest  # (the rest follows on the same stream)

    def issue_round(self, stream: int, x: torch.Tensor, send: Sequence[int], send_displs: Optional[Sequence[int]],
                    out: torch.Tensor, recv: Sequence[int], recv_displs: Optional[Sequence[int]],
                    row_bytes: int, meta: Sequence[int] = ()) -> None:
        """Enqueue one known-counts round on ``stream`` (the backend's, after its ``begin``):
        the rank's own block whole, at most a region's capacity of every other block. The
        GPU waits for the peers' headers (spins): only for ranks that run concurrently.
        ``meta``: at most :data:`META_WORDS` ints that travel in the headers, compared by every
        receiver with its own (a difference is reported by :meth:`problem`)."""
        me = self.rank
        self._ce_half ^= 1
        # the ready kernel (moecomm_ext/csrc/p2p_cuda.cu) only where the exchange before this one on
        # the device may have used the same half: the first of a capture; eager ones once captured
        capture = self._ext.capture_id(stream)
        ready = capture != self._ce_capture if capture else self._ce_captured
        self._ce_captured = self._ce_captured or bool(capture)
        self._ce_capture = capture
        self._ce_exchange(stream, x, send, send_displs, out, recv, recv_displs, row_bytes,
                          1 + self._ce_half if ready else -1, (), True, meta)

    def issue_direct(self, stream: int, x: torch.Tensor, send: Sequence[int], send_displs: Sequence[int],
                     out: torch.Tensor, recv: Sequence[int], recv_displs: Sequence[int], row_bytes: int,
                     peer_dst: Sequence[int], copy_out: bool) -> None:
        """Enqueue one direct exchange on ``stream`` (concurrent ranks): after a ready kernel
        (every peer's stream has reached this exchange), the block for rank ``p`` goes whole to
        ``peer_dst[p]`` (an address in ``p``'s output, :meth:`map_output`), or, where that is 0,
        into ``p``'s region as in :meth:`issue_round` (it must fit one); then the headers, and
        the copy out of this rank's regions unless ``copy_out`` is False (every peer wrote
        straight into ``out``). The own block is not part of it (0 rows)."""
        self._ce_half ^= 1
        self._ce_captured = self._ce_captured or bool(self._ext.capture_id(stream))
        self._ce_exchange(stream, x, send, send_displs, out, recv, recv_displs, row_bytes, 0, peer_dst, copy_out)

    def _ce_exchange(self, stream: int, x: torch.Tensor, send: Sequence[int], send_displs: Optional[Sequence[int]],
                     out: torch.Tensor, recv: Sequence[int], recv_displs: Optional[Sequence[int]], row_bytes: int,
                     ready_slot: int, peer_dst: Sequence[int], copy_out: bool, meta: Sequence[int] = ()) -> None:
        self._ext.ce_exchange(self._device, stream, self._aux.cuda_stream, self._fork, self._join, x.data_ptr(),
                              out.data_ptr(), row_bytes, send, () if send_displs is None else send_displs, recv,
                              () if recv_displs is None else recv_displs,
                              self._base_list,
                              self._ptrs[0], self.rank, self._ce_state.data_ptr(), self._ce_half, ready_slot,
                              self.region_bytes, self.ce_data_off, self.ce_header_off, self.ce_ack_off,
                              self._status_t.data_ptr(), self._timeout_ns, peer_dst, copy_out, meta,
                              self.copy_kernels and sum(send) * row_bytes <= COPY_KERNELS_MAX_BYTES)

    def launch_rows_exchange(self, src: int, in_block: int, row_bytes: int, counts: int, scale: int, tables: int,
                             my_sync: int, state: int, done: int, recv_rows: int, status: int,
                             src_index: int = 0, src_rows: int = 0) -> None:
        """Enqueue a used-rows exchange on the caller's current stream (two kernels, see
        ``rows_exchange`` in ``csrc/p2p_cuda.cu``). Raw addresses: ``tables`` is 3 x size
        uint64 on the device (where this rank's block, flag slot and ready slot are in each
        rank's memory); ``my_sync`` this rank's own flag slots ([size, 2] int64), then its
        ready slots ([size] int64); ``recv_rows`` 0 for none; ``src_index`` (int64, one per
        row of the blocks; 0 for none): the blocks' rows gathered from ``src`` (``src_rows``
        rows) on the way."""
        W = self.size
        self._ext.rows_exchange(self._device, _cudart.current_stream(self._device), src, in_block, row_bytes,
                                src_index, src_rows, counts, scale, tables, tables + 8 * W, tables + 16 * W, my_sync, my_sync + 16 * W, state, done,
                                W, max(_ROWS_MIN_BLOCKS_PER_PEER, self.rows_blocks // W), recv_rows, status,
                                self._timeout_ns)

    def export_output(self, out: torch.Tensor) -> Optional[list[int]]:
        """What a peer needs to write into ``out`` (:meth:`map_output`): the IPC handle of the
        allocation ``out`` lies in (8 int64) and ``out``'s byte offset in it. None where the
        memory cannot be shared that way (not from ``cudaMalloc``: torch's expandable
        segments, say): then the exchange goes through the arenas."""
        ptr = out.data_ptr()
        try:
            base = _cudart.allocation_base(ptr)
            handle = self._ext.ipc_handle(base)
        except RuntimeError:
            return None
        return [*np.frombuffer(handle, dtype=np.int64).tolist(), ptr - base]

    def map_output(self, peer: int, shared: Sequence[int], keep: bool = False) -> int:
        """The address in this process of the output rank ``peer`` exported (``shared``, from
        its :meth:`export_output`). Each allocation is mapped through IPC once and kept:
        torch's caching allocator hands the same segments out again, so a steady loop maps
        nothing after its first steps. At most :data:`MAPPED_PER_PEER` per peer stay mapped
        (least recently used unmapped first, after the device is idle); the ones a CUDA
        graph captured, and those asked to be kept (``keep``: the caller holds the address
        for good), stay for the transport's life."""
        key = (peer, tuple(shared[:8]))
        base = self._mapped.get(key)
        if base is None:
            base = self._map(key)
        else:
            self._mapped.move_to_end(key)
        if keep or torch.cuda.is_current_stream_capturing():
            self._pinned.add(key)
        return base + int(shared[8])

    def _map(self, key: tuple) -> int:
        peer = key[0]
        mine = [k for k in self._mapped if k[0] == peer and k not in self._pinned]
        if len(mine) >= MAPPED_PER_PEER and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(self._backend.device)  # no copy still writes through the mapping closed here
            self._ext.ipc_close(self._mapped.pop(mine[0]))
        base = self._ext.ipc_open(self._device, np.array(key[1], dtype=np.int64).tobytes())
        self._mapped[key] = base
        self.output_maps += 1
        return base

    def issue_round_host(self, stream: int, x: torch.Tensor, send: Sequence[int], send_displs: Sequence[int],
                         out: torch.Tensor, recv: Sequence[int], recv_displs: Sequence[int], row_bytes: int,
                         handshake: Callable[[list[int]], list[list[int]]], peer_dst: Sequence[int] = (),
                         copy_out: bool = True) -> Optional[str]:
        """One known-counts round coordinated by the host, for ranks that share a GPU without
        MPS (a kernel spinning on a peer would hold the GPU's time slice): copies into the
        peers' regions, the host waits for them (at most the timeout), ``handshake`` (an
        all-gather of this rank's counts on the host) tells every rank that its peers' rows
        have landed, then copies out of this rank's regions. Blocks the host. The own block
        is not part of a round (0 rows). Returns what disagreed (None: nothing): then only
        the rows both sides agree on are copied out. ``peer_dst``, ``copy_out``: a direct
        exchange, as in :meth:`issue_direct` (the ranks that receive straight into their
        output synced their stream before they shared it: nothing waits on the GPU).

        Why two buffer halves suffice: a rank writes half h again two rounds later, after
        the handshake of the round between, which every peer joined only after its stream
        had passed its copy-out of the round that used h."""
        me, W = self.rank, self.size
        self._ce_half ^= 1
        half = self._ce_half
        cap = self.capacity_rows(row_bytes)
        xp, op = x.data_ptr(), out.data_ptr()
        for p in range(W):
            direct = bool(peer_dst) and peer_dst[p] != 0
            rows = send[p] if direct else min(send[p], cap)
            if p != me and rows > 0:
                region = peer_dst[p] if direct else \
                    self._base_list[p] + self.ce_data_off + (half * W + me) * self.region_bytes
                _cudart.copy_async(region, xp + send_displs[p] * row_bytes, rows * row_bytes, _cudart.D2D, stream)
        self.wait_stream(stream, "all_to_all_v (peer memory, copies to the peers)")
        table = handshake(list(send))
        problem = None
        for p in range(W):
            sent = table[p][me]
            if p != me and sent != recv[p] and problem is None:
                problem = (f"rank {me} expected {recv[p]} rows from rank {p} in this round, but rank {p} sent "
                           f"{sent} (the ranks' splits disagree)")
            rows = min(recv[p], sent, cap)
            if p != me and rows > 0 and copy_out:
                region = self._base + self.ce_data_off + (half * W + p) * self.region_bytes
                _cudart.copy_async(op + recv_displs[p] * row_bytes, region, rows * row_bytes, _cudart.D2D, stream)
        return problem

    def wait_stream(self, stream: int, op: str) -> None:
        """Block the host until ``stream`` has done what was issued on it, at most the timeout
        (then the backend is aborted and ``TimeoutError`` raised)."""
        _cudart.record(self._host_event, stream)
        event = self._host_event
        if not poll_yielding(lambda: _cudart.query(event), time.monotonic() + self._timeout_ns / 1e9):
            self._backend.abort()
            raise TimeoutError(f"moecomm: {op} did not complete on the GPU within {self._timeout_ns / 1e9:g} s on "
                               f"rank {self.rank}; the communicator was aborted")

    def problem(self, op: str = "all_to_all_v (copy engines)",
                meta_words: Sequence[str] = ()) -> Optional[BaseException]:
        """What the copy-engine wait kernel reported (checked once an exchange completes),
        named as ``op``; ``meta_words``: this rank's meta words in words, for the message."""
        codes = self._status[0::3]
        if not codes.any():
            return None
        p = int(np.flatnonzero(codes)[0])
        code, sent, expected = (int(v) for v in self._status[3 * p: 3 * p + 3])
        if code == 1:
            # equal blocks skip the host agreement: a peer that passed split sizes waits in it instead
            why = (f" (rank {p} is gone or stuck, or passed split sizes where rank {self.rank} passed none: "
                   f"every rank must pass none for equal blocks)") if meta_words else ""
            return TimeoutError(f"moecomm: {op} on rank {self.rank} received nothing from "
                                f"rank {p} within {self._timeout_ns / 1e9:g} s{why}; the communicator was aborted")
        if code == 3:  # sent: which meta word differs
            name = META_WORD_NAMES[sent] if 0 <= sent < len(META_WORD_NAMES) else f"meta word {sent}"
            mine = f" ({meta_words[sent]})" if 0 <= sent < len(meta_words) else ""
            return CountMismatchError(f"moecomm: {op}: rank {p} passes another {name} than rank {self.rank}{mine}: "
                                      f"every rank must pass the same; the communicator was aborted")
        return CountMismatchError(f"moecomm: {op}: rank {self.rank} expected {expected} rows "
                                  f"from rank {p}, but rank {p} sent {sent} (the ranks' splits disagree); the "
                                  f"communicator was aborted")

    def counts(self) -> tuple[list[int], list[int], bool]:
        """(sent, received, timed out) of the exchange :meth:`start` issued last."""
        values = self._host.tolist()
        W = self.size
        return values[W:2 * W], values[:W], bool(values[2 * W])

    def senders(self) -> np.ndarray:
        """What each source's header of the exchange :meth:`start` issued last said of it:
        ``[size, 4]`` int64 rows (dtype code, row-shape code, row bytes, flags:
        :data:`OVERFLOWS` where any of its blocks overflowed the inline capacity,
        :data:`BAD_COUNTS` where its counts were negative or added up to more than its rows,
        which then moved nowhere). Every rank reads every rank's header, so all see the same
        table."""
        W = self.size
        return self._host_np[2 * W + 2:6 * W + 2].reshape(W, 4).copy()

    def copy_out_regions(self, stream: int, out: torch.Tensor, recv: Sequence[int], row_bytes: int) -> None:
        """Enqueue on ``stream`` the copies of the rows that :meth:`start` (the last exchange) left in
        this rank's regions into ``out`` (sources in rank order), the received counts ``recv``
        known on the host: one copy per source; a block over the inline capacity is not in its
        region (it follows whole, :meth:`finish`'s remainder)."""
        cap = self.inline_bytes // row_bytes
        parity, W = self._seq % 2, self.size
        at = out.data_ptr()
        for p, n in enumerate(recv):
            if 0 < n <= cap:
                region = self._base + self.data_off + (parity * W + p) * self.inline_bytes
                _cudart.copy_async(at, region, n * row_bytes, _cudart.D2D, stream)
            at += n * row_bytes

    def rest_whole(self, x: torch.Tensor, out: torch.Tensor, send: list[int], recv: list[int],
                   row_bytes: int) -> Optional[Request]:
        """The blocks of the last exchange larger than :attr:`inline_bytes`, each sent whole
        through the backend (on the peer backend a known-counts exchange every rank joins); None
        where every pair fit and the backend needs no exchange to be joined (NCCL)."""
        return self._overflow(x, send, None, out, recv, None, row_bytes, None, self.inline_bytes // row_bytes,
                              whole=True)

    def finish(self, x: torch.Tensor, out: torch.Tensor, send: list[int], recv: list[int], row_bytes: int,
               overflows: bool = True) -> Request:
        """Copy the rows out of this rank's arena into ``out`` (one kernel on the caller's
        current stream, which must already be ordered after :meth:`start`'s request; it
        reads the counts on the device), then send the blocks larger than
        :attr:`inline_bytes` whole through the backend (NCCL, or the peer backend's
        known-counts exchange, which every rank joins where ``overflows``: some rank's header
        said so). Returns the request of that remainder (done at once when there is none)."""
        if out.numel():
            self._ext.launch_copy_out(self._device, self._base, self.data_off, self._seq % 2, self.size,
                                      self.inline_bytes, row_bytes, self._ptrs[2], out.data_ptr(),
                                      self._blocks(out.numel() * out.element_size()),
                                      _cudart.current_stream(self._device))
        if self.collective and not overflows:
            return DoneRequest()
        rest = self.rest_whole(x, out, send, recv, row_bytes)
        return DoneRequest() if rest is None else rest

    def _overflow(self, x: torch.Tensor, send: Sequence[int], send_displs: Optional[Sequence[int]],
                  out: torch.Tensor, recv: Sequence[int], recv_displs: Optional[Sequence[int]], row_bytes: int,
                  skip: Optional[int], cap: int, whole: bool = False) -> Optional[Request]:
        """What the arenas did not carry (rank ``skip`` left out), through the backend (NCCL,
        or the peer backend's known-counts exchange) on its stream: the rows beyond ``cap``
        per pair, from and into the places right after what the arenas carried, or with
        ``whole`` every block larger than ``cap``, whole. None when every pair fit (never on
        the peer backend: every rank joins its exchanges)."""
        if max(send) <= cap and max(recv) <= cap and not self.collective:
            return None
        send_displs = split_offsets(send) if send_displs is None else send_displs
        recv_displs = split_offsets(recv) if recv_displs is None else recv_displs

        def carried(n: int) -> int:  # what the arenas carried of a block of n rows
            return (n if n <= cap else 0) if whole else min(n, cap)

        extra_send = [0 if p == skip else n - carried(n) for p, n in enumerate(send)]
        extra_recv = [0 if p == skip else n - carried(n) for p, n in enumerate(recv)]
        return self._backend.alltoallv(x, extra_send, out, extra_recv, row_bytes,
                                       [d + carried(n) for d, n in zip(send_displs, send)],
                                       [d + carried(n) for d, n in zip(recv_displs, recv)])

    def _release(self) -> None:
        self._destroy_events()
        for ptr in [*self._opened, *getattr(self, "_mapped", {}).values()]:
            self._ext.ipc_close(ptr)
        self._opened = []
        if self._base:
            self._ext.free(self._base)
            self._base = 0

    def close(self, engine: "Engine") -> None:
        """Collective: unmap the peers' arenas, then (after a barrier, so that no peer still
        maps it) free this rank's. After an abort nothing is freed: a kernel may still
        run, and the memory goes with the process."""
        if not self._base:
            return
        torch.cuda.synchronize(self._backend.device)
        for ptr in [*self._opened, *self._mapped.values()]:
            self._ext.ipc_close(ptr)
        self._opened = []
        self._mapped.clear()
        engine.barrier()
        self._ext.free(self._base)
        self._base = 0
        self._destroy_events()

    def _destroy_events(self) -> None:
        for name in ("_fork", "_join", "_order"):
            event = getattr(self, name, 0)
            if event:
                self._ext.destroy_event(event)
            setattr(self, name, 0)
        if getattr(self, "_host_event", None) is not None:
            _cudart.destroy_event(self._host_event)
            self._host_event = None


class _HostFlagRequest(Request):
    """Done once the kernel has written ``seq`` into ``host[index]`` (mapped host memory, written
    last); ``join`` is a no-op: the work was issued on the caller's current stream."""

    __slots__ = ("_host", "_index", "_seq")

    def __init__(self, host: np.ndarray, index: int, seq: int) -> None:
        self._host, self._index, self._seq = host, index, seq

    def test(self) -> bool:
        return int(self._host[self._index]) == self._seq


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k
