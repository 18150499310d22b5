"""A communicator's topology: its 2DH hierarchy groups, its topology profile, its cluster
fingerprint, and the choice ``algorithm="auto"`` makes from them.

Made once by :func:`build` when ``moecomm.init`` builds the communicator (``hierarchy=``,
``profile=``), never inside a collective. ``"auto"`` follows the profile entry nearest the
call's bytes per rank (the largest input over all ranks, agreed with one 8-byte allreduce
unless the profile makes the same choice at every size); without a profile, ``"2dh"`` when
the communicator has the hierarchy groups, ``num_nodes > 1``, ``local_size > 1`` and the
bytes per peer are at most :data:`AUTO_2DH_MAX_BYTES_PER_PEER`, else ``"flat"``; while a
CUDA graph is captured, always ``"flat"``.
"""

from __future__ import annotations

import json
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..engine.engine import Engine
from ..layout import Layout
from ..profile import Fingerprint, Profile, ProfileError, default_profile_path, load_profile

__all__ = ["ALGORITHMS", "AUTO_2DH_MAX_BYTES_PER_PEER", "Hierarchy", "Topology", "build", "fingerprint", "choose",
           "require_hierarchy", "unequal_nodes_message"]

ALGORITHMS = ("flat", "2dh", "auto")

AUTO_2DH_MAX_BYTES_PER_PEER = 256 << 10
"""Without a profile, ``"auto"`` picks 2DH up to this many bytes per peer (and layout allowing)."""


def unequal_nodes_message(sizes: Sequence[int]) -> str:
    return (
        f"moecomm: the 2D hierarchical all-to-all needs nodes of equal size, but this communicator's "
        f"nodes have {list(sizes)} ranks (node 0 first); use algorithm='flat' (or 'auto', which "
        f"falls back to it)"
    )


class Hierarchy:
    """The intra-node and rail sub-communicators of a communicator with equal nodes.

    ``pending``: the 2DH exchanges progressed by the host (MPI, gloo) that have exchanges
    not yet issued, in call order (see :mod:`moecomm.hierarchical`, "Asynchrony")."""

    def __init__(self, layout: Layout, intra: Any, rail: Any) -> None:
        lay = layout
        self.num_nodes = lay.num_nodes
        self.local_size = lay.local_size
        self.node_rank = lay.node_rank
        self.local_rank = lay.local_rank
        self.members: tuple[tuple[int, ...], ...] = lay.node_members
        self.intra = intra
        self.rail = rail
        if (intra.size, intra.rank, rail.size, rail.rank) != (self.local_size, self.local_rank, self.num_nodes, self.node_rank):
            raise RuntimeError(
                f"moecomm: hierarchy groups do not match the layout (intra {intra.rank}/{intra.size}, "
                f"rail {rail.rank}/{rail.size}, layout node {self.node_rank}/{self.num_nodes} "
                f"local {self.local_rank}/{self.local_size})"
            )
        L = self.local_size
        self.contiguous = all(r == n * L + l for n, m in enumerate(self.members) for l, r in enumerate(m))
        self.pending: list = []  # host-progressed 2DH chains with exchanges not yet issued


@dataclass
class Topology:
    """What :func:`build` makes for a communicator (``comm.topology``): its hierarchy groups
    (or why there are none), its topology profile and its fingerprint."""

    hierarchy: Optional[Hierarchy]
    why_not: str  # why there is no hierarchy ("" when there is one)
    profile: Optional[Profile]
    fingerprint: Fingerprint
    node_sizes: tuple = ()  # ranks per node, node 0 first


# -- setup (moecomm.init) -------------------------------------------------------------------


def fingerprint(engine: Engine, layout: Layout, hosts: Sequence[str]) -> Fingerprint:
    """The cluster fingerprint of a communicator: layout, device model, backend and link kind.

    The link kind is ``<backend>-<H>host(s)``, with ``-simulated`` when the layout (from
    ``local_size=``) differs from the one the host names give.
    """
    if engine.device.type == "cuda":
        device = torch.cuda.get_device_name(engine.device)
    else:
        device = engine.device.type
    backend = engine.backend.name
    n_hosts = len(set(hosts)) if hosts else 1
    link = f"{backend}-{n_hosts}host{'s' if n_hosts != 1 else ''}"
    if hosts and len(hosts) == engine.size:
        real = Layout.from_hosts(engine.rank, list(hosts))
        if real.node_of_rank != layout.node_of_rank:
            link += "-simulated"
    return Fingerprint(layout.num_nodes, layout.local_size, device, link, backend)


def build(
    engine: Engine,
    layout: Layout,
    *,
    sub_communicator: Callable[[Engine, Layout], Any],
    hierarchy: Optional[bool],
    profile: Union[None, str, Any, Profile],
    hosts: Sequence[str],
    local_size_given: bool,
) -> Topology:
    """Collective: build a communicator's hierarchy groups and load its profile.

    ``sub_communicator(engine, layout)`` wraps each group's engine (split from ``engine``,
    owned by it: closed and aborted with it) into a communicator.

    ``hierarchy``: True builds the groups (ValueError for unequal nodes), False does not,
    None builds them when ``num_nodes > 1 and local_size > 1`` or ``local_size_given``.
    ``profile``: a :class:`Profile`, a path, or None for ``<profile dir>/<fingerprint>.json``
    if that file exists.
    """
    if hierarchy is not None and not isinstance(hierarchy, bool):
        raise TypeError(f"hierarchy must be True, False or None, got {hierarchy!r}")
    lay = layout
    sizes = [len(m) for m in lay.node_members]
    want = hierarchy if hierarchy is not None else (local_size_given or (lay.num_nodes > 1 and lay.local_size > 1))
    groups: Optional[Hierarchy] = None
    why_not = ""
    if not want:
        why_not = ("init(hierarchy=False)" if hierarchy is False else
                   f"init(hierarchy=None) builds them only when num_nodes > 1 and local_size > 1 or local_size= "
                   f"is given, and this communicator has {lay.num_nodes} node(s) of {lay.local_size}")
    elif not lay.uniform:
        if hierarchy:
            raise ValueError(unequal_nodes_message(sizes))
        why_not = "unequal"
    else:
        subs = []
        for color, key in ((lay.node_rank, lay.local_rank), (lay.local_rank, lay.node_rank)):
            sub, members = engine.split(color, key, owned=True)
            subs.append(sub_communicator(sub, lay.subset(members.index(engine.rank), members)))
        groups = Hierarchy(lay, *subs)
    fp = fingerprint(engine, layout, hosts)
    prof = _resolve_profile(engine, profile, fp)
    return Topology(groups, why_not, prof, fp, tuple(sizes))


