"""``moecomm.integrations.megatron.enable(layer="moecomm")`` against Megatron-core's own
``MoELayer.forward`` on CPU ranks (run by tests/test_integrations_megatron_layer.py, 1 to 3
ranks, the experts spread over the ranks: expert parallelism over gloo).

The same Megatron layer (TopKRouter, SequentialMLP experts, optionally shared experts; built
with ``use_te=False``) runs the same input with Megatron's forward and with moecomm's: the
output, each aux loss (captured where Megatron attaches it), the input's gradient and every
parameter's gradient agree to float32 rounding, for softmax and sigmoid routers, groups,
expert bias, gated and plain experts, k = 1..4, unequal token counts
per rank. A layer moecomm does not cover (a capacity factor) runs Megatron's own forward and
says why (``layer_fallback_reason``). Exit status 77 (with the reason): Megatron-core is not
importable. Prints ``megatron layer checks passed on N ranks``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import torch
import torch.nn.functional as F

from tests.ranks.megatron_parity import closeness_recorder, megatron_modules

TOL = dict(rtol=2e-5, atol=3e-6)


def main() -> None:
    m = megatron_modules()
    parallel_state, get_moe_module_spec, PGC = m.parallel_state, m.get_moe_module_spec, m.ProcessGroupCollection
    moe_utils, router_mod, TransformerConfig = m.moe_utils, m.router, m.TransformerConfig
    import torch.distributed as dist

    import moecomm
    from moecomm.integrations import megatron

    from bench.frameworks import _megatron_cpu_standins
    from tests.mpi_util import init_gloo_over_mpi

    init_gloo_over_mpi()
    comm = moecomm.init(backend="mpi")
    W, R = comm.size, comm.rank
    parallel_state.initialize_model_parallel(expert_model_parallel_size=W)
    pg = PGC.use_mpu_process_groups()

    captured: list = []
    orig = moe_utils.MoEAuxLossAutoScaler.apply

    def capture(t, loss):
        captured.append(loss.detach().clone())
        return orig(t, loss)

    router_mod.MoEAuxLossAutoScaler.apply = capture
    E = 4 * W
    base = dict(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=E, ffn_hidden_size=12,
                moe_ffn_hidden_size=12, use_cpu_initialization=True, moe_router_dtype="fp32",
                moe_token_dispatcher_type="alltoall", expert_model_parallel_size=W, moe_permute_fusion=False,
                moe_z_loss_coeff=1e-3, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
    configs = []
    for k in (1, 2, 3, 4):
        configs.append((f"softmax k={k} gelu", dict(moe_router_topk=k, add_bias_linear=False,
                                                    moe_router_pre_softmax=k == 1)))
        # (expert biases: Megatron 0.19's own MLP fails on them here, an in-place add to a view of
        # its TP reduction's output, so none of the configurations has them)
        configs.append((f"softmax pre k={k} relu", dict(moe_router_topk=k, moe_router_pre_softmax=True,
                                                        activation_func=F.relu, add_bias_linear=False)))
        configs.append((f"sigmoid bias swiglu shared k={k}", dict(
            moe_router_topk=k, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            moe_shared_expert_intermediate_size=10, moe_router_load_balancing_type="seq_aux_loss")))
        if k <= 2:
            configs.append((f"sigmoid groups k={k}", dict(
                moe_router_topk=k, moe_router_score_function="sigmoid", moe_router_num_groups=2,
                moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5, add_bias_linear=False)))
    failures = []
    logging.getLogger("moecomm").setLevel(logging.ERROR)
    for ci, (name, extra) in enumerate(configs):
        torch.manual_seed(100 + ci)  # the same weights on every rank for the shared parts
        cfg = TransformerConfig(**{**base, **extra})
        with _megatron_cpu_standins(True):
            layer = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)(config=cfg,
                                                                                            pg_collection=pg)
        layer.set_layer_number(1)
        if cfg.moe_router_enable_expert_bias:
            with torch.no_grad():
                layer.router.expert_bias.copy_(torch.randn(E) * 0.05)
        layer.train()
        g = torch.Generator().manual_seed(1000 * ci + R)
        S = 3 + 2 * R  # unequal tokens per rank; rank 0 of three sees 3, rank 2 sees 7
        x = torch.randn(S, 2, 8, generator=g)
        gy = torch.randn(S, 2, 8, generator=g)
        results = []
        for mode in ("megatron", "moecomm"):
            if mode == "moecomm":
                megatron.enable()  # the default: the layer on moecomm
                if not megatron.layer_enabled():
                    failures.append(f"rank {R}: enable() left Megatron's own layer on")
            for p in layer.parameters():
                p.grad = None
            captured.clear()
            xx = x.clone().requires_grad_(True)
            saved_shapes: list = []

            def pack(t):
                saved_shapes.append(tuple(t.shape))
                return t

            try:
                with _megatron_cpu_standins(True):
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        y, bias = layer(xx)
                    (y * gy).sum().backward()
            finally:
                megatron.disable()
            if mode == "moecomm":  # the stacked expert weights are made again for the backward, not kept
                El, D = layer.num_local_experts, cfg.hidden_size
                H1 = cfg.moe_ffn_hidden_size * (2 if cfg.gated_linear_unit else 1)
                kept = [sh for sh in saved_shapes if sh in ((El, D, H1), (El, cfg.moe_ffn_hidden_size, D))]
                if kept:
                    failures.append(f"rank {R} {name}: stacked expert weights kept for the backward: {kept}")
            results.append((y.detach(), xx.grad, {n: p.grad for n, p in layer.named_parameters()},
                            list(captured), None if mode == "megatron" else megatron.layer_fallback_reason(layer)))
        (ym, gm, pm, am, _), (yo, go, po, ao, why) = results
        errs: list = []
        cmp = closeness_recorder(errs, TOL)

        if why is not None:
            errs.append(f"fell back: {why}")
        cmp("output", yo, ym)
        cmp("x.grad", go, gm)
        if len(ao) != len(am):
            errs.append(f"{len(ao)} aux losses, Megatron {len(am)}")
        for i, (a, b) in enumerate(zip(ao, am)):
            cmp(f"aux loss {i}", a, b)
        for n, want in pm.items():
            got = po[n]
            if (got is None) != (want is None):
                errs.append(f"{n}: grad {'missing' if got is None else 'unexpected'}")
            elif got is not None:
                cmp(f"{n} grad", got, want)
        failures += [f"rank {R} {name}: {m}" for m in errs]
    # a configuration moecomm does not cover: Megatron's own forward, and the reason
    cfg = TransformerConfig(**base, moe_router_topk=2, moe_expert_capacity_factor=1.0, add_bias_linear=False)
    with _megatron_cpu_standins(True):
        layer = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)(config=cfg,
                                                                                        pg_collection=pg)
    layer.set_layer_number(1)
    megatron.enable(layer="megatron")
    if megatron.layer_enabled():
        failures.append(f"rank {R}: enable(layer='megatron') put the layer on moecomm")
    megatron.disable()
    megatron.enable(layer="moecomm")
    try:
        with _megatron_cpu_standins(True), contextlib.suppress(Exception):
            layer(torch.randn(4, 2, 8))
        why = megatron.layer_fallback_reason(layer)
        if why is None or "moe_expert_capacity_factor" not in why:
            failures.append(f"rank {R}: a capacity factor did not fall back by name: {why!r}")
    finally:
        megatron.disable()
    per_rank: list = [None] * W
    dist.all_gather_object(per_rank, failures)
    flat = [f for per in per_rank for f in per]
    if flat:
        print("\n".join(flat))
        sys.exit(1)
    if R == 0:
        print(f"megatron layer checks passed on {W} ranks ({len(configs)} configurations)")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # gloo's threads at interpreter exit once aborted a passing run ("terminate called without
    # an active exception"): torch's teardown, not the checks'
    os._exit(0)
