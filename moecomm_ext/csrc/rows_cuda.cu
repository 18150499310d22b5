// CUDA row-gather kernels of moecomm_ext.
//
//   gather_rows(x[N,D], index[M] int64, scale[M] opmath?)      -> [M,D]  x.dtype
//   gather_reduce_rows(y[M,D], index[T,K] int64, weight[T,K]?) -> [T,D]  y.dtype
//   gather_rowdot(a[T,D], b[M,D], index[T,K] int64)            -> [T,K]  opmath
//
// opmath is float for float16/bfloat16/float32 and double for float64; all
// arithmetic happens in opmath (no fast-math).  Index -1 means "no row".
//
// Work split: a group of TPR consecutive lanes (TPR a power of two <= 32,
// the smallest that covers the row, so a warp per row for rows of >= 512 B)
// owns one output row (one (t, j) pair for gather_rowdot).  Rows are moved in
// 16-byte vectors when the row length and both base pointers allow it,
// otherwise in the widest width that does (8/4/2/1 bytes for the raw copy,
// one element for the typed kernels).  The Python wrapper checks the index
// range on the host; the kernels also trap on an out-of-range entry.

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace moecomm_ext {

namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int64_t kReduceGroups = 4096;  // lane groups gather_reduce_rows aims to keep busy

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Trap on an out-of-range index: never read outside the source tensor.
__device__ __forceinline__ void check_row(int64_t r, int64_t n) {
  if (r < -1 || r >= n) {
    __trap();
  }
}

inline int threads_per_row(int64_t row_vecs) {
  int tpr = 1;
  while (tpr < kWarp && tpr < row_vecs) tpr <<= 1;
  return tpr;
}

inline unsigned grid_for(int64_t items, int tpr) {
  const int64_t per_block = kThreads / tpr;
  int64_t blocks = (items + per_block - 1) / per_block;
  blocks = blocks < 1 ? 1 : blocks;
  const int64_t cap = int64_t(1) << 30;  // kernels are grid-stride loops
  return static_cast<unsigned>(blocks < cap ? blocks : cap);
}

inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(bytes) == 0;
}

// ---------------------------------------------------------------------------
// gather_rows without scale: raw copy in units of V (any dtype).
template <typename V, int UNROLL>
__global__ void __launch_bounds__(kThreads)
gather_copy_kernel(const V* __restrict__ src, V* __restrict__ dst,
                   const int64_t* __restrict__ index, int64_t M, int64_t N,
                   int64_t row_vecs, int tpr) {
  const int lane = threadIdx.x % tpr;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * (kThreads / tpr);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * (kThreads / tpr) + threadIdx.x / tpr; i < M;
       i += groups) {
    const int64_t r = index[i];
    check_row(r, N);
    V* d = dst + i * row_vecs;
    if (r < 0) {
      const V zero{};
      for (int64_t c = lane; c < row_vecs; c += tpr) d[c] = zero;
      continue;
    }
    const V* s = src + r * row_vecs;
    int64_t c = lane;
    for (; c + (UNROLL - 1) * tpr < row_vecs; c += UNROLL * tpr) {
      V tmp[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) tmp[u] = s[c + u * tpr];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) d[c + u * tpr] = tmp[u];
    }
    for (; c < row_vecs; c += tpr) d[c] = s[c];
  }
}

