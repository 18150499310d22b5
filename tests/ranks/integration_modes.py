"""The three ways the integration rank checks run a framework: its own exchanges, or on
moecomm through the default (MPI) communicator or through one made on the torch group."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import moecomm
from moecomm.integrations import clear_group_cache

MODES = ("native", "moecomm-default", "moecomm-group")


@contextlib.contextmanager
def integration_mode(name: str, integration: Any, default_comm: Any) -> Iterator[None]:
    """native: the framework's own exchange; moecomm-default: through moecomm, with
    ``default_comm`` (the launch's MPI communicator) as the default; moecomm-group: through a
    communicator made on the framework's gloo group (no default). ``integration``: a module
    with ``enable()``/``disable()``; ``default_comm`` is the default again afterwards."""
    clear_group_cache()
    if name == "native":
        yield
        return
    moecomm.set_default_communicator(default_comm if name == "moecomm-default" else None)
    integration.enable()
    try:
        yield
    finally:
        integration.disable()
        moecomm.set_default_communicator(default_comm)
