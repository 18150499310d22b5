"""Internal: the machinery of one MoE step, which :class:`moecomm.moe.MoELayer` runs.

The routing step (``routing_step``, ``agreement``), the expert-parallel and data-parallel
paths (``expert_parallel``, ``wire_dispatch``, ``data_parallel``, ``gather``), the fused
step (``fused_step``), the CUDA-graphed step (``graphed``) and the decode path (``decode``).
Layer: above the layer's parts (gates, routing, experts), below ``layer.py``
(docs/architecture.md).
"""
