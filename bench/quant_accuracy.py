"""Accuracy of FP8 dispatch: the MoE layer's output with its dispatched tokens sent in FP8,
against the same layer in bf16, on normal and heavy-tailed (Student-t) activations.

Runs in one process: the dispatch exchange's effect is applied to the experts' input by
hand (every token row goes through ``quantize_rows``/``dequantize_rows``), which is what
``MoELayer(wire_dtype=)`` computes on several ranks, bit for bit
(``tests/ranks/quant_checks.py::check_moe_layer``)::

    python3 -m bench.quant_accuracy --model-dim 1024 --tokens 2048
"""

from __future__ import annotations

import argparse

import torch

from ._common import prog

import moecomm
from moecomm import quant
from moecomm.moe import MoELayer


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog=prog(__spec__.name), description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    comm = moecomm.init(backend="mpi")
    layer = MoELayer(args.model_dim, args.hidden, args.experts, k=2, comm=comm, seed=1, dtype=torch.bfloat16).eval()
    plain = layer._run_experts

    def roundtrip(rows: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
        return quant.dequantize_rows(*quant.quantize_rows(rows, wire), rows.dtype)

    shape = (args.tokens, args.model_dim)
    inputs = {"normal": torch.randn(shape), "student-t (3 dof)": torch.distributions.StudentT(3.0).sample(shape)}
    results = []
    print(f"# MoELayer(model_dim={args.model_dim}, hidden={args.hidden}, experts={args.experts}, k=2), bf16, "
          f"{args.tokens} tokens: relative L2 error against bf16 dispatch")
    for name, x in inputs.items():
        x = x.bfloat16()
        with torch.no_grad():
            layer._run_experts = plain
            ref = layer(x).float()
            for wire in quant.WIRE_DTYPES:
                layer._run_experts = lambda rows, seg, w=wire: plain(roundtrip(rows, w), seg)
                err = ((layer(x).float() - ref).norm() / ref.norm()).item()
                tok = ((roundtrip(x, wire).float() - x.float()).norm() / x.float().norm()).item()
                results.append(dict(input=name, wire=str(wire), output_rel_l2=err, token_rel_l2=tok))
                print(f"{name:18s} {str(wire):22s} output {err:.4f}   dispatched tokens {tok:.4f}")
    layer._run_experts = plain
    return results


if __name__ == "__main__":
    main()
