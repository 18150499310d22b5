"""The checkpoint file format of :mod:`moecomm.moe.checkpoint`: writing (atomically, through a
temporary file renamed into place), reading with the safe loader, checksums, and the header's
cross-checks against the tensors. The format itself is described in that module."""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import tempfile
import warnings
from typing import Any

import torch

__all__ = ["FORMAT", "VERSION", "READABLE_VERSIONS", "CheckpointError", "read", "pack", "write", "write_temp",
           "commit", "refuse_overwrite", "one_line", "checksum", "header_checksum", "layout", "split_index"]

FORMAT = "moecomm.moe.checkpoint"
VERSION = 3
"""Written by this module; versions 1 (no checksums), 2 (the tensors' checksums) and 3 (and the
header's) are read."""
READABLE_VERSIONS = (1, 2, 3)
HEADER_KEY = "header_checksum"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read, is corrupt, or whose header does not match its
    tensors; or a conversion that would overwrite its input. The message names the file."""


def checksum(t: torch.Tensor) -> str:
    """``sha256:<hex>`` of the tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel():
        h.update(memoryview(flat.view(torch.uint8).numpy()))
    return "sha256:" + h.hexdigest()


def _canonical(v: Any) -> str:
    """A text of plain data (dicts, lists, tuples, strings, numbers, None, bools) that is the
    same exactly when the data is: dicts in sorted order, every value with its type."""
    if isinstance(v, dict):
        items = sorted((_canonical(k), _canonical(x)) for k, x in v.items())
        return "{" + ",".join(f"{k}:{x}" for k, x in items) + "}"
    if isinstance(v, (list, tuple)):
        return type(v).__name__ + "[" + ",".join(_canonical(x) for x in v) + "]"
    return f"{type(v).__name__}({v!r})"


def header_checksum(ck: dict) -> str:
    """``sha256:<hex>`` of everything in ``ck`` but the tensors: the header (format, version,
    world size, rank, layers), the tensors' checksums and the names of the state_dict's
    tensors (which a flipped bit could rename or drop in both tables at once)."""
    head = {k: v for k, v in ck.items() if k not in ("state_dict", HEADER_KEY)}
    sd = ck.get("state_dict")
    names = sorted(_canonical(k) for k in sd) if isinstance(sd, dict) else None
    return "sha256:" + hashlib.sha256(_canonical([head, names]).encode()).hexdigest()


def pack(size: int, rank: int, layers: dict, sd: dict) -> dict:
    """A checkpoint of the current version: header, checksums, the header's checksum and ``sd``."""
    ck = {"format": FORMAT, "version": VERSION, "world_size": size, "rank": rank, "layers": layers,
          "checksums": {k: checksum(v) for k, v in sd.items()}, "state_dict": sd}
    ck[HEADER_KEY] = header_checksum(ck)
    return ck


def write(obj: dict, path: str) -> None:
    """``torch.save`` to a temporary file in ``path``'s directory, then rename it into place."""
    commit([write_temp(obj, path)])


def write_temp(obj: dict, path: str) -> tuple[str, str]:
    """``torch.save`` into a new temporary file beside ``path``: ``(temporary, path)`` for :func:`commit`."""
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


def commit(pairs: list) -> None:
    """Rename every ``(temporary, path)`` of :func:`write_temp` into place; temporaries left are removed."""
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


def refuse_overwrite(outputs: list, inputs: list, what: str) -> None:
    """CheckpointError if an output is (a link to) one of the inputs."""
    for out in outputs:
        for inp in inputs:
            if _same_file(out, inp):
                raise CheckpointError(f"{what}: the output {out} is the input {inp}; write to another path")


def one_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception, at most 160 characters of message."""
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
            raise CheckpointError(f"{path}: cannot be read as a {FORMAT} file ({one_line(exc)})") from None
        detail = [ln.strip() for ln in str(exc).splitlines()[1:]
                  if ln.strip() and not ln.startswith(("Please file", "Check the documentation", "WeightsUnpickler"))]
        why = f" ({detail[0][:120]})" if detail else ""
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True), which ran none of it: it holds "
                              f"more than tensors and plain data{why}; not a {FORMAT} file") from None
    except Exception as exc:  # noqa: BLE001 - every failure to read is reported the same way
        raise CheckpointError(f"{path}: cannot be read as a {FORMAT} file ({one_line(exc)})") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} file")
    if ck.get("version") not in READABLE_VERSIONS or type(ck.get("version")) is not int:
        raise CheckpointError(f"{path}: unsupported checkpoint version {ck.get('version')!r} (this reads "
                              f"versions {list(READABLE_VERSIONS)})")
    _check_header_checksum(ck, path)
    _check_header(ck, path)
    return ck


def _check_header_checksum(ck: dict, path: str) -> None:
    """Version 3: the header's checksum matches (before any of the header is used). A file of an
    older version must not carry one (a version number changed by corruption)."""
    got = ck.get(HEADER_KEY)
    if ck["version"] < 3:
        if HEADER_KEY in ck:
            raise CheckpointError(f"{path}: says version {ck['version']} but carries a header checksum (a version 3 "
                                  f"field): the file is corrupt")
        return
    if not isinstance(got, str) or got != header_checksum(ck):
        raise CheckpointError(f"{path}: the header or the table of tensor names fails its checksum: the file is "
                              f"corrupt")


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
            if checksum(t) != sums[key]:
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
            want = layout(E, W, f"layer {prefix!r}")
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
                            i, _ = split_index(key, head)
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


def layout(num_experts: int, size: int, what: str) -> tuple[int, int]:
    """``(local experts, shards per expert)`` of ``num_experts`` over ``size`` ranks; ValueError if impossible."""
    if num_experts >= size:
        if num_experts % size:
            raise ValueError(f"{what}: {num_experts} experts cannot be split over {size} ranks "
                             f"(the world size must divide the number of experts, or be a multiple of it)")
        return num_experts // size, 1
    if size % num_experts:
        raise ValueError(f"{what}: {num_experts} experts cannot be sharded over {size} ranks "
                         f"(the world size must be a multiple of the number of experts)")
    return 1, size // num_experts


def split_index(key: str, head: str) -> tuple[int, str]:
    """``head<index>.<name>`` -> ``(index, name)``; ValueError for another shape of key."""
    m = re.match(r"(\d+)\.(.*)", key[len(head):])
    if m is None:
        raise ValueError(f"expert module key {key!r} does not follow {head}<index>.<name>")
    return int(m.group(1)), m.group(2)

