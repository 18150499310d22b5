"""Expert-weight checkpoints across world sizes.

A *per-rank* file holds one rank's ``state_dict`` of a model containing
:class:`~moecomm.moe.MoELayer` s, plus a description of every layer's expert parameters::

    {"format": "moecomm.moe.checkpoint", "version": 3, "world_size": W, "rank": r,
     "layers": {prefix: {"num_experts": E, "num_local_experts": El, "shards": S,
                         "params": {name: [expert_axis, shard_axis or None, replicated_over_shards]}}},
     "checksums": {key: "sha256:<hex of the dtype, the shape and the bytes of the tensor>"},
     "header_checksum": "sha256:<hex of every other field but the tensors, and the tensors' names>",
     "state_dict": {...}}

Reading is safe for files from anywhere: ``torch.load(weights_only=True)`` (a file whose
pickle would run code is refused without running it), every tensor's checksum is checked,
the header's checksum before any of the header is used, and the header is cross-checked
against the tensors (the layout of the experts over ``world_size`` ranks, the expert
dimension of every expert parameter); a file that fails raises :class:`CheckpointError`
naming the file (and the tensor). Version 1 files (written before checksums existed) are
still read, without the checksum check, and version 2 files without the header's. Writes go
to a temporary file in the target's directory, renamed into place once complete (``scatter``
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
import sys
from typing import Any, Optional

from torch import nn

from ._checkpoint.file import READABLE_VERSIONS  # noqa: F401 - importable from here, as before the split
from ._checkpoint.file import FORMAT, VERSION, CheckpointError, checksum, one_line, pack, read, write
from ._checkpoint.reshard import gather, rank_path, scatter

__all__ = ["FORMAT", "VERSION", "CheckpointError", "save", "load", "read", "gather", "scatter", "describe", "main"]

_checksum = checksum  # (tests build valid files with it)

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


def save(model: nn.Module, pattern: str) -> str:
    """Write this rank's file ``pattern.format(rank=, size=)`` (through a temporary file in
    its directory, renamed into place); returns its path.

    Raises:
        ValueError: ``pattern`` lacks ``{rank}`` on more than one rank, or a user expert
            module declares no ``moe_checkpoint_spec()``.
        OSError: the file cannot be written (the previous file at that path is left whole).
    """
    rank, size = _world(model)
    path = rank_path(pattern, rank, size)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    write(pack(size, rank, describe(model), sd), path)
    return path


def load(model: nn.Module, pattern: str, *, strict: bool = True) -> Any:
    """Load this rank's file (written for the model's world size, e.g. by :func:`scatter`).

    Raises:
        CheckpointError: the file is missing, unreadable, corrupt or inconsistent (see :func:`read`).
        ValueError: the file is for another rank, world size or expert layout than the model's.
    """
    rank, size = _world(model)
    ck = read(rank_path(pattern, rank, size))
    if ck["world_size"] != size or ck["rank"] != rank:
        raise ValueError(f"{rank_path(pattern, rank, size)} is rank {ck['rank']} of {ck['world_size']}, "
                         f"but this is rank {rank} of {size}: convert it with scatter first")
    mine = describe(model)
    for prefix, meta in mine.items():
        theirs = ck["layers"].get(prefix)
        if theirs is None or theirs["num_experts"] != meta["num_experts"] or theirs["shards"] != meta["shards"]:
            raise ValueError(f"layer {prefix!r}: checkpoint has {theirs}, the model {meta}")
    dev_sd = model.state_dict()
    sd = {k: v.to(dev_sd[k].device) if k in dev_sd else v for k, v in ck["state_dict"].items()}
    return model.load_state_dict(sd, strict=strict)


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
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
