"""``torch.distributed`` with moecomm's all-to-all calls.

Swap ``import torch.distributed as dist`` for ``import moecomm.distributed as dist``: that is
the whole migration. :func:`all_to_all_single` and :func:`all_to_all` are moecomm's, with
torch's arguments, their order, and ``async_op`` meaning exactly what they mean there; every
other name (``init_process_group``, ``get_rank``, ``all_reduce``, ``group``, ...) is
torch.distributed's own, looked up there.

``group`` may be None, a :class:`moecomm.Communicator`, or a torch ``ProcessGroup``. None
means the default communicator of :func:`moecomm.init`; without one, when torch.distributed
is initialized, the default process group (as in torch). A communicator bound to a process
group is made on first use (a collective call on that group) and kept.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .communicator import Work as _Work  # not ``Work``: that name is torch.distributed's here
from .init import communicator_for
from .splits import Splits

__all__ = ["all_to_all_single", "all_to_all", "communicator_for"]


def __getattr__(name: str) -> Any:
    import torch.distributed as dist

    try:
        return getattr(dist, name)
    except AttributeError:
        raise AttributeError(f"module 'moecomm.distributed' (and torch.distributed) has no attribute {name!r}") from None


def __dir__() -> list[str]:
    import torch.distributed as dist

    return sorted(set(globals()) | set(dir(dist)))


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Optional[Splits] = None,
    input_split_sizes: Optional[Splits] = None,
    group: Any = None,
    async_op: bool = False,
) -> Optional[_Work]:
    """``torch.distributed.all_to_all_single``: same arguments, same semantics."""
    return communicator_for(group).all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, async_op=async_op
    )


def all_to_all(
    output_tensor_list: Sequence[torch.Tensor],
    input_tensor_list: Sequence[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> Optional[_Work]:
    """``torch.distributed.all_to_all``: same arguments, same semantics."""
    return communicator_for(group).all_to_all(output_tensor_list, input_tensor_list, async_op=async_op)
