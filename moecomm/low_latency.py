"""Low-latency dispatch and combine for decoding: every buffer allocated once, no host sync.

:class:`LowLatencyBuffer` moves the few tokens per rank of a decode step to the ranks holding
their experts and back, with everything sized for the worst case at construction, so that a
call allocates nothing, never waits for the device, and can be captured in a CUDA graph and
replayed with new routing and a new token count.

Tokens. ``x`` is ``[T, hidden]`` with ``0 <= T <= max_tokens_per_rank``. Eagerly ``T`` may
change from call to call (read from the shape, no sync). Under CUDA graph capture pass the
padded batch (``T = max_tokens_per_rank``) and a device scalar ``num_tokens``: tokens at or
past it are not sent and their combined rows are zero; update it in place before a replay.
A ``topk_idx`` entry of ``-1`` routes that slot nowhere (its weight is ignored).

Transport. Every exchange is a fixed-size all-to-all with equal blocks (sizes known on every
rank: no count exchange), through a :class:`Transport`. On the peer-memory backend (ranks of
one node, several per GPU allowed) the default is :class:`PeerMemoryTransport`: each block
copied straight into the peer's receive buffer, shared once, with no host agreement per call.
Elsewhere :class:`AllToAllTransport` calls ``comm.all_to_all_single`` (NCCL on GPUs:
capturable; MPI on CPU ranks).

Wire format (bytes per rank and exchange, ``W`` ranks, ``M = max_tokens_per_rank``):

* dispatch: each token travels once to each rank that holds one of its experts (not once
  per expert). Block for a peer: ``M`` rows of ``row_bytes`` each: the token (``hidden``
  elements of ``dtype``, or the packed FP8 row of :mod:`moecomm.quant`: FP8 bytes then
  float32 block scales), then its ``k`` global expert ids (int16, int32 past 32767
  experts), padded to 16 bytes. Used rows first, in token order; unused rows have ids -1.
* combine: block for a peer: ``M * min(k, local_experts)`` rows of ``combine_hidden``
  elements: for each row received from it, the outputs of its distinct local experts, in
  the order of the token's top-k slots. The source sums ``w[t, j] * y[t, j]`` over
  ``j = 0..k-1`` in float32, in that order, whatever order the blocks arrived in.

Expert-major layout. ``dispatch`` returns ``[local_experts, W * M, hidden]``: expert ``e``'s
rows first from rank 0 then rank 1 ..., each source's in token order; ``counts[e]`` are
used, the rest are stale (the experts may compute on them; ``combine`` never reads them).

Memory: see :meth:`LowLatencyBuffer.memory` (bytes per buffer, exact) and the class
docstring (the formula).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from . import quant

__all__ = ["LowLatencyBuffer", "DispatchHandle", "Dispatched", "Transport", "AllToAllTransport", "PeerMemoryTransport",
           "default_transport"]

_WIRE_BLOCK = quant.WIRE_BLOCK  # elements per float32 scale: the block of moecomm.wire's exchanges
_ALIGN = 16


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


class Transport:
    """How the fixed-size blocks move: one implementation per transport.

    ``exchange(output, input)``: ``input`` and ``output`` are contiguous ``[W * B, ...]``
    tensors of one dtype on the communicator's device; block ``p`` of ``input`` (rows
    ``p*B .. (p+1)*B - 1``) goes to rank ``p``, block ``p`` of ``output`` is filled from rank
    ``p``. Collective, in call order; it must not allocate or synchronise with the host if
    the buffer's calls are to be captured.
    """

    def exchange(self, output: Tensor, input: Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def bind_rows(self, outputs: Sequence[Tensor]) -> bool:
        """Optional: set up :meth:`exchange_rows` into these outputs (kept for good; collective,
        called once by every rank). True where this transport moves used rows only."""
        return False

    gathers_rows: bool = False
    """True where :meth:`exchange_rows` takes ``gather=``."""

    def exchange_rows(self, index: int, input: Tensor, counts: Tensor, scale: int, row_bytes: int,
                      recv_rows: Optional[Tensor] = None,
                      gather: Optional[Tensor] = None) -> None:  # pragma: no cover - interface
        """Where :meth:`bind_rows` said True: only the first ``counts[p] * scale`` rows (of
        ``row_bytes``) of block ``p`` of ``input`` go to rank ``p``'s output ``index``, at the
        start of this rank's block there; the rest of that block is left as it was.
        ``counts`` (int64 ``[W]``) is on the device; ``recv_rows`` (int64 ``[W]`` on the
        device, or None) gets the rows each rank sent here. Where :attr:`gathers_rows`,
        ``gather`` (int64, one per row of the output) makes the blocks ``input[gather]``,
        gathered on the way rather than first. No host synchronisation."""
        raise NotImplementedError


class AllToAllTransport(Transport):
    """The exchange as ``comm.all_to_all_single(output, input)`` with equal splits (NCCL or MPI);
    one rank: a device copy."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def exchange(self, output: Tensor, input: Tensor) -> None:
        if self.comm.size == 1:
            output.copy_(input)
        else:
            self.comm.all_to_all_single(output, input)


