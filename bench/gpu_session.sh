#!/usr/bin/env bash
# One device call (2 x H200; NRANKS=1 on one GPU; the step "shared": several ranks on one GPU): the GPU test suites and the benchmarks,
# logged under $OUT.
# Needs the nccl4py wheel in .whl/ (see ../shared/DEVICE.md) and `carry: [".whl"]`.
# Usage: bash bench/gpu_session.sh [STEP ...]   (default: the measurement steps below; the diagnostic
# steps latency, copies, overlaptrace, moeprofile, overlapctas, moectas, p2ptests, ceprobe, overlapce,
# moece, a2ace, syncs, final, ceauto, hostprof, graphtests, moegraph,
# moegraphprofile, overlapgraph, fused, fusedonce, moeown, overlapown, overlapownnccl, overlapsplit, overlapsplitnccl,
# perpeer, perpeerx3, deadlines, fp8, fp8kernels, build, faults, shared, sharedbatch, sharedmoeprof, sharedmoe, sharedmoegpu, launchcost, copyab, sharedown, stamps, stampsref, sharedtimeline, dropless27, moe1, peercosts, sobuild, lltests, layer27, hostdiag, checkcost, decodeab, dlsyncs,
# frameworks and decode run when named)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moecomm-gpu}
RES=$OUT/files   # JSON and PNG outputs; packed into $OUT/results.tgz after each step (one file back)
rm -rf "$RES"; mkdir -p "$RES"  # only this call's files come back
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 MOECOMM_TIMEOUT=120 OMP_NUM_THREADS=4
NRANKS=${NRANKS:-2}  # ranks (one GPU each) of the mpirun and torchrun steps
MPI=(mpirun --allow-run-as-root -n $NRANKS -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS)
LOG=$OUT/session.log
SUMMARY=()

mps_on() {  # an MPS control daemon of this call's own, in /tmp (../shared/DEVICE.md)
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "===== MPS on" >> "$LOG"
}

