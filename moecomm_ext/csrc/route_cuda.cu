// CUDA kernels of the MoE router's capacity routing (moecomm_ext/_route.py); the same
// results as route_cpu.cpp (see its header), bound by rows_cuda_bind.cpp.
//
// route_capacity: a route's queue position in its expert is the number of earlier routes
// to that expert in queue order (every first choice in token order, then every second
// choice, ...). The routes are cut into chunks of L tokens of one choice level; three
// kernels: (1) each chunk's per-expert count (shared-memory atomics; the kernel also
// empties the slot maps), (2) one block scans the counts over the chunks per expert
// (exclusive offsets, the totals, the first-choice counts), (3) one warp per chunk walks its
// tokens 32 at a time in order, ranking equal experts within the 32 with __match_any_sync.
// No atomics decide an order, so the result is deterministic and equals the CPU's. With
// capacity -1 (dropless) every route is kept and expert e's slots start at the sum of the
// counts before it (the scan kernel's last step).
//
// route_backward: one warp per token row; the sum over experts is a warp reduction (its
// order differs from the CPU's sequential sum, so results agree to float rounding).

#include "route.h"

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>

#include <cfloat>
#include <cstdint>
#include <optional>
#include <vector>

namespace moecomm_ext {

namespace {

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kHistThreads = 256;
constexpr int kMaxChunks = 1024;
constexpr int64_t kMaxSmemExperts = 12 * 1024;  // 48 KiB of int32 counters

// torch.finfo(dtype).eps (std::numeric_limits is host-only in device code)
template <typename scalar_t>
__device__ __forceinline__ scalar_t epsilon();
template <>
__device__ __forceinline__ float epsilon<float>() { return FLT_EPSILON; }
template <>
__device__ __forceinline__ double epsilon<double>() { return DBL_EPSILON; }

template <typename scalar_t>
__device__ __forceinline__ scalar_t row_denominator(const scalar_t* v, int k) {
  scalar_t s = v[0];
  for (int j = 1; j < k; ++j) s += v[j];
  const scalar_t eps = epsilon<scalar_t>();
  return s < eps ? eps : s;
}

// (1) per-chunk expert counts; the slot maps emptied (grid-stride over all blocks)
template <typename scalar_t>
__global__ void __launch_bounds__(kHistThreads)
route_hist_kernel(const int64_t* __restrict__ idx, int64_t T, int k, int64_t E, int64_t L, int64_t cpl,
                  int32_t* __restrict__ hist, int64_t* __restrict__ slot_token, int64_t* __restrict__ slot_route,
                  scalar_t* __restrict__ slot_gate, int64_t M) {
  extern __shared__ int32_t counter[];
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) counter[e] = 0;
  __syncthreads();
  const int64_t c = blockIdx.x;
  const int j = static_cast<int>(c / cpl);
  const int64_t t0 = (c % cpl) * L;
  const int64_t t1 = t0 + L < T ? t0 + L : T;
  for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
    const int64_t e = idx[t * k + j];
    if (e < 0 || e >= E) __trap();
    atomicAdd(&counter[e], 1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) hist[c * E + e] = counter[e];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; m < M; m += stride) {
    slot_token[m] = -1;
    slot_route[m] = -1;
    slot_gate[m] = scalar_t(0);
  }
}

// (2) exclusive offsets of every chunk per expert (in place), totals and first-choice counts
template <typename scalar_t>
__global__ void route_scan_kernel(int32_t* __restrict__ hist, int64_t chunks, int64_t cpl, int64_t E,
                                  int64_t* __restrict__ counts, scalar_t* __restrict__ first_counts,
                                  int64_t* __restrict__ start) {
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    int64_t run = 0, first = -1;
    for (int64_t c = 0; c < chunks; ++c) {
      if (c == cpl) first = run;  // the first chunk of the second choice level
      const int32_t h = hist[c * E + e];
      hist[c * E + e] = static_cast<int32_t>(run);
      run += h;
    }
    counts[e] = run;
    first_counts[e] = static_cast<scalar_t>(first < 0 ? run : first);
  }
  if (start == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) {  // the experts' first slots (dropless): few experts, one thread
    int64_t run = 0;
    for (int64_t e = 0; e < E; ++e) {
      start[e] = run;
      run += counts[e];
    }
  }
}

