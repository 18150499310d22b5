"""Expert-weight checkpoints across world sizes.

A *per-rank* file holds one rank's ``state_dict`` of a model containing
:class:`~moecomm.moe.MoELayer` s, plus a description of every layer's expert parameters::

    {"format": "moecomm.moe.checkpoint", "version": 2, "world_size": W, "rank": r,
     "layers": {prefix: {"num_experts": E, "num_local_experts": El, "shards": S,
                         "params": {name: [expert_axis, shard_axis or None, replicated_over_shards]}}},
     "checksums": {key: "sha256:<hex of the dtype, the shape and the bytes of the tensor>"},
     "state_dict": {...}}

Reading is safe for files from anywhere: ``torch.load(weights_only=True)`` (a file whose
pickle would run code is refused without running it), every tensor's checksum is checked,
and the header is cross-checked against the tensors (the layout of the experts over
``world_size`` ranks, the expert dimension of every expert parameter); a file that fails
raises :class:`CheckpointError` naming the file (and the tensor). Version 1 files (written
before checksums existed) are still read, without the checksum check. Writes go to a
temporary file in the target's directory, renamed into place once complete (``scatter``
renames its files only once all are written); an output that is one of the inputs is refused
before anything is read or written.

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
import hashlib
import os
import pickle
import re
import sys
import tempfile
import warnings
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["FORMAT", "VERSION", "CheckpointError", "save", "load", "read", "gather", "scatter", "describe", "main"]

FORMAT = "moecomm.moe.checkpoint"
VERSION = 2
"""Written by this module; versions 1 (no checksums) and 2 are read."""
READABLE_VERSIONS = (1, 2)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read, is corrupt, or whose header does not match its
    tensors; or a conversion that would overwrite its input. The message names the file."""


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
    """Write this rank's file ``pattern.format(rank=, size=)`` (through a temporary file in
    its directory, renamed into place); returns its path.

    Raises:
        ValueError: ``pattern`` lacks ``{rank}`` on more than one rank, or a user expert
            module declares no ``moe_checkpoint_spec()``.
        OSError: the file cannot be written (the previous file at that path is left whole).
    """
    rank, size = _world(model)
    path = _path(pattern, rank, size)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    _write(_pack(size, rank, describe(model), sd), path)
    return path


def load(model: nn.Module, pattern: str, *, strict: bool = True) -> Any:
    """Load this rank's file (written for the model's world size, e.g. by :func:`scatter`).

    Raises:
        CheckpointError: the file is missing, unreadable, corrupt or inconsistent (see :func:`read`).
        ValueError: the file is for another rank, world size or expert layout than the model's.
    """
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


# -- the file format ---------------------------------------------------------------------------


