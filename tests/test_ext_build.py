"""moecomm_ext build, cache and fallback behaviour."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import moecomm_ext as me
from moecomm_ext import _loader

REPO = Path(__file__).resolve().parents[1]
HAVE_CXX = bool(shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++"))

CHILD = r"""
import json, sys, time, warnings
t0 = time.perf_counter()
import torch
import moecomm_ext as me
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    t1 = time.perf_counter()
    mod = me.load_native("cpu")
    t2 = time.perf_counter()
    x = torch.randn(6, 5, dtype=torch.float64)
    index = torch.tensor([5, -1, 0, 2])
    scale = torch.rand(4, dtype=torch.float64)
    out1 = me.gather_rows(x, index, scale)
    out2 = me.gather_reduce_rows(x, index.view(2, 2))
    impl = me.implementation("cpu")
    again = me.load_native("cpu")
ok = torch.equal(out1, me.reference.gather_rows(x, index, scale)) and torch.allclose(
    out2, me.reference.gather_reduce_rows(x, index.view(2, 2)))
build_warnings = [str(w.message) for w in rec if issubclass(w.category, me.NativeBuildWarning)]
print(json.dumps(dict(impl=impl, ok=ok, warnings=build_warnings, load_s=t2 - t1,
                      native=mod is not None, same=again is mod)))
"""


def _child_env(cache: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MOECOMM_EXT_DISABLE", None)
    env["MOECOMM_EXT_CACHE"] = str(cache)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _run_child(env: dict[str, str], timeout: float = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_failed_build_falls_back_with_exactly_one_warning(tmp_path):
    res = _run_child(_child_env(tmp_path / "cache", CXX="/nonexistent/c++"))
    assert res["impl"] == "reference" and not res["native"]
    assert res["ok"], "reference fallback gave a wrong answer"
    assert len(res["warnings"]) == 1, res["warnings"]
    msg = res["warnings"][0]
    assert "moecomm_ext_rows_cpu" in msg and "Reason:" in msg and "reference" in msg


def test_failed_build_in_process_warns_once(monkeypatch):
    def boom(**kwargs):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(_loader, "_LOADED", {})  # restored afterwards
    monkeypatch.setattr(_loader, "_torch_load", boom)
    x = torch.randn(4, 3)
    index = torch.tensor([3, -1])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = me.gather_rows(x, index, use_native=True)
        out2 = me.gather_reduce_rows(x, index.view(1, 2), use_native=True)
        assert me.implementation("cpu") == "reference"
        assert me.load_native("cpu") is None
    ours = [w for w in rec if issubclass(w.category, me.NativeBuildWarning)]
    assert len(ours) == 1 and "simulated compiler failure" in str(ours[0].message)
    assert issubclass(me.NativeBuildWarning, UserWarning)
    assert torch.equal(out, me.reference.gather_rows(x, index))
    assert torch.equal(out2, me.reference.gather_reduce_rows(x, index.view(1, 2)))
    with pytest.raises(RuntimeError, match="simulated compiler failure"):
        me.load_native("cpu", strict=True)


def test_disable_env_defaults_use_native_false(monkeypatch):
    calls = []
    monkeypatch.setattr(_loader, "_LOADED", {})
    monkeypatch.setattr(_loader, "_torch_load", lambda **kw: calls.append(kw))
    monkeypatch.setenv("MOECOMM_EXT_DISABLE", "1")
    assert me.default_use_native() is False
    assert me.implementation("cpu") == "reference"
    x = torch.randn(3, 2)
    assert torch.equal(me.gather_rows(x, torch.tensor([2])), x[2:])
    assert calls == []  # nothing was built
    monkeypatch.setenv("MOECOMM_EXT_DISABLE", "0")
    assert me.default_use_native() is True
    monkeypatch.delenv("MOECOMM_EXT_DISABLE")
    assert me.default_use_native() is True
    with pytest.raises(TypeError, match="'use_native'"):
        me.gather_rows(x, torch.tensor([2]), use_native="yes")  # type: ignore[arg-type]


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MOECOMM_EXT_CACHE", str(tmp_path / "c"))
    assert me.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MOECOMM_EXT_CACHE")
    d = me.default_cache_dir()
    flavour = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
    assert d == Path.home() / ".cache" / "moecomm_ext" / f"{torch.__version__.split('+')[0]}-{flavour}"


def test_cuda_without_cuda_is_unavailable_without_warning(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    monkeypatch.setattr(_loader, "_LOADED", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert me.native_available("cuda") is False
        assert me.implementation("cuda") == "reference"


@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler")
def test_concurrent_builds_share_one_cache_and_second_load_is_fast(tmp_path):
    """Several processes (think MPI ranks) load a cold cache at once: one builds,
    the others wait on torch's file baton; a later load reuses the build."""
    cache = tmp_path / "cache"
    env = _child_env(cache)
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD], env=env, cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["impl"] == "native" and r["ok"] and r["same"] and r["warnings"] == []
    build_dirs = [p for p in cache.iterdir() if p.is_dir()]
    assert len(build_dirs) == 1
    assert len(list(build_dirs[0].glob("*.so"))) == 1
    assert not (build_dirs[0] / "lock").exists()

    so = next(build_dirs[0].glob("*.so"))
    mtime = so.stat().st_mtime_ns
    start = time.perf_counter()
    warm = _run_child(env)
    assert warm["impl"] == "native" and warm["ok"]
    assert warm["load_s"] < 5.0, f"warm-cache load took {warm['load_s']:.1f} s"
    assert so.stat().st_mtime_ns == mtime, "warm load rebuilt the library"
    assert time.perf_counter() - start < 60


@pytest.mark.skipif(
    not (shutil.which("nvcc") and os.environ.get("MOECOMM_EXT_TEST_NVCC") == "1"),
    reason="compile check of rows_cuda.cu needs nvcc and MOECOMM_EXT_TEST_NVCC=1 (takes ~30-60 s)",
)
def test_cuda_source_compiles_with_nvcc(tmp_path):
    """Without a GPU: rows_cuda.cu must at least compile for sm_90 with the loader's flags."""
    from torch.utils.cpp_extension import include_paths

    spec = _loader._build_spec("cuda")
    includes = [f"-I{p}" for p in include_paths()]
    macros = Path(include_paths()[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not macros.exists():  # CPU-only torch wheels lack this generated header
        stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.insert(0, f"-I{tmp_path / 'stub'}")
    cmd = [
        "nvcc", "-c", str(_loader._CSRC / "rows_cuda.cu"), "-o", str(tmp_path / "rows_cuda.o"),
        "-std=c++20", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
        "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
        *spec["extra_cuda_cflags"], *includes,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
