"""moecomm: variable-length collectives for Mixture-of-Experts models.

Quick start::

    import torch, moecomm
    comm = moecomm.init()                       # mpirun / torchrun / single process
    send_splits = torch.randint(0, 5, (comm.size,))     # rows for each rank
    x = torch.randn(int(send_splits.sum()), 16, device=comm.device)
    out, recv_splits = comm.all_to_all_v(x, send_splits)
"""

from ._version import __version__
from .communicator import SUPPORTED_DTYPES, Communicator, Work
from .errors import CommunicatorClosedError, CountMismatchError, MoeCommError, PeerFailedError
from .init import BACKENDS, default_communicator, init, set_default_communicator
from .layout import Layout
from .low_latency import LowLatencyBuffer
from .pool import PoolStats

__all__ = [
    "__version__",
    "init",
    "default_communicator",
    "set_default_communicator",
    "Communicator",
    "Work",
    "Layout",
    "LowLatencyBuffer",
    "PoolStats",
    "BACKENDS",
    "SUPPORTED_DTYPES",
    "MoeCommError",
    "CommunicatorClosedError",
    "CountMismatchError",
    "PeerFailedError",
]