// (3) one warp per chunk: positions, gates and the slot maps
template <typename scalar_t>
__global__ void __launch_bounds__(kWarp)
route_place_kernel(const scalar_t* __restrict__ v, const int64_t* __restrict__ idx, const int32_t* __restrict__ hist,
                   const int64_t* __restrict__ start, int64_t T, int k, int64_t E, int64_t C, int64_t L,
                   int64_t cpl, bool normalize, scalar_t* __restrict__ gates, int64_t* __restrict__ locations, int64_t* __restrict__ token_slots,
                   int64_t* __restrict__ slot_token, int64_t* __restrict__ slot_route,
                   scalar_t* __restrict__ slot_gate) {
  extern __shared__ int32_t offset[];
  const int lane = threadIdx.x;
  const int64_t c = blockIdx.x;
  for (int64_t e = lane; e < E; e += kWarp) offset[e] = hist[c * E + e];
  __syncwarp();
  const int j = static_cast<int>(c / cpl);
  const int64_t t0 = (c % cpl) * L;
  const int64_t t1 = t0 + L < T ? t0 + L : T;
  const unsigned below = (1u << lane) - 1u;
  const bool norm = normalize && k > 1;
  for (int64_t base = t0; base < t1; base += kWarp) {
    const int64_t t = base + lane;
    const bool active = t < t1;
    const unsigned on = __ballot_sync(kFull, active);
    int64_t e = 0, loc = 0;
    unsigned peers = 0;
    if (active) {
      e = idx[t * k + j];
      peers = __match_any_sync(on, e);
      loc = offset[e] + __popc(peers & below);
    }
    __syncwarp();
    if (active && lane == __ffs(peers) - 1) offset[e] += __popc(peers);
    __syncwarp();
    if (!active) continue;
    const int64_t r = t * k + j;
    const scalar_t* row = v + t * k;
    const scalar_t g = norm ? row[j] / row_denominator(row, k) : row[j];
    gates[r] = g;
    locations[r] = loc;
    if (start != nullptr || loc < C) {  // dropless (start given): every route kept
      const int64_t s = start != nullptr ? start[e] + loc : e * C + loc;
      token_slots[r] = s;
      slot_token[s] = t;
      slot_route[s] = r;
      slot_gate[s] = g;
    } else {
      token_slots[r] = -1;
    }
  }
}

// Products and sums rounded one by one, as torch's separate ops round them (nvcc would
// otherwise contract a * b + c into one fused multiply-add, rounded once).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = kWarp / 2; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}
__device__ __forceinline__ double warp_sum(double x) {
  for (int o = kWarp / 2; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

// one warp per token row t: the routes' gradient, the aux loss's, the softmax's backward
template <typename scalar_t>
__global__ void __launch_bounds__(256)
route_backward_kernel(const scalar_t* __restrict__ gg, const scalar_t* __restrict__ v,
                      const int64_t* __restrict__ idx, const scalar_t* __restrict__ p,
                      const scalar_t* __restrict__ aux_grad, const scalar_t* __restrict__ aux_counts,
                      scalar_t aux_scale, int64_t T, int k, int64_t E, bool normalize,
                      scalar_t* __restrict__ out, __nv_bfloat16* __restrict__ out_split) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  const bool norm = normalize && k > 1;
  const scalar_t eps = epsilon<scalar_t>();
  const scalar_t g1 = aux_grad != nullptr ? mul_rn(aux_grad[0], aux_scale) : scalar_t(0);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp; t < T;
       t += warps) {
    const scalar_t* row = v + t * k;
    const scalar_t* grow = gg + t * k;
    const int64_t* irow = idx + t * k;
    scalar_t d = 1, gd = 0;
    if (norm) {
      scalar_t s = row[0];
      for (int j = 1; j < k; ++j) s += row[j];
      d = s < eps ? eps : s;
      for (int j = 0; j < k; ++j) gd = add_rn(gd, mul_rn(-grow[j], (row[j] / d) / d));
      if (!(s >= eps)) gd = 0;
    }
    const scalar_t* prow = p + t * E;
    // pass 1: the dot of the incoming gradient with the scores
    scalar_t part = 0;
    for (int64_t e = lane; e < E; e += kWarp) {
      scalar_t gin = 0;
      for (int j = 0; j < k; ++j) {
        if (irow[j] == e) gin = norm ? add_rn(grow[j] / d, gd) : grow[j];
      }
      if (aux_grad != nullptr) gin = add_rn(gin, mul_rn(g1, aux_counts[e]));
      part += gin * prow[e];
    }
    const scalar_t dot = warp_sum(part);
    // pass 2: softmax backward, written as the scores' dtype or split into two bfloat16
    for (int64_t e = lane; e < E; e += kWarp) {
      scalar_t gin = 0;
      for (int j = 0; j < k; ++j) {
        if (irow[j] == e) gin = norm ? add_rn(grow[j] / d, gd) : grow[j];
      }
      if (aux_grad != nullptr) gin = add_rn(gin, mul_rn(g1, aux_counts[e]));
      const scalar_t gl = mul_rn(prow[e], gin - dot);
      if (out_split != nullptr) {
        const float f = static_cast<float>(gl);
        const __nv_bfloat16 hi = __float2bfloat16_rn(f);
        out_split[t * 2 * E + e] = hi;
        out_split[t * 2 * E + E + e] = __float2bfloat16_rn(f - __bfloat162float(hi));
      } else {
        out[t * E + e] = gl;
      }
    }
  }
}

