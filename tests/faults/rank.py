"""One fault case, run on every rank: ``mpiexec -n K python -m tests.faults.rank PHASE KIND VICTIM``.

Rank VICTIM misbehaves at PHASE (``KIND``: ``raise`` an error, ``sleep`` forever, ``exit`` 0
early); the others run the phase normally. Every rank prints one line the campaign reads:
``FAULTS start rank=R t=UNIX`` before the phase, then ``FAULTS error rank=R after=S type=T
msg=M`` (the error it raised, which it re-raises) or ``FAULTS done rank=R``. The timeout comes
from ``MOECOMM_TIMEOUT``.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

import torch
from mpi4py import MPI

import moecomm

PHASES = ("init", "init-torch", "split", "counts", "rows", "2dh-intra", "2dh-rail", "overlap", "moe")
KINDS = ("raise", "sleep", "exit")


class InjectedFault(RuntimeError):
    """The victim's own error (kind ``raise``)."""


def fault(kind: str, where: str) -> None:
    if kind == "raise":
        raise InjectedFault(f"injected at {where}")
    if kind == "sleep":
        while True:
            time.sleep(3600)
    sys.exit(0)


def on_first_call(obj, names, kind: str, where: str, skip: int = 0) -> None:
    """Make the first call of any of ``obj``'s methods ``names`` (after ``skip`` calls, which
    run as usual) fault instead."""
    calls = [0]
    for name in names:
        real = getattr(obj, name)

        def hooked(*a, real=real, **k):
            calls[0] += 1
            if calls[0] > skip:
                fault(kind, where)
            return real(*a, **k)
        setattr(obj, name, hooked)


def splits(seed: int, W: int) -> list:
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(0, 6, (W, W), generator=g)
    m[:, 0] += 1  # never all zero: every rank sends something
    return m.tolist()


def main() -> None:
    phase, kind, victim = sys.argv[1], sys.argv[2], int(sys.argv[3])
    assert phase in PHASES and kind in KINDS, (phase, kind)
    world = MPI.COMM_WORLD
    R, W = world.Get_rank(), world.Get_size()
    bad = R == victim
    comm = None
    if phase == "init-torch":
        from tests.mpi_util import init_gloo_over_mpi

        init_gloo_over_mpi()
    elif phase != "init":
        comm = moecomm.init("mpi", local_size=2 if phase.startswith("2dh") else None, set_default=False)
    setup = {}
    if phase == "moe":
        from moecomm.moe import MoELayer

        torch.manual_seed(R)
        layer = MoELayer(8, 12, 2 * W, k=2, capacity_factor=0.0, comm=comm, seed=3, dtype=torch.float64)
        if bad:
            layer.experts.register_forward_pre_hook(lambda mod, args: fault(kind, "moe experts"))
        setup["x"] = torch.randn(10 + R, 8, dtype=torch.float64)
        setup["layer"] = layer
    world.Barrier()
    # a rank still here long after every deadline prints its stacks and ends (the campaign fails it)
    faulthandler.dump_traceback_later(float(os.environ.get("FAULTS_HANG_S", "60")), exit=True)
    t0 = time.time()
    report(R, f"start rank={R} t={t0:.3f}")
    try:
        run(phase, kind, bad, comm, R, W, setup)
    except SystemExit:
        raise
    except BaseException as exc:
        msg = str(exc).replace("\n", " ")
        report(R, f"error rank={R} after={time.time() - t0:.2f} type={type(exc).__name__} msg={msg}")
        raise
    report(R, f"done rank={R} after={time.time() - t0:.2f}")


def report(rank: int, line: str) -> None:
    """Print a result line, and append it to ``$FAULTS_DIR/rank<R>.txt`` (output may be cut short
    when the job is aborted; the file is not)."""
    print("FAULTS " + line, flush=True)
    out = os.environ.get("FAULTS_DIR")
    if out:
        with open(os.path.join(out, f"rank{rank}.txt"), "a") as f:
            f.write(line + "\n")


def run(phase: str, kind: str, bad: bool, comm, R: int, W: int, setup: dict) -> None:
    if phase == "init":
        if bad and kind == "raise":  # the case: an argument only the NCCL backend takes
            moecomm.init("mpi", max_ctas=4, set_default=False)
        elif bad:
            fault(kind, "init")
        moecomm.init("mpi", set_default=False)
        return
    if phase == "init-torch":  # over a torch process group (gloo): only a refused argument
        import torch.distributed as dist

        moecomm.init("torch", process_group=dist.group.WORLD, max_ctas=4 if bad else None, set_default=False)
        return
    if phase == "split":  # the fault comes after the gathered table, where MPI_Comm_split would block
        if bad:
            on_first_call(comm.engine.backend, ["split"], kind, "split")
        comm.split(R % 2)
        return
    m = splits(7, W)
    x = torch.randn(sum(m[R]), 5)
    if phase == "counts":
        if bad:
            on_first_call(comm.engine.backend, ["alltoall", "exchange_tagged"], kind, "count exchange")
        comm.all_to_all_v(x, m[R])
    elif phase == "rows":
        if bad:
            # MPI: the count exchange and the rows are both tagged exchanges (moecomm.engine.tags)
            tagged = comm.engine.tagged
            on_first_call(comm.engine.backend, ["alltoallv", "exchange_tagged"] if tagged else ["alltoallv"], kind,
                          "rows", skip=1 if tagged else 0)
        comm.all_to_all_v(x, m[R])
    elif phase.startswith("2dh"):
        if bad:
            hier = comm.topology.hierarchy
            sub = hier.intra if phase == "2dh-intra" else hier.rail
            on_first_call(sub.engine.backend, ["alltoall", "alltoallv", "allgather", "allgatherv", "exchange_tagged"],
                          kind, phase)
        comm.all_to_all_v(x, m[R], [m[p][R] for p in range(W)], algorithm="2dh")
    elif phase == "overlap":
        def fn(rows, chunk):
            if bad and chunk.index == 1:
                fault(kind, "overlap stage 1")
            return rows * 2

        comm.scatter_compute_gather(x, m[R], fn, degree=2, recv_splits=[m[p][R] for p in range(W)])
    elif phase == "moe":
        y = setup["layer"](setup["x"])
        y.sum().backward()


if __name__ == "__main__":
    main()
