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

    env = dict(os.environ, PYTHONPATH=str(target))
    probe = ("import importlib.util, moecomm.topology, moecomm.bench.alltoall, moecomm.bench.latency, "
             "moecomm.bench.hierarchical; print(moecomm.topology.__file__); print(moecomm.bench.alltoall.parse_bytes('1K'))")
    out = _run([sys.executable, "-c", probe], cwd=tmp_path, env=env).split()
    assert out == [str(target / "moecomm" / "topology" / "__init__.py"), "1024"], out
    out = _run([sys.executable, str(target / "bin" / "moecomm-bench"), "-h"], cwd=tmp_path, env=env)
    assert out.startswith("usage: moecomm-bench NAME") and "alltoall" in out and "graphs" not in out
    bad = subprocess.run([sys.executable, str(target / "bin" / "moecomm-bench"), "nope"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown benchmark 'nope'" in bad.stderr
    out = _run([sys.executable, str(target / "bin" / "moecomm-topology"), "-h"], cwd=tmp_path, env=env)
    assert "tune" in out and "simulate" in out


def test_checkout_module_forms_keep_working():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    assert "usage:" in _run([sys.executable, "-m", "topology", "-h"], cwd=REPO, env=env)
    assert "--maxbytes" in _run([sys.executable, "-m", "bench.alltoall", "-h"], cwd=REPO, env=env)
    out = _run([sys.executable, "-m", "bench", "latency", "-h"], cwd=REPO, env=env)
    assert "--sizes" in out