template <typename V>
void launch_copy(const at::Tensor& x, const at::Tensor& index, at::Tensor& out, int64_t row_bytes,
                 cudaStream_t stream) {
  const int64_t M = index.size(0), N = x.size(0);
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  const int tpr = threads_per_row(row_vecs);
  gather_copy_kernel<V, 4><<<grid_for(M, tpr), kThreads, 0, stream>>>(
      static_cast<const V*>(x.const_data_ptr()), static_cast<V*>(out.mutable_data_ptr()),
      index.const_data_ptr<int64_t>(), M, N, row_vecs, tpr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------
// gather_rows with scale: out[i] = x[index[i]] * scale[i] in opmath.
template <typename scalar_t, typename opmath_t, int VEC>
__global__ void __launch_bounds__(kThreads)
gather_scale_kernel(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst,
                    const int64_t* __restrict__ index, const opmath_t* __restrict__ scale,
                    int64_t M, int64_t N, int64_t row_vecs, int tpr) {
  using V = Vec<scalar_t, VEC>;
  const V* vsrc = reinterpret_cast<const V*>(src);
  V* vdst = reinterpret_cast<V*>(dst);
  const int lane = threadIdx.x % tpr;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * (kThreads / tpr);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * (kThreads / tpr) + threadIdx.x / tpr; i < M;
       i += groups) {
    const int64_t r = index[i];
    check_row(r, N);
    V* d = vdst + i * row_vecs;
    if (r < 0) {
      V zero;
#pragma unroll
      for (int e = 0; e < VEC; ++e) zero.v[e] = scalar_t(0);
      for (int64_t c = lane; c < row_vecs; c += tpr) d[c] = zero;
      continue;
    }
    const opmath_t w = scale[i];
    const V* s = vsrc + r * row_vecs;
    for (int64_t c = lane; c < row_vecs; c += 2 * tpr) {
      const bool two = c + tpr < row_vecs;
      V a = s[c];
      V b;
      if (two) b = s[c + tpr];
#pragma unroll
      for (int e = 0; e < VEC; ++e) a.v[e] = static_cast<scalar_t>(static_cast<opmath_t>(a.v[e]) * w);
      d[c] = a;
      if (two) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) b.v[e] = static_cast<scalar_t>(static_cast<opmath_t>(b.v[e]) * w);
        d[c + tpr] = b;
      }
    }
  }
}

template <typename scalar_t, int VEC>
void launch_scale(const at::Tensor& x, const at::Tensor& index, const at::Tensor& scale,
                  at::Tensor& out, cudaStream_t stream) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t M = index.size(0), N = x.size(0), D = x.size(1);
  const int64_t row_vecs = D / VEC;
  const int tpr = threads_per_row(row_vecs);
  gather_scale_kernel<scalar_t, opmath_t, VEC><<<grid_for(M, tpr), kThreads, 0, stream>>>(
      x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
      index.const_data_ptr<int64_t>(), scale.const_data_ptr<opmath_t>(), M, N, row_vecs, tpr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------
// gather_reduce_rows: out[t] = sum_j weight[t,j] * y[index[t,j]] in opmath.
template <typename scalar_t, typename opmath_t, int VEC>
__global__ void __launch_bounds__(kThreads)
gather_reduce_kernel(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst,
                     const int64_t* __restrict__ index, const opmath_t* __restrict__ weight,
                     int64_t T, int64_t K, int64_t M, int64_t row_vecs, int tpr, int64_t splits) {
  using V = Vec<scalar_t, VEC>;
  const V* vsrc = reinterpret_cast<const V*>(src);
  V* vdst = reinterpret_cast<V*>(dst);
  const int lane = threadIdx.x % tpr;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * (kThreads / tpr);
  // item = (row t, column split s): a split covers the vectors s * tpr + lane + k * tpr * splits
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * (kThreads / tpr) + threadIdx.x / tpr; item < T * splits;
       item += groups) {
    const int64_t t = item / splits, split = item % splits;
    const int64_t* idx = index + t * K;
    const opmath_t* wt = weight == nullptr ? nullptr : weight + t * K;
    for (int64_t j = lane; j < K; j += tpr) check_row(idx[j], M);
    for (int64_t c = split * tpr + lane; c < row_vecs; c += tpr * splits) {
      opmath_t acc[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = opmath_t(0);
      int64_t j = 0;
      // Two rows per step: two independent 16-byte loads in flight.
      for (; j + 1 < K; j += 2) {
        const int64_t r0 = idx[j], r1 = idx[j + 1];
        V v0, v1;
        if (r0 >= 0) v0 = vsrc[r0 * row_vecs + c];
        if (r1 >= 0) v1 = vsrc[r1 * row_vecs + c];
        if (r0 >= 0) {
          const opmath_t w0 = wt == nullptr ? opmath_t(1) : wt[j];
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] += w0 * static_cast<opmath_t>(v0.v[e]);
        }
        if (r1 >= 0) {
          const opmath_t w1 = wt == nullptr ? opmath_t(1) : wt[j + 1];
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] += w1 * static_cast<opmath_t>(v1.v[e]);
        }
      }
      if (j < K) {
        const int64_t r0 = idx[j];
        if (r0 >= 0) {
          const V v0 = vsrc[r0 * row_vecs + c];
          const opmath_t w0 = wt == nullptr ? opmath_t(1) : wt[j];
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] += w0 * static_cast<opmath_t>(v0.v[e]);
        }
      }
      V o;
#pragma unroll
      for (int e = 0; e < VEC; ++e) o.v[e] = static_cast<scalar_t>(acc[e]);
      vdst[t * row_vecs + c] = o;
    }
  }
}