class PeerMemoryTransport(Transport):
    """The blocks written straight into the peers' buffers through CUDA IPC, on the
    peer-memory backend (``moecomm.init(backend="peer")``, the ranks of one node, several per
    GPU allowed): each output buffer is shared once, at its first exchange (a host all-gather:
    do it before a capture), then an exchange is one copy per peer into the peer's buffer
    with no host agreement and no arena in between; the GPU waits for every peer's stream to
    reach the exchange before writing, and checks the peers' headers. Capturable where the
    ranks' kernels run concurrently (one GPU each, or ranks sharing one under MPS); without
    MPS the host coordinates each exchange. The default transport on the peer backend.

    Raises (at construction) ``TypeError`` for a communicator on another backend."""

    def __init__(self, comm) -> None:
        backend = comm.engine.backend
        if not hasattr(backend, "fixed_alltoall"):
            raise TypeError(f"PeerMemoryTransport needs a communicator on the peer-memory backend "
                            f"(moecomm.init(backend='peer')), got backend {comm.backend!r}")
        self.comm = comm
        self._backend = backend
        self._destinations: dict = {}  # (output's address, bytes) -> where this rank's block goes in each peer's
        self._rows = None  # FixedRows, once bound

    def bind_rows(self, outputs: Sequence[Tensor]) -> bool:
        """Used rows only where the ranks' kernels run concurrently (one GPU each, or ranks
        sharing one under MPS): each block's used rows written by the GPU straight into the
        peer's output and a flag after them (:class:`moecomm.backends.peer.FixedRows`)."""
        self._rows = self._backend.fixed_rows(outputs)
        return self._rows is not None

    gathers_rows = True

    def exchange_rows(self, index: int, input: Tensor, counts: Tensor, scale: int, row_bytes: int,
                      recv_rows: Optional[Tensor] = None, gather: Optional[Tensor] = None) -> None:
        self._rows.exchange(index, input, counts, scale, row_bytes, recv_rows, gather)

    def exchange(self, output: Tensor, input: Tensor) -> None:
        block = input.nbytes // self.comm.size
        key = (output.data_ptr(), output.nbytes)
        dst = self._destinations.get(key)
        if dst is None:
            dst = self._destinations[key] = self._backend.fixed_destinations(output, block)
        request = self._backend.fixed_alltoall(input, output, block, dst)
        self.comm.engine.complete(request, "LowLatencyBuffer (peer memory)", None)


def default_transport(comm) -> Transport:
    """:class:`PeerMemoryTransport` on the peer-memory backend with more than one rank, else
    :class:`AllToAllTransport`."""
    if comm.size > 1 and hasattr(comm.engine.backend, "fixed_alltoall"):
        return PeerMemoryTransport(comm)
    return AllToAllTransport(comm)


@dataclass
class DispatchHandle:
    """What :meth:`LowLatencyBuffer.combine` needs of one dispatch: the token count and the
    dispatch's generation (the routing tables live in the buffer: a later dispatch of the
    same buffer invalidates this handle)."""

    num_rows: int
    """``T``, the rows of the dispatched ``x`` (the combine returns ``[T, combine_hidden]``)."""
    generation: int


class Dispatched(NamedTuple):
    """The result of :meth:`LowLatencyBuffer.dispatch` (views into the buffer's memory,
    overwritten by the next dispatch)."""

    x: Tensor
    """``[local_experts, W * M, hidden]``: ``dtype``, or FP8 with ``fp8_dispatch``."""
    scales: Optional[Tensor]
    """``[local_experts, W * M, ceil(hidden / 128)]`` float32 block scales (FP8), else None."""
    counts: Tensor
    """``[local_experts]`` int64 on the device: the used rows of each local expert."""
    handle: DispatchHandle


