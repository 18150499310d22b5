"""A callable activation that is exactly one known activation runs as that activation (its one
backward kernel), and any other callable keeps its own path: moecomm.moe._ops.activation_forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import moecomm
from moecomm.moe import MoELayer
from moecomm.moe.experts import _BACKWARD, resolve_activation

RECOGNISED = {
    "lambda F.relu": lambda x: F.relu(x), "lambda torch.relu": lambda x: torch.relu(x),
    "lambda x.relu()": lambda x: x.relu(), "lambda F.gelu": lambda x: F.gelu(x),
    "lambda F.gelu tanh": lambda x: F.gelu(x, approximate="tanh"), "nn.GELU('tanh')": nn.GELU(approximate="tanh"),
    "nn.ReLU()": nn.ReLU(), "nn.SiLU()": nn.SiLU(), "lambda F.silu": lambda x: F.silu(x),
    "lambda torch.sigmoid": lambda x: torch.sigmoid(x), "lambda x.tanh()": lambda x: x.tanh(),
    "nn.Identity()": nn.Identity(), "lambda x: x": lambda x: x,
}
NOT_RECOGNISED = {
    "relu times 2": lambda x: F.relu(x) * 2, "relu in place": lambda x: F.relu(x, inplace=True),
    "leaky relu": lambda x: F.leaky_relu(x), "PReLU (a parameter)": nn.PReLU(),
    "control flow on the input": lambda x: x if x.sum() > 0 else -x, "two inputs": lambda x, y=1: x * y,
    "gelu of the negation": lambda x: F.gelu(-x), "softmax (mixes elements)": lambda x: F.softmax(x, -1),
}


@pytest.mark.parametrize("name", sorted(RECOGNISED))
def test_a_callable_that_is_one_known_activation_gets_its_backward_kernel(name):
    fn = RECOGNISED[name]
    known = resolve_activation(fn)
    assert known is not fn and known in _BACKWARD, known
    x = torch.randn(7, 5, dtype=torch.float64) * 3
    assert torch.equal(known(x), fn(x))  # the same function: the same bits


@pytest.mark.parametrize("name", sorted(NOT_RECOGNISED))
def test_any_other_callable_keeps_its_own_path(name):
    fn = NOT_RECOGNISED[name]
    assert resolve_activation(fn) is fn


@given(st.sampled_from(sorted(RECOGNISED)), st.integers(0, 2 ** 16), st.sampled_from([torch.float32, torch.float64]))
@settings(max_examples=40, deadline=None)
def test_layer_with_the_callable_equals_it_through_autograd(name, seed, dtype):
    """The whole layer, forward and backward, with the callable (recognised: the known
    activation's kernels) against the same callable hidden behind a clone (not recognised:
    torch.autograd through it, the path it had before), to float rounding."""
    fn = RECOGNISED[name]
    opaque = lambda x: fn(x.clone())  # noqa: E731 - two operations: not one known activation
    assert resolve_activation(fn) is not fn and resolve_activation(opaque) is opaque
    comm = moecomm.init("self", set_default=False)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 8, generator=g, dtype=dtype)
    runs = []
    for act in (fn, opaque):
        layer = MoELayer(8, 6, 4, k=2, comm=comm, seed=seed % 97, activation=act, dtype=dtype)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        (y * torch.arange(y.numel(), dtype=dtype).reshape(y.shape).sin()).sum().backward()
        runs.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters()])
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
