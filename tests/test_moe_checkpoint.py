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
    parts[1]["state_dict"]["moe.gates.0.wg.weight"] += 1
    torch.save(parts[1], f"{d}/p.1.pt")
    with pytest.raises(ValueError, match="differs between rank 0 and rank 1"):
        checkpoint.gather(f"{d}/p.{{rank}}.pt", size=2)
    kept = checkpoint.gather(f"{d}/p.{{rank}}.pt", size=2, allow_divergent=True)
    assert torch.equal(kept["state_dict"]["moe.gates.0.wg.weight"], full["state_dict"]["moe.gates.0.wg.weight"])
