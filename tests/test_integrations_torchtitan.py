"""torchtitan's expert-parallel MoE on moecomm, on 2 and 3 MPI ranks.

One ``mpiexec`` launch per world size runs tests/ranks/torchtitan_checks.py: torchtitan's own
``MoE`` module forward and backward with its exchanges and with
``moecomm.integrations.torchtitan.enable()``, equal bit for bit. Skipped where torchtitan is
not installed; to install it without touching torch (README "torchtitan")::

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring-parser typeguard
    pip install --no-deps triton     # torchtitan's token dispatcher imports it
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from tests.mpi_util import launch_ranks

_runs: dict[int, str] = {}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def report(request) -> str:
    if importlib.util.find_spec("torchtitan") is None:  # before the launch: nothing to run it on
        from moecomm.integrations.torchtitan import INSTALL

        pytest.skip(f"torchtitan is not installed: {INSTALL}")
    n = request.param
    if n not in _runs:
        cmd, rc, stdout, stderr = launch_ranks(n, "tests.ranks.torchtitan_checks", timeout=300,
                                                env={"MOECOMM_TIMEOUT": "120"})
        status = "did not finish within 300 s" if rc is None else f"exited with {rc}"
        _runs[n] = stdout if rc == 0 else f"{stdout}\n{' '.join(cmd)} {status}\n--- stderr ---\n{stderr[-8000:]}"
    return _runs[n]


@pytest.mark.mpi
def test_torchtitan_moe(report):
    """torchtitan's MoE (router, AllToAllTokenDispatcher, GroupedExperts) bit-identical on moecomm,
    under both of its exchange paths (spmd_types and the functional all_to_all_single)."""
    for line in report.splitlines():
        if line.startswith("SKIP torchtitan:"):
            pytest.skip(line)
    assert "PASS torchtitan" in report, report[-3000:]


def _fake_dispatcher_module(monkeypatch, methods: dict) -> type:
    cls = type("AllToAllTokenDispatcher", (), dict(methods))
    module = types.ModuleType("torchtitan.models.common.token_dispatcher")
    module.AllToAllTokenDispatcher = cls
    monkeypatch.setitem(sys.modules, "torchtitan.models.common.token_dispatcher", module)
    return cls


def test_enable_without_torchtitan_names_the_recipe(monkeypatch):
    from moecomm.integrations import torchtitan as tt

    monkeypatch.setitem(sys.modules, "torchtitan.models.common.token_dispatcher", None)  # import fails
    with pytest.raises(ImportError, match="pip install --no-deps torchtitan==0.3.0"):
        tt.enable()
    assert not tt.is_enabled()


def test_enable_refuses_a_dispatcher_without_the_methods(monkeypatch):
    from moecomm.integrations import torchtitan as tt

    _fake_dispatcher_module(monkeypatch, {"_dispatch_token_exchange": lambda self: None})
    with pytest.raises(RuntimeError, match="_token_count_exchange, _combine_token_exchange.*tested: 0.3.0"):
        tt.enable()
    assert not tt.is_enabled()


def test_enable_disable_swap_the_methods_on_the_class(monkeypatch):
    from moecomm.integrations import torchtitan as tt

    own = {n: (lambda self, *a: n) for n in tt._METHODS}
    cls = _fake_dispatcher_module(monkeypatch, own)
    try:
        tt.enable()
        assert tt.is_enabled() and all(cls.__dict__[n] is not own[n] for n in own)
    finally:
        tt.disable()
    assert not tt.is_enabled() and all(cls.__dict__[n] is own[n] for n in own)


def test_install_recipe_is_the_readmes():
    from pathlib import Path

    from moecomm.integrations.torchtitan import INSTALL

    assert INSTALL in (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
