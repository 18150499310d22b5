// moecomm.LowLatencyBuffer's dispatch kernels on the GPU (see lowlat.h).
//
// Positions must not depend on thread timing (the output is documented as source, then token
// order), so no atomics decide them. Both layouts run in one block that walks its rows in
// chunks of blockDim: a thread per row, warp ballots (source) or a warp-serial pass over the
// lanes (receiver) for the positions inside a warp, a prefix over the warps in shared memory,
// and a running base carried from chunk to chunk. The receiver's row copies then run in a grid
// (one block per received row). Nothing is read on the host: num_tokens stays on the device.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "lowlat.h"

namespace moecomm_ext {

namespace {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 256;  // the layout blocks (slots in registers: up to ~220 of them a thread)
constexpr int64_t kSharedInts = 12 * 1024;  // 48 KiB of shared memory: no opt-in needed

void cuda_ok(const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), "low-latency kernels: a CUDA tensor was expected, got one on ", t.device());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous(), "low-latency kernels: a contiguous ", dim,
              "-D tensor was expected, got sizes ", t.sizes(), " strides ", t.strides());
}

__device__ __forceinline__ int64_t load_id(const uint8_t* p, int id_bytes) {
  return id_bytes == 2 ? int64_t(*reinterpret_cast<const int16_t*>(p)) : int64_t(*reinterpret_cast<const int32_t*>(p));
}

__device__ __forceinline__ void store_id(uint8_t* p, int id_bytes, int64_t v) {
  if (id_bytes == 2) {
    *reinterpret_cast<int16_t*>(p) = static_cast<int16_t>(v);
  } else {
    *reinterpret_cast<int32_t*>(p) = static_cast<int32_t>(v);
  }
}

// Warps of a layout block: as many as a chunk needs, and as shared memory allows for
// `per_warp` ints per warp plus `per_warp` more (the running base).
int layout_warps(int64_t rows, int64_t per_warp) {
  int64_t warps = (rows + kWarp - 1) / kWarp;
  warps = warps < 1 ? 1 : (warps > kMaxThreads / kWarp ? kMaxThreads / kWarp : warps);
  const int64_t fit = kSharedInts / per_warp - 1;
  return static_cast<int>(warps < fit ? warps : fit);
}

// Items counted per warp (cnt[w * n + i]) become each warp's first position: the exclusive
// prefix over the warps on top of base[i], which moves on past them.
__device__ __forceinline__ void prefix_over_warps(int* base, int* cnt, int64_t n, int warps) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    int run = base[i];
    for (int w = 0; w < warps; ++w) {
      const int here = cnt[w * n + i];
      cnt[w * n + i] = run;
      run += here;
    }
    base[i] = run;
  }
}

// The kernels keep a token's (or row's) slots in registers: arrays of KMAX indexed only by
// unrolled slot loops (a k above 8 takes the KMAX = 32 instances).

