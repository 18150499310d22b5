// CUDA kernels of moecomm.quant: FP8 row quantization with per-block float32 scales, fused
// with the packing of a wire_dtype exchange (one pass over HBM each way).  Same functions,
// arguments and results as quant_cpu.cpp (see there and moecomm/quant.py for the rule):
//   quantize_rows, dequantize_rows, quantize_pack, unpack_dequantize, and
//   gather_quantize_pack: the MoE dispatch gather (moecomm_ext.reference.gather_rows: row m
//   is x[index[m]] * scale[m] rounded to x's dtype, zeros where index[m] == -1) and
//   quantize_pack in one pass: the gathered rows never go through HBM.
// The FP8 and bf16/fp16 conversions are c10's (round to nearest even, the ones torch's own
// casts use); the scale is a true IEEE division (nvcc's default -prec-div=true, no fast
// math), so results equal the CPU kernel's and the torch reference's bit for bit.
//
// Quantize: one warp per (row, block): the lanes stride over the block's elements, reduce
// |x| with shuffles, then each lane encodes its own elements; the warp of a row's last block
// also zeroes the packed row's padding.  Dequantize: one thread per element (rows along
// the grid's y).  Rows of a multiple of 8 elements, aligned (the packed layout, the layer's
// shapes), take the *_vec kernels: the same arithmetic, 8 elements per lane and access.

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

namespace moecomm_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__host__ __device__ inline int64_t num_blocks(int64_t d, int64_t block) { return (d + block - 1) / block; }
__host__ __device__ inline int64_t scale_offset(int64_t d) { return (d + 3) / 4 * 4; }

template <typename fp8_t>
struct Wire;
template <>
struct Wire<c10::Float8_e4m3fn> {
  static constexpr float kMax = 448.0f;
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E4M3;
};
template <>
struct Wire<c10::Float8_e5m2> {
  static constexpr float kMax = 57344.0f;
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E5M2;
};

// Two quotients as FP8 codes (low byte: a) by the hardware conversion (round to nearest
// even, saturating to the largest finite code). It equals c10's encoder wherever c10's
// result is finite: the quotients x / scale of a block stay within FP8_MAX * (1 + 2^-23),
// which both round to FP8_MAX. (Non-finite inputs are undefined: moecomm/quant.py.)
template <typename fp8_t>
__device__ __forceinline__ uint16_t encode2(float a, float b) {
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, Wire<fp8_t>::kKind));
}

// The codes of RN(a / scale) and RN(b / scale) (IEEE divisions) without dividing, as a rule:
// t = a * inv (inv = RN(1 / scale)) is within 2^-23 relative of a / scale, so within 3 float32
// steps of the rounded quotient (2.5 in one binade, 3 across a power of two), and encoding is
// monotonic: where the magnitudes 4 steps below and above t encode alike, that is the
// quotient's code. Elsewhere (a quotient within a few ulps of a rounding midpoint, about one
// element in 10^5) the division is done. FP8 is sign and magnitude: the sign bit comes from
// the value (-0 included).
template <typename fp8_t>
__device__ __forceinline__ uint16_t quantize2(float a, float b, float scale, float inv) {
  const uint32_t ua = __float_as_uint(a * inv) & 0x7FFFFFFFu, ub = __float_as_uint(b * inv) & 0x7FFFFFFFu;
  const uint16_t lo = encode2<fp8_t>(__uint_as_float(ua > 4u ? ua - 4u : 0u), __uint_as_float(ub > 4u ? ub - 4u : 0u));
  const uint16_t hi = encode2<fp8_t>(__uint_as_float(ua + 4u), __uint_as_float(ub + 4u));
  uint16_t mag = encode2<fp8_t>(__uint_as_float(ua), __uint_as_float(ub));
  if (lo != hi) mag = encode2<fp8_t>(fabsf(a) / scale, fabsf(b) / scale);
  const uint16_t sign = static_cast<uint16_t>(((__float_as_uint(a) >> 24) & 0x80u) | ((__float_as_uint(b) >> 16) & 0x8000u));
  return mag | sign;
}

