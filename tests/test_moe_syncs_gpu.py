"""The eager MoE step's host synchronisations (one GPU, world size 1), counted with
``torch.cuda.set_sync_debug_mode("warn")``: a capacity step never waits for the GPU, nor does
the fused dropless step in bf16 (its grouped GEMMs read the experts' counts on the GPU); the
others wait once (the counts' ``.tolist()``, for the per-expert loop or the op-by-op split sizes); and the dropless bias gradient (a grouped GEMM of a ones block) equals a float64
reference to bfloat16 tolerance."""

from __future__ import annotations


import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D, E, T = 256, 16, 1024


@pytest.fixture(scope="module")
def comm():
    import moecomm

    return moecomm.init()


def _syncs(fn) -> list:
    """The host synchronisations ``fn()`` made, as ``file:line: message``."""
    from moecomm.graphs import host_synchronizations

    torch.cuda.synchronize()
    found = host_synchronizations(fn)
    torch.cuda.synchronize()
    return found


def _step_syncs(layer, x, gy, after_backward=None) -> tuple:
    """(the forward's, the backward's) host synchronisations of a training step of ``layer``
    (``after_backward`` runs as part of the backward), after two warm-up steps: one-time probes
    (grouped GEMM, kernel builds) may synchronise."""
    state: dict = {}

    def forward():
        state["y"] = layer(x)
        state["aux"] = layer.aux_loss

    def backward():
        torch.autograd.backward([state["y"], state["aux"]], [gy, torch.ones_like(state["aux"])])
        if after_backward is not None:
            after_backward()

    for _ in range(2):
        forward()
        backward()
    return _syncs(forward), _syncs(backward)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("dropless", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_step_synchronises_only_for_the_counts(comm, dropless, k, dtype, fused):
    from moecomm.moe import MoELayer

    layer = MoELayer(D, D, E, k=k, dropless=dropless, seed=3, comm=comm, dtype=dtype, device="cuda",
                     fused_step=fused)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(T, D, generator=g).to("cuda", dtype).requires_grad_()
    gy = torch.randn(T, D, generator=g).to("cuda", dtype)
    fwd, bwd = _step_syncs(layer, x, gy)
    # the fused dropless step on one rank keeps the experts' counts on the GPU where the grouped
    # GEMMs run (bf16); float32 takes the per-expert loop, which reads them on the host once
    want = 1 if dropless and not (fused and dtype == torch.bfloat16) else 0
    assert len(fwd) == want and not bwd, f"forward {len(fwd)} (want {want}): {fwd}; backward {len(bwd)}: {bwd}"
    if want:
        assert ("_ops/segments.py" if fused else "_step/expert_parallel.py") in fwd[0], fwd


@pytest.mark.parametrize("blocks", [1, 3])
def test_dropless_bias_gradient_sums(blocks):
    from moecomm.moe._ops.seg_gemm import seg_sum
    from moecomm.moe._ops.segments import Segments

    g = torch.Generator().manual_seed(blocks)
    El, B = 5, 384
    counts = torch.randint(0, 40, (blocks, El), generator=g)
    counts[0, 1] = 0
    seg = Segments(counts.tolist(), El, counts_dev=counts.cuda())
    rows = torch.randn(seg.rows, B, generator=g).cuda().bfloat16()
    want = torch.zeros(El, B, dtype=torch.float64)
    for e, s, n in seg.items():
        want[e] += rows[s:s + n].double().sum(0).cpu()
    got = seg_sum(rows, seg)
    assert got.dtype == torch.bfloat16 and got.shape == (El, B)
    mag = torch.zeros(El, B, dtype=torch.float64)
    for e, s, n in seg.items():
        mag[e] += rows[s:s + n].double().abs().sum(0).cpu()
    # float32 sums rounded to bfloat16 once per block, then once more: two bf16 ulps of the
    # magnitude per block
    err = (got.double().cpu() - want).abs()
    assert (err <= mag * 2 ** -7 * (blocks + 1) + 1e-6).all(), err.max().item()


@pytest.mark.parametrize("dropless", [False, True])
def test_modern_router_step_never_synchronises(comm, dropless):
    """Sigmoid scores with expert bias, group-limited routing, the switch, sequence and z
    losses, a gated shared expert on its side stream, and update_expert_bias (issue 27): no
    host synchronisation, dropless included (one rank, bf16)."""
    from moecomm.moe import MoELayer

    layer = MoELayer(D, D, E, k=4, dropless=dropless, seed=3, comm=comm, dtype=torch.bfloat16, device="cuda",
                     score_function="sigmoid", expert_bias=True, num_groups=4, group_topk=2, balance_loss="switch",
                     balance_loss_weight=0.01, seq_aux_loss_weight=0.01, z_loss_weight=1e-3, topk_scaling_factor=2.5,
                     shared_expert_size=D, shared_expert_gate=True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, T // 8, D, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    gy = torch.randn(8, T // 8, D, generator=g).to("cuda", torch.bfloat16)
    fwd, bwd = _step_syncs(layer, x, gy, lambda: layer.update_expert_bias(1e-3))
    want = 0  # bf16 on one rank: the dropless step's grouped GEMMs read the counts on the GPU
    assert len(fwd) == want and not bwd, f"forward {len(fwd)} (want {want}): {fwd}; backward {len(bwd)}: {bwd}"