// One block. Shared: base[W] (tokens placed per destination so far), then wtot[warps][W].
template <int KMAX>
__global__ void __launch_bounds__(kMaxThreads) layout_kernel(const int64_t* __restrict__ topk, int64_t T, const int64_t* __restrict__ num_tokens,
                              int64_t E, int W, int64_t L, int64_t M, int k, int64_t kk, uint8_t* __restrict__ staged,
                              int64_t row_bytes, int64_t id_offset, int id_bytes, int64_t* __restrict__ send_tok,
                              int64_t* __restrict__ bidx, int64_t* __restrict__ send_counts) {
  extern __shared__ int shared[];
  int* base = shared;
  int* wtot = shared + W;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  int64_t n = T;
  if (num_tokens != nullptr) {
    const int64_t v = *num_tokens;
    n = v < 0 ? 0 : (v < T ? v : T);
  }
  for (int64_t i = threadIdx.x; i < int64_t(W) * M; i += blockDim.x) send_tok[i] = M;
  for (int d = threadIdx.x; d < W; d += blockDim.x) base[d] = 0;
  __syncthreads();
  const unsigned lower = (1u << lane) - 1u;
  for (int64_t c0 = 0; c0 < M; c0 += blockDim.x) {
    const int64_t t = c0 + threadIdx.x;
    const bool active = t < M;
    int64_t v[KMAX];
    int dest[KMAX];        // the slot's destination rank, -1 for none
    bool rank_first[KMAX];  // the first slot naming its destination
    int pos[KMAX];         // (rank_first slots) the token's place in the destination's block
#pragma unroll
    for (int j = 0; j < KMAX; ++j) {
      const int64_t e = active && t < n && j < k ? topk[t * k + j] : -1;
      v[j] = e >= 0 && e < E ? e : -1;
      if (active && j < k) store_id(staged + t * row_bytes + id_offset + j * id_bytes, id_bytes, v[j]);
      dest[j] = v[j] >= 0 ? static_cast<int>(v[j] / L) : -1;
      pos[j] = 0;
    }
#pragma unroll
    for (int j = 0; j < KMAX; ++j) {
      rank_first[j] = dest[j] >= 0;
#pragma unroll
      for (int i = 0; i < j; ++i) rank_first[j] = rank_first[j] && dest[i] != dest[j];
    }
    for (int d = 0; d < W; ++d) {
      bool has = false;
#pragma unroll
      for (int j = 0; j < KMAX; ++j) has = has || (rank_first[j] && dest[j] == d);
      const unsigned ballot = __ballot_sync(0xffffffffu, has);
      const int before = __popc(ballot & lower);
#pragma unroll
      for (int j = 0; j < KMAX; ++j) pos[j] = rank_first[j] && dest[j] == d ? before : pos[j];
      if (lane == 0) wtot[warp * W + d] = __popc(ballot);
    }
    __syncthreads();
    prefix_over_warps(base, wtot, W, blockDim.x / kWarp);
    __syncthreads();
    if (active) {
#pragma unroll
      for (int j = 0; j < KMAX; ++j) {
        if (rank_first[j]) {
          pos[j] += wtot[warp * W + dest[j]];
          send_tok[int64_t(dest[j]) * M + pos[j]] = t;
        }
      }
      int first[KMAX];  // the first slot naming the same expert
#pragma unroll
      for (int j = 0; j < KMAX; ++j) {
        first[j] = j;
#pragma unroll
        for (int i = j - 1; i >= 0; --i) first[j] = v[i] == v[j] ? i : first[j];
      }
#pragma unroll
      for (int j = 0; j < KMAX; ++j) {
        if (j >= k) break;
        int64_t at = -1;
        if (v[j] >= 0) {
          int before = 0;  // distinct experts of the slot's rank whose first slot comes before this one's
          int p = 0;
#pragma unroll
          for (int i = 0; i < KMAX; ++i) {
            before += i < first[j] && v[i] >= 0 && first[i] == i && dest[i] == dest[j];
            p = rank_first[i] && dest[i] == dest[j] ? pos[i] : p;
          }
          at = int64_t(dest[j]) * M * kk + int64_t(p) * kk + before;
        }
        bidx[t * k + j] = at;
      }
    }
    __syncthreads();  // wtot is rewritten by the next chunk
  }
  if (send_counts != nullptr) {
    for (int d = threadIdx.x; d < W; d += blockDim.x) send_counts[d] = base[d];
  }
}

// Row r's slots that name a distinct expert of this rank (its first slot; at most kk of them),
// with their local expert numbers; returns how many.
// Whether received row r holds rows of its source (recv_counts: the rows each source sent;
// none: every row is there, unused ones with ids -1).
__device__ __forceinline__ bool row_sent(int64_t r, int64_t R, const int64_t* __restrict__ recv_counts, int W) {
  if (recv_counts == nullptr) return true;
  const int64_t per = R / W;
  return r % per < recv_counts[r / per];
}

