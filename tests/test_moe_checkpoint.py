"""python -m moecomm.moe.checkpoint gather|scatter between world sizes: exact round trips."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.mpi_util import ROOT, run_ranks


def cli(*args, ok=True):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "moecomm.moe.checkpoint", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert (p.returncode == 0) == ok, p.stdout + p.stderr
    return p.stdout + p.stderr


def same(a, b):
    sa, sb = a["state_dict"], b["state_dict"]
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_round_trips_and_reload(tmp_path):
    d = str(tmp_path)
    # E=4 experts on 2 ranks (2 per rank), trained one step
    run_ranks(2, "tests.ranks.moe_checkpoint", "save", d, "4")
    cli("gather", "--input", f"{d}/w{{size}}.{{rank}}.pt", "--output", f"{d}/full.pt")
    full = torch.load(f"{d}/full.pt", weights_only=False)
    assert full["world_size"] == 1
    assert full["state_dict"]["moe.experts.fc1_weight"].shape == (4, 8, 16)
    from moecomm.moe import checkpoint

    for size in (1, 2, 8, 16):  # 8, 16: each expert sharded over 2, 4 ranks (API; the CLI wraps it)
        out = f"{d}/s{size}/x.{{rank}}-of-{{size}}.pt"
        checkpoint.scatter(f"{d}/full.pt", out, size)
        same(full, checkpoint.gather(out))
    r8 = torch.load(f"{d}/s8/x.3-of-8.pt", weights_only=False)
    assert r8["state_dict"]["moe.experts.fc1_weight"].shape == (1, 8, 8)
    assert r8["layers"]["moe."]["shards"] == 2
    # bad target sizes
    with pytest.raises(ValueError, match="cannot be sharded"):
        checkpoint.scatter(f"{d}/full.pt", None, 6)
    assert "cannot be split" in cli("scatter", "--input", f"{d}/full.pt", "--size", "3", "--output",
                                    f"{d}/bad/{{rank}}.pt", ok=False)
    # the CLI round trip through 4 ranks; the W=4 model loaded from those files computes
    # what the full model computes
    cli("scatter", "--input", f"{d}/full.pt", "--size", "4", "--output", f"{d}/scattered.{{rank}}-of-{{size}}.pt")
    cli("gather", "--input", f"{d}/scattered.{{rank}}-of-{{size}}.pt", "--output", f"{d}/back4.pt")
    same(full, torch.load(f"{d}/back4.pt", weights_only=False))
    # the W=4 model loaded from the scattered files computes what the full model computes
    cli("scatter", "--input", f"{d}/full.pt", "--size", "4", "--output", f"{d}/scattered.{{rank}}-of-{{size}}.pt")
    run_ranks(4, "tests.ranks.moe_checkpoint", "load", d, f"{d}/full.pt", "4")


def test_divergent_replicas_are_reported(tmp_path):
    from moecomm.moe import checkpoint

    d = str(tmp_path)
    run_ranks(1, "tests.ranks.moe_checkpoint", "save", d, "2")
    full = checkpoint.gather(f"{d}/w{{size}}.{{rank}}.pt", size=1)
    parts = checkpoint.scatter(full, f"{d}/p.{{rank}}.pt", 2)
    key = "moe.gates.0.wg.weight"
    parts[1]["state_dict"][key] += 1
    parts[1]["checksums"][key] = checkpoint._checksum(parts[1]["state_dict"][key])  # a valid file, not a corrupt one
    parts[1] = sealed(parts[1])
    torch.save(parts[1], f"{d}/p.1.pt")
    with pytest.raises(ValueError, match="differs between rank 0 and rank 1"):
        checkpoint.gather(f"{d}/p.{{rank}}.pt", size=2)
    kept = checkpoint.gather(f"{d}/p.{{rank}}.pt", size=2, allow_divergent=True)
    assert torch.equal(kept["state_dict"]["moe.gates.0.wg.weight"], full["state_dict"]["moe.gates.0.wg.weight"])


# -- safety: files from anywhere, outputs that are inputs, interrupted writes, corruption ---------

E, D, H = 4, 3, 4


def full_checkpoint(version: int = 1) -> dict:
    """A full (world size 1) checkpoint of one MoE layer and a replicated tensor, built by
    hand (no MPI): version 1 had no checksums."""
    from moecomm.moe import checkpoint

    g = torch.Generator().manual_seed(0)
    sd = {"inp.weight": torch.randn(D, D, generator=g), "moe.gates.0.wg.weight": torch.randn(E, D, generator=g),
          "moe.experts.fc1_weight": torch.randn(E, D, H, generator=g), "moe.experts.fc1_bias": torch.randn(E, H, generator=g),
          "moe.experts.fc2_weight": torch.randn(E, H, D, generator=g), "moe.experts.fc2_bias": torch.randn(E, D, generator=g)}
    params = {"experts.fc1_weight": [0, 2, False], "experts.fc1_bias": [0, 1, False],
              "experts.fc2_weight": [0, 1, False], "experts.fc2_bias": [0, None, True]}
    ck = {"format": checkpoint.FORMAT, "version": version, "world_size": 1, "rank": 0,
          "layers": {"moe.": {"num_experts": E, "num_local_experts": E, "shards": 1, "params": params}},
          "state_dict": sd}
    return ck


def main_err(*args) -> str:
    """``python -m moecomm.moe.checkpoint ARGS`` in this process (importing torch per call
    would cost seconds): must fail; returns what it printed."""
    import contextlib
    import io

    from moecomm.moe import checkpoint

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = checkpoint.main(list(args))
    assert rc != 0, buf.getvalue()
    return buf.getvalue()


def one_line_error(out: str, *words: str) -> None:
    assert "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1, out
    for w in words:
        assert w in out, (w, out)


def snapshot(d) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_crafted_pickle_runs_nothing(tmp_path):
    import pickle

    from moecomm.moe import checkpoint

    marker = tmp_path / "pwned"
    zipped, raw = tmp_path / "evil.0.pt", tmp_path / "raw.pt"
    torch.save({"format": checkpoint.FORMAT, "version": 2, "payload": Evil(marker)}, zipped)
    with open(raw, "wb") as f:
        pickle.dump({"format": checkpoint.FORMAT, "payload": Evil(marker)}, f)
    for path in (zipped, raw):
        with pytest.raises(ValueError, match=str(path)):
            checkpoint.scatter(str(path), None, 2)
        one_line_error(main_err("scatter", "--input", str(path), "--size", "2", "--output",
                                f"{tmp_path}/o.{{rank}}.pt"), str(path))
    # the real command line: one line on stderr, no traceback, and nothing run
    one_line_error(cli("gather", "--input", f"{tmp_path}/evil.{{rank}}.pt", "--size", "1", "--output",
                       f"{tmp_path}/full.pt", ok=False), "evil.0.pt", "refused")
    assert not marker.exists(), "loading a checkpoint ran code from its pickle"


def test_output_that_is_an_input_is_refused(tmp_path):
    from moecomm.moe import checkpoint

    d = str(tmp_path)
    checkpoint.scatter(full_checkpoint(), f"{d}/r.{{rank}}.pt", 2)
    os.symlink(f"{d}/r.1.pt", f"{d}/link.pt")
    before = snapshot(tmp_path)
    for out in (f"{d}/r.0.pt", f"{d}/r.1.pt", f"{d}/link.pt", f"{d}/../{tmp_path.name}/r.1.pt"):
        one_line_error(main_err("gather", "--input", f"{d}/r.{{rank}}.pt", "--output", out), "is the input")
        with pytest.raises(ValueError, match="is the input"):
            checkpoint.gather(f"{d}/r.{{rank}}.pt", out, size=2)
    # a full file scattered onto a pattern that names it
    checkpoint.gather(f"{d}/r.{{rank}}.pt", f"{d}/f0.pt")
    before = snapshot(tmp_path)
    one_line_error(main_err("scatter", "--input", f"{d}/f0.pt", "--size", "2", "--output", f"{d}/f{{rank}}.pt"),
                   "is the input")
    one_line_error(main_err("scatter", "--input", f"{d}/f0.pt", "--size", "1", "--output", f"{d}/f0.pt"),
                   "is the input")
    assert snapshot(tmp_path) == before


def test_writes_go_through_a_temporary_file(tmp_path, monkeypatch):
    from moecomm.moe import checkpoint

    d = str(tmp_path)
    checkpoint.scatter(full_checkpoint(), f"{d}/r.{{rank}}.pt", 2)
    checkpoint.gather(f"{d}/r.{{rank}}.pt", f"{d}/full.pt")
    before = snapshot(tmp_path)
    real_save, calls = torch.save, []

    def failing_save(obj, f, *a, **kw):  # writes part of the file, then fails (disk full, killed, ...)
        calls.append(1)
        if len(calls) < 2:
            return real_save(obj, f, *a, **kw)
        (open(f, "wb") if isinstance(f, str) else f).write(b"PK\x03\x04partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    calls.append(1)
    with pytest.raises(OSError):
        checkpoint.gather(f"{d}/r.{{rank}}.pt", f"{d}/full.pt")
    calls.clear()
    with pytest.raises(OSError):  # the second file fails: the first is not renamed into place either
        checkpoint.scatter(f"{d}/full.pt", f"{d}/r.{{rank}}.pt", 2)
    monkeypatch.setattr(torch, "save", real_save)
    assert snapshot(tmp_path) == before  # the old files whole, no temporary file left
    checkpoint.scatter(f"{d}/full.pt", f"{d}/r.{{rank}}.pt", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt", "r.0.pt", "r.1.pt"]


def test_flipped_bytes_inside_a_tensor_are_detected(tmp_path):
    from moecomm.moe import checkpoint

    d = str(tmp_path)
    parts = checkpoint.scatter(full_checkpoint(), f"{d}/r.{{rank}}.pt", 2)
    data = (tmp_path / "r.1.pt").read_bytes()
    t = parts[1]["state_dict"]["moe.experts.fc2_weight"]
    at = data.find(t.numpy().tobytes())
    assert at > 0
    flipped = bytearray(data)
    for i in range(at + 8, at + 16):
        flipped[i] ^= 0xFF
    (tmp_path / "r.1.pt").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=r"r\.1\.pt.*'moe\.experts\.fc2_weight'.*checksum"):
        checkpoint.gather(f"{d}/r.{{rank}}.pt")
    one_line_error(main_err("gather", "--input", f"{d}/r.{{rank}}.pt", "--output", f"{d}/full.pt"),
                   "r.1.pt", "moe.experts.fc2_weight", "checksum")
    assert not (tmp_path / "full.pt").exists()


def sealed(ck: dict) -> dict:
    """``ck`` with its header checksum made anew: a file whose writer lied, not a corrupt one."""
    from moecomm.moe._checkpoint import file as _checkpoint_file

    return dict(ck, header_checksum=_checkpoint_file.header_checksum(ck))


def test_header_that_lies_is_refused(tmp_path):
    from moecomm.moe import checkpoint

    d = str(tmp_path)
    parts = checkpoint.scatter(full_checkpoint(), None, 2)
    # a per-rank file (2 of the 4 experts) whose header claims a full file (world size 1)
    lie = sealed(dict(parts[0], world_size=1, rank=0))
    torch.save(lie, f"{d}/lie1.pt")
    lie2 = sealed(dict(lie, layers={"moe.": dict(lie["layers"]["moe."], num_local_experts=E)}))
    torch.save(lie2, f"{d}/lie2.pt")
    for name, words in (("lie1.pt", ["world_size=1", "num_local_experts=2"]),
                        ("lie2.pt", ["'moe.experts.fc1_weight'", "(2, 3, 4)"])):
        out = main_err("scatter", "--input", f"{d}/{name}", "--size", "4", "--output", f"{d}/x{name}.{{rank}}.pt")
        one_line_error(out, name, *words)
    # rank files whose headers claim world size 4 (of which two are missing) / 1
    for r in range(2):
        torch.save(sealed(dict(parts[r], world_size=4)), f"{d}/w4.{r}.pt")
    one_line_error(main_err("gather", "--input", f"{d}/w4.{{rank}}.pt", "--output", f"{d}/o.pt"), "w4.0.pt")
    one_line_error(main_err("gather", "--input", f"{d}/w4.{{rank}}.pt", "--size", "2", "--output", f"{d}/o.pt"),
                   "w4.0.pt")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("x", "o"))) == []


def test_unreadable_files_are_named_in_one_line(tmp_path):
    from moecomm.moe import checkpoint

    d = str(tmp_path)
    checkpoint.scatter(full_checkpoint(), f"{d}/r.{{rank}}.pt", 2)
    good = (tmp_path / "r.1.pt").read_bytes()
    cases = {"truncated": good[: len(good) // 2], "empty": b"", "garbage": os.urandom(300),
             "tail cut": good[:-20]}
    for name, data in cases.items():
        (tmp_path / "r.1.pt").write_bytes(data)
        with pytest.raises(ValueError, match=r"r\.1\.pt"):
            checkpoint.gather(f"{d}/r.{{rank}}.pt")
        one_line_error(main_err("gather", "--input", f"{d}/r.{{rank}}.pt", "--output", f"{d}/o.pt"), "r.1.pt")
        if name == "truncated":  # the real command line too
            one_line_error(cli("gather", "--input", f"{d}/r.{{rank}}.pt", "--output", f"{d}/o.pt", ok=False), "r.1.pt")
    (tmp_path / "r.1.pt").unlink()
    one_line_error(main_err("gather", "--input", f"{d}/r.{{rank}}.pt", "--size", "2", "--output", f"{d}/o.pt"),
                   "r.1.pt", "no such file")
    torch.save({"weights": torch.zeros(2)}, f"{d}/other.pt")
    one_line_error(main_err("scatter", "--input", f"{d}/other.pt", "--size", "2", "--output", f"{d}/s.{{rank}}.pt"),
                   "other.pt", "not a moecomm.moe.checkpoint file")
    assert not (tmp_path / "o.pt").exists()


def test_version_1_files_still_read(tmp_path):
    from moecomm.moe import checkpoint

    d = str(tmp_path)
    v1 = full_checkpoint()
    torch.save(v1, f"{d}/v1.pt")
    parts = checkpoint.scatter(f"{d}/v1.pt", f"{d}/r.{{rank}}.pt", 2)
    assert all(p["version"] == checkpoint.VERSION and "checksums" in p for p in parts)
    assert issubclass(checkpoint.CheckpointError, ValueError)
    back = checkpoint.gather(f"{d}/r.{{rank}}.pt")
    same(v1, back)
    v3 = dict(v1, version=99)
    torch.save(v3, f"{d}/v99.pt")
    with pytest.raises(ValueError, match="unsupported checkpoint version 99"):
        checkpoint.read(f"{d}/v99.pt")


def _tiny_rank_file(rank: int = 0, size: int = 2) -> dict:
    """A small per-rank checkpoint (2 experts over 2 ranks, a replicated tensor), by hand."""
    from moecomm.moe._checkpoint import file as _checkpoint_file

    g = torch.Generator().manual_seed(1)
    sd = {"inp.weight": torch.randn(2, 2, generator=g), "moe.experts.fc1_weight": torch.randn(1, 2, 3, generator=g),
          "moe.experts.fc2_bias": torch.randn(1, 2, generator=g)}
    params = {"experts.fc1_weight": [0, 2, False], "experts.fc2_bias": [0, None, True]}
    layers = {"moe.": {"num_experts": 2, "num_local_experts": 1, "shards": 1, "params": params}}
    return _checkpoint_file.pack(size, rank, layers, sd)


def _pickle_span(data: bytes) -> tuple[int, int]:
    """(offset, length) of the pickle (header, table of names) inside a torch.save zip."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    local = info.header_offset
    name_len = int.from_bytes(data[local + 26:local + 28], "little")
    extra_len = int.from_bytes(data[local + 28:local + 30], "little")
    return local + 30 + name_len + extra_len, info.file_size


