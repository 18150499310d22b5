"""Shared launches of ranks (tests/mpi_util.py, SharedLaunches), and the order tests run in.

A test marked ``@pytest.mark.ranks_job(module, *args, env=..., timeout=...)`` with a
parameter (or marker keyword) ``nprocs`` gets, by calling its ``ranks_job`` fixture, the output
of ``mpiexec -n nprocs python -m module args``, run as one job of a single launch that runs
the jobs of every selected test of that world size (tests/ranks/suite.py): Python, torch
and MPI start once per world size instead of once per script.

Those launches start when the session does, on a background thread, one at a time, the
largest world size first; the tests run in three groups, each in its collected order: the
tests without ranks (not marked ``mpi``) while the launches run, then the tests reading a
shared launch, then the other multi-rank tests (their own launches, some timing a timeout),
when the shared launches are over and the cores are theirs.
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


def _group(item) -> int:
    """0: no ranks; 1: reads a shared launch; 2: launches ranks of its own."""
    if item.get_closest_marker("ranks_job") is not None:
        return 1
    return 2 if item.get_closest_marker("mpi") is not None else 0


def pytest_collection_modifyitems(session, config, items) -> None:
    items.sort(key=_group)  # stable: each group keeps the collected order


def pytest_collection_finish(session) -> None:
    """The plan: every selected test's job, per world size, in test order."""
    shared = _shared(session.config)
    for item in session.items:
        job = _job_of(item)
        if job is not None:
            shared.add(job)


@pytest.fixture(scope="session", autouse=True)
def _shared_launches_start(request, tmp_path_factory):
    """Start the planned shared launches in the background as the first test sets up; stop
    them at the end of the session (one still running then is ended)."""
    shared = _shared(request.config)
    shared.tmp_dir = lambda: tmp_path_factory.mktemp("ranks-job")
    shared.start_background()
    yield
    shared.stop()


@pytest.fixture
def ranks_job(request):
    """A function returning this test's job's output (its section of the shared launch's
    stdout, rank 0's lines in order); it fails the test unless the job passed."""
    job = _job_of(request.node)
    if job is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the ranks_job fixture needs @pytest.mark.ranks_job(...)")
    shared = _shared(request.config)

    def output() -> str:
        return shared.output(job)

    return output