mps_off() {
  echo quit | nvidia-cuda-mps-control && sleep 1 && echo "===== MPS off" >> "$LOG"
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

step() {
  local name=$1 limit=$2
  shift 2
  echo "===== $name: $*" >> "$LOG"
  local start=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "===== $name rc=$rc $((SECONDS - start))s" >> "$LOG"
  SUMMARY+=("$name rc=$rc $((SECONDS - start))s")
  tar czf "$OUT/results.tgz" -C "$RES" .  # after every step: a call cut off at its limit still sends back what it measured
}

run_step() {
  case $1 in
    core)
      step core_mpirun 90 "${MPI[@]}" -x MOECOMM_TEST_VERBOSE=1 python3 -m tests.ranks.core_collectives nccl -check_timeout
      step core_timeout 50 "${MPI[@]}" -x MOECOMM_TEST_VERBOSE=1 -x NCCL_DEBUG=WARN python3 -m tests.ranks.core_collectives nccl check_timeout ;;
    torchrun) step core_torchrun 120 torchrun --standalone --nproc-per-node $NRANKS -m tests.ranks.core_collectives nccl ;;
    a2a)
      step alltoall_uniform 150 "${MPI[@]}" python3 -m bench.alltoall -d bfloat16 --row-elems 2048 \
        -b 256K -e 512M -f 2 -p uniform --compare --p2p-bytes 2G -n 30 --no-progress --json "$RES/alltoall_uniform.json"
      step alltoall_variable 120 "${MPI[@]}" python3 -m bench.alltoall -d bfloat16 --row-elems 2048 \
        -b 256K -e 512M -f 4 -p random,skewed --compare --p2p-bytes 2G -n 30 --no-progress --json "$RES/alltoall_variable.json" ;;
    hier)
      step hier_1x2 60 "${MPI[@]}" python3 -m bench.hierarchical --local-size 2 --skew 1.0 --json "$RES/hier_1x2.json"
      step hier_2x1 60 "${MPI[@]}" python3 -m bench.hierarchical --local-size 1 --skew 1.0 --json "$RES/hier_2x1.json" ;;
    latency) step latency 120 "${MPI[@]}" python3 -m bench.latency --json "$RES/latency.json" ;;
    overlaptrace)
      step overlap_trace 90 "${MPI[@]}" python3 -m bench.overlap --degrees 1,2 -n 5 --trace /tmp/traces
      step overlap_trace_summary 60 python3 -m bench.trace_summary /tmp/traces/trace_1.json /tmp/traces/trace_2.json ;;
    moeprofile)
      step moe_profile 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2 -n 5 --profile /tmp/moe_trace.json
      step moe_trace_summary 60 python3 -m bench.trace_summary /tmp/moe_trace.json --top 40 ;;
    overlapctas)
      for c in 4 8 16; do
        step overlap_ctas$c 60 "${MPI[@]}" python3 -m bench.overlap --degrees 1,2,4 -n 15 --max-ctas $c --json "$RES/overlap_ctas$c.json"
      done ;;
    moectas)
      step moe_ctas8 60 "${MPI[@]}" python3 -m bench.moe_layer --overlap-degree 1,2 --max-ctas 8 --json "$RES/moe_layer_ctas8.json" ;;
    copies) step layout_copies 60 python3 -m bench.layout_copies ;;
    overlap) step overlap 120 "${MPI[@]}" python3 -m bench.overlap --json "$RES/overlap.json" ;;
    kernels) step kernels 150 python3 -m bench.kernels --json "$RES/kernels.json" ;;
    gputests) step pytest_gpu 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfE ;;
    lltests) step pytest_ll 200 python3 -m pytest -q -m gpu tests/test_low_latency.py tests/test_quant.py -p no:cacheprovider -rfE ;;
    moe)
      step moe_layer 90 "${MPI[@]}" python3 -m bench.moe_layer --json "$RES/moe_layer.json"
      step moe_dropless 60 "${MPI[@]}" python3 -m bench.moe_layer --dropless --top-k 2 ;;
    moetests) step moe_checks 120 "${MPI[@]}" python3 -m tests.ranks.moe_layer_checks all cuda ;;
    overlaptests) step overlap_checks 60 "${MPI[@]}" python3 -m tests.ranks.overlap_checks nccl ;;
    p2ptests)
      step core_p2p 120 "${MPI[@]}" -x MOECOMM_TEST_VERBOSE=1 python3 -m tests.ranks.core_collectives nccl-p2p -check_timeout
      step overlap_checks_p2p 90 "${MPI[@]}" python3 -m tests.ranks.overlap_checks nccl-p2p ;;
    ceprobe) step copy_engine_probe 90 "${MPI[@]}" python3 -m bench.copy_engine_probe --json "$RES/copy_engine_probe.json" ;;
    overlapce)
      step overlap 120 "${MPI[@]}" python3 -m bench.overlap --json "$RES/overlap.json"
      step overlap_ce 120 "${MPI[@]}" python3 -m bench.overlap --p2p-bytes 1G --json "$RES/overlap_ce.json" ;;
    a2ace) step alltoall_ce 120 "${MPI[@]}" python3 -m bench.alltoall -d bfloat16 --row-elems 2048 \
        -b 256K -e 256M -f 4 -p uniform,random,skewed --compare --p2p-bytes 2G -n 30 --no-progress --json "$RES/alltoall_ce.json" ;;
    syncs)
      step moe_syncs 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2 -n 5 --sync-report --host-profile
      step overlap_ce_degrees 120 "${MPI[@]}" python3 -m bench.overlap --p2p-bytes 1G --degrees 1,2,3,4 -n 15 --sync-report \
        --json "$RES/overlap_ce_degrees.json" ;;
    ceauto) step overlap_ce_auto 90 "${MPI[@]}" python3 -m bench.overlap --p2p-bytes 1G --degrees 1,2,auto -n 20 \
        --json "$RES/overlap_ce_auto.json" ;;
    final)
      step overlap 120 "${MPI[@]}" python3 -m bench.overlap --degrees plain,1,2,3,4,auto --json "$RES/overlap.json"
      step overlap_ce 120 "${MPI[@]}" python3 -m bench.overlap --p2p-bytes 1G --degrees plain,1,2,3,4,8,auto --json "$RES/overlap_ce.json"
      step moe_layer 90 "${MPI[@]}" python3 -m bench.moe_layer --json "$RES/moe_layer.json"
      step moe_layer_ce 90 "${MPI[@]}" python3 -m bench.moe_layer --p2p-bytes 1G --json "$RES/moe_layer_ce.json" ;;
    hostprof)
      step overlap_hostprof 120 "${MPI[@]}" python3 -m bench.overlap --p2p-bytes 1G --degrees 1,4 -n 5 --trace /tmp/traces --host-profile
      step overlap_host_summary 60 python3 -m bench.trace_summary --host --top 45 /tmp/traces/trace_4.json
      step moe_hostprof 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2 -n 5 --profile /tmp/moe_trace.json --host-profile
      step moe_host_summary 60 python3 -m bench.trace_summary --host --top 45 /tmp/moe_trace.json ;;
    moece)
      step moe_layer 90 "${MPI[@]}" python3 -m bench.moe_layer --json "$RES/moe_layer.json"
      step moe_layer_ce 90 "${MPI[@]}" python3 -m bench.moe_layer --p2p-bytes 1G --overlap-degree 1,2 --json "$RES/moe_layer_ce.json" ;;
    topology)
      step probe_1x2 90 "${MPI[@]}" python3 -m topology probe --local-size 2 --sizes 256,4K,64K,1M,16M,64M --out "$RES/probe_1x2.json"
      step tune_2x1 150 "${MPI[@]}" python3 -m topology tune --local-size 1 --sizes 64K,1M,16M,256M --probe-sizes 256,4K,64K,1M,16M,64M --degrees 1,2,4 \
        --out "$RES/profile_2x1.json"
      step show_2x1 30 python3 -m topology show "$RES/profile_2x1.json" --png "$RES/profile_2x1.png"
      step simulate_2x1 30 python3 -m topology simulate --nodes 2 --local-size 1 --profile "$RES/profile_2x1.json"
      step simulate_h200 30 python3 -m topology simulate --nodes 64 --local-size 8 ;;
    graphtests)
      step core_graph 90 "${MPI[@]}" python3 -m tests.ranks.core_collectives nccl check_cuda_graph
      step core_graph_p2p 90 "${MPI[@]}" python3 -m tests.ranks.core_collectives nccl-p2p check_cuda_graph
      step overlap_graph 90 "${MPI[@]}" python3 -m tests.ranks.overlap_checks nccl cuda_graph
      step overlap_graph_p2p 90 "${MPI[@]}" python3 -m tests.ranks.overlap_checks nccl-p2p cuda_graph,equivalence
      step pytest_tables 60 python3 -m pytest -q -m gpu tests/test_device_tables.py tests/test_wide_gemm_gpu.py -p no:cacheprovider ;;
    moegraph)
      step moe_graph 150 "${MPI[@]}" python3 -m bench.moe_layer --overlap-degree 1,2 --cuda-graph --json "$RES/moe_layer_graph.json"
      step moe_graph_ce 150 "${MPI[@]}" python3 -m bench.moe_layer --p2p-bytes 2G --overlap-degree 1,2 --cuda-graph \
        --json "$RES/moe_layer_graph_ce.json" ;;
    moegraphprofile)
      step moe_graph_profile 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2 -n 3 --p2p-bytes 2G --cuda-graph \
        --profile /tmp/moe_graph_trace.json
      step moe_graph_summary 60 python3 -m bench.trace_summary /tmp/moe_graph_trace.json --top 45 ;;
    overlapgraph)
      step overlap_graph_bench 150 "${MPI[@]}" python3 -m bench.overlap --degrees 1,2,3,4 --cuda-graph -n 15 --json "$RES/overlap_graph.json"
      step overlap_graph_ce 150 "${MPI[@]}" python3 -m bench.overlap --p2p-bytes 2G --degrees 1,2,3,4,6,8 --cuda-graph -n 15 \
        --json "$RES/overlap_graph_ce.json" ;;
    moeown)
      step moe_own_ce 150 "${MPI[@]}" python3 -m bench.moe_layer --p2p-bytes 2G --own-first 0,1 --cuda-graph \
        --json "$RES/moe_layer_own_ce.json"
      step moe_own 150 "${MPI[@]}" python3 -m bench.moe_layer --own-first 0,1 --cuda-graph --json "$RES/moe_layer_own.json" ;;
    overlapown)
      step overlap_own_ce 200 "${MPI[@]}" python3 -m bench.overlap --p2p-bytes 2G --degrees 1,o1,2,o2,4,o4 --cuda-graph -n 15 \
        --json "$RES/overlap_own_ce.json" ;;
    overlapownnccl)
      step overlap_own 200 "${MPI[@]}" python3 -m bench.overlap --degrees 1,o1,2,o2,4 --cuda-graph -n 15 \
        --json "$RES/overlap_own.json" ;;
    overlapsplit)
      step overlap_split_ce 240 "${MPI[@]}" python3 -m bench.overlap --p2p-bytes 2G \
        --degrees 1,o1:1,o1:0.5,o2:1,o2:0.5,o2:0.3,o4:0.5,4 --cuda-graph -n 15 --json "$RES/overlap_split_ce.json" ;;
    overlapsplitnccl)
      step overlap_split 200 "${MPI[@]}" python3 -m bench.overlap --degrees 1,o1:1,o1:0.5,o2:1,o2:0.5,2 --cuda-graph \
        -n 15 --json "$RES/overlap_split.json" ;;
    fp8)  # issue 20: FP8 on the wire (kernels, exchanges over NCCL and peer memory, the benchmark)
      step quant_kernels 300 python3 -m pytest -q -p no:cacheprovider tests/test_quant.py
      step quant_checks 120 "${MPI[@]}" -x MOECOMM_TEST_VERBOSE=1 python3 -m tests.ranks.quant_checks nccl
      step quant_checks_p2p 120 "${MPI[@]}" -x MOECOMM_TEST_VERBOSE=1 python3 -m tests.ranks.quant_checks nccl-p2p
      step alltoall_fp8 200 "${MPI[@]}" python3 -m bench.alltoall -d bfloat16 --row-elems 2048 -b 1M -e 256M -f 4 \
        -p uniform,random --wire-dtype float8_e4m3fn --p2p-bytes 2G -n 30 --no-progress --json "$RES/alltoall_fp8.json" ;;
    fp8kernels)  # issue 20: the FP8 wire passes' bandwidth (the layer's tokens: 32 MiB and 128 MiB of bf16)
      step kernels_fp8 120 python3 -m bench.kernels --wire-dtype float8_e4m3fn --graph --json "$RES/kernels_fp8.json"
      step kernels_fp8_128M 120 python3 -m bench.kernels --wire-dtype float8_e4m3fn --tokens 32768 --capacity 4096 \
        --json "$RES/kernels_fp8_128M.json" ;;
    build)  # the native kernels as the install builds them (setup.py), then where each one loads from
      step build_ext 400 env MAX_JOBS=16 python3 setup.py -q build_ext --inplace
      step ext_origins 200 python3 -c "import moecomm_ext as me, moecomm_ext._loader as L, moecomm.backends._ext as T, \
moecomm_ext._quant as Q; me.load_native('cuda', strict=True); me.load_native('cpu', strict=True); T.load_p2p(); \
T.load_nccl_issue(); Q.quant_module('cuda', None); Q.quant_module('cpu', None); \
print({k: v.origin for k, v in L._LOADED.items()})" ;;
    faults) step faults 300 python3 -m tests.faults --subset --launcher "mpirun --allow-run-as-root" ;;
    fusedonce)  # the fused step's final check: one round of the comparison, and its sync report
      step moe_fused 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2,3 -n 15 --json "$RES/moe_fused.json"
      step moe_opbyop 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2,3 -n 15 --op-by-op --json "$RES/moe_opbyop.json"
      step dl_fused 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2 --dropless -n 15 --sync-report \
        --json "$RES/dl_fused.json" ;;
    fused)  # issue 16: the fused step (default) beside the op-by-op one (--op-by-op), alternating, two rounds
      for run in 1 2; do
        step "moe_fused_$run" 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2,3 -n 15 --json "$RES/moe_fused_$run.json"
        step "moe_opbyop_$run" 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2,3 -n 15 --op-by-op \
          --json "$RES/moe_opbyop_$run.json"
        step "dl_fused_$run" 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2 --dropless -n 15 \
          --json "$RES/dl_fused_$run.json"
        step "dl_opbyop_$run" 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2 --dropless -n 15 --op-by-op \
          --json "$RES/dl_opbyop_$run.json"
      done
      step moe_fused_graph 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2,3 -n 15 --cuda-graph \
        --json "$RES/moe_fused_graph.json"
      step moe_fused_syncs 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2 -n 3 --sync-report --host-profile
      step dl_fused_syncs 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2 -n 3 --dropless --sync-report
      step moe_fused_profile 90 "${MPI[@]}" python3 -m bench.moe_layer --top-k 2 -n 3 --profile /tmp/moe_fused_trace.json
      step moe_fused_summary 60 python3 -m bench.trace_summary --host --top 30 /tmp/moe_fused_trace.json ;;
    shared)  # issue 26: SHARED_RANKS ranks sharing GPU 0 on the peer backend: the rank suites (SHARED_PARTS)
      # under MPS, then the core suite and the exchange benchmark without MPS (2 ranks)
      local parts=${SHARED_PARTS:-core overlap quant moe ll a2a moebench} L=${SHARED_STEP_S:-240}
      mps_on
      for n in ${SHARED_RANKS:-2 3 4 8}; do
        local M=(mpirun --allow-run-as-root -n $n -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS
                 -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY)
        for part in $parts; do
          case $part in
            core) step "shared_core_$n" $L "${M[@]}" -x MOECOMM_TEST_VERBOSE=1 python3 -m tests.ranks.core_collectives peer ;;
            overlap) step "shared_overlap_$n" $L "${M[@]}" python3 -m tests.ranks.overlap_checks peer ;;
            quant) step "shared_quant_$n" $L "${M[@]}" python3 -m tests.ranks.quant_checks peer ;;
            moe) step "shared_moe_$n" $L "${M[@]}" python3 -m tests.ranks.moe_layer_checks all cuda ;;
            ll) step "shared_ll_$n" $L "${M[@]}" python3 -m tests.ranks.low_latency_checks peer ;;
            a2a) step "shared_a2a_$n" $L "${M[@]}" python3 -m bench.alltoall -d bfloat16 --row-elems 2048 -b 256K -e 256M \
                   -f 4 -p uniform,random,skewed -n 20 --no-progress --json "$RES/shared_gpu_alltoall_$n.json" ;;
            moebench) if [ $n = 2 ] || [ $n = 4 ]; then  # (then the agreed equal blocks beside, in the same call)
                   step "shared_moe_layer_$n" $L "${M[@]}" python3 -m bench.moe_layer \
                     --tokens $((8192 / n)) --top-k 2 --json "$RES/shared_gpu_moe_layer_$n.json"
                   step "shared_moe_layer_${n}_agreed" $L "${M[@]}" python3 -m bench.moe_layer --peer-agree-equal \
                     --tokens $((8192 / n)) --top-k 2 --json "$RES/shared_gpu_moe_layer_${n}_agreed.json"
                 fi ;;
          esac
        done
      done
      mps_off
      if [ -z "${SHARED_NO_NOMPS:-}" ]; then
        local M=(mpirun --allow-run-as-root -n 2 -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS
                 -x CUDA_VISIBLE_DEVICES=0)
        step shared_core_2_nomps $L "${M[@]}" -x MOECOMM_TEST_VERBOSE=1 python3 -m tests.ranks.core_collectives peer
        # counts on the GPU in one host round (PeerBackend.one_host_round, off by default until this passes)
        step shared_core_2_nomps_oneround $L "${M[@]}" -x MOECOMM_TEST_VERBOSE=1 python3 -m tests.ranks.core_collectives \
          peer-one-round
        step shared_a2a_2_nomps $L "${M[@]}" python3 -m bench.alltoall -d bfloat16 --row-elems 2048 -b 256K -e 256M -f 4 \
          -p uniform,random,skewed -n 20 --peer-one-host-round --no-progress --json "$RES/shared_gpu_alltoall_2_nomps.json"
      fi ;;
    layer27)  # issue 27 (world size 1): every activation against ReLU, SwiGLU against torch's grouped-GEMM layer, the modern router
      for act in relu swiglu geglu gelu silu lambda:relu; do  # (lambda:relu: Tutel's spelling, lambda x: F.relu(x))
        step "layer27_${act/:/_}" 120 python3 -m bench.moe_layer --top-k 2 --activation $act \
          --json "$RES/layer27_${act/:/_}.json"
      done
      step layer27_relu_dropless 120 python3 -m bench.moe_layer --top-k 2 --dropless --json "$RES/layer27_relu_dropless.json"
      step layer27_relu_dropless_segkernels 120 python3 -m bench.moe_layer --top-k 2 --dropless --seg-kernels on \
        --json "$RES/layer27_relu_dropless_segkernels.json"
      step layer27_gelu_dropless 120 python3 -m bench.moe_layer --top-k 2 --dropless --activation gelu \
        --json "$RES/layer27_gelu_dropless.json"
      step layer27_swiglu_dropless 180 python3 -m bench.moe_layer --top-k 2 --activation swiglu --dropless --reference \
        --json "$RES/layer27_swiglu_dropless.json"
      for router in modern modern-routing softmax-shared; do
        step "layer27_$router" 120 python3 -m bench.moe_layer --top-k 2 --router $router --json "$RES/layer27_$router.json"
      done ;;
    dropless27)  # issue 27 (world size 1): the dropless steps alone, ReLU and SwiGLU (against torch's grouped-GEMM layer)
      step layer27_relu_dropless 120 python3 -m bench.moe_layer --top-k 2 --dropless --json "$RES/layer27_relu_dropless.json"
      step layer27_swiglu_dropless 180 python3 -m bench.moe_layer --top-k 2 --activation swiglu --dropless --reference \
        --json "$RES/layer27_swiglu_dropless.json" ;;
    hostdiag)  # issue 27: where the host time of a step goes (torch profiler's host calls), capacity, dropless, modern router
      for cfg in "relu_cap:" "relu_dl:--dropless" "swiglu_dl:--activation swiglu --dropless" "modern:--router modern"; do
        local name=${cfg%%:*} opts=${cfg#*:}
        step "hostprof_$name" 90 python3 -m bench.moe_layer --top-k 2 $opts -n 3 --profile "/tmp/hp_$name.json"
        step "hostsum_$name" 60 python3 -m bench.trace_summary --host --top 40 "/tmp/hp_$name.json"
      done ;;
    frameworks)  # issue 28: the wheels of ../shared/DEVICE.md carried in .fw/; world size 1 (torchrun), then
      # FW_RANKS ranks sharing GPU 0 under MPS (mpirun: gloo for torch.distributed, moecomm's peer backend;
      # 8192 tokens in all, each framework a run of its own)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fw .fw/*.whl >> "$LOG" 2>&1
      [ -z "${FW_NO_1:-}" ] && step frameworks_1 400 env PYTHONPATH=/tmp/fw:$PYTHONPATH torchrun --standalone \
        --nproc-per-node 1 -m bench.frameworks ${FW_ONLY:+--only $FW_ONLY} --json "$RES/frameworks_1${FW_ONLY:+_$FW_ONLY}.json"
      if [ -n "${FW_RANKS:-}" ]; then
        mps_on
        for n in $FW_RANKS; do
          for fw in megatron deepspeed; do
            step "frameworks_${n}_$fw" 200 env PYTHONPATH=/tmp/fw:$PYTHONPATH mpirun --allow-run-as-root -n $n -x PYTHONPATH \
              -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY \
              -x CUDA_MPS_LOG_DIRECTORY python3 -m bench.frameworks --only $fw --tokens $((8192 / n)) --iters 10 --warmup 3 \
              --json "$RES/frameworks_${n}_$fw.json"
          done
        done
        mps_off
      fi ;;
    decode)  # issue 30: LowLatencyBuffer, DeepSeek-V3's decode shape, ranks sharing GPU 0 under MPS
      mps_on
      for n in ${DECODE_RANKS:-1 2 4 8}; do
        local M=(mpirun --allow-run-as-root -n $n -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS
                 -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY)
        step "decode_$n" 120 "${M[@]}" python3 -m bench.low_latency -t 128 -H 7168 -E 256 -k 8 --json "$RES/decode_$n.json"
        step "decode_fp8_$n" 120 "${M[@]}" python3 -m bench.low_latency -t 128 -H 7168 -E 256 -k 8 --fp8 \
          --json "$RES/decode_fp8_$n.json"
        [ $n -le 2 ] && step "decode_torchops_$n" 120 "${M[@]}" python3 -m bench.low_latency -t 128 -H 7168 -E 256 -k 8 \
          --torch-ops --json "$RES/decode_torchops_$n.json"
      done
      mps_off ;;
    decodeprof)  # issue 30: where the decode time goes (kernels, per call), 1 and 2 ranks sharing GPU 0 under MPS
      mps_on
      for n in ${DECODE_RANKS:-1 2}; do
        for fp8 in "" "--fp8"; do
          step "decodeprof_$n$fp8" 120 mpirun --allow-run-as-root -n $n -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT \
            -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY \
            python3 -m bench.low_latency -t 128 -H 7168 -E 256 -k 8 $fp8 -n 20 --profile 20
        done
      done
      mps_off ;;
    sharedbatch)  # issue 26: the exchange timed as nccl-tests do (10 exchanges back to back per sample), under MPS
      mps_on
      for n in ${BATCH_RANKS:-2 8}; do
        step "shared_a2a_batch_$n" 240 mpirun --allow-run-as-root -n $n -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT \
          -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY \
          python3 -m bench.alltoall -d bfloat16 --row-elems 2048 -b 256K -e ${BATCH_E:-256M} -f 4 -p uniform,random,skewed \
          -n 20 --batch 10 --no-progress --json "$RES/shared_gpu_alltoall_${n}_batch10.json"
      done
      mps_off ;;
    checkcost)  # issue 32: the default check's cost (known counts, checked against unchecked), ranks sharing GPU 0 under MPS
      mps_on
      for n in ${CHECK_RANKS:-2 4}; do
        step "checkcost_$n" 180 mpirun --allow-run-as-root -n $n -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT \
          -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY \
          python3 -m bench.alltoall -d bfloat16 --row-elems 2048 -b 1M -e 64M -f 4 -p uniform,random --check-cost \
          -n ${CHECK_ITERS:-30} --batch 10 --no-progress --json "$RES/shared_gpu_checkcost_$n.json"
      done
      mps_off ;;
    decodeab)  # issue 30: the used-rows exchange's copy blocks (AB_BLOCKS) and gathering on the way (or not), 2 ranks, MPS
      mps_on
      for rb in ${AB_BLOCKS:-16 32}; do
        for g in "" "--no-gather"; do
          step "decodeab_${rb}${g}" 90 mpirun --allow-run-as-root -n 2 -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT \
            -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY \
            python3 -m bench.low_latency -t 128 -H 7168 -E 256 -k 8 --rows-blocks $rb $g --json "$RES/decodeab_${rb}${g}.json"
        done
      done
      mps_off ;;
    dlsyncs)  # issue 27: host syncs and host time (cProfile) of the dropless steps, ReLU (biases) and SwiGLU
      for cfg in "relu_dl:--dropless" "swiglu_dl:--activation swiglu --dropless"; do
        step "dlsyncs_${cfg%%:*}" 90 python3 -m bench.moe_layer --top-k 2 ${cfg#*:} -n 3 --sync-report --host-profile
      done ;;
    sharedmoeprof)  # issue 26: where a step of the layer spends its host time, 2 ranks sharing the GPU under MPS
      mps_on
      step shared_moe_prof_2 120 mpirun --allow-run-as-root -n 2 -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT \
        -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY \
        python3 -m bench.moe_layer --tokens 4096 --top-k 2 -n 5 --sync-report --host-profile
      mps_off ;;
    sharedmoe)  # issue 26: the layer at 2 and 4 ranks sharing the GPU under MPS, equal blocks checked on the GPU (default)
      # beside agreed on the host (--peer-agree-equal); at 4 ranks also one torch thread per rank, and a host profile
      mps_on
      for n in 2 4; do
        local M=(mpirun --allow-run-as-root -n $n -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS
                 -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY)
        for run in 1 2; do
          step "shared_moe_layer_${n}_run$run" 60 "${M[@]}" python3 -m bench.moe_layer --tokens $((8192 / n)) --top-k 2 \
            --json "$RES/shared_gpu_moe_layer_${n}_run$run.json"
          step "shared_moe_layer_${n}_agreed_run$run" 60 "${M[@]}" python3 -m bench.moe_layer --peer-agree-equal \
            --tokens $((8192 / n)) --top-k 2 --json "$RES/shared_gpu_moe_layer_${n}_agreed_run$run.json"
        done
      done
      step shared_moe_layer_4_omp1 60 env OMP_NUM_THREADS=1 "${M[@]}" python3 -m bench.moe_layer --tokens 2048 --top-k 2 \
        --json "$RES/shared_gpu_moe_layer_4_omp1.json"
      step shared_moe_prof_4 90 "${M[@]}" python3 -m bench.moe_layer --tokens 2048 --top-k 2 -n 5 --sync-report --host-profile
      mps_off ;;
    sharedmoegpu)  # issue 26: where the GPU time of a step goes, world size 1 and rank 0 of 4 ranks sharing the GPU (MPS)
      step moe_gpuprof_1 90 python3 -m bench.moe_layer --top-k 2 -n 3 --profile /tmp/moe_gpuprof_1.json
      step moe_gpusum_1 60 python3 -m bench.trace_summary --top 30 /tmp/moe_gpuprof_1.json
      mps_on
      step moe_gpuprof_4 90 mpirun --allow-run-as-root -n 4 -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT \
        -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY \
        python3 -m bench.moe_layer --tokens 2048 --top-k 2 -n 3 --profile /tmp/moe_gpuprof_4.json
      mps_off
      step moe_gpusum_4 60 python3 -m bench.trace_summary --top 30 /tmp/moe_gpuprof_4.json ;;
    launchcost)  # issue 26: what issuing GPU work costs each process when 1-8 share the GPU (MPS or not, bound to
      # cores or not), and the 4-rank layer bound to cores beside the default binding
      step cpus 10 bash -c "nproc; lscpu | grep -E '^(Model name|Socket|Core|Thread|NUMA node\(s\)|CPU\(s\))'"
      local L=(mpirun --allow-run-as-root -x PYTHONPATH -x PYTHONUNBUFFERED -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0)
      step launch_1 60 "${L[@]}" -n 1 python3 -m bench.launch_cost
      step launch_4_nomps 60 "${L[@]}" -n 4 python3 -m bench.launch_cost
      mps_on
      L+=(-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY)
      for n in 1 2 4 8; do step "launch_${n}_mps" 60 "${L[@]}" -n $n python3 -m bench.launch_cost; done
      step launch_4_mps_core 60 "${L[@]}" -n 4 --bind-to core --map-by core --report-bindings python3 -m bench.launch_cost
      step launch_4_mps_none 60 "${L[@]}" -n 4 --bind-to none python3 -m bench.launch_cost
      for b in core none; do
        step "shared_moe_layer_4_bind_$b" 60 "${L[@]}" -n 4 -x MOECOMM_TIMEOUT --bind-to $b --map-by core \
          python3 -m bench.moe_layer --tokens 2048 --top-k 2 --json "$RES/shared_gpu_moe_layer_4_bind_$b.json"
      done
      step shared_moe_layer_4_default 60 "${L[@]}" -n 4 -x MOECOMM_TIMEOUT python3 -m bench.moe_layer --tokens 2048 \
        --top-k 2 --json "$RES/shared_gpu_moe_layer_4_default.json"
      mps_off ;;
    copyab)  # issue 26: the peer backend's known-counts rounds moved by SM kernels (default) against copy engines,
      # side by side: the layer at 2 and 4 ranks (runs alternating), the exchange (methods interleaved in each round)
      mps_on
      for n in 2 4; do
        local M=(mpirun --allow-run-as-root -n $n -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS
                 -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY)
        for run in $([ -z "${COPYAB_NO_MOE:-}" ] && echo 1 2); do
          step "copyab_moe_${n}_kernels_run$run" 60 "${M[@]}" python3 -m bench.moe_layer --tokens $((8192 / n)) --top-k 2 \
            --json "$RES/shared_gpu_moe_layer_${n}_kernels_run$run.json"
          step "copyab_moe_${n}_ce_run$run" 60 "${M[@]}" python3 -m bench.moe_layer --peer-copy-engines \
            --tokens $((8192 / n)) --top-k 2 --json "$RES/shared_gpu_moe_layer_${n}_ce_run$run.json"
        done
        step "copyab_a2a_$n" 120 "${M[@]}" python3 -m bench.alltoall -d bfloat16 --row-elems 2048 -b 256K -e 64M -f 4 \
          -p uniform,random --peer-copy-engines -n 20 --batch 10 --no-progress --json "$RES/shared_gpu_copyab_$n.json"
      done
      mps_off ;;
    sharedown)  # issue 26: the layer at 2 and 4 ranks sharing the GPU, own rows first or not, overlap degree 1 or 2
      mps_on
      for n in 4 2; do
        step "shared_moe_own_$n" 120 mpirun --allow-run-as-root -n $n -x PYTHONPATH -x PYTHONUNBUFFERED -x MOECOMM_TIMEOUT \
          -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY \
          python3 -m bench.moe_layer --tokens $((8192 / n)) --top-k 2 --own-first 0,1 --overlap-degree 1,2 \
          --json "$RES/shared_gpu_moe_own_$n.json"
      done
      mps_off ;;
    stamps)  # issue 26: GPU time stamps around every exchange of the layer at 4 and 2 ranks sharing the GPU (no
      # profiler): how far apart the ranks arrive, who is last, what an exchange takes after the last arrival
      mps_on
      for n in 4 2; do
        step "shared_moe_stamps_$n" 180 mpirun --allow-run-as-root -n $n -x PYTHONPATH -x PYTHONUNBUFFERED \
          -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY \
          -x CUDA_MPS_LOG_DIRECTORY python3 -m bench.moe_layer --tokens $((8192 / n)) --top-k 2 -n 5 --stamps 5
        # each client limited to its share of the SMs (MPS's own setting, per client): the ranks' GEMMs then
        # run side by side instead of taking turns on the whole GPU
        step "shared_moe_share_$n" 120 mpirun --allow-run-as-root -n $n -x PYTHONPATH -x PYTHONUNBUFFERED \
          -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY \
          -x CUDA_MPS_LOG_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)) python3 -m bench.moe_layer \
          --tokens $((8192 / n)) --top-k 2 -n 5 --stamps 5
      done
      mps_off ;;
    stampsref)  # issue 26: the same stamps at world size 1 (all 8192 tokens in one process: the compute between the
      # exchanges without sharing the GPU) and at 4 ranks bound to cores (hosts kept off each other's cores)
      step moe_stamps_1 90 python3 -m bench.moe_layer --tokens 8192 --top-k 2 -n 5 --stamps 5
      mps_on
      step shared_moe_stamps_4_bound 120 mpirun --allow-run-as-root -n 4 -x PYTHONPATH -x PYTHONUNBUFFERED \
        -x MOECOMM_TIMEOUT -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY \
        -x CUDA_MPS_LOG_DIRECTORY --bind-to core --map-by core python3 -m bench.moe_layer --tokens 2048 --top-k 2 \
        -n 5 --stamps 5
      mps_off ;;
    sharedtimeline)  # issue 26: is the 4-rank layer bound by sharing the GPU or by its exchanges? The same work
      # per process without exchanges (4 independent world-size-1 layers of 4 experts, 2048 tokens, at once), the
      # 4-rank layer captured (no host), and every rank's GPU trace on one time line
      step alone_1x4 60 python3 -m bench.moe_layer --tokens 2048 --experts 4 --top-k 2 -n 40
      mps_on
      step independent_4x4 120 bash -c 'for i in 0 1 2 3; do python3 -m bench.moe_layer --tokens 2048 --experts 4 \
        --top-k 2 -n 40 > /tmp/indep_$i.log 2>&1 & done; wait; grep -h -E "^ 2 " /tmp/indep_*.log'
      step independent_2x8 120 bash -c 'for i in 0 1; do python3 -m bench.moe_layer --tokens 4096 --experts 8 \
        --top-k 2 -n 40 > /tmp/indep2_$i.log 2>&1 & done; wait; grep -h -E "^ 2 " /tmp/indep2_*.log'
      local T=(mpirun --allow-run-as-root -x PYTHONPATH -x PYTHONUNBUFFERED -x OMP_NUM_THREADS -x MOECOMM_TIMEOUT
               -x CUDA_VISIBLE_DEVICES=0 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY --bind-to core --map-by core)
      step shared_moe_layer_4_graph 90 "${T[@]}" -n 4 python3 -m bench.moe_layer --tokens 2048 --top-k 2 --cuda-graph
      step shared_moe_timeline_4 90 "${T[@]}" -n 4 python3 -m bench.moe_layer --tokens 2048 --top-k 2 -n 3 \
        --profile "/tmp/tl4_{rank}.json"
      step shared_moe_timeline_2 90 "${T[@]}" -n 2 python3 -m bench.moe_layer --tokens 4096 --top-k 2 -n 3 \
        --profile "/tmp/tl2_{rank}.json"
      mps_off
      step timeline_4 60 python3 -m bench.trace_summary --merge /tmp/tl4_0.json /tmp/tl4_1.json /tmp/tl4_2.json \
        /tmp/tl4_3.json
      step timeline_2 60 python3 -m bench.trace_summary --merge /tmp/tl2_0.json /tmp/tl2_1.json
      step timeline_4_rank0 60 python3 -m bench.trace_summary --top 12 /tmp/tl4_0.json ;;
    moe1) step moe_layer_1 120 python3 -m bench.moe_layer --top-k 2 --json "$RES/shared_gpu_moe_layer_1.json" ;;
    peercosts) mps_on
      for rows in 64 2048; do
        step "peer_costs_$rows" 60 mpirun --allow-run-as-root -n 2 -x PYTHONPATH -x CUDA_VISIBLE_DEVICES=0 \
          -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY python3 -m bench.peer_costs --rows $rows --profile 200
      done
      mps_off ;;
    sobuild)  # build every native extension in place and send the libraries back (carry them next time)
      step build_ext 400 env MAX_JOBS=16 python3 setup.py -q build_ext --inplace
      mkdir -p "$RES/so" && find moecomm moecomm_ext -name "*cpython-3*.so" -exec cp --parents {} "$RES/so" \; ;;
    perpeer) step per_peer 90 "${MPI[@]}" python3 -m bench.latency --only-per-peer -n 100 --json "$RES/latency_per_peer.json" ;;
    deadlines) step nccl_deadlines 90 "${MPI[@]}" python3 -m tests.ranks.nccl_init_timeout ;;
    perpeerx3)  # the same, three runs
      for run in 1 2 3; do
        step "per_peer_$run" 90 "${MPI[@]}" python3 -m bench.latency --only-per-peer -n 100 \
          --json "$RES/latency_per_peer_$run.json"
      done ;;
    *) echo "unknown step $1" >> "$LOG" ;;
  esac
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; nvidia-smi topo -m;
  python3 -c "import torch, nccl.core as n; print('torch', torch.__version__, 'nccl4py', n.__version__)"; } >> "$LOG" 2>&1

# Steps run in the order given (default: all of them).
for name in ${*:-core torchrun latency a2a hier topology overlap kernels gputests moe moetests overlaptests}; do
  run_step "$name"
done

tar czf "$OUT/results.tgz" -C "$RES" . && rm -rf "$RES"
printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
