"""A dense, token-by-token MoE reference in plain torch (float64), written independently of
``moecomm.moe``'s code paths: python loops over tokens and choices, no slot maps, no
all-to-all. It sees every rank's tokens at once and routes each rank's batch separately
(capacities are per source rank, as in the layer)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F


@dataclass
class RefParams:
    gate_type: str  # "linear" | "cosine"
    gate: dict  # linear: wg [E, D]; cosine: proj_w [P, D], proj_b [P], sim [P, E], temp [1]
    w1: torch.Tensor  # [E, D, H]
    b1: Optional[torch.Tensor]  # [E, H]
    w2: torch.Tensor  # [E, H, Do]
    b2: Optional[torch.Tensor]  # [E, Do]
    act: Callable = F.relu
    w3: Optional[torch.Tensor] = None  # [E, D, H]: gated experts, act(v W1 + b1) * (v W3 + b3)
    b3: Optional[torch.Tensor] = None  # [E, H]

    def leaves(self) -> list:
        out = list(self.gate.values()) + [self.w1, self.w2]
        out += [t for t in (self.b1, self.b2, self.w3, self.b3) if t is not None]
        return out


def random_params(seed: int, gate_type: str, D: int, H: int, E: int, Do: Optional[int] = None, *,
                  bias1: bool = True, bias2: bool = True, proj_dim: int = 8, act=F.relu,
                  gated: bool = False) -> RefParams:
    """Random reference parameters; ``gated``: also ``w3`` (and ``b3`` with ``bias1``), and
    ``act`` is the gate's function (SiLU for SwiGLU)."""
    g = torch.Generator().manual_seed(seed)
    Do = D if Do is None else Do

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_(True)

    if gate_type == "linear":
        gate = {"wg": rnd(E, D, scale=1.0 / math.sqrt(D))}
    else:
        gate = {"proj_w": rnd(proj_dim, D, scale=1.0 / math.sqrt(D)), "proj_b": rnd(proj_dim, scale=0.1),
                "sim": rnd(proj_dim, E), "temp": torch.tensor([math.log(4.0)], dtype=torch.float64,
                                                              requires_grad=True)}
    p = RefParams(gate_type, gate, rnd(E, D, H, scale=1.0 / math.sqrt(D)),
                  rnd(E, H, scale=0.1) if bias1 else None,
                  rnd(E, H, Do, scale=1.0 / math.sqrt(H)), rnd(E, Do, scale=0.1) if bias2 else None, act)
    if gated:  # drawn after the others, which stay as they were
        p.w3 = rnd(E, D, H, scale=1.0 / math.sqrt(D))
        p.b3 = rnd(E, H, scale=0.1) if bias1 else None
    return p


def ref_logits(p: RefParams, x: torch.Tensor) -> torch.Tensor:
    if p.gate_type == "linear":
        return x @ p.gate["wg"].t()
    proj = x @ p.gate["proj_w"].t() + p.gate["proj_b"]
    proj = proj / proj.norm(dim=1, keepdim=True).clamp(min=1e-12)
    sim = p.gate["sim"] / p.gate["sim"].norm(dim=0, keepdim=True).clamp(min=1e-12)
    return (proj @ sim) * torch.clamp(p.gate["temp"], max=math.log(100.0)).exp()


def expert(p: RefParams, e: int, v: torch.Tensor) -> torch.Tensor:
    h = v @ p.w1[e]
    if p.b1 is not None:
        h = h + p.b1[e]
    a = p.act(h)
    if p.w3 is not None:
        a = a * (v @ p.w3[e] + (p.b3[e] if p.b3 is not None else 0.0))
    out = a @ p.w2[e]
    if p.b2 is not None:
        out = out + p.b2[e]
    return out


@dataclass
class RefRouter:
    """Router options (the layer's names) for :func:`reference`; ``bias``: ``[E]`` or None."""

    score_function: str = "softmax"
    pre_softmax: bool = True
    scaling: Optional[float] = None
    bias: Optional[torch.Tensor] = None
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    balance_weight: float = 1.0
    seq_weight: float = 0.0


@dataclass
class RefShared:
    """A shared expert: ``w1`` ``[F or 2F, D]`` (gated: ``[:F]`` through ``act``), ``w2``
    ``[Do, F]``, ``gate`` ``[1, D]`` or None."""

    w1: torch.Tensor
    w2: torch.Tensor
    gate: Optional[torch.Tensor]
    act: Callable
    gated: bool

    def leaves(self) -> list:
        return [self.w1, self.w2] + ([self.gate] if self.gate is not None else [])

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        h = self.w1 @ v
        if self.gated:
            f = h.shape[0] // 2
            h = self.act(h[:f]) * h[f:]
        else:
            h = self.act(h)
        out = self.w2 @ h
        if self.gate is not None:
            out = out * torch.sigmoid((self.gate @ v)[0])
        return out


