"""The MoE layer's routing step: the gate, the top-k routing, the auxiliary losses and the
capacity of one call (a part of :class:`~moecomm.moe.MoELayer`, which inherits it)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .agreement import agree
from .._ops.step_cache import StepConstants
from ..gates import TopKGate
from ..losses import gshard_loss, load_importance_loss, router_z_loss
from ..routing import Routing, fixed_capacity, route

__all__ = ["RoutingStep"]

_AGREED_KEPT = 64  # local token counts whose agreed count is remembered for CUDA graph capture


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

    def _route(self, x2: Tensor, gate: TopKGate, k: int) -> Routing:
        """Route the ``[T, model_dim]`` tokens (scores in float32 at least) and set the call's losses."""
        logits = gate(x2)
        sdtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logits = logits.to(sdtype)
        if self.training and gate.gate_noise > 0:
            noisy = logits + gate.gate_noise * torch.randn_like(logits) / self.num_experts
        else:
            noisy = logits
        scores = F.softmax(noisy, dim=1)
        cc = self._consts
        r = route(scores, k, batch_prioritized=self.batch_prioritized_routing, normalize=self.normalize_gate,
                  consts=cc)

        if self.balance_loss_type == "gshard":
            bal = gshard_loss(scores, r.topk_idx[:, 0], cc.ones(scores.shape[0], scores.dtype, scores.device))
        elif self.balance_loss_type == "load_importance":
            bal = load_importance_loss(F.softmax(logits, dim=1), noisy, r.topk_idx, gate.gate_noise)
        else:
            bal = None
        if self.z_loss_weight != 0:
            z = router_z_loss(logits)
            aux = z * self.z_loss_weight if bal is None else bal + z * self.z_loss_weight
            z_logits = None
        else:  # not part of the loss: computed (without a graph) only if someone reads layer.z_loss
            aux = bal if bal is not None else logits.new_zeros(())
            z, z_logits = None, logits.detach()
        # plain attributes (none is a parameter, buffer or module): skip nn.Module.__setattr__'s lookups
        d = self.__dict__
        d["_z_logits"], d["_z_loss"], d["balance_loss"], d["aux_loss"] = z_logits, z, bal, aux
        return r

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
