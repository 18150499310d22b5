"""The MoE layer's routing step: the gate, the top-k routing, the auxiliary losses and the
capacity of one call (a part of :class:`~moecomm.moe.MoELayer`, which inherits it)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .agreement import agree
from .._ops import comm as _comm
from .._ops.args import float_arg
from .._ops.step_cache import StepConstants
from ..config import MoEConfig, check_groups
from ..gates import TopKGate
from ..losses import gshard_loss, load_importance_loss, router_z_loss
from ..routing import Routing, fixed_capacity, route, top_k
from ..scoring import RouterOptions, loss_scores, select_experts, seq_switch_loss, switch_loss, updated_expert_bias

__all__ = ["RoutingStep"]

_AGREED_KEPT = 64  # local token counts whose agreed count is remembered for CUDA graph capture


def _router_reason(cfg: MoEConfig) -> Optional[str]:
    """None when ``cfg``'s router is Tutel's (softmax, top-k, renormalised or not: the one the
    fused step implements), else the option that is not, with its value."""
    for name, default in (("score_function", "softmax"), ("pre_softmax", True), ("topk_scaling_factor", None),
                          ("expert_bias", False), ("num_groups", None), ("balance_loss_weight", 1.0),
                          ("seq_aux_loss_weight", 0.0)):
        value = getattr(cfg, name)
        if value != default:
            return f"{name}={value!r} (the fused step routes by softmax top-k, with the unweighted GShard loss)"
    return None


class RoutingStep:
    """Routing, losses and capacity of :class:`~moecomm.moe.MoELayer` (a mixin: it uses the
    layer's ``comm``, ``num_experts``, routing options and ``training``, and sets
    ``aux_loss``, ``balance_loss`` and the z-loss of the call)."""

    comm: Any
    num_experts: int
    training: bool
    batch_prioritized_routing: bool
    normalize_gate: bool
    balance_loss_type: Optional[str]
    z_loss_weight: float
    aux_loss: Optional[Tensor]
    balance_loss: Optional[Tensor]
    _z_loss: Optional[Tensor]
    _z_logits: Optional[Tensor]
    _agreed: dict
    _call_settings: tuple
    _consts: StepConstants
    router_options: RouterOptions
    expert_bias: Optional[Tensor]
    tokens_per_expert: Optional[Tensor]
    balance_loss_weight: float
    seq_aux_loss_weight: float
    seq_aux_loss: Optional[Tensor]
    seq_dim: int
    _router_reason: Optional[str]

    def _setup_router(self, cfg: MoEConfig, device: torch.device) -> None:
        """The routing options of ``cfg``, and the expert bias with its load counter."""
        self.router_options = RouterOptions(cfg.score_function, cfg.pre_softmax, cfg.normalize_gate,
                                            cfg.topk_scaling_factor, cfg.num_groups, cfg.group_topk)
        self.balance_loss_weight, self.seq_aux_loss_weight = cfg.balance_loss_weight, cfg.seq_aux_loss_weight
        self.seq_dim = cfg.seq_dim
        self.seq_aux_loss = None
        E = cfg.num_experts
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32, device=device))
            self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32, device=device),
                                 persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None
        self._router_reason = _router_reason(cfg)

    @torch.no_grad()
    def update_expert_bias(self, rate: float, *, allreduce: bool = True) -> Tensor:
        """Aux-loss-free balancing (DeepSeek-V3; Megatron-core's ``get_updated_expert_bias``):
        ``expert_bias += rate * sign(mean(n) - n)`` where ``n`` (``[E]``) counts the routes each
        expert got (before capacity drops) in the training forwards since the last update,
        summed over the layer's ranks (one ``allreduce`` of ``E`` floats, on the device: no host
        sync; ``allreduce=False``: this rank's counts only); then ``n`` restarts from zero.
        Call it once per optimizer step (after the backward). Returns ``expert_bias`` ``[E]``
        float32 (a buffer: saved in ``state_dict``).

        Raises:
            RuntimeError: the layer was built without ``expert_bias=True``.
            TypeError, ValueError: ``rate`` is not a finite number.
        """
        rate = float_arg("rate", rate)
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias: the layer has no expert bias (build it with expert_bias=True)")
        n = self.tokens_per_expert
        if allreduce:
            _comm.allreduce_sum_(self.comm, n)
        new = updated_expert_bias(self.expert_bias.float(), n, rate)
        if self.expert_bias.dtype == torch.float32:
            self.expert_bias.copy_(new)  # in place: a captured CUDA graph reads this storage
        else:  # cast by layer.to(dtype): back to float32, where rate-sized steps are not lost
            self.expert_bias.data = new
        n.zero_()
        return self.expert_bias

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

    def _route(self, x2: Tensor, gate: TopKGate, k: int, lead: tuple = (), positions: bool = True) -> Routing:
        """Route the ``[T, model_dim]`` tokens (scores in float32 at least) and set the call's
        losses; ``lead``: the input's shape before ``model_dim`` (for the sequence-level loss).
        ``positions=False`` (the routed fused step, which places the routes itself and counts
        the expert load): only the choice, ``locations`` and ``counts`` None, and the
        expert-bias load counter left alone."""
        logits = gate(x2)
        sdtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logits = logits.to(sdtype)
        if self.training and gate.gate_noise > 0:
            noisy = logits + gate.gate_noise * torch.randn_like(logits) / self.num_experts
        else:
            noisy = logits
        cc = self._consts
        opts = self.router_options
        if opts.plain and self.expert_bias is None:
            scores = F.softmax(noisy, dim=1)
            if not positions:
                gates, idx = top_k(scores, k, self.normalize_gate)
                r = Routing(topk_idx=idx, gates=gates, locations=None, counts=None)
            else:
                r = route(scores, k, batch_prioritized=self.batch_prioritized_routing, normalize=self.normalize_gate,
                          consts=cc)
        else:
            if opts.num_groups is not None and k != self.k:
                check_groups(k, self.num_experts, opts.num_groups, opts.group_topk)
            bias = self.expert_bias
            selected = select_experts(noisy, k, opts, None if bias is None else bias.float())
            # the probabilities for the losses and the batch priority; route() reads only the shape otherwise
            need = (self.balance_loss_type is not None or self.seq_aux_loss_weight != 0
                    or self.batch_prioritized_routing)
            scores = loss_scores(noisy, opts.score_function) if need else noisy
            if not positions:
                r = Routing(topk_idx=selected[1], gates=selected[0], locations=None, counts=None)
            else:
                r = route(scores, k, batch_prioritized=self.batch_prioritized_routing, consts=cc, selected=selected)
                self._count_expert_load(r.counts)

        if self.balance_loss_type == "gshard":
            bal = gshard_loss(scores, r.topk_idx[:, 0], cc.ones(scores.shape[0], scores.dtype, scores.device))
        elif self.balance_loss_type == "switch":
            bal = switch_loss(scores, k)
        elif self.balance_loss_type == "load_importance":
            bal = load_importance_loss(F.softmax(logits, dim=1), noisy, r.topk_idx, gate.gate_noise)
        else:
            bal = None
        w = self.balance_loss_weight
        aux = None if bal is None else (bal if w == 1.0 else bal * w)
        seq = None
        if self.seq_aux_loss_weight != 0:
            seq = seq_switch_loss(self._by_sequence(scores, lead), k)
            aux = seq * self.seq_aux_loss_weight if aux is None else aux + seq * self.seq_aux_loss_weight
        if self.z_loss_weight != 0:
            z = router_z_loss(logits)
            aux = z * self.z_loss_weight if aux is None else aux + z * self.z_loss_weight
            z_logits = None
        else:  # not part of the loss: computed (without a graph) only if someone reads layer.z_loss
            aux = aux if aux is not None else logits.new_zeros(())
            z, z_logits = None, logits.detach()
        # plain attributes (none is a parameter, buffer or module): skip nn.Module.__setattr__'s lookups
        d = self.__dict__
        d["seq_aux_loss"] = seq
        d["_z_logits"], d["_z_loss"], d["balance_loss"], d["aux_loss"] = z_logits, z, bal, aux
        return r

    def _count_expert_load(self, counts: Tensor) -> None:
        """Add a training call's routes per expert (``[E]``) to the expert-bias load counter."""
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            n = self.tokens_per_expert
            if n.dtype != torch.float32:  # cast by layer.to(dtype): counts past 256 are not exact in bf16
                n.data = n.data.float()
            n.add_(counts)

    def _by_sequence(self, scores: Tensor, lead: tuple) -> Tensor:
        """``[T, E]`` scores as ``[S, B, E]``: ``B`` sequences of ``S`` tokens, from the input's
        leading shape ``[S, B]`` (``seq_dim=0``, Megatron-core's layout) or ``[B, S]``
        (``seq_dim=1``); a 1-D or 0-D leading shape is one sequence."""
        E = scores.shape[1]
        if len(lead) <= 1:
            return scores.view(-1, 1, E)
        if len(lead) != 2:
            raise ValueError(f"seq_aux_loss_weight != 0 needs x as [seq, batch, model_dim] (seq_dim=0) or "
                             f"[batch, seq, model_dim] (seq_dim=1), got x with leading shape {tuple(lead)}")
        if self.seq_dim == 0:
            return scores.view(lead[0], lead[1], E)
        return scores.view(lead[0], lead[1], E).transpose(0, 1)

    def _capacity(self, r: Routing, T: int, k: int, cf: float, ineq: bool) -> int:
        """Slots per expert and source rank: fixed (``cf > 0``) or the busiest expert's load over
        all ranks (one ``allreduce``), bounded by ``|cf|`` times the fixed one when ``cf < 0``."""
        E = self.num_experts
        if cf > 0:
            return fixed_capacity(self._step_tokens(T, r.topk_idx.device, ineq), E, k, cf)
        busiest = int(r.counts.max()) if T else 0
        need, t = (busiest, T) if self.comm.size == 1 else agree(self.comm, busiest, T, T, self._call_settings, False)
        if cf < 0:  # the bound uses the largest token count of any rank, so that ranks agree
            need = min(need, fixed_capacity(t, E, k, cf))
        return need

    def _step_tokens(self, T: int, device: torch.device, ineq: bool) -> int:
        """The token count the capacity is computed from: the largest of any rank
        (``inequivalent_tokens``), else ``T`` after checking that every rank has ``T`` (with
        the call's settings, in one agreement; not while a CUDA graph is captured)."""
        if ineq:
            return self._agreed_tokens(T, device)
        if self.comm.size > 1 and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            agree(self.comm, T, 0, T, self._call_settings, True)
        return T

    def _agree_settings_once(self, device: torch.device) -> None:
        """Check the call's settings with every rank, once for each settings tuple (the dropless
        step has no host agreement of its own to carry the check)."""
        settings = self._call_settings
        done = self.__dict__.setdefault("_settings_agreed", set())
        if self.comm.size == 1 or settings in done or (
                device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        agree(self.comm, 0, 0, 0, settings, False)
        if len(done) >= _AGREED_KEPT:
            done.clear()
        done.add(settings)

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
        agreed = agree(self.comm, T, 0, T, self._call_settings, False)[0]
        if T not in self._agreed and len(self._agreed) >= _AGREED_KEPT:
            self._agreed.pop(next(iter(self._agreed)))
        self._agreed[T] = agreed
        return agreed
