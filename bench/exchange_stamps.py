"""GPU time stamps around every exchange of the MoE layer's steps, comparable across ranks that
share one GPU (issue 26: where a 4-rank step's exchange barriers spend their time).

``bench.moe_layer --stamps N`` wraps the communicator's ``all_to_all_single`` (the layer's
capacity exchanges) for N steps: a one-thread kernel on the caller's stream writes the GPU's
``%globaltimer`` (nanoseconds, one clock for every process on the GPU) just before the
exchange (when this rank's stream *arrives*: its compute before it is done) and just after it
(when the exchange is *done* here: the stream waited for it). No profiler runs, so the hosts
keep their speed. Rank 0 prints, per exchange: how far apart the ranks arrived, which rank came
last, how long the exchange took after the last arrival, and each rank's compute before it.

The stamp kernel is compiled on first use with ``torch.utils.cpp_extension.load_inline``
(nvcc; cached in torch's extensions folder); it is a benchmark's tool, not part of the package.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

__all__ = ["ExchangeStamps", "summarize"]

_CUDA = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
__global__ void stamp_kernel(long long* slot) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *slot = (long long)t;
}
void stamp(torch::Tensor buf, int64_t i, int64_t stream) {
  stamp_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<long long*>(buf.data_ptr<int64_t>()) + i);
}
"""


def _module() -> Any:
    from torch.utils.cpp_extension import load_inline

    return load_inline(name="moecomm_bench_stamps", cpp_sources="void stamp(torch::Tensor buf, int64_t i, int64_t stream);",
                       cuda_sources=_CUDA, functions=["stamp"], verbose=False)


class ExchangeStamps:
    """Stamps before and after each ``comm.all_to_all_single`` while installed (``with``)."""

    def __init__(self, comm: Any, capacity: int = 4096, stamp: Optional[Callable[[torch.Tensor, int], None]] = None):
        self.comm = comm
        self.buf = torch.zeros(2 * capacity, dtype=torch.int64, device=comm.device)
        self.count = 0
        if stamp is None:
            native = _module().stamp
            stamp = lambda buf, i: native(buf, i, torch.cuda.current_stream(buf.device).cuda_stream)  # noqa: E731
        self._stamp = stamp

    def _mark(self) -> None:
        if self.count >= self.buf.numel():
            raise RuntimeError(f"ExchangeStamps: more than {self.buf.numel() // 2} exchanges stamped")
        self._stamp(self.buf, self.count)
        self.count += 1

    def __enter__(self) -> "ExchangeStamps":
        inner = self.comm.all_to_all_single

        def stamped(*args: Any, **kw: Any) -> Any:
            self._mark()
            out = inner(*args, **kw)
            self._mark()
            return out

        self.comm.all_to_all_single = stamped  # an instance attribute: the class's method stays as it is
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.comm.all_to_all_single

    def collect(self) -> np.ndarray:
        """``[exchanges, 2]`` (arrived, done) in nanoseconds, after a device synchronisation."""
        if self.buf.is_cuda:
            torch.cuda.synchronize(self.buf.device)
        return self.buf[: self.count].cpu().numpy().reshape(-1, 2)


def summarize(per_rank: list[np.ndarray], per_step: int, show: int = 8) -> str:
    """The report of :mod:`bench.exchange_stamps` from every rank's ``collect()``: rows of
    (arrived, done) ns, the same exchanges in the same order on every rank; ``per_step``
    exchanges make one step."""
    n = min(len(s) for s in per_rank)
    if n == 0:
        return "no exchange was stamped"
    arrived = np.stack([s[:n, 0] for s in per_rank]).astype(np.float64)  # [ranks, exchanges]
    done = np.stack([s[:n, 1] for s in per_rank]).astype(np.float64)
    last = arrived.max(0)
    spread = (last - arrived.min(0)) / 1e3
    after_last = (done.max(0) - last) / 1e3
    compute = np.full_like(arrived, np.nan)
    compute[:, 1:] = (arrived[:, 1:] - done[:, :-1]) / 1e3  # each rank's work between two exchanges
    lines = [f"{len(per_rank)} ranks, {n} exchanges stamped ({per_step} a step); microseconds",
             f"{'exchange':>8} {'spread':>8} {'last':>5} {'after_last':>10}  compute before it, per rank"]
    for i in range(min(n, show)):
        work = " ".join("-" if np.isnan(c) else f"{c:.0f}" for c in compute[:, i])
        lines.append(f"{i:>8} {spread[i]:>8.1f} {int(arrived[:, i].argmax()):>5} {after_last[i]:>10.1f}  {work}")
    steps = n // per_step
    if steps:
        span = (done.max(0)[steps * per_step - 1] - arrived.min(0)[0]) / 1e3 / steps
        lines.append(f"per step (mean of {steps}): {span:.1f} us from the first arrival to the last exchange done; "
                     f"exchanges after their last arrival {after_last[:steps * per_step].sum() / steps:.1f} us; "
                     f"arrivals apart {spread[:steps * per_step].sum() / steps:.1f} us; ranks last (count): "
                     f"{np.bincount(arrived[:, :steps * per_step].argmax(0), minlength=len(per_rank)).tolist()}")
    return "\n".join(lines)