void check_cuda(const at::Tensor& t, const char* fn, const char* name, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), fn, ": '", name, "' must be a CUDA tensor");
  TORCH_CHECK(t.dim() == dim, fn, ": '", name, "' must be ", dim, "-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), fn, ": '", name, "' must be contiguous");
}

}  // namespace

std::vector<at::Tensor> route_capacity_cuda(const at::Tensor& topk_scores, const at::Tensor& topk_idx,
                                            int64_t num_experts, int64_t capacity, bool normalize) {
  constexpr const char* fn = "route_capacity";
  check_cuda(topk_scores, fn, "topk_scores", 2);
  check_cuda(topk_idx, fn, "topk_idx", 2);
  TORCH_CHECK(topk_idx.scalar_type() == at::kLong, fn, ": 'topk_idx' must be int64");
  TORCH_CHECK(topk_idx.sizes() == topk_scores.sizes(), fn, ": 'topk_idx' and 'topk_scores' must have one shape");
  TORCH_CHECK(num_experts >= 1 && num_experts <= kMaxSmemExperts, fn, ": num_experts must be in [1, ",
              kMaxSmemExperts, "]");
  const c10::cuda::CUDAGuard guard(topk_scores.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t T = topk_scores.size(0), K = topk_scores.size(1), E = num_experts, C = capacity;
  const bool dropless = C < 0;  // every route kept, expert e's slots at [start_e, start_e + counts_e)
  const int64_t M = dropless ? T * K : E * C;
  auto lopt = topk_idx.options();
  auto fopt = topk_scores.options();
  at::Tensor gates = at::empty({T, K}, fopt);
  at::Tensor locations = at::empty({T, K}, lopt);
  at::Tensor token_slots = at::empty({T, K}, lopt);
  if (T == 0 || K == 0) {
    return {gates, locations, at::zeros({E}, lopt), at::zeros({E}, fopt), token_slots, at::full({M}, -1, lopt),
            at::full({M}, -1, lopt), at::zeros({M}, fopt)};
  }
  at::Tensor counts = at::empty({E}, lopt);
  at::Tensor first_counts = at::empty({E}, fopt);
  at::Tensor slot_token = at::empty({M}, lopt);
  at::Tensor slot_route = at::empty({M}, lopt);
  at::Tensor slot_gate = at::empty({M}, fopt);
  // chunks of L tokens (a multiple of 32), about kMaxChunks of them over the k levels at most
  int64_t L = (T * K + kMaxChunks - 1) / kMaxChunks;
  L = L < kHistThreads ? kHistThreads : (L + kWarp - 1) / kWarp * kWarp;
  const int64_t cpl = (T + L - 1) / L;
  const int64_t chunks = cpl * K;
  at::Tensor hist = at::empty({chunks, E}, lopt.dtype(at::kInt));
  at::Tensor start = dropless ? at::empty({E}, lopt) : at::Tensor();
  int64_t* start_ptr = dropless ? start.mutable_data_ptr<int64_t>() : nullptr;
  const size_t smem = static_cast<size_t>(E) * sizeof(int32_t);
  AT_DISPATCH_FLOATING_TYPES(topk_scores.scalar_type(), "route_capacity_cuda", [&] {
    route_hist_kernel<scalar_t><<<static_cast<unsigned>(chunks), kHistThreads, smem, stream>>>(
        topk_idx.const_data_ptr<int64_t>(), T, static_cast<int>(K), E, L, cpl, hist.mutable_data_ptr<int32_t>(),
        slot_token.mutable_data_ptr<int64_t>(), slot_route.mutable_data_ptr<int64_t>(),
        slot_gate.mutable_data_ptr<scalar_t>(), M);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int scan_threads = static_cast<int>(E < 1024 ? (E + kWarp - 1) / kWarp * kWarp : 1024);
    route_scan_kernel<scalar_t><<<1, scan_threads, 0, stream>>>(hist.mutable_data_ptr<int32_t>(), chunks, cpl, E,
                                                                counts.mutable_data_ptr<int64_t>(),
                                                                first_counts.mutable_data_ptr<scalar_t>(), start_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    route_place_kernel<scalar_t><<<static_cast<unsigned>(chunks), kWarp, smem, stream>>>(
        topk_scores.const_data_ptr<scalar_t>(), topk_idx.const_data_ptr<int64_t>(), hist.const_data_ptr<int32_t>(),
        start_ptr, T, static_cast<int>(K), E, C, L, cpl, normalize, gates.mutable_data_ptr<scalar_t>(),
        locations.mutable_data_ptr<int64_t>(), token_slots.mutable_data_ptr<int64_t>(),
        slot_token.mutable_data_ptr<int64_t>(), slot_route.mutable_data_ptr<int64_t>(),
        slot_gate.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {gates, locations, counts, first_counts, token_slots, slot_token, slot_route, slot_gate};
}

at::Tensor route_backward_cuda(const at::Tensor& grad_gates, const at::Tensor& topk_scores,
                               const at::Tensor& topk_idx, const at::Tensor& scores, bool normalize,
                               const std::optional<at::Tensor>& aux_grad,
                               const std::optional<at::Tensor>& aux_counts, double aux_scale, bool split_bf16) {
  check_route_backward_args(grad_gates, topk_scores, topk_idx, scores, aux_grad, aux_counts,
                            [](const at::Tensor& t, int64_t dim) { check_cuda(t, "route_backward", "tensor", dim); });
  const int64_t T = scores.size(0), E = scores.size(1), K = topk_idx.size(1);
  const auto dtype = scores.scalar_type();
  const c10::cuda::CUDAGuard guard(scores.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor out = split_bf16 ? at::empty({T, 2 * E}, scores.options().dtype(at::kBFloat16))
                              : at::empty({T, E}, scores.options());
  if (T == 0 || E == 0) return out;
  constexpr int threads = 256;
  const int64_t rows_per_block = threads / kWarp;
  int64_t blocks = (T + rows_per_block - 1) / rows_per_block;
  blocks = blocks < (int64_t(1) << 30) ? blocks : (int64_t(1) << 30);
  AT_DISPATCH_FLOATING_TYPES(dtype, "route_backward_cuda", [&] {
    route_backward_kernel<scalar_t><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        grad_gates.const_data_ptr<scalar_t>(), topk_scores.const_data_ptr<scalar_t>(),
        topk_idx.const_data_ptr<int64_t>(), scores.const_data_ptr<scalar_t>(),
        aux_grad.has_value() ? aux_grad->const_data_ptr<scalar_t>() : nullptr,
        aux_counts.has_value() ? aux_counts->const_data_ptr<scalar_t>() : nullptr,
        static_cast<scalar_t>(aux_scale), T, static_cast<int>(K), E, normalize,
        split_bf16 ? nullptr : out.mutable_data_ptr<scalar_t>(),
        split_bf16 ? reinterpret_cast<__nv_bfloat16*>(out.mutable_data_ptr<at::BFloat16>()) : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace moecomm_ext
