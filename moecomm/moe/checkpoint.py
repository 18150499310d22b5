"""Expert-weight checkpoints across world sizes.

A *per-rank* file holds one rank's ``state_dict`` of a model containing
:class:`~moecomm.moe.MoELayer` s, plus a description of every layer's expert parameters::

    {"format": "moecomm.moe.checkpoint", "version": 1, "world_size": W, "rank": r,
     "layers": {prefix: {"num_experts": E, "num_local_experts": El, "shards": S,
                         "params": {name: [expert_axis, shard_axis or None, replicated_over_shards]}}},
     "state_dict": {...}}

A *full* file is the same for ``world_size`` 1 (every expert whole and local): exactly what
a single-process model saves. ``gather`` turns the per-rank files of any world size into the
full file; ``scatter`` turns a full file into per-rank files for any world size whose ranks
the experts divide (or that divides over the experts, sharding each along its hidden
dimension). Parameters outside the experts are replicated: ``gather`` keeps rank 0's copy
and checks that every rank holds the same bits (``--allow-divergent`` to take rank 0's
anyway). Conversions are exact (bit for bit), on the CPU.

Command line::

    python -m moecomm.moe.checkpoint gather --input 'ckpt/moe.{rank}-of-{size}.pt' --output full.pt
    python -m moecomm.moe.checkpoint scatter --input full.pt --size 8 --output 'ckpt8/moe.{rank}-of-{size}.pt'

From code: :func:`save` / :func:`load` (per rank, inside the job) and :func:`gather` /
:func:`scatter` (offline).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["FORMAT", "save", "load", "gather", "scatter", "describe", "main"]

FORMAT = "moecomm.moe.checkpoint"
VERSION = 1


# -- inside the job ----------------------------------------------------------------------------


def describe(model: nn.Module) -> dict:
    """The ``layers`` entry of a checkpoint: every MoELayer of ``model`` by state-dict prefix."""
    from .layer import MoELayer

    layers = {}
    for name, mod in model.named_modules():
        if isinstance(mod, MoELayer):
            spec = mod.expert_checkpoint_spec()
            if not spec:
                raise ValueError(f"{name or 'model'}: its user expert module declares no moe_checkpoint_spec(); "
                                 f"checkpoints cannot be converted between world sizes")
            layers[f"{name}." if name else ""] = {
                "num_experts": mod.num_experts, "num_local_experts": mod.num_local_experts,
                "shards": mod.shards, "params": {k: list(v) for k, v in spec.items()}}
    return layers


def _world(model: nn.Module) -> tuple[int, int]:
    from .layer import MoELayer

    for mod in model.modules():
        if isinstance(mod, MoELayer):
            return mod.comm.rank, mod.comm.size
    return 0, 1


def _path(pattern: str, rank: int, size: int) -> str:
    if "{rank}" not in pattern and size > 1:
        raise ValueError(f"path pattern {pattern!r} must contain '{{rank}}' (and may contain '{{size}}')")
    return pattern.format(rank=rank, size=size)


def save(model: nn.Module, pattern: str) -> str:
    """Write this rank's file ``pattern.format(rank=, size=)``; returns its path."""
    rank, size = _world(model)
    path = _path(pattern, rank, size)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save({"format": FORMAT, "version": VERSION, "world_size": size, "rank": rank,
                "layers": describe(model), "state_dict": sd}, path)
    return path


def load(model: nn.Module, pattern: str, *, strict: bool = True) -> Any:
    """Load this rank's file (written for the model's world size, e.g. by :func:`scatter`)."""
    rank, size = _world(model)
    ck = _read(_path(pattern, rank, size))
    if ck["world_size"] != size or ck["rank"] != rank:
        raise ValueError(f"{_path(pattern, rank, size)} is rank {ck['rank']} of {ck['world_size']}, "
                         f"but this is rank {rank} of {size}: convert it with scatter first")
    mine = describe(model)
    for prefix, meta in mine.items():
        theirs = ck["layers"].get(prefix)
        if theirs is None or theirs["num_experts"] != meta["num_experts"] or theirs["shards"] != meta["shards"]:
            raise ValueError(f"layer {prefix!r}: checkpoint has {theirs}, the model {meta}")
    dev_sd = model.state_dict()
    sd = {k: v.to(dev_sd[k].device) if k in dev_sd else v for k, v in ck["state_dict"].items()}
    return model.load_state_dict(sd, strict=strict)


