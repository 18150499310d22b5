"""``moecomm.integrations.megatron.enable(layer="moecomm")``: Megatron-core's MoELayer on moecomm's
fused step against Megatron's own forward, on 1, 2 and 3 MPI ranks (expert parallelism over
the ranks; tests/ranks/megatron_layer_checks.py), skipped where megatron-core (and the triton
it imports) is absent; and the option's errors, which need no Megatron."""

from __future__ import annotations

import importlib.util

import pytest

from tests.mpi_util import launch_ranks

_HAVE = importlib.util.find_spec("megatron") is not None


@pytest.mark.mpi
@pytest.mark.skipif(not _HAVE, reason="megatron-core is not installed (README: Megatron-core and DeepSpeed)")
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_layer_equals_megatron_own_forward(nprocs):
    cmd, rc, out, err = launch_ranks(nprocs, "tests.ranks.megatron_layer_checks", timeout=280)
    if rc == 77:
        pytest.skip(out.strip().splitlines()[0])
    assert rc == 0 and f"megatron layer checks passed on {nprocs} ranks" in out, \
        f"{' '.join(cmd)}: {rc}\n{out[-4000:]}\n{err[-4000:]}"


def test_enable_refuses_an_unknown_layer():
    from moecomm.integrations import megatron

    with pytest.raises(ValueError, match="layer must be one of"):
        megatron.enable(layer="tutel")
    assert not megatron.layer_enabled()
