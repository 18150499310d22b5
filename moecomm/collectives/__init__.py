"""Internal: how each collective is made of backend exchanges (no public names; use
:mod:`moecomm`).

The flat all-to-all (``flat``), the 2D hierarchical plan (``hier_plan``, ``blocks``) and the
choice between them (``topology``), the overlap pipeline (``overlap_plan``,
``overlap_chunk``, ``overlap_pipeline``) and the collectives other than the all-to-alls
(``small``). Layer: above :mod:`moecomm.engine`, below the public front
(``communicator.py``, ``hierarchical.py``, ``overlap.py``, ``wire.py``; docs/architecture.md).
"""