// Element i of row r as quantized: x[r][i], or with `index` the gathered row's element
// (gather_rows: float(x) * scale in float32, rounded to scalar_t; 0 for index -1).
template <typename scalar_t>
__device__ __forceinline__ float source_value(const scalar_t* xr, const float* row_scale, int64_t r, int64_t i) {
  if (xr == nullptr) return 0.0f;
  if (row_scale == nullptr) return static_cast<float>(xr[i]);
  return static_cast<float>(static_cast<scalar_t>(static_cast<float>(xr[i]) * row_scale[r]));
}

// q row r at q + r * q_stride; its scales (float32) at s + r * s_stride (bytes; 4-aligned).
// pad_to > 0: packed rows of pad_to bytes whose gaps are zeroed. index (nullable): row r
// is x's row index[r] (none: zeros where -1), times row_scale[r] when row_scale is given.
template <typename scalar_t, typename fp8_t>
__global__ void __launch_bounds__(kThreads)
quantize_kernel(const scalar_t* __restrict__ x, int64_t n, int64_t d, int64_t block, uint8_t* __restrict__ q,
                int64_t q_stride, uint8_t* __restrict__ s, int64_t s_stride, int64_t pad_to,
                const int64_t* __restrict__ index, const float* __restrict__ row_scale) {
  const int lane = threadIdx.x & 31;
  const int64_t nb = num_blocks(d, block);
  const int64_t total = n * nb;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); w < total; w += step) {
    const int64_t r = w / nb, k = w - r * nb;
    const int64_t b0 = k * block, b1 = min(d, b0 + block);
    const int64_t src = index == nullptr ? r : index[r];
    const scalar_t* xr = src < 0 ? nullptr : x + src * d;
    float amax = 0.0f;
    for (int64_t i = b0 + lane; i < b1; i += 32) amax = fmaxf(amax, fabsf(source_value(xr, row_scale, r, i)));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float scale = amax == 0.0f ? 1.0f : amax / Wire<fp8_t>::kMax;
    uint8_t* qr = q + r * q_stride;
    for (int64_t i = b0 + lane; i < b1; i += 32) qr[i] = fp8_t(source_value(xr, row_scale, r, i) / scale).x;
    if (lane == 0) reinterpret_cast<float*>(s + r * s_stride)[k] = scale;
    if (pad_to > 0 && k == nb - 1) {
      const int64_t soff = scale_offset(d), send = soff + 4 * nb;
      for (int64_t i = d + lane; i < soff; i += 32) qr[i] = 0;
      for (int64_t i = send + lane; i < pad_to; i += 32) qr[i] = 0;
    }
  }
}

// Codes of 8 source values in v by the scale (the 8-wide kernels' rule).
template <typename fp8_t>
__device__ __forceinline__ uint2 quantize8(const float (&v)[8], float scale) {
  const bool normal = scale >= 1.17549435e-38f;  // and finite: amax is; 1 / scale is then finite too
  const float inv = 1.0f / scale;
  uint2 codes;
  uint16_t* c = reinterpret_cast<uint16_t*>(&codes);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    c[j] = normal ? quantize2<fp8_t>(v[2 * j], v[2 * j + 1], scale, inv)
                  : encode2<fp8_t>(v[2 * j] / scale, v[2 * j + 1] / scale);
  }
  return codes;
}

// The same two kernels for rows whose elements can be moved 8 at a time (D a multiple of 8,
// 16-byte aligned rows of x, 8-byte aligned rows of q: the packed layout and the layer's
// shapes): one half-warp per (row, block), each lane loading 8 elements with one or two
// 16-byte loads and storing its 8 codes with one 8-byte store. The arithmetic is the
// scalar kernels', element by element, but for the encoder (the hardware conversion, the same
// codes: encode2); the scalar kernels' 1-2 byte accesses kept them near 0.2x of a device
// copy on an H200.
template <typename scalar_t>
__device__ __forceinline__ void load8(const scalar_t* p, float (&v)[8]) {
  if constexpr (sizeof(scalar_t) == 2) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const scalar_t* e = reinterpret_cast<const scalar_t*>(&u);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(e[j]);
  } else if constexpr (sizeof(scalar_t) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(p[j]);
  }
}

