"""The host channel of the short integer agreements (moecomm._host_channel): real MPI ranks
run tests/ranks/host_channel_checks.py (channels of every size from 1 to the world's, against
numpy); the choice of channel for a group, without ranks."""

import types

import pytest

from tests.mpi_util import run_ranks


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [4])  # channels of 1, 2, 3 and 4 ranks, split from the 4
def test_host_channel_on_ranks(nprocs):
    out = run_ranks(nprocs, "tests.ranks.host_channel_checks")
    assert f"checks passed on {nprocs} ranks" in out


def test_gloo_capable_follows_the_groups_cpu_backend(monkeypatch):
    """A group whose CPU collectives run on gloo gets a channel; an NCCL-only group, or an
    object torch does not know as a group, does not (its agreements stay on the device)."""
    import torch.distributed as dist

    from moecomm._host_channel import gloo_capable

    names = {"g": "gloo", "mixed": "cpu:gloo,cuda:nccl", "n": "nccl"}

    def get_backend(group):
        if group not in names:
            raise ValueError("Invalid process group specified")
        return names[group]

    monkeypatch.setattr(dist, "get_backend", get_backend)
    assert gloo_capable("g") and gloo_capable("mixed")
    assert not gloo_capable("n") and not gloo_capable(types.SimpleNamespace())
