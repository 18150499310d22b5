"""moecomm_ext build, cache and fallback behaviour."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pytest
import torch

import moecomm_ext as me
from moecomm_ext import _loader, _specs

REPO = Path(__file__).resolve().parents[1]
HAVE_CXX = bool(shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++"))

CHILD = r"""
import json, sys, time, warnings
if "jit" in sys.argv[1:]:  # act as a checkout that was never built: no installed module
    sys.modules["moecomm_ext._rows_cpu"] = None
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


def _run_child(env: dict[str, str], *args: str, timeout: float = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_failed_build_falls_back_with_exactly_one_warning(tmp_path):
    res = _run_child(_child_env(tmp_path / "cache", CXX="/nonexistent/c++"), "jit")
    assert res["impl"] == "reference" and not res["native"]
    assert res["ok"], "reference fallback gave a wrong answer"
    assert len(res["warnings"]) == 1, res["warnings"]
    msg = res["warnings"][0]
    assert "moecomm_ext_rows_cpu" in msg and "Reason: not built at install" in msg and "reference" in msg


def test_failed_build_in_process_warns_once(monkeypatch):
    def boom(**kwargs):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(_loader, "_LOADED", {})  # restored afterwards
    monkeypatch.setattr(_loader, "_import_installed", lambda spec: (None, "not built at install"))
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


def test_default_cache_dir_is_keyed_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MOECOMM_EXT_CACHE", str(tmp_path / "c"))
    assert me.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MOECOMM_EXT_CACHE")
    d = me.default_cache_dir()
    flavour = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert d.parent == Path.home() / ".cache" / "moecomm_ext"
    assert d.name.startswith(f"{torch.__version__.split('+')[0]}-{flavour}-{py}-"), d
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    other = me.default_cache_dir()
    assert other.parent == d.parent and other != d  # two environments never share builds


def test_cuda_without_cuda_is_unavailable_without_warning(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    monkeypatch.setattr(_loader, "_LOADED", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert me.native_available("cuda") is False
        assert me.implementation("cuda") == "reference"


class _FakeExtension(types.ModuleType):
    def gather_rows(self, *a):  # never called: the loader only checks that it is there
        raise AssertionError

    gather_reduce_rows = gather_rowdot = route_capacity = route_backward = gather_rows
    step_route = step_ffn = step_combine_backward = step_ffn_backward = step_route_backward = gather_rows
    ll_dispatch_layout = ll_dispatch_place = glu_forward = glu_backward = gather_rows
    select_experts = select_experts_backward = seg_bias_act = seg_colsum = gather_rows


def test_installed_module_is_used_without_compiling(monkeypatch, capsys, tmp_path):
    """Loading imports the module built at install and never compiles; a module built from
    other sources (an edited checkout) is not used: the just-in-time build is, with a line
    on stderr saying so."""
    spec = _loader._build_spec("cpu")
    fake = _FakeExtension(spec.installed)
    fake.source_hash = _specs.source_hash(spec, torch.__version__)
    built = []
    monkeypatch.setattr(_loader, "_LOADED", {})
    monkeypatch.setitem(sys.modules, spec.installed, fake)
    monkeypatch.setattr(_loader, "_torch_load", lambda **kw: built.append(kw) or _FakeExtension("jit"))
    assert me.load_native("cpu") is fake and built == []
    assert _loader._LOADED["cpu"].origin == "installed"

    monkeypatch.setattr(_loader, "_LOADED", {})
    fake.source_hash = "0123456789ab"  # stale
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod = me.load_native("cpu", cache_dir=tmp_path)
    assert mod is not fake and len(built) == 1 and _loader._LOADED["cpu"].origin == "jit"
    assert any(f"-D{_specs.HASH_MACRO}=" in f for f in built[0]["extra_cflags"])
    err = capsys.readouterr().err
    assert "moecomm_ext: building moecomm_ext_rows_cpu (first use, about" in err
    assert "older than its sources" in err


@pytest.mark.skipif(importlib.util.find_spec("moecomm_ext._rows_cpu") is None,
                    reason="moecomm_ext was not built at install (a checkout used through PYTHONPATH)")
def test_the_module_built_at_install_matches_the_sources(monkeypatch):
    monkeypatch.setattr(_loader, "_LOADED", {})
    monkeypatch.setattr(_loader, "_torch_load", lambda **kw: pytest.fail("compiled although installed"))
    assert me.load_native("cpu", strict=True) is not None
    assert _loader._LOADED["cpu"].origin == "installed"


def test_build_lock_is_broken_after_its_timeout(tmp_path):
    lock = tmp_path / _loader.LOCK_NAME
    lock.write_text(f"{os.getpid()} {socket.gethostname()} 0\n")  # a live holder: this process
    start = time.perf_counter()
    with _loader._build_lock(lock, stale_after=0.5, poll=0.05):
        assert str(os.getpid()) in lock.read_text()
    assert 0.4 < time.perf_counter() - start < 10
    assert not lock.exists()
    lock.write_text("")  # a holder that died between creating and writing it, long ago
    os.utime(lock, (time.time() - 60, time.time() - 60))
    with _loader._build_lock(lock, poll=0.05):
        pass
    assert not lock.exists()


# A tiny extension in the C API only (no torch or pybind11 headers: it compiles in well under
# a second), loaded through the real just-in-time path: lock, stderr line, cache, torch's load.
TINY_SOURCE = r"""
#include <Python.h>
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, "moecomm_ext_tiny", nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""

JIT_CHILD = r"""
import json, sys, time
from pathlib import Path
from moecomm_ext import _loader, _specs
tiny = _specs.Spec("cpu", "moecomm_ext_tiny", "moecomm_ext._tiny_not_installed", (sys.argv[2],),
                   ("-O0",), None, (), "cpu", ("answer",))
t = time.perf_counter()
out = _loader._jit(tiny, Path(sys.argv[1]), False, "not built at install")
print(json.dumps(dict(origin=out.origin, reason=out.reason, ok=out.module is not None and out.module.answer() == 42,
                      s=time.perf_counter() - t)))
"""


def _jit_child(cache: Path) -> subprocess.Popen:
    source = cache.parent / "tiny.cpp"
    if not source.exists():
        source.write_text(TINY_SOURCE)
    return subprocess.Popen([sys.executable, "-c", JIT_CHILD, str(cache), str(source)], env=_child_env(cache), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen) -> tuple[dict, str]:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["origin"] == "jit" and res["ok"], (res, err[-3000:])
    return res, err


@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler")
def test_concurrent_jit_builds_share_one_build_and_survive_a_dead_builder(tmp_path, caplog):
    """Several processes (think MPI ranks) load a cold cache at once: one builds and says so,
    the others wait on the lock; a lock (ours and torch's) left by a killed builder is broken."""
    cache = tmp_path / "cache"
    results = [_finish(p) for p in [_jit_child(cache) for _ in range(3)]]
    messages = [err.count("moecomm_ext: building moecomm_ext_tiny (first use, about") for _, err in results]
    assert sorted(messages) == [0, 0, 1], [err[-2000:] for _, err in results]
    build_dirs = [p for p in cache.iterdir() if p.is_dir()]
    assert len(build_dirs) == 1 and len(list(build_dirs[0].glob("*.so"))) == 1
    assert not (build_dirs[0] / _loader.LOCK_NAME).exists() and not (build_dirs[0] / "lock").exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (build_dirs[0] / _loader.LOCK_NAME).write_text(f"{dead.stdout.strip()} {socket.gethostname()} 0\n")
    (build_dirs[0] / "lock").write_text("")  # torch's own baton, which it would wait on forever
    so = next(build_dirs[0].glob("*.so"))
    mtime = so.stat().st_mtime_ns
    tiny = _specs.Spec("cpu", "moecomm_ext_tiny", "moecomm_ext._tiny_not_installed", (str(tmp_path / "tiny.cpp"),),
                       ("-O0",), None, (), "cpu", ("answer",))
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger="moecomm_ext"):
        out = _loader._jit(tiny, cache, False, "not built at install")
    assert "broke the stale build lock" in caplog.text
    assert out.origin == "jit" and out.module.answer() == 42, out.reason
    assert time.perf_counter() - start < 60 and so.stat().st_mtime_ns == mtime, "the warm load rebuilt the library"
    assert not (build_dirs[0] / _loader.LOCK_NAME).exists()


@pytest.mark.skipif(
    not (shutil.which("nvcc") and os.environ.get("MOECOMM_EXT_TEST_NVCC") == "1"),
    reason="compile check of the CUDA row kernels needs nvcc and MOECOMM_EXT_TEST_NVCC=1 (takes ~30-60 s)",
)
def test_cuda_source_compiles_with_nvcc(tmp_path):
    """Without a GPU: the row extension's .cu sources must at least compile for sm_90 with the
    loader's flags."""
    from torch.utils.cpp_extension import include_paths

    spec = _loader._build_spec("cuda")
    includes = [f"-I{p}" for p in include_paths()]
    macros = Path(include_paths()[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not macros.exists():  # CPU-only torch wheels lack this generated header
        stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.insert(0, f"-I{tmp_path / 'stub'}")
    for source in [s for s in spec.sources if s.endswith(".cu")]:
        cmd = [
            "nvcc", "-c", str(_loader._CSRC / source), "-o", str(tmp_path / (source + ".o")),
            "-std=c++20", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
            "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
            "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
            *spec.cuda_cflags, *includes,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, source + ": " + proc.stderr[-4000:]
