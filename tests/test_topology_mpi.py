"""The tuner on real MPI ranks: ``python -m topology tune`` writes a valid profile on CPU,
``probe`` measures the links, and ``algorithm="auto"`` follows the profile."""

import pytest

from moecomm.profile import load_profile
from tests.mpi_util import run_ranks
from topology import cli

pytestmark = pytest.mark.mpi


def test_tune_then_auto_follows(tmp_path, capsys):
    path = tmp_path / "profile.json"
    env = {"MOECOMM_PROFILE_DIR": str(tmp_path / "none")}
    out = run_ranks(4, "topology", "tune", "--local-size", "2", "--sizes", "4K,64K", "--probe-sizes", "256,4K",
                    "--iters", "3", "--warmup", "1", "--out", str(path), env=env)
    assert f"wrote {path}" in out and "choice" in out
    prof = load_profile(path)
    fp = prof.fingerprint
    assert (fp.num_nodes, fp.local_size, fp.device, fp.backend) == (2, 2, "cpu", "mpi")
    assert fp.link == "mpi-1host-simulated"
    assert [e.bytes_per_rank for e in prof.entries] == [4096, 65536]
    for e in prof.entries:
        assert e.choice in ("flat", "2dh") and set(e.timings) == {"flat", "2dh"}
        assert e.choice == min(("flat", "2dh"), key=lambda a: (e.timings[a]["median_s"], a != "flat"))
        assert all(0 < t["median_s"] <= t["p99_s"] for t in e.timings.values())
    assert set(prof.links) == {"intra", "inter", "copy"}

    assert cli.main(["show", str(path), "--png", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["simulate", "--nodes", "2", "--local-size", "2", "--profile", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "model error vs the measured timings of 2x2" in shown and "mean |error|" in shown

    out = run_ranks(4, "tests.ranks.hierarchical_tuner", str(path), str(tmp_path), env=env)
    assert "4 checks passed on 4 ranks" in out
