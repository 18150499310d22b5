"""The integrations' pieces that need neither the frameworks nor MPI ranks: the megatron-core
version check (with the version faked) and DeepSpeed's ``group=None`` (its expert group before
``set_deepspeed_parallelism()``), on a one-rank gloo group in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moecomm.integrations import megatron


@pytest.mark.parametrize("version, ok", [("0.19.2", True), ("0.19.2+f6a5b40", True), ("0.20.0rc1", True),
                                         ("1.0", True), (None, True), ("0.16.1", False), ("0.9.0", False),
                                         ("unknown", False)])
def test_megatron_check_version(version, ok):
    why = megatron.check_version(version)
    assert (why is None) == ok, why
    if not ok:
        assert f"megatron-core {version} is not supported" in why and "0.19 and later" in why
        assert megatron.INSTALL in why and "README" in why


def test_megatron_enable_refuses_an_unsupported_version(monkeypatch):
    """``enable()`` on megatron-core 0.16.1 (what pip picks on Python 3.11) says what to install,
    before importing Megatron, and enables nothing."""
    monkeypatch.setattr(megatron, "installed_version", lambda: "0.16.1")
    monkeypatch.setattr(megatron, "_mappings", lambda: pytest.fail("imported Megatron for an unsupported version"))
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.16\.1 is not supported.*--ignore-requires-python "
                                           r"megatron-core==0\.19\.2"):
        megatron.enable()
    assert not megatron.is_enabled()


def test_deepspeed_group_none_is_the_world_group():
    """DeepSpeed's ``_AllToAll`` gets ``group=None`` from a layer whose expert group was never set:
    the world group to DeepSpeed and torch, so to moecomm too (no TypeError)."""
    from tests.mpi_util import ROOT

    script = (
        "import types, torch, torch.distributed as dist\n"
        "from moecomm.integrations import deepspeed as ds\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "x = torch.arange(12.0).reshape(2, 3, 2)\n"
        "ctx = types.SimpleNamespace()\n"
        "y = ds._forward(ctx, None, x)\n"
        "assert torch.equal(x, y) and ctx.group is None, (x, y, ctx.group)\n"
        "dist.destroy_process_group()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("PMI_RANK", "PMI_SIZE", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("layer", ["MoeComm", "tutel", None, 1])
def test_deepspeed_enable_refuses_an_unknown_layer(layer):
    """``enable(layer=)`` names the argument and the value, before importing DeepSpeed."""
    from moecomm.integrations import deepspeed as ds

    with pytest.raises(ValueError, match=rf"layer must be one of \('deepspeed', 'moecomm'\), got {layer!r}"):
        ds.enable(layer=layer)
    assert not ds.layer_enabled() and not ds.is_enabled()
