"""moecomm.graphs.capture's argument checks (the capture itself runs on a GPU in
tests/ranks/overlap_checks.py and tests/ranks/moe_layer_checks.py)."""

from __future__ import annotations

import pytest
import torch

from moecomm.graphs import capture


def _never() -> None:
    pytest.fail("step ran although the arguments were bad")


def test_bad_arguments_are_named_before_the_step_runs():
    with pytest.raises(TypeError, match="'step' must be callable"):
        capture(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'warmup' must be an int"):
        capture(_never, "cuda", warmup=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'warmup' must be >= 0"):
        capture(_never, "cuda", warmup=-1)
    with pytest.raises(ValueError, match="'device' must be a CUDA device; got cpu"):
        capture(_never, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is absent")
def test_without_cuda_capture_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        capture(_never)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        capture(_never, "cuda:0")
    from moecomm.graphs import host_synchronizations

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        host_synchronizations(_never)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replay_reruns_the_step_on_new_input():
    x = torch.zeros(8, device="cuda")
    graph, out = capture(lambda: x * 2 + 1, x.device, warmup=2)
    for _ in range(2):
        new = torch.randn(8, device="cuda")
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, new * 2 + 1)