template <int KMAX>
__device__ __forceinline__ int local_experts_of(const uint8_t* row, int64_t id_offset, int id_bytes, int k, int64_t lo,
                                                int64_t L, int64_t kk, bool sent, bool* take, int* le) {
  int64_t v[KMAX];
#pragma unroll
  for (int j = 0; j < KMAX; ++j) v[j] = sent && j < k ? load_id(row + id_offset + j * id_bytes, id_bytes) : -1;
  int n = 0;
#pragma unroll
  for (int j = 0; j < KMAX; ++j) {
    bool t = v[j] >= lo && v[j] < lo + L && n < kk;
#pragma unroll
    for (int i = 0; i < j; ++i) t = t && v[i] != v[j];
    take[j] = t;
    le[j] = t ? static_cast<int>(v[j] - lo) : 0;
    n += t;
  }
  return n;
}

// One block. Shared: base[L] (rows placed per expert so far), then wcnt[warps][L].
template <int KMAX>
__global__ void __launch_bounds__(kMaxThreads) place_layout_kernel(const uint8_t* __restrict__ recv, int64_t R, int64_t row_bytes, int64_t id_offset,
                                    int id_bytes, int k, int64_t rank, int64_t L, int64_t kk,
                                    int64_t* __restrict__ qic, int64_t* __restrict__ counts,
                                    const int64_t* __restrict__ recv_counts, int W) {
  extern __shared__ int shared[];
  int* base = shared;
  int* wcnt = shared + L;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  for (int64_t e = threadIdx.x; e < L; e += blockDim.x) base[e] = 0;
  for (int64_t c0 = 0; c0 < R; c0 += blockDim.x) {
    for (int64_t i = threadIdx.x; i < int64_t(warps) * L; i += blockDim.x) wcnt[i] = 0;
    __syncthreads();
    const int64_t r = c0 + threadIdx.x;
    bool take[KMAX];
    int le[KMAX];
    int local[KMAX];
    const int n = r < R ? local_experts_of<KMAX>(recv + r * row_bytes, id_offset, id_bytes, k, rank * L, L, kk,
                                                 row_sent(r, R, recv_counts, W), take, le)
                        : 0;
    if (r >= R) {
#pragma unroll
      for (int j = 0; j < KMAX; ++j) take[j] = false;
    }
#pragma unroll
    for (int j = 0; j < KMAX; ++j) local[j] = 0;
    for (int l = 0; l < kWarp; ++l) {  // the lanes in order: rows before r come first
      if (lane == l) {
#pragma unroll
        for (int j = 0; j < KMAX; ++j) {
          if (take[j]) local[j] = wcnt[warp * L + le[j]]++;
        }
      }
      __syncwarp();
    }
    __syncthreads();
    prefix_over_warps(base, wcnt, L, warps);
    __syncthreads();
    if (r < R) {
      int i = 0;
#pragma unroll
      for (int j = 0; j < KMAX; ++j) {
        if (take[j]) qic[r * kk + i++] = int64_t(le[j]) * R + wcnt[warp * L + le[j]] + local[j];
      }
      for (; i < kk; ++i) qic[r * kk + i] = 0;
      (void)n;
    }
    __syncthreads();  // wcnt is cleared by the next chunk
  }
  for (int64_t e = threadIdx.x; e < L; e += blockDim.x) counts[e] = base[e];
}

