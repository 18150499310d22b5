"""The MoE layer under torch's graphing tools and its own ``cuda_graph=True`` (one GPU).

Every case runs a twin layer (same seed, so the same weights) eagerly on the same inputs and
compares outputs, aux loss and the gradients of the input and of every parameter: a replayed
graph runs the same kernels on the same data, so they agree to the last bit or within a
few units of the last place where the autograd engine's sums order differently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D, H, E, T = 256, 512, 8, 512


@pytest.fixture(scope="module")
def comm():
    import moecomm

    c = moecomm.init()
    yield c


def _layer(comm, k=2, dtype=torch.float32, **kw):
    from moecomm.moe import MoELayer

    return MoELayer(D, H, E, k=k, seed=5, comm=comm, dtype=dtype, device="cuda", **kw)


def _inputs(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, D, generator=g).to("cuda", dtype) for _ in range(n)]


def _close(a, b, what, tol):
    assert a is not None and b is not None, what
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item() + 1e-30
    assert err <= tol * scale, f"{what}: max err {err:.3g} (scale {scale:.3g})"


def _grads(mod):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in mod.named_parameters()}


def _compare_grads(got, want, tol):
    assert got.keys() == want.keys()
    for n in want:
        if want[n] is None:
            assert got[n] is None or not got[n].any(), n
        else:
            _close(got[n], want[n], n, tol)


class _WithAux(nn.Module):
    """make_graphed_callables graphs a module's tensor outputs: return the aux loss as one."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        y = self.layer(x)
        return y, self.layer.aux_loss


@pytest.mark.parametrize("k", [1, 2, 3])
def test_make_graphed_callables_equals_eager(comm, k):
    ref, lay = _layer(comm, k), _layer(comm, k)
    xs = _inputs(4, seed=k)
    sample = xs[0].clone().requires_grad_(True)
    graphed = torch.cuda.make_graphed_callables(_WithAux(lay), (sample,))
    for i, x in enumerate(xs):
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, aa = ref(xa), ref.aux_loss
        yb, ab = graphed(xb)
        gy = torch.randn_like(ya)
        torch.autograd.backward([ya, aa], [gy, torch.ones_like(aa)])
        torch.autograd.backward([yb, ab], [gy, torch.ones_like(ab)])
        _close(yb, ya, f"step {i} y", 1e-6)
        _close(ab, aa, f"step {i} aux", 1e-6)
        _close(xb.grad, xa.grad, f"step {i} x.grad", 1e-5)
        _compare_grads(_grads(lay), _grads(ref), 1e-5)
        for m in (ref, lay):
            m.zero_grad(set_to_none=True)


def test_whole_step_capture_with_other_modules_equals_eager(comm):
    def model():
        torch.manual_seed(1)
        return nn.ModuleDict({"pre": nn.Linear(D, D), "moe": _layer(comm, 2), "post": nn.Linear(D, D)}).cuda()

    def step(m, x):
        h = m["pre"](x)
        y = m["moe"](h)
        loss = m["post"](y).square().mean() + 0.01 * m["moe"].aux_loss
        loss.backward()
        m["moe"].aux_loss = m["moe"].balance_loss = None
        return loss.detach()

    ref, cap = model(), model()
    xs = _inputs(3, seed=7)
    static_x = xs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            cap.zero_grad(set_to_none=True)
            step(cap, static_x)
    torch.cuda.current_stream().wait_stream(side)
    cap.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(cap, static_x)
    for i, x in enumerate(xs):
        static_x.copy_(x)
        graph.replay()
        ref.zero_grad(set_to_none=True)
        want = step(ref, x)
        _close(static_loss, want, f"step {i} loss", 1e-6)
        _compare_grads(_grads(cap), _grads(ref), 1e-5)
    del graph


@pytest.mark.parametrize("k,dtype", [(1, torch.float32), (2, torch.float32), (3, torch.bfloat16),
                                     (4, torch.float32)])
