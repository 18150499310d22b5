"""The tuner's pieces without MPI ranks: fits, model, CLI show (its matplotlib plot)/simulate."""

from __future__ import annotations

import json
import sys

import pytest

from moecomm.profile import Fingerprint, Profile, ProfileEntry
from topology import cli
from topology.measure import fit_alpha_beta, fit_link, format_bytes, parse_bytes
from topology.model import Link, Links, best_time, crossover, flat_time, hdh_time, model_error, wire_ratio, wire_time

pytestmark = pytest.mark.timeout(120)


def _png_pixels(path):
    """The image as an [h, w, channels] array, read back by matplotlib (a PNG it can decode)."""
    import matplotlib.image

    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(str(path))


def test_fits_recover_parameters():
    alpha, msg, beta = 20e-6, 3e-6, 5e9
    pts = [(p, m, alpha + (p - 1) * (msg + m / beta)) for p in (2, 8) for m in (256, 4096, 1 << 16, 1 << 20)]
    a, o, b = fit_link(pts)
    assert a == pytest.approx(alpha, rel=1e-6) and o == pytest.approx(msg, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    a, o, b = fit_link([(p, m, t) for p, m, t in pts if p == 8])  # one group size: msg folds into alpha
    assert o == 0 and b == pytest.approx(beta, rel=1e-3)
    a, b = fit_alpha_beta([(m, 1e-5 + m / 2e9) for m in (1, 1000, 1 << 20)])
    assert a == pytest.approx(1e-5, rel=1e-6) and b == pytest.approx(2e9, rel=1e-6)
    assert fit_alpha_beta([(m, 1e-4) for m in (10, 100, 1000)])[1] == float("inf")  # flat: latency only


def test_parse_and_format_bytes():
    assert [parse_bytes(s) for s in ("4096", "64K", "16M", "1G", "1.5KiB", "2MB")] == \
        [4096, 65536, 16 << 20, 1 << 30, 1536, 2 << 20]
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("lots")
    assert format_bytes(1 << 20) == "1 MiB" and format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 B"


LINKS = Links(Link(10e-6, 150e9, 0.5e-6), Link(15e-6, 45e9, 2e-6), Link(5e-6, 1.5e12))


def test_model_shapes():
    # one node: 2DH is the intra-node exchange alone (no copies, no rail)
    assert hdh_time(LINKS, 1, 8, 1 << 20, counts=False) == pytest.approx(LINKS.intra.call((1 << 20) / 8, 7))
    assert flat_time(LINKS, 1, 8, 1 << 20, counts=False) == pytest.approx(LINKS.intra.call((1 << 20) / 8, 7))
    # one rank per node: both are the rail exchange
    assert hdh_time(LINKS, 16, 1, 1 << 20) == pytest.approx(flat_time(LINKS, 16, 1, 1 << 20))
    # at scale 2DH wins small messages and loses huge ones; crossover lies between
    small, big = 1 << 16, 1 << 36
    assert hdh_time(LINKS, 64, 8, small) < flat_time(LINKS, 64, 8, small)
    assert hdh_time(LINKS, 64, 8, big) > flat_time(LINKS, 64, 8, big)
    x = crossover(LINKS, 64, 8)
    assert small < x < big
    assert hdh_time(LINKS, 64, 8, x) == pytest.approx(flat_time(LINKS, 64, 8, x), rel=1e-6)
    assert crossover(LINKS, 16, 1) is None
    err = model_error(LINKS, 2, 4, [(1 << 20, "flat", flat_time(LINKS, 2, 4, 1 << 20) * 2),
                                    (1 << 20, "2dh", hdh_time(LINKS, 2, 4, 1 << 20))])
    assert err["n"] == 2 and err["max_abs_rel"] == pytest.approx(0.5) and err["mean_abs_rel"] == pytest.approx(0.25)


def _profile(tmp_path) -> str:
    fp = Fingerprint(2, 4, "cpu", "mpi-1host-simulated", "mpi")
    entries = []
    for b in (4096, 65536, 1 << 20):
        f, h = flat_time(LINKS, 2, 4, b) * 1.2, hdh_time(LINKS, 2, 4, b) * 0.9
        entries.append(ProfileEntry(b, "2dh" if h < f else "flat",
                                    {"flat": {"median_s": f, "p99_s": f * 1.5}, "2dh": {"median_s": h, "p99_s": h * 1.5}}))
    links = {k: {"alpha_s": v.alpha_s, "msg_s": v.msg_s, "beta_Bps": v.beta_Bps}
             for k, v in (("intra", LINKS.intra), ("inter", LINKS.inter), ("copy", LINKS.copy))}
    return str(Profile(fp, tuple(entries), links).save(tmp_path / "prof.json"))


def test_cli_show(tmp_path, capsys):
    path = _profile(tmp_path)
    png = tmp_path / "show.png"
    assert cli.main(["show", path, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "2 node(s) x 4 rank(s)" in out and "flat med" in out and "2dh p99" in out and f"plot: {png}" in out
    assert out.count("KiB") >= 2 and "1 MiB" in out
    px = _png_pixels(png)
    assert px.shape[:2] == (560, 900)
    colors = {tuple(round(float(c), 2) for c in p[:3]) for p in px.reshape(-1, px.shape[2])[::7]}
    assert (0.12, 0.47, 0.71) in colors and (1.0, 0.5, 0.05) in colors  # flat and 2dh lines (C0, C1)


def test_cli_show_without_matplotlib(tmp_path, capsys, monkeypatch):
    path = _profile(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.chdir(tmp_path)
    assert cli.main(["show", path]) == 0  # the table still; the default plot is skipped, saying why
    out = capsys.readouterr().out
    assert "flat med" in out and "no plot: plotting needs matplotlib" in out
    assert cli.main(["show", path, "--png", str(tmp_path / "x.png")]) == 2
    assert "pip install" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_cli_simulate(tmp_path, capsys):
    assert cli.main(["simulate", "--nodes", "8", "--local-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "crossover:" in out and "model error: not checked" in out
    for g in (64, 128, 256, 512, 1024, 2048, 4096):
        assert f"\n{g:6d} " in out
    assert cli.main(["simulate", "--nodes", "2", "--local-size", "4", "--profile", _profile(tmp_path),
                     "--flat-links", "concurrent"]) == 0
    out = capsys.readouterr().out
    # the synthetic timings are the model's own x1.2 (flat) and x0.9 (2dh)
    assert "flat mean 17% max 17%" in out and "2dh mean 11% max 11%" in out
    assert cli.main(["simulate", "--nodes", "4", "--local-size", "2", "--alpha-inter", "1e-3", "--gpus", "64,101"]) == 0
    out = capsys.readouterr().out
    assert "overridden by --alpha-inter" in out and "not a multiple of local size" in out


def test_cli_simulate_takes_the_layout_from_the_profile(tmp_path, capsys):
    """``simulate --profile P`` models the profile's own 2 nodes x 4 ranks unless flags say otherwise."""
    path = _profile(tmp_path)
    assert cli.main(["simulate", "--profile", path]) == 0
    assert "alpha-beta model: 2 node(s) x 4 rank(s) = 8 ranks" in capsys.readouterr().out
    assert cli.main(["simulate", "--profile", path, "--local-size", "8"]) == 0
    assert "alpha-beta model: 2 node(s) x 8 rank(s) = 16 ranks" in capsys.readouterr().out
    assert cli.main(["simulate", "--local-size", "8"]) == 2
    assert "simulate needs --nodes (or --profile PROFILE" in capsys.readouterr().err


def test_cli_probe_without_a_launcher_says_how_to_launch(capsys, monkeypatch):
    """``probe``/``tune --local-size 4`` in one process: "run under mpiexec -n N", not a layout error."""
    for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE",
              "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for command in ("probe", "tune"):
        assert cli.main([command, "--local-size", "4"]) == 2
        err = capsys.readouterr().err
        assert "run under mpiexec -n N (N a multiple of 4)" in err and "without a launcher" in err, err
        assert f"mpiexec -n 8 python -m topology {command} --local-size 4" in err
    assert cli.main(["probe", "--sizes", "256", "--iters", "1", "--warmup", "0", "--backend", "self"]) == 0
    assert "one rank has no links to measure, only the layout copy: run under mpiexec -n N" in capsys.readouterr().out


def test_wire_model():
    """The FP8 wire model: the packed rows' bytes (from quant.packed_row_bytes, counted here by
    hand) through the faster algorithm, plus two passes over (1 + w) B on the copy link."""
    assert wire_ratio(2048, 2) == pytest.approx((2048 + 4 * 16) / 4096)  # 2112 B: a multiple of 16
    assert wire_ratio(1000, 4) == pytest.approx((1000 + 4 * 8 + 8) / 4000)  # 1032 rounded up to 1040
    with pytest.raises(ValueError, match="row_elems"):
        wire_ratio(0, 2)
    w = wire_ratio(2048, 2)
    for nodes, local, b in ((64, 8, 1 << 20), (64, 8, 256 << 20), (1, 8, 16 << 20), (16, 1, 4 << 10)):
        t, alg = wire_time(LINKS, nodes, local, b, w)
        inner = min(flat_time(LINKS, nodes, local, w * b), hdh_time(LINKS, nodes, local, w * b))
        assert t == pytest.approx(inner + 2 * (5e-6 + (1 + w) * b / 1.5e12))
        assert alg == best_time(LINKS, nodes, local, w * b)[1]
    # across nodes of a 400 Gb/s network, large exchanges gain about what the bytes save; tiny
    # ones only pay the passes
    assert wire_time(LINKS, 64, 8, 256 << 20, w)[0] / best_time(LINKS, 64, 8, 256 << 20)[0] < 0.7
    assert wire_time(LINKS, 64, 8, 1 << 10, w)[0] > best_time(LINKS, 64, 8, 1 << 10)[0]


def test_cli_simulate_wire(capsys):
    assert cli.main(["simulate", "--nodes", "8", "--local-size", "8", "--wire-dtype", "float8_e4m3fn",
                     "--ratio-sizes", "256M", "--gpus", "64,4096"]) == 0
    out = capsys.readouterr().out
    assert "rows of 2048 bfloat16 (4096 B) travel as 2112 B (0.516x)" in out
    table = out.split("predicted float8_e4m3fn/bfloat16 time ratio")[1]
    ratios = [float(line.split()[2]) for line in table.splitlines()[2:4]]
    assert [line.split()[:2] for line in table.splitlines()[2:4]] == [["64", "8"], ["4096", "512"]]
    assert all(0.5 < r < 0.7 for r in ratios), ratios
    assert cli.main(["simulate", "--nodes", "2", "--local-size", "2", "--wire-dtype", "float8_e5m2",
                     "--dtype", "float32", "--row-elems", "1000"]) == 0
    assert "rows of 1000 float32 (4000 B) travel as 1040 B (0.260x)" in capsys.readouterr().out
    assert cli.main(["simulate", "--nodes", "2", "--local-size", "2", "--wire-dtype", "float8_e5m2",
                     "--row-elems", "0"]) == 2
    assert "--row-elems must be >= 1" in capsys.readouterr().err


def test_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "moecomm.topology-profile", "version": 7}))
    assert cli.main(["show", str(bad)]) == 2
    assert "profile version 7 is not supported" in capsys.readouterr().err
    assert cli.main(["simulate", "--nodes", "0", "--local-size", "2"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["tune", "--sizes", "lots"])


def test_tune_expert_fn():
    """``tune --expert-hidden``: the overlap sweep times a real FFN over rows of --row-bytes."""
    import torch

    from topology.cli import _expert_fn

    assert _expert_fn(0, 64, torch.float32, torch.device("cpu")) is None
    fn = _expert_fn(8, 64, torch.float32, torch.device("cpu"))
    rows = torch.randn(5, 16)
    out = fn(rows, None)
    assert out.shape == (5, 16) and torch.isfinite(out).all()
    with pytest.raises(SystemExit, match="whole torch.float32 elements"):
        _expert_fn(8, 6, torch.float32, torch.device("cpu"))
    with pytest.raises(SystemExit, match="floating --dtype"):
        _expert_fn(8, 64, torch.int32, torch.device("cpu"))