template <typename scalar_t>
__device__ __forceinline__ void store8(scalar_t* p, const float (&v)[8]) {
  if constexpr (sizeof(scalar_t) == 2) {
    uint4 u;
    scalar_t* e = reinterpret_cast<scalar_t*>(&u);
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = static_cast<scalar_t>(v[j]);
    *reinterpret_cast<uint4*>(p) = u;
  } else if constexpr (sizeof(scalar_t) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) p[j] = static_cast<scalar_t>(v[j]);
  }
}

// Eight source values of row r from element i (as source_value: gathered and scaled, or 0).
template <typename scalar_t>
__device__ __forceinline__ void source8(const scalar_t* xr, const float* row_scale, int64_t r, int64_t i,
                                        float (&v)[8]) {
  if (xr == nullptr) {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = 0.0f;
    return;
  }
  load8(xr + i, v);
  if (row_scale != nullptr) {
    const float rs = row_scale[r];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(static_cast<scalar_t>(v[j] * rs));
  }
}

template <typename scalar_t, typename fp8_t>
__global__ void __launch_bounds__(kThreads)
quantize_vec_kernel(const scalar_t* __restrict__ x, int64_t n, int64_t d, int64_t block, uint8_t* __restrict__ q,
                    int64_t q_stride, uint8_t* __restrict__ s, int64_t s_stride, int64_t pad_to,
                    const int64_t* __restrict__ index, const float* __restrict__ row_scale) {
  const int lane = threadIdx.x & 15;  // within the half-warp
  const int64_t nb = num_blocks(d, block);
  const int64_t total = n * nb;
  // the two halves of a warp step together (their shuffles need every lane), each its own (row, block)
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t wp = warp; 2 * wp < total; wp += step) {
    const int64_t w = 2 * wp + ((threadIdx.x >> 4) & 1);
    const bool active = w < total;
    const int64_t r = active ? w / nb : 0, k = active ? w - r * nb : 0;
    const int64_t b0 = k * block, b1 = active ? min(d, b0 + block) : b0;
    const int64_t src = index == nullptr ? r : (active ? index[r] : -1);
    const scalar_t* xr = src < 0 ? nullptr : x + src * d;
    float v[8];
    float amax = 0.0f;
    for (int64_t i = b0 + 8 * lane; i < b1; i += 128) {
      source8(xr, row_scale, r, i, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (!active) continue;
    const float scale = amax == 0.0f ? 1.0f : amax / Wire<fp8_t>::kMax;
    uint8_t* qr = q + r * q_stride;
    for (int64_t i = b0 + 8 * lane; i < b1; i += 128) {
      source8(xr, row_scale, r, i, v);
      *reinterpret_cast<uint2*>(qr + i) = quantize8<fp8_t>(v, scale);
    }
    if (lane == 0) reinterpret_cast<float*>(s + r * s_stride)[k] = scale;
    if (pad_to > 0 && k == nb - 1) {
      const int64_t soff = scale_offset(d), send = soff + 4 * nb;
      for (int64_t i = d + lane; i < soff; i += 16) qr[i] = 0;
      for (int64_t i = send + lane; i < pad_to; i += 16) qr[i] = 0;
    }
  }
}

// The 8-wide quantize kernel for blocks of 128 elements (the wire's): a lane holds at most
// one 8-element chunk of a block, so each half-warp takes kItems (row, block) items at once,
// all its loads in flight together and the values kept in registers between the amax and
// the codes (one read of x). The kernel above, with one item per half-warp and a second
// read, stayed near 0.35x of a device copy on an H200: too little memory in flight.
constexpr int kItems = 4;

template <typename scalar_t, typename fp8_t>
__global__ void __launch_bounds__(kThreads)
quantize_b128_kernel(const scalar_t* __restrict__ x, int64_t n, int64_t d, uint8_t* __restrict__ q,
                     int64_t q_stride, uint8_t* __restrict__ s, int64_t s_stride, int64_t pad_to,
                     const int64_t* __restrict__ index, const float* __restrict__ row_scale) {
  constexpr int64_t kBlock = 128;
  const int lane = threadIdx.x & 15;
  const int half = (threadIdx.x >> 4) & 1;
  const int64_t nb = num_blocks(d, kBlock);
  const int64_t total = n * nb;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t wp = warp; 2 * kItems * wp < total; wp += step) {
    float v[kItems][8];
    float amax[kItems];
    int64_t row[kItems], blk[kItems];
    bool has[kItems];  // this lane holds a chunk of item u
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int64_t w = (2 * wp + half) * kItems + u;
      const bool active = w < total;
      row[u] = active ? w / nb : -1;
      blk[u] = active ? w - row[u] * nb : 0;
      const int64_t i = blk[u] * kBlock + 8 * lane;
      has[u] = active && i < d;
      const int64_t src = !has[u] ? -1 : (index == nullptr ? row[u] : index[row[u]]);
      source8(src < 0 ? nullptr : x + src * d, row_scale, row[u], i, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      amax[u] = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) amax[u] = fmaxf(amax[u], fabsf(v[u][j]));
    }
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) {
#pragma unroll
      for (int u = 0; u < kItems; ++u) amax[u] = fmaxf(amax[u], __shfl_xor_sync(0xffffffffu, amax[u], off));
    }
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      if (row[u] < 0) continue;
      const float scale = amax[u] == 0.0f ? 1.0f : amax[u] / Wire<fp8_t>::kMax;
      uint8_t* qr = q + row[u] * q_stride;
      const int64_t i = blk[u] * kBlock + 8 * lane;
      if (has[u]) *reinterpret_cast<uint2*>(qr + i) = quantize8<fp8_t>(v[u], scale);
      if (lane == 0) reinterpret_cast<float*>(s + row[u] * s_stride)[blk[u]] = scale;
      if (pad_to > 0 && blk[u] == nb - 1) {
        const int64_t soff = scale_offset(d), send = soff + 4 * nb;
        for (int64_t k = d + lane; k < soff; k += 16) qr[k] = 0;
        for (int64_t k = send + lane; k < pad_to; k += 16) qr[k] = 0;
      }
    }
  }
}

