"""``moecomm.moe``: a Mixture-of-Experts layer built on moecomm's public collectives.

Quick start (under ``mpirun -n N``, or a single process)::

    import moecomm
    from moecomm.moe import MoELayer

    comm = moecomm.init()
    layer = MoELayer(model_dim=1024, hidden_size=4096, num_experts=8 * comm.size, k=2, comm=comm)
    y = layer(x)                        # x: [..., 1024]
    loss = task_loss(y) + 0.01 * layer.aux_loss

Tutel users: ``moecomm.moe.moe_layer(gate_type=..., model_dim=..., experts=..., ...)`` takes
Tutel's configuration keys (see ``moecomm/moe/README.md`` for every difference).
"""

from .config import MoEConfig
from .experts import ACTIVATIONS, BatchedExperts, ExpertList, FFNExperts, Segments
from .gates import GATE_TYPES, CosineTopKGate, LinearTopKGate, TopKGate
from .layer import PARALLEL_MODES, MoELayer
from .losses import gshard_loss, load_importance_loss, router_z_loss
from .megatron import load_megatron_state_dict, megatron_options
from .routing import Routing, fixed_capacity, route
from .scoring import SCORE_FUNCTIONS
from .shared import SharedExpertFFN
from .tutel import moe_layer

__all__ = [
    "MoELayer",
    "moe_layer",
    "MoEConfig",
    "TopKGate",
    "LinearTopKGate",
    "CosineTopKGate",
    "GATE_TYPES",
    "FFNExperts",
    "BatchedExperts",
    "ExpertList",
    "Segments",
    "ACTIVATIONS",
    "PARALLEL_MODES",
    "Routing",
    "route",
    "fixed_capacity",
    "gshard_loss",
    "load_importance_loss",
    "router_z_loss",
    "SCORE_FUNCTIONS",
    "SharedExpertFFN",
    "megatron_options",
    "load_megatron_state_dict",
]
