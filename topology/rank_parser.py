"""An ``argparse`` parser that only rank 0 of a launch prints from.

Under ``mpiexec -n 4`` every rank parses the same command line: ``--help`` or a usage error
would print four times. With :class:`RankZeroParser` the other ranks print nothing and exit
with the same status, so the launch ends cleanly.
"""

from __future__ import annotations

import argparse
import os
from typing import IO, Optional

__all__ = ["RankZeroParser", "launcher_rank"]

_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "RANK")


def launcher_rank() -> int:
    """This process's rank as its launcher (mpiexec, mpirun, torchrun) set it; 0 without one."""
    for name in _RANK_VARS:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


class RankZeroParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose help, usage and error text only rank 0 prints."""

    def _print_message(self, message: str, file: Optional[IO[str]] = None) -> None:
        if launcher_rank() == 0:
            super()._print_message(message, file)
