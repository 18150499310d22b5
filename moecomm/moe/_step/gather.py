"""Data-parallel mode: every rank gathers all experts' weights (differentiably).

Forward: one ``all_gather_v`` of this rank's expert parameters (flattened together).
Backward: a reduce-scatter done as one ``all_to_all_v`` (each rank sends every other rank
the gradient of that rank's parameters) followed by a sum, so each rank gets the gradient
of its own parameters summed over all ranks' tokens.
"""

from __future__ import annotations

import math

from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["gather_expert_params"]


def _assemble(parts: Tensor, shapes: list, specs: list, world: int, shards: int) -> list[Optional[Tensor]]:
    """``parts``: ``[world, total]`` flat local parameters of every rank -> full parameters."""
    out, off = [], 0
    for shape, spec in zip(shapes, specs):
        if shape is None:
            out.append(None)
            continue
        n = math.prod(shape)
        per_rank = parts[:, off:off + n].reshape(world, *shape)  # [W, El, ...]
        off += n
        _, shard_axis, replicated = spec
        if shards == 1:
            out.append(per_rank.reshape(world * shape[0], *shape[1:]))
        else:
            E = world // shards
            grid = per_rank.reshape(E, shards, *shape)  # [E, S, 1, ...]
            if replicated:
                out.append(grid[:, 0].reshape(E, *shape[1:]))
            else:
                pieces = [grid[:, s].reshape(E, *shape[1:]) for s in range(shards)]
                out.append(torch.cat(pieces, dim=shard_axis))
    return out


class _GatherExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, specs, shards, *params):  # type: ignore[override]
        world = comm.size
        shapes = [None if p is None else tuple(p.shape) for p in params]
        present = [p for p in params if p is not None]
        flat = torch.cat([p.reshape(-1) for p in present]) if present else None
        gathered, _ = comm.all_gather_v(flat.view(1, -1).contiguous())  # [W, total]
        ctx.comm, ctx.specs, ctx.shards, ctx.shapes = comm, specs, shards, shapes
        ctx.total = flat.numel()
        ctx.dtype = flat.dtype
        return tuple(_assemble(gathered, shapes, specs, world, shards))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # type: ignore[override]
        comm, specs, shards, shapes = ctx.comm, ctx.specs, ctx.shards, ctx.shapes
        world = comm.size
        E = world // shards
        # send[q] = gradient of rank q's local parameters (flattened in the same order)
        blocks = []
        for g, shape, spec in zip(grads, shapes, specs):
            if shape is None:
                continue
            if g is None:
                blocks.append(torch.zeros(world, *shape, dtype=ctx.dtype, device=comm.device).reshape(world, -1))
                continue
            g = g.to(ctx.dtype)
            _, shard_axis, replicated = spec
            if shards == 1:
                blocks.append(g.reshape(world, -1))
            elif replicated:
                blocks.append(g.unsqueeze(1).expand(E, shards, *g.shape[1:]).reshape(world, -1))
            else:
                pieces = torch.chunk(g, shards, dim=shard_axis)  # each [E, ...]
                blocks.append(torch.stack(pieces, dim=1).reshape(world, -1))
        send = torch.cat(blocks, dim=1).contiguous()  # [W, total]
        recv, _ = comm.all_to_all_v(send, [1] * world, [1] * world)
        summed = recv.to(torch.float64 if ctx.dtype == torch.float64 else torch.float32).sum(0).to(ctx.dtype)
        out, off = [], 0
        for shape in shapes:
            if shape is None:
                out.append(None)
                continue
            n = math.prod(shape)
            out.append(summed[off:off + n].view(shape))
            off += n
        return (None, None, None, *out)


def gather_expert_params(comm, specs: Sequence[tuple], shards: int, params: Sequence[Optional[Tensor]]):
    """Full ``[num_experts, ...]`` parameters from every rank's local ones (differentiable).

    ``specs[i]`` is ``(expert_axis, shard_axis, replicated_over_shards)`` of ``params[i]``.
    """
    if comm.size == 1:
        return list(params)
    return list(_GatherExperts.apply(comm, list(specs), shards, *params))
