"""The MoE layer's options: :class:`MoEConfig`, shared by :class:`~moecomm.moe.MoELayer` and
:func:`~moecomm.moe.moe_layer`, and the checks that need the communicator.

``MoEConfig(...)`` takes exactly ``MoELayer``'s arguments (names, defaults) and checks, when
it is made, every one that depends neither on the communicator nor on a gate or expert
module (``gate_noise``, ``fp32_gate``, ``proj_dim``, ``init_t`` and ``activation`` are
checked by the gate and the experts as the layer builds them). ``MoELayer.from_config(cfg)``
builds the layer, which then checks what depends on the communicator's world size and
features (:func:`expert_layout`, :func:`check_degree`, :func:`check_own_first`,
:func:`check_algorithm`, used again for the per-call overrides of ``forward``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from moecomm.quant import check_grad_wire_dtype, check_wire_dtype

from ._ops import comm as _comm
from ._ops.args import float_arg, int_arg
from .gates import GATE_TYPES, TopKGate
from .losses import BALANCE_LOSSES
from .scoring import SCORE_FUNCTIONS

__all__ = ["MoEConfig", "PARALLEL_MODES", "bool_arg", "check_groups", "expert_layout", "check_degree",
           "check_own_first", "check_algorithm"]

PARALLEL_MODES = ("expert", "data", "auto")

GateSpec = Union[str, TopKGate, Sequence[Union[str, TopKGate]]]


def bool_arg(name: str, value: Any) -> bool:
    """``value`` if it is a bool; TypeError naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