def _int_arg(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


class LowLatencyBuffer:
    """Preallocated dispatch and combine for at most ``max_tokens_per_rank`` tokens per rank.

    Args:
        comm: a :class:`moecomm.Communicator` (every rank builds its buffer with the same
            arguments; construction itself communicates nothing).
        max_tokens_per_rank: ``M``, the most tokens any rank dispatches in one call.
        hidden: elements per dispatched token.
        num_experts: ``E``, a multiple of ``comm.size``; rank ``r`` holds experts
            ``r * L .. (r + 1) * L - 1`` with ``L = E / W`` local experts.
        k: experts per token (``topk_idx`` is ``[T, k]``).
        dtype: float32, bfloat16 or float16: the tokens' and the experts' outputs' dtype.
        fp8_dispatch: False, True (``torch.float8_e4m3fn``) or an FP8 dtype: tokens travel
            and arrive quantized with :mod:`moecomm.quant`'s rule (blocks of 128 elements,
            a float32 scale each): the bits of ``quant.quantize_rows(x, fp8)``.
        combine_hidden: elements per expert output row (default ``hidden``).
        check_routing: check ``topk_idx``'s range on the host (raising ``ValueError``); it
            allocates and, on a GPU, synchronises, so the default is True on the CPU only.
            Unchecked entries outside ``[-1, E)`` are treated as ``-1``.
        transport: how blocks move (default :func:`default_transport`: the peers' buffers
            written through CUDA IPC on the peer-memory backend, else ``all_to_all_single``).
        use_native: lay out and place the rows with :mod:`moecomm_ext`'s kernels (one
            kernel for the source's tables, one for the receiver's, and the combine's sum in
            one; C++ on the CPU, CUDA on the GPU), as other ops default to (None:
            ``not $MOECOMM_EXT_DISABLE``); False, or where they are not built (one
            ``NativeBuildWarning``), the same results come from about 60 torch ops per
            dispatch. ``k`` above 32 always takes the torch ops.

    Memory (bytes, ``R = W * M``, ``kk = min(k, L)``, ``es`` the dtype's size, ``Hc`` =
    ``combine_hidden``; index tables of ``O(R * (k + L) + M * k * k)`` int64 besides):
    send and receive rows ``2 * R * row_bytes``; the expert-major output ``(L * R + 1) *
    hidden * es`` (FP8: ``(L * R + 1) * (hidden + 4 * ceil(hidden / 128))``); combine blocks
    ``(2 * R * kk + 1) * Hc * es``; the combine's gather ``M * k * Hc * es``, its float32
    sum ``4 * M * Hc`` and result ``M * Hc * es``. :meth:`memory` lists them.

    Raises:
        TypeError, ValueError: a bad argument, named, with its value.
    """

    def __init__(self, comm, max_tokens_per_rank: int, hidden: int, num_experts: int, k: int,
                 dtype: torch.dtype = torch.bfloat16, fp8_dispatch: Union[bool, torch.dtype] = False, *,
                 combine_hidden: Optional[int] = None, check_routing: Optional[bool] = None,
                 transport: Optional[Transport] = None, use_native: Optional[bool] = None) -> None:
        for attr in ("size", "rank", "device"):
            if not hasattr(comm, attr):
                raise TypeError(f"comm must be a moecomm.Communicator, got {type(comm).__name__}")
        W, rank, dev = comm.size, comm.rank, torch.device(comm.device)
        M = _int_arg("max_tokens_per_rank", max_tokens_per_rank, 1)
        H = _int_arg("hidden", hidden, 1)
        E = _int_arg("num_experts", num_experts, 1)
        k = _int_arg("k", k, 1)
        Hc = H if combine_hidden is None else _int_arg("combine_hidden", combine_hidden, 1)
        if E % W:
            raise ValueError(f"num_experts must be a multiple of the communicator's size {W}, got {E}")
        if dtype not in quant.INPUT_DTYPES:
            raise TypeError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
        if fp8_dispatch is True:
            fp8: Optional[torch.dtype] = torch.float8_e4m3fn
        elif fp8_dispatch is False or fp8_dispatch is None:
            fp8 = None
        else:
            fp8 = quant.check_wire_dtype(fp8_dispatch, "fp8_dispatch")
        if transport is not None and not isinstance(transport, Transport):
            raise TypeError(f"transport must be a moecomm.low_latency.Transport, got {type(transport).__name__}")
        L = E // W
        R = W * M
        kk = min(k, L)
        self._ll = _native_module(dev, use_native, k, W, L)
        native = self._ll is not None
        self.comm, self.rank, self.size, self.device = comm, rank, W, dev
        self.max_tokens_per_rank, self.hidden, self.num_experts, self.k = M, H, E, k
        self.local_experts, self.max_rows, self.combine_hidden = L, R, Hc
        self.dtype, self.fp8_dtype = dtype, fp8
        self.check_routing = dev.type == "cpu" if check_routing is None else bool(check_routing)
        self.transport = transport if transport is not None else default_transport(comm)
        self._kk = kk
        self._generation = 0
        es = torch.empty((), dtype=dtype).element_size()
        self._idx_dtype = torch.int16 if E < 2 ** 15 else torch.int32
        ie = self._id_bytes = 2 if self._idx_dtype == torch.int16 else 4
        self._nb = quant.num_blocks(H, _WIRE_BLOCK)
        self._payload = quant.packed_row_bytes(H, _WIRE_BLOCK) if fp8 is not None else _round_up(H * es, _ALIGN)
        self._scale_off = _round_up(H, 4)
        self.row_bytes = _round_up(self._payload + k * ie, _ALIGN)
        """Bytes of one dispatched row on the wire (token, then its ``k`` expert ids)."""

        def z(*shape, dt=torch.int64):
            return torch.zeros(shape, dtype=dt, device=dev)

        # -- the source's staged rows ([M + 1, ...]) --
        self._xs = z(M + 1, self.row_bytes, dt=torch.uint8)  # staged rows; row M: the unused row
        self._hdr(self._xs[M:]).fill_(-1)
        self._bidx = z(M, k)  # the combine's row of each slot
        self._qic = z(R, kk)  # [r, i]: the expert row of received row r's i-th distinct local expert
        # one rank with the default transport: the blocks are written where they land (no exchange)
        self._alone = W == 1 and type(self.transport) is AllToAllTransport
        self._recv = z(R, self.row_bytes, dt=torch.uint8)
        self._send = self._recv if self._alone else z(R, self.row_bytes, dt=torch.uint8)
        self._by_rows: Optional[bool] = None  # the transport moves used rows only (decided at the first dispatch)
        if native:
            self._send_tok = z(R)  # the staged row of each send row
            self._send_counts = z(W)  # used rows of each destination's block
            self._recv_counts = z(W)  # rows each source sent here
        else:
            self._reference_tables()
        self.counts = z(L) if native else self._ecum[R - 1, :L]
        """``[local_experts]`` int64: the used rows of each local expert after the last dispatch."""
        n_out = L * R + 1  # the last row takes the writes of unused slots
        if fp8 is not None:
            self._out = z(n_out, H, dt=torch.uint8)
            self._out_scales = z(n_out, self._nb, dt=torch.float32)
            self._out_x = self._out[:L * R].view(fp8).view(L, R, H)
            self._out_s = self._out_scales[:L * R].view(L, R, self._nb)
        else:
            self._out = z(n_out, H, dt=dtype)
            self._out_x = self._out[:L * R].view(L, R, H)
            self._out_s = None
        # -- combine --
        self._back_recv = z(R * kk + 1, Hc, dt=dtype)  # the last row stays zero: unused slots read it
        self._back_send = self._back_recv[:-1] if self._alone else z(R * kk, Hc, dt=dtype)
        self._w = z(M, k, dt=torch.float32)
        self._y = z(M, Hc, dt=dtype)
        if not native:
            self._gath = z(M * k, Hc, dt=dtype)
            self._gath32 = z(M * k, Hc, dt=torch.float32) if dtype != torch.float32 else None
            self._acc = z(M, Hc, dt=torch.float32)
            self._term = z(M, Hc, dt=torch.float32)

    @property
    def uses_native(self) -> bool:
        """Whether dispatch and combine run :mod:`moecomm_ext`'s kernels (else torch ops)."""
        return self._ll is not None

    def _gather_rows(self, src: Tensor, row_bytes: int) -> bool:
        """Whether the transport can pick the send rows from ``src`` on the way (no gather first)."""
        return (self.transport.gathers_rows and src.is_contiguous() and row_bytes % 16 == 0
                and src.data_ptr() % 16 == 0)

    def _exchange(self, output: Tensor, input: Tensor) -> None:
        if not self._alone:
            self.transport.exchange(output, input)

    def _reference_tables(self) -> None:
        """The tables of the op-by-op path (no native kernels)."""
        M, W, L, R, k, kk, dev = (self.max_tokens_per_rank, self.size, self.local_experts, self.max_rows, self.k,
                                  self._kk, self.device)

        def z(*shape, dt=torch.int64):
            return torch.zeros(shape, dtype=dt, device=dev)

        def c(v: int) -> Tensor:  # a Python number as an operand would be wrapped in a new tensor per call
            return torch.full((), v, dtype=torch.int64, device=dev)

        self._c_L, self._c_R, self._c_Mkk, self._c_rankL, self._c_LR = c(L), c(R), c(M * kk), c(self.rank * L), c(L * R)
        self._c_one = c(1)
        if self.fp8_dtype is not None:  # FP8 staging, moecomm.quant's rule op for op
            nbB = self._nb * _WIRE_BLOCK
            self._xf = z(M, nbB, dt=torch.float32)
            self._xq = z(M, nbB, dt=torch.float32)
            self._amax = z(M, self._nb, dt=torch.float32)
            self._scale = z(M, self._nb, dt=torch.float32)
            self._zero_amax = z(M, self._nb, dt=torch.bool)
            self._fp8_max = torch.full((1, 1), quant.FP8_MAX[self.fp8_dtype], dtype=torch.float32, device=dev)
            self._f_zero = torch.zeros((), dtype=torch.float32, device=dev)
        self._idx = z(M, k)
        self._bad = z(M, k, dt=torch.bool)
        self._bad_tok = z(M, 1, dt=torch.bool)
        self._tok = torch.arange(M, device=dev).view(M, 1)
        self._dr = z(M, k)  # destination rank of each slot, W for none
        self._goes = z(M, W + 1)
        self._cum = z(M, W + 1)
        self._pos = z(M, W + 1)  # position of the token in each destination's block
        self._stay = z(M, W + 1, dt=torch.bool)
        self._flat = z(M, W + 1)
        self._tokid = self._tok.expand(M, W + 1).contiguous()
        self._dbase = torch.arange(W + 1, device=dev).view(1, W + 1) * M
        self._src_tok = z(R + M + 1)  # row M * (W + 1) and past: where unused (token, rank) pairs go
        self._send_tok = self._src_tok[:R]
        # slot -> first slot with the same expert, and the rank of a slot among its rank's distinct experts
        self._first_tables = _FirstSlots(M, k, dev)
        self._p_src = z(M, k)
        self._src_invalid = z(M, k, dt=torch.bool)
        # -- the receiver's tables ([R, ...]) --
        self._ridx = z(R, k)
        self._rd = z(R, k)
        self._mine = z(R, k, dt=torch.bool)
        self._le = z(R, k)
        self._emask = z(R, L + 1)
        self._ecum = z(R, L + 1)
        self._epos = z(R, L + 1)
        self._q = z(R, k)
        self._recv_first = _FirstSlots(R, k, dev)
        self._take = z(R, k, dt=torch.bool)
        self._not_mine = z(R, k, dt=torch.bool)
        self._ii = z(R, k)
        self._qflat = z(R, k)
        self._row_col = torch.arange(R, device=dev).view(R, 1)
        self._qi = z(kk + 1, R)  # [i, r]: the expert row of row r's i-th distinct local expert

    # -- helpers -----------------------------------------------------------------------------

    def _hdr(self, rows: Tensor) -> Tensor:
        """The expert-id columns of wire rows ``[n, row_bytes]`` as ``[n, k]`` ids."""
        ie = 2 if self._idx_dtype == torch.int16 else 4
        return rows[:, self._payload:self._payload + self.k * ie].view(self._idx_dtype)

    def memory(self) -> dict:
        """Bytes of each preallocated buffer group: ``{"wire", "expert_rows", "combine",
        "staging", "tables"}`` and ``"total"``."""
        groups = {"wire": ("_send", "_recv"), "expert_rows": ("_out", "_out_scales"),
                  "combine": ("_back_send", "_back_recv", "_gath", "_gath32", "_acc", "_term", "_y", "_w"),
                  "staging": ("_xs", "_xf", "_xq", "_amax", "_scale")}
        storages: dict = {}  # data pointer -> bytes: views share their base's storage
        for v in vars(self).values():
            for t in v.tensors() if isinstance(v, _FirstSlots) else [v]:
                if isinstance(t, Tensor):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        out = {}
        for name, attrs in groups.items():
            ptrs = {getattr(self, a).untyped_storage().data_ptr() for a in attrs if getattr(self, a, None) is not None}
            out[name] = sum(storages.pop(p) for p in ptrs)
        out["tables"] = sum(storages.values())
        out["total"] = sum(out.values())
        return out

    def wire_bytes(self) -> dict:
        """Bytes one rank sends per call (its blocks for every rank, itself included):
        ``{"dispatch": W * M * row_bytes, "combine": W * M * min(k, L) * combine_hidden * es}``."""
        return {"dispatch": self._send.nbytes, "combine": self._back_send.nbytes}

    # -- dispatch ----------------------------------------------------------------------------

    def dispatch(self, x: Tensor, topk_idx: Tensor, num_tokens: Optional[Tensor] = None) -> Dispatched:
        """Send each token to the ranks of its experts; returns this rank's experts' rows.

        Args:
            x: ``[T, hidden]`` in ``dtype`` on the device, ``0 <= T <= max_tokens_per_rank``.
            topk_idx: ``[T, k]`` integer global expert ids in ``[0, num_experts)``, or -1 (the
                slot goes nowhere). A token may name an expert twice (its rows travel once).
            num_tokens: None, or a 0-dim integer device tensor: only tokens ``t < num_tokens``
                are sent (for a padded batch under CUDA graph capture).

        Returns:
            :class:`Dispatched` ``(x, scales, counts, handle)``, views into this buffer valid
            until the next dispatch (see the module docstring for the layout).

        Raises:
            TypeError, ValueError: a bad argument, named, before anything is sent.
        """
        T = self._check_dispatch(x, topk_idx, num_tokens)
        if self._ll is not None:
            self._dispatch_native(x, topk_idx, num_tokens, T)
        else:
            self._dispatch_reference(x, topk_idx, num_tokens, T)
        self._generation += 1
        return Dispatched(self._out_x, self._out_s, self.counts, DispatchHandle(T, self._generation))

    def _dispatch_native(self, x: Tensor, topk_idx: Tensor, num_tokens: Optional[Tensor], T: int) -> None:
        ll = self._ll
        if topk_idx.dtype != torch.int64 or not topk_idx.is_contiguous():
            topk_idx = topk_idx.to(torch.int64).contiguous()  # (the one allocation: other integer dtypes)
        if num_tokens is not None and num_tokens.dtype != torch.int64:
            num_tokens = num_tokens.to(torch.int64)
        if self._by_rows is None:  # (collective: every rank's first dispatch)
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("LowLatencyBuffer.dispatch: the first dispatch sets up the exchange with the peers "
                                   "(host agreement, a synchronize), which a CUDA graph capture cannot hold: run one "
                                   "dispatch and combine eagerly before capturing")
            self._by_rows = not self._alone and self.transport.bind_rows([self._recv, self._back_recv[:-1]])
        rows = self._by_rows
        self._stage_rows(x, T)
        ll.ll_dispatch_layout(topk_idx, num_tokens, self.num_experts, self.size, self._kk, self._xs, self._payload,
                              self._id_bytes, self._send_tok, self._bidx, self._send_counts if rows else None)
        if rows and self._gather_rows(self._xs, self.row_bytes):  # the send rows picked on the way
            self.transport.exchange_rows(0, self._xs, self._send_counts, 1, self.row_bytes, self._recv_counts,
                                         gather=self._send_tok)
        elif rows:
            torch.index_select(self._xs, 0, self._send_tok, out=self._send)
            self.transport.exchange_rows(0, self._send, self._send_counts, 1, self.row_bytes, self._recv_counts)
        else:
            torch.index_select(self._xs, 0, self._send_tok, out=self._send)
            self._exchange(self._recv, self._send)
        sent = self._recv_counts if rows else None
        if self.fp8_dtype is None:
            ll.ll_dispatch_place(self._recv, self._payload, self._id_bytes, self.k, self.rank, self.local_experts,
                                 self._out, 0, None, 0, self._qic, self.counts, sent)
        else:
            ll.ll_dispatch_place(self._recv, self._payload, self._id_bytes, self.k, self.rank, self.local_experts,
                                 self._out, 0, self._out_scales, self._scale_off, self._qic, self.counts, sent)

    def _dispatch_reference(self, x: Tensor, topk_idx: Tensor, num_tokens: Optional[Tensor], T: int) -> None:
        M, W, L, R, k, kk = self.max_tokens_per_rank, self.size, self.local_experts, self.max_rows, self.k, self._kk
        E = self.num_experts
        idx, bad = self._idx, self._bad
        # routing: invalid entries, padding and tokens past num_tokens become -1
        idx[:T].copy_(topk_idx)
        idx[T:].fill_(-1)
        torch.ge(idx, E, out=bad)
        idx.masked_fill_(bad, -1)
        torch.lt(idx, -1, out=bad)
        idx.masked_fill_(bad, -1)
        if num_tokens is not None:
            torch.ge(self._tok, num_tokens, out=self._bad_tok)
            idx.masked_fill_(self._bad_tok, -1)
        torch.lt(idx, 0, out=self._src_invalid)
        self._stage_rows(x, T)
        self._hdr(self._xs[:M]).copy_(idx)

        # the source's block layout: token t goes to rank d at position pos[t, d]
        dr = self._dr
        torch.div(idx, self._c_L, rounding_mode="floor", out=dr)
        dr.masked_fill_(self._src_invalid, W)
        goes = self._goes
        goes.zero_()
        goes.scatter_(1, dr, 1)
        torch.cumsum(goes, 0, out=self._cum)
        torch.sub(self._cum, goes, out=self._pos)
        torch.eq(goes, 0, out=self._stay)
        self._stay[:, W].fill_(True)
        torch.add(self._pos, self._dbase, out=self._flat)
        # unused (token, rank) pairs each write their own spare entry: no two writes collide
        torch.add(self._tokid, self._c_R, out=self._cum)
        torch.where(self._stay, self._cum, self._flat, out=self._flat)
        self._send_tok.fill_(M)
        self._src_tok.scatter_(0, self._flat.view(-1), self._tokid.view(-1))
        torch.index_select(self._xs, 0, self._send_tok, out=self._send)

        # the combine's gather index of each of the source's slots
        fs = self._first_tables
        fs.compute(idx, dr, self._src_invalid)
        torch.gather(self._pos, 1, dr, out=self._p_src)
        b = self._bidx
        torch.mul(dr, self._c_Mkk, out=b)
        b.add_(self._p_src, alpha=kk)
        b.add_(fs.rank_of_first)
        b.masked_fill_(self._src_invalid, R * kk)

        self._exchange(self._recv, self._send)
        self._place_rows()

    def _check_dispatch(self, x: Tensor, topk_idx: Tensor, num_tokens: Optional[Tensor]) -> int:
        M, H, k = self.max_tokens_per_rank, self.hidden, self.k
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != H or x.shape[0] > M:
            raise ValueError(f"x must be [T, hidden={H}] with T <= max_tokens_per_rank={M}, got shape {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise TypeError(f"x must have the buffer's dtype {self.dtype}, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"x must be on {self.device}, got {x.device}")
        T = x.shape[0]
        if not isinstance(topk_idx, Tensor):
            raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
        if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
            raise TypeError(f"topk_idx must be an integer tensor, got dtype {topk_idx.dtype}")
        if tuple(topk_idx.shape) != (T, k):
            raise ValueError(f"topk_idx must be [T={T}, k={k}], got shape {tuple(topk_idx.shape)}")
        if topk_idx.device != self.device:
            raise ValueError(f"topk_idx must be on {self.device}, got {topk_idx.device}")
        if num_tokens is not None:
            if not isinstance(num_tokens, Tensor) or num_tokens.dim() != 0 or num_tokens.dtype.is_floating_point \
                    or num_tokens.dtype == torch.bool or num_tokens.device != self.device:
                raise TypeError(f"num_tokens must be None or a 0-dim integer tensor on {self.device}, got "
                                f"{num_tokens!r}")
        if self.check_routing and T:
            lo, hi = (int(v) for v in torch.aminmax(topk_idx))
            if lo < -1 or hi >= self.num_experts:
                raise ValueError(f"topk_idx must hold expert ids in [-1, num_experts={self.num_experts}), got "
                                 f"min {lo}, max {hi}")
        return T

    def _stage_rows(self, x: Tensor, T: int) -> None:
        """Write the ``T`` tokens into the staged wire rows (packed FP8 with ``fp8_dispatch``)."""
        H = self.hidden
        if self.fp8_dtype is None:
            self._xs[:T, :self._payload].view(self.dtype)[:, :H].copy_(x)
            return
        if self._ll is not None:  # moecomm.quant's kernel, in one pass (the ids follow: the layout writes them)
            quant.pack_rows_into(x, self.fp8_dtype, self._xs[:T], _WIRE_BLOCK)
            return
        # moecomm.quant's rule, op for op, into preallocated buffers
        nb = self._nb
        xf = self._xf[:T]
        xf[:, :H].copy_(x)
        xb = xf.view(T, nb, _WIRE_BLOCK)
        xq = self._xq[:T].view(T, nb, _WIRE_BLOCK)
        torch.abs(xb, out=xq)
        amax, scale = self._amax[:T], self._scale[:T]
        torch.amax(xq, dim=2, out=amax)
        torch.div(amax, self._fp8_max, out=scale)
        torch.eq(amax, self._f_zero, out=self._zero_amax[:T])
        scale.masked_fill_(self._zero_amax[:T], 1.0)
        torch.div(xb, scale.unsqueeze(2), out=xq)
        rows = self._xs[:T]
        rows[:, :H].view(self.fp8_dtype).copy_(self._xq[:T, :H])
        rows[:, self._scale_off:self._scale_off + 4 * nb].view(torch.float32).copy_(scale)

    def _place_rows(self) -> None:
        """The received rows into the expert-major output (and the combine's gather index)."""
        W, L, R, k, kk, rank = self.size, self.local_experts, self.max_rows, self.k, self._kk, self.rank
        ridx = self._ridx
        ridx.copy_(self._hdr(self._recv))
        invalid = self._not_mine
        rd = self._rd
        torch.div(ridx, self._c_L, rounding_mode="floor", out=rd)
        torch.eq(rd, rank, out=self._mine)
        le = self._le
        torch.sub(ridx, self._c_rankL, out=le)
        torch.logical_not(self._mine, out=invalid)
        le.masked_fill_(invalid, L)
        em = self._emask
        em.zero_()
        em.scatter_(1, le, 1)
        torch.cumsum(em, 0, out=self._ecum)
        torch.sub(self._ecum, em, out=self._epos)
        q = self._q
        torch.gather(self._epos, 1, le, out=q)
        q.add_(le, alpha=R)
        # the i-th distinct local expert of each row: as the source numbers them
        fs = self._recv_first
        rd.masked_fill_(invalid, W)
        fs.compute(ridx, rd, invalid)
        torch.logical_and(self._mine, fs.is_first, out=self._take)
        torch.logical_not(self._take, out=invalid)
        ii = self._ii
        self._qflat.copy_(self._take)  # scratch: a cumsum of bools would allocate their int64 copy
        torch.cumsum(self._qflat, 1, out=ii)
        ii.sub_(self._c_one)
        ii.masked_fill_(invalid, kk)
        # flat [i, r] entry; slots not taken go to row kk (not read)
        torch.mul(ii, self._c_R, out=self._qflat)
        self._qflat.add_(self._row_col)
        qi = self._qi
        qi.fill_(L * R)
        qi.view(-1).scatter_(0, self._qflat.view(-1), q.view(-1))
        torch.remainder(qi[:kk].t(), self._c_LR, out=self._qic)
        rows = self._recv
        if self.fp8_dtype is None:
            src = rows[:, :self._payload].view(self.dtype)[:, :self.hidden]
            for i in range(kk):
                self._out.index_copy_(0, qi[i], src)
        else:
            nb = self._nb
            src_q = rows[:, :self.hidden]
            src_s = rows[:, self._scale_off:self._scale_off + 4 * nb].view(torch.float32)
            for i in range(kk):
                self._out.index_copy_(0, qi[i], src_q)
                self._out_scales.index_copy_(0, qi[i], src_s)

    # -- combine -----------------------------------------------------------------------------

    def combine(self, expert_y: Tensor, topk_weights: Tensor, handle: DispatchHandle) -> Tensor:
        """Send the experts' outputs home and sum each token's, weighted, in slot order.

        Args:
            expert_y: ``[local_experts, W * M, combine_hidden]`` in ``dtype``, contiguous:
                row ``i`` of expert ``e`` is the output for row ``i`` of the dispatch's
                ``x[e]`` (rows past ``counts[e]`` are not read).
            topk_weights: ``[T, k]`` floating, on the device: the weight of each slot
                (slots routed to -1, and tokens past ``num_tokens``, count as 0).
            handle: the handle of this buffer's last dispatch.

        Returns:
            ``[T, combine_hidden]`` in ``dtype``: ``sum_j w[t, j] * y[t, j]`` in float32,
            ``j = 0..k-1`` in order (deterministic), rounded once; zero for tokens with no
            slot. A view into this buffer, overwritten by the next combine.

        Raises:
            TypeError, ValueError: a bad argument, named; ``ValueError`` also for a handle of
                an earlier dispatch.
        """
        T = self._check_combine(expert_y, topk_weights, handle)
        M, k, Hc = self.max_tokens_per_rank, self.k, self.combine_hidden
        rows = expert_y.view(-1, Hc)
        back_bytes = Hc * self._back_send.element_size()
        if self._by_rows and self._gather_rows(rows, back_bytes):  # each source gets back kk rows per row it
            self.transport.exchange_rows(1, rows, self._recv_counts, self._kk, back_bytes,  # sent here, picked
                                         gather=self._qic.view(-1))                    # on the way
        elif self._by_rows:
            torch.index_select(rows, 0, self._qic.view(-1), out=self._back_send)
            self.transport.exchange_rows(1, self._back_send, self._recv_counts, self._kk, back_bytes)
        else:
            torch.index_select(rows, 0, self._qic.view(-1), out=self._back_send)
            self._exchange(self._back_recv[:-1], self._back_send)
        if self._ll is not None:
            w = topk_weights
            if w.dtype != torch.float32 or not w.is_contiguous():
                w = self._w[:T]
                w.copy_(topk_weights)
            y = self._y[:T]
            result = self._ll.gather_reduce_rows(self._back_recv, self._bidx[:T], w, out=y)
            if isinstance(result, tuple) and result[1] >= 0:  # (the CPU kernel's report of a bad row)
                raise RuntimeError(f"LowLatencyBuffer.combine: internal error, combine row index {result[1]} "
                                   f"out of range")
            return y
        gath = self._gath[:T * k]
        torch.index_select(self._back_recv, 0, self._bidx[:T].view(-1), out=gath)
        w = self._w[:T]
        w.copy_(topk_weights)
        w.masked_fill_(self._src_invalid[:T], 0.0)
        if self._gath32 is not None:  # mixed-dtype arithmetic would allocate float32 copies
            self._gath32[:T * k].copy_(gath)
            gath = self._gath32[:T * k]
        acc = self._acc[:T]
        acc.zero_()
        g3 = gath.view(T, k, Hc)
        term = self._term[:T]
        for j in range(k):  # each product rounded, then added (no fused multiply-add), as the CPU kernel does
            torch.mul(g3[:, j], w[:, j:j + 1], out=term)
            acc.add_(term)
        y = self._y[:T]
        y.copy_(acc)
        return y

    def _check_combine(self, expert_y: Tensor, topk_weights: Tensor, handle: DispatchHandle) -> int:
        L, R, Hc, k = self.local_experts, self.max_rows, self.combine_hidden, self.k
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the DispatchHandle of this buffer's dispatch, got {type(handle).__name__}")
        if handle.generation != self._generation:
            raise ValueError(f"handle is of dispatch {handle.generation} of this buffer, but dispatch "
                             f"{self._generation} has run since: combine each dispatch before the next")
        T = handle.num_rows
        if not isinstance(expert_y, Tensor):
            raise TypeError(f"expert_y must be a torch.Tensor, got {type(expert_y).__name__}")
        if tuple(expert_y.shape) != (L, R, Hc):
            raise ValueError(f"expert_y must be [local_experts={L}, max_rows={R}, combine_hidden={Hc}], got shape "
                             f"{tuple(expert_y.shape)}")
        if expert_y.dtype != self.dtype:
            raise TypeError(f"expert_y must have the buffer's dtype {self.dtype}, got {expert_y.dtype}")
        if expert_y.device != self.device or not expert_y.is_contiguous():
            raise ValueError(f"expert_y must be contiguous on {self.device}, got strides {expert_y.stride()} on "
                             f"{expert_y.device}")
        if not isinstance(topk_weights, Tensor) or not topk_weights.dtype.is_floating_point:
            raise TypeError(f"topk_weights must be a floating torch.Tensor, got "
                            f"{topk_weights.dtype if isinstance(topk_weights, Tensor) else type(topk_weights).__name__}")
        if tuple(topk_weights.shape) != (T, k) or topk_weights.device != self.device:
            raise ValueError(f"topk_weights must be [T={T}, k={k}] on {self.device}, got shape "
                             f"{tuple(topk_weights.shape)} on {topk_weights.device}")
        return T


def _native_module(dev: torch.device, use_native: Optional[bool], k: int, world: int, local_experts: int):
    """moecomm_ext's module for the buffer's kernels, or None: not built, not wanted, or a
    shape the kernels do not take (``k`` > 32; on a GPU, ranks or local experts past what one
    block's 48 KiB of shared memory can count)."""
    if use_native is not None and not isinstance(use_native, bool):
        raise TypeError(f"use_native must be None or a bool, got {use_native!r}")
    if k > 32 or (dev.type == "cuda" and 2 * max(world, local_experts) > 12 * 1024):
        return None
    from moecomm_ext.unchecked import low_latency_ops

    return low_latency_ops(dev, use_native)


class _FirstSlots:
    """For ``n`` rows of ``k`` slots (expert ids, with their ranks): whether each slot is the
    first naming its expert, and ``rank_of_first``: the number of distinct experts of the
    slot's rank before its first occurrence (the slot's place in the combine block)."""

    def __init__(self, n: int, k: int, dev: torch.device) -> None:
        self.k = k
        self._eq = torch.zeros(n, k, k, dtype=torch.bool, device=dev)
        self._cand = torch.zeros(n, k, k, dtype=torch.int64, device=dev)
        self._first = torch.zeros(n, k, dtype=torch.int64, device=dev)
        self.is_first = torch.zeros(n, k, dtype=torch.bool, device=dev)
        self._valid = torch.zeros(n, k, dtype=torch.bool, device=dev)
        self._count = torch.zeros(n, k, dtype=torch.int64, device=dev)
        self.rank_of_first = torch.zeros(n, k, dtype=torch.int64, device=dev)
        self._slot = torch.arange(k, device=dev)
        self._k = torch.full((), k, dtype=torch.int64, device=dev)
        # [j, j']: j' < j
        self._before = torch.ones(k, k, dtype=torch.bool, device=dev).tril(-1)

    def tensors(self) -> list:
        return [t for t in vars(self).values() if isinstance(t, Tensor)]

    def compute(self, idx: Tensor, rank: Tensor, invalid: Tensor) -> None:
        """``idx``, ``rank``: ``[n, k]`` int64 (invalid slots: any id, their rows skip them)."""
        k = self.k
        eq, cand = self._eq, self._cand
        torch.eq(idx.unsqueeze(2), idx.unsqueeze(1), out=eq)
        torch.where(eq, self._slot, self._k, out=cand)
        torch.amin(cand, dim=2, out=self._first)
        torch.eq(self._first, self._slot, out=self.is_first)
        torch.logical_not(invalid, out=self._valid)
        self.is_first.logical_and_(self._valid)
        # distinct experts of the same rank strictly before slot j: [n, j, j']
        torch.eq(rank.unsqueeze(2), rank.unsqueeze(1), out=eq)
        eq.logical_and_(self.is_first.unsqueeze(1))
        eq.logical_and_(self._before)
        cand.copy_(eq)  # summing a bool tensor would allocate its int64 copy
        torch.sum(cand, dim=2, out=self._count)
        torch.gather(self._count, 1, self._first, out=self.rank_of_first)