# -- offline conversion ------------------------------------------------------------------------


def _read(path: str) -> dict:
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file")
    if ck.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported checkpoint version {ck.get('version')} (this is {VERSION})")
    return ck


def _expert_keys(layers: dict, sd: dict) -> dict:
    """``{state_dict key: (layer prefix, spec)}`` for every expert parameter."""
    out = {}
    for prefix, meta in layers.items():
        for name, spec in meta["params"].items():
            if spec[0] == "module_index":
                head = prefix + name  # e.g. "moe.experts.local."
                for k in sd:
                    if k.startswith(head):
                        out[k] = (prefix, spec)
            else:
                key = prefix + name
                if key not in sd:
                    raise ValueError(f"checkpoint lacks expert parameter {key!r}")
                out[key] = (prefix, spec)
    return out


def _split_index(key: str, head: str) -> tuple[int, str]:
    m = re.match(r"(\d+)\.(.*)", key[len(head):])
    if m is None:
        raise ValueError(f"expert module key {key!r} does not follow {head}<index>.<name>")
    return int(m.group(1)), m.group(2)


def gather(pattern: str, output: Optional[str] = None, *, size: Optional[int] = None,
           allow_divergent: bool = False) -> dict:
    """Per-rank files (``pattern`` with ``{rank}``, maybe ``{size}``) -> the full checkpoint."""
    if size is None:
        probe = pattern.replace("{size}", "*").format(rank=0)
        found = sorted(glob.glob(probe))
        if not found:
            raise FileNotFoundError(f"no file matches {probe!r} (rank 0 of {pattern!r})")
        size = _read(found[0])["world_size"]
    cks = [_read(_path(pattern, r, size)) for r in range(size)]
    for r, ck in enumerate(cks):
        if ck["world_size"] != size or ck["rank"] != r:
            raise ValueError(f"{_path(pattern, r, size)} says it is rank {ck['rank']} of {ck['world_size']}, "
                             f"expected rank {r} of {size}")
    layers = cks[0]["layers"]
    sds = [ck["state_dict"] for ck in cks]
    experts = _expert_keys(layers, sds[0])
    out: dict = {}
    for key, ref in sds[0].items():
        if key in experts:
            continue
        for r in range(1, size):
            if key not in sds[r] or not torch.equal(sds[r][key], ref):
                if not allow_divergent:
                    raise ValueError(f"replicated parameter {key!r} differs between rank 0 and rank {r} "
                                     f"(use allow_divergent / --allow-divergent to keep rank 0's)")
        out[key] = ref.clone()
    for key, (prefix, spec) in experts.items():
        meta = layers[prefix]
        El, S = meta["num_local_experts"], meta["shards"]
        if spec[0] == "module_index":
            head = prefix + next(n for n, s in meta["params"].items() if s[0] == "module_index")
            i, rest = _split_index(key, head)
            for r in range(size):
                out[f"{head}{r * El + i}.{rest}"] = sds[r][key].clone()
            continue
        _, shard_axis, replicated = spec
        parts = [sd[key] for sd in sds]
        if S == 1:
            out[key] = torch.cat(parts, dim=0)
            continue
        E = size // S
        whole = []
        for e in range(E):
            pieces = parts[e * S:(e + 1) * S]
            if replicated:
                for s in range(1, S):
                    if not torch.equal(pieces[s], pieces[0]) and not allow_divergent:
                        raise ValueError(f"{key!r} of expert {e} differs between its shards 0 and {s}")
                whole.append(pieces[0])
            else:
                whole.append(torch.cat(pieces, dim=shard_axis))
        out[key] = torch.cat(whole, dim=0)
    new_layers = {p: dict(m, num_local_experts=m["num_experts"], shards=1) for p, m in layers.items()}
    full = {"format": FORMAT, "version": VERSION, "world_size": 1, "rank": 0, "layers": new_layers,
            "state_dict": out}
    if output is not None:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        torch.save(full, output)
    return full


