"""moecomm_ext.permute_blocks against a numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moecomm_ext as me


def numpy_permute(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Blocks in a-major order -> b-major order, one block at a time."""
    A, B = counts.shape
    blocks = {}
    pos = 0
    for a in range(A):
        for b in range(B):
            blocks[a, b] = x[pos : pos + counts[a, b]]
            pos += counts[a, b]
    assert pos == x.shape[0]
    parts = [blocks[a, b] for b in range(B) for a in range(A)]
    return np.concatenate(parts, axis=0) if parts else x[:0]


IMPLS = [pytest.param(True, id="native"), pytest.param(False, id="reference")]


@settings(max_examples=40, deadline=None)
@given(
    A=st.integers(0, 5),
    B=st.integers(0, 5),
    max_count=st.integers(0, 6),
    trailing=st.sampled_from([(), (3,), (2, 2), (0,)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]),
    as_list=st.booleans(),
    use_native=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_permute_blocks_matches_numpy(A, B, max_count, trailing, dtype, as_list, use_native, seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, max_count + 1, size=(A, B))
    counts[rng.random((A, B)) < 0.3] = 0  # plenty of empty blocks
    N = int(counts.sum())
    x = torch.from_numpy(rng.integers(0, 100, size=(N, *trailing))).to(dtype)
    c = counts.tolist() if as_list else torch.from_numpy(counts)
    out = me.permute_blocks(x, c, use_native=use_native)
    xf = x.float().numpy() if dtype == torch.bfloat16 else x.numpy()
    expected = numpy_permute(xf, counts)
    assert out.shape == x.shape and out.dtype == dtype
    got = out.float().numpy() if dtype == torch.bfloat16 else out.numpy()
    np.testing.assert_array_equal(got, expected)
    # inverse: b-major -> a-major undoes it; equals the forward with counts.T
    back = me.permute_blocks(out, c, inverse=True, use_native=use_native)
    assert torch.equal(back, x)
    assert torch.equal(back, me.permute_blocks(out, torch.from_numpy(counts.T.copy()), use_native=use_native))


def test_permute_blocks_example():
    # A=2 (nodes), B=3 (local ranks); block (a, b) holds counts[a][b] rows
    counts = [[1, 0, 2], [2, 1, 0]]
    x = torch.tensor([10, 20, 21, 30, 31, 40])  # (0,0)=10 (0,2)=20,21 (1,0)=30,31 (1,1)=40
    out = me.permute_blocks(x, counts)
    assert out.tolist() == [10, 30, 31, 40, 20, 21]


@pytest.mark.parametrize("use_native", IMPLS)
def test_permute_blocks_gradient(use_native):
    counts = torch.tensor([[2, 0, 1], [1, 3, 2]])
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: me.permute_blocks(x, counts, use_native=use_native), (x,))
    assert torch.autograd.gradcheck(
        lambda x: me.permute_blocks(x, counts, inverse=True, use_native=use_native), (x,)
    )


def test_permute_blocks_bad_inputs():
    x = torch.randn(6, 2)
    with pytest.raises(ValueError, match="'counts'.*sum"):
        me.permute_blocks(x, [[1, 2], [3, 1]])
    with pytest.raises(ValueError, match="'counts'.*non-negative"):
        me.permute_blocks(x, [[4, -1], [3, 0]])
    with pytest.raises(ValueError, match="'counts'.*ragged"):
        me.permute_blocks(x, [[4, 1], [1]])
    with pytest.raises(ValueError, match="'counts'.*2-D"):
        me.permute_blocks(x, torch.tensor([6]))
    with pytest.raises(TypeError, match="'counts'.*integer"):
        me.permute_blocks(x, torch.tensor([[6.0]]))
    with pytest.raises(TypeError, match="'counts'"):
        me.permute_blocks(x, 6)
    with pytest.raises(ValueError, match="'x'"):
        me.permute_blocks(torch.tensor(1.0), [[1]])
