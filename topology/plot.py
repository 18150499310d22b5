"""Figures of topology profiles, drawn with matplotlib (an optional dependency: the ``plot`` extra)."""

from __future__ import annotations

from typing import Any

__all__ = ["require_matplotlib", "plot_profile", "size_label"]


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Raises:
        ImportError: matplotlib is not installed; the message says how to install it.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib (or the 'plot' extra: "
                          "pip install 'moecomm[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def size_label(n: float, _pos: Any = None) -> str:
    """``65536`` -> ``"64K"`` (binary units), for axis ticks."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def plot_profile(prof: Any, path: str) -> None:
    """Median time (p99 as a band) against bytes per rank, one line per algorithm of the
    profile's entries, written to ``path`` (its extension picks the format: .png, .svg, .pdf).

    Raises:
        ImportError: matplotlib is missing.
    """
    plt = require_matplotlib()
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    algs = [a for a in ("flat", "2dh") if any(a in e.timings for e in prof.entries)]
    algs += sorted({a for e in prof.entries for a in e.timings} - set(algs))
    fig, ax = plt.subplots(figsize=(9, 5.6))
    sizes: set[int] = set()
    for i, a in enumerate(algs):
        pts = sorted((e.bytes_per_rank, e.timings[a]["median_s"], e.timings[a].get("p99_s"))
                     for e in prof.entries if a in e.timings and e.timings[a].get("median_s"))
        if not pts:
            continue
        x = [p[0] for p in pts]
        med = [p[1] * 1e6 for p in pts]
        sizes.update(x)
        ax.plot(x, med, marker="o", color=f"C{i}", label=a)
        if all(p[2] for p in pts):
            ax.fill_between(x, med, [p[2] * 1e6 for p in pts], color=f"C{i}", alpha=0.15)
    for e in prof.entries:
        if e.degree:
            ax.annotate(f"d={e.degree}", (e.bytes_per_rank, e.timings[e.choice]["median_s"] * 1e6),
                        textcoords="offset points", xytext=(0, 8), ha="center", fontsize="x-small")
    fp = prof.fingerprint
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if sizes:
        ax.xaxis.set_major_locator(FixedLocator(sorted(sizes)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(size_label))
    ax.set(xlabel="bytes per rank", ylabel="time per exchange (us)",
           title=f"all-to-all median time (band: p99): {fp.num_nodes}x{fp.local_size} {fp.device} {fp.link}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
