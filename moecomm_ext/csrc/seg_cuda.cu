// Per-expert bias and column sums over segments on the GPU (seg.h).
//
// seg_bias_act: one thread per VEC adjacent columns of a row (vec_cuda.h), a grid-stride loop over
// the rows' vectors; each thread finds its row's segment by a binary search of `ends` (the threads
// of a warp mostly search for the same row: one cached line).
// seg_colsum: expert e's rows (its segments one after the other) cut into K chunks; block
// (column tile, e, k) sums chunk k of them in opmath into a partial row, and a second kernel adds
// the K partials in order: deterministic, with K set by the shape alone.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "seg.h"
#include "vec_cuda.h"

namespace moecomm_ext {

namespace {

using vec::grid_for;
using vec::load;
using vec::Pack;
using vec::pick_vec;
using vec::store;
using vec::with_vec;

constexpr int kSumThreads = 128;  // column vectors per block of seg_colsum's partial kernel

void cuda_ok(const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), "seg: a CUDA tensor was expected, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), "seg: a contiguous tensor was expected, got strides ", t.strides());
}

__device__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t lmax(int64_t a, int64_t b) { return a > b ? a : b; }

// segment s's rows [start, end): its ends clamped to [0, rows] (empty where they are reversed)
__device__ __forceinline__ int64_t seg_start(const int* ends, int64_t s, int64_t rows) {
  return s == 0 ? 0 : lmin(rows, lmax(0, ends[s - 1]));
}

__device__ __forceinline__ int64_t seg_end(const int* ends, int64_t s, int64_t rows) {
  return lmin(rows, lmax(0, ends[s]));
}

template <typename T, int VEC>
__global__ void seg_bias_act_kernel(T* __restrict__ h, const T* __restrict__ bias, const int* __restrict__ ends,
                                    int64_t S, int64_t El, int64_t rows, int64_t cols, bool relu) {
  using opmath = at::opmath_type<T>;
  const int64_t per_row = cols / VEC, total = rows * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i - r * per_row) * VEC;
    int64_t lo = 0, hi = S;  // the first segment that ends past r
    while (lo < hi) {
      const int64_t mid = (lo + hi) >> 1;
      if (ends[mid] > r) hi = mid; else lo = mid + 1;
    }
    if (lo == S || r < seg_start(ends, lo, rows)) continue;  // in no segment: untouched
    T* row = h + r * cols + c;
    const Pack<T, VEC> hv = load<T, VEC>(row), bv = load<T, VEC>(bias + (lo % El) * cols + c);
    Pack<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const T v = static_cast<T>(static_cast<opmath>(hv.v[j]) + static_cast<opmath>(bv.v[j]));
      out.v[j] = relu && static_cast<opmath>(v) < opmath(0) ? T(0) : v;  // (NaN stays, as torch's relu)
    }
    store<T, VEC>(row, out);
  }
}

template <typename T, int VEC>
__global__ void seg_colsum_partial_kernel(const T* __restrict__ g, const int* __restrict__ ends,
                                          at::opmath_type<T>* __restrict__ partial, int64_t S, int64_t El,
                                          int64_t rows, int64_t cols, int64_t K) {
  using opmath = at::opmath_type<T>;
  const int64_t e = blockIdx.y, k = blockIdx.z;
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c >= cols) return;
  int64_t total = 0;  // expert e's rows in all
  for (int64_t s = e; s < S; s += El) total += lmax(0, seg_end(ends, s, rows) - seg_start(ends, s, rows));
  const int64_t lo = total * k / K, hi = total * (k + 1) / K;  // this block's chunk of them
  opmath acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = opmath(0);
  int64_t before = 0;  // rows of expert e in the segments before s
  for (int64_t s = e; s < S && before < hi; s += El) {
    const int64_t start = seg_start(ends, s, rows), n = lmax(0, seg_end(ends, s, rows) - start);
    const int64_t first = start + lmax(0, lo - before), last = start + lmin(n, hi - before);
#pragma unroll 4
    for (int64_t r = first; r < last; ++r) {
      const Pack<T, VEC> v = load<T, VEC>(g + r * cols + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += static_cast<opmath>(v.v[j]);
    }
    before += n;
  }
  opmath* out = partial + (k * El + e) * cols + c;
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = acc[j];
}

