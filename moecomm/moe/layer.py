"""The Mixture-of-Experts layer: options and construction, and the call (routing, then the
expert-parallel, data-parallel or ``"auto"`` path, each in a module of its own)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

import moecomm_ext
from moecomm.quant import check_wire_dtype

from ._ops import comm as _comm
from ._step import fused_step as _fused_step
from ._ops.args import float_arg, int_arg
from ._step.data_parallel import DataParallelPath
from ._step.decode import DecodePath
from ._step.expert_parallel import ExpertParallelPath
from ._step.graphed import CallResults, StepAccess, StepGraphs
from ._step.routing_step import RoutingStep
from ._ops.step_cache import StepConstants
from .config import (PARALLEL_MODES, MoEConfig, bool_arg, check_algorithm, check_degree, check_own_first,
                     expert_layout)
from .experts import BatchedExperts, ExpertList, FFNExperts
from .gates import GATE_TYPES, TopKGate, make_gate
from .routing import Routing, fixed_capacity
from .shared import SharedExpertFFN, SharedExpertStep

__all__ = ["MoELayer", "PARALLEL_MODES"]

_log = logging.getLogger("moecomm")
_REASONS_LOGGED: set = set()  # why calls ran op by op, each logged once per process
_AUTO_TRIALS = 3  # timed calls of each path before parallel_mode="auto" chooses (the first is a warm-up)


def _build_gates(cfg: MoEConfig, seed: int, device: torch.device) -> list:
    """The gates of ``cfg.gate``: given ones as they are, named ones made with ``seed``."""
    gates = []
    for i, g in enumerate(cfg.gate_list()):
        if isinstance(g, str):
            gen = torch.Generator().manual_seed(seed + 7919 * i)
            kw = dict(k=cfg.k, capacity_factor=cfg.capacity_factor, gate_noise=cfg.gate_noise,
                      fp32_gate=cfg.fp32_gate, generator=gen, dtype=cfg.dtype, device=device)
            if GATE_TYPES[g].__name__ == "CosineTopKGate":
                kw.update(proj_dim=cfg.proj_dim, init_t=cfg.init_t)
            g = make_gate(g, cfg.model_dim, cfg.num_experts, **kw)
        gates.append(g)
    if cfg.balance_loss == "load_importance":
        for g in gates:
            if g.gate_noise <= 0:
                raise ValueError("balance_loss='load_importance' needs gate_noise > 0 "
                                 f"(got gate_noise={g.gate_noise})")
    return gates


class MoELayer(RoutingStep, SharedExpertStep, ExpertParallelPath, DataParallelPath, DecodePath, nn.Module):
    """A Mixture-of-Experts layer over a :class:`moecomm.Communicator`.

    ``forward(x)`` takes ``[..., model_dim]`` and returns ``[..., output_dim]`` (``output_dim``
    defaults to ``model_dim``); the auxiliary loss of that call is ``layer.aux_loss`` (also
    ``layer.l_aux`` and ``y.l_aux``, as in Tutel).

    Experts: ``num_experts`` in total over the communicator's ``size`` ranks: ``num_experts /
    size`` per rank when that divides, or, with fewer experts than ranks, each expert sharded
    over ``size / num_experts`` ranks along its hidden dimension. The built-in experts are
    feed-forward networks (``hidden_size``, ``activation``, ``fc1_bias``, ``fc2_bias``; a gated
    ``activation`` such as ``"swiglu"`` or ``"geglu"`` makes them ``fc2(act(x W1) * (x W3))``
    with ``W1`` and ``W3`` in one weight ``fc1_weight [El, model_dim, 2, hidden]``, and the
    biases default to off for those, on for the others); pass
    ``experts=`` for your own (an ``nn.Module`` mapping ``[num_local, N, model_dim]`` to
    ``[num_local, N, output_dim]``, or a callable ``f(global_expert_index) -> nn.Module`` whose
    modules map ``[n, model_dim]`` to ``[n, output_dim]``).

    Routing: ``gate`` is ``"linear"`` (Tutel's ``"top"``), ``"cosine"`` (``"cosine_top"``), a
    :class:`~moecomm.moe.gates.TopKGate`, or a list of those (select with ``gate_index=``).
    ``k`` experts per token; ``capacity_factor`` > 0: ``k * int(f * ceil(T/E))`` slots per expert
    per source rank; 0: just enough for the busiest expert (the max over ranks); < 0: that, but
    at most ``|f|`` times the fixed capacity. ``dropless=True`` sends exactly the routed rows
    through ``all_to_all_v``, with no capacity and no padding.

    Router options (Megatron-core's ``TopKRouter``, :mod:`moecomm.moe.scoring`; the README's
    "Routers, shared experts and Megatron-core"): ``score_function`` (``"softmax"``,
    ``"sigmoid"``, ``"sqrtsoftplus"``), ``pre_softmax`` (softmax before the top-k, or over the
    k chosen logits), ``normalize_gate``, ``topk_scaling_factor``, ``expert_bias=True`` (a
    per-expert bias for the choice only, updated by :meth:`update_expert_bias` from the counted
    load), ``num_groups``/``group_topk`` (group-limited routing), ``balance_loss="switch"`` with
    ``balance_loss_weight``, ``seq_aux_loss_weight`` (per-sequence loss; ``seq_dim`` says which
    leading dimension of ``x`` is the sequence). ``shared_expert_size``: a dense FFN
    (``shared_expert_activation``, ``shared_expert_gate``) on every token added to the output,
    overlapped with the dispatch on a GPU side stream.

    Token counts may differ between ranks (a rank may have none): with
    ``inequivalent_tokens=True`` (default, per call too) ``T`` above is the largest count of
    any rank, agreed with one ``allreduce`` of one integer per call, the reduction that
    ``capacity_factor <= 0`` makes anyway. While a CUDA graph is captured the host cannot take
    part, so the count agreed by the last eager call with the same local count (the warm-up)
    is used. ``inequivalent_tokens=False`` (Tutel's default) promises equal counts on every
    rank and skips the agreement: a capacity step then has no host synchronisation, and
    ranks whose counts differ anyway compute with different capacities (their exchanges
    disagree: a hang until the communicator's timeout, or wrong results).

    Every routing argument marked *per call* can be overridden in ``forward`` without
    rebuilding the layer: ``k`` (``top_k``), ``capacity_factor``, ``overlap_degree``
    (``a2a_ffn_overlap_degree``), ``own_first``, ``algorithm``, ``dropless``, ``parallel_mode``.

    ``own_first`` (expert-parallel, more than one rank): True: the experts start on the
    tokens this rank routed to its own experts (no exchange, no copy) while the peers' tokens
    are in flight, and the backward pass likewise (``Communicator.scatter_compute_gather(...,
    own_first=True)``, with ``overlap_degree`` stages for the peers' rows). False: an
    ``overlap_degree`` of 1 is a plain all-to-all before and after the experts. ``"auto"``
    (default): True while the call is captured into a CUDA graph, else False: measured
    (``bench/results/README.md``), own rows first shortened the captured step, while eagerly
    the step is bound by the host, whose cost of issuing the pipelined stages made it longer.

    ``wire_dtype`` (expert-parallel, *per call*): ``torch.float8_e4m3fn`` or
    ``torch.float8_e5m2``: the dispatch exchange sends the tokens in that dtype with a
    float32 scale per 128 elements (``Communicator.all_to_all_v(..., wire_dtype=)``) and
    the experts get them dequantized to the activation dtype; the combine exchange stays in
    the activation dtype. The backward pass sends the dispatch gradient in
    ``grad_wire_dtype`` (default bfloat16; an FP8 dtype, float16, float32, or None for the
    gradient's own dtype); the quantization's gradient is the straight-through one. With
    ``overlap_degree`` > 1 or ``own_first`` the pipelined exchange sends the tokens in FP8
    too, and the dispatch gradient in the activation dtype (``grad_wire_dtype`` must then be
    None or that dtype). On one rank nothing travels and nothing is quantized.

    ``cuda_graph=True``: a capacity-mode training step (``capacity_factor > 0``, not dropless,
    expert-parallel, autograd on, no autocast) is captured on first use per input shape and
    per-call options (two CUDA graphs: forward, and backward for the output and the aux loss)
    and replayed inside a normal eager ``forward``/``backward``: ``aux_loss`` and the
    gradients flow as usual, and the host issues a handful of operations instead of the
    whole step. The first call of each shape runs the step eagerly three times (the warm-up)
    and captures it (at most 8 shapes are kept, the least recently used dropped). Costs and
    limits: each captured shape keeps its activations and the gradients of the input and the
    parameters in memory pools of its own; a call while the previous replay of the same graph
    still awaits its backward runs eagerly (their saved activations would collide), as does
    every call the graphs do not cover; the backward of a replay whose activations a later
    call overwrote (a graph kept with ``retain_graph=True``) raises ``RuntimeError``; gradients
    returned by ``torch.autograd.grad`` for the layer's input and parameters are the graph's
    buffers, overwritten by that graph's next backward (``.grad`` fields are safe: a field
    that shares them gets its own copy first). With more than one rank the token-count
    agreement (``inequivalent_tokens=True``) stays eager, one ``allreduce`` per call.

    ``fused_step=True`` (default): the calls it covers run as one autograd Function whose
    operations are issued from C++, with the router in two native kernels
    (:mod:`moecomm.moe._step.fused_step`): capacity mode (``capacity_factor > 0``) and dropless
    with the built-in experts (any activation: named, gated or a callable), each with the
    linear float32 gate, the GShard loss or none, postscore gates, unsharded experts, no
    pipelining (``wire_dtype`` across ranks too) (with gate noise only outside training).
    Another router, gate or loss (sigmoid or sqrtsoftplus scores, an expert bias, groups,
    scaling, gate noise, the cosine gate, the z-loss and the other losses) keeps the rest of
    the step fused: the layer routes with torch operations and the slots, exchanges, experts
    and combine run as the same Function (``routed_step``).
    ``fused_step`` is the option; ``layer.last_step_path`` (a ``StepPath(path, reason)``:
    ``"fused"``, ``"op_by_op"`` or ``"cuda_graph"``, and why not fused, naming the option)
    says which path the last call took, and the first call that runs op by op although
    ``fused_step=True`` logs why (a warning on the ``moecomm`` logger, once per process and
    reason). The same results as the op-by-op step
    (``fused_step=False``): the output, aux loss, routing and the experts' gradients the same
    bits for ``k <= 4`` on the CPU and ``k <= 2`` on GPUs (torch sums more gates in another
    order), the input's and the gate's gradients to float32 rounding (the
    softmax's backward sums in another order); the host issues a step in a fraction of the
    time. It calls the gate's weight directly: hooks on the gate module do not run (use
    ``fused_step=False`` to keep them).

    ``decode_tokens=N`` (off by default): a ``torch.no_grad()`` call with at most ``N`` tokens
    per rank moves them through a preallocated :class:`moecomm.LowLatencyBuffer` (no host
    synchronisation, capturable in a CUDA graph), dropless; ``layer.last_decode`` says whether
    the last call did. See :mod:`moecomm.moe._step.decode`.

    The options are held (and checked) by a :class:`~moecomm.moe.config.MoEConfig`, kept as
    ``layer.config``; ``MoELayer.from_config(cfg)`` builds a layer from one.

    Raises:
        TypeError, ValueError: a bad option (named), see :class:`~moecomm.moe.config.MoEConfig`;
            ValueError also when ``num_experts`` and the world size do not divide each other,
            or an option needs a feature the communicator lacks.
    """

    def __init__(
        self,
        model_dim: int,
        hidden_size: Optional[int] = None,
        num_experts: Optional[int] = None,
        *,
        k: int = 2,
        capacity_factor: float = 1.0,
        gate: Union[str, TopKGate, Sequence[Union[str, TopKGate]]] = "linear",
        gate_noise: float = 0.0,
        fp32_gate: bool = True,
        proj_dim: int = 256,
        init_t: float = 0.5,
        normalize_gate: bool = True,
        score_function: str = "softmax",
        pre_softmax: bool = True,
        topk_scaling_factor: Optional[float] = None,
        expert_bias: bool = False,
        num_groups: Optional[int] = None,
        group_topk: Optional[int] = None,
        balance_loss_weight: float = 1.0,
        seq_aux_loss_weight: float = 0.0,
        seq_dim: int = 0,
        shared_expert_size: Optional[int] = None,
        shared_expert_activation: Union[str, Callable[[Tensor], Tensor]] = "swiglu",
        shared_expert_gate: bool = False,
        batch_prioritized_routing: bool = False,
        is_postscore: bool = True,
        balance_loss: Optional[str] = "gshard",
        z_loss_weight: float = 0.0,
        dropless: bool = False,
        activation: Union[str, Callable[[Tensor], Tensor], None] = "relu",
        fc1_bias: Optional[bool] = None,
        fc2_bias: Optional[bool] = None,
        output_dim: Optional[int] = None,
        experts: Union[None, nn.Module, Callable[[int], nn.Module]] = None,
        parallel_mode: str = "expert",
        overlap_degree: int = 1,
        own_first: Union[bool, str] = "auto",
        algorithm: Optional[str] = None,
        inequivalent_tokens: bool = True,
        wire_dtype: Optional[torch.dtype] = None,
        grad_wire_dtype: Optional[torch.dtype] = torch.bfloat16,
        cuda_graph: bool = False,
        fused_step: bool = True,
        decode_tokens: Optional[int] = None,
        seed: Optional[int] = None,
        expert_seed: Optional[int] = None,
        scan_expert_func: Optional[Callable[[str, nn.Parameter], Any]] = None,
        result_func: Optional[Callable[[Tensor], Tensor]] = None,
        comm: Any = None,
        dtype: Optional[torch.dtype] = None,
        device: Union[None, str, torch.device] = None,
    ) -> None:
        super().__init__()
        options = locals()
        self._setup(MoEConfig(**{name: options[name] for name in MoEConfig.__dataclass_fields__}))

    @classmethod
    def from_config(cls, config: MoEConfig) -> "MoELayer":
        """The layer of ``config`` (whose ``comm`` is resolved now, as ``MoELayer(...)`` does).

        Raises:
            TypeError: ``config`` is not a :class:`~moecomm.moe.config.MoEConfig`.
            ValueError: as ``MoELayer(...)`` for the options that depend on the communicator.
        """
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        return cls(**config.kwargs())

    def _setup(self, cfg: MoEConfig) -> None:
        """The layer of ``cfg``: the communicator resolved and the checks that need it, the
        gates and experts built, the per-call state empty."""
        self.config = cfg
        self.model_dim, self.num_experts = cfg.model_dim, cfg.num_experts
        self.output_dim = self.model_dim if cfg.output_dim is None else cfg.output_dim
        self.comm = comm = _comm.resolve_comm(cfg.comm)
        self.num_local_experts, self.shards, self.shard_index, self.first_expert = \
            expert_layout(cfg.num_experts, comm.size, comm.rank)
        self.k, self.capacity_factor = cfg.k, cfg.capacity_factor
        self.normalize_gate, self.batch_prioritized_routing = cfg.normalize_gate, cfg.batch_prioritized_routing
        self.is_postscore, self.dropless = cfg.is_postscore, cfg.dropless
        self.inequivalent_tokens, self.cuda_graph = cfg.inequivalent_tokens, cfg.cuda_graph
        self.fused_step = cfg.fused_step
        self.balance_loss_type, self.z_loss_weight = cfg.balance_loss, cfg.z_loss_weight
        self.parallel_mode = cfg.parallel_mode
        self.overlap_degree = check_degree(comm, cfg.overlap_degree)
        self.own_first = check_own_first(comm, cfg.own_first)
        self.algorithm = check_algorithm(comm, cfg.algorithm)
        self.wire_dtype, self.grad_wire_dtype = cfg.wire_dtype, cfg.grad_wire_dtype
        self.seed = seed = cfg.seed if cfg.seed is not None else self._shared_random_seed()
        device = comm.device if cfg.device is None else torch.device(cfg.device)
        self.gates = nn.ModuleList(_build_gates(cfg, seed, device))
        self.experts = self._build_experts(cfg, seed, device)
        self.shared_experts = None if cfg.shared_expert_size is None else SharedExpertFFN(
            self.model_dim, cfg.shared_expert_size, output_dim=self.output_dim,
            activation=cfg.shared_expert_activation, gate=cfg.shared_expert_gate,
            generator=torch.Generator().manual_seed(seed + 3), dtype=cfg.dtype, device=device)
        self._setup_router(cfg, device)
        for name, p in self.experts.named_parameters():
            p.skip_allreduce = True  # Tutel's marker: expert weights are not data-parallel
            if cfg.scan_expert_func is not None:
                cfg.scan_expert_func(name, p)
        self.result_func = cfg.result_func
        self.aux_loss: Optional[Tensor] = None
        self.balance_loss: Optional[Tensor] = None
        self._z_loss: Optional[Tensor] = None
        self._z_logits: Optional[Tensor] = None
        self._use_native = moecomm_ext.default_use_native()
        self._last_routing: Optional[Routing] = None
        self._last_route: Optional[Routing] = None  # the call's routing, detached when last_routing is read
        self.last_parallel_mode: Optional[str] = None
        self._consts = StepConstants()  # the step's constant index tensors, per shape
        self._auto: dict = {}
        self.auto_trials = _AUTO_TRIALS
        self._agreed: dict = {}  # local token count -> largest of all ranks, for CUDA graph capture
        self._graphed = StepGraphs()  # cuda_graph=True: the captured steps, per input shape and options
        self.last_step_path: Optional[_fused_step.StepPath] = None  # the last call's path and why
        self.last_decode = False
        self._decode = self._make_decode_buffer(cfg.decode_tokens, cfg.wire_dtype, cfg.dtype)

    def _build_experts(self, cfg: MoEConfig, seed: int, device: torch.device) -> nn.Module:
        """This rank's experts: the built-in FFNs (sharded when ``shards > 1``) or the user's."""
        E, W, El, S = self.num_experts, self.comm.size, self.num_local_experts, self.shards
        if cfg.experts is None:
            if cfg.hidden_size % S:
                raise ValueError(f"hidden_size={cfg.hidden_size} must be divisible by {S}, the number of ranks "
                                 f"each of the num_experts={E} experts is sharded over ({W} ranks)")
            return FFNExperts(self.model_dim, cfg.hidden_size, El, output_dim=self.output_dim,
                              activation=cfg.activation, fc1_bias=cfg.fc1_bias, fc2_bias=cfg.fc2_bias, shards=S,
                              shard_index=self.shard_index, first_expert=self.first_expert,
                              seed=seed + 1 if cfg.expert_seed is None else cfg.expert_seed,
                              dtype=cfg.dtype, device=device)
        if S > 1:
            raise ValueError(f"experts: user expert modules cannot be sharded over ranks; num_experts={E} must "
                             f"be a multiple of the world size {W}")
        if isinstance(cfg.experts, nn.Module):
            return BatchedExperts(cfg.experts, El)
        mods = []
        for i in range(El):
            m = cfg.experts(self.first_expert + i)
            if not isinstance(m, nn.Module):
                raise TypeError(f"experts factory must return an nn.Module, got {type(m).__name__}")
            mods.append(m)
        return ExpertList(mods)

    # -- helpers -----------------------------------------------------------------------------

    @property
    def num_global_experts(self) -> int:
        return self.num_experts

    def _shared_random_seed(self) -> int:
        """A seed drawn on rank 0 from torch's RNG and broadcast, so replicated weights agree."""
        t = torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64).to(self.comm.device)
        if self.comm.size > 1:
            self.comm.broadcast(t, 0)
        return int(t.item())

    def expert_checkpoint_spec(self) -> dict:
        """``{parameter name in state_dict: (expert_axis, shard_axis, replicated_over_shards)}``
        for the expert parameters (used by :mod:`moecomm.moe.checkpoint`)."""
        ex = self.experts
        if isinstance(ex, FFNExperts):
            return {f"experts.{k}": v for k, v in ex.checkpoint_spec().items()}
        if isinstance(ex, ExpertList):
            return {"experts.local.": ("module_index", None, False)}
        spec = getattr(getattr(ex, "module", None), "moe_checkpoint_spec", None)
        if callable(spec):
            return {f"experts.module.{k}": v for k, v in spec().items()}
        return {}

    def checkpoint_meta(self) -> dict:
        return {"num_experts": self.num_experts, "world_size": self.comm.size, "rank": self.comm.rank,
                "num_local_experts": self.num_local_experts, "shards": self.shards}

    # -- forward -------------------------------------------------------------------------------

    def forward(
        self,
        x: Tensor,
        *,
        k: Optional[int] = None,
        top_k: Optional[int] = None,
        capacity_factor: Optional[float] = None,
        overlap_degree: Optional[int] = None,
        a2a_ffn_overlap_degree: Optional[int] = None,
        own_first: Union[None, bool, str] = None,
        algorithm: Optional[str] = None,
        dropless: Optional[bool] = None,
        parallel_mode: Optional[str] = None,
        gate_index: int = 0,
        inequivalent_tokens: Optional[bool] = None,
        wire_dtype: Optional[torch.dtype] = None,
    ) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.model_dim:
            raise ValueError(f"x must be [..., model_dim={self.model_dim}], got shape {tuple(x.shape)}")
        gate_index = int_arg("gate_index", gate_index, 0, len(self.gates) - 1)
        gate = self.gates[gate_index]
        kk = self._call_k(gate, k, top_k)
        deg = self._call_degree(overlap_degree, a2a_ffn_overlap_degree)
        own = self.own_first if own_first is None else check_own_first(self.comm, own_first)
        wire = self.wire_dtype if wire_dtype is None else wire_dtype
        if wire is not None:
            check_wire_dtype(wire)
        own_captured = True if own == "auto" else own  # what "auto" means in a captured step
        if own == "auto":
            own = x.is_cuda and torch.cuda.is_current_stream_capturing()
        cf = gate.capacity_factor if capacity_factor is None else float_arg("capacity_factor", capacity_factor)
        algo = self.algorithm if algorithm is None else check_algorithm(self.comm, algorithm)
        drop_less = self.dropless if dropless is None else bool_arg("dropless", dropless)
        ineq = self.inequivalent_tokens if inequivalent_tokens is None else bool_arg("inequivalent_tokens",
                                                                                     inequivalent_tokens)
        mode = self._call_mode(parallel_mode)
        # what every rank must agree on (_agreement.SETTINGS): checked with the call's host agreement
        self.__dict__["_call_settings"] = (self.model_dim, self.output_dim, self.num_experts, x.dtype, kk, cf,
                                           drop_less, deg, own, algo, ineq, mode, wire)
        if drop_less:  # no agreement per call: the settings once, as long as they stay the same
            self._agree_settings_once(x.device)

        y = None if self._decode is None else self._decode_forward(x, gate, kk, mode, ineq, wire)
        if y is None and self.cuda_graph and self._graphable(x, cf, drop_less, mode):
            y = self._graphed.run(self._step_access(), x, gate_index, kk, cf, deg, own_captured, algo, ineq, mode, wire)
            if y is not None:
                self.__dict__["last_step_path"] = _fused_step.StepPath("cuda_graph")
        if y is None:
            y = self._run(x, gate, kk, cf, deg, own, algo, drop_less, ineq, mode, wire)
        aux = self.aux_loss
        if self.result_func is not None:
            y = self.result_func(y)
        try:
            y.l_aux = aux
        except (AttributeError, TypeError):
            # result_func may return a non-tensor (a tuple, a frozen object) that takes no attribute
            pass
        return y

    def _call_k(self, gate: TopKGate, k: Optional[int], top_k: Optional[int]) -> int:
        """The call's ``k`` (alias ``top_k``), else the gate's."""
        if k is not None and top_k is not None and k != top_k:
            raise ValueError(f"k={k} and top_k={top_k} disagree (they are the same argument)")
        kk = k if k is not None else top_k
        E = self.num_experts
        return gate.k if kk is None else int_arg("k", kk, 1, E, f" (num_experts={E})")

    def _call_degree(self, overlap_degree: Any, a2a_ffn_overlap_degree: Any) -> Union[int, str]:
        """The call's ``overlap_degree`` (alias ``a2a_ffn_overlap_degree``), else the layer's."""
        if overlap_degree is not None and a2a_ffn_overlap_degree is not None and \
                overlap_degree != a2a_ffn_overlap_degree:
            raise ValueError(f"overlap_degree={overlap_degree} and a2a_ffn_overlap_degree={a2a_ffn_overlap_degree} "
                             f"disagree (they are the same argument)")
        deg = overlap_degree if overlap_degree is not None else a2a_ffn_overlap_degree
        return self.overlap_degree if deg is None else check_degree(self.comm, deg)

    def _call_mode(self, parallel_mode: Optional[str]) -> str:
        """The call's ``parallel_mode``, else the layer's."""
        mode = self.parallel_mode if parallel_mode is None else parallel_mode
        if mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be one of {PARALLEL_MODES}, got {mode!r}")
        if mode != "expert" and not isinstance(self.experts, FFNExperts):
            raise ValueError(f"parallel_mode={mode!r} needs the built-in FFN experts")
        return mode

    def _graphable(self, x: Tensor, cf: float, drop_less: bool, mode: str) -> bool:
        """Whether this call can replay a per-shape CUDA graph (``cuda_graph=True``): a capacity
        step (``capacity_factor > 0``, not dropless) on a GPU, expert-parallel, with autograd
        on and no autocast, not itself inside a capture."""
        if not (x.is_cuda and cf > 0 and not drop_less and mode == "expert" and torch.is_grad_enabled()):
            return False
        return not (torch.is_autocast_enabled("cuda") or torch.cuda.is_current_stream_capturing())

    def _step_access(self) -> StepAccess:
        """What the captured steps (``cuda_graph=True``) need of this layer, handed over per call."""
        return StepAccess(self, self._run, self._agreed_tokens, self._call_results, self._set_call_results)

    def _call_results(self) -> CallResults:
        """The last call's losses, z logits and routing (for the captured steps)."""
        return CallResults(self.aux_loss, self.balance_loss, self._z_loss, self._z_logits, self.last_routing)

    def _set_call_results(self, results: CallResults) -> None:
        """Make ``results`` the last call's (a replayed step's, or none after a failed capture)."""
        self.aux_loss, self.balance_loss, self._z_loss, self._z_logits, self.last_routing = results

    def _run(self, x: Tensor, gate: TopKGate, kk: int, cf: float, deg, own, algo, drop_less: bool, ineq: bool,
             mode: str, wire: Optional[torch.dtype] = None) -> Tensor:
        """The eager step: routing, losses, dispatch, experts, combine; ``[..., output_dim]``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.model_dim)
        T = x2.shape[0]
        dev_type = x2.device.type
        autocast = torch.is_autocast_enabled(dev_type) if hasattr(torch, "is_autocast_enabled") else False
        cdtype = torch.get_autocast_dtype(dev_type) if autocast else x2.dtype
        shared = None if self.shared_experts is None else self._start_shared(x2)
        routed = False
        if not self.fused_step:
            why = "fused_step=False"
        elif mode != "expert":
            why = f"parallel_mode={mode!r} (the fused step is expert-parallel)"
        elif autocast:
            why = "autocast (the fused step runs in the input's dtype)"
        else:
            why = _fused_step.uncovered_routed(self, x2, cf, drop_less, deg, own, wire, self.comm.size)
            # a router, gate or loss the fused routing does not cover: the layer routes, the rest is fused
            routed = why is None and (self._router_reason or _fused_step.routing_uncovered(self, gate)) is not None
        self._note_step_path(why)
        if why is None:
            if routed:
                y = self._routed(x2, gate, kk, cf, ineq, algo, drop_less, wire, lead)
            else:
                y = self._fused(x2, gate, kk, cf, ineq, algo, drop_less, wire)
            return self._add_shared(y, shared).reshape(*lead, self.output_dim)

        r = self._route(x2, gate, kk, lead)  # fp32 at least; sets the call's losses
        r.capacity = None if drop_less else self._capacity(r, T, kk, cf, ineq)

        auto_key = None
        if mode == "auto":
            # identical on every rank (the choice must be): the capacity is agreed, T is not
            auto_key = (r.capacity, kk, cf, drop_less, deg, own, str(cdtype), algo, str(wire))
            mode = self._auto_choice(auto_key)
        self.__dict__["last_parallel_mode"] = mode  # a plain attribute: skip nn.Module.__setattr__
        x_c = x2 if x2.dtype == cdtype else x2.to(cdtype)
        if mode == "expert":
            y = self._expert_parallel(x_c, r, deg, own, algo, cdtype, wire)
        elif mode == "data":
            y = self._data_parallel(x_c, r, cdtype)
        else:  # a timed trial of both paths in auto mode
            y = self._timed(mode, auto_key, x_c, r, deg, own, algo, cdtype, wire)
        d = self.__dict__
        d["_last_route"], d["_last_routing"] = r, None
        return self._add_shared(y, shared).reshape(*lead, self.output_dim)

    def _note_step_path(self, why: Optional[str]) -> None:
        """Record the call's path (:attr:`last_step_path`); the first call that a configuration
        sends op by op although ``fused_step=True`` says why on the ``moecomm`` logger (once
        per process and reason)."""
        d = self.__dict__  # plain attributes: skip nn.Module.__setattr__
        if why is None:
            d["last_step_path"] = _fused_step.FUSED
            return
        d["last_step_path"] = _fused_step.StepPath("op_by_op", why)
        if self.fused_step and why not in _REASONS_LOGGED:
            _REASONS_LOGGED.add(why)
            _log.warning("MoELayer: a call runs op by op, not the fused step (slower): %s. Said once per process "
                         "and reason; layer.last_step_path tells each call's path.", why)

    def _fused(self, x2: Tensor, gate: TopKGate, kk: int, cf: float, ineq: bool, algo: Optional[str],
               dropless: bool, wire: Optional[torch.dtype]) -> Tensor:
        """The step as one autograd Function (:mod:`._fused_step`); sets the call's losses and
        routing as :meth:`_route` does."""
        gshard = self.balance_loss_type == "gshard"
        call = self._step_call(x2, kk, cf, ineq, algo, dropless, wire, self.normalize_gate, gshard)
        y, aux = _fused_step.fused_step(call, x2, gate.wg.weight, self.experts)
        d = self.__dict__  # plain attributes: skip nn.Module.__setattr__
        d["_z_logits"], d["_z_loss"], d["balance_loss"], d["aux_loss"] = call.logits, None, aux if gshard else None, aux
        d["_last_route"], d["_last_routing"], d["last_parallel_mode"] = call.routing, None, "expert"
        return y

    def _routed(self, x2: Tensor, gate: TopKGate, kk: int, cf: float, ineq: bool, algo: Optional[str],
                dropless: bool, wire: Optional[torch.dtype], lead: tuple) -> Tensor:
        """The layer's router and losses op by op (:meth:`_route`), the slots, exchanges, experts
        and combine as one autograd Function (:func:`._fused_step.routed_step`)."""
        r = self._route(x2, gate, kk, lead, positions=False)
        call = self._step_call(x2, kk, cf, ineq, algo, dropless, wire, False, False)
        y = _fused_step.routed_step(call, x2, r.gates, r.topk_idx, self.experts)
        self._count_expert_load(call.routing.counts)
        d = self.__dict__  # plain attributes: skip nn.Module.__setattr__
        d["_last_route"], d["_last_routing"], d["last_parallel_mode"] = call.routing, None, "expert"
        return y

    def _step_call(self, x2: Tensor, kk: int, cf: float, ineq: bool, algo: Optional[str], dropless: bool,
                   wire: Optional[torch.dtype], normalize: bool, gshard: bool) -> "_fused_step.StepCall":
        """A fused step's settings: the capacity of the agreed token count (None: dropless)."""
        E = self.num_experts
        C = None if dropless else fixed_capacity(self._step_tokens(x2.shape[0], x2.device, ineq), E, kk, cf)
        return _fused_step.StepCall(self.comm, E, self.num_local_experts, kk, C, algo, normalize, gshard,
                                    self._use_native, self._consts, wire, self.grad_wire_dtype)

    @property
    def last_routing(self) -> Optional[Routing]:
        """The routing of the last call (gate weights detached), or None before the first."""
        r = self._last_route
        if r is not None:
            kept = r.kept
            if kept is None:  # the fused step's: made when read
                kept = r.locations < r.capacity if r.capacity is not None else torch.ones_like(r.locations, dtype=torch.bool)
            self._last_routing = Routing(r.topk_idx, r.gates.detach(), r.locations, r.counts, r.capacity, kept)
            self._last_route = None
        return self._last_routing

    @last_routing.setter
    def last_routing(self, value: Optional[Routing]) -> None:
        self._last_routing, self._last_route = value, None

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, num_experts={self.num_experts}, k={self.k}, "
                f"capacity_factor={self.capacity_factor}, dropless={self.dropless}, world={self.comm.size}, "
                f"local_experts={self.num_local_experts}, shards={self.shards}, parallel_mode={self.parallel_mode}")
