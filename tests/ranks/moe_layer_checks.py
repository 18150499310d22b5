"""MoELayer against the dense reference on real MPI ranks (run by tests/test_moe_layer.py).

``python -m tests.ranks.moe_layer_checks [GROUP]``: every case of the group on every rank;
each case's result is checked collectively (all ranks fail together).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from mpi4py import MPI

import moecomm
from moecomm.graphs import capture
from moecomm.moe import MoELayer
from tests.mpi_util import collective_assert, rank_main
from tests.ranks.moe_reference import RefParams, RefRouter, RefShared, random_params, reference

WORLD = MPI.COMM_WORLD
D, H = 8, 12
DEV = torch.device("cpu")  # "cuda" as the 2nd argument: NCCL ranks on GPUs, float32 layers
DT = torch.float64
TOL = 1e-9


@dataclass
class Case:
    name: str
    E: int
    k: int = 2
    cf: float = 1.0
    gate: str = "linear"
    dropless: bool = False
    tokens: Optional[list] = None  # per rank; default 10 + small spread where allowed
    layer_kw: dict = field(default_factory=dict)
    call_kw: dict = field(default_factory=dict)
    ref_kw: dict = field(default_factory=dict)
    experts: str = "ffn"  # ffn | batched | factory
    noise: float = 0.0
    calls: int = 1
    schedule: Optional[list] = None  # per call, the token count of every rank (overrides tokens)


# the reference's own activations (written here, not taken from moecomm): name -> function
# (for the gated names, the gate's function: the reference adds the linear unit itself)
REF_ACTS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "swiglu": lambda h: h * torch.sigmoid(h),
            "geglu": lambda h: 0.5 * h * (1.0 + torch.erf(h / 2 ** 0.5))}
GATED = ("swiglu", "geglu")


def _comm():
    if not hasattr(_comm, "c"):
        _comm.c = moecomm.init(backend="mpi" if DEV.type == "cpu" else "auto")
    return _comm.c


def token_counts(case: Case, W: int) -> list:
    if case.tokens is not None:
        return [case.tokens[r % len(case.tokens)] for r in range(W)]
    return [11] * W


def make_inputs(seed: int, counts: list) -> list:
    out = []
    for r, T in enumerate(counts):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        out.append(torch.randn(T, D, generator=g, dtype=torch.float64))
    return out


class BatchedFFN(torch.nn.Module):
    """A user expert module in Tutel's batched convention: [El, N, D] -> [El, N, D]."""

    def __init__(self, El: int):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.zeros(El, D, H, dtype=DT, device=DEV))
        self.b1 = torch.nn.Parameter(torch.zeros(El, 1, H, dtype=DT, device=DEV))
        self.w2 = torch.nn.Parameter(torch.zeros(El, H, D, dtype=DT, device=DEV))
        self.b2 = torch.nn.Parameter(torch.zeros(El, 1, D, dtype=DT, device=DEV))

    def forward(self, x):
        return torch.bmm(F.relu(torch.bmm(x, self.w1) + self.b1), self.w2) + self.b2


def factory(e: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(D, H, dtype=DT, device=DEV), torch.nn.ReLU(),
                               torch.nn.Linear(H, D, dtype=DT, device=DEV))


def load_params(layer: MoELayer, p: RefParams, case: Case) -> None:
    with torch.no_grad():
        g = layer.gates[0]
        if p.gate_type == "linear":
            g.wg.weight.copy_(p.gate["wg"])
        else:
            g.cosine_projector.weight.copy_(p.gate["proj_w"])
            g.cosine_projector.bias.copy_(p.gate["proj_b"])
            g.sim_matrix.copy_(p.gate["sim"])
            g.temperature.copy_(p.gate["temp"])
        e0, El, S, s = layer.first_expert, layer.num_local_experts, layer.shards, layer.shard_index
        Hl = H // S
        hs = slice(s * Hl, (s + 1) * Hl)
        es = slice(e0, e0 + El)
        if case.experts == "ffn":
            ex = layer.experts
            ex.fc2_weight.copy_(p.w2[es, hs])
            if ex.gated:  # fc1_weight [El, D, 2, Hl]: W1 then W3
                ex.fc1_weight.copy_(torch.stack([p.w1[es, :, hs], p.w3[es, :, hs]], dim=2))
                if ex.fc1_bias is not None:
                    ex.fc1_bias.copy_(torch.stack([p.b1[es, hs], p.b3[es, hs]], dim=1))
            else:
                ex.fc1_weight.copy_(p.w1[es, :, hs])
                if ex.fc1_bias is not None:
                    ex.fc1_bias.copy_(p.b1[es, hs])
            if ex.fc2_bias is not None:
                ex.fc2_bias.copy_(p.b2[es])
        elif case.experts == "batched":
            m = layer.experts.module
            m.w1.copy_(p.w1[es]); m.b1.copy_(p.b1[es].unsqueeze(1))
            m.w2.copy_(p.w2[es]); m.b2.copy_(p.b2[es].unsqueeze(1))
        else:
            for i, mod in enumerate(layer.experts.local):
                mod[0].weight.copy_(p.w1[e0 + i].t()); mod[0].bias.copy_(p.b1[e0 + i])
                mod[2].weight.copy_(p.w2[e0 + i].t()); mod[2].bias.copy_(p.b2[e0 + i])


def expert_grads(layer: MoELayer, case: Case) -> dict:
    if case.experts == "ffn":
        ex = layer.experts
        out = {"w2": ex.fc2_weight.grad}
        if ex.gated:
            out["w1"], out["w3"] = ex.fc1_weight.grad.unbind(2)
            if ex.fc1_bias is not None:
                out["b1"], out["b3"] = ex.fc1_bias.grad.unbind(1)
        else:
            out["w1"] = ex.fc1_weight.grad
            if ex.fc1_bias is not None:
                out["b1"] = ex.fc1_bias.grad
        if ex.fc2_bias is not None:
            out["b2"] = ex.fc2_bias.grad
        return out
    if case.experts == "batched":
        m = layer.experts.module
        return {"w1": m.w1.grad, "b1": m.b1.grad.squeeze(1), "w2": m.w2.grad, "b2": m.b2.grad.squeeze(1)}
    mods = layer.experts.local
    return {"w1": torch.stack([m[0].weight.grad.t() for m in mods]), "b1": torch.stack([m[0].bias.grad for m in mods]),
            "w2": torch.stack([m[2].weight.grad.t() for m in mods]), "b2": torch.stack([m[2].bias.grad for m in mods])}


