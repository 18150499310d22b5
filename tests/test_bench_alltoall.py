"""bench.alltoall for people: sizes in whole rows (at least one), help from rank 0 only, and
``python -m bench.plot`` (issue 18)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import alltoall
from bench.alltoall import plan_sizes
from topology.rank_parser import RankZeroParser, launcher_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(1, 1 << 20), span=st.integers(0, 6), factor=st.integers(2, 8), row=st.integers(1, 1 << 14))
def test_plan_sizes_whole_rows_at_least_one(lo, span, factor, row):
    hi = lo * factor ** span
    plan = plan_sizes(lo, hi, factor, row)
    requested = [lo * factor ** i for i in range(span + 1)]
    expect_rows = []
    for r in requested:  # independent restatement: whole rows, at least one, repeats dropped
        n = r // row if r >= row else 1
        if n not in expect_rows:
            expect_rows.append(n)
    assert [rows for _, rows in plan] == expect_rows
    assert all(req in requested for req, _ in plan)


def test_plan_sizes_readme_example_and_bad_input():
    # -b 1K -e 64M -f 4 with rows of 4 KiB: 1K rounds up to one row; 4K is that row again
    plan = plan_sizes(1 << 10, 64 << 20, 4, 4096)
    assert plan[0] == (1024, 1) and [r for _, r in plan][:3] == [1, 4, 16] and len(plan) == 8  # 9 sizes, 4K dropped
    for bad in ((0, 4, 2, 1), (8, 4, 2, 1), (1, 4, 1, 1), (1, 4, 2, 0)):
        with pytest.raises(ValueError):
            plan_sizes(*bad)


@pytest.mark.mpi
def test_one_rank_run_reports_the_bytes_it_times(tmp_path):
    """-b 1K with rows of 4 KiB: one row, and size, algbw and busbw all from those 4096 bytes."""
    path = tmp_path / "r.json"
    results = alltoall.main(["-b", "1K", "-e", "8K", "-f", "2", "-n", "2", "-w", "0", "-p", "uniform,skewed",
                             "--no-progress", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["results"] == json.loads(json.dumps(results))
    assert [(r["size"], r["rows"]) for r in results if r["method"] == "moecomm"] == \
        [(4096, 1), (8192, 2)] * 2
    for r in results:
        assert r["size"] == r["rows"] * 4096 and r["check"]
        assert r["algbw"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw"] == 0.0  # one rank: (n-1)/n = 0


def test_batch_times_exchanges_back_to_back(tmp_path, monkeypatch):
    """--batch N: each timed sample issues N exchanges, then one synchronize, and reports the
    time per exchange; the header and the JSON say so."""
    calls = []
    real = alltoall.Bench.sync

    def counting_sync(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(alltoall.Bench, "sync", counting_sync)
    path = tmp_path / "r.json"
    results = alltoall.main(["-b", "4K", "-e", "4K", "-n", "3", "-w", "0", "-p", "uniform", "--batch", "4",
                             "--no-progress", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["batch"] == 4 and "of 4 exchanges back to back" in data["header"]
    methods = {r["method"] for r in results}
    assert len(calls) == 1 + 3 * len(methods)  # after the warm-up, then once per sample
    with pytest.raises(SystemExit):
        alltoall.main(["--batch", "0"])


def test_rank_zero_parser_is_quiet_elsewhere(monkeypatch, capsys):
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "RANK"):
        monkeypatch.delenv(var, raising=False)
    assert launcher_rank() == 0
    monkeypatch.setenv("PMI_RANK", "2")
    assert launcher_rank() == 2
    p = RankZeroParser(prog="x")
    p.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["--help"])
    assert exc.value.code == 0 and capsys.readouterr() == ("", "")
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["--n", "x"])
    assert exc.value.code == 2 and capsys.readouterr() == ("", "")
    monkeypatch.setenv("PMI_RANK", "0")
    with pytest.raises(SystemExit):
        p.parse_args(["--n", "x"])
    assert "invalid int value" in capsys.readouterr().err


@pytest.mark.mpi
def test_help_printed_once_under_mpiexec():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(["mpiexec", "-n", "3", sys.executable, "-m", "bench.alltoall", "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("usage: python -m bench.alltoall") == 1 and "usage:" not in proc.stderr


def _results() -> dict:
    rows = []
    for pattern in ("uniform", "random"):
        for i, size in enumerate((4096, 65536, 1 << 20)):
            for j, method in enumerate(("moecomm", "moecomm-known", "torch", "raw")):
                t = 10.0 * (i + 1) * (j + 1)
                rows.append(dict(pattern=pattern, size=size, rows=size // 4096, method=method, time_us=t,
                                 p99_us=t * 1.3, algbw=size / t / 1e3, busbw=size / t / 1e3 * 2 / 3, check=True))
    return {"header": "# test", "results": rows}


def test_plot_writes_a_png(tmp_path):
    src, out = tmp_path / "r.json", tmp_path / "plot.png"
    src.write_text(json.dumps(_results()))
    from bench import plot

    assert plot.main([str(src), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    import matplotlib.image

    px = matplotlib.image.imread(str(out))
    assert px.shape[0] > 400 and px.shape[1] > 800
    colors = {tuple(round(float(c), 2) for c in p[:3]) for p in px.reshape(-1, px.shape[2])[::5]}
    assert {(0.12, 0.47, 0.71), (1.0, 0.5, 0.05), (0.17, 0.63, 0.17), (0.84, 0.15, 0.16)} <= colors  # 4 methods


def test_plot_title_and_one_legend_for_every_panel():
    """The header's ``# `` is not in the title; one figure legend names every method (the time
    panels had none)."""
    pytest.importorskip("matplotlib")
    from bench import plot

    data = _results()
    fig = plot.build_figure(data["results"], "# moecomm all-to-all: 3 ranks\n# second line")
    try:
        assert fig.get_suptitle() == "moecomm all-to-all: 3 ranks\nsecond line"
        assert len(fig.legends) == 1
        assert [t.get_text() for t in fig.legends[0].get_texts()] == ["moecomm", "moecomm-known", "torch", "raw"]
        assert all(not ax.get_title().startswith("#") for ax in fig.axes)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def _row(method: str, time_us: float, **extra) -> dict:
    return dict(pattern="uniform", size=4096, rows=1, method=method, time_us=time_us, p99_us=time_us, algbw=1.0,
                busbw=0.5, check=True, wire_bytes=4096, **extra)


def test_table_has_wire_columns_only_with_a_wire_dtype():
    plain = alltoall.format_table([_row("moecomm", 10.0), _row("torch", 20.0)], "# h")
    assert "wire" not in plain and "vs plain" not in plain
    assert plain.splitlines()[1].split()[-2:] == ["vs", "raw"]
    assert plain.splitlines()[2].split()[-3:] == ["OK", "0.50x", "-"]
    wired = alltoall.format_table([_row("moecomm", 10.0), _row("moecomm-fp8", 5.0)], "# h")
    assert wired.splitlines()[1].split()[-3:] == ["wire", "vs", "plain"]
    assert wired.splitlines()[3].split()[-2:] == ["4096", "0.50x"]


def test_plot_errors_are_clear(tmp_path, capsys, monkeypatch):
    from bench import plot

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": [{"size": 1}]}))
    assert plot.main([str(bad), "-o", str(tmp_path / "x.png")]) == 2
    assert "lacks" in capsys.readouterr().err
    good = tmp_path / "r.json"
    good.write_text(json.dumps(_results()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot.main([str(good), "-o", str(tmp_path / "y.png")]) == 2
    assert "pip install" in capsys.readouterr().err and not (tmp_path / "y.png").exists()
