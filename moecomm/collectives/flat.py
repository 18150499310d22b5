"""The flat variable-length exchange on an engine: validate, learn or check the counts
(:mod:`moecomm.engine.peer_check`), and issue the rows through the backend, the peer-memory
transport's kernels (counts on the GPU) or its copy engines (known counts).

Every function takes the :class:`moecomm.engine.engine.Engine` of the communicator (or of a 2DH
sub-communicator) it runs on.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch

from ..engine import tags as _tags
from ..engine.peer_check import PeerCheck
from ..errors import CountMismatchError
from ..engine.requests import CheckedRequest, RaiseAfter
from ..backends._p2p_limits import BAD_COUNTS, OVERFLOWS, ROW_ALIGN as PEER_ROW_ALIGN
from ..backends.base import DoneRequest, Request
from ..splits import Splits, check_own_block, check_split_total, normalize_splits, split_offsets

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.engine import Engine

__all__ = ["PEER_ROW_ALIGN", "start_all_to_all_v", "start_all_to_all_single",
           "start_all_to_all_list", "start_records", "settle", "exchange_records", "check_exchanged_counts",
           "alltoallv"]


def _on_gpu(splits: Any) -> bool:
    return isinstance(splits, torch.Tensor) and splits.device.type != "cpu"


def check_exchanged_counts(engine: Engine, send: list[int], recv: list[int], rows: int, sent: str,
                           x: Optional[torch.Tensor] = None) -> Optional[str]:
    """Counts from a GPU tensor, checked once they reach the host, after ``sent`` went out.
    A bad count aborts the engine (its peers have what was sent) and raises, unless
    ``validate``, where it is returned for the cross-check to raise on every rank. On a backend
    whose every exchange every rank joins, agreeing before any row moves (the peer backend),
    a rank given its input ``x`` instead joins the row exchange sending nothing: its peers'
    agreement refuses it, every rank raises and the communicator stays usable."""
    try:
        check_split_total(send, rows, "send_splits", "input")
        for name, vals in (("send_splits", send), ("recv_splits (received)", recv)):
            if any(v < 0 for v in vals):
                raise ValueError(f"{name} must be >= 0, got {vals}")
    except ValueError as exc:
        if engine.validate:
            return str(exc)
        if x is None or not engine.backend.collective_exchanges or engine.size == 1:
            engine.abort()
            raise ValueError(f"{exc} (the communicator was aborted: peers had received {sent})") from None
        _join_sending_nothing(engine, x, recv)
        bad = [p for p, v in enumerate(recv) if v < 0]
        if bad and min(send) >= 0 and sum(send) == rows:  # not this rank's splits: a peer's
            raise CountMismatchError(f"moecomm: all_to_all_v: rank(s) {bad}'s send_splits are negative (this rank "
                                     f"received {recv}); nothing was sent") from None
        raise ValueError(f"{exc}; nothing was sent (the peers' exchange was refused)") from None
    return None


def _join_sending_nothing(engine: Engine, x: torch.Tensor, recv: list[int]) -> None:
    """The row exchange of :func:`check_exchanged_counts`'s refusal: this rank sends no row (its
    peers, expecting some, refuse it in the agreement and raise)."""
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    if row_bytes == 0:  # as the peers' exchange of rows of no bytes (alltoallv below): empty, agreed
        expect, row_bytes, meta = [0] * engine.size, 1, None
    else:
        expect, meta = (recv if min(recv) >= 0 else [0] * engine.size), engine.meta_of(x)
    out = engine.output(sum(expect), tuple(x.shape[1:]), x.dtype)
    try:
        request = engine.backend.alltoallv(x[:0], [0] * engine.size, out, expect, row_bytes, meta=meta)  # (peer)
        engine.wait_host(request, "all_to_all_v (refused: bad send_splits)", None)
    except CountMismatchError:
        pass  # (the peers raise theirs, naming this rank: what it sends disagrees with their counts)


def start_all_to_all_v(engine: Engine, input: torch.Tensor, send_splits: Splits, recv_splits: Optional[Splits]
                       ) -> tuple[torch.Tensor, list[int], list[int], Request]:
    """The flat ``all_to_all_v``: validate, learn the counts and issue the exchange.
    Returns (output, send, recv, request); see ``Communicator.all_to_all_v``."""
    op = "all_to_all_v"
    engine.check_open(op)
    x = engine.check_tensor(input, "input", min_dim=1)
    rows, row_shape = x.shape[0], tuple(x.shape[1:])
    problem: Optional[str] = None
    records: Optional[tuple] = None
    if (recv_splits is None or _on_gpu(send_splits) or _on_gpu(recv_splits)) and engine.capturing():
        raise RuntimeError(f"{op}: recv_splits must be given, and both splits on the host (ints, numpy or "
                           f"CPU tensors), while a CUDA graph is captured: reading counts from the GPU or "
                           f"exchanging them needs the host, which a captured graph cannot involve")
    device_counts = (
        recv_splits is None and isinstance(send_splits, torch.Tensor) and send_splits.device.type != "cpu"
    )
    row_bytes = math.prod(row_shape) * x.element_size()
    if device_counts and row_bytes > 0 and row_bytes % PEER_ROW_ALIGN == 0:
        if engine.peer is not None:
            return _start_peer_exchange(engine, x, send_splits, row_bytes)
        if engine.backend.counts_in_one_host_round:
            return _start_counts_round(engine, x, send_splits, row_bytes)
    if device_counts:
        engine.check_count_tensor(send_splits, "send_splits")
        check = PeerCheck(op, engine.rank, [[0]] * engine.size, None, x.dtype, row_shape)
        send, recv, issues, stuck = exchange_records(engine, check, send_splits)
        problem = check_exchanged_counts(engine, send, recv, rows, "the counts", x)
    else:
        send = normalize_splits(send_splits, "send_splits", engine.size)
        check_split_total(send, rows, "send_splits", "input")
        if recv_splits is None:
            check = PeerCheck(op, engine.rank, [[c] for c in send], None, x.dtype, row_shape)
            send, recv, issues, stuck = exchange_records(engine, check)
        else:
            recv = engine.check_recv_splits(recv_splits, x)
            check = PeerCheck(op, engine.rank, [[c] for c in send], [[c] for c in recv], x.dtype, row_shape)
            issues, stuck = None, False
            records = start_records(engine, check)  # (validate=True) compared beside the rows
    try:
        if engine.validate:
            engine.cross_check(op, send, recv, x.dtype, row_shape, problem)
        out = engine.output(sum(recv), row_shape, x.dtype)
        request = alltoallv(engine, x, send, out, recv, check=check, issues=issues, stuck=stuck, records=records)
    except BaseException:
        settle(engine, records)
        raise
    return out, send, recv, request


def start_all_to_all_single(engine: Engine, op: str, x: torch.Tensor, send: list[int], out: torch.Tensor,
                            recv: list[int], equal: bool = False) -> Request:
    """The exchange of ``all_to_all_single`` (arguments checked): both sides' counts are given,
    so with ``validate`` they are cross-checked first, and their records travel beside the
    rows (:func:`start_records`) to be compared at completion. ``equal``: no split sizes were
    given (equal blocks on every rank, by torch's contract): a backend that checks such an
    exchange where it lands takes it with no agreement first (``Backend.alltoall_equal``),
    unless ``validate``."""
    row_shape = (math.prod(x.shape[1:]),)
    row_bytes = row_shape[0] * x.element_size()
    if equal and row_bytes and not engine.validate and engine.size > 1:
        request = engine.backend.alltoall_equal(x, out, send[0], row_bytes, engine.meta_of(x), op)
        if request is not None:
            return request
    check = PeerCheck(op, engine.rank, [[c] for c in send], [[c] for c in recv], x.dtype, row_shape)
    records = start_records(engine, check)
    try:
        if engine.validate:
            engine.cross_check(op, send, recv, x.dtype, row_shape, None)
        return alltoallv(engine, x, send, out, recv, check=check, records=records)
    except BaseException:
        settle(engine, records)
        raise


def start_all_to_all_list(engine: Engine, op: str, outs: list[torch.Tensor], ins: list[torch.Tensor]
                          ) -> tuple[Request, Callable[[], None]]:
    """The exchange of ``all_to_all`` (one tensor per peer and direction, any shapes, one dtype,
    checked): each side's tensors travel as bytes packed into one buffer, with counts in
    bytes. Returns the request and the unpacking into ``outs`` to run once it completes."""
    esize = ins[0].element_size()
    send = [t.numel() * esize for t in ins]
    recv = [t.numel() * esize for t in outs]
    check = PeerCheck(op, engine.rank, [[c] for c in send], [[c] for c in recv], ins[0].dtype, (), unit="bytes")
    records = start_records(engine, check)
    try:
        if engine.validate:
            engine.cross_check(op, send, recv, torch.uint8, (1,), None)
        packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in ins]) if sum(send) else \
            torch.empty(0, dtype=torch.uint8, device=engine.device)
        landing = torch.empty(sum(recv), dtype=torch.uint8, device=engine.device)
        request = alltoallv(engine, packed, send, landing, recv, check=check, records=records)
    except BaseException:
        settle(engine, records)
        raise

    def unpack() -> None:
        offset = 0
        for t, n in zip(outs, recv):
            t.reshape(-1).view(torch.uint8).copy_(landing[offset:offset + n])
            offset += n

    return request, unpack


def start_records(engine: Engine, check: PeerCheck) -> Optional[tuple]:
    """With ``validate``: send ``check``'s records (counts were given, so no count exchange
    carried them), before anything else of the call, as a call without ``recv_splits``
    exchanges its counts first. Host backends: non-blocking, ``(request, mine, theirs)``;
    NCCL: exchanged at once (validate=True blocks the host anyway). None: not sent."""
    if engine.size == 1 or not (engine.validate or (engine.records_beside and not engine.tagged)):
        return None
    if engine.backend.stream_ordered:
        _, got = engine.exchange_ints(check.record(), check.per_peer, f"{check.op} (count records)")
        return DoneRequest(), None, torch.tensor(got, dtype=torch.int64)
    mine = torch.tensor(check.record(), dtype=torch.int64)
    theirs = torch.empty_like(mine)
    return engine.start_ints(mine, theirs, check.per_peer, f"{check.op} (count records)"), mine, theirs


def settle(engine: Engine, records: Optional[tuple]) -> None:
    """Records from :func:`start_records` that no request took over (the call failed
    after sending them): wait for them, as every rank sends its records first, so that
    MPI never writes into freed memory; past the timeout they are kept referenced."""
    if records is None:
        return
    try:  # (at: a wait of the failure's, not a step of the call: moecomm.engine.notices)
        engine.wait_host(records[0], "count records (of a call that failed)", None, engine.wait_position())
    except BaseException:  # noqa: BLE001 - the caller's error is the one to report
        engine.keep(records)


def exchange_records(engine: Engine, check: PeerCheck, counts: Optional[torch.Tensor] = None
                     ) -> tuple[list[int], list[int], list[str], bool]:
    """The count exchange of a call without ``recv_splits``: every rank's records
    (:mod:`moecomm.engine.peer_check`), blocking. Returns (send, recv, disagreements) with one
    count per peer, and whether some rows could never arrive; ``counts`` (a count tensor, any
    device) replaces ``check.sent``."""
    values: Any = check.record() if counts is None else check.record_tensor(counts)
    mine, got = engine.exchange_ints(values, check.per_peer, f"{check.op} (count exchange)")
    n = check.per_peer
    if counts is not None:
        check.sent = [[mine[p * n]] for p in range(engine.size)]
    theirs, issues, stuck = check.compare(got)
    return [s[0] for s in check.sent], [t[0] for t in theirs], issues, stuck


def _gpu_counts_inputs(engine: Engine, x: torch.Tensor, counts: torch.Tensor) -> tuple:
    """What the counts-on-the-GPU kernel takes: ``(x, counts, meta, codes)``, the rows 16-byte
    aligned (the kernel moves 16-byte vectors), the counts contiguous int64 on this GPU (it reads
    them there), what the exchange is and its two header codes (the row shape apart)."""
    engine.check_count_tensor(counts, "send_splits")
    c = counts.to(device=engine.device, dtype=torch.int64).contiguous()
    if x.data_ptr() % PEER_ROW_ALIGN:
        x = x.clone()
    meta = _tags.exchange_meta(x.dtype, x.shape[1:])
    return x, c, meta, (_kind_code(meta), meta.codes[2])


def _start_peer_exchange(engine: Engine, x: torch.Tensor, counts: torch.Tensor,
                         row_bytes: int) -> tuple[torch.Tensor, list[int], list[int], Request]:
    """``all_to_all_v`` with the counts on the GPU through peer memory (``init(p2p_bytes=)``):
    the rows move with the counts, in one round (see :mod:`moecomm.backends.p2p`)."""
    op = "all_to_all_v"
    x, c, meta, codes = _gpu_counts_inputs(engine, x, counts)
    request = engine.peer.start(x, c, row_bytes, codes)
    engine.wait_host(request, f"{op} (peer memory)", None)
    send, recv, timed_out = engine.peer.counts()
    if timed_out:
        engine.abort()
        raise TimeoutError(f"moecomm: {op} (peer memory) did not receive every rank's rows within "
                           f"{engine.timeout:g} s on rank {engine.rank}; the communicator was aborted")
    heads = engine.peer.senders().tolist()
    _check_heads(engine.rank, heads, codes, row_bytes, meta, send, x.shape[0])
    problem = check_exchanged_counts(engine, send, recv, x.shape[0], "the rows")
    if engine.validate:
        engine.cross_check(op, send, recv, x.dtype, tuple(x.shape[1:]), problem)
    out = torch.empty((sum(recv),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    request.join()  # (the kernels ran on the caller's stream: nothing to order)
    return out, send, recv, engine.peer.finish(x, out, send, recv, row_bytes, any(h[3] & OVERFLOWS for h in heads))


def _start_counts_round(engine: Engine, x: torch.Tensor, counts: torch.Tensor,
                        row_bytes: int) -> tuple[torch.Tensor, list[int], list[int], Request]:
    """``all_to_all_v`` with the counts on the GPU on ranks that share a GPU without MPS: the
    peer backend's one host round (:meth:`moecomm.backends.peer.PeerBackend.counts_round`)."""
    op = "all_to_all_v"
    x, c, meta, codes = _gpu_counts_inputs(engine, x, counts)
    rnd = engine.backend.counts_round(x, c, row_bytes, codes)
    _check_heads(engine.rank, rnd.heads, codes, row_bytes, meta, rnd.send, x.shape[0])
    if engine.validate:
        engine.cross_check(op, rnd.send, rnd.recv, x.dtype, tuple(x.shape[1:]), None)
    out = torch.empty((sum(rnd.recv),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, rnd.send, rnd.recv, engine.backend.finish_counts_round(x, out, rnd, row_bytes)


@functools.lru_cache(maxsize=256)  # an explicit cache: a training loop asks the same few each step
def _kind_code(meta: _tags.ExchangeMeta) -> int:
    """One code of an exchange's dtype, wire dtype and kind (its label)."""
    return zlib.crc32("|".join((meta.words[1], meta.words[3], meta.words[0])).encode()) & 0x7FFFFFFF


def _check_heads(me: int, heads: list[list[int]], codes: tuple[int, int], row_bytes: int, meta: _tags.ExchangeMeta,
                 send: list[int], rows: int) -> None:
    """Raise :func:`_header_error`'s error where the heads of a counts-on-the-GPU exchange (every
    rank's: dtype code, row-shape code, row bytes, flags) show one: every rank has read every
    head, so all raise and none is left waiting. The common case in one pass over the rows."""
    if all(h[0] == codes[0] and h[1] == codes[1] and not h[3] & BAD_COUNTS for h in heads):
        return
    error = _header_error(me, np.asarray(heads, dtype=np.int64), codes, row_bytes, meta, send, rows)
    if error is not None:
        raise error


def _header_error(me: int, senders: Any, codes: tuple[int, int], row_bytes: int, meta: _tags.ExchangeMeta,
                  send: list[int], rows: int) -> Optional[Exception]:
    """The error every rank raises after a counts-on-the-GPU exchange whose headers
    (``senders``, :meth:`moecomm.backends.p2p.PeerTransport.senders`) show bad counts or a
    dtype or row-shape disagreement, or None. Nothing is returned after such an exchange and
    the communicator stays usable (the kernel moved no row of a rank with bad counts)."""
    op = "all_to_all_v (peer memory)"
    bad = np.flatnonzero(senders[:, 3] & BAD_COUNTS)
    if me in bad:
        if any(v < 0 for v in send):
            return ValueError(f"send_splits must be >= 0, got {send}; nothing was sent")
        return ValueError(f"send_splits must sum to the {rows} rows of input (dim 0), but sums to {sum(send)}: "
                          f"{send}; nothing was sent")
    if bad.size:
        return CountMismatchError(f"moecomm: {op}: rank {int(bad[0])}'s send_splits are negative or do not add up "
                                  f"to its input's rows; nothing was returned")
    mismatch = _header_mismatch(me, senders, codes, row_bytes, meta)
    if mismatch is not None:
        return CountMismatchError(f"moecomm: {op}: {mismatch}; nothing was returned")
    return None


def _header_mismatch(me: int, senders: Any, codes: tuple[int, int], row_bytes: int,
                     meta: _tags.ExchangeMeta) -> Optional[str]:
    """What the peers' headers of a counts-on-the-GPU exchange (``senders``: ``[size, 4]``,
    :meth:`moecomm.backends.p2p.PeerTransport.senders`) say that disagrees with this rank's
    rows (dtype, wire dtype or kind of exchange; row shape), or None."""
    other = (senders[:, 0] != codes[0]) | (senders[:, 1] != codes[1])
    if not other.any():
        return None
    p = int(other.nonzero()[0][0])  # (never this rank: its own header carries its codes)
    their_bytes = int(senders[p, 2])
    if senders[p, 0] != codes[0]:
        label, dtype, _, wire = meta.words
        return (f"rank {p} sent rows of another dtype, wire dtype or kind of exchange than rank {me}'s ({dtype}, "
                f"wire dtype {wire}, {label}; rows of {their_bytes} bytes against {row_bytes}): every rank must pass "
                f"the same")
    return (f"rank {p} sent rows of another shape than rank {me} (rows of {their_bytes} bytes against "
            f"{row_bytes}): every rank must pass the same row shape")


def alltoallv(engine: Engine, x: torch.Tensor, send: list[int], out: torch.Tensor, recv: list[int],
              check: Optional[PeerCheck] = None, issues: Optional[list[str]] = None,
              records: Optional[tuple] = None, stuck: bool = False) -> Request:
    """Issue the rows. ``check``: the records of this exchange; ``issues``: what the count
    exchange that carried them found, or ``records``: the records in flight from
    :func:`start_records`, compared once they and the rows complete (before the rows where
    the backend cannot complete disagreeing rows). Neither: the counts are not checked."""
    check_own_block(send, recv, engine.rank)  # before anything moves
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    host = not engine.backend.stream_ordered
    complete = engine.backend.mismatched_rows_complete
    beside = records
    if beside is not None and not complete:
        # gloo aborts the process on rows of another size than expected: compare first.
        engine.wait_host(beside[0], f"{check.op} (count records)", None)
        _, issues, stuck = check.compare(beside[2].tolist())
        beside = None
    # The peer backend (collective_exchanges): every rank joins every exchange, and its agreement
    # compares every rank's record before any row moves, so it refuses a disagreement on every
    # rank (raised below with this rank's account); nothing is stuck, nothing needs aborting.
    if issues and not engine.backend.collective_exchanges and ((stuck and not engine.tagged) or not complete):
        # Rows that could never arrive (a side that sends or expects none posts nothing),
        # or a backend that cannot complete rows of disagreeing sizes (gloo, NCCL): raise
        # before the rows and abort; peers waiting for this rank's rows time out.
        engine.abort()
        raise check.error(issues, moved=False, aborted=True)
    if engine.tagged:
        # One tagged message per peer (empty ones too): checked where the rows land.
        op = check.op if check is not None else "all_to_all_v"
        sent = check.sent if check is not None and check.k > 1 else [[c] for c in send]
        expected = check.expected if check is not None and check.k > 1 and check.expected else [[c] for c in recv]
        unit = check.unit if check is not None else "rows"
        request = engine.start_tagged(x, sent, split_offsets(send), out, expected, split_offsets(recv), row_bytes, op,
                                      x.dtype, tuple(x.shape[1:]), unit)
    elif row_bytes == 0:
        # Host backends still run the row exchange (empty), so that every rank issues the
        # same collectives whatever the others' rows; NCCL has no matching to keep.
        if host and engine.size > 1:
            request = engine.backend.alltoallv(x, [0] * engine.size, out, [0] * engine.size, 1)
        else:
            request = engine.backend.barrier() if engine.size > 1 else DoneRequest()
    else:
        meta = engine.meta_of(x)  # what the exchange is, where the backend compares it (peer)
        try:
            if engine.peer is not None and max(sum(send), sum(recv)) * row_bytes >= engine.copy_engine_min_bytes:
                request = engine.peer.exchange(x, send, None, out, recv, None, row_bytes, meta)
            elif meta is None:
                request = engine.backend.alltoallv(x, send, out, recv, row_bytes)
            else:
                request = engine.backend.alltoallv(x, send, out, recv, row_bytes, meta=meta)
        except CountMismatchError as exc:  # the backend's agreement refused it (the peer backend)
            if not issues:
                raise
            raise check.error(issues, moved=False) from exc
    if beside is not None:
        return CheckedRequest(engine, request, check, *beside)
    if issues:
        return RaiseAfter(request, check.error(issues, moved=True))
    return request
