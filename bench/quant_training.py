"""A small MoE model trained on CPU ranks with bf16 dispatch and with FP8 dispatch
(``MoELayer(wire_dtype=)``), from the same initial weights and data: the loss curves side
by side. Run under MPI (expert-parallel needs at least 2 ranks)::

    mpiexec -n 2 python3 -m bench.quant_training --steps 200
"""

from __future__ import annotations

import argparse
import json

import torch

from ._common import prog

import moecomm
from moecomm.moe import MoELayer


def train(comm, args, wire_dtype) -> list[float]:
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in both runs
    layer = MoELayer(args.model_dim, args.hidden, args.experts, k=2, comm=comm, seed=args.seed,
                     dtype=torch.bfloat16, wire_dtype=wire_dtype)
    head = torch.nn.Linear(args.model_dim, 1, dtype=torch.bfloat16)
    params = list(layer.parameters()) + list(head.parameters())
    shared = [p for n, p in layer.named_parameters() if "experts" not in n] + list(head.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)
    g = torch.Generator().manual_seed(1000 + comm.rank)  # each rank its own tokens, the same in both runs
    teacher = torch.randn(args.model_dim, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(args.steps):
        x = torch.randn(args.tokens, args.model_dim, generator=g)
        target = torch.tanh(x @ teacher / args.model_dim ** 0.5).unsqueeze(1) + 0.3 * torch.sin(3 * x[:, :1])
        x = x.bfloat16()
        y = head(layer(x)).float()
        loss = torch.nn.functional.mse_loss(y, target) + 0.01 * layer.aux_loss.float()
        opt.zero_grad()
        loss.backward()
        for p in shared:  # data-parallel parts: average their gradients over the ranks
            grad = p.grad.float()
            comm.allreduce(grad)
            p.grad.copy_(grad / comm.size)
        opt.step()
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        comm.allreduce(mean)
        losses.append(mean.item() / comm.size)
    return losses


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog=prog(__spec__.name), description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--model-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank and step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    comm = moecomm.init(backend="mpi")
    runs = {"bf16": train(comm, args, None), "float8_e4m3fn": train(comm, args, torch.float8_e4m3fn)}
    if comm.rank == 0:
        base, fp8 = runs["bf16"], runs["float8_e4m3fn"]
        window = max(1, args.steps // 10)
        print(f"# {comm.size} ranks, MoELayer(model_dim={args.model_dim}, hidden={args.hidden}, "
              f"experts={args.experts}, k=2), bf16, {args.tokens} tokens/rank, Adam lr {args.lr}")
        print(f"{'step':>5} {'bf16 dispatch':>14} {'fp8 dispatch':>13} {'fp8/bf16':>9}")
        for i in list(range(0, args.steps, max(1, args.steps // 10))) + [args.steps - 1]:
            print(f"{i:>5} {base[i]:>14.5f} {fp8[i]:>13.5f} {fp8[i] / base[i]:>9.4f}")
        worst = max(abs(f / b - 1) for b, f in zip(base, fp8))
        smooth = max(abs(sum(fp8[i:i + window]) / sum(base[i:i + window]) - 1)
                     for i in range(0, args.steps - window + 1))
        tail = sum(fp8[-window:]) / sum(base[-window:])
        print(f"# largest deviation of one step {worst:.2%}, of a {window}-step mean {smooth:.2%}; "
              f"mean loss of the last {window} steps: fp8/bf16 = {tail:.4f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "losses": runs}, fh)
    return runs


if __name__ == "__main__":
    main()
