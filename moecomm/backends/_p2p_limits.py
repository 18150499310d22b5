"""What the peer-memory transport's kernels ask of an exchange, importable without CUDA
(:mod:`moecomm.backends.p2p` needs cuda-bindings; the communicator checks these first)."""

from __future__ import annotations

__all__ = ["ROW_ALIGN"]

ROW_ALIGN = 16
"""Rows must be a multiple of this many bytes (the kernels move 16-byte vectors)."""