template <typename scalar_t, typename fp8_t>
__global__ void __launch_bounds__(kThreads)
dequantize_vec_kernel(const uint8_t* __restrict__ q, int64_t q_stride, const uint8_t* __restrict__ s,
                      int64_t s_stride, int64_t n, int64_t d, int64_t block, scalar_t* __restrict__ out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t chunks = d / 8;
  for (int64_t r = blockIdx.y; r < n; r += gridDim.y) {
    const float* sr = reinterpret_cast<const float*>(s + r * s_stride);
    const uint8_t* qr = q + r * q_stride;
    scalar_t* orow = out + r * d;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c < chunks; c += step) {
      const int64_t i = 8 * c;
      const uint2 codes = *reinterpret_cast<const uint2*>(qr + i);
      const uint8_t* cb = reinterpret_cast<const uint8_t*>(&codes);
      const float scale = sr[static_cast<int32_t>(i) / static_cast<int32_t>(block)];
      float v[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // every FP8 value is exact in half precision
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(cb[2 * j] | (cb[2 * j + 1] << 8)), Wire<fp8_t>::kKind);
        v[2 * j] = __half2float(__ushort_as_half(h.x)) * scale;
        v[2 * j + 1] = __half2float(__ushort_as_half(h.y)) * scale;
      }
      store8(orow + i, v);
    }
  }
}