// Grid: one block per received row; copies `bytes` from byte `src_offset` of the row to each
// of its expert rows (dst rows of `bytes`), in units of V bytes (all offsets and sizes are
// multiples of V).
template <int KMAX, typename V>
__global__ void place_copy_kernel(const uint8_t* __restrict__ recv, int64_t R, int64_t row_bytes, int64_t id_offset,
                                  int id_bytes, int k, int64_t rank, int64_t L, int64_t kk,
                                  const int64_t* __restrict__ qic, uint8_t* __restrict__ dst, int64_t src_offset,
                                  int64_t bytes, const int64_t* __restrict__ recv_counts, int W) {
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const uint8_t* row = recv + r * row_bytes;
    bool take[KMAX];
    int le[KMAX];
    const int n = local_experts_of<KMAX>(row, id_offset, id_bytes, k, rank * L, L, kk, row_sent(r, R, recv_counts, W),
                                         take, le);
    __shared__ V* out[KMAX];
    __syncthreads();  // the previous row's destinations are read
    if (threadIdx.x < n) out[threadIdx.x] = reinterpret_cast<V*>(dst + qic[r * kk + threadIdx.x] * bytes);
    __syncthreads();
    const V* src = reinterpret_cast<const V*>(row + src_offset);
    const int64_t units = bytes / int64_t(sizeof(V));
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      const V value = src[u];
      for (int i = 0; i < n; ++i) out[i][u] = value;
    }
  }
}

struct alignas(8) Bytes8 {
  uint32_t a, b;
};