def _flip_outcomes(data: bytes, bits, path: str, reference: dict, act) -> list:
    """For each bit index: flip it, write ``path``, ``act(path)``; the bits after which it
    neither raised CheckpointError nor gave ``reference`` (with the exception, if any)."""
    from moecomm.moe import checkpoint

    def header(ck):
        return {k: v for k, v in ck.items() if k != "state_dict"}

    accepted = []
    for bit in bits:
        buf = bytearray(data)
        buf[bit // 8] ^= 1 << (bit % 8)
        with open(path, "wb") as f:
            f.write(buf)
        try:
            got = act(path)
        except checkpoint.CheckpointError:
            continue
        except Exception as exc:  # noqa: BLE001 - any other error is a finding
            accepted.append((bit, f"{type(exc).__name__}: {exc}"))
            continue
        for a, b in zip(got, reference):
            if header(a) != header(b) or sorted(a["state_dict"]) != sorted(b["state_dict"]) or not all(
                    a["state_dict"][k].dtype == b["state_dict"][k].dtype
                    and torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"]):
                accepted.append((bit, "read a different checkpoint"))
                break
    return accepted


def test_single_bit_flips_give_checkpoint_error(tmp_path):
    """Issue 34 item 6: single-bit flips of the header and the table of names (the whole pickle:
    one random bit of every byte; every bit takes ~30 s) and sampled bits of the rest of the
    file give CheckpointError from read() (and from scatter(), every 4th byte of its pickle), or
    the identical checkpoint; never another checkpoint or another error."""
    import io
    import random

    from moecomm.moe import checkpoint
    from moecomm.moe._checkpoint import file as _checkpoint_file

    buf = io.BytesIO()
    torch.save(_tiny_rank_file(), buf)
    data = buf.getvalue()
    start, length = _pickle_span(data)
    path = str(tmp_path / "r.pt")
    with open(path, "wb") as f:
        f.write(data)
    ref = [checkpoint.read(path)]
    rng = random.Random(0)
    rest = [b for b in range(8 * len(data)) if not start * 8 <= b < (start + length) * 8]
    bits = [8 * byte + rng.randrange(8) for byte in range(start, start + length)] + rng.sample(rest, 100)
    bad = _flip_outcomes(data, bits, path, ref, lambda p: [checkpoint.read(p)])
    assert not bad, f"{len(bad)} of {len(bits)} flips were not refused, e.g. {bad[:5]}"

    full = io.BytesIO()
    torch.save(_checkpoint_file.pack(1, 0, {}, {"w": torch.arange(3.0)}), full)
    fdata = full.getvalue()
    fstart, flen = _pickle_span(fdata)
    src = str(tmp_path / "full.pt")
    with open(src, "wb") as f:
        f.write(fdata)
    out = str(tmp_path / "s.{rank}.pt")
    sref = checkpoint.scatter(src, out, 2)
    fbits = [8 * byte + rng.randrange(8) for byte in range(fstart, fstart + flen, 4)]
    bad = _flip_outcomes(fdata, fbits, src, sref, lambda p: checkpoint.scatter(p, out, 2))
    assert not bad, f"scatter: {len(bad)} of {len(fbits)} flips were not refused, e.g. {bad[:5]}"
