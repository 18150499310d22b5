"""Shared launches of ranks (tests/mpi_util.py, SharedLaunches).

A test marked ``@pytest.mark.ranks_job(module, *args, env=..., timeout=...)`` with a
parameter (or marker keyword) ``nprocs`` gets, by calling its ``ranks_job`` fixture, the output
of ``mpiexec -n nprocs python -m module args``, run as one job of a single launch that runs
the jobs of every selected test of that world size (tests/ranks/suite.py): Python, torch
and MPI start once per world size instead of once per script.
"""

from __future__ import annotations

import pytest

from tests.mpi_util import RankJob, SharedLaunches

_KEY = pytest.StashKey[SharedLaunches]()


def _job_of(item) -> RankJob | None:
    marker = item.get_closest_marker("ranks_job")
    if marker is None:
        return None
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    nprocs = params["nprocs"] if "nprocs" in params else marker.kwargs["nprocs"]
    return RankJob.from_marker(marker, nprocs)


def _shared(config) -> SharedLaunches:
    if _KEY not in config.stash:
        config.stash[_KEY] = SharedLaunches()
    return config.stash[_KEY]


def pytest_collection_finish(session) -> None:
    """The plan: every selected test's job, per world size, in test order."""
    shared = _shared(session.config)
    for item in session.items:
        job = _job_of(item)
        if job is not None:
            shared.add(job)


@pytest.fixture
def ranks_job(request, tmp_path_factory):
    """A function returning this test's job's output (its section of the shared launch's
    stdout, rank 0's lines in order); it fails the test unless the job passed."""
    job = _job_of(request.node)
    if job is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the ranks_job fixture needs @pytest.mark.ranks_job(...)")
    shared = _shared(request.config)

    def output() -> str:
        shared.tmp_dir = lambda: tmp_path_factory.mktemp("ranks-job")
        return shared.output(job)

    return output