template <typename scalar_t, typename fp8_t>
__global__ void __launch_bounds__(kThreads)
dequantize_kernel(const uint8_t* __restrict__ q, int64_t q_stride, const uint8_t* __restrict__ s, int64_t s_stride,
                  int64_t n, int64_t d, int64_t block, scalar_t* __restrict__ out) {
  // rows along y, a row's elements along x: no 64-bit division per element
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t r = blockIdx.y; r < n; r += gridDim.y) {
    const float* sr = reinterpret_cast<const float*>(s + r * s_stride);
    const uint8_t* qr = q + r * q_stride;
    scalar_t* orow = out + r * d;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < d; i += step) {
      const float v = static_cast<float>(fp8_t(qr[i], fp8_t::from_bits()));
      orow[i] = static_cast<scalar_t>(v * sr[static_cast<int32_t>(i) / static_cast<int32_t>(block)]);
    }
  }
}

int grid_for(int64_t items, int per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 65535 * 8));
}

void check_x(const at::Tensor& x, const char* fn) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), fn, ": 'x' must be a contiguous 2-D CUDA tensor");
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, fn,
              ": 'x' must be float32, bfloat16 or float16");
}

void check_wire_block(int64_t wire, int64_t block, const char* fn) {
  TORCH_CHECK(wire == 0 || wire == 1, fn, ": 'wire' must be 0 (e4m3fn) or 1 (e5m2)");
  TORCH_CHECK(block > 0 && block % 16 == 0, fn, ": 'block' must be a positive multiple of 16");
}

// n rows: x's (index null) or index's
// Whether rows of d elements of `elem` bytes at `x` (stride d) and their codes at `q` (stride
// q_stride) can be moved 8 elements at a time.
bool vector_rows(const void* x, int64_t d, int64_t elem, const void* q, int64_t q_stride) {
  return d % 8 == 0 && (d * elem) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         q_stride % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0;
}