template <typename scalar_t, int VEC>
void launch_reduce(const at::Tensor& y, const at::Tensor& index,
                   const std::optional<at::Tensor>& weight, at::Tensor& out, cudaStream_t stream) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t M = y.size(0), D = y.size(1), T = index.size(0), K = index.size(1);
  const int64_t row_vecs = D / VEC;
  const int tpr = threads_per_row(row_vecs);
  // Few wide rows (a decode batch) would leave most SMs idle with one group of lanes per row:
  // split each row's columns over groups until there are kReduceGroups of them (the sums per
  // element are the same: a split only changes which lanes compute which columns).
  const int64_t splits = std::max<int64_t>(
      1, std::min<int64_t>((row_vecs + tpr - 1) / tpr, (kReduceGroups + T - 1) / std::max<int64_t>(T, 1)));
  gather_reduce_kernel<scalar_t, opmath_t, VEC><<<grid_for(T * splits, tpr), kThreads, 0, stream>>>(
      y.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
      index.const_data_ptr<int64_t>(),
      weight.has_value() ? weight->const_data_ptr<opmath_t>() : nullptr, T, K, M, row_vecs, tpr, splits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------
// gather_rowdot: out[p] = dot(a[p / K], b[index[p]]) in opmath, p = t*K + j.
template <typename scalar_t, typename opmath_t, int VEC>
__global__ void __launch_bounds__(kThreads)
gather_rowdot_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                     const int64_t* __restrict__ index, opmath_t* __restrict__ out, int64_t P,
                     int64_t K, int64_t M, int64_t row_vecs, int tpr) {
  using V = Vec<scalar_t, VEC>;
  const V* va = reinterpret_cast<const V*>(a);
  const V* vb = reinterpret_cast<const V*>(b);
  const int lane = threadIdx.x % tpr;
  const int64_t per_block = kThreads / tpr;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * per_block;
  // The loop bound is uniform across each warp (all of its groups share
  // `base`), so every lane reaches the shuffles below.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * per_block; base < P; base += groups) {
    const int64_t p = base + threadIdx.x / tpr;
    opmath_t acc = opmath_t(0);
    int64_t r = -1;
    if (p < P) {
      r = index[p];
      check_row(r, M);
    }
    if (r >= 0) {
      const V* x = va + (p / K) * row_vecs;
      const V* z = vb + r * row_vecs;
      opmath_t part[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) part[e] = opmath_t(0);
      for (int64_t c = lane; c < row_vecs; c += tpr) {
        const V u = x[c];
        const V v = z[c];
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          part[e] += static_cast<opmath_t>(u.v[e]) * static_cast<opmath_t>(v.v[e]);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc += part[e];
    }
    for (int off = tpr / 2; off > 0; off >>= 1) {
      acc += __shfl_xor_sync(0xffffffffu, acc, off);
    }
    if (p < P && lane == 0) out[p] = acc;
  }
}

