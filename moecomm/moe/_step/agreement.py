"""The layer's per-call agreement between ranks: the call's settings and token counts.

Every rank of an expert-parallel layer must run the same step: the same ``k``, capacity
factor, dropless mode, overlap degree, dtype, model size, ... (else the exchanges pair
messages of different sizes: wrong values, or a wait until the timeout on some ranks only),
and with ``inequivalent_tokens=False`` the same number of tokens. The layer folds a check of
both into the host agreement it already makes (the largest token count, or the busiest
expert's load): one ``allreduce_ints("max")`` of a fixed frame ``[a, b, T, -T, fp, -fp]``
(``fp`` a 62-bit fingerprint of the settings), from whose maxima every rank sees at once
whether the fingerprints (and the token counts) agree. Where they do not, every rank joins
a second agreement (a table of every rank's settings) and raises
:class:`~moecomm.errors.CountMismatchError` naming the setting and each rank's value.

Every agreement of the layer has this one frame, so two ranks in different agreements still
compare their settings instead of reading each other's unrelated numbers.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Sequence

import torch

from moecomm.errors import CountMismatchError

__all__ = ["SETTINGS", "settings_codes", "agree"]

SETTINGS = ("model_dim", "output_dim", "num_experts", "dtype", "k", "capacity_factor", "dropless", "overlap_degree",
            "own_first", "algorithm", "inequivalent_tokens", "parallel_mode", "wire_dtype")
"""The names of the settings a call's tuple holds, in order (what the errors name)."""

_VOCAB: tuple = (None, "auto", "flat", "2dh", "expert", "data", torch.float16, torch.bfloat16, torch.float32,
                 torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)
_VOCAB_BASE = 1 << 40  # word codes: _VOCAB_BASE + index (ints and bools are themselves; floats their bits)


def _code(value: Any) -> int:
    """An int64 for one setting, equal on two ranks exactly when the values are."""
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    for i, word in enumerate(_VOCAB):
        if value == word and type(value) is type(word):
            return _VOCAB_BASE + i
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:7], "little") | (1 << 58)


def settings_codes(settings: Sequence[Any]) -> list[int]:
    """The codes of a call's settings (``len(SETTINGS)`` values)."""
    return [_code(v) for v in settings]


def _fingerprint(codes: Sequence[int]) -> int:
    digest = hashlib.sha256(struct.pack(f"<{len(codes)}q", *codes)).digest()
    return int.from_bytes(digest[:8], "little") >> 2  # 62 bits: -fp fits int64


def agree(comm: Any, a: int, b: int, tokens: int, settings: Sequence[Any], equal_tokens: bool) -> tuple[int, int]:
    """``(max a, max b)`` over the ranks of ``comm``, after checking that every rank passed
    the same ``settings`` (a tuple in :data:`SETTINGS` order) and, with ``equal_tokens``,
    the same ``tokens``. One ``allreduce_ints`` (two more where they differ).

    Raises:
        CountMismatchError: on every rank, naming the settings (or the token counts) that
            differ and each rank's value.
    """
    codes = settings_codes(settings)
    fp = _fingerprint(codes)
    out = comm.allreduce_ints([a, b, tokens, -tokens, fp, -fp], "max")
    if out[4] != -out[5]:
        _name_difference(comm, settings, codes)
    if equal_tokens and out[2] != -out[3]:
        table = _table(comm, [tokens])
        raise CountMismatchError(
            f"MoELayer: inequivalent_tokens=False needs the same number of tokens on every rank, got "
            + ", ".join(f"rank {r}: {row[0]}" for r, row in enumerate(table))
            + " (pass inequivalent_tokens=True where the token counts differ)")
    return out[0], out[1]


def _table(comm: Any, values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (the same length), by an ``allreduce_ints("sum")`` of a table
    in which each rank fills its own row."""
    n, W = len(values), comm.size
    mine = [0] * (W * n)
    mine[comm.rank * n:(comm.rank + 1) * n] = values
    flat = comm.allreduce_ints(mine, "sum")
    return [flat[r * n:(r + 1) * n] for r in range(W)]


def _decode(name: str, code: int, own_value: Any, own_code: int) -> str:
    if code == own_code:
        return repr(own_value)
    if isinstance(own_value, bool) and code in (0, 1):
        return repr(bool(code))
    if name == "capacity_factor":
        return repr(struct.unpack("<d", struct.pack("<q", code))[0])
    if _VOCAB_BASE <= code < _VOCAB_BASE + len(_VOCAB):
        return repr(_VOCAB[code - _VOCAB_BASE])
    if name in ("dtype", "wire_dtype", "algorithm", "parallel_mode", "overlap_degree") and code >= 1 << 58:
        return f"<another value, code {code}>"
    return repr(code)


def _name_difference(comm: Any, settings: Sequence[Any], codes: list[int]) -> None:
    table = _table(comm, codes)
    diffs = []
    for i, name in enumerate(SETTINGS):
        column = [row[i] for row in table]
        if len(set(column)) > 1:
            values = ", ".join(f"rank {r}: {_decode(name, c, settings[i], codes[i])}" for r, c in enumerate(column))
            diffs.append(f"{name} ({values})")
    raise CountMismatchError(
        f"MoELayer: the ranks called the layer with different settings: {'; '.join(diffs)}; every rank must "
        f"construct and call it alike")
