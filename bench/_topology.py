"""The sibling package's :mod:`topology.measure`, under either name: ``moecomm.topology``
where moecomm is installed (``bench`` is then ``moecomm.bench``), ``topology`` in a
checkout (``python -m bench.alltoall`` from the repository's root)."""

if __package__.startswith("moecomm."):
    from ..topology.measure import *  # noqa: F401,F403
    from ..topology.measure import __all__  # noqa: F401
else:
    from topology.measure import *  # noqa: F401,F403
    from topology.measure import __all__  # noqa: F401
