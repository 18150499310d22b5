"""Route other frameworks' MoE exchanges through moecomm, without editing them.

* :mod:`moecomm.integrations.megatron`: Megatron-core's ``_AllToAll`` (``mappings.all_to_all``,
  used by ``MoEAlltoAllTokenDispatcher`` for tokens, probabilities and the combine).
* :mod:`moecomm.integrations.deepspeed`: DeepSpeed's ``sharded_moe._AllToAll`` and, with
  ``enable(tutel_kernels=True)``, its ``use_tutel=True`` path on moecomm's kernels
  (:mod:`moecomm.moe.tutel_functional`); with ``enable(layer="moecomm")``, ``MOELayer``'s
  dispatch, experts (one grouped FFN) and combine on moecomm.
* :mod:`moecomm.integrations.torchtitan`: torchtitan's ``AllToAllTokenDispatcher`` (its count,
  dispatch and combine exchanges, under either ``spmd_backend``).

Each has ``enable()`` / ``disable()`` / ``is_enabled()``; the framework is imported only by
``enable()``. A framework's process group is mapped to a moecomm communicator once per group
by :func:`communicator_for_group`.
"""

from ._groups import clear_group_cache, communicator_for_group

__all__ = ["communicator_for_group", "clear_group_cache"]
