"""Resharding checkpoints between world sizes: :func:`gather` (per-rank files -> the full
file) and :func:`scatter` (the full file -> per-rank files), exact and on the CPU."""

from __future__ import annotations

import glob
import os
from typing import Any, Optional

import torch

from .file import (CheckpointError, commit, layout, pack, read, refuse_overwrite, split_index, write,
                               write_temp)

__all__ = ["gather", "scatter", "rank_path"]


def rank_path(pattern: str, rank: int, size: int) -> str:
    """``pattern.format(rank=, size=)``; ValueError if it lacks ``{rank}`` on more than one rank."""
    if "{rank}" not in pattern and size > 1:
        raise ValueError(f"path pattern {pattern!r} must contain '{{rank}}' (and may contain '{{size}}')")
    return pattern.format(rank=rank, size=size)


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


def gather(pattern: str, output: Optional[str] = None, *, size: Optional[int] = None,
           allow_divergent: bool = False) -> dict:
    """Per-rank files (``pattern`` with ``{rank}``, maybe ``{size}``) -> the full checkpoint,
    also written to ``output`` if given.

    Raises:
        CheckpointError: a file is missing, unreadable, corrupt or inconsistent with the
            others (see :func:`read`), or ``output`` is one of the inputs.
        FileNotFoundError: ``size`` not given and no file matches rank 0 of ``pattern``.
        ValueError: replicated parameters differ between ranks (unless ``allow_divergent``).
    """
    if size is None:
        probe = pattern.replace("{size}", "*").format(rank=0)
        found = sorted(glob.glob(probe))
        if not found:
            raise FileNotFoundError(f"no file matches {probe!r} (rank 0 of {pattern!r})")
        if output is not None:
            refuse_overwrite([output], found, "gather")
        size = read(found[0])["world_size"]
    elif isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    paths = [rank_path(pattern, r, size) for r in range(size)]
    if output is not None:
        refuse_overwrite([output], paths, "gather")
    cks = [read(p) for p in paths]
    layers, sds = cks[0]["layers"], [ck["state_dict"] for ck in cks]
    experts = _check_ranks(cks, paths)
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
        _merge_expert(out, key, prefix, layers[prefix], spec, sds, allow_divergent)
    new_layers = {p: dict(m, num_local_experts=m["num_experts"], shards=1) for p, m in layers.items()}
    full = pack(1, 0, new_layers, out)
    if output is not None:
        write(full, output)
    return full


def _check_ranks(cks: list, paths: list) -> dict:
    """CheckpointError unless the files are ranks 0.. of one job with the same layers, tensors and
    expert tensor shapes; the expert keys (as :func:`_expert_keys`)."""
    size = len(cks)
    for r, ck in enumerate(cks):
        if ck["world_size"] != size or ck["rank"] != r:
            raise CheckpointError(f"{paths[r]} says it is rank {ck['rank']} of {ck['world_size']}, "
                                  f"expected rank {r} of {size}")
    layers, sds = cks[0]["layers"], [ck["state_dict"] for ck in cks]
    for r in range(1, size):
        if cks[r]["layers"] != layers:
            raise CheckpointError(f"{paths[r]}: its layers {cks[r]['layers']} differ from rank 0's {layers}")
        if set(sds[r]) != set(sds[0]):
            diff = sorted(set(sds[r]) ^ set(sds[0]))
            raise CheckpointError(f"{paths[r]}: holds other tensors than rank 0's file {paths[0]} (e.g. {diff[:3]})")
    experts = _expert_keys(layers, sds[0])
    for key in experts:
        for r in range(1, size):
            if sds[r][key].shape != sds[0][key].shape or sds[r][key].dtype != sds[0][key].dtype:
                raise CheckpointError(f"{paths[r]}: expert tensor {key!r} is {sds[r][key].dtype} "
                                      f"{tuple(sds[r][key].shape)}, rank 0's {sds[0][key].dtype} "
                                      f"{tuple(sds[0][key].shape)}")
    return experts


def _merge_expert(out: dict, key: str, prefix: str, meta: dict, spec: Any, sds: list,
                  allow_divergent: bool) -> None:
    """Put expert parameter ``key``, whole, into ``out``: the ranks' local experts concatenated,
    each expert's shards joined (or, replicated over its shards, checked equal)."""
    size = len(sds)
    El, S = meta["num_local_experts"], meta["shards"]
    if spec[0] == "module_index":
        head = prefix + next(n for n, s in meta["params"].items() if s[0] == "module_index")
        i, rest = split_index(key, head)
        for r in range(size):
            out[f"{head}{r * El + i}.{rest}"] = sds[r][key].clone()
        return
    _, shard_axis, replicated = spec
    parts = [sd[key] for sd in sds]
    if S == 1:
        out[key] = torch.cat(parts, dim=0)
        return
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


def scatter(source: Any, pattern: Optional[str], size: int) -> list[dict]:
    """The full checkpoint (a path or the dict of :func:`gather`) -> ``size`` per-rank
    checkpoints, also written to ``pattern`` if given (all renamed into place once every one
    is written).

    Raises:
        CheckpointError: the source is missing, unreadable or corrupt (see :func:`read`), or
            one of the outputs is the source.
        ValueError: ``size`` is not a positive int, or the experts cannot be laid out over it.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    paths = [rank_path(pattern, r, size) for r in range(size)] if pattern is not None else []
    if len(set(map(os.path.realpath, paths))) != len(paths):
        raise ValueError(f"pattern {pattern!r} names the same file for several ranks")
    if isinstance(source, str):
        refuse_overwrite(paths, [source], "scatter")
    full = read(source) if isinstance(source, str) else source
    if full["world_size"] != 1:
        raise ValueError(f"scatter needs a full checkpoint (world_size 1), got one of world size "
                         f"{full['world_size']}: gather it first")
    layers, sd = full["layers"], full["state_dict"]
    experts = _expert_keys(layers, sd)
    plans = {p: layout(m["num_experts"], size, f"layer {p!r}") for p, m in layers.items()}
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
                e, rest = split_index(key, head)
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
        outs.append(pack(size, r, new_layers, rsd))
    if paths:
        temps: list = []
        try:
            for ck, path in zip(outs, paths):
                temps.append(write_temp(ck, path))
        except BaseException:
            for tmp, _ in temps:
                os.unlink(tmp)
            raise
        commit(temps)
    return outs