def gate_grads(layer: MoELayer, p: RefParams) -> dict:
    g = layer.gates[0]
    if p.gate_type == "linear":
        return {"wg": g.wg.weight.grad}
    return {"proj_w": g.cosine_projector.weight.grad, "proj_b": g.cosine_projector.bias.grad,
            "sim": g.sim_matrix.grad, "temp": g.temperature.grad}


def grad_of(t: torch.Tensor) -> torch.Tensor:
    """The reference's gradient (None, where no token reached the tensor, is zero)."""
    return torch.zeros_like(t) if t.grad is None else t.grad


def close(name: str, got, want, tol: float, errs: list) -> None:
    if got is None and want is not None and not bool(want.any()):
        return  # no gradient reached it: None is torch's zero gradient
    if got is None or want is None:
        if not (got is None and want is None):
            errs.append(f"{name}: one of got/want is None ({got is None}, {want is None})")
        return
    got = got.detach().cpu().double()
    want = want.detach().double()
    if got.shape != want.shape:
        errs.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    if got.numel() == 0:
        return
    err = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    if not err <= tol * scale:
        errs.append(f"{name}: max abs err {err:.3g} > {tol:g} * {scale:.3g}")


def _agrees_on_tokens(case: Case, kw: dict) -> bool:
    """The layer's capacity for f > 0 uses the largest token count of any rank unless the
    caller promises equal counts with inequivalent_tokens=False."""
    flag = case.call_kw.get("inequivalent_tokens", kw.get("inequivalent_tokens"))
    return flag is not False


_ROUTER_KEYS = {"score_function": "score_function", "pre_softmax": "pre_softmax", "topk_scaling_factor": "scaling",
                "num_groups": "num_groups", "group_topk": "group_topk", "balance_loss_weight": "balance_weight",
                "seq_aux_loss_weight": "seq_weight"}


def router_setup(layer: MoELayer, kw: dict, seed: int) -> tuple:
    """(RefRouter or None, RefShared or None) for the router and shared-expert options of
    ``kw``, with a random expert bias and shared expert loaded into ``layer``."""
    router = shared = None
    if any(key in kw for key in _ROUTER_KEYS) or kw.get("expert_bias"):
        router = RefRouter(**{_ROUTER_KEYS[key]: kw[key] for key in _ROUTER_KEYS if key in kw})
        if kw.get("expert_bias"):
            g = torch.Generator().manual_seed(seed + 5)
            bias = torch.randn(layer.num_experts, generator=g, dtype=torch.float64) * 0.05
            with torch.no_grad():
                layer.expert_bias.copy_(bias.float())
            router.bias = layer.expert_bias.detach().cpu().double()
    if kw.get("shared_expert_size"):
        g = torch.Generator().manual_seed(seed + 6)
        sx = layer.shared_experts

        def rnd(*shape):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5).requires_grad_(True)
        shared = RefShared(rnd(*sx.fc1_weight.shape), rnd(*sx.fc2_weight.shape),
                           rnd(1, D) if sx.gate_weight is not None else None, sx.act, sx.gated)
        with torch.no_grad():
            sx.fc1_weight.copy_(shared.w1)
            sx.fc2_weight.copy_(shared.w2)
            if shared.gate is not None:
                sx.gate_weight.copy_(shared.gate)
    return router, shared


def check_router_state(case: Case, layer: MoELayer, refs: list, shared: Optional[RefShared], tol: float,
                       errs: list) -> None:
    """Shared-expert gradients (summed over ranks) and, with an expert bias, the load counts and
    ``update_expert_bias`` against a plain computation over every rank's choices."""
    if shared is not None:
        sx = layer.shared_experts
        for name, got, want in (("fc1", sx.fc1_weight.grad, shared.w1), ("fc2", sx.fc2_weight.grad, shared.w2),
                                ("gate", sx.gate_weight.grad if sx.gate_weight is not None else None, shared.gate)):
            if want is None:
                continue
            g = torch.zeros(want.shape, dtype=DT) if got is None else got
            summed = torch.from_numpy(WORLD.allreduce(g.detach().cpu().double().numpy(), op=MPI.SUM))
            close(f"{case.name}: shared {name} grad (sum over ranks)", summed, grad_of(want), tol, errs)
    if layer.expert_bias is not None:
        E = layer.num_experts
        mine = [sum(row.count(e) for row in refs[layer.comm.rank].topk) for e in range(E)]
        close(f"{case.name}: tokens_per_expert", layer.tokens_per_expert, torch.tensor(mine, dtype=DT), 0, errs)
        total = [sum(sum(row.count(e) for row in ref.topk) for ref in refs) for e in range(E)]
        before = layer.expert_bias.detach().cpu().double().clone()
        mean = sum(total) / E
        want = torch.tensor([float(before[e]) + 0.001 * ((mean > total[e]) - (mean < total[e])) for e in range(E)])
        got = layer.update_expert_bias(0.001)
        close(f"{case.name}: update_expert_bias", got, want, 1e-7, errs)
        if bool(layer.tokens_per_expert.any()):
            errs.append(f"{case.name}: tokens_per_expert not reset by update_expert_bias")


