"""The built-in experts' weight-gradient sum over pipelined stages (moecomm.moe.experts.WeightGradSum)."""

import pytest
import torch

from moecomm.moe.experts import FFNExperts, Segments, WeightGradSum


def _stages(layout: str):
    """Two stages' row layouts (and the whole) for the uniform and the variable path."""
    if layout == "uniform":
        return [lambda s: Segments.uniform_blocks(1, 3, 4, s), lambda s: Segments.uniform_blocks(2, 3, 4, s)]
    return [lambda s: Segments([[2, 0, 3]], 3, wgrad_sum=s), lambda s: Segments([[1, 4, 0], [0, 2, 5]], 3, wgrad_sum=s)]


@pytest.mark.parametrize("layout", ["uniform", "variable"])
@pytest.mark.parametrize("retain", [False, True])
def test_stages_sum_weight_gradients_once(layout, retain):
    torch.manual_seed(0)
    ex = FFNExperts(5, 6, 3, dtype=torch.float64)
    makers = _stages(layout)
    rows = [m(None).rows for m in makers]
    xs = [torch.randn(n, 5, dtype=torch.float64, requires_grad=True) for n in rows]
    gys = [torch.randn(n, 5, dtype=torch.float64) for n in rows]

    def run(share):
        for p in ex.parameters():
            p.grad = None
        for x in xs:
            x.grad = None
        outs = [ex(x, m(share)) for x, m in zip(xs, makers)]
        torch.autograd.backward(outs, gys, retain_graph=retain)
        if retain:  # a second backward through the same graph starts the sums afresh
            for p in ex.parameters():
                p.grad = None
            torch.autograd.backward(outs, gys)
        return [p.grad.clone() for p in ex.parameters()] + [x.grad.clone() for x in xs]

    ref = run(None)  # autograd adds the stages' gradients
    got = run(WeightGradSum())
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_one_stage_without_rows_still_returns_the_sum():
    torch.manual_seed(1)
    ex = FFNExperts(4, 4, 2, dtype=torch.float64)
    share = WeightGradSum()
    x0 = torch.randn(0, 4, dtype=torch.float64, requires_grad=True)
    x1 = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = [ex(x0, Segments.uniform_blocks(0, 2, 3, share)), ex(x1, Segments.uniform_blocks(1, 2, 3, share))]
    torch.autograd.backward(y, [torch.ones_like(t) for t in y])
    got = ex.fc1_weight.grad.clone()
    ex.fc1_weight.grad = None
    ex(x1, Segments.uniform_blocks(1, 2, 3)).sum().backward()
    torch.testing.assert_close(got, ex.fc1_weight.grad)
