"""Framework integrations on real MPI ranks (run by tests/test_integrations.py).

One launch per world size runs every check: the global ``torch.distributed`` swap, then
DeepSpeed's ``MoE`` layer (plain and ``use_tutel=True``), then Megatron-core's
``mappings.all_to_all`` and ``MoEAlltoAllTokenDispatcher`` pipeline, each with and without
moecomm.
A framework that is not installed is reported as ``SKIP <name>: <reason>`` and not run.
Data is made on a gloo group over the MPI ranks (tests.mpi_util.init_gloo_over_mpi).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import numpy as np
import torch

import moecomm
import moecomm.distributed
from moecomm.integrations import _groups, clear_group_cache, communicator_for_group
from tests.mpi_util import collective_assert, init_gloo_over_mpi, rank_main
from tests.ranks.data import as_bytes, count_matrix, expected_bytes, input_for
from tests.ranks.integration_modes import MODES, checks_if_installed, integration_mode, same, say

os.environ.setdefault("DS_ACCELERATOR", "cpu")
init_gloo_over_mpi()
import torch.distributed as dist  # noqa: E402

W, R = dist.get_world_size(), dist.get_rank()
MPI_COMM = moecomm.init(backend="mpi", timeout=60)  # the default communicator (MPI rank == torch rank)


# ---------------------------------------------------------------------------------------
# 1. torch.distributed.all_to_all_single = moecomm.distributed.all_to_all_single


@contextlib.contextmanager
def swapped():
    saved = dist.all_to_all_single, dist.all_to_all
    dist.all_to_all_single = moecomm.distributed.all_to_all_single
    dist.all_to_all = moecomm.distributed.all_to_all
    try:
        yield
    finally:
        dist.all_to_all_single, dist.all_to_all = saved


def check_global_swap() -> None:
    gloo_comm = moecomm.init(process_group=dist.group.WORLD, set_default=False, timeout=60)
    collective_assert(gloo_comm.backend == "torch", gloo_comm.backend)
    rng = np.random.default_rng(5)
    with swapped():
        for case in range(8):
            m = count_matrix(100 + case, W, 5, 0.3)
            dtype = [torch.float32, torch.bfloat16, torch.int64, torch.uint8][case % 4]
            x = input_for(100 + case, R, m, (3,), dtype)
            out = torch.empty((int(m[:, R].sum()), 3), dtype=dtype)
            group = [gloo_comm, dist.group.WORLD][case % 2]  # the WORLD group: a communicator made on it
            work = dist.all_to_all_single(out, x, [int(v) for v in m[:, R]], [int(v) for v in m[R]],
                                          group=group, async_op=bool(case & 2))
            if work is not None:
                work.wait()
            collective_assert(np.array_equal(as_bytes(out), expected_bytes(100 + case, R, m, (3,), dtype)),
                              f"all_to_all_single case {case}")
            ins = [torch.from_numpy(rng.standard_normal((int(m[R, p]), 2))) for p in range(W)]
            outs = [torch.empty((int(m[p, R]), 2), dtype=torch.float64) for p in range(W)]
            dist.all_to_all(outs, ins, group=group)
            sent = [None] * W
            dist.all_gather_object(sent, [t.numpy() for t in ins])
            for p in range(W):
                collective_assert(np.array_equal(outs[p].numpy(), sent[p][R]), f"all_to_all case {case} from {p}")
        # the backend keeps the originals: nothing it runs goes through the swapped names
        from moecomm.backends import torch_dist

        collective_assert(torch_dist._all_to_all_single is dist.distributed_c10d.all_to_all_single, "captured")
    gloo_comm.close()


def check_group_mapping() -> None:
    """communicator_for_group: the default is reused only for its own ranks in order; any other
    group gets a communicator of its own, made once."""
    clear_group_cache()
    members = [0, 1] if W == 2 else [0, W - 1]
    sub = dist.new_group(members)  # every rank takes part in making it
    ok, msg = True, ""
    if R in members:
        comm = communicator_for_group(sub)
        mine = members.index(R)
        if W == 2:
            ok, msg = comm is MPI_COMM, f"the default's ranks: not reused ({comm})"
        else:
            ok = comm is not MPI_COMM and comm.backend == "torch" and comm.size == 2 and comm.rank == mine
            msg = f"sub-group communicator {comm}"
        ok = ok and communicator_for_group(sub) is comm
        out = torch.empty(4)
        comm.all_to_all_single(out, torch.arange(4, dtype=torch.float32) + 10 * R)
        want = torch.cat([(torch.arange(4, dtype=torch.float32) + 10 * m)[2 * mine:2 * mine + 2] for m in members])
        if ok and not torch.equal(out, want):
            ok, msg = False, f"sub-group exchange gave {out.tolist()}, want {want.tolist()}"
    collective_assert(ok, msg)
    try:
        communicator_for_group("not a group")
    except TypeError:
        pass
    else:
        raise AssertionError("a non-ProcessGroup was accepted")
    clear_group_cache()


# ---------------------------------------------------------------------------------------
# 2. Megatron-core


def megatron_missing() -> str | None:
    from moecomm.integrations.megatron import check_version, installed_version

    unsupported = check_version(installed_version())
    if unsupported:
        return unsupported
    try:
        import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
    except ImportError as exc:  # not installed, or triton missing (megatron.core imports it)
        return f"megatron-core cannot be imported ({exc})"
    return None


class _CpuStream:
    """Stand-in for torch.cuda.Stream / Event on CPU ranks (the test only)."""

    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


@contextlib.contextmanager
def megatron_on_cpu():
    """Megatron's CUDA-only calls (current_device, Stream, stream, the side-stream host copy of
    the splits) as CPU stand-ins."""
    from megatron.core.transformer.moe import token_dispatcher

    names = ("current_device", "Stream", "current_stream", "stream")
    saved = {n: getattr(torch.cuda, n) for n in names}
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def host_copy(tensor, as_numpy=False, record_stream=False):
        # what the CUDA path returns: the splits as numpy arrays (torch's gloo takes no tensors)
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = host_copy
    stream = _CpuStream()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)
        token_dispatcher.maybe_move_tensor_to_cpu = to_host




def mode(name: str, integration, **enable_kw):
    return integration_mode(name, integration, MPI_COMM, **enable_kw)


def megatron_all_to_all_run(seed: int):
    from megatron.core.tensor_parallel import mappings

    m = count_matrix(seed, W, 6, 0.3)
    g = torch.Generator().manual_seed(seed * 10 + R)
    x = torch.randn(int(m[R].sum()), 4, generator=g, dtype=torch.float64, requires_grad=True)
    # the forms Megatron passes: host numpy arrays (its dispatcher) or lists
    form = (lambda v: [int(a) for a in v]) if seed % 2 else np.asarray
    y = mappings.all_to_all(dist.group.WORLD, x, form(m[:, R]), form(m[R]), use_nccl_stream=bool(seed & 1))
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y * w).sum().backward()
    eq = mappings.all_to_all(dist.group.WORLD, torch.randn(2 * W, 3, generator=g))
    return y.detach(), x.grad, eq


def check_megatron_all_to_all() -> None:
    from moecomm.integrations import megatron

    with megatron_on_cpu():
        for seed in range(4):
            runs = {}
            for name in MODES:
                with mode(name, megatron):
                    runs[name] = megatron_all_to_all_run(seed)
            for name in MODES[1:]:
                for a, b, what in zip(runs["native"], runs[name], ("output", "grad", "equal-split output")):
                    same(a, b, f"mappings.all_to_all {what} ({name}, seed {seed})")
    collective_assert(not megatron.is_enabled(), "disable")


def megatron_dispatcher_run(seed: int, topk: int, capacity_factor):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    local, H, T = 2, 8, 7 + R
    E = local * W
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
                            moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
                            moe_expert_capacity_factor=capacity_factor, moe_permute_fusion=False,
                            expert_model_parallel_size=W, add_bias_linear=False,
                            moe_router_pre_softmax=topk == 1)
    pgs = ProcessGroupCollection(ep=dist.group.WORLD, tp_ep=dist.group.WORLD)
    d = MoEAlltoAllTokenDispatcher(local, list(range(R * local, (R + 1) * local)), cfg, pg_collection=pgs)
    g = torch.Generator().manual_seed(1000 * seed + R)
    hidden = torch.randn(T, 1, H, generator=g, requires_grad=True)
    scores = torch.randn(T, E, generator=g)
    if seed % 2:  # nothing routed to the last expert: zero counts
        scores[:, -1] = -float("inf")
    top = scores.topk(topk, dim=1).indices
    routing = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
    probs = (torch.softmax(scores, 1) * routing).detach().requires_grad_(True)
    weights = torch.randn(local, H, H, generator=g, requires_grad=True)

    tokens, p = d.dispatch_preprocess(hidden, routing, probs)
    tokens, p = d.token_dispatch(tokens, p)
    tokens, per_expert, p = d.dispatch_postprocess(tokens, p)
    chunks = torch.split(tokens, [int(c) for c in per_expert])
    out = torch.cat([c @ weights[e] for e, c in enumerate(chunks)]) * p.unsqueeze(-1)
    out = d.combine_preprocess(out)
    out = d.token_combine(out)
    out = d.combine_postprocess(out)
    r = torch.randn(out.shape, generator=g)
    (out * r).sum().backward()
    return out.detach(), hidden.grad, probs.grad, weights.grad


def check_megatron_dispatcher() -> None:
    from moecomm.integrations import megatron

    with megatron_on_cpu():
        for seed, topk, cap in ((0, 2, None), (1, 1, None), (2, 3, None), (3, 2, 1.0)):
            runs = {}
            for name in MODES:
                with mode(name, megatron):
                    runs[name] = megatron_dispatcher_run(seed, topk, cap)
                    used = _groups._by_group.get(dist.group.WORLD)  # what the exchanges were mapped to
                    if name == "moecomm-default":
                        collective_assert(used is MPI_COMM, f"default communicator not reused: {used}")
                    if name == "moecomm-group":
                        collective_assert(used is not None and used.backend == "torch", f"group communicator {used}")
            for name in MODES[1:]:
                for a, b, what in zip(runs["native"], runs[name], ("output", "hidden grad", "probs grad",
                                                                    "expert weight grad")):
                    same(a, b, f"MoEAlltoAllTokenDispatcher {what} ({name}, seed {seed}, top-{topk}, cap {cap})")


def megatron_checks() -> list:
    return checks_if_installed("megatron", megatron_missing,
                               [check_megatron_all_to_all, check_megatron_dispatcher, lambda: say("PASS megatron")])


# ---------------------------------------------------------------------------------------
# 3. DeepSpeed


def deepspeed_missing() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)"
    try:
        import deepspeed.moe.layer  # noqa: F401
    except ImportError as exc:
        return f"deepspeed cannot be imported ({exc})"
    return None


def deepspeed_run(seed: int, k: int, use_tutel: bool, parallelism: bool = True, expert=None,
                  dtype: torch.dtype = torch.float32, H: int = 6, T: int = 16, local: int = 2):
    """One forward and backward of DeepSpeed's MoE layer; without ``parallelism`` its
    ``set_deepspeed_parallelism()`` is not called (its expert group stays None: the world).
    ``expert``: a function of (H, seed) making the expert (default: Linear, GELU, Linear)."""
    from deepspeed.moe.layer import MoE

    torch.manual_seed(seed)  # the same gate and expert weights on every rank
    expert = (torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.GELU(), torch.nn.Linear(2 * H, H))
              if expert is None else expert(H, seed))
    layer = MoE(H, expert, num_experts=local * W, ep_size=W, k=k, capacity_factor=1.0, min_capacity=2,
                use_tutel=use_tutel).to(dtype)
    if parallelism:
        layer.set_deepspeed_parallelism()
    assert (layer.deepspeed_moe.ep_group is None) != parallelism
    assert layer.deepspeed_moe.use_tutel == use_tutel
    g = torch.Generator().manual_seed(100 * seed + R)
    x = torch.randn(2, T // 2, H, generator=g).to(dtype).requires_grad_(True)
    torch.manual_seed(7 + seed)  # the gates' random draws (gumbel, RTS) repeat in every mode
    out, l_aux, counts = layer(x)
    r = torch.randn(out.shape, generator=g).to(dtype)
    ((out * r).sum() + l_aux).backward()
    run = [out.detach(), l_aux.detach(), counts, x.grad] + [p.grad for p in layer.parameters()]
    deepspeed_run.last_layer = layer  # for the fallback check
    return run


def check_deepspeed() -> None:
    from deepspeed.moe import sharded_moe

    from moecomm.integrations import deepspeed as ds

    init_deepspeed()
    for k in (1, 2, 3):
        for seed in (k,):
            runs = {}
            for name in MODES:  # DeepSpeed's layer with moecomm's exchange: the same bits
                with mode(name, ds, layer="deepspeed"):
                    collective_assert((sharded_moe._AllToAll.forward is ds._forward) == (name != "native"), name)
                    collective_assert(not ds.layer_enabled(), "layer='deepspeed' keeps DeepSpeed's forward")
                    runs[name] = deepspeed_run(seed, k, False)
                    if name != "native":
                        ds.enable(tutel_kernels=True, layer="deepspeed")
                        runs[name + "+tutel"] = deepspeed_run(seed, k, True)
                        used = _groups._by_group.get(next(iter(ds_group_dict().values())))
                        collective_assert(used is not None and (used is MPI_COMM) == (name == "moecomm-default"),
                                          f"{name}: mapped to {used}")
            collective_assert(not sharded_moe.TUTEL_INSTALLED and not ds.is_enabled(), "disable restores")
            ds.enable(tutel_kernels=True, exchange=False, layer="deepspeed")  # moecomm's kernels, DeepSpeed's exchange
            try:
                collective_assert(not ds.is_enabled() and ds.tutel_kernels_enabled(), "exchange=False")
                runs["native+tutel"] = deepspeed_run(seed, k, True)
            finally:
                ds.disable()
            what = ["output", "l_aux", "exp_counts", "input grad"] + [f"param grad {i}" for i in range(99)]
            if k == 2:  # no set_deepspeed_parallelism(): the group is None, the world group to DeepSpeed
                for name in MODES:
                    with mode(name, ds, layer="deepspeed"):
                        runs[name + "/world"] = deepspeed_run(seed, k, False, parallelism=False)
                for name in MODES[1:]:
                    for a, b, w in zip(runs["native/world"], runs[name + "/world"], what):
                        same(a, b, f"DeepSpeed MoE k={k} seed {seed} {w} ({name}, expert group None)")
                for a, b, w in zip(runs["native"], runs["native/world"], what):
                    same(a, b, f"DeepSpeed MoE k={k} seed {seed} {w}: group None vs the expert-parallel group")
            for name in MODES[1:]:
                for suffix in ("", "+tutel"):
                    for a, b, w in zip(runs["native" + suffix], runs[name + suffix], what):
                        same(a, b, f"DeepSpeed MoE k={k} seed {seed} {w} ({name}{suffix})")
            for a, b, w in zip(runs["native"], runs["native+tutel"], what):
                ok = torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6) if a.is_floating_point() \
                    else torch.equal(a, b)
                collective_assert(ok, f"DeepSpeed MoE k={k} seed {seed} {w}: use_tutel=True on moecomm's kernels "
                                      f"differs from the native path beyond float tolerance")


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |a| (0 for equal tensors)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / a.abs().max().clamp(min=1e-30)) if a.numel() else 0.0


DS_LAYER_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
"""enable(layer="moecomm") vs DeepSpeed's own layer: the largest difference allowed, relative to
the largest magnitude of each result (batched vs per-expert GEMMs, another order of the k sums).
The gate's weight gradient is held to its own float32 error instead (:data:`DS_GATE_FACTOR`)."""

