"""Where a benchmark step spends its host time: cProfile over a few steps, as text.

Used by ``bench.overlap --host-profile`` and ``bench.moe_layer --host-profile``: when a
step's host time (``host_ms``) nears its GPU time, the run is bound by the Python and
launch work that issues it, and this says which calls that is.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from typing import Callable

__all__ = ["host_profile", "sync_report"]


def host_profile(step: Callable[[], object], steps: int = 10, sync: Callable[[], None] = lambda: None,
                 top: int = 35) -> str:
    """Profile ``steps`` calls of ``step`` (then ``sync``); the ``top`` functions by own time
    and by cumulative time, as pstats prints them."""
    step()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    sync()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    out.write(f"# host profile of {steps} steps, by own time\n")
    stats.sort_stats("tottime").print_stats(top)
    out.write("# by cumulative time\n")
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def sync_report(step: Callable[[], object], sync: Callable[[], None] = lambda: None) -> str:
    """Run ``step`` once under ``torch.cuda.set_sync_debug_mode("warn")``: every call that made
    the host wait for the GPU (``.item()``, ``.tolist()``, a copy from pageable memory, a
    stream synchronisation), with the line that made it. A step that synchronises cannot
    run ahead of the GPU, and the GPU idles while the host issues what follows."""
    from moecomm.graphs import host_synchronizations

    step()
    sync()
    caught = host_synchronizations(step)
    sync()
    lines = [f"# host synchronisations in one step: {len(caught)}"]
    lines.extend(caught)
    return "\n".join(lines)
