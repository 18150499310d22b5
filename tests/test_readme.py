"""The READMEs' examples run as written (issue 18).

Every ```python block of README.md and moecomm/moe/README.md (those using ``torch.cuda``
only with CUDA) runs, in order, in one process without a launcher (with mpi4py made
unimportable: a single process needs nothing but torch and numpy) and on 3 MPI ranks
(``tests/ranks/readme_blocks.py``; for blocks that call ``init_process_group`` it sets
torchrun's variables). Every command line of the ```sh blocks is listed in ``SHELL`` below:
run on the CPU with the substitutions written there (smaller sizes, fewer iterations, 3 ranks,
a stored profile for PROFILE.json), or skipped with the reason. A new README command without
an entry fails the test. On a machine with CUDA, ``MOECOMM_BACKEND`` (the default of
``init(backend=)``) keeps these CPU examples on the CPU.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys

import pytest

from tests.ranks.readme_blocks import code_blocks, skipped_here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MOE_README = os.path.join(ROOT, "moecomm", "moe", "README.md")
QUICK = "-n 2 -w 1 --no-progress"  # bench.alltoall: 2 timed exchanges after 1 untimed, no bar

# README command -> (command run here, or None) and why it differs / is skipped
SHELL: dict[str, tuple[str | None, str]] = {
    "python3 -m pip install 'torch==2.13.0' 'setuptools>=64' wheel ninja && python3 -m pip install --no-build-isolation -e '.[mpi]' && mpiexec -n 4 python3 -m bench.alltoall -b 64K -e 16M -f 4 --compare":
        (f"mpiexec -n 3 python3 -m bench.alltoall -b 64K -e 64K -f 4 -p uniform --compare {QUICK}",
         "installing is the environment's job; 3 ranks, one size (64K), one pattern, fewer iterations"),
    "python3 -m pip install 'torch==2.13.0' 'setuptools>=64' wheel ninja && python3 -m pip install --no-build-isolation -e '.[test]' && python3 -m pytest -q":
        (None, "the test suite itself (.ci/run)"),
    "mpiexec -n 4 python3 -m bench.alltoall -b 1K -e 64M -f 4 -p uniform,random,skewed --compare --json out.json":
        (f"mpiexec -n 3 python3 -m bench.alltoall -b 1K -e 16K -f 4 -p uniform,random,skewed --compare --json out.json "
         f"{QUICK}", "3 ranks, -e 16K, fewer iterations"),
    "python3 -m bench.plot out.json -o plot.png":
        ("python3 -m bench.plot out.json -o plot.png", "as written, on the out.json of the line above"),
    "mpirun --allow-run-as-root -n 2 python3 -m bench.alltoall -d bfloat16 --row-elems 2048 -b 256K -e 512M --compare":
        (None, "GPUs"),
    "mpiexec -n 8 python3 -m topology probe --local-size 4":
        (None, "8 ranks of link probes: tests/test_topology_mpi.py runs the tuner on 4 ranks"),
    "mpiexec -n 8 python3 -m topology tune --local-size 4":
        (None, "8 ranks of timings: tests/test_topology_mpi.py runs it on 4 ranks (--local-size 2)"),
    "python3 -m topology show PROFILE.json --png plot.png":
        ("python3 -m topology show {root}/bench/results/cpu/profile_2x2.json --png plot.png",
         "PROFILE.json: a profile stored in bench/results"),
    "pip install --no-deps --ignore-requires-python megatron-core==0.19.2 && pip install --no-deps triton":
        (None, "installs a framework (tests/test_integrations.py runs with it where installed)"),
    "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring-parser typeguard && pip install --no-deps triton":
        (None, "installs a framework (tests/test_integrations_torchtitan.py runs with it where installed)"),
    "DS_BUILD_OPS=0 pip install deepspeed==0.19.8":
        (None, "installs a framework (tests/test_integrations.py runs with it where installed)"),
    "DS_ACCELERATOR=cpu python3 -m pytest -q tests/test_integrations.py tests/test_integrations_tutel.py":
        (None, "tests that the suite itself runs"),
    "python3 -m topology simulate --nodes 16 --local-size 8":
        ("python3 -m topology simulate --nodes 16 --local-size 8", "as written"),
}


def _commands() -> list[str]:
    """The command lines of the README's sh blocks, without their trailing comments."""
    out = []
    for _, block in code_blocks(README, "sh"):
        for line in block.splitlines():
            cmd = line.split("  #")[0].strip()
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
    return out


def _env(cpu_backend: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOECOMM_BACKEND")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("MOECOMM_TIMEOUT", "60")
    import torch

    if torch.cuda.is_available():  # these are the CPU examples: 3 ranks must not share 2 GPUs through NCCL
        env["MOECOMM_BACKEND"] = cpu_backend
    return env


def _run(cmd: list[str], cwd: str, cpu_backend: str = "mpi") -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(cpu_backend), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_has_runnable_python_blocks():
    blocks = [code for _, code in code_blocks(README, "python")]
    assert len(blocks) >= 2 and "comm.all_to_all_v(x, counts)" in blocks[0]
    assert "import moecomm.distributed as dist          # was: import torch.distributed as dist" in blocks[1]


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 3])
def test_readme_python_blocks_run(nprocs):
    driver = [sys.executable, "-m", "tests.ranks.readme_blocks", str(_free_port()), README, MOE_README]
    if nprocs == 1:
        out = _run(driver + ["--no-mpi4py"], ROOT, cpu_backend="self")  # no launcher at all
    else:
        out = _run(["mpiexec", "-n", str(nprocs)] + driver, ROOT)
    blocks = [code for path in (README, MOE_README) for _, code in code_blocks(path, "python")]
    skipped = sum(map(skipped_here, blocks))
    assert skipped < len(blocks) - 1  # the Quick start and the migration always run
    assert f"{len(blocks) - skipped} README python blocks ran on {nprocs} rank(s), {skipped} skipped " \
           f"(no CUDA or framework)" in out
    for r in range(nprocs):
        assert f"rank {r}/{nprocs}: sent" in out  # the Quick start's own line


def test_every_readme_command_is_listed():
    assert sorted(_commands()) == sorted(SHELL), "a README command changed: update SHELL in this test"


@pytest.mark.mpi
def test_readme_shell_commands_run(tmp_path):
    outputs = {}
    for readme_cmd in _commands():  # in README order: bench.plot reads what bench.alltoall wrote
        cmd, _why = SHELL[readme_cmd]
        if cmd is None:
            continue
        argv = shlex.split(cmd.format(root=ROOT))
        argv = [sys.executable if a == "python3" else a for a in argv]
        outputs[readme_cmd] = _run(argv, str(tmp_path))
        if "bench.plot" in readme_cmd:  # topology show writes plot.png again later
            assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            (tmp_path / "plot.png").rename(tmp_path / "bench_plot.png")
    bench_out = "\n".join(v for k, v in outputs.items() if "bench.alltoall" in k)
    assert "FAIL" not in bench_out and bench_out.count(" OK ") == 5 * (1 + 2 * 3)  # methods (copy included) x (sizes x patterns)
    assert (tmp_path / "out.json").stat().st_size > 0
    assert (tmp_path / "bench_plot.png").stat().st_size > 10_000
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # topology show's
    assert "crossover" in outputs["python3 -m topology simulate --nodes 16 --local-size 8"]