DS_GATE_FACTOR = 4.0
"""The gate's weight gradient sums softmax-Jacobian products that cancel: DeepSpeed's own float32
result is ~1e-4 of its largest magnitude away from the float64 one (and its use_tutel path as far
from its plain one). moecomm's may differ from DeepSpeed's by at most this many times that
distance (or DS_LAYER_RTOL, if larger)."""


def _gelu_tanh_expert(H, seed):
    return torch.nn.Sequential(torch.nn.Linear(H, 3 * H, bias=False), torch.nn.GELU(approximate="tanh"),
                               torch.nn.Linear(3 * H, H))


def _relu_expert(H, seed):
    return torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.ReLU(), torch.nn.Linear(2 * H, H, bias=False))


class _OtherExpert(torch.nn.Module):
    def __init__(self, H):
        super().__init__()
        self.fc = torch.nn.Linear(H, H)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def check_deepspeed_layer() -> None:
    """enable(layer="moecomm"): the layer's dispatch, experts and combine on moecomm, against
    DeepSpeed's own layer (output, l_aux, exp_counts, the input's and every parameter's
    gradient); unsupported experts fall back to DeepSpeed's path, bit for bit, with a reason."""
    import logging

    from moecomm.integrations import deepspeed as ds

    worst, worst_gate = {}, 0.0
    small, large = (8, 24, 3), (64, 512, 4)  # (model_dim, tokens per rank, local experts)
    cases = [(1, False, None, torch.float32, small), (2, False, None, torch.float32, small),
             (3, False, None, torch.float32, small), (2, True, None, torch.float32, small),
             (1, True, _relu_expert, torch.float32, small), (3, False, _gelu_tanh_expert, torch.float32, small),
             (2, False, None, torch.float64, small), (2, False, None, torch.float32, large)]
    what = ["output", "l_aux", "exp_counts", "input grad"] + [f"param grad {i}" for i in range(99)]
    for seed, (k, tutel, expert, dtype, (H, T, local)) in enumerate(cases):
        kw = dict(expert=expert, dtype=dtype, H=H, T=T, local=local)
        # native: DeepSpeed's layer and exchange, the kernels as asked
        ds.enable(tutel_kernels=tutel, exchange=False, layer="deepspeed")
        try:
            native = deepspeed_run(seed, k, tutel, **kw)
            gate = [n for n, _ in deepspeed_run.last_layer.named_parameters()].index("deepspeed_moe.gate.wg.weight")
            gate_tol = DS_LAYER_RTOL[dtype]
            if dtype == torch.float32:  # DeepSpeed's own float32 error in the gate's weight gradient
                ref = deepspeed_run(seed, k, tutel, **dict(kw, dtype=torch.float64))
                gate_tol = max(gate_tol, DS_GATE_FACTOR * _max_rel(ref[4 + gate], native[4 + gate]))
        finally:
            ds.disable()
        for name in MODES[1:]:
            with mode(name, ds):
                ds.enable(tutel_kernels=tutel)  # the default: layer="moecomm"
                collective_assert(ds.layer_enabled(), "layer_enabled")
                got = deepspeed_run(seed, k, tutel, **kw)
                moe = deepspeed_run.last_layer.deepspeed_moe
                reason = ds.layer_fallback_reason(moe)
                collective_assert(reason is None and hasattr(moe, "_moecomm_dispatcher"),
                                  f"layer='moecomm' fell back: {reason}")
            collective_assert(len(got) == len(native), "parameter count")
            for i, (a, b, w) in enumerate(zip(native, got, what)):
                collective_assert(b is not None and a.dtype == b.dtype and a.shape == b.shape, f"{w}: {b}")
                if not a.is_floating_point():
                    same(a, b, f"layer='moecomm' k={k} {w}")
                    continue
                rel = _max_rel(a, b)
                if i == 4 + gate:
                    tol, w = gate_tol, w + " (the gate's weight)"
                    worst_gate = max(worst_gate, rel)
                else:
                    tol = DS_LAYER_RTOL[dtype]
                    worst[dtype] = max(worst.get(dtype, 0.0), rel)
                collective_assert(rel <= tol, f"layer='moecomm' k={k} tutel={tutel} {dtype} H={H} {w}: "
                                  f"relative difference {rel:.3g} > {tol:.3g} ({name})")
    collective_assert(not ds.layer_enabled(), "disable")
    # an expert moecomm does not run: DeepSpeed's own path, the same bits, a reason, one log line
    native = deepspeed_run(11, 2, False, expert=lambda H, s: _OtherExpert(H))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("moecomm").addHandler(handler)
    ds.enable()
    try:
        got = deepspeed_run(11, 2, False, expert=lambda H, s: _OtherExpert(H))
        layer = deepspeed_run.last_layer
        layer(torch.randn(2, 3, 6))  # a second forward: no second log line
    finally:
        ds.disable()
        logging.getLogger("moecomm").removeHandler(handler)
    reason = ds.layer_fallback_reason(layer.deepspeed_moe)
    collective_assert(reason is not None and "_OtherExpert" in reason, f"fallback reason {reason!r}")
    collective_assert(len(records) == 1 and "_OtherExpert" in records[0].getMessage(), f"log lines {records}")
    for a, b, w in zip(native, got, what):
        same(a, b, f"layer='moecomm' fallback {w}")
    check_deepspeed_layer_changes(ds)
    say("deepspeed layer='moecomm' vs DeepSpeed's layer, max relative difference: "
        + ", ".join(f"{d}: {v:.2e}" for d, v in worst.items()) + f"; the gate's weight gradient: {worst_gate:.2e}")


