"""What the transports' native extensions are made of: sources (``csrc/`` beside this
file), flags and module names, in :mod:`moecomm_ext._specs`'s :class:`Spec`.

* ``"cuda-p2p"``: the peer-memory transport's kernels (:mod:`moecomm.backends.p2p`,
  ``csrc/p2p_cuda.cu``);
* ``"nccl-issue"``: the NCCL backend's grouped send/recv issued natively
  (:mod:`moecomm.backends.nccl`, ``csrc/nccl_issue.cpp``).

Shared by ``setup.py`` (the build at install, which loads this file by path after
``moecomm_ext/_specs.py``, so it imports nothing else) and by
:mod:`moecomm.backends._ext` (which loads the installed modules, or builds just in time).
"""

from __future__ import annotations

from pathlib import Path

from moecomm_ext._specs import Spec, cuda_arch_flags

__all__ = ["CSRC", "P2P", "NCCL_ISSUE", "KINDS", "spec"]

CSRC = Path(__file__).resolve().parent / "csrc"

P2P = "cuda-p2p"
NCCL_ISSUE = "nccl-issue"
KINDS = (P2P, NCCL_ISSUE)


def spec(kind: str, *, openmp: bool, device_capability: tuple[int, int] | None = None) -> Spec:
    """The extension of ``kind`` (one of :data:`KINDS`); the arguments as in
    :func:`moecomm_ext._specs.spec` (``openmp`` is unused: neither runs host loops)."""
    del openmp
    if kind == NCCL_ISSUE:
        return Spec(NCCL_ISSUE, "moecomm_nccl_issue", "moecomm.backends._nccl_issue", ("nccl_issue.cpp",),
                    ("-O2", "-DNDEBUG"), None, ("-ldl",), "host", ("NcclCalls",),
                    csrc=CSRC, build_seconds=15)
    if kind == P2P:
        arch_flags, tag = cuda_arch_flags(device_capability)
        return Spec(P2P, "moecomm_p2p_cuda", "moecomm.backends._p2p_cuda", ("p2p_cuda.cu",),
                    ("-O3", "-DNDEBUG"), ("-O3", "-lineinfo", *arch_flags), (), tag,
                    ("alloc", "free", "ipc_handle", "ipc_open", "ipc_close", "gpu_counts_exchange",
                     "launch_copy_out", "ce_exchange", "rows_exchange", "new_event", "destroy_event",
                     "max_copy_engine_ranks", "can_access_peer"),
                    csrc=CSRC, build_seconds=90)
    raise ValueError(f"unknown transport extension kind {kind!r}; expected one of {KINDS}")
