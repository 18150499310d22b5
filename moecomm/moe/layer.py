"""The Mixture-of-Experts layer."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import moecomm_ext

from . import _comm, _wire
from ._args import float_arg, int_arg
from ._gather import gather_expert_params
from ._graphed import StepGraphs
from .experts import BatchedExperts, ExpertList, FFNExperts, Segments, WeightGradSum
from .gates import GATE_TYPES, TopKGate, make_gate
from .losses import BALANCE_LOSSES, gshard_loss, load_importance_loss, router_z_loss
from .routing import Routing, capacity_slots, dropless_slots, fixed_capacity, pipelined_capacity_slots, route

__all__ = ["MoELayer", "PARALLEL_MODES"]

PARALLEL_MODES = ("expert", "data", "auto")


def _bool_arg(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


class MoELayer(nn.Module):
    """A Mixture-of-Experts layer over a :class:`moecomm.Communicator`.

    ``forward(x)`` takes ``[..., model_dim]`` and returns ``[..., output_dim]`` (``output_dim``
    defaults to ``model_dim``); the auxiliary loss of that call is ``layer.aux_loss`` (also
    ``layer.l_aux`` and ``y.l_aux``, as in Tutel).

    Experts: ``num_experts`` in total over the communicator's ``size`` ranks: ``num_experts /
    size`` per rank when that divides, or, with fewer experts than ranks, each expert sharded
    over ``size / num_experts`` ranks along its hidden dimension. The built-in experts are
    feed-forward networks (``hidden_size``, ``activation``, ``fc1_bias``, ``fc2_bias``); pass
    ``experts=`` for your own (an ``nn.Module`` mapping ``[num_local, N, model_dim]`` to
    ``[num_local, N, output_dim]``, or a callable ``f(global_expert_index) -> nn.Module`` whose
    modules map ``[n, model_dim]`` to ``[n, output_dim]``).

    Routing: ``gate`` is ``"linear"`` (Tutel's ``"top"``), ``"cosine"`` (``"cosine_top"``), a
    :class:`~moecomm.moe.gates.TopKGate`, or a list of those (select with ``gate_index=``).
    ``k`` experts per token; ``capacity_factor`` > 0: ``k * int(f * ceil(T/E))`` slots per expert
    per source rank; 0: just enough for the busiest expert (the max over ranks); < 0: that, but
    at most ``|f|`` times the fixed capacity. ``dropless=True`` sends exactly the routed rows
    through ``all_to_all_v``, with no capacity and no padding.

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
    (default): True while the call is captured into a CUDA graph, else False. Measured on
    2 x H200 (``bench/results/README.md``): captured, own rows first shortens the step by
    5-8%; eagerly the step is bound by the host, whose cost of issuing the pipelined stages
    made it longer.

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
        batch_prioritized_routing: bool = False,
        is_postscore: bool = True,
        balance_loss: Optional[str] = "gshard",
        z_loss_weight: float = 0.0,
        dropless: bool = False,
        activation: Union[str, Callable[[Tensor], Tensor], None] = "relu",
        fc1_bias: bool = True,
        fc2_bias: bool = True,
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
        seed: Optional[int] = None,
        expert_seed: Optional[int] = None,
        scan_expert_func: Optional[Callable[[str, nn.Parameter], Any]] = None,
        result_func: Optional[Callable[[Tensor], Tensor]] = None,
        comm: Any = None,
        dtype: Optional[torch.dtype] = None,
        device: Union[None, str, torch.device] = None,
    ) -> None:
        super().__init__()
        self.model_dim = int_arg("model_dim", model_dim, 1)
        if num_experts is None:
            raise TypeError("num_experts is required (the total number of experts over all ranks)")
        self.num_experts = E = int_arg("num_experts", num_experts, 1)
        self.output_dim = self.model_dim if output_dim is None else int_arg("output_dim", output_dim, 1)
        self.comm = comm = _comm.resolve_comm(comm)
        W = comm.size
        if E >= W:
            if E % W:
                raise ValueError(
                    f"num_experts={E} cannot be split evenly over the {W} ranks of the communicator: use a "
                    f"multiple of {W}, or a divisor of {W} to shard each expert over several ranks")
            self.num_local_experts, self.shards = E // W, 1
        else:
            if W % E:
                raise ValueError(
                    f"num_experts={E} is fewer than the {W} ranks but does not divide {W}: an expert can be "
                    f"sharded only over {W}/num_experts ranks (num_experts must divide the world size)")
            self.num_local_experts, self.shards = 1, W // E
        self.shard_index = comm.rank % self.shards
        self.first_expert = (comm.rank // self.shards) * self.num_local_experts if self.shards > 1 else \
            comm.rank * self.num_local_experts

        self.k = int_arg("k", k, 1, E, f" (num_experts={E})")
        self.capacity_factor = float_arg("capacity_factor", capacity_factor)
        self.normalize_gate = _bool_arg("normalize_gate", normalize_gate)
        self.batch_prioritized_routing = _bool_arg("batch_prioritized_routing", batch_prioritized_routing)
        self.is_postscore = _bool_arg("is_postscore", is_postscore)
        self.dropless = _bool_arg("dropless", dropless)
        self.inequivalent_tokens = _bool_arg("inequivalent_tokens", inequivalent_tokens)
        self.cuda_graph = _bool_arg("cuda_graph", cuda_graph)
        if balance_loss not in BALANCE_LOSSES:
            raise ValueError(f"balance_loss must be one of {BALANCE_LOSSES}, got {balance_loss!r}")
        self.balance_loss_type = balance_loss
        self.z_loss_weight = float_arg("z_loss_weight", z_loss_weight)
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be one of {PARALLEL_MODES}, got {parallel_mode!r}")
        self.parallel_mode = parallel_mode
        self.overlap_degree = self._check_degree(overlap_degree)
        self.own_first = self._check_own_first(own_first)
        self.algorithm = self._check_algorithm(algorithm)
        _wire.check_wire_args(wire_dtype, grad_wire_dtype)
        self.wire_dtype, self.grad_wire_dtype = wire_dtype, grad_wire_dtype
        if seed is not None:
            int_arg("seed", seed, 0)
        else:
            seed = self._shared_random_seed()
        self.seed = seed
        device = comm.device if device is None else torch.device(device)

        # -- gates -----------------------------------------------------------------------
        gate_list = list(gate) if isinstance(gate, (list, tuple)) else [gate]
        if not gate_list:
            raise ValueError("gate: an empty list of gates")
        gates = []
        for i, g in enumerate(gate_list):
            if isinstance(g, TopKGate):
                if g.num_experts != E or g.model_dim != self.model_dim:
                    raise ValueError(
                        f"gate[{i}] is for model_dim={g.model_dim}, num_experts={g.num_experts}; the layer has "
                        f"model_dim={self.model_dim}, num_experts={E}")
                gates.append(g)
            elif isinstance(g, str):
                if g not in GATE_TYPES:
                    raise ValueError(f"gate={g!r} is unknown; known gate types: {sorted(GATE_TYPES)}")
                gen = torch.Generator().manual_seed(seed + 7919 * i)
                kw = dict(k=self.k, capacity_factor=self.capacity_factor, gate_noise=gate_noise, fp32_gate=fp32_gate,
                          generator=gen, dtype=dtype, device=device)
                if GATE_TYPES[g].__name__ == "CosineTopKGate":
                    kw.update(proj_dim=proj_dim, init_t=init_t)
                gates.append(make_gate(g, self.model_dim, E, **kw))
            else:
                raise TypeError(f"gate must be a gate type name ({sorted(GATE_TYPES)}), a TopKGate or a list of "
                                f"those, got {type(g).__name__}")
        self.gates = nn.ModuleList(gates)
        for g in self.gates:
            if self.balance_loss_type == "load_importance" and g.gate_noise <= 0:
                raise ValueError("balance_loss='load_importance' needs gate_noise > 0 "
                                 f"(got gate_noise={g.gate_noise})")

        # -- experts ---------------------------------------------------------------------
        El, S = self.num_local_experts, self.shards
        if experts is None:
            if hidden_size is None:
                raise TypeError("hidden_size is required for the built-in feed-forward experts")
            int_arg("hidden_size", hidden_size, 1)
            if hidden_size % S:
                raise ValueError(f"hidden_size={hidden_size} must be divisible by {S}, the number of ranks each "
                                 f"of the num_experts={E} experts is sharded over ({W} ranks)")
            self.experts = FFNExperts(self.model_dim, hidden_size, El, output_dim=self.output_dim,
                                      activation=activation, fc1_bias=_bool_arg("fc1_bias", fc1_bias),
                                      fc2_bias=_bool_arg("fc2_bias", fc2_bias), shards=S,
                                      shard_index=self.shard_index, first_expert=self.first_expert,
                                      seed=seed + 1 if expert_seed is None else int_arg("expert_seed", expert_seed, 0),
                                      dtype=dtype, device=device)
        else:
            if S > 1:
                raise ValueError(f"experts: user expert modules cannot be sharded over ranks; num_experts={E} must "
                                 f"be a multiple of the world size {W}")
            if parallel_mode != "expert":
                raise ValueError(f"parallel_mode={parallel_mode!r} needs the built-in FFN experts; with user expert "
                                 f"modules use parallel_mode='expert'")
            if isinstance(experts, nn.Module):
                self.experts = BatchedExperts(experts, El)
            elif callable(experts):
                mods = []
                for i in range(El):
                    m = experts(self.first_expert + i)
                    if not isinstance(m, nn.Module):
                        raise TypeError(f"experts factory must return an nn.Module, got {type(m).__name__}")
                    mods.append(m)
                self.experts = ExpertList(mods)
            else:
                raise TypeError(f"experts must be None, an nn.Module or a callable returning one, got "
                                f"{type(experts).__name__}")
        for name, p in self.experts.named_parameters():
            p.skip_allreduce = True  # Tutel's marker: expert weights are not data-parallel
            p._moe_expert = True
            if scan_expert_func is not None:
                scan_expert_func(name, p)
        if result_func is not None and not callable(result_func):
            raise TypeError(f"result_func must be callable, got {type(result_func).__name__}")
        self.result_func = result_func
        self.aux_loss: Optional[Tensor] = None
        self.balance_loss: Optional[Tensor] = None
        self._z_loss: Optional[Tensor] = None
        self._z_logits: Optional[Tensor] = None
        self._use_native = moecomm_ext.default_use_native()
        self.last_routing: Optional[Routing] = None
        self.last_parallel_mode: Optional[str] = None
        self._auto: dict = {}
        self.auto_trials = 3
        self._agreed: dict = {}  # local token count -> largest of all ranks, for CUDA graph capture
        self._graphed = StepGraphs()  # cuda_graph=True: the captured steps, per input shape and options

    # -- helpers -----------------------------------------------------------------------------

    @property
    def l_aux(self) -> Optional[Tensor]:
        return self.aux_loss

    @property
    def z_loss(self) -> Optional[Tensor]:
        """The router z-loss of the last call (part of ``aux_loss`` when ``z_loss_weight != 0``)."""
        if self._z_loss is None and self._z_logits is not None:
            with torch.no_grad():
                self._z_loss = router_z_loss(self._z_logits)
            self._z_logits = None
        return self._z_loss

    @property
    def num_global_experts(self) -> int:
        return self.num_experts

    def _shared_random_seed(self) -> int:
        """A seed drawn on rank 0 from torch's RNG and broadcast, so replicated weights agree."""
        t = torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64).to(self.comm.device)
        if self.comm.size > 1:
            self.comm.broadcast(t, 0)
        return int(t.item())

    def _check_degree(self, degree: Any) -> Union[int, str]:
        if degree == "auto" or (isinstance(degree, int) and not isinstance(degree, bool) and degree == 1):
            pass
        else:
            int_arg("overlap_degree", degree, 1, 16, " or 'auto'")
        if degree != 1 and not _comm.has_scatter_compute_gather(self.comm):
            raise ValueError(f"overlap_degree={degree!r}: this moecomm core has no "
                             f"Communicator.scatter_compute_gather; only overlap_degree=1 is possible")
        return degree

    def _check_own_first(self, own_first: Any) -> Union[bool, str]:
        if own_first != "auto" and not isinstance(own_first, bool):
            raise TypeError(f"own_first must be a bool or 'auto', got {own_first!r} ({type(own_first).__name__})")
        if own_first and not _comm.has_own_first(self.comm):
            if own_first == "auto":
                return False
            raise ValueError("own_first=True: this moecomm core's Communicator.scatter_compute_gather has no "
                             "own_first argument; pass own_first=False")
        return own_first

    def _check_algorithm(self, algorithm: Optional[str]) -> Optional[str]:
        if algorithm is None:
            return None
        if algorithm not in _comm.ALGORITHMS:
            raise ValueError(f"algorithm must be None or one of {_comm.ALGORITHMS}, got {algorithm!r}")
        if algorithm != "flat" and not _comm.a2a_accepts_algorithm(self.comm):
            raise ValueError(f"algorithm={algorithm!r}: this moecomm core has no 'algorithm' argument in "
                             f"Communicator.all_to_all_v (only 'flat' or None is possible)")
        return algorithm

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
        E = self.num_experts
        if k is not None and top_k is not None and k != top_k:
            raise ValueError(f"k={k} and top_k={top_k} disagree (they are the same argument)")
        kk = k if k is not None else top_k
        kk = gate.k if kk is None else int_arg("k", kk, 1, E, f" (num_experts={E})")
        if overlap_degree is not None and a2a_ffn_overlap_degree is not None and \
                overlap_degree != a2a_ffn_overlap_degree:
            raise ValueError(f"overlap_degree={overlap_degree} and a2a_ffn_overlap_degree={a2a_ffn_overlap_degree} "
                             f"disagree (they are the same argument)")
        deg = overlap_degree if overlap_degree is not None else a2a_ffn_overlap_degree
        deg = self.overlap_degree if deg is None else self._check_degree(deg)
        own = self.own_first if own_first is None else self._check_own_first(own_first)
        wire = self.wire_dtype if wire_dtype is None else wire_dtype
        _wire.check_wire_args(wire, None)
        own_captured = True if own == "auto" else own  # what "auto" means in a captured step
        if own == "auto":
            own = x.is_cuda and torch.cuda.is_current_stream_capturing()
        cf = gate.capacity_factor if capacity_factor is None else float_arg("capacity_factor", capacity_factor)
        algo = self.algorithm if algorithm is None else self._check_algorithm(algorithm)
        drop_less = self.dropless if dropless is None else _bool_arg("dropless", dropless)
        ineq = self.inequivalent_tokens if inequivalent_tokens is None else _bool_arg("inequivalent_tokens",
                                                                                      inequivalent_tokens)
        mode = self.parallel_mode if parallel_mode is None else parallel_mode
        if mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be one of {PARALLEL_MODES}, got {mode!r}")
        if mode != "expert" and not isinstance(self.experts, FFNExperts):
            raise ValueError(f"parallel_mode={mode!r} needs the built-in FFN experts")

        y = None
        if self.cuda_graph and self._graphable(x, cf, drop_less, mode):
            y = self._graphed.run(self, x, gate_index, kk, cf, deg, own_captured, algo, ineq, mode, wire)
        if y is None:
            y = self._run(x, gate, kk, cf, deg, own, algo, drop_less, ineq, mode, wire)
        aux = self.aux_loss
        if self.result_func is not None:
            y = self.result_func(y)
        try:
            y.l_aux = aux
        except Exception:  # noqa: BLE001 - result_func may return a non-tensor
            pass
        return y

    def _graphable(self, x: Tensor, cf: float, drop_less: bool, mode: str) -> bool:
        """Whether this call can replay a per-shape CUDA graph (``cuda_graph=True``): a capacity
        step (``capacity_factor > 0``, not dropless) on a GPU, expert-parallel, with autograd
        on and no autocast, not itself inside a capture."""
        if not (x.is_cuda and cf > 0 and not drop_less and mode == "expert" and torch.is_grad_enabled()):
            return False
        return not (torch.is_autocast_enabled("cuda") or torch.cuda.is_current_stream_capturing())

    def _run(self, x: Tensor, gate: TopKGate, kk: int, cf: float, deg, own, algo, drop_less: bool, ineq: bool,
             mode: str, wire: Optional[torch.dtype] = None) -> Tensor:
        """The eager step: routing, losses, dispatch, experts, combine; ``[..., output_dim]``."""
        E = self.num_experts
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.model_dim)
        T = x2.shape[0]
        dev_type = x2.device.type
        autocast = torch.is_autocast_enabled(dev_type) if hasattr(torch, "is_autocast_enabled") else False
        cdtype = torch.get_autocast_dtype(dev_type) if autocast else x2.dtype

        # -- routing (fp32 at least) --
        logits = gate(x2)
        sdtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logits = logits.to(sdtype)
        if self.training and gate.gate_noise > 0:
            noisy = logits + gate.gate_noise * torch.randn_like(logits) / E
        else:
            noisy = logits
        scores = F.softmax(noisy, dim=1)
        r = route(scores, kk, batch_prioritized=self.batch_prioritized_routing, normalize=self.normalize_gate)

        if self.balance_loss_type == "gshard":
            bal = gshard_loss(scores, r.topk_idx[:, 0])
        elif self.balance_loss_type == "load_importance":
            bal = load_importance_loss(F.softmax(logits, dim=1), noisy, r.topk_idx, gate.gate_noise)
        else:
            bal = None
        if self.z_loss_weight != 0:
            z = router_z_loss(logits)
            aux = z * self.z_loss_weight if bal is None else bal + z * self.z_loss_weight
            self._z_logits, self._z_loss = None, z
        else:  # not part of the loss: computed (without a graph) only if someone reads layer.z_loss
            aux = bal if bal is not None else logits.new_zeros(())
            self._z_logits, self._z_loss = logits.detach(), None
        self.balance_loss, self.aux_loss = bal, aux

        # -- capacity --
        if drop_less:
            r.capacity = None
        else:
            r.capacity = self._capacity(r, T, kk, cf, ineq)

        # -- experts --
        auto_key = None
        if mode == "auto":
            # identical on every rank (the choice must be): the capacity is agreed, T is not
            auto_key = (r.capacity, kk, cf, drop_less, deg, own, str(cdtype), algo, str(wire))
            mode = self._auto_choice(auto_key)
        self.last_parallel_mode = mode
        x_c = x2 if x2.dtype == cdtype else x2.to(cdtype)
        if mode == "expert":
            y = self._expert_parallel(x_c, r, deg, own, algo, cdtype, wire)
        elif mode == "data":
            y = self._data_parallel(x_c, r, cdtype)
        else:  # a timed trial of both paths in auto mode
            y = self._timed(mode, auto_key, x_c, r, deg, own, algo, cdtype, wire)
        self.last_routing = Routing(r.topk_idx, r.gates.detach(), r.locations, r.counts, r.capacity, r.kept)
        return y.reshape(*lead, self.output_dim)

    def _capacity(self, r: Routing, T: int, k: int, cf: float, ineq: bool) -> int:
        E = self.num_experts
        if cf > 0:
            return fixed_capacity(self._agreed_tokens(T, r.topk_idx.device) if ineq else T, E, k, cf)
        busiest = int(r.counts.max()) if T else 0
        need, t = _comm.allreduce_max(self.comm, [busiest, T])
        if cf < 0:  # the bound uses the largest token count of any rank, so that ranks agree
            need = min(need, fixed_capacity(t, E, k, cf))
        return need

    def _agreed_tokens(self, T: int, device: torch.device) -> int:
        """The largest token count of any rank (one ``allreduce``); while a CUDA graph is
        captured, the count agreed for this local count by an earlier eager call."""
        if self.comm.size == 1:
            return T
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            agreed = self._agreed.get(T)
            if agreed is None:
                raise RuntimeError(
                    f"MoELayer: capacity_factor > 0 with inequivalent_tokens=True (the default) under CUDA graph "
                    f"capture needs the ranks' largest token count, which the host cannot agree on during a "
                    f"capture: run the layer eagerly once with the same {T} tokens first (the warm-up), or pass "
                    f"inequivalent_tokens=False if every rank captures the same number of tokens")
            return agreed
        agreed = _comm.allreduce_max(self.comm, [T])[0]
        if T not in self._agreed and len(self._agreed) >= 64:
            self._agreed.pop(next(iter(self._agreed)))
        self._agreed[T] = agreed
        return agreed

    # -- expert-parallel path ---------------------------------------------------------------

    def _slot_weights(self, r: Routing, S: int):
        g = r.gates
        return g if S == 1 else g.repeat_interleave(S, dim=1)

    def _dispatch(self, x_c: Tensor, r: Routing, sm, S: int) -> tuple[Tensor, Optional[Tensor]]:
        """Send buffer and the combine weights."""
        w = self._slot_weights(r, S)
        if self.is_postscore:
            send = moecomm_ext.dispatch(x_c, sm.slot_token, sm.token_slots, None, check=False,
                                        use_native=self._use_native)
            return send, w
        flat = w.reshape(-1)
        safe = sm.slot_route.clamp(min=0)
        scale = torch.where(sm.slot_route >= 0, flat.index_select(0, safe) if flat.numel() else
                            flat.new_zeros(safe.shape), flat.new_zeros(()))
        send = moecomm_ext.dispatch(x_c, sm.slot_token, sm.token_slots, scale, check=False,
                                    use_native=self._use_native)
        return send, None

    def _combine(self, back: Tensor, sm, weights: Optional[Tensor]) -> Tensor:
        return moecomm_ext.combine(back, sm.token_slots, weights, sm.slot_token, check=False,
                                   use_native=self._use_native)

    def _run_experts(self, rows: Tensor, seg: Segments) -> Tensor:
        return self.experts(rows, seg)

    def _expert_parallel(self, x_c: Tensor, r: Routing, degree, own_first: bool, algo: Optional[str],
                         cdtype, wire: Optional[torch.dtype] = None) -> Tensor:
        comm = self.comm
        W, El, S, E = comm.size, self.num_local_experts, self.shards, self.num_experts
        El_dest = El if S == 1 else 1  # experts per destination rank, as the rows arrive
        own_first = own_first and W > 1
        if r.capacity is not None:
            C = r.capacity
            if degree == "auto":  # equal pair blocks: every pair gets the same number of pieces
                from moecomm.overlap import auto_pieces

                row_bytes = x_c.shape[1] * x_c.element_size()
                degree = max(auto_pieces(comm, [El_dest * C], row_bytes) + [1])
            # each destination block = `degree` equal chunks along the capacity, expert by expert
            Cc = -(-C // degree) if C else 0
            piece = El_dest * Cc  # rows of one chunk of one source: [El_dest][Cc]
            sm = pipelined_capacity_slots(r, C, E, S, degree, El)
            send, weights = self._dispatch(x_c, r, sm, S)
            send_splits = recv_splits = [degree * El_dest * Cc] * W
            blocks = [[degree * Cc] * El_dest for _ in range(W)]
            seg = Segments.uniform_blocks(W, El_dest, degree * Cc)
        else:
            sm = dropless_slots(r, S, 1)
            piece = 0  # no fixed layout: each chunk is regrouped from its counts
            send, weights = self._dispatch(x_c, r, sm, S)
            n = r.counts  # [E] routes per expert (all kept)
            send_cnt = n if S == 1 else n.repeat_interleave(S)  # rank e*S+s gets expert e's rows
            recv_cnt = _comm.all_to_all_nograd(send_cnt.contiguous(), comm, [El_dest] * W, [El_dest] * W)
            host = torch.cat([send_cnt, recv_cnt]).tolist()  # the one host sync of a dropless step
            mine, got = host[:W * El_dest], host[W * El_dest:]
            send_splits = [sum(mine[w * El_dest:(w + 1) * El_dest]) for w in range(W)]
            blocks = [got[w * El_dest:(w + 1) * El_dest] for w in range(W)]
            recv_splits = [sum(b) for b in blocks]
            seg = Segments(blocks, El_dest, counts_dev=recv_cnt.view(W, El_dest))

        if degree == 1 and not own_first:
            got_rows = _comm.all_to_all(send, comm, send_splits, recv_splits, algo) if wire is None else \
                _wire.all_to_all_wire(send, comm, send_splits, recv_splits, algo, wire, self.grad_wire_dtype)
            y = self._run_experts(got_rows, seg)
            back = _comm.all_to_all(y.contiguous(), comm, recv_splits, send_splits, algo)
        else:
            wgrad_sum = WeightGradSum()  # the stages' weight gradients summed inside the GEMMs

            def fn(rows: Tensor, chunk) -> Tensor:
                if piece and all(n % piece == 0 for n in chunk.source_splits):
                    # the capacity layout: every source's rows here are whole [El_dest][Cc] pieces
                    nb = sum(chunk.source_splits) // piece
                    return self._run_experts(rows, Segments.uniform_blocks(nb, El_dest, Cc, wgrad_sum))
                return self._run_experts(rows, Segments(chunk.group_splits(blocks), El_dest, wgrad_sum=wgrad_sum))

            if wire is not None and W > 1 and self.grad_wire_dtype not in (None, cdtype):
                raise ValueError(f"wire_dtype with overlap_degree={degree} or own_first sends the dispatch gradient "
                                 f"in the activation dtype {cdtype}: pass grad_wire_dtype=None (or {cdtype}), got "
                                 f"{self.grad_wire_dtype}")
            back = _comm.scatter_compute_gather(comm, send, send_splits, recv_splits, fn, degree, algo, own_first,
                                                wire if W > 1 else None)  # one rank: nothing travels
        return self._combine(back, sm, weights)

    # -- data-parallel path -----------------------------------------------------------------

    def _data_parallel(self, x_c: Tensor, r: Routing, cdtype) -> Tensor:
        E = self.num_experts
        ex: FFNExperts = self.experts  # type: ignore[assignment]
        if r.capacity is None:
            sm = dropless_slots(r, 1, 1)
            counts = r.counts.view(1, E)
            seg = Segments([counts[0].tolist()], E, counts_dev=counts)
        else:
            sm = capacity_slots(r, r.capacity, E, 1, 1)
            seg = Segments.uniform_blocks(1, E, r.capacity)
        send, weights = self._dispatch(x_c, r, sm, 1)
        spec = ex.checkpoint_spec()
        names = ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
        params = ex.params(cdtype)
        specs = [spec.get(nm, (0, None, False)) for nm in names]
        w1, b1, w2, b2 = gather_expert_params(self.comm, specs, self.shards, params)
        y = FFNExperts.run(send, seg, w1, b1, w2, b2, ex.act, 1.0)
        return self._combine(y, sm, weights)

    # -- auto mode ------------------------------------------------------------------------------

    def _auto_choice(self, key) -> str:
        st = self._auto.get(key)
        if st is None:
            st = self._auto[key] = {"times": {"expert": [], "data": []}, "choice": None}
        if st["choice"] is not None:
            return st["choice"]
        t = st["times"]
        return "trial:expert" if len(t["expert"]) <= len(t["data"]) else "trial:data"

    def _timed(self, trial: str, key, x_c, r, deg, own, algo, cdtype, wire=None) -> Tensor:
        mode = trial.split(":", 1)[1]
        sync = torch.cuda.synchronize if x_c.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        y = self._expert_parallel(x_c, r, deg, own, algo, cdtype, wire) if mode == "expert" else \
            self._data_parallel(x_c, r, cdtype)
        sync()
        dt = time.perf_counter() - t0
        st = self._auto[key]
        st["times"][mode].append(dt)
        te, td = st["times"]["expert"], st["times"]["data"]
        if len(te) >= self.auto_trials and len(td) >= self.auto_trials:
            # the first trial of each is a warm-up; ranks agree on the slowest rank's medians
            med = [sorted(v[1:])[len(v[1:]) // 2] for v in (te, td)]
            agreed = torch.tensor(med, dtype=torch.float64, device=self.comm.device)
            if self.comm.size > 1:
                self.comm.allreduce(agreed, "max")
            me, md = agreed.tolist()
            st["choice"] = "expert" if me <= md else "data"
            st["measured_s"] = {"expert": me, "data": md}
        self.last_parallel_mode = mode
        return y

    def auto_decisions(self) -> dict:
        """What ``parallel_mode='auto'`` chose per call shape: ``{key: (choice, measured seconds)}``."""
        return {k: (v["choice"], v.get("measured_s")) for k, v in self._auto.items()}

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, num_experts={self.num_experts}, k={self.k}, "
                f"capacity_factor={self.capacity_factor}, dropless={self.dropless}, world={self.comm.size}, "
                f"local_experts={self.num_local_experts}, shards={self.shards}, parallel_mode={self.parallel_mode}")
