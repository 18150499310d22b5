"""Plot a ``bench.alltoall --json`` file: time and busbw against size, one line per method.

    python -m bench.plot results.json -o plot.png

One row of two panels per split pattern (uniform, random, skewed): the median time per
exchange (log-log, with the p99 as a shaded band) and the bus bandwidth; one legend of the
methods above them, and the run's header (without its ``# ``) as the title. Needs matplotlib
(``pip install 'moecomm[plot]'``).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional, Sequence

from ._common import prog
from ._topology import RankZeroParser, require_matplotlib, size_label

__all__ = ["main", "plot_results", "build_figure", "plot_title", "load_results"]


def load_results(path: str) -> tuple[str, list[dict]]:
    """``(header, results)`` of a ``bench.alltoall --json`` file.

    Raises:
        ValueError: the file is not such a file (no results, or rows without the columns).
    """
    with open(path) as fh:
        data = json.load(fh)
    results = data.get("results") if isinstance(data, dict) else None
    if not results:
        raise ValueError(f"{path}: no 'results' (expected a file written by bench.alltoall --json)")
    need = {"pattern", "size", "method", "time_us", "p99_us", "busbw"}
    for row in results:
        missing = need - set(row)
        if missing:
            raise ValueError(f"{path}: a result lacks {sorted(missing)}: {row}")
    return str(data.get("header", "")), results


def plot_title(header: str) -> str:
    """The figure title of a ``bench.alltoall`` header: its lines without their ``# `` marks."""
    return "\n".join(line.lstrip("#").strip() for line in header.splitlines()).strip()


def plot_results(results: Sequence[dict], path: str, title: str = "") -> None:
    """Write the figure of ``results`` (rows of ``bench.alltoall``) to ``path`` (PNG, SVG, PDF
    by its extension); ``title`` may be the file's ``# `` header as it stands."""
    plt = require_matplotlib()
    fig = build_figure(results, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_figure(results: Sequence[dict], title: str = "") -> Any:
    """The matplotlib figure of ``results``: per pattern, a time and a busbw panel; one legend
    of the methods above them all (the same colour in every panel)."""
    plt = require_matplotlib()
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    patterns = list(dict.fromkeys(r["pattern"] for r in results))
    sizes = sorted({r["size"] for r in results})
    methods = list(dict.fromkeys(r["method"] for r in results))
    fig, axes = plt.subplots(len(patterns), 2, figsize=(11, 3.6 * len(patterns)), squeeze=False)
    for row, pattern in enumerate(patterns):
        ax_t, ax_b = axes[row]
        for i, method in enumerate(methods):
            pts = sorted((r["size"], r["time_us"], r["p99_us"], r["busbw"]) for r in results
                         if r["pattern"] == pattern and r["method"] == method)
            if not pts:
                continue
            size, med, p99, busbw = (list(col) for col in zip(*pts))
            color = f"C{i}"
            ax_t.plot(size, med, marker="o", color=color, label=method)
            ax_t.fill_between(size, med, p99, color=color, alpha=0.15)
            ax_b.plot(size, busbw, marker="o", color=color, label=method)
        ax_t.set_yscale("log")
        ax_t.set( xlabel="size per rank (bytes)", ylabel="time per exchange (us)",
                 title=f"{pattern}: median time (band: p99)")
        ax_b.set(xlabel="size per rank (bytes)", ylabel="busbw (GB/s)", title=f"{pattern}: busbw")
        for ax in (ax_t, ax_b):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(FixedLocator(sizes))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(FuncFormatter(size_label))
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 4), fontsize="small",
               bbox_to_anchor=(0.5, 1.0))
    legend_rows = -(-len(labels) // 4)
    top = 1.0 - (0.05 * legend_rows + (0.05 if title else 0.0)) / len(patterns)
    if title:
        fig.suptitle(plot_title(title), fontsize="small", y=top + 0.02 / len(patterns))
    fig.tight_layout(rect=(0, 0, 1, top))
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = RankZeroParser(prog=prog(__spec__.name), description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a JSON file written by python -m bench.alltoall --json")
    p.add_argument("-o", "--output", default="plot.png", help="image to write (default plot.png)")
    args = p.parse_args(argv)
    try:
        header, results = load_results(args.results)
        plot_results(results, args.output, header)
    except (ImportError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
