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
    """A peer's call of the same collective failed on that peer (its arguments were refused)
    and it aborted the communicator: raised on the other ranks, quoting the peer's error,
    as soon as its notice arrives (during a wait, or at the next call), instead of a timeout.
    The communicator is aborted on every rank it reached.
    """
