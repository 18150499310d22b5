"""Small things every benchmark script shares."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "FLOAT_DTYPES", "prog"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}
"""``--dtype`` names -> torch dtypes (the exchanges move any of them)."""

FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""The names of :data:`DTYPES` a benchmark with arithmetic (GEMMs, MoE layers) accepts."""


def prog(module: str) -> str:
    """How a user started the benchmark ``module`` (``"bench.alltoall"``), for its usage line:
    ``moecomm-bench alltoall`` where moecomm is installed, ``python -m bench.alltoall`` in a
    checkout."""
    name = module.rsplit(".", 1)[-1]
    return f"moecomm-bench {name}" if __package__.startswith("moecomm.") else f"python -m bench.{name}"