def _layout(num_experts: int, size: int, what: str) -> tuple[int, int]:
    if num_experts >= size:
        if num_experts % size:
            raise ValueError(f"{what}: {num_experts} experts cannot be split over {size} ranks "
                             f"(the world size must divide the number of experts, or be a multiple of it)")
        return num_experts // size, 1
    if size % num_experts:
        raise ValueError(f"{what}: {num_experts} experts cannot be sharded over {size} ranks "
                         f"(the world size must be a multiple of the number of experts)")
    return 1, size // num_experts


def scatter(source: Any, pattern: Optional[str], size: int) -> list[dict]:
    """The full checkpoint (a path or the dict of :func:`gather`) -> ``size`` per-rank files."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    full = _read(source) if isinstance(source, str) else source
    if full["world_size"] != 1:
        raise ValueError(f"scatter needs a full checkpoint (world_size 1), got one of world size "
                         f"{full['world_size']}: gather it first")
    layers, sd = full["layers"], full["state_dict"]
    experts = _expert_keys(layers, sd)
    plans = {p: _layout(m["num_experts"], size, f"layer {p!r}") for p, m in layers.items()}
    outs = []
    for r in range(size):
        rsd: dict = {}
        for key, t in sd.items():
            if key not in experts:
                rsd[key] = t.clone()
        for key, (prefix, spec) in experts.items():
            El, S = plans[prefix]
            if spec[0] == "module_index":
                head = prefix + next(n for n, s in layers[prefix]["params"].items() if s[0] == "module_index")
                e, rest = _split_index(key, head)
                if r * El <= e < (r + 1) * El:
                    rsd[f"{head}{e - r * El}.{rest}"] = sd[key].clone()
                continue
            _, shard_axis, replicated = spec
            t = sd[key]
            if S == 1:
                rsd[key] = t[r * El:(r + 1) * El].clone()
                continue
            if spec[0] == "module_index" or shard_axis is None and not replicated:
                raise ValueError(f"{key!r} cannot be sharded")
            e, s = r // S, r % S
            one = t[e:e + 1]
            if replicated:
                rsd[key] = one.clone()
            else:
                n = one.shape[shard_axis]
                if n % S:
                    raise ValueError(f"{key!r}: dimension {shard_axis} of size {n} cannot be sharded {S} ways "
                                     f"(world size {size})")
                w = n // S
                rsd[key] = one.narrow(shard_axis, s * w, w).clone()
        new_layers = {p: dict(m, num_local_experts=plans[p][0], shards=plans[p][1]) for p, m in layers.items()}
        ck = {"format": FORMAT, "version": VERSION, "world_size": size, "rank": r, "layers": new_layers,
              "state_dict": rsd}
        if pattern is not None:
            path = _path(pattern, r, size)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save(ck, path)
        outs.append(ck)
    return outs


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moecomm.moe.checkpoint",
                                 description="Convert MoE expert checkpoints between world sizes (CPU).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gather", help="per-rank files -> one full file")
    g.add_argument("--input", required=True, help="per-rank path pattern with {rank} (and optionally {size})")
    g.add_argument("--output", required=True, help="the full checkpoint to write")
    g.add_argument("--size", type=int, default=None, help="source world size (default: read from rank 0's file)")
    g.add_argument("--allow-divergent", action="store_true",
                   help="keep rank 0's copy of replicated parameters that differ between ranks")
    s = sub.add_parser("scatter", help="one full file -> per-rank files")
    s.add_argument("--input", required=True, help="the full checkpoint")
    s.add_argument("--output", required=True, help="per-rank path pattern with {rank} (and optionally {size})")
    s.add_argument("--size", type=int, required=True, help="target world size")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "gather":
            full = gather(args.input, args.output, size=args.size, allow_divergent=args.allow_divergent)
            n = len(full["state_dict"])
            print(f"wrote {args.output}: {n} tensors, layers {sorted(full['layers'])}")
        else:
            outs = scatter(args.input, args.output, args.size)
            print(f"wrote {len(outs)} files {args.output!r} for world size {args.size}")
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
