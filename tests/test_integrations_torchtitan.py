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


def test_bench_frameworks_torchtitan_cpu_smoke(tmp_path):
    """``bench.frameworks --only torchtitan`` on 2 CPU ranks, tiny sizes: both methods timed."""
    if importlib.util.find_spec("torchtitan") is None:
        from moecomm.integrations.torchtitan import INSTALL

        pytest.skip(f"torchtitan is not installed: {INSTALL}")
    import json
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "titan.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "bench.frameworks", "--device", "cpu", "--only", "torchtitan", "--tokens", "32", "--model-dim", "16",
           "--hidden", "16", "--experts", "4", "--iters", "2", "--warmup", "1", "--json", str(out)]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())["torchtitan"]
    assert set(result["methods"]) == {"native", "moecomm"}
    assert result["config"]["spmd_backend"] == "partial_dtensor"
    assert all(v > 0 for v in result["ratio_moecomm_over_native"].values())
