"""Exceptions raised by moecomm.

Bad arguments raise the builtin :class:`ValueError` or :class:`TypeError`; a wait that
outlives the communicator's timeout raises the builtin :class:`TimeoutError`. The classes
here cover what the builtins do not.
"""

from __future__ import annotations

__all__ = ["MoeCommError", "CommunicatorClosedError", "CountMismatchError", "PeerFailedError"]


class MoeCommError(RuntimeError):
    """Base class of moecomm's own runtime errors."""


class CommunicatorClosedError(MoeCommError):
    """The communicator was closed or aborted (after a timeout or an explicit abort)."""


class CountMismatchError(MoeCommError, ValueError):
    """Ranks disagree on what they exchange (found by ``validate=True``).

    Raised on every rank of the collective, with the same message naming the ranks and counts.
    """


class PeerFailedError(MoeCommError):
    """A peer raised in the collective call this rank waits for, or aborted the communicator,
    and sent a failure notice saying why (MPI; see :mod:`moecomm.engine.notices`).

    Raised by the wait as soon as the notice arrives, instead of a ``TimeoutError`` after the
    timeout; the message names the peer and quotes its error. The communicator is aborted
    here (as after a timeout), and the peers are told so.
    """
