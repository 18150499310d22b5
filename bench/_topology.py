"""What the benchmarks take from their sibling package ``topology``, under either name:
``moecomm.topology`` where moecomm is installed (``bench`` is then ``moecomm.bench``),
``topology`` in a checkout (``python -m bench.alltoall`` from the repository's root)."""

if __package__.startswith("moecomm."):
    from ..topology.measure import *  # noqa: F401,F403
    from ..topology.measure import __all__ as _measure_all
    from ..topology.plot import require_matplotlib, size_label  # noqa: F401
    from ..topology.rank_parser import RankZeroParser  # noqa: F401
else:
    from topology.measure import *  # noqa: F401,F403
    from topology.measure import __all__ as _measure_all
    from topology.plot import require_matplotlib, size_label  # noqa: F401
    from topology.rank_parser import RankZeroParser  # noqa: F401

__all__ = list(_measure_all) + ["require_matplotlib", "size_label", "RankZeroParser"]