def _checksum(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel():
        h.update(memoryview(flat.view(torch.uint8).numpy()))
    return "sha256:" + h.hexdigest()


def _pack(size: int, rank: int, layers: dict, sd: dict) -> dict:
    return {"format": FORMAT, "version": VERSION, "world_size": size, "rank": rank, "layers": layers,
            "checksums": {k: _checksum(v) for k, v in sd.items()}, "state_dict": sd}


def _write(obj: dict, path: str) -> None:
    """``torch.save`` to a temporary file in ``path``'s directory, then rename it into place."""
    _commit([_write_temp(obj, path)])


def _write_temp(obj: dict, path: str) -> tuple[str, str]:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp, path


def _commit(pairs: list) -> None:
    try:
        for tmp, path in pairs:
            os.replace(tmp, path)
    finally:
        for tmp, _ in pairs:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _refuse_overwrite(outputs: list, inputs: list, what: str) -> None:
    for out in outputs:
        for inp in inputs:
            if _same_file(out, inp):
                raise CheckpointError(f"{what}: the output {out} is the input {inp}; write to another path")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    first = first if len(first) <= 160 else first[:157] + "..."
    return f"{type(exc).__name__}: {first}".rstrip(": ")


def read(path: str) -> dict:
    """Read and check one checkpoint file (per-rank or full) on the CPU.

    Raises:
        CheckpointError: the file is missing, unreadable, truncated, not a checkpoint of this
            format, refused by the safe loader (its pickle would run code), corrupt (a tensor
            fails its checksum) or its header does not match its tensors.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: " + ("not a file" if os.path.exists(path) else "no such file"))
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols of foreign files
            warnings.simplefilter("ignore")
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" not in str(exc).lower():
            raise CheckpointError(f"{path}: cannot be read as a {FORMAT} file ({_one_line(exc)})") from None
        detail = [ln.strip() for ln in str(exc).splitlines()[1:]
                  if ln.strip() and not ln.startswith(("Please file", "Check the documentation", "WeightsUnpickler"))]
        why = f" ({detail[0][:120]})" if detail else ""
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True), which ran none of it: it holds "
                              f"more than tensors and plain data{why}; not a {FORMAT} file") from None
    except Exception as exc:  # noqa: BLE001 - every failure to read is reported the same way
        raise CheckpointError(f"{path}: cannot be read as a {FORMAT} file ({_one_line(exc)})") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} file")
    if ck.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: unsupported checkpoint version {ck.get('version')!r} (this reads "
                              f"versions {list(READABLE_VERSIONS)})")
    _check_header(ck, path)
    return ck


_read = read


def _check_header(ck: dict, path: str) -> None:
    """The header's fields have their types, and agree with the tensors and their checksums."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{path}: {msg}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    W, rank = ck.get("world_size"), ck.get("rank")
    if not is_int(W) or W < 1 or not is_int(rank) or not 0 <= rank < W:
        raise bad(f"header has world_size={W!r}, rank={rank!r} (want ints with 0 <= rank < world_size)")
    sd, layers = ck.get("state_dict"), ck.get("layers")
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise bad("state_dict is not a dict of tensors")
    if not isinstance(layers, dict):
        raise bad("header has no 'layers' dict")
    if ck["version"] >= 2:
        sums = ck.get("checksums")
        if not isinstance(sums, dict) or set(sums) != set(sd):
            missing = sorted(set(sd) - set(sums or {})) + sorted(set(sums or {}) - set(sd))
            raise bad(f"the checksums do not list the tensors of the state_dict (differ at {missing[:3]})")
        for key, t in sd.items():
            if _checksum(t) != sums[key]:
                raise bad(f"tensor {key!r} fails its checksum: the file is corrupt")
    for prefix, meta in layers.items():
        try:
            E, El, S = meta["num_experts"], meta["num_local_experts"], meta["shards"]
            params = meta["params"]
            if not (is_int(E) and is_int(El) and is_int(S)) or not isinstance(params, dict):
                raise TypeError
        except (TypeError, KeyError):
            raise bad(f"layer {prefix!r}: malformed header entry {meta!r}") from None
        try:
            want = _layout(E, W, f"layer {prefix!r}")
        except ValueError as exc:
            raise bad(f"header: {exc}") from None
        if (El, S) != want:
            raise bad(f"layer {prefix!r}: header says world_size={W}, num_experts={E}, so {want[0]} local "
                      f"experts and {want[1]} shards each, but it lists num_local_experts={El}, shards={S}")
        for name, spec in params.items():
            if not isinstance(spec, (list, tuple)) or len(spec) != 3:
                raise bad(f"layer {prefix!r}: parameter {name!r} has a malformed spec {spec!r}")
            if spec[0] == "module_index":
                head = prefix + name
                for key in sd:
                    if key.startswith(head):
                        try:
                            i, _ = _split_index(key, head)
                        except ValueError as exc:
                            raise bad(str(exc)) from None
                        if i >= El:
                            raise bad(f"{key!r} is expert module {i}, but the header says {El} local experts")
                continue
            key = prefix + name
            t = sd.get(key)
            if t is None:
                raise bad(f"lacks expert parameter {key!r} that its header lists")
            if t.dim() == 0 or t.shape[0] != (El if S == 1 else 1):
                raise bad(f"expert parameter {key!r} has shape {tuple(t.shape)}, but the header says "
                          f"{El if S == 1 else 1} expert(s) on this rank (world_size={W}, num_experts={E})")


# -- offline conversion ------------------------------------------------------------------------


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
            _refuse_overwrite([output], found, "gather")
        size = _read(found[0])["world_size"]
    elif isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    paths = [_path(pattern, r, size) for r in range(size)]
    if output is not None:
        _refuse_overwrite([output], paths, "gather")
    cks = [_read(p) for p in paths]
    for r, ck in enumerate(cks):
        if ck["world_size"] != size or ck["rank"] != r:
            raise CheckpointError(f"{paths[r]} says it is rank {ck['rank']} of {ck['world_size']}, "
                                  f"expected rank {r} of {size}")
    layers = cks[0]["layers"]
    sds = [ck["state_dict"] for ck in cks]
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
    full = _pack(1, 0, new_layers, out)
    if output is not None:
        _write(full, output)
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
    paths = [_path(pattern, r, size) for r in range(size)] if pattern is not None else []
    if len(set(map(os.path.realpath, paths))) != len(paths):
        raise ValueError(f"pattern {pattern!r} names the same file for several ranks")
    if isinstance(source, str):
        _refuse_overwrite(paths, [source], "scatter")
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
        outs.append(_pack(size, r, new_layers, rsd))
    if paths:
        temps: list = []
        try:
            for ck, path in zip(outs, paths):
                temps.append(_write_temp(ck, path))
        except BaseException:
            for tmp, _ in temps:
                os.unlink(tmp)
            raise
        _commit(temps)
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
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        print("error: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the tool reports one line, never a traceback
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
