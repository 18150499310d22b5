"""Where each rank sits: its node and its index inside the node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """The node layout of a communicator, as seen from one rank.

    Ranks on one node need not be consecutive when the layout comes from host names;
    ``node_members[n]`` lists the ranks of node ``n`` in rank order.
    """

    rank: int
    size: int
    node_of_rank: tuple[int, ...]
    node_members: tuple[tuple[int, ...], ...]

    @property
    def node_rank(self) -> int:
        return self.node_of_rank[self.rank]

    @property
    def num_nodes(self) -> int:
        return len(self.node_members)

    @property
    def local_rank(self) -> int:
        return self.node_members[self.node_rank].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.node_members[self.node_rank])

    @property
    def uniform(self) -> bool:
        """Every node has the same number of ranks."""
        return len({len(m) for m in self.node_members}) == 1

    @classmethod
    def from_hosts(cls, rank: int, hosts: Sequence[str]) -> "Layout":
        """Group ranks by host name; nodes are numbered in order of their lowest rank."""
        order: dict[str, int] = {}
        for h in hosts:
            order.setdefault(h, len(order))
        node_of_rank = tuple(order[h] for h in hosts)
        return cls._from_node_of_rank(rank, node_of_rank)

    @classmethod
    def from_local_size(cls, rank: int, size: int, local_size: int) -> "Layout":
        """Blocks of ``local_size`` consecutive ranks per node (the ``local_size=`` override)."""
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
            raise ValueError(f"local_size must be a positive int, got {local_size!r}")
        if size % local_size:
            raise ValueError(
                f"local_size={local_size} does not divide the communicator size {size}: "
                f"nodes of unequal size cannot be simulated"
            )
        return cls._from_node_of_rank(rank, tuple(r // local_size for r in range(size)))

    @classmethod
    def _from_node_of_rank(cls, rank: int, node_of_rank: tuple[int, ...]) -> "Layout":
        members: list[list[int]] = [[] for _ in range(max(node_of_rank) + 1)] if node_of_rank else []
        for r, n in enumerate(node_of_rank):
            members[n].append(r)
        return cls(rank, len(node_of_rank), node_of_rank, tuple(tuple(m) for m in members))

    def subset(self, rank: int, members: Sequence[int]) -> "Layout":
        """The layout of a sub-communicator made of the parent ranks ``members`` (in new-rank order)."""
        parent_nodes = [self.node_of_rank[m] for m in members]
        renumber: dict[int, int] = {}
        for n in parent_nodes:
            renumber.setdefault(n, len(renumber))
        return self._from_node_of_rank(rank, tuple(renumber[n] for n in parent_nodes))
