"""torchtitan's expert-parallel MoE on moecomm, on real MPI ranks (run by tests/test_integrations_torchtitan.py).

torchtitan's own ``MoE`` module (router, token counts, ``AllToAllTokenDispatcher`` dispatch,
``GroupedExperts``, combine) runs forward and backward with its own exchanges ("native"), then
with ``moecomm.integrations.torchtitan.enable()`` on the MPI default communicator and on a
communicator made on the gloo group; outputs and every gradient must be equal bit for bit.
Both of torchtitan's exchange paths are run: ``spmd_backend="spmd_types"`` (its default:
``spmd_types.all_to_all``, the list ``torch.distributed.all_to_all``) and
``"partial_dtensor"`` (the functional ``all_to_all_single``). The reference is torchtitan's own
``"partial_dtensor"`` run: its own ``"spmd_types"`` path cannot run here, because gloo's list
``all_to_all`` refuses blocks of different sizes ("ProcessGroupGloo::alltoall: invalid tensor
size"), which the dispatcher sends whenever routing is uneven; both paths differ only in the
exchange call, and with moecomm enabled neither is called.

The layer is built with all experts and each rank keeps its own slice of the expert weights as
plain tensors (what ``parallelize`` leaves ``GroupedExperts.forward`` after ``to_local()``);
the EP mesh is wired with the dispatcher's ``wire_meshes`` as ``RoutedExperts.parallelize``
does. Where torchtitan cannot be imported the launch reports ``SKIP torchtitan: <reason>``.
"""

from __future__ import annotations


import torch

import moecomm
from moecomm.integrations import _groups
from tests.mpi_util import collective_assert, init_gloo_over_mpi, rank_main
from tests.ranks.integration_modes import MODES, checks_if_installed, integration_mode, same, say

init_gloo_over_mpi()
import torch.distributed as dist  # noqa: E402

W, R = dist.get_world_size(), dist.get_rank()
MPI_COMM = moecomm.init(backend="mpi", timeout=60)  # the default communicator (MPI rank == torch rank)
BACKENDS = ("spmd_types", "partial_dtensor")


def torchtitan_missing() -> str | None:
    try:
        import torchtitan.models.common.moe  # noqa: F401
        import torchtitan.models.common.token_dispatcher  # noqa: F401
    except ImportError as exc:
        return f"torchtitan cannot be imported ({exc})"
    return None


def spmd_backend(name: str, mesh):
    from bench.frameworks_torchtitan import spmd_backend as backend

    return backend(name, mesh)


def mode(name: str):
    """native: torchtitan's own exchanges; moecomm-default / moecomm-group: through moecomm."""
    from moecomm.integrations import torchtitan as tt

    return integration_mode(name, tt, MPI_COMM)


def build_moe(seed: int, dim: int, hidden: int, local: int, top_k: int, mesh):
    """torchtitan's MoE with ``local * W`` experts, this rank's expert slice, the EP mesh wired."""
    from bench.frameworks_torchtitan import build_moe as build

    return build(local * W, dim, hidden, top_k, seed, mesh, scale=0.3)


def moe_run(seed: int, top_k: int, mesh, skewed: bool):
    dim, hidden, local = 8, 16, 2
    moe = build_moe(seed, dim, hidden, local, top_k, mesh)
    g = torch.Generator().manual_seed(100 * seed + R)
    x = torch.randn(2, 5 + R, dim, generator=g)  # a different token count on every rank
    if skewed:  # most tokens to one expert, others none: zero splits both ways
        x = x + 4 * moe.router.gate.weight.detach()[0]
    x.requires_grad_(True)
    out = moe(x)
    r = torch.randn(out.shape, generator=g)
    (out * r).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in moe.parameters()]


def check_torchtitan_moe() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from moecomm.integrations import torchtitan as tt

    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("ep",))
    what = ["output", "input grad"] + [f"param grad {i}" for i in range(99)]
    for seed, top_k, skewed in ((0, 2, False), (1, 1, True), (2, 3, False)):
        runs = {}
        for backend in BACKENDS:
            with spmd_backend(backend, mesh):
                for name in MODES:
                    if name == "native" and backend == "spmd_types":
                        continue  # gloo's list all_to_all takes equal sizes only: see the module docstring
                    with mode(name):
                        runs[backend, name] = moe_run(seed, top_k, mesh, skewed)
                        used = _groups._by_group.get(mesh.get_group())
                        if name == "native":
                            collective_assert(used is None, f"native run mapped a communicator: {used}")
                        elif name == "moecomm-default":
                            collective_assert(used is MPI_COMM, f"default communicator not reused: {used}")
                        else:
                            collective_assert(used is not None and used.backend == "torch", f"group comm {used}")
        native = runs["partial_dtensor", "native"]
        for (backend, name), run in runs.items():
            for a, b, w in zip(native, run, what):
                same(a, b, f"torchtitan MoE {w} ({backend}, {name}, seed {seed}, top-{top_k})")
    collective_assert(not tt.is_enabled(), "disable restores")


def check_enable_disable() -> None:
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from moecomm.integrations import torchtitan as tt

    before = {n: AllToAllTokenDispatcher.__dict__[n] for n in tt._METHODS}
    tt.enable()
    tt.enable()  # idempotent
    ok = tt.is_enabled() and all(AllToAllTokenDispatcher.__dict__[n] is not before[n] for n in before)
    tt.disable()
    tt.disable()
    ok = ok and not tt.is_enabled() and all(AllToAllTokenDispatcher.__dict__[n] is before[n] for n in before)
    collective_assert(ok, "enable/disable do not swap the three methods and back")


def torchtitan_checks() -> list:
    return checks_if_installed("torchtitan", torchtitan_missing,
                               [check_enable_disable, check_torchtitan_moe, lambda: say("PASS torchtitan")])


if __name__ == "__main__":
    rank_main(torchtitan_checks())