template <typename T>
__global__ void seg_colsum_finish_kernel(const at::opmath_type<T>* __restrict__ partial, T* __restrict__ out,
                                         int64_t items, int64_t K) {
  using opmath = at::opmath_type<T>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < items; i += int64_t(gridDim.x) * blockDim.x) {
    opmath s = opmath(0);
    for (int64_t k = 0; k < K; ++k) s += partial[k * items + i];
    out[i] = static_cast<T>(s);
  }
}

// the chunks of each expert's rows: about 1024 partial blocks in all, 1 to 64 per expert, from
// the shape alone (not the vector width, which the pointers' alignment picks), so that the
// same shape sums in the same order
int64_t sum_chunks(int64_t El, int64_t cols, int64_t elem_bytes) {
  const int64_t tiles = std::max<int64_t>(1, (cols * elem_bytes + 16 * kSumThreads - 1) / (16 * kSumThreads));
  return std::max<int64_t>(1, std::min<int64_t>(64, 1024 / (El * tiles)));
}

}  // namespace

at::Tensor seg_bias_act_cuda(at::Tensor& h, const at::Tensor& bias, const at::Tensor& ends, bool relu) {
  check_seg_bias(h, bias, ends, cuda_ok);
  const int64_t rows = h.size(0), cols = h.size(1), El = bias.size(0), S = ends.numel();
  if (rows == 0 || cols == 0) return h;
  const c10::cuda::CUDAGuard guard(h.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  constexpr int kThreads = 256;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "seg_bias_act_cuda", [&] {
    scalar_t* hp = h.mutable_data_ptr<scalar_t>();
    const scalar_t* bp = bias.const_data_ptr<scalar_t>();
    const int* ep = ends.const_data_ptr<int>();
    const int v = pick_vec<scalar_t>(cols, {hp, bp});
    const dim3 grid = grid_for(rows * (cols / v), kThreads);
    with_vec(v, [&](auto vec) {
      seg_bias_act_kernel<scalar_t, decltype(vec)::value><<<grid, kThreads, 0, stream>>>(hp, bp, ep, S, El, rows, cols,
                                                                                        relu);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return h;
}

at::Tensor seg_colsum_cuda(const at::Tensor& g, const at::Tensor& ends, int64_t num_local) {
  check_seg_ends(g, ends, num_local, "seg_colsum", cuda_ok);
  const int64_t rows = g.size(0), cols = g.size(1), El = num_local, S = ends.numel();
  const c10::cuda::CUDAGuard guard(g.device());
  at::Tensor out = at::empty({El, cols}, g.options());
  if (cols == 0) return out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "seg_colsum_cuda", [&] {
    using opmath = at::opmath_type<scalar_t>;
    const int64_t K = sum_chunks(El, cols, sizeof(scalar_t));
    at::Tensor partial = at::empty({K, El, cols}, g.options().dtype(c10::CppTypeToScalarType<opmath>::value));
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const int* ep = ends.const_data_ptr<int>();
    opmath* pp = partial.mutable_data_ptr<opmath>();
    const int v = pick_vec<scalar_t>(cols, {gp});
    const dim3 grid(static_cast<unsigned>((cols / v + kSumThreads - 1) / kSumThreads), static_cast<unsigned>(El),
                    static_cast<unsigned>(K));
    with_vec(v, [&](auto vec) {
      seg_colsum_partial_kernel<scalar_t, decltype(vec)::value><<<grid, kSumThreads, 0, stream>>>(gp, ep, pp, S, El,
                                                                                                 rows, cols, K);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    constexpr int kThreads = 256;
    seg_colsum_finish_kernel<scalar_t><<<grid_for(El * cols, kThreads), kThreads, 0, stream>>>(
        pp, out.mutable_data_ptr<scalar_t>(), El * cols, K);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace moecomm_ext
