"""On GPUs (NCCL backend): the integer agreements over the host channel never wait for the GPU.
Runs under ``mpiexec -n 2`` (an MPI channel) and ``torchrun --nproc-per-node 2`` (moecomm.init
makes a gloo group: a gloo channel); run by tests/test_host_channel.py on a GPU machine.

With about a second of GPU work queued (``torch.cuda._sleep``), ``allreduce_ints``, the
engine's ``max_int``/``gather_ints`` and an eager MoE forward with the default
``inequivalent_tokens=True`` return while the GPU is still busy with it."""

from __future__ import annotations

import torch

import moecomm
from tests.mpi_util import collective_assert, rank_main, under_torchrun

COMM = moecomm.init(backend="nccl", timeout=120, p2p_bytes=0)
W, R = COMM.size, COMM.rank
_SLEEP_CYCLES = int(3e9)  # about 1.5 s of one SM at 2 GHz


def _busy_gpu() -> None:
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES)


def check_channel_kind() -> None:
    want = "gloo" if under_torchrun() else "mpi"
    collective_assert(COMM.backend == "nccl" and COMM.host_channel == want, f"{COMM.backend} {COMM.host_channel}")


def check_agreements_do_not_wait_for_the_gpu() -> None:
    _busy_gpu()
    got = COMM.allreduce_ints([R, -R], "max")
    top = COMM.engine.max_int(R + 5, "allreduce")
    table = COMM.engine.gather_ints([R], "check")
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    ok = got == [W - 1, 0] and top == W + 4 and table == [[r] for r in range(W)]
    collective_assert(ok and busy, f"values {got} {top} {table}; GPU still busy on return: {busy}")


def check_moe_forward_does_not_wait_for_the_gpu() -> None:
    from moecomm.moe import MoELayer

    torch.manual_seed(0)
    moe = MoELayer(model_dim=64, hidden_size=128, num_experts=2 * W, k=2, capacity_factor=1.0, comm=COMM)
    x = torch.randn(96 + 7 * R, 64, device=COMM.device)  # a different token count on each rank
    for _ in range(2):  # warm-up: kernels built, caches filled
        moe(x).sum().backward()
    torch.cuda.synchronize()
    _busy_gpu()
    y = moe(x)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    collective_assert(busy and bool(torch.isfinite(y).all()), f"GPU still busy after the forward returned: {busy}")


ALL = [check_channel_kind, check_agreements_do_not_wait_for_the_gpu, check_moe_forward_does_not_wait_for_the_gpu]

if __name__ == "__main__":
    try:
        rank_main(ALL)
    finally:
        COMM.close()