def test_cuda_graph_option_equals_eager(comm, k, dtype):
    ref, lay = _layer(comm, k, dtype), _layer(comm, k, dtype, cuda_graph=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    xs = _inputs(4, dtype, seed=10 + k)
    for i, x in enumerate(xs):
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = ref(xa), lay(xb)
        if i >= 1:
            assert len(lay._graphed) == 1  # captured on the first call, replayed since
        gy = torch.randn_like(ya)
        torch.autograd.backward([ya, ref.aux_loss], [gy, torch.ones_like(ref.aux_loss)])
        torch.autograd.backward([yb, lay.aux_loss], [gy, torch.ones_like(lay.aux_loss)])
        _close(yb, ya, f"step {i} y", tol)
        _close(lay.aux_loss.detach(), ref.aux_loss.detach(), f"step {i} aux", 1e-5)
        _close(xb.grad, xa.grad, f"step {i} x.grad", tol)
        _compare_grads(_grads(lay), _grads(ref), tol)
        assert torch.equal(lay.last_routing.topk_idx, ref.last_routing.topk_idx)
        if i % 2 == 1:  # accumulate over two steps, then an optimizer-like in-place update
            with torch.no_grad():
                for m in (ref, lay):
                    for p in m.parameters():
                        p.sub_(1e-3 * p.grad)
                    m.zero_grad(set_to_none=True)


def test_cuda_graph_option_two_calls_before_backward(comm):
    """The second call while the first awaits its backward runs eagerly; both stay right."""
    ref, lay = _layer(comm, 2), _layer(comm, 2, cuda_graph=True)
    x0, x1, x2 = _inputs(3, seed=3)
    lay(x0.clone().requires_grad_(True)).sum().backward()  # capture
    lay.zero_grad(set_to_none=True)
    losses = []
    for m in (ref, lay):
        xa, xb = x1.clone().requires_grad_(True), x2.clone().requires_grad_(True)
        loss = m(xa).square().mean() + m.aux_loss + m(xb).square().mean() + m.aux_loss
        loss.backward()
        losses.append((loss.detach(), xa.grad, xb.grad))
    for a, b, what in zip(losses[1], losses[0], ("loss", "xa.grad", "xb.grad")):
        _close(a, b, what, 1e-5)
    _compare_grads(_grads(lay), _grads(ref), 1e-5)


def test_torch_compile_of_a_model_with_the_layer(comm):
    """torch.compile runs a model containing the layer (graph breaks around the layer's
    autograd Functions and native ops are allowed) with the eager results."""
    torch._dynamo.reset()

    def model():
        torch.manual_seed(2)
        return nn.ModuleDict({"pre": nn.Linear(D, D), "moe": _layer(comm, 2), "post": nn.Linear(D, D)}).cuda()

    def fwd(m, x):
        y = m["moe"](torch.relu(m["pre"](x)))
        return m["post"](y).square().mean() + 0.01 * m["moe"].aux_loss

    ref, comp = model(), model()
    compiled = torch.compile(lambda x: fwd(comp, x))
    for i, x in enumerate(_inputs(2, seed=4)):
        want = fwd(ref, x)
        got = compiled(x)
        want.backward()
        got.backward()
        _close(got.detach(), want.detach(), f"step {i} loss", 1e-5)
        _compare_grads(_grads(comp), _grads(ref), 1e-4)
        ref.zero_grad(set_to_none=True)
        comp.zero_grad(set_to_none=True)


@pytest.mark.xfail(run=False, reason=(
    "known bug (H200, torch 2.11, 2026-12-01): after the eager twin ran both shapes, capturing the "
    "second shape fails (cudaErrorStreamCaptureInvalidated); the layer falls back to eager with a "
    "RuntimeWarning, but the failed capture leaves torch's CUDA generator in capture state, so later "
    "random kernels in the process raise ('Offset increment outside graph capture'). Not run: it "
    "poisons the tests after it. Alone in a process the same sequence (eager twin, then both shapes) "
    "captures fine in thread_local, relaxed and global capture modes; it fails only after this "
    "file's earlier cases ran in the same process (still so with --runxfail, 2026-12-01, session 8)."))
def test_cuda_graph_option_shapes_interleave_and_retained_graph_raises(comm):
    """Two shapes (two graphs, separate memory) forward A, forward B, backward B, backward A;
    then a graph retained across a later call of the same shape raises instead of misleading."""
    ref, lay = _layer(comm, 2), _layer(comm, 2, cuda_graph=True)
    xa, xb = _inputs(1, seed=8)[0], _inputs(1, seed=9)[0][: T // 2]
    for m in (ref, lay):  # captures both shapes
        for x in (xa, xb):
            m(x).sum().backward()
        m.zero_grad(set_to_none=True)
    got = []
    for m in (ref, lay):
        a, b = xa.clone().requires_grad_(True), xb.clone().requires_grad_(True)
        la = m(a).square().mean() + m.aux_loss
        lb = m(b).square().mean() + m.aux_loss
        lb.backward()
        la.backward()
        got.append((a.grad, b.grad, _grads(m)))
    assert len(lay._graphed) == 2
    _close(got[1][0], got[0][0], "a.grad", 1e-5)
    _close(got[1][1], got[0][1], "b.grad", 1e-5)
    _compare_grads(got[1][2], got[0][2], 1e-5)
    loss = lay(xa.clone().requires_grad_(True)).sum()
    loss.backward(retain_graph=True)
    lay(xa.clone().requires_grad_(True)).sum().backward()
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
