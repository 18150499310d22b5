"""The communicator's collectives other than the all-to-alls: ``all_gather_v``, ``allreduce``,
``allreduce_ints``, ``broadcast`` and ``barrier`` (a base class of
:class:`moecomm.communicator.Communicator`, which documents them)."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch

from ..engine.dtypes import DTYPE_CODES, float8_dtypes
from ..engine.engine import Engine
from ..engine.notices import collective
from ..backends._host_channel import int_list
from ..engine.requests import Work
from ..backends.base import DoneRequest, Request, reduce_op_name
from ..errors import CountMismatchError

__all__ = ["OtherCollectives"]


class OtherCollectives:
    """Mixed into :class:`~moecomm.communicator.Communicator`: needs its engine, ``rank``,
    ``size`` and ``backend``."""

    _engine: Engine
    rank: int
    size: int
    backend: str

    @collective("all_gather_v")
    def all_gather_v(self, input: torch.Tensor, *, async_op: bool = False) -> Union[tuple[torch.Tensor, list[int]], Work]:
        """Concatenate every rank's ``input`` (``[N_r, *row_shape]``, ``N_r`` may differ) in rank order.

        Returns ``(output, sizes)`` with ``output`` of ``[sum(sizes), *row_shape]`` and
        ``sizes[r] = N_r``. The row counts are gathered first (the call blocks the host for them).

        Raises:
            TypeError, ValueError: a bad ``input``, before anything is sent.
            CountMismatchError: ranks pass different dtypes or row shapes (on every rank).
            TimeoutError: a wait outlived the timeout (the communicator is aborted).
            PeerFailedError: (MPI) a peer raised in this call, or aborted the communicator (see
                :meth:`moecomm.Communicator.all_to_all_v`).
        """
        op = "all_gather_v"
        self._engine.check_open(op)
        x = self._engine.check_tensor(input, "input", min_dim=1)
        row_shape = tuple(x.shape[1:])
        sizes = self._engine.gather_ints([x.shape[0], DTYPE_CODES[x.dtype], hash(row_shape) & 0x7FFFFFFF], op)
        for r, (_, code, shape_hash) in enumerate(sizes):
            if code != DTYPE_CODES[x.dtype] or shape_hash != hash(row_shape) & 0x7FFFFFFF:
                raise CountMismatchError(
                    f"all_gather_v: rank {r} passed a different dtype or row shape than rank {self.rank} "
                    f"({x.dtype}, rows of {row_shape})"
                )
        counts = [s[0] for s in sizes]
        out = torch.empty((sum(counts),) + row_shape, dtype=x.dtype, device=x.device)
        row_bytes = math.prod(row_shape) * x.element_size()
        if row_bytes == 0 or not any(counts):
            request: Request = DoneRequest()
        else:
            request = self._engine.backend.allgatherv(x, out, counts, row_bytes)
        return self._engine.finish(request, op, (out, counts), async_op)

    @collective("allreduce")
    def allreduce(self, tensor: torch.Tensor, op: Any = "sum", async_op: bool = False) -> Optional[Work]:
        """In-place reduction over all ranks (``op``: "sum", "max", "min", "prod" or a
        ``torch.distributed.ReduceOp``). float16/bfloat16 are reduced in float32 on MPI.

        Raises:
            TypeError, ValueError: a bad ``tensor`` (complex, FP8) or ``op``; TimeoutError, PeerFailedError:
                as :meth:`barrier`.
        """
        name = "allreduce"
        self._engine.check_open(name)
        t = self._engine.check_tensor(tensor, "tensor", min_dim=0, written=True)
        op_name = reduce_op_name(op)
        if t.dtype.is_complex or t.dtype in float8_dtypes():
            raise TypeError(f"tensor: allreduce does not support dtype {t.dtype}")
        work_tensor = t
        if self.backend == "mpi" and t.dtype in (torch.float16, torch.bfloat16):
            work_tensor = t.float()
        request = self._engine.backend.allreduce(work_tensor, op_name)
        then = (lambda: t.copy_(work_tensor)) if work_tensor is not t else None
        return self._engine.finish(request, name, True if async_op else None, async_op, then=then)

    @collective("allreduce_ints")
    def allreduce_ints(self, values: Sequence[int], op: str = "max") -> list[int]:
        """Element-wise ``op`` over all ranks of a short list of host integers (token counts,
        sizes, flags), returned as a list of Python ints; every rank passes the same number
        of values.

        Over the communicator's host channel where it has one (an MPI launch, or a torch group
        with gloo: see the README, "Host agreements"), this never touches the GPU: the host
        does not wait for the work queued on it. Without one (an NCCL-only process group) it
        goes through the device and waits for the GPU. Blocks the host until every rank has
        called it. Collective. Works during a CUDA graph capture only over a host channel
        (the agreement then happens at capture time, not at replay).

        Args:
            values: ints (numpy ints too, not bools) in int64's range; may be empty.
            op: ``"max"``, ``"min"`` or ``"sum"`` (in int64: a sum must fit int64).

        Raises:
            TypeError: ``values`` not a sequence of ints; ValueError: a value out of int64's
                range, or ``op`` not one of those; both before anything is sent.
            CountMismatchError: the ranks passed different numbers of values (on every rank).
            TimeoutError: some rank did not call it within ``timeout`` (the communicator is aborted).
            CommunicatorClosedError: the communicator is closed or aborted.
            PeerFailedError: as :meth:`barrier`.
        """
        return self._engine.allreduce_ints(int_list(values, "values"), op, "allreduce_ints")  # it checks op

    @property
    def host_channel(self) -> Optional[str]:
        """The kind of host channel the integer agreements use: ``"mpi"``, ``"gloo"``, or None
        (they go through the device; a communicator of one rank needs none)."""
        host = self._engine.host
        return None if host is None else host.kind

    @collective("broadcast")
    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Optional[Work]:
        """In-place broadcast of ``tensor`` from rank ``src``.

        Raises:
            TypeError, ValueError: a bad ``tensor`` or ``src``; TimeoutError, PeerFailedError: as :meth:`barrier`.
        """
        name = "broadcast"
        self._engine.check_open(name)
        t = self._engine.check_tensor(tensor, "tensor", min_dim=0, written=True)
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.size:
            raise ValueError(f"src must be a rank in [0, {self.size}), got {src!r}")
        request = self._engine.backend.broadcast(t, src)
        return self._engine.finish(request, name, True if async_op else None, async_op)

    @collective("barrier")
    def barrier(self) -> None:
        """Return once every rank has entered the barrier.

        Raises:
            TimeoutError: not every rank entered within ``timeout`` (the communicator is aborted).
            PeerFailedError: (MPI) a peer raised in this call, or aborted the communicator (see
                :meth:`moecomm.Communicator.all_to_all_v`).
        """
        self._engine.barrier()
