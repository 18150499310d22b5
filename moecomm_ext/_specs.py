"""What each native extension is made of: sources, flags, the installed module's name.

Shared by ``setup.py`` (the build at install, which loads this file by path, so it must
import nothing from the package) and by :mod:`moecomm_ext._loader` (which imports the
installed modules and, for a checkout that was never installed, builds just in time).
The transports' own extensions (:mod:`moecomm.backends._ext_specs`) are described with the
same :class:`Spec`, their sources beside them.

An installed module carries the hash of the sources and torch version it was built from
(``MOECOMM_EXT_SOURCE_HASH``, exposed as its ``source_hash`` attribute); the loader uses
it only when that matches the sources beside it, so an edited checkout never runs a stale
library.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
"""This package's sources, and ``source_hash.h``, which every extension includes."""

CPU = "cpu"
CUDA = "cuda"
QUANT_CPU = "quant-cpu"  # moecomm.quant's FP8 kernels (moecomm_ext/_quant.py), CPU
QUANT_CUDA = "quant-cuda"  # and CUDA
KINDS = (CPU, CUDA, QUANT_CPU, QUANT_CUDA)
CUDA_KINDS = (CUDA, QUANT_CUDA)  # need nvcc and a torch with CUDA

HASH_MACRO = "MOECOMM_EXT_SOURCE_HASH"
_ROW_FUNCTIONS = ("gather_rows", "gather_reduce_rows", "gather_rowdot", "route_capacity", "route_backward",
                  "step_route", "step_ffn", "step_combine_backward", "step_ffn_backward", "step_route_backward",
                  "ll_dispatch_layout", "ll_dispatch_place", "glu_forward", "glu_backward",
                  "select_experts", "select_experts_backward", "seg_bias_act", "seg_colsum")
_QUANT_FUNCTIONS = ("quantize_rows", "dequantize_rows", "quantize_pack", "unpack_dequantize",
                    "gather_quantize_pack")


@dataclass(frozen=True)
class Spec:
    kind: str
    base: str  # module name of a just-in-time build
    installed: str  # module name of the build made at install
    sources: tuple[str, ...]  # file names in csrc/
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...] | None  # None: no nvcc
    ldflags: tuple[str, ...]
    tag: str  # part of the just-in-time build directory's name
    functions: tuple[str, ...] = field(default=())
    csrc: Path = CSRC  # the directory of ``sources``
    build_seconds: int = 60  # rough first build on one free core, for the progress line

    @property
    def with_cuda(self) -> bool:
        return self.cuda_cflags is not None

    def source_paths(self) -> list[Path]:
        return [self.csrc / s for s in self.sources]

    def include_dirs(self) -> list[Path]:
        """Include directories besides ``csrc``: this package's (``source_hash.h``) for
        sources elsewhere."""
        return [] if self.csrc == CSRC else [CSRC]

    def header_paths(self) -> list[Path]:
        return [h for d in [self.csrc, *self.include_dirs()] for h in sorted(d.glob("*.h"))]


def cuda_arch_flags(device_capability: tuple[int, int] | None) -> tuple[list[str], str]:
    """nvcc -gencode flags: sm_90 SASS + compute_90 PTX, plus ``device_capability``'s own
    architecture when it is older than Hopper (PTX only runs on the same or newer GPUs;
    newer ones JIT-compile the compute_90 PTX)."""
    archs = {(9, 0)}
    if device_capability is not None and tuple(device_capability) < (9, 0):
        archs.add(tuple(device_capability))
    flags = [f"-gencode=arch=compute_{a}{b},code=sm_{a}{b}" for a, b in sorted(archs)]
    flags.append("-gencode=arch=compute_90,code=compute_90")
    tag = "sm" + "_".join(f"{a}{b}" for a, b in sorted(archs))
    return flags, tag


def spec(kind: str, *, openmp: bool, device_capability: tuple[int, int] | None = None) -> Spec:
    """The extension of ``kind`` (one of :data:`KINDS`).

    ``openmp``: torch was built with OpenMP (``torch.backends.openmp.is_available()``);
    ``at::parallel_for`` is header-inline, so without ``-fopenmp`` it would run serially.
    ``device_capability``: the GPU the CUDA kinds should also run on natively.
    """
    omp = ("-fopenmp",) if openmp else ()
    if kind == CPU:
        # -O3 against -O2 or -O0 barely changes the compile time: parsing torch's headers is
        # most of it.
        # -ffp-contract=off: products and sums rounded one by one, as torch's separate ops
        # round them (the router kernels mirror a chain of torch ops; FMA-default targets
        # such as aarch64 would otherwise fuse them)
        return Spec(CPU, "moecomm_ext_rows_cpu", "moecomm_ext._rows_cpu",
                    ("rows_cpu.cpp", "route_cpu.cpp", "step.cpp", "lowlat_cpu.cpp", "glu_cpu.cpp",
                     "select_cpu.cpp", "seg_cpu.cpp"),
                    ("-O3", "-DNDEBUG", "-ffp-contract=off", *omp), None, omp, "cpu", _ROW_FUNCTIONS,
                    build_seconds=40)
    if kind == QUANT_CPU:
        # -fno-trapping-math lets the selects of the FP8 codec vectorize (no result changes)
        return Spec(QUANT_CPU, "moecomm_ext_quant_cpu", "moecomm_ext._quant_cpu", ("quant_cpu.cpp",),
                    ("-O3", "-DNDEBUG", "-fno-trapping-math", *omp), None, omp, "cpu", _QUANT_FUNCTIONS,
                    build_seconds=30)
    if kind == QUANT_CUDA:
        arch_flags, tag = cuda_arch_flags(device_capability)
        return Spec(QUANT_CUDA, "moecomm_ext_quant_cuda", "moecomm_ext._quant_cuda",
                    ("quant_cuda.cu", "quant_cuda_bind.cpp"), ("-O3", "-DNDEBUG"),
                    ("-O3", "-lineinfo", *arch_flags), (), tag, _QUANT_FUNCTIONS, build_seconds=90)
    if kind == CUDA:
        arch_flags, tag = cuda_arch_flags(device_capability)
        # No --use_fast_math: the kernels accumulate in fp32 and must match the reference closely.
        return Spec(CUDA, "moecomm_ext_rows_cuda", "moecomm_ext._rows_cuda",
                    ("rows_cuda.cu", "route_cuda.cu", "lowlat_cuda.cu", "glu_cuda.cu", "select_cuda.cu",
                     "seg_cuda.cu", "rows_cuda_bind.cpp",
                     "step.cpp"), ("-O3", "-DNDEBUG"),
                    ("-O3", "-lineinfo", *arch_flags), (), tag, _ROW_FUNCTIONS, build_seconds=150)
    raise ValueError(f"unknown extension kind {kind!r}; expected one of {KINDS}")


def source_hash(s: Spec, torch_version: str) -> str:
    """12 hex digits over the sources, the headers of their include directories and torch's
    version."""
    h = hashlib.sha256()
    for path in [*s.source_paths(), *s.header_paths()]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(torch_version.encode())
    return h.hexdigest()[:12]


def flags_hash(s: Spec) -> str:
    """12 hex digits over the compiler and linker flags."""
    return hashlib.sha256(repr((s.cflags, s.cuda_cflags, s.ldflags)).encode()).hexdigest()[:12]