def check_deepspeed_layer_changes(ds) -> None:
    """What the layer path learnt of a layer's experts is kept between calls, yet a change made
    after a call on moecomm's path is seen at the next: a forward hook on an expert's Linear, an
    expert's activation replaced, its parameters in another dtype (each falls back to DeepSpeed's
    own forward with its reason); undone, the layer runs on moecomm again."""
    deepspeed_run(21, 2, False)
    layer = deepspeed_run.last_layer
    moe = layer.deepspeed_moe
    x = torch.randn(2, 8, 6)
    ds.enable()
    try:
        def reason() -> object:
            layer(x)
            return ds.layer_fallback_reason(moe)

        first = reason()
        experts = list(moe.experts.deepspeed_experts)
        hook = experts[-1][0].register_forward_hook(lambda *a: None)
        hooked = reason()
        hook.remove()
        again = reason()
        gelu = experts[0][1]
        experts[0][1] = torch.nn.Tanh()
        other_act = reason()
        experts[0][1] = gelu
        moe.experts.double()  # (DeepSpeed's own forward fails on that too: only ask why)
        other_dtype = ds._plan(moe, x.reshape(-1, 6))
        moe.experts.float()
        last = reason()
    finally:
        ds.disable()
    got = (first, hooked, again, other_act, other_dtype, last)
    ok = first is None and "forward hooks" in str(hooked) and again is None and "differs from expert 0's" in \
        str(other_act) and "torch.float64" in str(other_dtype) and last is None
    collective_assert(ok, f"deepspeed layer path after changes to the experts: {got}")


def ds_group_dict():
    from deepspeed.utils import groups

    return groups._get_expert_parallel_group_dict()


def deepspeed_checks() -> list:
    return checks_if_installed("deepspeed", deepspeed_missing,
                               [check_deepspeed, lambda: say("PASS deepspeed"), check_deepspeed_layer,
                                lambda: say("PASS deepspeed-layer")])


def init_deepspeed() -> None:
    import importlib

    import deepspeed

    # DeepSpeed's CPU accelerator JIT-builds a shared-memory all-reduce op (minutes of compiling,
    # used only by its all_reduce) when its comm backend is made; the MoE path does not use it
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["deepspeed-layer"]:  # one world size's run of the layer check alone
        reason = deepspeed_missing()
        if reason:
            say(f"SKIP deepspeed: {reason}")
            rank_main([])
        else:
            rank_main([init_deepspeed, check_deepspeed_layer, lambda: say("PASS deepspeed-layer")])
        sys.exit(0)
    checks = [check_global_swap, check_group_mapping, lambda: say("PASS global-swap")]
    checks += deepspeed_checks()
    checks += megatron_checks()  # last: the most version-sensitive, a failure there ends the launch
    rank_main(checks)
