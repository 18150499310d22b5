"""What a (non-editable) install puts on sys.path: moecomm, moecomm_ext, with topology/ and
bench/ inside moecomm, and no generic top-level name; the checkout's ``python -m`` forms."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_SKIP = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".hypothesis",
                               ".pytest_cache", "results")


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_install_into_a_target_exposes_only_namespaced_packages(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_SKIP)
    target = tmp_path / "target"
    env = dict(os.environ, MOECOMM_BUILD_EXT="0")  # the layout only: no compiling here
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--no-index",
          "--target", str(target), str(src)], cwd=tmp_path, env=env)

    top = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert top == {"moecomm", "moecomm_ext", "bin"}, top
    for pkg in [p.parent for p in REPO.glob("moecomm*/**/__init__.py") if "__pycache__" not in p.parts]:
        assert (target / pkg.relative_to(REPO) / "__init__.py").exists(), f"{pkg} was not installed"
    for name in ("topology", "bench"):
        for module in (REPO / name).glob("*.py"):
            assert (target / "moecomm" / name / module.name).exists(), module
    assert sorted(p.name for p in (target / "bin").iterdir()) == ["moecomm-bench", "moecomm-topology"]

    scripts = {p.name: p.read_text() for p in (target / "bin").iterdir()}
    assert sorted(scripts) == ["moecomm-bench", "moecomm-topology"]
    assert "from moecomm.bench.__main__ import main" in scripts["moecomm-bench"]
    assert "from moecomm.topology.cli import main" in scripts["moecomm-topology"]

    # One interpreter for every check (each one imports torch): the entry points called as
    # the scripts call them.
    out = _run([sys.executable, "-c", INSTALLED_PROBE], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(target)))
    lines = out.splitlines()
    assert lines[0] == str(target / "moecomm" / "topology" / "__init__.py"), lines
    assert lines[1] == "1024", lines  # bench found its sibling moecomm.topology
    assert "usage: moecomm-bench NAME" in out and "alltoall" in out and "graphs" not in out
    assert "bench rc 2: unknown benchmark 'nope'" in out
    assert "topology rc 0" in out and "simulate" in out


INSTALLED_PROBE = r"""
import contextlib, io, sys
import moecomm.topology, moecomm.bench.alltoall, moecomm.bench.latency, moecomm.bench.hierarchical
print(moecomm.topology.__file__)
print(moecomm.bench.alltoall.parse_bytes("1K"))
from moecomm.bench.__main__ import main as bench_main
from moecomm.topology.cli import main as topology_main
assert bench_main(["-h"]) == 0
err = io.StringIO()
with contextlib.redirect_stderr(err):
    rc = bench_main(["nope"])
print(f"bench rc {rc}: {err.getvalue().split(': ', 1)[1]}")
try:
    topology_main(["-h"])
except SystemExit as exc:
    print(f"topology rc {exc.code}")
"""

CHECKOUT_PROBE = r"""
import runpy, sys
for argv in (["topology", "-h"], ["bench.alltoall", "-h"], ["bench", "latency", "-h"]):
    sys.argv = ["x", *argv[1:]]
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        print(f"== {argv[0]} rc {exc.code}")
"""


def test_checkout_module_forms_keep_working():
    """python -m topology, python -m bench.alltoall and python -m bench NAME from the root."""
    out = _run([sys.executable, "-c", CHECKOUT_PROBE], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    parts = out.split("== ")
    assert "simulate" in parts[0] and parts[1].startswith("topology rc 0")
    assert "--maxbytes" in parts[1] and parts[2].startswith("bench.alltoall rc 0")
    assert "--sizes" in parts[2] and parts[3].startswith("bench rc 0")
