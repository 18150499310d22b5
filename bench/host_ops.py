"""Host cost of one MoE layer training step, counted on the CPU at tiny dims (a proxy for
the eager GPU step, whose time is bound by the host issuing it).

Per step (forward + backward, ``y`` and the aux loss): the aten operations dispatched (a
``TorchDispatchMode`` counter), the Python function calls (cProfile), the autograd nodes
of the graph, and the median wall time. The dims are tiny so that the time is the host's
cost of issuing the step, not arithmetic. Run as ``python -m bench host_ops`` (one process,
world size 1)::

    python -m bench host_ops --json /tmp/ops.json
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import json
import pstats
import statistics
import time
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moecomm
from moecomm.moe import MoELayer

__all__ = ["count_ops", "main"]


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _graph_nodes(t: torch.Tensor) -> int:
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return len(seen)


def count_ops(layer: MoELayer, x: torch.Tensor, gy: torch.Tensor, **kw) -> dict:
    """Aten ops, Python calls, autograd nodes and host ms of one ``layer(x, **kw)`` step."""
    params = list(layer.parameters()) + [x]

    def step(nodes: Optional[list] = None) -> None:
        for p in params:
            p.grad = None
        y = layer(x, **kw)
        aux = layer.aux_loss
        if nodes is not None:
            nodes.append(_graph_nodes(y) + _graph_nodes(aux))
        torch.autograd.backward([y, aux], [gy, torch.ones_like(aux)])
        layer.aux_loss = layer.balance_loss = None

    for _ in range(3):
        step()
    with _OpCounter() as c:
        step()
    nodes: list = []
    step(nodes)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        step()
    prof.disable()
    calls = pstats.Stats(prof).total_calls // 10
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        times.append((time.perf_counter() - t0) / 20 * 1e3)
    return {"aten_ops": sum(c.ops.values()), "python_calls": calls, "autograd_nodes": nodes[0],
            "host_ms": statistics.median(times), "host_ms_min": min(times), "top_ops": dict(c.ops.most_common(8))}


def main(argv: Optional[list] = None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dim", type=int, default=64, help="model_dim = hidden_size")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    comm = moecomm.init()
    rows = []
    modern = dict(score_function="sigmoid", expert_bias=True, num_groups=4, group_topk=2)
    for name, kw in (("capacity k=2", dict(k=2)), ("capacity k=3", dict(k=3)),
                     ("op-by-op k=2", dict(k=2, fused_step=False)), ("dropless k=2", dict(k=2, dropless=True)),
                     ("swiglu dropless k=2", dict(k=2, dropless=True, activation="swiglu")),
                     ("modern-routing k=2", dict(k=2, **modern))):
        layer = MoELayer(a.dim, a.dim, a.experts, seed=0, comm=comm, **kw)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(a.tokens, a.dim, generator=g).requires_grad_(True)
        gy = torch.randn(a.tokens, a.dim, generator=g)
        r = count_ops(layer, x, gy)
        r["case"] = name
        rows.append(r)
        print(f"{name:20s} aten_ops {r['aten_ops']:5d}  python_calls {r['python_calls']:5d}  "
              f"autograd_nodes {r['autograd_nodes']:3d}  host_ms {r['host_ms']:.3f} (min {r['host_ms_min']:.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
