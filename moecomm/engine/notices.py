"""Failure notices: a rank whose collective call fails tells its peers why (issue 32, "fault
tails"), so that a peer waiting for it raises :class:`moecomm.PeerFailedError` quoting its
error instead of a ``TimeoutError`` after the timeout.

Where the backend has a :class:`moecomm.backends.base.NoticeChannel` (MPI, two or more
ranks), every public collective call takes the next *call number* on every rank as it begins
(:func:`run_collective`, :func:`collective`), before it checks anything; a call made inside
another (an exchange of a backward, ``fn`` of ``scatter_compute_gather`` calling a collective)
is part of it. Within a call the host waits are numbered too (its *steps*). The ranks call the
collectives in the same order and a call waits in the same order on every rank, so the same
call and step have the same numbers everywhere.

A call that raises (anything but a :class:`moecomm.MoeCommError`, which its peers learn of
themselves or which came from them, or a ``TimeoutError``, which they reach themselves) sends
every peer a notice: its call number, the steps it completed, its name, the rank and the
error, as ``failed``, or as ``aborted`` where the call aborted the communicator. A wait
(:meth:`moecomm.engine.engine.Engine.wait_host`, and the host channel's agreements) tests the
channel's posted receive once per poll, and gives up on

- a ``failed`` notice for its call that completed fewer steps than this wait's: that peer
  will never take part (a wait at an earlier step goes on: the peer completed it);
- an ``aborted`` notice likewise, or for an earlier call: that peer takes part in nothing more.

Giving up raises :class:`moecomm.PeerFailedError` naming the peer and quoting its error,
aborts the communicator (as a timeout does) and tells the peers (``aborted``).

The rank that failed raises its error at once, its communicator as it was. It cannot tell yet
whether its peers failed alike (then nothing is wrong between the ranks) or wait for it: it
starts a barrier of the ranks that failed that call
(:meth:`moecomm.backends.base.NoticeChannel.agree`), which its next call settles before
anything else. Where every rank failed the call, the barrier completes and the call goes on.
Where a peer waited for it, that peer gave up and said so: the call raises
:class:`moecomm.PeerFailedError` and aborts the communicator, so that it never pairs with
messages the peers left behind.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

from ..backends.base import NOTICE_BYTES, NoticeChannel
from ..errors import MoeCommError, PeerFailedError

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

__all__ = ["KEEP_CALLS", "Notice", "Notices", "collective", "run_collective", "describe", "failure_kind", "cause",
           "peer_failed_error"]

KEEP_CALLS = 64
"""Calls whose ``failed`` notices are kept for a wait that may still come (an ``async_op``
call's ``wait()``): older ones are dropped."""

_TEXT_CHARS = 700
"""The longest error text a notice quotes, in characters (the notice is cut to
:data:`moecomm.backends.base.NOTICE_BYTES` bytes as well)."""


class Notice(NamedTuple):
    """One peer's notice: ``kind`` (``"failed"`` or ``"aborted"``), the number of the call,
    the steps (host waits) it completed in it, the call's name, the peer (as its messages name
    it) and its error (type and text)."""

    kind: str
    call: int
    steps: int
    op: str
    where: str
    error: str

    def encode(self) -> bytes:
        text = f"{self.kind}|{self.call}|{self.steps}|{self.op}|{self.where}|{self.error}"
        return text.encode("utf-8", "replace")[:NOTICE_BYTES]

    @staticmethod
    def decode(source: int, payload: bytes) -> "Notice":
        """A notice from its bytes; one that cannot be read counts as ``aborted`` before the
        first call (a peer that sends garbage cannot be waited for)."""
        try:
            kind, call, steps, op, where, error = payload.decode("utf-8", "replace").split("|", 5)
            if kind not in ("failed", "aborted"):
                raise ValueError(kind)
            return Notice(kind, int(call), int(steps), op, where, error)
        except ValueError:
            return Notice("aborted", 0, 0, "?", f"rank {source}", f"an unreadable notice: {payload[:80]!r}")

    def ends(self, call: int, step: Optional[int]) -> bool:
        """Whether this notice ends a wait at ``step`` of call ``call`` (``step`` None: a wait
        outside any call, after call ``call``)."""
        if self.call != call:
            return self.kind == "aborted" and self.call < call
        if step is None:  # after the call: a peer that failed it takes part in what follows (or not) as it likes
            return self.kind == "aborted"
        return step >= self.steps


def describe(exc: BaseException) -> str:
    """``exc`` as a notice quotes it: its type and its message, cut to a few hundred characters."""
    text = " ".join(str(exc).split()) or "(no message)"
    if len(text) > _TEXT_CHARS:
        text = text[:_TEXT_CHARS] + " ..."
    return f"{type(exc).__name__}: {text}"


class Notices:
    """The failure notices of one backend's communicators (every engine over the backend, and
    the 2DH groups a communicator owns, share them): the
    :class:`~moecomm.backends.base.NoticeChannel`, the call numbers and what the peers' notices
    said.

    ``call``: the number of the collective call in progress (or of the last one); ``depth``:
    how many :func:`run_collective` calls are in progress (a call inside another takes no
    number); ``step``: the host waits the call in progress has completed; ``meeting``: the
    number of the last call, where it failed on this rank, and the barrier of the ranks that
    failed it (:meth:`moecomm.engine.engine.Engine.settle_failure`), else None.
    """

    __slots__ = ("channel", "call", "depth", "step", "meeting", "_failed", "_aborted")

    def __init__(self, channel: NoticeChannel) -> None:
        self.channel = channel
        self.call = 0
        self.depth = 0
        self.step = 0
        self.meeting: Optional[tuple[int, Any]] = None
        self._failed: dict[int, Notice] = {}  # call -> the "failed" notice of fewest steps (recent calls)
        self._aborted: Optional[Notice] = None  # the "aborted" notice of the earliest call and step

    def check(self, call: int, step: Optional[int]) -> Optional[Notice]:
        """The notice that ends a wait at ``step`` of call ``call`` (:meth:`Notice.ends`), or
        None. Reads what arrived (one test of the channel's posted receive when nothing did);
        never blocks."""
        got = self.channel.poll()
        if got:
            self._file(got)
        failed = self._failed.get(call) if self._failed else None
        if failed is not None and failed.ends(call, step):  # the cause, rather than a peer that gave up on it
            return failed
        aborted = self._aborted
        return aborted if aborted is not None and aborted.ends(call, step) else None

    def peer_aborted(self) -> Optional[Notice]:
        """The earliest ``aborted`` notice that arrived, or None (never blocks)."""
        got = self.channel.poll()
        if got:
            self._file(got)
        return self._aborted

    def tell(self, kind: str, call: int, steps: int, op: str, where: str, error: str) -> None:
        """Send every peer a notice that this rank's call ``call`` (``op``) raised ``error``
        (:func:`describe`) after ``steps`` steps (``kind``: ``"failed"``, or ``"aborted"``
        where the communicator was aborted too)."""
        self.channel.send(Notice(kind, call, steps, op, where, error).encode())

    def _file(self, got: Sequence[tuple[int, bytes]]) -> None:
        for source, payload in got:
            notice = Notice.decode(source, payload)
            if notice.kind == "aborted":
                if self._aborted is None or (notice.call, notice.steps) < (self._aborted.call, self._aborted.steps):
                    self._aborted = notice
            else:
                known = self._failed.get(notice.call)
                if known is None or notice.steps < known.steps:
                    self._failed[notice.call] = notice
        if len(self._failed) > KEEP_CALLS:
            for old in sorted(self._failed)[:-KEEP_CALLS]:
                del self._failed[old]


def cause(notice: Notice) -> str:
    """What ``notice`` says happened, with the peer's error."""
    if notice.kind == "failed":
        return f"{notice.where} failed its call {notice.call} ({notice.op}): {notice.error}"
    return f"{notice.where} aborted the communicator in its call {notice.call} ({notice.op}): {notice.error}"


def peer_failed_error(notice: Notice, op: str, here: str) -> PeerFailedError:
    """The error a wait of ``op`` on ``here`` raises for ``notice``."""
    return PeerFailedError(f"moecomm: {op}: {cause(notice)} -- the communicator was aborted on {here}, as after "
                           f"a timeout")


def failure_kind(exc: BaseException, aborted: bool) -> Optional[str]:
    """The notice a call that raised ``exc`` sends: None for what its peers learn of without
    one (a :class:`moecomm.MoeCommError`: they raise it too, or it came from them; a
    ``TimeoutError``: they time out too), else ``"aborted"`` where the communicator was
    aborted in the call, ``"failed"`` where it was not."""
    if isinstance(exc, (MoeCommError, TimeoutError)):
        return None
    return "aborted" if aborted else "failed"


def collective(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator of a public collective method ``op`` of an object with an engine (``_engine``):
    the method runs as :func:`run_collective` runs ``fn``."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return run_collective(self._engine, op, method, self, *args, **kwargs)
        return call
    return wrap


def run_collective(engine: "Engine", op: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` as the collective call ``op`` on ``engine``: where the engine has
    :class:`Notices` and no call is in progress, the call takes the next call number, and an
    exception it raises is told to the peers (:meth:`moecomm.engine.engine.Engine.tell_failure`)
    before it propagates; a call after one that failed here first settles that failure
    (:meth:`moecomm.engine.engine.Engine.settle_failure`). Inside another call, or without
    notices, just ``fn(...)``."""
    notices = engine.notices
    if notices is None or notices.depth:
        return fn(*args, **kwargs)
    if notices.meeting is not None:
        engine.settle_failure(op)
    notices.call += 1
    notices.step = 0
    notices.depth = 1
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        engine.tell_failure(op, notices.call, notices.step, exc)
        raise
    finally:
        notices.depth = 0
