"""Builds moecomm's native kernels at install; the metadata is in setup.cfg.

The extensions are compiled with torch's ``BuildExtension``, so torch must be importable
while building: install torch first, then this package with ``--no-build-isolation`` (an
isolated build would have no torch, or fetch one). Built here:

* ``moecomm_ext._rows_cpu``, ``moecomm_ext._quant_cpu`` and ``moecomm.backends._nccl_issue``
  (C++, host only) always;
* ``moecomm_ext._rows_cuda``, ``moecomm_ext._quant_cuda`` and ``moecomm.backends._p2p_cuda`` where torch has CUDA
  (``torch.version.cuda``) and a CUDA toolkit is found.

``moecomm_ext/_specs.py`` describes the row kernels, ``moecomm/backends/_ext_specs.py`` the
transports' extensions (sources in ``moecomm/backends/csrc``).

A build that cannot happen (no torch, no compiler, a compile error) does not fail the
install: the package then loads the kernels just in time on first use, or, where that fails
too, uses the pure-torch references with one ``NativeBuildWarning``.
``MOECOMM_BUILD_EXT=0`` installs without building any (for example for a quick
pure-Python install).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _note(msg: str) -> None:
    print(f"moecomm setup: {msg}", file=sys.stderr, flush=True)


def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _load_specs():
    """(moecomm_ext._specs, moecomm.backends._ext_specs), loaded by path: importing the
    packages would import their torch-dependent modules. The first is registered under its
    own name, so the second's ``from moecomm_ext._specs import ...`` finds it without
    importing the package."""
    ext = _load_by_path("moecomm_ext._specs", ROOT / "moecomm_ext" / "_specs.py")
    transports = _load_by_path("_moecomm_backends_ext_specs", ROOT / "moecomm" / "backends" / "_ext_specs.py")
    return ext, transports


def _native_build() -> dict:
    """``ext_modules`` and ``cmdclass`` for setup(), or {} when nothing can be built."""
    if os.environ.get("MOECOMM_BUILD_EXT", "1").strip().lower() in ("0", "false", "no", "off"):
        _note("MOECOMM_BUILD_EXT=0: not building the native kernels")
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        _note(f"torch is not importable here ({exc}); installing without native kernels "
              "(they are built on first use instead). Install torch first and this package "
              "with --no-build-isolation to build them now.")
        return {}
    specs, transports = _load_specs()
    openmp = torch.backends.openmp.is_available()
    kinds = [(specs, specs.CPU), (specs, specs.QUANT_CPU), (transports, transports.NCCL_ISSUE)]
    if torch.version.cuda and cpp_extension.CUDA_HOME:
        kinds += [(specs, specs.CUDA), (specs, specs.QUANT_CUDA), (transports, transports.P2P)]
    elif torch.version.cuda:
        _note("torch has CUDA but no CUDA toolkit was found (CUDA_HOME, nvcc): building the CPU kernels only")
    capability = torch.cuda.get_device_capability() if torch.version.cuda and torch.cuda.is_available() else None
    torch_version = torch.__version__
    extensions = []
    for module, kind in kinds:
        s = module.spec(kind, openmp=openmp, device_capability=capability)
        define = f"-D{specs.HASH_MACRO}={specs.source_hash(s, torch_version)}"
        sources = [str(p.relative_to(ROOT)) for p in s.source_paths()]
        include_dirs = [str(d) for d in s.include_dirs()]
        # -g0: Python's own CFLAGS (which setuptools passes first) carry -g, and debug info
        # for torch's templates triples the compile time and the library's size.
        args = {"cxx": [*s.cflags, define, "-g0"]}
        if s.with_cuda:
            args["nvcc"] = [*s.cuda_cflags, define]
            cls = cpp_extension.CUDAExtension
        else:
            cls = cpp_extension.CppExtension
        extensions.append(cls(s.installed, sources, include_dirs=include_dirs, extra_compile_args=args,
                              extra_link_args=list(s.ldflags)))

    class OptionalBuildExtension(cpp_extension.BuildExtension):
        """A failed extension is reported and skipped; the install goes on."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - any failure leaves the reference path
                _note(f"could not build {ext.name} ({type(exc).__name__}: {str(exc).strip()[:500]}); "
                      "it will be built on first use, or the pure-torch reference used")

    return {"ext_modules": extensions, "cmdclass": {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}}


setup(**_native_build())
