"""The NCCL backend's native send/recv issuer, on the CPU: the extension builds, refuses a
library that is not loaded, and the backend falls back to the raw bindings with one warning;
the transports' sources and build specs live in moecomm/backends."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import pytest

from moecomm.backends import _ext_specs, nccl
from moecomm.backends._ext import load_nccl_issue
from moecomm_ext import _loader, _specs


def test_extension_names_a_library_that_is_not_loaded():
    calls = load_nccl_issue().NcclCalls
    with pytest.raises(RuntimeError, match="/nonexistent/libnccl.so.2 is not loaded in this process"):
        calls("/nonexistent/libnccl.so.2")


def test_without_libnccl_the_backend_warns_once_and_uses_the_raw_bindings(monkeypatch):
    monkeypatch.setattr(nccl, "_NATIVE_CALLS", {})
    monkeypatch.setattr(nccl, "_loaded_nccl_library", lambda: (_ for _ in ()).throw(RuntimeError("no libnccl here")))
    with pytest.warns(RuntimeWarning, match="raw bindings .*unavailable: no libnccl here"):
        assert nccl._native_calls() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nccl._native_calls() is None  # the outcome is cached: no second warning


def test_a_library_that_fails_to_bind_is_reported(monkeypatch):
    monkeypatch.setattr(nccl, "_NATIVE_CALLS", {})
    monkeypatch.setattr(nccl, "_loaded_nccl_library", lambda: "/nonexistent/libnccl.so.2")
    with pytest.warns(RuntimeWarning, match="/nonexistent/libnccl.so.2 is not loaded in this process"):
        assert nccl._native_calls() is None


def test_transport_sources_live_beside_the_transports():
    backends = pathlib.Path(nccl.__file__).resolve().parent
    for kind in _ext_specs.KINDS:
        spec = _ext_specs.spec(kind, openmp=False, device_capability=None)
        assert spec.installed.startswith("moecomm.backends._") and spec.csrc == backends / "csrc"
        assert all(p.is_file() and p.parent == backends / "csrc" for p in spec.source_paths())
        assert _specs.CSRC / "source_hash.h" in spec.header_paths()  # the hash covers the shared header
    assert not list(_specs.CSRC.glob("p2p_cuda.cu")) and not list(_specs.CSRC.glob("nccl_issue.cpp"))
    with pytest.raises(ValueError, match="'kind' must not be one of"):
        _loader.load_extension("cpu", _ext_specs.spec, cuda=False, what="x")


SETUP_PROBE = r"""
import sys
source = open("setup.py").read().replace("setup(**_native_build())", "")
namespace = {"__file__": "setup.py", "__name__": "setup_probe"}
exec(compile(source, "setup.py", "exec"), namespace)
specs, transports = namespace["_load_specs"]()
assert "moecomm_ext" not in sys.modules and "moecomm" not in sys.modules, sorted(sys.modules)
for kind in transports.KINDS:
    s = transports.spec(kind, openmp=False)
    print(s.installed, [str(p.relative_to(namespace["ROOT"])) for p in s.source_paths()], len(specs.source_hash(s, "x")))
"""


def test_setup_loads_both_spec_files_without_importing_the_packages():
    """setup.py reads moecomm_ext/_specs.py and moecomm/backends/_ext_specs.py by path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SETUP_PROBE], cwd=root, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "moecomm.backends._p2p_cuda ['moecomm/backends/csrc/p2p_cuda.cu'] 12",
        "moecomm.backends._nccl_issue ['moecomm/backends/csrc/nccl_issue.cpp'] 12",
    ]
