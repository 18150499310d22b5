"""Loading of the transports' native extensions (:mod:`moecomm.backends._ext_specs`): the
modules built at install, else a just-in-time build, through :mod:`moecomm_ext`'s loader
(same cache directory, lock and source-hash check). Neither has a pure-torch fallback."""

from __future__ import annotations

import types

from moecomm_ext._loader import load_extension

from . import _ext_specs

__all__ = ["load_p2p", "load_nccl_issue"]


def load_p2p() -> types.ModuleType:
    """Build (if needed) and load the peer-memory transport's CUDA extension.

    Raises:
        RuntimeError: it cannot be built or loaded (no CUDA torch or device, no nvcc, a
            compile error); the message says why. It is what an explicit
            ``moecomm.init(p2p_bytes=...)`` asked for, so there is no fallback.
    """
    return load_extension(_ext_specs.P2P, _ext_specs.spec, cuda=True, what="peer-memory (p2p) CUDA")


def load_nccl_issue() -> types.ModuleType:
    """Build (if needed) and load the extension that issues the NCCL backend's grouped
    send/recv natively (host code only; it binds to the libnccl already loaded).

    Raises:
        RuntimeError: it cannot be built or loaded; the backend then issues the calls
            through nccl4py's raw bindings instead (correct, slower per call).
    """
    return load_extension(_ext_specs.NCCL_ISSUE, _ext_specs.spec, cuda=False, what="NCCL issue")
