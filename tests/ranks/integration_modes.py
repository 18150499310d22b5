"""The three ways the integration rank checks run a framework: its own exchanges, or on
moecomm through the default (MPI) communicator or through one made on the torch group."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

import moecomm
from moecomm.integrations import clear_group_cache
from tests.mpi_util import collective_assert
from tests.ranks.data import as_bytes

MODES = ("native", "moecomm-default", "moecomm-group")


@contextlib.contextmanager
def integration_mode(name: str, integration: Any, default_comm: Any, **enable_kw: Any) -> Iterator[None]:
    """native: the framework's own exchange; moecomm-default: through moecomm, with
    ``default_comm`` (the launch's MPI communicator) as the default; moecomm-group: through a
    communicator made on the framework's gloo group (no default). ``integration``: a module
    with ``enable()``/``disable()`` (called with ``enable_kw``); ``default_comm`` is the default
    again afterwards."""
    clear_group_cache()
    if name == "native":
        yield
        return
    moecomm.set_default_communicator(default_comm if name == "moecomm-default" else None)
    integration.enable(**enable_kw)
    try:
        yield
    finally:
        integration.disable()
        moecomm.set_default_communicator(default_comm)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Collective: ``a`` and ``b`` hold the same bytes, shape and dtype on every rank."""
    ok = a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(as_bytes(a), as_bytes(b)))
    collective_assert(ok, f"{what} differs" + ("" if a.shape == b.shape else f": {tuple(a.shape)} vs {tuple(b.shape)}"))


def say(line: str) -> None:
    """Print ``line`` once (rank 0 of torch.distributed's world)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(line, flush=True)


def checks_if_installed(framework: str, missing: Callable[[], Optional[str]], checks: list) -> list:
    """``checks`` where ``missing()`` finds nothing absent, else none (and one line saying
    ``SKIP framework`` and why)."""
    reason = missing()
    if reason:
        say(f"SKIP {framework}: {reason}")
        return []
    return checks
