#!/usr/bin/env bash
# One device call (2 x H200): the GPU test suites and the benchmarks, logged under $OUT.
# Needs the nccl4py wheel in .whl/ (see ../shared/DEVICE.md) and `carry: [".whl"]`.
# Usage: bash bench/gpu_session.sh [STEP ...]   (default: every step)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moecomm-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 MOECOMM_TIMEOUT=120 OMP_NUM_THREADS=4
MPI=(mpirun --allow-run-as-root -n 2 -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS)
LOG=$OUT/session.log
SUMMARY=()

step() {
  local name=$1 limit=$2
  shift 2
  echo "===== $name: $*" >> "$LOG"
  local start=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "===== $name rc=$rc $((SECONDS - start))s" >> "$LOG"
  SUMMARY+=("$name rc=$rc $((SECONDS - start))s")
}

want() { [ $# -eq 0 ] || [[ " $STEPS " == *" $1 "* ]]; }
STEPS="$*"

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; nvidia-smi topo -m;
  python3 -c "import torch, nccl.core as n; print('torch', torch.__version__, 'nccl4py', n.__version__)"; } >> "$LOG" 2>&1

want core && step core_mpirun 120 "${MPI[@]}" -x MOECOMM_TEST_VERBOSE=1 python3 -m tests.ranks.core_collectives nccl -check_timeout
want core && step core_timeout 60 "${MPI[@]}" -x MOECOMM_TEST_VERBOSE=1 -x NCCL_DEBUG=WARN python3 -m tests.ranks.core_collectives nccl check_timeout
want core && step core_torchrun 120 torchrun --standalone --nproc-per-node 2 -m tests.ranks.core_collectives nccl
want a2a && step alltoall_uniform 150 "${MPI[@]}" python3 -m bench.alltoall -d bfloat16 --row-elems 2048 \
  -b 256K -e 512M -f 2 -p uniform --compare -n 30 --no-progress --json "$OUT/alltoall_uniform.json"
want a2a && step alltoall_variable 120 "${MPI[@]}" python3 -m bench.alltoall -d bfloat16 --row-elems 2048 \
  -b 256K -e 512M -f 4 -p random,skewed --compare -n 30 --no-progress --json "$OUT/alltoall_variable.json"
want hier1x2 && step hier_1x2 60 "${MPI[@]}" python3 -m bench.hierarchical --local-size 2 --skew 1.0 --json "$OUT/hier_1x2.json"
want hier && step hier_2x1 60 "${MPI[@]}" python3 -m bench.hierarchical --local-size 1 --skew 1.0 --json "$OUT/hier_2x1.json"
want overlap && step overlap 120 "${MPI[@]}" python3 -m bench.overlap --json "$OUT/overlap.json"
want kernels && step kernels 150 python3 -m moecomm_ext.bench_kernels --json "$OUT/kernels.json"
want gputests && step pytest_gpu 240 python3 -m pytest -q -m gpu tests -p no:cacheprovider
want moe && step moe_layer 90 "${MPI[@]}" python3 -m bench.moe_layer --json "$OUT/moe_layer.json"
want moe && step moe_dropless 60 "${MPI[@]}" python3 -m bench.moe_layer --dropless --top-k 2
want moetests && step moe_checks 120 "${MPI[@]}" python3 -m tests.ranks.moe_layer_checks all cuda
want overlaptests && step overlap_checks 60 "${MPI[@]}" python3 -m tests.ranks.overlap_checks nccl

printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
