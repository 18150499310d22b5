"""Internal: what the MoE layer's public parts (gates, routing, experts, config) are built on.

Grouped GEMMs over expert segments (``seg_gemm``, ``wide_gemm``), the row layout an expert
receives (``segments``), the step's cache of constant tensors (``step_cache``), the layer's
calls into the communicator (``comm``) and argument checks (``args``). Nothing here imports
the layer's public modules (docs/architecture.md).
"""