def _profile_digest(prof: Optional[Profile]) -> int:
    if prof is None:
        return 0
    return zlib.crc32(json.dumps(prof.to_json(), sort_keys=True).encode()) & 0x7FFFFFFF


def _resolve_profile(engine: Engine, profile: Any, fp: Fingerprint) -> Optional[Profile]:
    explicit = profile is not None
    prof: Optional[Profile] = None
    problem = ""
    try:
        if isinstance(profile, Profile):
            prof = profile
        elif explicit:
            if not isinstance(profile, (str, bytes)) and not hasattr(profile, "__fspath__"):
                raise TypeError(f"profile must be a path, a moecomm.profile.Profile or None, got {type(profile).__name__}")
            prof = load_profile(profile)
        else:
            path = default_profile_path(fp)
            if path.is_file():
                prof = load_profile(path)
        if prof is not None:
            prof = _check_fingerprint(prof, fp, explicit)
    except TypeError:
        raise
    except ProfileError as exc:
        if explicit:
            problem = str(exc)
        else:
            warnings.warn(f"moecomm: ignoring the cached topology profile: {exc}", RuntimeWarning, stacklevel=4)
            prof = None
    # Every rank must decide alike: compare what each loaded.
    table = engine.gather_ints([1 if problem else 0, _profile_digest(prof)], "init (topology profile)")
    failed = [r for r, row in enumerate(table) if row[0]]
    if failed:
        mine = f": {problem}" if problem else ""
        raise ProfileError(f"moecomm: the topology profile could not be loaded on rank(s) {failed}{mine}")
    if len({row[1] for row in table}) > 1:
        if explicit:
            raise ProfileError(
                f"moecomm: the ranks loaded different topology profiles from {profile!r} "
                f"(content digests {[row[1] for row in table]}); give every rank the same file"
            )
        if engine.rank == 0:
            warnings.warn("moecomm: ranks found different cached topology profiles; using none (auto follows "
                          "the built-in rule)", RuntimeWarning, stacklevel=4)
        prof = None
    return prof


def _check_fingerprint(prof: Profile, fp: Fingerprint, explicit: bool) -> Profile:
    pf = prof.fingerprint
    where = prof.source or "the given profile"
    if (pf.num_nodes, pf.local_size) != (fp.num_nodes, fp.local_size):
        raise ProfileError(
            f"topology profile {where} was tuned for {pf.num_nodes} node(s) x {pf.local_size}, but this "
            f"communicator is {fp.num_nodes} node(s) x {fp.local_size}; tune this layout "
            f"(python -m topology tune) or pass another profile"
        )
    if pf != fp:
        message = f"topology profile {where} was tuned on {pf.describe()}; this communicator is {fp.describe()}"
        if not explicit:
            raise ProfileError(message)
        warnings.warn(f"moecomm: {message}", RuntimeWarning, stacklevel=5)
    return prof


# -- choosing ------------------------------------------------------------------------------


def choose(engine: Engine, topology: Optional[Topology], x: torch.Tensor) -> str:
    """Collective: what ``algorithm="auto"`` runs for input ``x`` (the same on every rank)."""
    if topology is None or topology.hierarchy is None or engine.capturing():
        return "flat"  # while a CUDA graph is captured, 2DH's count exchanges cannot run
    h = topology.hierarchy
    if topology.profile is not None:
        fixed = topology.profile.uniform_choice()
        if fixed is not None:
            return fixed
        return topology.profile.choose(_max_input_bytes(engine, x))
    if h.num_nodes == 1 or h.local_size == 1:
        return "flat"
    per_peer = _max_input_bytes(engine, x) / engine.size
    return "2dh" if per_peer <= AUTO_2DH_MAX_BYTES_PER_PEER else "flat"


def _max_input_bytes(engine: Engine, x: torch.Tensor) -> int:
    return engine.max_int(x.numel() * x.element_size(), "allreduce")


def require_hierarchy(topology: Optional[Topology]) -> Hierarchy:
    """The hierarchy groups ``algorithm="2dh"`` needs, or the error that says why there are none
    (``ValueError`` for unequal nodes, naming their sizes; else ``RuntimeError``)."""
    if topology is not None and topology.hierarchy is not None:
        return topology.hierarchy
    if topology is not None and topology.why_not == "unequal":
        raise ValueError(unequal_nodes_message(topology.node_sizes))
    why = f" ({topology.why_not})" if topology is not None and topology.why_not else \
        " (it was not made by moecomm.init, e.g. it came from split())"
    raise RuntimeError(
        f"moecomm: algorithm='2dh' needs the intra-node and rail sub-communicators, which this "
        f"communicator does not have{why}; pass hierarchy=True to moecomm.init"
    )