def elementwise_scores(l: torch.Tensor, fn: str) -> torch.Tensor:
    """One token's ``[E]`` scores: softmax over the experts, or sigmoid / sqrt(softplus) each."""
    if fn == "softmax":
        e = torch.exp(l - l.max())
        return e / e.sum()
    if fn == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-l))
    return torch.sqrt(torch.log1p(torch.exp(l)))


def route_token(l: torch.Tensor, k: int, o: RefRouter, normalize: bool) -> tuple:
    """One token's ``(choices [k], gates [k])`` from its ``[E]`` logits: the experts ranked by
    the (biased) selection score inside the best groups, then the gate weights."""
    E = l.shape[0]
    fn = o.score_function
    s = elementwise_scores(l, fn)
    post = fn == "softmax" and not o.pre_softmax
    sel = [float(v) for v in (l if post else s).detach()]
    if o.bias is not None:
        sel = [v + float(b) for v, b in zip(sel, o.bias)]
    allowed = list(range(E))
    if o.num_groups is not None:
        per = E // o.num_groups
        gscore = []
        for gi in range(o.num_groups):
            vals = sorted((sel[e] for e in range(gi * per, (gi + 1) * per)), reverse=True)
            gscore.append(sum(vals[:k // o.group_topk]))
        best = sorted(range(o.num_groups), key=lambda gi: (-gscore[gi], gi))[:o.group_topk]
        allowed = [e for e in range(E) if e // per in best]
    choices = sorted(allowed, key=lambda e: (-sel[e], e))[:k]
    if post:
        ex = [torch.exp(l[e] - max(l[c] for c in choices)) for e in choices]
        tot = sum(ex)
        g = [v / tot for v in ex]
    else:
        g = [s[e] for e in choices]
        if normalize and k > 1:
            tot = sum(g)
            g = [v / tot for v in g]
    if o.scaling is not None:
        g = [v * o.scaling for v in g]
    return choices, g


def switch_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """E / (k T^2) sum_e (sum_t scores[t, e]) * #{t: e in the top-k of scores[t]}."""
    T, E = scores.shape
    if T == 0:
        return scores.sum() * 0
    n = [0] * E
    for t in range(T):
        for e in sorted(range(E), key=lambda e: (-float(scores[t, e].detach()), e))[:k]:
            n[e] += 1
    return sum(scores[:, e].sum() * n[e] for e in range(E)) * E / (k * T * T)


@dataclass
class RefResult:
    y: torch.Tensor
    aux: torch.Tensor
    balance: Optional[torch.Tensor]
    z: torch.Tensor
    topk: list  # [T][k] experts
    kept: list  # [T][k] bools
    capacity: Optional[int]
    extra: dict = field(default_factory=dict)


def reference(p: RefParams, xs: list, *, k: int, capacity_factor: float, dropless: bool = False,
              normalize: bool = True, batch_prioritized: bool = False, postscore: bool = True,
              balance_loss: Optional[str] = "gshard", z_weight: float = 0.0, noise: Optional[list] = None,
              gate_noise: float = 0.0, inequivalent: bool = False, router: Optional[RefRouter] = None,
              shared: Optional[RefShared] = None, seqs: Optional[list] = None) -> list:
    """One :class:`RefResult` per rank. ``noise[r]``: the ``[T_r, E]`` standard normals the layer
    drew. ``router``: non-default router options; ``shared``: a shared expert; ``seqs[r]``: the
    sequences of rank ``r`` as lists of token indices (default: one sequence of all)."""
    E = p.w1.shape[0]
    logits_all, scores_all, choices_all = [], [], []
    for r, x in enumerate(xs):
        logits = ref_logits(p, x)
        noisy = logits if noise is None else logits + gate_noise * noise[r] / E
        T = x.shape[0]
        choices = []
        if router is None:
            scores = torch.softmax(noisy, dim=1)
            for t in range(T):
                sd = scores.detach()
                ranked = sorted(range(E), key=lambda e: (-float(sd[t, e]), e))
                choices.append(ranked[:k])
        else:
            rows = [elementwise_scores(noisy[t], router.score_function) for t in range(T)]
            if router.score_function != "softmax":
                rows = [v / (v.sum() + 1e-20) for v in rows]
            scores = torch.stack(rows) if rows else noisy * 0
            gates_r = []
            for t in range(T):
                c, g = route_token(noisy[t], k, router, normalize)
                choices.append(c)
                gates_r.append(g)
            choices = (choices, gates_r)
        logits_all.append((logits, noisy))
        scores_all.append(scores)
        choices_all.append(choices)

    # per-expert route counts per rank (for capacity_factor <= 0: the busiest expert anywhere)
    busiest = 0
    gates_all = []
    for i, ch in enumerate(choices_all):
        if isinstance(ch, tuple):
            choices_all[i], g = ch
            gates_all.append(g)
        else:
            gates_all.append(None)
    for choices in choices_all:
        cnt = [0] * E
        for ch in choices:
            for e in ch:
                cnt[e] += 1
        busiest = max(busiest, max(cnt) if choices else 0)
    t_max = max(x.shape[0] for x in xs)

    out = []
    for r, x in enumerate(xs):
        T = x.shape[0]
        scores, choices = scores_all[r], choices_all[r]
        logits, noisy = logits_all[r]
        t_cap = t_max if inequivalent else T
        fixed = k * int(abs(capacity_factor) * ((t_cap + E - 1) // E))
        if dropless:
            cap = None
        elif capacity_factor > 0:
            cap = fixed
        elif capacity_factor == 0:
            cap = busiest
        else:  # bounded by the fixed capacity of the largest batch of any rank
            cap = min(busiest, k * int(abs(capacity_factor) * ((t_max + E - 1) // E)))
        if batch_prioritized:
            order = sorted(range(T), key=lambda t: (-float(scores[t].detach().max()), t))
        else:
            order = list(range(T))
        used = [0] * E
        kept = [[False] * k for _ in range(T)]
        for j in range(k):
            for t in order:
                e = choices[t][j]
                kept[t][j] = cap is None or used[e] < cap
                used[e] += 1
        rows = []
        for t in range(T):
            if gates_all[r] is not None:
                g = gates_all[r][t]
            else:
                g = [scores[t, e] for e in choices[t]]
                if normalize and k > 1:
                    s = sum(g)
                    g = [gi / s for gi in g]
            acc = torch.zeros(p.w2.shape[2], dtype=x.dtype)
            if shared is not None:
                acc = acc + shared(x[t])
            for j, e in enumerate(choices[t]):
                if not kept[t][j]:
                    continue
                if postscore:
                    acc = acc + g[j] * expert(p, e, x[t])
                else:
                    acc = acc + expert(p, e, g[j] * x[t])
            rows.append(acc)
        y = torch.stack(rows) if rows else torch.zeros(0, p.w2.shape[2], dtype=x.dtype)
        # auxiliary losses
        if balance_loss == "gshard":
            if T:
                me = scores.sum(0)
                ce = torch.tensor([sum(1 for t in range(T) if choices[t][0] == e) for e in range(E)],
                                  dtype=scores.dtype)
                bal = (me * ce).sum() * E / (T * T)
            else:
                bal = scores.sum() * 0
        elif balance_loss == "load_importance":
            clean = torch.softmax(logits, dim=1)
            imp = clean.sum(0)
            l_imp = imp.var() / (imp.mean() ** 2 + 1e-10)
            kth = torch.stack([noisy[t, choices[t][-1]] for t in range(T)]).view(T, 1)
            normal = torch.distributions.Normal(0.0, gate_noise / E)
            load = normal.cdf(clean - kth).sum(0)
            l_load = load.var() / (load.mean() ** 2 + 1e-10)
            bal = (l_imp + l_load) / 2
        elif balance_loss == "switch":
            bal = switch_ref(scores, k)
        else:
            bal = None
        z = (torch.logsumexp(logits, dim=1) ** 2).mean() if T else logits.sum() * 0
        aux = z * z_weight if bal is None else bal * (router.balance_weight if router else 1.0) + z * z_weight
        if router is not None and router.seq_weight:
            groups = seqs[r] if seqs is not None else [list(range(T))]
            parts = [switch_ref(scores[torch.tensor(ix, dtype=torch.int64)], k) for ix in groups if ix]
            seq = sum(parts) / len(groups) if parts else scores.sum() * 0
            aux = aux + router.seq_weight * seq
        out.append(RefResult(y, aux, bal, z, choices, kept, cap))
    return out
