"""Issue 32, item 2 ("fault tails"): a rank whose collective call fails tells its peers why
(tests/ranks/peer_failures.py on 2, 3 and 4 MPI ranks); the notice's own rules, without ranks."""

from __future__ import annotations

import pytest

from moecomm.backends.base import NOTICE_BYTES
from moecomm.engine.notices import Notice, Notices, describe, failure_kind
from moecomm.errors import CountMismatchError, PeerFailedError


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
@pytest.mark.ranks_job("tests.ranks.peer_failures", timeout=180)
def test_ranks_peer_failures(nprocs, ranks_job):  # in the shared launch of its world size (tests/conftest.py)
    assert f"checks passed on {nprocs} ranks" in ranks_job()


def test_notice_round_trip_and_cut():
    n = Notice("failed", 12, 3, "all_to_all_v", "rank 1", describe(ValueError("a|b " * 1000)))
    back = Notice.decode(1, n.encode())
    assert back.kind == "failed" and (back.call, back.steps, back.op, back.where) == (12, 3, "all_to_all_v", "rank 1")
    assert back.error.startswith("ValueError: a|b a|b") and back.error.endswith(" ...")
    assert len(n.encode()) <= NOTICE_BYTES
    garbled = Notice.decode(2, b"\xff\xfe nonsense")
    assert garbled.kind == "aborted" and garbled.call == 0 and garbled.where == "rank 2"


@pytest.mark.parametrize("kind, call, steps, at, ends", [
    ("failed", 5, 0, (5, 0), True),      # the peer failed before this wait: it never comes
    ("failed", 5, 2, (5, 1), False),     # it completed this wait's step before failing: go on
    ("failed", 5, 2, (5, 2), True),
    ("failed", 4, 0, (5, 0), False),     # another call: every rank failed it alike, or it is over
    ("failed", 6, 0, (5, 0), False),     # a later call of the peer's: this one was not waiting for it
    ("failed", 5, 0, (5, None), False),  # a wait after the call (a backward): not the failed call's
    ("aborted", 4, 7, (5, 0), True),     # the peer aborted earlier: it takes part in nothing more
    ("aborted", 5, 1, (5, 0), False),
    ("aborted", 5, 1, (5, None), True),
    ("aborted", 6, 0, (5, 3), False),    # (an async wait of an earlier call: the peer took part in it)
])
def test_which_waits_a_notice_ends(kind, call, steps, at, ends):
    assert Notice(kind, call, steps, "op", "rank 1", "E: x").ends(*at) is ends


class _Channel:
    def __init__(self) -> None:
        self.inbox: list = []
        self.sent: list = []

    def send(self, payload):
        self.sent.append(payload)

    def poll(self):
        got, self.inbox = self.inbox, []
        return got

    def agree(self):  # pragma: no cover - not used here
        raise AssertionError


def test_notices_keep_the_cause_and_forget_old_calls():
    ch = _Channel()
    notices = Notices(ch)
    ch.inbox = [(2, Notice("aborted", 3, 0, "op", "rank 2", "PeerFailedError: rank 1 failed").encode()),
                (1, Notice("failed", 3, 1, "op", "rank 1", "ValueError: bad").encode()),
                (3, Notice("failed", 3, 0, "op", "rank 3", "TypeError: worse").encode())]
    got = notices.check(3, 0)
    assert got.where == "rank 3" and got.kind == "failed"  # the cause (fewest steps), not the peer that gave up
    assert notices.check(4, 0).kind == "aborted"  # after rank 2 aborted, every later call's waits end
    ch.inbox = [(1, Notice("failed", c, 0, "op", "rank 1", "E: x").encode()) for c in range(100, 300)]
    assert notices.check(299, 0).call == 299 and notices.check(100, 0).kind == "aborted"  # (100: forgotten)
    assert len(notices._failed) <= 64


def test_what_is_told():
    assert failure_kind(ValueError("x"), False) == "failed" and failure_kind(RuntimeError("x"), True) == "aborted"
    for told_by_themselves in (CountMismatchError("x"), PeerFailedError("x"), TimeoutError("x")):
        assert failure_kind(told_by_themselves, False) is None
