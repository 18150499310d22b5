"""What the peer-memory transport's kernels ask of an exchange, importable without CUDA
(:mod:`moecomm.backends.p2p` needs cuda-bindings; the communicator checks these first)."""

from __future__ import annotations

__all__ = ["ROW_ALIGN", "OVERFLOWS", "BAD_COUNTS"]

ROW_ALIGN = 16
"""Rows must be a multiple of this many bytes (the kernels move 16-byte vectors)."""

OVERFLOWS = 1
"""Header flag of a counts-on-the-GPU exchange (:meth:`moecomm.backends.p2p.PeerTransport.senders`):
some block of the sender is larger than the inline capacity (every rank joins the exchange after)."""

BAD_COUNTS = 2
"""Header flag: the sender's counts were negative or did not add up to its rows; none of its
rows moved (the kernel never reads past the input), and every rank raises."""
