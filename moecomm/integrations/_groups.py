"""One moecomm communicator per torch ProcessGroup, reusing the default one where it fits."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from ..communicator import Communicator

__all__ = ["communicator_for_group", "clear_group_cache"]

_by_group: "weakref.WeakKeyDictionary[Any, Communicator]" = weakref.WeakKeyDictionary()
"""Explicit cache: the communicator each torch ProcessGroup was mapped to."""


def clear_group_cache() -> None:
    """Forget every group -> communicator mapping (the communicators stay open)."""
    _by_group.clear()


def _default_or_none() -> Optional[Communicator]:
    from ..init import default_communicator

    try:
        return default_communicator()
    except RuntimeError:
        return None


def _members(comm: Communicator, world_size: int) -> Optional[list[int]]:
    """The torch global ranks of ``comm``'s ranks 0..size-1, where that can be learnt safely.

    A communicator on a torch group names its ranks locally. Any other spans the launch; its
    order is gathered over it (a collective), which is safe only when it spans every torch
    rank, since then the group being mapped is the whole world and every rank is here.
    """
    import torch.distributed as dist

    group = getattr(comm.engine.backend, "group", None)
    if comm.backend == "torch":
        return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if comm.size != world_size:
        return None
    mine = torch.tensor([[dist.get_rank()]], dtype=torch.int64, device=comm.device)
    gathered, _ = comm.all_gather_v(mine)
    return [int(v) for v in gathered.reshape(-1).tolist()]


def communicator_for_group(group: Any) -> Communicator:
    """The moecomm communicator for a torch ``ProcessGroup`` (made once per group, cached).

    The default communicator (:func:`moecomm.init`) is reused when its ranks are the group's
    ranks in the group's order; otherwise a communicator is made on the group with
    ``moecomm.init(process_group=group, set_default=False)`` (gloo and other non-NCCL groups
    run on the torch backend, NCCL groups get an NCCL communicator). The first call for a group
    is collective over the group's ranks, as every framework exchange on it is.

    Args:
        group: an initialized ``torch.distributed.ProcessGroup``.

    Returns:
        The communicator; rank ``p`` of it is rank ``p`` of ``group``.

    Raises:
        TypeError: ``group`` is not a ProcessGroup.
        RuntimeError: torch.distributed is not initialized.
    """
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("moecomm.integrations: torch.distributed is not initialized")
    comm = _by_group.get(group)
    if comm is not None and not comm.closed:
        return comm
    ranks = list(dist.get_process_group_ranks(group))
    default = _default_or_none()
    if default is not None and default.size == len(ranks) and _members(default, dist.get_world_size()) == ranks:
        comm = default
    else:
        from ..init import init

        comm = init(process_group=group, set_default=False)
    _by_group[group] = comm
    return comm
