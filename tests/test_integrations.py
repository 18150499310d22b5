"""Megatron-core / DeepSpeed on moecomm, and the global torch.distributed swap, on 2 and 3 MPI ranks.

One ``mpiexec`` launch per world size runs every check (tests/ranks/integrations_checks.py);
the tests below read its report. The frameworks' tests are skipped where they are not
installed; to install them on CPU (Python 3.11 included, see README "Megatron-core and
DeepSpeed")::

    pip install --no-deps --ignore-requires-python megatron-core==0.19.2   # declares Python >= 3.12
    pip install --no-deps triton     # megatron.core imports it (besides torch, numpy, packaging)
    DS_BUILD_OPS=0 pip install deepspeed==0.19.8
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.mpi_util import launch_ranks

pytestmark = pytest.mark.mpi

_runs: dict[int, str] = {}


def _missing(*modules: str) -> str | None:
    for m in modules:
        try:
            if importlib.util.find_spec(m) is None:
                return m
        except (ImportError, ValueError):
            return m
    return None


def _skipped_by_ranks(out: str, name: str) -> None:
    """The ranks report ``SKIP <name>: <reason>`` where the framework is found but cannot be imported."""
    for line in out.splitlines():
        if line.startswith(f"SKIP {name}:"):
            pytest.skip(line)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def report(request) -> tuple[int, str]:
    """The launch's output, whether or not it passed: each test looks for its own PASS line, so
    a framework that fails fails its own test only (a check that failed ends the launch, so the
    checks after it report nothing)."""
    n = request.param
    if n not in _runs:
        cmd, rc, stdout, stderr = launch_ranks(n, "tests.ranks.integrations_checks", timeout=600,
                                                env={"DS_ACCELERATOR": "cpu", "MOECOMM_TIMEOUT": "120"})
        status = "did not finish within 600 s" if rc is None else f"exited with {rc}"
        _runs[n] = stdout if rc == 0 else f"{stdout}\n{' '.join(cmd)} {status}\n--- stderr ---\n{stderr[-8000:]}"
    return n, _runs[n]


def test_global_torch_distributed_swap(report):
    """torch.distributed.all_to_all_single/all_to_all = moecomm's: no recursion, right data."""
    n, out = report
    assert "PASS global-swap" in out, out[-3000:]


def test_megatron_core(report):
    """mappings.all_to_all and the MoEAlltoAllTokenDispatcher pipeline, bit-identical on moecomm."""
    missing = _missing("megatron.core", "triton")
    if missing:
        pytest.skip(f"{missing} is not installed: pip install --no-deps --ignore-requires-python "
                    f"megatron-core==0.19.2 && pip install --no-deps triton")
    from moecomm.integrations.megatron import check_version, installed_version

    unsupported = check_version(installed_version())
    if unsupported:
        pytest.skip(unsupported)
    n, out = report
    _skipped_by_ranks(out, "megatron")
    assert "PASS megatron" in out, out[-3000:]


def test_deepspeed_moe(report):
    """DeepSpeed's MoE layer, k = 1, 2, 3, plain and use_tutel=True, on moecomm."""
    if _missing("deepspeed"):
        pytest.skip("deepspeed is not installed: DS_BUILD_OPS=0 pip install deepspeed==0.19.8")
    n, out = report
    _skipped_by_ranks(out, "deepspeed")
    assert "PASS deepspeed" in out, out[-3000:]


def test_deepspeed_moecomm_layer(report):
    """enable(layer="moecomm"): DeepSpeed's MoE layer with moecomm's dispatch, grouped experts and
    combine equals DeepSpeed's own (float tolerance, tests/ranks/integrations_checks.py), and an
    unsupported expert falls back with a reason."""
    if _missing("deepspeed"):
        pytest.skip("deepspeed is not installed: DS_BUILD_OPS=0 pip install deepspeed==0.19.8")
    n, out = report
    _skipped_by_ranks(out, "deepspeed")
    assert "PASS deepspeed-layer" in out, out[-3000:]


def test_deepspeed_moecomm_layer_one_rank():
    """The same on one rank (ep_size 1: no exchange, every expert local)."""
    if _missing("deepspeed"):
        pytest.skip("deepspeed is not installed: DS_BUILD_OPS=0 pip install deepspeed==0.19.8")
    cmd, rc, out, err = launch_ranks(1, "tests.ranks.integrations_checks", "deepspeed-layer", timeout=600,
                                     env={"DS_ACCELERATOR": "cpu", "MOECOMM_TIMEOUT": "120"})
    _skipped_by_ranks(out, "deepspeed")
    assert rc == 0 and "PASS deepspeed-layer" in out, f"{' '.join(cmd)} exited with {rc}\n{out[-3000:]}\n{err[-3000:]}"