void launch_quantize(const at::Tensor& x, int64_t n, int64_t wire, int64_t block, uint8_t* q, int64_t q_stride,
                     uint8_t* s, int64_t s_stride, int64_t pad_to, const int64_t* index = nullptr,
                     const float* row_scale = nullptr) {
  const int64_t d = x.size(1);
  const int grid = grid_for(n * num_blocks(d, block), kWarps);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = vector_rows(x.const_data_ptr(), d, x.element_size(), q, q_stride);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows_cuda", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    if (vec && block == 128) {
      const int bgrid = grid_for((n * num_blocks(d, block) + 2 * kItems - 1) / (2 * kItems), kWarps);
      if (wire == 0) {
        quantize_b128_kernel<scalar_t, c10::Float8_e4m3fn><<<bgrid, kThreads, 0, stream>>>(
            xp, n, d, q, q_stride, s, s_stride, pad_to, index, row_scale);
      } else {
        quantize_b128_kernel<scalar_t, c10::Float8_e5m2><<<bgrid, kThreads, 0, stream>>>(
            xp, n, d, q, q_stride, s, s_stride, pad_to, index, row_scale);
      }
    } else if (vec) {
      const int vgrid = grid_for((n * num_blocks(d, block) + 1) / 2, kWarps);
      if (wire == 0) {
        quantize_vec_kernel<scalar_t, c10::Float8_e4m3fn><<<vgrid, kThreads, 0, stream>>>(
            xp, n, d, block, q, q_stride, s, s_stride, pad_to, index, row_scale);
      } else {
        quantize_vec_kernel<scalar_t, c10::Float8_e5m2><<<vgrid, kThreads, 0, stream>>>(
            xp, n, d, block, q, q_stride, s, s_stride, pad_to, index, row_scale);
      }
    } else if (wire == 0) {
      quantize_kernel<scalar_t, c10::Float8_e4m3fn><<<grid, kThreads, 0, stream>>>(xp, n, d, block, q, q_stride, s,
                                                                                  s_stride, pad_to, index, row_scale);
    } else {
      quantize_kernel<scalar_t, c10::Float8_e5m2><<<grid, kThreads, 0, stream>>>(xp, n, d, block, q, q_stride, s,
                                                                                s_stride, pad_to, index, row_scale);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_dequantize(const uint8_t* q, int64_t q_stride, const uint8_t* s, int64_t s_stride, int64_t n, int64_t d,
                       int64_t wire, int64_t block, at::Tensor& out) {
  TORCH_CHECK(d < (int64_t(1) << 31), "dequantize_rows: rows of 2^31 elements or more are not supported");
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((d + kThreads - 1) / kThreads, 1024)),
                  static_cast<unsigned>(std::min<int64_t>(n, 65535)));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = vector_rows(out.const_data_ptr(), d, out.element_size(), q, q_stride);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_rows_cuda", [&] {
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    if (vec) {
      const dim3 vgrid(static_cast<unsigned>(std::min<int64_t>((d / 8 + kThreads - 1) / kThreads, 1024)),
                       static_cast<unsigned>(std::min<int64_t>(n, 65535)));
      if (wire == 0) {
        dequantize_vec_kernel<scalar_t, c10::Float8_e4m3fn><<<vgrid, kThreads, 0, stream>>>(q, q_stride, s, s_stride,
                                                                                          n, d, block, op);
      } else {
        dequantize_vec_kernel<scalar_t, c10::Float8_e5m2><<<vgrid, kThreads, 0, stream>>>(q, q_stride, s, s_stride,
                                                                                        n, d, block, op);
      }
    } else if (wire == 0) {
      dequantize_kernel<scalar_t, c10::Float8_e4m3fn><<<grid, kThreads, 0, stream>>>(q, q_stride, s, s_stride, n, d,
                                                                                    block, op);
    } else {
      dequantize_kernel<scalar_t, c10::Float8_e5m2><<<grid, kThreads, 0, stream>>>(q, q_stride, s, s_stride, n, d,
                                                                                  block, op);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_rows_cuda(const at::Tensor& x, int64_t wire, int64_t block) {
  check_x(x, "quantize_rows");
  check_wire_block(wire, block, "quantize_rows");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(0), d = x.size(1), nb = num_blocks(d, block);
  at::Tensor q = at::empty({n, d}, x.options().dtype(at::kByte));
  at::Tensor s = at::empty({n, nb}, x.options().dtype(at::kFloat));
  if (n == 0 || d == 0) return {q, s};
  launch_quantize(x, n, wire, block, q.mutable_data_ptr<uint8_t>(), d,
                  reinterpret_cast<uint8_t*>(s.mutable_data_ptr<float>()), 4 * nb, 0);
  return {q, s};
}

// out: [N, row_bytes] contiguous uint8 to write into, or none (allocated)
at::Tensor quantize_pack_cuda(const at::Tensor& x, int64_t wire, int64_t block, int64_t row_bytes,
                              const std::optional<at::Tensor>& out) {
  check_x(x, "quantize_pack");
  check_wire_block(wire, block, "quantize_pack");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(d == 0 ? row_bytes == 0 : (row_bytes >= scale_offset(d) + 4 * num_blocks(d, block) && row_bytes % 4 == 0),
              "quantize_pack: 'row_bytes' is too small for rows of D elements");
  TORCH_CHECK(!out.has_value() || (out->device() == x.device() && out->scalar_type() == at::kByte &&
                                   out->dim() == 2 && out->size(0) == n && out->size(1) == row_bytes &&
                                   out->is_contiguous()),
              "quantize_pack: 'out' must be a contiguous [N, row_bytes] uint8 tensor on x's device");
  at::Tensor p = out.has_value() ? *out : at::empty({n, row_bytes}, x.options().dtype(at::kByte));
  if (n == 0 || d == 0) return p;
  uint8_t* pp = p.mutable_data_ptr<uint8_t>();
  launch_quantize(x, n, wire, block, pp, row_bytes, pp + scale_offset(d), row_bytes, row_bytes);
  return p;
}

at::Tensor gather_quantize_pack_cuda(const at::Tensor& x, const at::Tensor& index,
                                     const std::optional<at::Tensor>& row_scale, int64_t wire, int64_t block,
                                     int64_t row_bytes) {
  check_x(x, "gather_quantize_pack");
  check_wire_block(wire, block, "gather_quantize_pack");
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(index.device() == x.device() && index.dim() == 1 && index.is_contiguous() &&
                  index.scalar_type() == at::kLong,
              "gather_quantize_pack: 'index' must be a contiguous 1-D int64 tensor on x's device");
  const int64_t m = index.size(0), d = x.size(1);
  const float* sp = nullptr;
  if (row_scale.has_value()) {
    const at::Tensor& rs = *row_scale;
    TORCH_CHECK(rs.device() == x.device() && rs.dim() == 1 && rs.size(0) == m && rs.is_contiguous() &&
                    rs.scalar_type() == at::kFloat,
                "gather_quantize_pack: 'scale' must be a contiguous float32 [M] tensor on x's device");
    sp = rs.const_data_ptr<float>();
  }
  TORCH_CHECK(d == 0 ? row_bytes == 0 : (row_bytes >= scale_offset(d) + 4 * num_blocks(d, block) && row_bytes % 4 == 0),
              "gather_quantize_pack: 'row_bytes' is too small for rows of D elements");
  at::Tensor p = at::empty({m, row_bytes}, x.options().dtype(at::kByte));
  if (m == 0 || d == 0) return p;
  uint8_t* pp = p.mutable_data_ptr<uint8_t>();
  launch_quantize(x, m, wire, block, pp, row_bytes, pp + scale_offset(d), row_bytes, row_bytes,
                  index.const_data_ptr<int64_t>(), sp);
  return p;
}

at::Tensor dequantize_rows_cuda(const at::Tensor& q, const at::Tensor& s, int64_t wire, int64_t block,
                                at::ScalarType dtype) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kByte,
              "dequantize_rows: 'q' must be a contiguous 2-D uint8 CUDA tensor");
  check_wire_block(wire, block, "dequantize_rows");
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t n = q.size(0), d = q.size(1), nb = num_blocks(d, block);
  TORCH_CHECK(s.device() == q.device() && s.is_contiguous() && s.scalar_type() == at::kFloat && s.dim() == 2 &&
                  s.size(0) == n && s.size(1) == nb,
              "dequantize_rows: 'scales' must be contiguous float32 of shape [N, ceil(D / block)] on q's device");
  at::Tensor out = at::empty({n, d}, q.options().dtype(dtype));
  if (n == 0 || d == 0) return out;
  launch_dequantize(q.const_data_ptr<uint8_t>(), d, reinterpret_cast<const uint8_t*>(s.const_data_ptr<float>()),
                    4 * nb, n, d, wire, block, out);
  return out;
}