def run_case(case: Case, seed: int = 0) -> list:
    comm = _comm()
    W, rank = comm.size, comm.rank
    errs: list = []
    counts = token_counts(case, W)
    xs = make_inputs(seed, counts)
    act = case.layer_kw.get("activation", "relu")
    gated = act in GATED
    bias_default = not gated  # the layer's default: biases off for gated experts
    p = random_params(seed + 17, case.gate, D, H, case.E,
                      bias1=case.layer_kw.get("fc1_bias", bias_default),
                      bias2=case.layer_kw.get("fc2_bias", bias_default),
                      act=REF_ACTS[act] if isinstance(act, str) else act, gated=gated)
    kw = dict(k=case.k, capacity_factor=case.cf, gate=case.gate, dropless=case.dropless, fp32_gate=False,
              dtype=DT, seed=3, proj_dim=8, gate_noise=case.noise, comm=comm)
    kw.update(case.layer_kw)
    if case.experts == "batched":
        kw["experts"] = BatchedFFN(case.E // W)
    elif case.experts == "factory":
        kw["experts"] = factory
    layer = MoELayer(D, H, case.E, **kw)
    load_params(layer, p, case)
    router, shared = router_setup(layer, kw, seed)
    if case.noise > 0 or kw.get("expert_bias"):
        layer.train()
    else:
        layer.eval()
    ref_kw = dict(k=case.call_kw.get("k", case.call_kw.get("top_k", case.k)), capacity_factor=case.call_kw.get("capacity_factor", case.cf),
                  dropless=case.call_kw.get("dropless", case.dropless),
                  normalize=kw.get("normalize_gate", True), batch_prioritized=kw.get("batch_prioritized_routing", False),
                  postscore=kw.get("is_postscore", True), balance_loss=kw.get("balance_loss", "gshard"),
                  z_weight=kw.get("z_loss_weight", 0.0), gate_noise=case.noise,
                  inequivalent=_agrees_on_tokens(case, kw), router=router, shared=shared)
    ref_kw.update(case.ref_kw)
    for call in range(case.calls):
        if case.schedule is not None:
            counts = case.schedule[call]
            xs = make_inputs(seed + call, counts)
        if case.noise > 0:
            noise = []
            for r, T in enumerate(counts):
                torch.manual_seed(1234 + 17 * call + r)
                noise.append(torch.randn(T, case.E, dtype=torch.float64))
            torch.manual_seed(1234 + 17 * call + rank)
            ref_kw["noise"] = noise
        x = xs[rank].detach().clone().to(DEV, DT).requires_grad_(True)
        gy = torch.randn(counts[rank], D, generator=torch.Generator().manual_seed(99 + rank),
                         dtype=torch.float64).to(DEV, DT)
        layer.zero_grad(set_to_none=True)
        y = layer(x, **case.call_kw)
        loss = (y * gy).sum() + 0.5 * layer.aux_loss
        loss.backward()

        for t in p.leaves() + (shared.leaves() if shared is not None else []):
            t.grad = None
        xr = [xi.detach().clone().requires_grad_(True) for xi in xs]
        refs = reference(p, xr, **ref_kw)
        total = sum((refs[r].y * torch.randn(counts[r], D, generator=torch.Generator().manual_seed(99 + r),
                                             dtype=torch.float64)).sum() + 0.5 * refs[r].aux for r in range(W))
        total.backward()
        me = refs[rank]
        tol = TOL
        close(f"{case.name}: y", y, me.y, tol, errs)
        close(f"{case.name}: aux_loss", layer.aux_loss, me.aux, tol, errs)
        if me.balance is not None:
            close(f"{case.name}: balance_loss", layer.balance_loss, me.balance, tol, errs)
        close(f"{case.name}: z_loss", layer.z_loss, me.z, tol, errs)
        close(f"{case.name}: x.grad", x.grad, xr[rank].grad, tol, errs)
        lr = layer.last_routing
        if lr.topk_idx.cpu().tolist() != me.topk:
            errs.append(f"{case.name}: top-k choices differ")
        if lr.kept.cpu().tolist() != me.kept:
            errs.append(f"{case.name}: kept routes differ: got {lr.kept.int().tolist()} want "
                        f"{[[int(b) for b in row] for row in me.kept]}")
        if lr.capacity != me.capacity:
            errs.append(f"{case.name}: capacity {lr.capacity} != {me.capacity}")
        # expert gradients: this rank's slice of the reference's
        e0, El, S, s = layer.first_expert, layer.num_local_experts, layer.shards, layer.shard_index
        Hl = H // S
        hs = slice(s * Hl, (s + 1) * Hl)
        es = slice(e0, e0 + El)
        want = {"w1": grad_of(p.w1)[es, :, hs], "w2": grad_of(p.w2)[es, hs]}
        if p.b1 is not None:
            want["b1"] = grad_of(p.b1)[es, hs] if case.experts == "ffn" else grad_of(p.b1)[es]
        if p.w3 is not None:
            want["w3"] = grad_of(p.w3)[es, :, hs]
        if p.b3 is not None:
            want["b3"] = grad_of(p.b3)[es, hs]
        if p.b2 is not None:
            want["b2"] = grad_of(p.b2)[es]
        for name, g in expert_grads(layer, case).items():
            close(f"{case.name}: expert grad {name}", g, want[name], tol, errs)
        # gate gradients: summed over ranks (what data-parallel training all-reduces)
        for name, g in gate_grads(layer, p).items():
            g = torch.zeros(p.gate[name].shape, dtype=DT) if g is None else g
            summed = torch.from_numpy(WORLD.allreduce(g.detach().cpu().double().numpy(), op=MPI.SUM))
            close(f"{case.name}: gate grad {name} (sum over ranks)", summed, grad_of(p.gate[name]), tol, errs)
        check_router_state(case, layer, refs, shared, tol, errs)
        if errs:
            break
    return errs


def check(cases: list):
    if DEV.type == "cuda":  # the layer draws its gate noise on the GPU: not reproducible on the CPU
        cases = [c for c in cases if c.noise == 0]

    def run():
        failures = []
        for case in cases:
            try:
                errs = run_case(case)
            except Exception as exc:  # noqa: BLE001 - reported collectively
                import traceback
                errs = [f"{case.name}: raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"]
            collective_assert(not errs, "; ".join(errs)[:3000])
            failures += errs
    run.__name__ = f"cases[{cases[0].name}..{cases[-1].name}]"
    return run


def cases_for(W: int, group: str) -> list:
    E = {1: 4, 2: 4, 3: 6, 4: 8}.get(W, 2 * W)
    ragged = ([9, 13, 0, 7] * 2)[:W] if W > 2 else [9, 13][:W]
    out = []
    if group in ("routing", "all"):
        for gate in ("linear", "cosine"):
            for k in range(1, 5):
                for cf, dl in ((1.0, False), (0.5, False), (0.0, False), (-0.6, False), (None, True)):
                    out.append(Case(f"{gate} k={k} cf={cf} dropless={dl}", E, k=k, cf=1.0 if cf is None else cf,
                                    gate=gate, dropless=dl,
                                    tokens=ragged if (dl or (cf is not None and cf <= 0)) else None))
    if group in ("features", "all"):
        out += [
            Case("batch prioritized", E, k=2, cf=0.5, layer_kw=dict(batch_prioritized_routing=True)),
            Case("prescore", E, k=3, cf=1.0, layer_kw=dict(is_postscore=False)),
            Case("prescore dropless", E, k=2, dropless=True, layer_kw=dict(is_postscore=False), tokens=ragged),
            Case("no normalize", E, k=2, cf=1.0, layer_kw=dict(normalize_gate=False)),
            Case("no biases gelu", E, k=2, cf=1.0, layer_kw=dict(fc1_bias=False, fc2_bias=False,
                                                                 activation="gelu")),
            Case("z loss, no balance", E, k=2, layer_kw=dict(balance_loss=None, z_loss_weight=0.1)),
            Case("gate noise gshard", E, k=2, noise=1.0, calls=2),
            Case("load_importance", E, k=2, noise=1.0, layer_kw=dict(balance_loss="load_importance")),
            Case("overlap 2 capacity", E, k=2, cf=1.0, layer_kw=dict(overlap_degree=2)),
            Case("own_first", E, k=2, cf=1.0, layer_kw=dict(own_first=True)),
            Case("own_first k=3 cf=0", E, k=3, cf=0.0, tokens=ragged, layer_kw=dict(own_first=True)),
            Case("own_first dropless", E, k=2, dropless=True, tokens=ragged, layer_kw=dict(own_first=True)),
            Case("own_first overlap 2", E, k=3, cf=0.5, layer_kw=dict(own_first=True, overlap_degree=2)),
            Case("per-call own_first", E, k=2, cf=1.0, call_kw=dict(own_first=True)),
            Case("own_first batched experts", E, k=2, dropless=True, experts="batched", tokens=ragged,
                 layer_kw=dict(own_first=True)),
            Case("own_first factory experts", E, k=2, cf=1.0, experts="factory", layer_kw=dict(own_first=True)),
            Case("overlap 3 dropless", E, k=3, dropless=True, layer_kw=dict(overlap_degree=3), tokens=ragged),
            Case("per-call k / cf / dropless", E, k=2, cf=1.0,
                 call_kw=dict(k=3, capacity_factor=0.5, overlap_degree=2)),
            Case("per-call dropless", E, k=1, cf=1.0, call_kw=dict(dropless=True, top_k=2)),
            Case("inequivalent tokens", E, k=2, cf=1.0, tokens=ragged, layer_kw=dict(inequivalent_tokens=True)),
            Case("data parallel capacity", E, k=2, cf=0.5, layer_kw=dict(parallel_mode="data")),
            Case("data parallel dropless", E, k=3, dropless=True, tokens=ragged, layer_kw=dict(parallel_mode="data")),
            Case("auto mode", E, k=2, cf=1.0, layer_kw=dict(parallel_mode="auto"), calls=7),
            Case("custom batched experts", E, k=2, cf=1.0, experts="batched"),
            Case("custom batched dropless", E, k=2, dropless=True, experts="batched", tokens=ragged),
            Case("custom factory experts", E, k=3, dropless=True, experts="factory", tokens=ragged),
            # gated experts (biases off by default), capacity and dropless, pipelined, data-parallel
            Case("swiglu capacity", E, k=2, cf=1.0, layer_kw=dict(activation="swiglu")),
            Case("swiglu dropless k=3", E, k=3, dropless=True, tokens=ragged, layer_kw=dict(activation="swiglu")),
            Case("geglu biases k=1 cf=0.5", E, k=1, cf=0.5,
                 layer_kw=dict(activation="geglu", fc1_bias=True, fc2_bias=True)),
            Case("swiglu dropless overlap 2", E, k=2, dropless=True, tokens=ragged,
                 layer_kw=dict(activation="swiglu", overlap_degree=2)),
            Case("swiglu data parallel", E, k=2, cf=0.5, layer_kw=dict(activation="swiglu", parallel_mode="data")),
        ]
        if W > 1:
            # fewer experts than ranks: each expert sharded over W / E ranks along its hidden dim
            for Es in sorted({e for e in (1, 2) if W % e == 0 and W > e and H % (W // e) == 0}):
                for k in range(1, Es + 1):
                    out.append(Case(f"sharded E={Es} k={k} cf=1", Es, k=k, cf=1.0))
                    out.append(Case(f"sharded E={Es} k={k} dropless", Es, k=k, dropless=True, tokens=ragged))
                out.append(Case(f"sharded E={Es} data parallel", Es, k=1, cf=0.0, tokens=ragged,
                                layer_kw=dict(parallel_mode="data")))
                out.append(Case(f"sharded E={Es} overlap 2", Es, k=Es, cf=1.0, layer_kw=dict(overlap_degree=2)))
                out.append(Case(f"sharded E={Es} swiglu biases", Es, k=1, cf=1.0,
                                layer_kw=dict(activation="swiglu", fc1_bias=True, fc2_bias=True)))
                out.append(Case(f"sharded E={Es} geglu data parallel", Es, k=1, dropless=True, tokens=ragged,
                                layer_kw=dict(activation="geglu", parallel_mode="data")))
    if group in ("routers", "all"):
        out += router_cases(E, ragged) + random_router_cases(E, W)
    return out


def router_cases(E: int, ragged: list) -> list:
    """Megatron-core's router options and shared experts (issue 27) against the reference's own
    routing (tests/ranks/moe_reference.py route_token)."""
    sig = dict(score_function="sigmoid", expert_bias=True, num_groups=2, group_topk=1, balance_loss="switch",
               balance_loss_weight=0.3, z_loss_weight=0.1)
    return [
        Case("sigmoid bias groups switch z dropless", E, k=2, dropless=True, tokens=ragged, layer_kw=sig),
        Case("sigmoid bias groups cf=1", E, k=2, cf=1.0, layer_kw=sig),
        Case("sqrtsoftplus no normalize scaling seq loss", E, k=3, cf=0.5,
             layer_kw=dict(score_function="sqrtsoftplus", normalize_gate=False, topk_scaling_factor=2.5,
                           seq_aux_loss_weight=0.2)),
        Case("softmax after top-k groups 2/2 switch", E, k=3, dropless=True, tokens=ragged,
             layer_kw=dict(pre_softmax=False, num_groups=2, group_topk=2, balance_loss="switch")),
        Case("softmax bias scaling k=1 cf=0", E, k=1, cf=0.0, tokens=ragged,
             layer_kw=dict(expert_bias=True, topk_scaling_factor=0.5, normalize_gate=False)),
        Case("per-call k with groups", E, k=2, cf=1.0, call_kw=dict(k=3),
             layer_kw=dict(score_function="sigmoid", num_groups=2, group_topk=2)),
        Case("sigmoid batch prioritized", E, k=2, cf=0.5,
             layer_kw=dict(score_function="sigmoid", batch_prioritized_routing=True)),
        Case("shared swiglu gated, sigmoid dropless", E, k=2, dropless=True, tokens=ragged,
             layer_kw=dict(score_function="sigmoid", shared_expert_size=10, shared_expert_gate=True)),
        Case("shared relu, default router (fused step)", E, k=2, cf=1.0,
             layer_kw=dict(shared_expert_size=6, shared_expert_activation="relu")),
        Case("shared geglu, sigmoid overlap 2 own_first", E, k=2, cf=1.0,
             layer_kw=dict(score_function="sigmoid", expert_bias=True, shared_expert_size=6,
                           shared_expert_activation="geglu", overlap_degree=2, own_first=True)),
        Case("prescore sigmoid scaling", E, k=2, cf=1.0,
             layer_kw=dict(score_function="sigmoid", topk_scaling_factor=1.5, is_postscore=False)),
        Case("sigmoid bias gate noise", E, k=2, cf=1.0, noise=1.0,
             layer_kw=dict(score_function="sigmoid", expert_bias=True, balance_loss="switch")),
        Case("shared swiglu data parallel", E, k=2, cf=0.5,
             layer_kw=dict(score_function="sigmoid", shared_expert_size=6, parallel_mode="data")),
    ]


def random_router_cases(E: int, W: int, n: int = 6) -> list:
    """``n`` router configurations drawn from a generator seeded by the world size (the same
    draw on every rank): score function, softmax side, k, groups, bias, scaling, losses, shared
    expert, capacity or dropless, and token counts per rank (zeros included)."""
    import random

    rnd = random.Random(2700 + W)
    out = []
    for i in range(n):
        kw: dict = dict(score_function=rnd.choice(["softmax", "sigmoid", "sqrtsoftplus"]),
                        expert_bias=rnd.random() < 0.5, normalize_gate=rnd.random() < 0.7,
                        balance_loss=rnd.choice(["gshard", "switch", None]), seq_aux_loss_weight=rnd.choice([0.0, 0.3]))
        if kw["score_function"] == "softmax":
            kw["pre_softmax"] = rnd.random() < 0.5
        if rnd.random() < 0.4:
            kw["topk_scaling_factor"] = 1.5
        groups = rnd.choice([None, 2] + ([E // 2] if E // 2 not in (1, 2) else []))
        if groups is not None:
            gk = rnd.randint(1, groups)
            k = rnd.randint(gk, gk * (E // groups))
            kw.update(num_groups=groups, group_topk=gk)
        else:
            k = rnd.randint(1, E)
        if rnd.random() < 0.4:
            kw.update(shared_expert_size=5, shared_expert_activation=rnd.choice(["swiglu", "relu"]))
        dropless = rnd.random() < 0.5
        tokens = [rnd.choice([0, 3, 8, 13]) for _ in range(W)]
        out.append(Case(f"random router #{i} k={k} {kw}", E, k=k, cf=rnd.choice([0.5, 1.0, 0.0]), dropless=dropless,
                        tokens=tokens, layer_kw=kw))
    return out


def unequal_cases(W: int) -> list:
    """Default options (capacity_factor=1.0, no inequivalent_tokens) with token counts that
    differ between ranks, one rank with none: the ranks agree on the capacity of the largest
    count; a rank without tokens still takes part in every exchange, forward and backward."""
    E = {1: 4, 2: 4, 3: 6, 4: 8}.get(W, 2 * W)
    zero = ([0, 11, 9, 13] * 2)[:W] if W != 3 else [9, 0, 13]
    uneq = ([5, 13, 4, 11] * 2)[:W] if W != 3 else [4, 11, 7]
    out = [
        Case("default, one rank without tokens", E, tokens=zero),
        Case("default, unequal counts", E, tokens=uneq),
        Case("unequal k=1 cf=0.5 cosine", E, k=1, cf=0.5, gate="cosine", tokens=uneq),
        Case("unequal k=3 prescore", E, k=3, tokens=zero, layer_kw=dict(is_postscore=False)),
        Case("unequal per-call cf=2", E, tokens=zero, call_kw=dict(capacity_factor=2.0)),
        Case("unequal overlap 2 own_first", E, tokens=zero, layer_kw=dict(overlap_degree=2, own_first=True)),
        Case("unequal overlap 3", E, k=3, tokens=uneq, call_kw=dict(overlap_degree=3)),
        Case("unequal data parallel", E, tokens=zero, layer_kw=dict(parallel_mode="data")),
        Case("unequal auto mode", E, tokens=uneq, layer_kw=dict(parallel_mode="auto"), calls=7),
        Case("unequal batched experts", E, tokens=zero, experts="batched"),
        Case("unequal factory experts", E, tokens=uneq, experts="factory"),
        Case("unequal inequivalent_tokens=True", E, tokens=zero, layer_kw=dict(inequivalent_tokens=True)),
        Case("every rank without tokens", E, tokens=[0]),
        Case("equal counts, inequivalent_tokens=False", E, tokens=[11], call_kw=dict(inequivalent_tokens=False)),
        Case("unequal sigmoid bias groups shared", E, k=2, tokens=zero,
             layer_kw=dict(score_function="sigmoid", expert_bias=True, num_groups=2, group_topk=1,
                           balance_loss="switch", shared_expert_size=6, shared_expert_gate=True)),
        Case("every rank without tokens, sigmoid bias shared", E, tokens=[0],
             layer_kw=dict(score_function="sigmoid", expert_bias=True, shared_expert_size=6,
                           seq_aux_loss_weight=0.1)),
    ]
    # one layer, counts changing from call to call (random, zeros included; the same draw on every rank)
    g = torch.Generator().manual_seed(1400 + W)
    schedule = [torch.randint(0, 16, (W,), generator=g).tolist() for _ in range(5)]
    schedule[1] = [0] * W
    schedule[2][W - 1] = 0
    out.append(Case("counts changing per call", E, k=2, schedule=schedule, calls=len(schedule)))
    out.append(Case("counts changing per call, overlap 2", E, k=3, cf=0.75, schedule=schedule, calls=len(schedule),
                    layer_kw=dict(overlap_degree=2)))
    if W > 1:
        out.append(Case("unequal sharded E=1", 1, k=1, tokens=zero))
    return out


def check_algorithms():
    """algorithm='2dh' (on a simulated multi-node layout) and 'auto' reach every exchange:
    same results as the reference, alone and with the pipelined overlap."""
    W = WORLD.size
    if W == 1:
        return
    hcomm = moecomm.init(backend="mpi", local_size=2 if W % 2 == 0 else 1, set_default=False)
    E = {2: 4, 3: 6, 4: 8}.get(W, 2 * W)
    cases = []
    for algo in ("2dh", "auto"):
        cases += [
            Case(f"{algo} capacity", E, k=2, cf=0.5, layer_kw=dict(comm=hcomm, algorithm=algo)),
            Case(f"{algo} dropless overlap 2", E, k=3, dropless=True, tokens=([9, 13, 0, 7] * 2)[:W],
                 layer_kw=dict(comm=hcomm, algorithm=algo, overlap_degree=2)),
            Case(f"{algo} per call, capacity overlap 3", E, k=2, cf=1.0, call_kw=dict(algorithm=algo, overlap_degree=3),
                 layer_kw=dict(comm=hcomm)),
        ]
    check(cases)()


def check_bad_configs():
    comm = _comm()
    W = comm.size
    errs = []

    def expect(exc_type, words, fn):
        try:
            fn()
        except exc_type as exc:
            if not all(w in str(exc) for w in words):
                errs.append(f"message {str(exc)!r} lacks {words}")
            return
        except Exception as exc:  # noqa: BLE001
            errs.append(f"{words}: raised {type(exc).__name__}: {exc}, wanted {exc_type.__name__}")
            return
        errs.append(f"{words}: no error")

    if W > 1:
        expect(ValueError, ["num_experts", str(W + 1)], lambda: MoELayer(D, H, W + 1, k=1, comm=comm))
        if W in (3, 4):
            expect(ValueError, ["num_experts=2" if W == 3 else "num_experts=3"],
                   lambda: MoELayer(D, H, 2 if W == 3 else 3, k=1, comm=comm))
        expect(ValueError, ["hidden_size"], lambda: MoELayer(D, W * 3 + 1, 1, k=1, comm=comm))
        expect(ValueError, ["sharded"], lambda: MoELayer(D, H, 1, k=1, comm=comm, experts=factory))
    expect(ValueError, ["k", "num_experts"], lambda: MoELayer(D, H, 4 * W, k=4 * W + 1, comm=comm))
    expect(TypeError, ["own_first", "bool"], lambda: MoELayer(D, H, 4 * W, k=1, comm=comm, own_first=1))
    expect(TypeError, ["own_first", "bool"], lambda: MoELayer(D, H, 4 * W, k=1, comm=comm, own_first="on"))
    layer = MoELayer(D, H, 4 * W, k=1, comm=comm, device=DEV)
    expect(TypeError, ["own_first"], lambda: layer(torch.zeros(3, D, device=DEV), own_first="yes"))
    collective_assert(not errs, "; ".join(errs))


def _step(layer, x, gy, **kw):
    for q in list(layer.parameters()) + [x]:
        q.grad = None
    y = layer(x, **kw)
    aux = layer.aux_loss
    torch.autograd.backward([y, aux] if aux.requires_grad else [y], [gy, torch.ones_like(aux)][:1 + aux.requires_grad])
    r = layer.last_routing
    return [y, layer.aux_loss, x.grad] + [q.grad for q in layer.parameters()], r


def _sq_tanh(h):
    return h * torch.tanh(h)


def check_fused_step():
    """The fused capacity step (the default) against the op-by-op path (fused_step=False),
    for every activation (named, gated, callables, a lambda) and router (sigmoid, expert bias,
    groups, scaling, sequence loss: the layer routes, the rest fused): output, aux loss, routing and
    the experts' gradients the same bits on the CPU for k <= 4 (k = 5's gates sum in another
    order), the input's and the gate's gradients to float32 rounding (bfloat16's where that is
    the dtype), on GPUs everything to float32 rounding; the configurations it does not cover
    run the op-by-op path either way, and ``last_step_path`` says which path each took."""
    comm = _comm()
    W, rank = comm.size, comm.rank
    errs = []
    dts = [torch.float32, torch.bfloat16] if DEV.type == "cuda" else [torch.float64, torch.float32, torch.bfloat16]
    configs = [dict(k=1), dict(k=2), dict(k=3, fc1_bias=False), dict(k=4, capacity_factor=0.5),
               dict(k=5, capacity_factor=2.0, fc2_bias=False), dict(k=2, balance_loss=None),
               dict(k=2, normalize_gate=False, capacity_factor=0.25),
               # routed by the layer, the rest fused: noise, cosine gate, z-loss; cf 0: op by op
               dict(k=2, gate_noise=1.0), dict(k=2, gate="cosine"),
               dict(k=2, z_loss_weight=0.1), dict(k=2, capacity_factor=0.0),
               # dropless: fused too (any activation)
               dict(k=2, dropless=True), dict(k=3, dropless=True, activation="gelu", fc1_bias=False),
               dict(k=1, dropless=True, balance_loss=None),
               # one expert per rank (issue 34: the uniform row map of one local expert was a
               # zero-stride view the native gather refused), and with two ranks k = 2 of E = 2
               dict(k=1, experts_per_rank=1), dict(k=min(2, W), experts_per_rank=1, capacity_factor=1.0),
               # every activation, capacity and dropless: named, gated (with and without biases), callables
               dict(k=2, activation="gelu"), dict(k=2, activation="silu"), dict(k=3, activation="gelu_tanh"),
               dict(k=2, activation="sigmoid"), dict(k=1, activation="tanh"), dict(k=2, activation="identity"),
               dict(k=2, activation="swiglu"), dict(k=3, activation="geglu", fc1_bias=True, fc2_bias=True),
               dict(k=2, activation="reglu"), dict(k=2, activation=lambda h: torch.relu(h) * 1.5),
               dict(k=2, activation=_sq_tanh, capacity_factor=0.5),
               dict(k=2, dropless=True, activation="swiglu"),
               dict(k=3, dropless=True, activation="geglu_tanh", fc1_bias=True),
               dict(k=2, dropless=True, activation=lambda h: h * torch.sigmoid(1.7 * h)),
               # modern routers: the layer routes, the rest is the fused step (routed_step)
               dict(k=2, score_function="sigmoid", expert_bias=True), dict(k=2, score_function="sigmoid",
                                                                          num_groups=2, group_topk=1),
               dict(k=3, score_function="softmax", pre_softmax=False, topk_scaling_factor=2.0),
               dict(k=2, score_function="sqrtsoftplus", seq_aux_loss_weight=0.01, activation="swiglu"),
               dict(k=2, dropless=True, score_function="sigmoid", expert_bias=True, activation="swiglu")]
    uncovered = ()  # (gate noise, the cosine gate, the z-loss: the layer routes, the rest is fused)
    for dt in dts:
        for i, cfg in enumerate(configs):
            cfg = dict(cfg)
            E = cfg.pop("experts_per_rank", 8 if i % 2 else 6) * W
            T = [0, 13, 29][(rank + i) % 3] if W > 1 else 23  # unequal counts, a rank with none
            g = torch.Generator().manual_seed(100 * i + rank)
            x = torch.randn(T, D, generator=g).to(DEV, dt)
            if "experts_per_rank" in configs[i]:  # and a transposed (non-contiguous) input
                x = x.t().contiguous().t()
            x.requires_grad_(True)
            gy = torch.randn(T, D, generator=g).to(DEV, dt)
            outs, paths = [], []
            for fused in (True, False):
                layer = MoELayer(D, H, E, comm=comm, seed=7 + i, dtype=dt, device=DEV, fused_step=fused, **cfg)
                torch.manual_seed(1000 + i)  # the same gate noise on both paths
                outs.append(_step(layer, x, gy))
                paths.append(layer.last_step_path.path)
            (a, ra), (b, rb) = outs
            tag = f"{dt} {cfg}"
            fused_path = not any(name in cfg for name in uncovered) and cfg.get("capacity_factor") != 0.0
            if paths != [("fused" if fused_path else "op_by_op"), "op_by_op"]:
                errs.append(f"{tag}: paths {paths}")
            for name in ("topk_idx", "locations", "counts", "kept"):
                if not torch.equal(getattr(ra, name), getattr(rb, name)):
                    errs.append(f"{tag}: routing {name} differs")
            for j, (u, v) in enumerate(zip(a, b)):
                # 2, 3: the input's and the gate weight's gradients, through the router's float32
                # softmax backward, whose sum over experts runs in another order
                exact = DEV.type == "cpu" and cfg["k"] <= 4 and j not in (2, 3)
                if (u is None) != (v is None):
                    errs.append(f"{tag}: output {j} is None on one path only")
                elif u is not None and exact and not torch.equal(u, v):
                    errs.append(f"{tag}: output {j} differs (max {float((u.double() - v.double()).abs().max()):.3g})")
                elif u is not None and not exact:
                    tol = 1e-2 if dt == torch.bfloat16 and j in (2, 3) else 1e-5
                    close(f"{tag}: output {j}", u, v.cpu(), tol, errs)
    collective_assert(not errs, "; ".join(errs[:8]))


def check_autocast_bf16():
    """bf16 autocast: the gate stays fp32, the experts run in bf16; result near the fp64 reference."""
    comm = _comm()
    W, rank = comm.size, comm.rank
    E = 2 * W
    errs = []
    counts = [16] * W
    xs = make_inputs(5, counts)
    p = random_params(40, "linear", D, H, E)
    layer = MoELayer(D, H, E, k=2, capacity_factor=0.0, comm=comm, seed=1)
    load_params(layer, p, Case("bf16", E))
    layer.eval()
    seen = {}
    orig = layer.gates[0].logits

    def spy(x):
        out = orig(x)
        seen["dtype"] = out.dtype
        return out

    layer.gates[0].logits = spy
    x = xs[rank].float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    refs = reference(p, [xi for xi in xs], k=2, capacity_factor=0.0)
    if y.dtype != torch.bfloat16:
        errs.append(f"autocast output dtype {y.dtype}")
    if seen.get("dtype") != torch.float32:
        errs.append(f"gate logits dtype {seen.get('dtype')} under autocast")
    if layer.last_routing.topk_idx.tolist() != refs[rank].topk:
        errs.append("bf16: routing differs from reference")
    close("bf16 y", y.float(), refs[rank].y, 5e-2, errs)
    collective_assert(not errs, "; ".join(errs))


def check_gpu_bf16():
    """bf16 parameters on GPUs: the bmm (capacity), grouped-GEMM (dropless) and chunked
    (overlap) expert paths against the fp64 reference of the same bf16-rounded weights."""
    comm = _comm()
    W, rank = comm.size, comm.rank
    E = 4 * W
    errs = []
    counts = [64] * W
    xs = [x.bfloat16().double() for x in make_inputs(8, counts)]
    p = random_params(41, "linear", D, H, E)
    with torch.no_grad():
        for t in p.leaves():
            t.copy_(t.bfloat16().double())
    for name, kw, ref_kw in (("capacity", dict(capacity_factor=1.0), dict(capacity_factor=1.0)),
                             ("dropless", dict(dropless=True), dict(capacity_factor=1.0, dropless=True)),
                             ("overlap 2", dict(capacity_factor=1.0, overlap_degree=2), dict(capacity_factor=1.0)),
                             ("dropless overlap 2", dict(dropless=True, overlap_degree=2),
                              dict(capacity_factor=1.0, dropless=True))):
        layer = MoELayer(D, H, E, k=2, comm=comm, seed=1, dtype=torch.bfloat16, device=DEV, **kw)
        load_params(layer, p, Case("bf16", E))
        layer.eval()
        for t in p.leaves():
            t.grad = None
        x = xs[rank].to(DEV, torch.bfloat16).requires_grad_(True)
        y = layer(x)
        y.float().square().sum().backward()
        xr = [xi.detach().clone().requires_grad_(True) for xi in xs]
        refs = reference(p, xr, k=2, **ref_kw)
        sum(r.y.square().sum() for r in refs).backward()
        if layer.last_routing.topk_idx.cpu().tolist() != refs[rank].topk:
            errs.append(f"bf16 {name}: routing differs")
            continue
        close(f"bf16 {name}: y", y, refs[rank].y, 3e-2, errs)
        close(f"bf16 {name}: x.grad", x.grad, xr[rank].grad, 5e-2, errs)
        e0 = layer.first_expert
        close(f"bf16 {name}: w1.grad", layer.experts.fc1_weight.grad, p.w1.grad[e0:e0 + 4], 5e-2, errs)
    collective_assert(not errs, "; ".join(errs))


def check_cuda_graph():
    """GPU, capacity mode: a training step (forward, backward of y and the aux loss), with token
    counts that differ between ranks, captured into a CUDA graph and replayed with new tokens
    (so new routes) equals the same step run
    eagerly by a twin layer with the same weights: overlap degrees 1 (own_first="auto": own
    rows first when captured, not eagerly) and 2 with own rows first, and degree 1 without."""
    errs = []
    plain = _comm()
    # with peer memory, every exchange by copy engines (p2p_min_bytes=0)
    peer = moecomm.init(backend="nccl", p2p_bytes=64 << 20, p2p_min_bytes=0, set_default=False) \
        if plain.size > 1 and plain.backend == "nccl" else None  # (the peer backend: copy engines already)
    try:
        for comm in [c for c in (plain, peer) if c is not None]:
            _check_cuda_graph(comm, errs)
    finally:
        if peer is not None:
            peer.close()
    collective_assert(not errs, "; ".join(errs[:6]))


def _check_cuda_graph(comm, errs: list) -> None:
    rank = comm.rank
    E = 4 * comm.size
    kind = "copy engines" if comm.engine.peer is not None else "nccl"
    for deg, own in ((1, "auto"), (2, True), (1, False)):
        layers = [MoELayer(D, H, E, k=2, comm=comm, seed=3, capacity_factor=1.0, overlap_degree=deg, own_first=own,
                           device=DEV) for _ in range(2)]
        graphed, eager = layers
        eager.load_state_dict(graphed.state_dict())
        counts = [48 + 8 * (r % 2) for r in range(comm.size)]  # unequal: the capacity agreed by the warm-up
        x = make_inputs(60, counts)[rank].to(DEV, DT).requires_grad_(True)
        gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(61 + rank)).to(DEV)

        def step():
            for t in [x, *graphed.parameters()]:
                t.grad = None
            y = graphed(x)
            torch.autograd.backward([y, graphed.aux_loss], [gy, torch.ones_like(graphed.aux_loss)])
            return y

        graph, y = capture(step, DEV, warmup=2)
        for seed in (62, 63):
            with torch.no_grad():
                x.copy_(make_inputs(seed, counts)[rank].to(DEV))
                gy.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 10 * rank)))
            graph.replay()
            comm.watch_stream("moe check_cuda_graph replay", timeout=60)
            xe = x.detach().clone().requires_grad_(True)
            for t in eager.parameters():
                t.grad = None
            ye = eager(xe)
            torch.autograd.backward([ye, eager.aux_loss], [gy, torch.ones_like(eager.aux_loss)])
            tag = f"graph ({kind}) degree {deg} own_first {own} seed {seed}"
            pairs = [("y", y, ye), ("aux", graphed.aux_loss, eager.aux_loss), ("x.grad", x.grad, xe.grad)]
            pairs += [(f"{name}.grad", pg.grad, pe.grad)
                      for (name, pg), pe in zip(graphed.named_parameters(), eager.parameters())]
            for name, got, want in pairs:
                close(f"{tag}: {name}", got, None if want is None else want.cpu(), 1e-5, errs)
        del graph


def main() -> None:
    global DEV, DT, TOL
    group = sys.argv[1] if len(sys.argv) > 1 else "all"
    if len(sys.argv) > 2 and sys.argv[2] == "cuda":
        DEV = torch.device("cuda", WORLD.rank % torch.cuda.device_count())
        torch.cuda.set_device(DEV)
        DT, TOL = torch.float32, 2e-4
    W = WORLD.size
    checks = []
    if group == "unequal":
        checks.append(check(unequal_cases(W)))
    if group in ("routing", "all"):
        checks.append(check(cases_for(W, "routing")))
    if group in ("routers", "all"):
        checks.append(check(cases_for(W, "routers")))
    if group in ("features", "all"):
        checks.append(check(cases_for(W, "features")))
        checks.append(check_bad_configs)
        checks.append(check_fused_step)
        if DEV.type == "cpu":
            checks.append(check_algorithms)
            checks.append(check_autocast_bf16)
        else:
            checks.append(check_gpu_bf16)
            checks.append(check_cuda_graph)
    rank_main(checks)


if __name__ == "__main__":
    main()
