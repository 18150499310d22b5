"""``moecomm-bench NAME [ARGS]`` (installed) or ``python -m bench NAME [ARGS]`` (checkout):
runs the benchmark module ``NAME`` of this package as ``python -m bench.NAME ARGS`` would."""

from __future__ import annotations

import pkgutil
import runpy
import sys
from typing import Optional, Sequence

_NOT_BENCHMARKS = frozenset({"__main__", "host_profile"})  # helpers, not benchmarks


def benchmarks() -> list[str]:
    """Names of the runnable modules of this package, sorted."""
    return sorted(m.name for m in pkgutil.iter_modules(_package_path())
                  if not m.name.startswith("_") and m.name not in _NOT_BENCHMARKS and not m.ispkg)


def _package_path() -> list[str]:
    return list(sys.modules[__spec__.parent].__path__)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run benchmark ``argv[0]`` with the rest as its arguments; 2 on an unknown name."""
    args = list(sys.argv[1:] if argv is None else argv)
    names = benchmarks()
    prog = "moecomm-bench" if __spec__.parent.startswith("moecomm.") else f"python -m {__spec__.parent}"
    if not args or args[0] in ("-h", "--help"):
        print(f"usage: {prog} NAME [ARGS...]  (NAME -h: the benchmark's own help)\n"
              f"benchmarks: {', '.join(names)}")
        return 0 if args else 2
    if args[0] not in names:
        print(f"{prog}: unknown benchmark {args[0]!r}; choose from {', '.join(names)}", file=sys.stderr)
        return 2
    sys.argv = [f"{prog} {args[0]}", *args[1:]]
    runpy.run_module(f"{__spec__.parent}.{args[0]}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