at::Tensor unpack_dequantize_cuda(const at::Tensor& p, int64_t d, int64_t wire, int64_t block, at::ScalarType dtype,
                                  const std::optional<at::Tensor>& out_opt) {
  TORCH_CHECK(p.is_cuda() && p.dim() == 2 && p.is_contiguous() && p.scalar_type() == at::kByte,
              "unpack_dequantize: 'packed' must be a contiguous 2-D uint8 CUDA tensor");
  check_wire_block(wire, block, "unpack_dequantize");
  const c10::cuda::CUDAGuard guard(p.device());
  const int64_t n = p.size(0), row_bytes = p.size(1);
  TORCH_CHECK(d >= 0 && (d == 0 || (row_bytes >= scale_offset(d) + 4 * num_blocks(d, block) && row_bytes % 4 == 0)),
              "unpack_dequantize: the packed rows cannot hold D elements");
  at::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK(out.device() == p.device() && out.is_contiguous() && out.scalar_type() == dtype && out.dim() == 2 &&
                    out.size(0) == n && out.size(1) == d,
                "unpack_dequantize: 'out' must be a contiguous [N, D] tensor of the requested dtype on the rows' device");
  } else {
    out = at::empty({n, d}, p.options().dtype(dtype));
  }
  if (n == 0 || d == 0) return out;
  const uint8_t* pp = p.const_data_ptr<uint8_t>();
  launch_dequantize(pp, row_bytes, pp + scale_offset(d), row_bytes, n, d, wire, block, out);
  return out;
}

}  // namespace moecomm_ext
