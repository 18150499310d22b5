"""A small MoE step written against torch.distributed only: the migration test's script.

``tests/test_migration.py`` runs it as it is and with its one ``import torch.distributed as
dist`` line changed to ``import moecomm.distributed as dist``, under torchrun and under
mpiexec, and compares the two runs' outputs. Nothing else in it knows moecomm.

Usage: ``torchrun --standalone --nproc-per-node N torch_moe_script.py OUT_DIR [cuda]`` (or
under mpiexec with ``MASTER_ADDR``/``MASTER_PORT`` set). Gloo on CPU tensors, or with ``cuda``
NCCL on ``cuda:LOCAL_RANK``. Each rank writes ``OUT_DIR/rank{r}.pt`` and checks its result
against a dense reference computed locally.
"""

import os
import sys

import torch
import torch.distributed as dist

HIDDEN = 4
EXPERTS_PER_RANK = 2
CAPACITY = 1  # slots per expert per source rank in the capacity (padded) dispatch


def _mpi_launcher_env() -> None:
    # mpiexec sets no torch variables: env:// takes rank and size from the MPI launcher's own.
    for ours, theirs in (("RANK", ("PMI_RANK", "OMPI_COMM_WORLD_RANK")),
                         ("WORLD_SIZE", ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))):
        if ours not in os.environ:
            for name in theirs:
                if name in os.environ:
                    os.environ[ours] = os.environ[name]
                    break


def main(out_dir: str, device: str = "cpu") -> None:
    _mpi_launcher_env()
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device == "cpu" else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    experts = EXPERTS_PER_RANK * world
    shared = torch.Generator().manual_seed(1234)
    gate_w = torch.randn(HIDDEN, experts, generator=shared, dtype=torch.float64).to(device)
    expert_w = torch.randn(experts, HIDDEN, HIDDEN, generator=shared, dtype=torch.float64).to(device)
    mine = torch.Generator().manual_seed(100 + rank)
    tokens = 2 + 3 * rank  # a different number of tokens on every rank
    x = torch.randn(tokens, HIDDEN, generator=mine, dtype=torch.float64).to(device)

    probs = torch.softmax(x @ gate_w, dim=1)
    prob, expert = probs.max(dim=1)
    owner = expert // EXPERTS_PER_RANK
    dense = torch.einsum("th,thk->tk", x, expert_w[expert]) * prob[:, None]

    # dropless dispatch: counts, then rows with split sizes, and back
    order = torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    sent, got = send_counts.tolist(), recv_counts.tolist()
    rows = torch.empty(sum(got), HIDDEN, dtype=x.dtype, device=device)
    dist.all_to_all_single(rows, x[order], got, sent)
    row_expert = torch.empty(sum(got), dtype=torch.int64, device=device)
    dist.all_to_all_single(row_expert, expert[order].contiguous(), got, sent)
    computed = torch.einsum("th,thk->tk", rows, expert_w[row_expert])
    back = torch.empty(tokens, HIDDEN, dtype=x.dtype, device=device)
    dist.all_to_all_single(back, computed, sent, got, async_op=True).wait()
    dropless = torch.empty_like(back)
    dropless[order] = back * prob[order, None]

    # capacity dispatch: one [experts per rank, CAPACITY, HIDDEN] block per peer, a list all_to_all
    blocks = [torch.zeros(EXPERTS_PER_RANK, CAPACITY, HIDDEN, dtype=x.dtype, device=device) for _ in range(world)]
    slot_of = torch.full((tokens,), -1, dtype=torch.int64, device=device)
    used = [0] * experts
    for t in range(tokens):
        e = int(expert[t])
        if used[e] < CAPACITY:
            slot_of[t] = used[e]
            blocks[e // EXPERTS_PER_RANK][e % EXPERTS_PER_RANK, used[e]] = x[t]
            used[e] += 1
    arrived = [torch.empty_like(b) for b in blocks]
    dist.all_to_all(arrived, blocks)
    local_w = expert_w[rank * EXPERTS_PER_RANK:(rank + 1) * EXPERTS_PER_RANK]
    results = [torch.einsum("ech,ehk->eck", a, local_w) for a in arrived]
    returned = [torch.empty_like(r) for r in results]
    dist.all_to_all(returned, results, async_op=True).wait()
    capacity = torch.zeros_like(x)
    for t in range(tokens):
        if slot_of[t] >= 0:
            e = int(expert[t])
            capacity[t] = returned[e // EXPERTS_PER_RANK][e % EXPERTS_PER_RANK, slot_of[t]] * prob[t]

    kept = slot_of >= 0
    torch.testing.assert_close(dropless, dense)
    torch.testing.assert_close(capacity[kept], dense[kept])
    assert not capacity[~kept].any()
    torch.save({k: v.cpu() for k, v in dict(dropless=dropless, capacity=capacity, recv_counts=recv_counts,
                                            kept=kept).items()},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