template <typename scalar_t, int VEC>
void launch_rowdot(const at::Tensor& a, const at::Tensor& b, const at::Tensor& index,
                   at::Tensor& out, cudaStream_t stream) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t D = a.size(1), M = b.size(0), K = index.size(1);
  const int64_t P = index.numel();
  const int64_t row_vecs = D / VEC;
  const int tpr = threads_per_row(row_vecs);
  gather_rowdot_kernel<scalar_t, opmath_t, VEC><<<grid_for(P, tpr), kThreads, 0, stream>>>(
      a.const_data_ptr<scalar_t>(), b.const_data_ptr<scalar_t>(), index.const_data_ptr<int64_t>(),
      out.mutable_data_ptr<opmath_t>(), P, K, M, row_vecs, tpr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_cuda(const at::Tensor& t, const char* fn, const char* name, int64_t dim,
                const at::Device& dev) {
  TORCH_CHECK(t.device() == dev, fn, ": '", name, "' must be on ", dev, ", got ", t.device());
  TORCH_CHECK(t.dim() == dim, fn, ": '", name, "' must be ", dim, "-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), fn, ": '", name, "' must be contiguous");
}

template <typename opmath_t>
void check_weight(const std::optional<at::Tensor>& w, const char* fn, const char* name,
                  at::IntArrayRef shape, const at::Device& dev) {
  if (!w.has_value()) return;
  check_cuda(*w, fn, name, static_cast<int64_t>(shape.size()), dev);
  TORCH_CHECK(w->sizes() == shape, fn, ": '", name, "' must have shape ", shape, ", got ",
              w->sizes());
  TORCH_CHECK(w->scalar_type() == c10::CppTypeToScalarType<opmath_t>::value, fn, ": '", name,
              "' must have dtype ", c10::CppTypeToScalarType<opmath_t>::value);
}

// Elements per 16-byte vector when the row length and pointers allow, else 1.
template <typename scalar_t>
int vec_width(int64_t D, std::initializer_list<const void*> ptrs) {
  constexpr int v = 16 / static_cast<int>(sizeof(scalar_t));
  if (v <= 1 || D % v != 0) return 1;
  for (const void* p : ptrs)
    if (!aligned(p, 16)) return 1;
  return v;
}

}  // namespace

at::Tensor gather_rows_cuda(const at::Tensor& x, const at::Tensor& index,
                            const std::optional<at::Tensor>& scale) {
  constexpr const char* fn = "gather_rows";
  TORCH_CHECK(x.is_cuda(), fn, ": 'x' must be a CUDA tensor");
  const at::Device dev = x.device();
  check_cuda(x, fn, "x", 2, dev);
  check_cuda(index, fn, "index", 1, dev);
  TORCH_CHECK(index.scalar_type() == at::kLong, fn, ": 'index' must be int64");
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t M = index.size(0), D = x.size(1);
  at::Tensor out = at::empty({M, D}, x.options());
  if (M == 0 || D == 0) return out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  if (!scale.has_value()) {
    const int64_t row_bytes = D * static_cast<int64_t>(x.element_size());
    const void* s = x.const_data_ptr();
    const void* d = out.const_data_ptr();
    auto fits = [&](int64_t w) { return row_bytes % w == 0 && aligned(s, w) && aligned(d, w); };
    if (fits(16)) {
      launch_copy<uint4>(x, index, out, row_bytes, stream);
    } else if (fits(8)) {
      launch_copy<uint2>(x, index, out, row_bytes, stream);
    } else if (fits(4)) {
      launch_copy<uint32_t>(x, index, out, row_bytes, stream);
    } else if (fits(2)) {
      launch_copy<uint16_t>(x, index, out, row_bytes, stream);
    } else {
      launch_copy<uint8_t>(x, index, out, row_bytes, stream);
    }
    return out;
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gather_rows_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    check_weight<opmath_t>(scale, fn, "scale", {M}, dev);
    constexpr int V = 16 / sizeof(scalar_t);
    if (vec_width<scalar_t>(D, {x.const_data_ptr(), out.const_data_ptr()}) == V) {
      launch_scale<scalar_t, V>(x, index, *scale, out, stream);
    } else {
      launch_scale<scalar_t, 1>(x, index, *scale, out, stream);
    }
  });
  return out;
}

