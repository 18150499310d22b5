"""Run every ```python block of the given markdown files as written, each in a fresh
namespace, in order; blocks that use ``torch.cuda`` only where CUDA is available, blocks that
use ``moecomm.integrations`` only where the frameworks they name (Megatron-core, DeepSpeed)
are installed (:func:`skipped_here`).

Launched by ``tests/test_readme.py`` as one process (no launcher) and under ``mpiexec -n 3``.
Between blocks the default communicator is cleared and torch.distributed torn down, so each
block starts as a fresh script would. A block that calls ``init_process_group`` (or DeepSpeed's
``init_distributed``) is written for torchrun: for it this driver plays torchrun's part, setting
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (from the MPI
launcher's rank and size, and the port given on the command line) while it runs.

Usage: ``python -m tests.ranks.readme_blocks PORT README.md [MORE.md ...] [--no-mpi4py]``
"""

from __future__ import annotations

import os
import re
import sys

__all__ = ["code_blocks", "skipped_here"]


def code_blocks(path: str, lang: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each fenced block of ``lang`` in the markdown file ``path``."""
    text = open(path).read()
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if m.group(1) == lang:
            out.append((text.count("\n", 0, m.start()) + 2, m.group(2)))
    return out


def skipped_here(code: str) -> bool:
    """Whether the block ``code`` cannot run on this machine: it uses CUDA and there is none,
    or it runs the framework integrations and a framework it names is not installed (or is a
    megatron-core version that ``megatron.enable()`` refuses)."""
    import importlib.util

    import torch

    if "torch.cuda" in code and not torch.cuda.is_available():
        return True
    if "moecomm.integrations" in code:
        needs = [m for m, name in (("megatron.core", "megatron"), ("deepspeed", "deepspeed"),
                                              ("torchtitan", "torchtitan")) if name in code]
        try:
            if any(importlib.util.find_spec(m) is None for m in needs):
                return True
        except ModuleNotFoundError:  # find_spec("megatron.core") with no "megatron" at all
            return True
        if "megatron.core" in needs:
            from moecomm.integrations.megatron import check_version, installed_version

            return check_version(installed_version()) is not None  # enable() refuses it
    return False


def _block_mpi4py() -> None:
    class _NoMpi:
        def find_spec(self, name, path=None, target=None):
            if name == "mpi4py" or name.startswith("mpi4py."):
                raise ImportError("mpi4py is not installed (blocked by the test)")

    sys.meta_path.insert(0, _NoMpi())


def _launcher_rank_size() -> tuple[int, int]:
    for r, s in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


def main(argv: list[str]) -> None:
    port, readmes = argv[0], [a for a in argv[1:] if not a.startswith("--")]
    if "--no-mpi4py" in argv:
        _block_mpi4py()
    import torch.distributed as dist

    import moecomm

    rank, size = _launcher_rank_size()
    torchrun_vars = {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}

    blocks = [(path, line, code) for path in readmes for line, code in code_blocks(path, "python")]
    ran = skipped = 0
    for readme, line, code in blocks:
        if skipped_here(code):
            skipped += 1
            continue
        plays_torchrun = "init_process_group" in code or "init_distributed" in code
        if plays_torchrun:
            os.environ.update(torchrun_vars)
            # a store of its own per block: a new group's rendezvous on the port a destroyed
            # group's store had can hang one rank (seen with DeepSpeed's init_distributed)
            os.environ["MASTER_PORT"] = str(int(port) + line)
        try:
            exec(compile(code, f"{readme}:{line}", "exec"), {"__name__": "__main__"})
        finally:
            if plays_torchrun:
                for k in torchrun_vars:
                    os.environ.pop(k, None)
            moecomm.set_default_communicator(None)
            if dist.is_initialized():
                dist.destroy_process_group()
        ran += 1
        print(f"[rank {rank}] {readme}:{line} ran", flush=True)
    if rank == 0:
        print(f"{ran} README python blocks ran on {size} rank(s), {skipped} skipped (no CUDA or framework)",
              flush=True)
    if "--no-mpi4py" in argv:
        assert "mpi4py" not in sys.modules


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BaseException:  # noqa: BLE001 - one rank failing must end the launch, not hang it
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
