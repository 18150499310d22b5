"""MoELayer against Megatron-core 0.19's MoELayer on the CPU (run by tests/test_moe_megatron.py
in a process of its own: it initialises torch.distributed and points torch.cuda.current_device
at the CPU, which Megatron's router and dispatcher need outside a GPU).

Megatron's layer (TopKRouter, allgather dispatcher, SequentialMLP experts, SharedExpertMLP)
and a moecomm layer built by ``megatron_options`` and loaded by ``load_megatron_state_dict``
take the same input: the outputs, each aux loss (captured where Megatron attaches it), the
input's gradient and every weight's gradient agree to float32 rounding, k = 1..8.

Exit status 77 (with the reason): Megatron-core is not importable. Prints ``parity passed``.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F

TOL = dict(rtol=2e-5, atol=2e-6)


def megatron_modules() -> SimpleNamespace:
    """Megatron-core's modules these checks use (exit status 77 with the reason where it cannot
    be imported); points ``torch.cuda.current_device`` at the CPU first, which Megatron's router
    buffers and gating read."""
    warnings.filterwarnings("ignore")
    try:
        torch.cuda.current_device = lambda: "cpu"
        from megatron.core import parallel_state
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe import moe_utils, router
        from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception as exc:  # noqa: BLE001 - any import failure means: skip
        print(f"megatron-core not importable: {type(exc).__name__}: {exc}")
        sys.exit(77)
    return SimpleNamespace(parallel_state=parallel_state, get_moe_module_spec=get_moe_module_spec,
                           ProcessGroupCollection=ProcessGroupCollection, moe_utils=moe_utils, router=router,
                           TransformerConfig=TransformerConfig)


def closeness_recorder(errs: list, tol: dict):
    """``cmp(what, got, want)``: appends to ``errs`` a line naming ``what`` where ``got`` is not
    close to ``want`` (``torch.testing.assert_close`` with ``tol``)."""
    def cmp(what, got, want):
        try:
            torch.testing.assert_close(got, want, **tol)
        except AssertionError as e:
            errs.append(f"{what}: {str(e).splitlines()[0:3]}")
    return cmp


def _megatron():
    import torch.distributed as dist

    m = megatron_modules()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    m.parallel_state.initialize_model_parallel()
    return (m.TransformerConfig, m.get_moe_module_spec, m.ProcessGroupCollection.use_mpu_process_groups(), m.moe_utils,
            m.router)


def main() -> None:
    TransformerConfig, get_moe_module_spec, pg, moe_utils, router_mod = _megatron()
    import moecomm
    from moecomm.moe import MoELayer
    from moecomm.moe.megatron import load_megatron_state_dict, megatron_options

    captured: list = []
    orig = moe_utils.MoEAuxLossAutoScaler.apply

    def capture(t, loss):
        captured.append(loss)
        return orig(t, loss)

    router_mod.MoEAuxLossAutoScaler.apply = capture
    comm = moecomm.init(backend="mpi")
    base = dict(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=8, ffn_hidden_size=12,
                moe_ffn_hidden_size=12, use_cpu_initialization=True, moe_router_dtype="fp32", add_bias_linear=False,
                moe_token_dispatcher_type="allgather", moe_z_loss_coeff=1e-3)
    configs = []
    for k in range(1, 9):
        configs.append((f"softmax pre k={k}", dict(moe_router_topk=k, moe_router_pre_softmax=True,
                                                   moe_router_topk_scaling_factor=1.5,
                                                   moe_router_load_balancing_type="aux_loss",
                                                   moe_aux_loss_coeff=1e-2)))
        if k > 1:
            configs.append((f"softmax post k={k} seq loss", dict(
                moe_router_topk=k, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                moe_aux_loss_coeff=[1e-2, 2e-2], activation_func=F.silu)))
        configs.append((f"sigmoid bias shared k={k}", dict(
            moe_router_topk=k, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[1e-2, 3e-2],
            moe_shared_expert_intermediate_size=10, moe_shared_expert_gate=k % 2 == 0)))
        if 2 <= k <= 4:
            configs.append((f"sigmoid groups 4/2 bias k={k}", dict(
                moe_router_topk=k, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2)))
        if k in (3, 8):
            configs.append((f"sqrtsoftplus bias k={k}", dict(
                moe_router_topk=k, moe_router_score_function="sqrtsoftplus", moe_router_enable_expert_bias=True,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)))
        if k in (2, 5):
            configs.append((f"swiglu experts, shared k={k}", dict(
                moe_router_topk=k, moe_router_score_function="sigmoid", gated_linear_unit=True,
                activation_func=F.silu, moe_shared_expert_intermediate_size=10,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)))
    failures, skipped = [], []
    for name, extra in configs:
        torch.manual_seed(len(captured) + 7)
        cfg = TransformerConfig(**base, **extra)
        mlayer = get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False)(config=cfg, pg_collection=pg)
        mlayer.set_layer_number(1)
        if cfg.moe_router_enable_expert_bias:
            with torch.no_grad():
                mlayer.router.expert_bias.copy_(torch.randn(8) * 0.05)
        try:
            ours = MoELayer(**megatron_options(cfg), comm=comm, seed=0)
        except ValueError as exc:  # gated experts before the experts engineer's activation="swiglu" lands
            skipped.append(f"{name}: {exc}")
            continue
        load_megatron_state_dict(ours, mlayer.state_dict())
        mlayer.train()
        ours.train()
        x = torch.randn(5, 3, 8)
        gy = torch.randn(5, 3, 8)
        xm = x.clone().requires_grad_(True)
        captured.clear()
        ym, _ = mlayer(xm)
        (ym * gy).sum().backward()  # Megatron's aux losses reach the router through its autoscaler
        mine = x.clone().requires_grad_(True)
        y = ours(mine)
        ((y * gy).sum() + ours.aux_loss).backward()
        errs: list = []
        cmp = closeness_recorder(errs, TOL)
        cmp("output", y, ym)
        want_aux = sum(captured)
        cmp("aux_loss (sum)", ours.aux_loss, want_aux)
        cmp("z loss", ours.z_loss * cfg.moe_z_loss_coeff, captured[0])
        cmp("x.grad", mine.grad, xm.grad)
        sd = dict(mlayer.named_parameters())
        cmp("router grad", ours.gates[0].wg.weight.grad, sd["router.weight"].grad)
        for e in range(8):
            b = f"experts.local_experts.{e}."
            for ofc, mfc in (("fc1_weight", "linear_fc1.weight"), ("fc2_weight", "linear_fc2.weight")):
                g = getattr(ours.experts, ofc).grad
                gm = sd[b + mfc].grad
                want = torch.zeros_like(sd[b + mfc]).t() if gm is None else gm.t()
                # gated experts keep fc1 as [D, 2, F]: Megatron's [2F, D] transposed, halves in order
                cmp(f"expert {e} {mfc} grad", torch.zeros_like(want) if g is None else g[e].reshape(want.shape), want)
        if ours.shared_experts is not None:
            sx = ours.shared_experts
            cmp("shared fc1 grad", sx.fc1_weight.grad, sd["shared_experts.linear_fc1.weight"].grad)
            cmp("shared fc2 grad", sx.fc2_weight.grad, sd["shared_experts.linear_fc2.weight"].grad)
            if sx.gate_weight is not None:
                cmp("shared gate grad", sx.gate_weight.grad, sd["shared_experts.gate_weight"].grad)
        if ours.expert_bias is not None:
            cmp("tokens_per_expert", ours.tokens_per_expert, mlayer.router.local_tokens_per_expert)
            want_bias = moe_utils.get_updated_expert_bias(mlayer.router.local_tokens_per_expert.clone(),
                                                          mlayer.router.expert_bias, 1e-3, pg.tp_dp_cp)
            cmp("update_expert_bias", ours.update_expert_bias(1e-3), want_bias)
        failures += [f"{name}: {m}" for m in errs]
        print(f"{name}: {'ok' if not errs else 'FAILED'}")
    for s in skipped:
        print(f"skipped {s}")
    if failures:
        print("\n".join(failures))
        sys.exit(1)
    print(f"parity passed ({len(configs) - len(skipped)} configurations, {len(skipped)} skipped)")


if __name__ == "__main__":
    main()