void launch_copy(const at::Tensor& recv, int64_t id_offset, int id_bytes, int k, int64_t rank, int64_t L, int64_t kk,
                 const at::Tensor& qic, const at::Tensor& out, int64_t src_offset, const int64_t* recv_counts, int W,
                 cudaStream_t stream) {
  const int64_t R = recv.size(0), row_bytes = recv.size(1);
  const int64_t bytes = out.size(1) * int64_t(out.element_size());
  if (R == 0 || bytes == 0) return;
  const uint8_t* src = recv.const_data_ptr<uint8_t>();
  uint8_t* dst = static_cast<uint8_t*>(out.mutable_data_ptr());
  auto fits = [&](int64_t a) {
    return reinterpret_cast<uintptr_t>(src) % a == 0 && reinterpret_cast<uintptr_t>(dst) % a == 0 &&
           row_bytes % a == 0 && src_offset % a == 0 && bytes % a == 0;
  };
  const int64_t widest = fits(16) ? 16 : fits(8) ? 8 : fits(4) ? 4 : fits(2) ? 2 : 1;
  const int64_t units = bytes / widest;
  const int threads = static_cast<int>(units >= 256 ? 256 : ((units + kWarp - 1) / kWarp) * kWarp);
  const unsigned grid = static_cast<unsigned>(R < (1 << 20) ? R : (1 << 20));
#define MOECOMM_LL_COPY(V)                                                                                        \
  if (k <= 8) {                                                                                                   \
    place_copy_kernel<8, V><<<grid, threads, 0, stream>>>(src, R, row_bytes, id_offset, id_bytes, k, rank, L, kk, \
                                                          qic.const_data_ptr<int64_t>(), dst, src_offset, bytes, recv_counts, W);\
  } else {                                                                                                        \
    place_copy_kernel<32, V><<<grid, threads, 0, stream>>>(src, R, row_bytes, id_offset, id_bytes, k, rank, L, kk,\
                                                           qic.const_data_ptr<int64_t>(), dst, src_offset, bytes, recv_counts, W);\
  }
  if (widest == 16) {
    MOECOMM_LL_COPY(uint4);
  } else if (widest == 8) {
    MOECOMM_LL_COPY(Bytes8);
  } else if (widest == 4) {
    MOECOMM_LL_COPY(uint32_t);
  } else if (widest == 2) {
    MOECOMM_LL_COPY(uint16_t);
  } else {
    MOECOMM_LL_COPY(uint8_t);
  }
#undef MOECOMM_LL_COPY
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void ll_dispatch_layout_cuda(const at::Tensor& topk_idx, const std::optional<at::Tensor>& num_tokens,
                             int64_t num_experts, int64_t world, int64_t kk, at::Tensor staged, int64_t id_offset,
                             int64_t id_bytes, at::Tensor send_tok, at::Tensor bidx,
                             const std::optional<at::Tensor>& send_counts) {
  check_ll_layout(topk_idx, num_tokens, num_experts, world, kk, staged, id_offset, id_bytes, send_tok, bidx,
                  send_counts, cuda_ok);
  for (const at::Tensor* t : {&staged, &send_tok, &bidx}) {
    TORCH_CHECK(t->device() == topk_idx.device(), "ll_dispatch_layout: every tensor must be on ", topk_idx.device());
  }
  const int64_t M = staged.size(0) - 1;
  if (M == 0) return;
  const int warps = layout_warps(M, world);
  TORCH_CHECK(warps >= 1, "ll_dispatch_layout: ", world, " ranks do not fit the layout kernel's shared memory");
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const size_t shared = size_t(warps + 1) * size_t(world) * sizeof(int);
  auto kernel = topk_idx.size(1) <= 8 ? layout_kernel<8> : layout_kernel<32>;
  kernel<<<1, warps * kWarp, shared, stream>>>(
      topk_idx.const_data_ptr<int64_t>(), topk_idx.size(0),
      num_tokens.has_value() ? num_tokens->const_data_ptr<int64_t>() : nullptr, num_experts, static_cast<int>(world),
      num_experts / world, M, static_cast<int>(topk_idx.size(1)), kk, staged.mutable_data_ptr<uint8_t>(),
      staged.size(1), id_offset, static_cast<int>(id_bytes), send_tok.mutable_data_ptr<int64_t>(),
      bidx.mutable_data_ptr<int64_t>(), send_counts.has_value() ? send_counts->mutable_data_ptr<int64_t>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void ll_dispatch_place_cuda(const at::Tensor& recv, int64_t id_offset, int64_t id_bytes, int64_t k, int64_t rank,
                            int64_t local_experts, at::Tensor out, int64_t src_offset,
                            const std::optional<at::Tensor>& out2, int64_t src_offset2, at::Tensor qic,
                            at::Tensor counts, const std::optional<at::Tensor>& recv_counts) {
  check_ll_place(recv, id_offset, id_bytes, k, rank, local_experts, out, src_offset, out2, src_offset2, qic, counts,
                 recv_counts, cuda_ok);
  for (const at::Tensor* t : {&out, &qic, &counts}) {
    TORCH_CHECK(t->device() == recv.device(), "ll_dispatch_place: every tensor must be on ", recv.device());
  }
  TORCH_CHECK(!out2.has_value() || out2->device() == recv.device(), "ll_dispatch_place: out2 must be on ",
              recv.device());
  const int64_t R = recv.size(0), L = local_experts, kk = qic.size(1);
  TORCH_CHECK(!recv_counts.has_value() || recv_counts->device() == recv.device(), "ll_dispatch_place: recv_counts "
              "must be on ", recv.device());
  const int64_t* sent = recv_counts.has_value() ? recv_counts->const_data_ptr<int64_t>() : nullptr;
  const int W = recv_counts.has_value() ? static_cast<int>(recv_counts->size(0)) : 1;
  const int warps = layout_warps(R, L);
  TORCH_CHECK(warps >= 1, "ll_dispatch_place: ", L, " local experts do not fit the layout kernel's shared memory");
  const c10::cuda::CUDAGuard guard(recv.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const size_t shared = size_t(warps + 1) * size_t(L) * sizeof(int);
  auto kernel = k <= 8 ? place_layout_kernel<8> : place_layout_kernel<32>;
  kernel<<<1, warps * kWarp, shared, stream>>>(
      recv.const_data_ptr<uint8_t>(), R, recv.size(1), id_offset, static_cast<int>(id_bytes), static_cast<int>(k),
      rank, L, kk, qic.mutable_data_ptr<int64_t>(), counts.mutable_data_ptr<int64_t>(), sent, W);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_copy(recv, id_offset, static_cast<int>(id_bytes), static_cast<int>(k), rank, L, kk, qic, out, src_offset,
              sent, W, stream);
  if (out2.has_value()) {
    launch_copy(recv, id_offset, static_cast<int>(id_bytes), static_cast<int>(k), rank, L, kk, qic, *out2,
                src_offset2, sent, W, stream);
  }
}

}  // namespace moecomm_ext