@dataclass(frozen=True)
class MoEConfig:
    """Every option of :class:`~moecomm.moe.MoELayer` (see its docstring for their meaning),
    checked when made (those of the gates and experts aside, see the module's docstring):
    ``capacity_factor``, ``z_loss_weight``, ``topk_scaling_factor``, ``balance_loss_weight`` and
    ``seq_aux_loss_weight`` are stored as floats, the rest as given.

    Raises:
        TypeError: an option of the wrong type (named), or a required one missing
            (``num_experts``; ``hidden_size`` with the built-in experts).
        ValueError: an option out of its range or set (named, with the allowed values).
    """

    model_dim: int
    hidden_size: Optional[int] = None
    num_experts: Optional[int] = None
    k: int = 2
    capacity_factor: float = 1.0
    gate: GateSpec = "linear"
    gate_noise: float = 0.0
    fp32_gate: bool = True
    proj_dim: int = 256
    init_t: float = 0.5
    normalize_gate: bool = True
    score_function: str = "softmax"
    pre_softmax: bool = True
    topk_scaling_factor: Optional[float] = None
    expert_bias: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    balance_loss_weight: float = 1.0
    seq_aux_loss_weight: float = 0.0
    seq_dim: int = 0
    shared_expert_size: Optional[int] = None
    shared_expert_activation: Union[str, Callable[[Tensor], Tensor]] = "swiglu"
    shared_expert_gate: bool = False
    batch_prioritized_routing: bool = False
    is_postscore: bool = True
    balance_loss: Optional[str] = "gshard"
    z_loss_weight: float = 0.0
    dropless: bool = False
    activation: Union[str, Callable[[Tensor], Tensor], None] = "relu"
    fc1_bias: Optional[bool] = None
    fc2_bias: Optional[bool] = None
    output_dim: Optional[int] = None
    experts: Union[None, nn.Module, Callable[[int], nn.Module]] = None
    parallel_mode: str = "expert"
    overlap_degree: Union[int, str] = 1
    own_first: Union[bool, str] = "auto"
    algorithm: Optional[str] = None
    inequivalent_tokens: bool = True
    wire_dtype: Optional[torch.dtype] = None
    grad_wire_dtype: Optional[torch.dtype] = torch.bfloat16
    cuda_graph: bool = False
    fused_step: bool = True
    decode_tokens: Optional[int] = None
    seed: Optional[int] = None
    expert_seed: Optional[int] = None
    scan_expert_func: Optional[Callable[[str, nn.Parameter], Any]] = None
    result_func: Optional[Callable[[Tensor], Tensor]] = None
    comm: Any = None
    dtype: Optional[torch.dtype] = None
    device: Union[None, str, torch.device] = None

    def __post_init__(self) -> None:
        int_arg("model_dim", self.model_dim, 1)
        if self.num_experts is None:
            raise TypeError("num_experts is required (the total number of experts over all ranks)")
        E = int_arg("num_experts", self.num_experts, 1)
        if self.output_dim is not None:
            int_arg("output_dim", self.output_dim, 1)
        int_arg("k", self.k, 1, E, f" (num_experts={E})")
        object.__setattr__(self, "capacity_factor", float_arg("capacity_factor", self.capacity_factor))
        for name in ("normalize_gate", "batch_prioritized_routing", "is_postscore", "dropless",
                     "inequivalent_tokens", "cuda_graph", "fused_step"):
            bool_arg(name, getattr(self, name))
        if self.balance_loss not in BALANCE_LOSSES:
            raise ValueError(f"balance_loss must be one of {BALANCE_LOSSES}, got {self.balance_loss!r}")
        object.__setattr__(self, "z_loss_weight", float_arg("z_loss_weight", self.z_loss_weight))
        self._check_router(E)
        self._check_shared()
        if self.parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be one of {PARALLEL_MODES}, got {self.parallel_mode!r}")
        _check_degree_value(self.overlap_degree)
        _check_own_first_value(self.own_first)
        _check_algorithm_value(self.algorithm)
        if self.wire_dtype is not None:
            check_wire_dtype(self.wire_dtype)
        check_grad_wire_dtype(self.grad_wire_dtype)
        if self.seed is not None:
            int_arg("seed", self.seed, 0)
        if self.decode_tokens is not None:
            int_arg("decode_tokens", self.decode_tokens, 1)
        self._check_gates()
        self._check_experts()
        if self.result_func is not None and not callable(self.result_func):
            raise TypeError(f"result_func must be callable, got {type(self.result_func).__name__}")

    def gate_list(self) -> list:
        """``gate`` as a list (one entry per gate)."""
        return list(self.gate) if isinstance(self.gate, (list, tuple)) else [self.gate]

    def kwargs(self) -> dict:
        """The options as ``MoELayer`` keyword arguments (the objects themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def _check_gates(self) -> None:
        gates = self.gate_list()
        if not gates:
            raise ValueError("gate: an empty list of gates")
        for i, g in enumerate(gates):
            if isinstance(g, TopKGate):
                if g.num_experts != self.num_experts or g.model_dim != self.model_dim:
                    raise ValueError(
                        f"gate[{i}] is for model_dim={g.model_dim}, num_experts={g.num_experts}; the layer has "
                        f"model_dim={self.model_dim}, num_experts={self.num_experts}")
            elif isinstance(g, str):
                if g not in GATE_TYPES:
                    raise ValueError(f"gate={g!r} is unknown; known gate types: {sorted(GATE_TYPES)}")
            else:
                raise TypeError(f"gate must be a gate type name ({sorted(GATE_TYPES)}), a TopKGate or a list of "
                                f"those, got {type(g).__name__}")

    def _check_router(self, E: int) -> None:
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {self.score_function!r}")
        for name in ("pre_softmax", "expert_bias", "shared_expert_gate"):
            bool_arg(name, getattr(self, name))
        if self.topk_scaling_factor is not None:
            object.__setattr__(self, "topk_scaling_factor", float_arg("topk_scaling_factor", self.topk_scaling_factor))
        for name in ("balance_loss_weight", "seq_aux_loss_weight"):
            object.__setattr__(self, name, float_arg(name, getattr(self, name)))
        int_arg("seq_dim", self.seq_dim, 0, 1)
        if self.balance_loss == "load_importance" and self.score_function != "softmax":
            raise ValueError(f"balance_loss='load_importance' needs score_function='softmax', got "
                             f"{self.score_function!r}")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError(f"group-limited routing needs both num_groups and group_topk, got "
                             f"num_groups={self.num_groups}, group_topk={self.group_topk}")
        if self.num_groups is not None:
            int_arg("num_groups", self.num_groups, 1, E, f" (num_experts={E})")
            if E % self.num_groups:
                raise ValueError(f"num_groups={self.num_groups} must divide num_experts={E}")
            int_arg("group_topk", self.group_topk, 1, self.num_groups, f" (num_groups={self.num_groups})")
            check_groups(self.k, E, self.num_groups, self.group_topk)

    def _check_shared(self) -> None:
        if self.shared_expert_size is not None:
            int_arg("shared_expert_size", self.shared_expert_size, 1)
            act = self.shared_expert_activation
            if not callable(act) and not isinstance(act, str):
                raise TypeError(f"shared_expert_activation must be a name or a callable, got {act!r}")

    def _check_experts(self) -> None:
        if self.experts is None:
            if self.hidden_size is None:
                raise TypeError("hidden_size is required for the built-in feed-forward experts")
            int_arg("hidden_size", self.hidden_size, 1)
            for name in ("fc1_bias", "fc2_bias"):  # None: on for plain activations, off for gated ones
                if getattr(self, name) is not None:
                    bool_arg(name, getattr(self, name))
            if self.expert_seed is not None:
                int_arg("expert_seed", self.expert_seed, 0)
            return
        if self.parallel_mode != "expert":
            raise ValueError(f"parallel_mode={self.parallel_mode!r} needs the built-in FFN experts; with user "
                             f"expert modules use parallel_mode='expert'")
        if not isinstance(self.experts, nn.Module) and not callable(self.experts):
            raise TypeError(f"experts must be None, an nn.Module or a callable returning one, got "
                            f"{type(self.experts).__name__}")


def check_groups(k: int, num_experts: int, num_groups: int, group_topk: int) -> None:
    """Group-limited routing can pick ``k`` experts: ``group_topk <= k`` (each group is scored
    by its ``k // group_topk`` best experts) and ``k <= group_topk * num_experts / num_groups``.

    Raises:
        ValueError: naming ``k`` (also a per-call ``k``) and the group options.
    """
    per = num_experts // num_groups
    if group_topk > k or k > group_topk * per:
        raise ValueError(f"k={k} does not fit group-limited routing with num_groups={num_groups}, "
                         f"group_topk={group_topk} ({per} experts per group): need group_topk <= k <= "
                         f"group_topk * {per}")


def expert_layout(num_experts: int, world: int, rank: int) -> tuple[int, int, int, int]:
    """``(local experts, shards per expert, this rank's shard index, its first expert)`` of
    ``num_experts`` over ``world`` ranks: ``num_experts / world`` whole experts per rank, or,
    with fewer experts than ranks, one expert sharded over ``world / num_experts`` ranks.

    Raises:
        ValueError: neither divides the other.
    """
    E, W = num_experts, world
    if E >= W:
        if E % W:
            raise ValueError(
                f"num_experts={E} cannot be split evenly over the {W} ranks of the communicator: use a "
                f"multiple of {W}, or a divisor of {W} to shard each expert over several ranks")
        local, shards = E // W, 1
    else:
        if W % E:
            raise ValueError(
                f"num_experts={E} is fewer than the {W} ranks but does not divide {W}: an expert can be "
                f"sharded only over {W}/num_experts ranks (num_experts must divide the world size)")
        local, shards = 1, W // E
    first = (rank // shards) * local if shards > 1 else rank * local
    return local, shards, rank % shards, first


def _check_degree_value(degree: Any) -> None:
    if degree == "auto" or (isinstance(degree, int) and not isinstance(degree, bool) and degree == 1):
        return
    int_arg("overlap_degree", degree, 1, 16, " or 'auto'")


def _check_own_first_value(own_first: Any) -> None:
    if own_first != "auto" and not isinstance(own_first, bool):
        raise TypeError(f"own_first must be a bool or 'auto', got {own_first!r} ({type(own_first).__name__})")


def _check_algorithm_value(algorithm: Optional[str]) -> None:
    if algorithm is not None and algorithm not in _comm.ALGORITHMS:
        raise ValueError(f"algorithm must be None or one of {_comm.ALGORITHMS}, got {algorithm!r}")


def check_degree(comm: Any, degree: Any) -> Union[int, str]:
    """``overlap_degree``: 1 to 16 or ``'auto'``."""
    _check_degree_value(degree)
    return degree


def check_own_first(comm: Any, own_first: Any) -> Union[bool, str]:
    """``own_first``: a bool or ``'auto'``."""
    _check_own_first_value(own_first)
    return own_first


def check_algorithm(comm: Any, algorithm: Optional[str]) -> Optional[str]:
    """``algorithm``: None or one of ``ALGORITHMS``."""
    if algorithm is not None:
        _check_algorithm_value(algorithm)
    return algorithm
