"""The NCCL backend's native send/recv issuer, on the CPU: the extension builds, refuses a
library that is not loaded, and the backend falls back to the raw bindings with one warning."""

from __future__ import annotations

import warnings

import pytest

from moecomm.backends import nccl
from moecomm.backends._ext import load_nccl_issue


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