at::Tensor gather_reduce_rows_into_cuda(const at::Tensor& y, const at::Tensor& index,
                                        const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& into);

at::Tensor gather_reduce_rows_cuda(const at::Tensor& y, const at::Tensor& index,
                                   const std::optional<at::Tensor>& weight) {
  return gather_reduce_rows_into_cuda(y, index, weight, std::nullopt);
}

// out: [T, D] contiguous of y's dtype to write into, or none (allocated)
at::Tensor gather_reduce_rows_into_cuda(const at::Tensor& y, const at::Tensor& index,
                                        const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& into) {
  constexpr const char* fn = "gather_reduce_rows";
  TORCH_CHECK(y.is_cuda(), fn, ": 'y' must be a CUDA tensor");
  const at::Device dev = y.device();
  check_cuda(y, fn, "y", 2, dev);
  check_cuda(index, fn, "index", 2, dev);
  TORCH_CHECK(index.scalar_type() == at::kLong, fn, ": 'index' must be int64");
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t D = y.size(1), T = index.size(0), K = index.size(1);
  at::Tensor out = into.has_value() ? *into : at::empty({T, D}, y.options());
  if (into.has_value()) {
    check_cuda(out, fn, "out", 2, dev);
    TORCH_CHECK(out.sizes() == at::IntArrayRef({T, D}) && out.scalar_type() == y.scalar_type(), fn,
                ": 'out' must be [", T, ", ", D, "] of ", y.scalar_type(), ", got ", out.sizes(), " of ",
                out.scalar_type());
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "gather_reduce_rows_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    check_weight<opmath_t>(weight, fn, "weight", {T, K}, dev);
    if (T == 0 || D == 0) return;
    constexpr int V = 16 / sizeof(scalar_t);
    if (vec_width<scalar_t>(D, {y.const_data_ptr(), out.const_data_ptr()}) == V) {
      launch_reduce<scalar_t, V>(y, index, weight, out, stream);
    } else {
      launch_reduce<scalar_t, 1>(y, index, weight, out, stream);
    }
  });
  return out;
}

at::Tensor gather_rowdot_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& index) {
  constexpr const char* fn = "gather_rowdot";
  TORCH_CHECK(a.is_cuda(), fn, ": 'a' must be a CUDA tensor");
  const at::Device dev = a.device();
  check_cuda(a, fn, "a", 2, dev);
  check_cuda(b, fn, "b", 2, dev);
  check_cuda(index, fn, "index", 2, dev);
  TORCH_CHECK(index.scalar_type() == at::kLong, fn, ": 'index' must be int64");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), fn, ": 'a' and 'b' must have the same dtype");
  TORCH_CHECK(a.size(1) == b.size(1), fn, ": 'a' and 'b' must have the same number of columns");
  TORCH_CHECK(index.size(0) == a.size(0), fn, ": 'index' must have ", a.size(0), " rows");
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t D = a.size(1), T = index.size(0), K = index.size(1);
  at::Tensor out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "gather_rowdot_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    out = at::empty({T, K}, a.options().dtype(c10::CppTypeToScalarType<opmath_t>::value));
    if (T * K == 0) return;
    if (D == 0) {
      out.zero_();
      return;
    }
    constexpr int V = 16 / sizeof(scalar_t);
    if (vec_width<scalar_t>(D, {a.const_data_ptr(), b.const_data_ptr()}) == V) {
      launch_rowdot<scalar_t, V>(a, b, index, out, stream);
    } else {
      launch_rowdot<scalar_t, 1>(a, b, index, out, stream);
    }
  });
  return out;
}

}  // namespace moecomm_ext
