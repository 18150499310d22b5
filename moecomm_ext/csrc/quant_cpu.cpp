// CPU kernels of moecomm.quant: FP8 row quantization with per-block float32 scales,
// fused with the packing of a wire_dtype exchange (one pass over the rows each way).
//
// The Python side (moecomm/quant.py) validates arguments; the TORCH_CHECKs only guard
// direct calls, with literal messages (see check_index).  The rule, per block of `block`
// elements of a row (the last may be shorter), is exactly moecomm.quant.quantize_rows_reference's:
//   amax = max |x| (float32);  scale = amax == 0 ? 1 : amax / FP8_MAX  (a true division)
//   q = fp8(x / scale) (c10's round-to-nearest-even conversion, the one torch's cast uses)
//   back: to(dtype)(float(q) * scale)
//
//   quantize_rows(x[N,D], wire, block)                 -> (q[N,D] uint8, scales[N,nb] float32)
//   dequantize_rows(q[N,D] uint8, scales, wire, block, dtype) -> [N,D] dtype
//   quantize_pack(x[N,D], wire, block, row_bytes)      -> [N,row_bytes] uint8
//   unpack_dequantize(p[N,row_bytes], D, wire, block, dtype, out?) -> [N,D] dtype (into out if given)
//   gather_quantize_pack(x[N,D], index[M], scale[M]?, wire, block, row_bytes) -> [M,row_bytes] uint8:
//     quantize_pack of moecomm_ext.reference.gather_rows(x, index, scale) (row m: x[index[m]],
//     times scale[m] in float32 rounded to x's dtype; zeros where index[m] == -1), in one pass
// wire: 0 = float8_e4m3fn, 1 = float8_e5m2.  Packed row: D fp8 bytes, zeros to a multiple
// of 4, nb float32 scales, zeros to row_bytes.

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGrainBytes = 64 * 1024;

int64_t num_blocks(int64_t d, int64_t block) { return (d + block - 1) / block; }
int64_t scale_offset(int64_t d) { return (d + 3) / 4 * 4; }

#define MOECOMM_INLINE inline __attribute__((always_inline))

MOECOMM_INLINE uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
MOECOMM_INLINE float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Built with -fno-trapping-math (moecomm_ext/_loader.py): GCC then computes both sides of
// the selects below and vectorizes the loops; no value changes (exceptions are not used).
// The conversions below are c10's (fp8e4m3fn_from_fp32_value, fp8e5m2_from_fp32_value, and
// the decoders), rewritten with selects instead of branches so that loops over them
// vectorize; tests/test_quant.py compares them with torch's casts.
struct E4M3 {
  static constexpr float kMax = 448.0f;
  // The encoder's constants, for the AVX-512 version (avx512::encode16) as well:
  static constexpr uint32_t kSubMagic = 141u << 23, kSubBelow = 121u << 23, kBigFrom = 1087u << 20;
  static constexpr uint32_t kRound = (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu, kShift = 20, kBig = 0x7Eu;
  // The decoder's: value bits = (code & 0x7F) << kShift, plus kNormalBias (normal) or
  // kSubBias minus kSubOffset as a float (subnormal: exact by Sterbenz).
  static constexpr uint32_t kNormalBias = 120u << 23, kSubBias = 121u << 23, kSubCodes = 8u;
  static constexpr float kSubOffset = 0x1p-6f;
  static MOECOMM_INLINE uint8_t encode(float f) {
    uint32_t b = f2u(f);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    const uint32_t sub = f2u(u2f(b) + u2f(kSubMagic)) - kSubMagic;
    const uint32_t normal = (b + kRound + ((b >> kShift) & 1u)) >> kShift;
    const uint32_t big = b > 0x7F800000u ? 0x7Fu : kBig;
    const uint32_t r = b >= kBigFrom ? big : (b < kSubBelow ? sub : normal);
    return static_cast<uint8_t>(r | (sign >> 24));
  }
  static MOECOMM_INLINE float decode(uint32_t c) {
    const uint32_t mag = c & 0x7Fu, e = mag >> 3, m = mag & 7u;
    const uint32_t normal = ((e + 120u) << 23) | (m << 20);
    const uint32_t sub = f2u(static_cast<float>(static_cast<int32_t>(m)) * 0x1p-9f);
    uint32_t v = e == 0 ? sub : normal;
    v = mag == 0x7Fu ? 0x7FC00000u : v;
    return u2f(v | ((c & 0x80u) << 24));
  }
};

struct E5M2 {
  static constexpr float kMax = 57344.0f;
  static constexpr uint32_t kSubMagic = 134u << 23, kSubBelow = 113u << 23, kBigFrom = 143u << 23;
  static constexpr uint32_t kRound = (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFFu, kShift = 21, kBig = 0x7Cu;
  static constexpr uint32_t kNormalBias = 112u << 23, kSubBias = 113u << 23, kSubCodes = 4u;
  static constexpr float kSubOffset = 0x1p-14f;
  static MOECOMM_INLINE uint8_t encode(float f) {
    uint32_t b = f2u(f);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    const uint32_t sub = f2u(u2f(b) + u2f(kSubMagic)) - kSubMagic;
    const uint32_t normal = (b + kRound + ((b >> kShift) & 1u)) >> kShift;
    const uint32_t big = b > (255u << 23) ? 0x7Fu : kBig;
    const uint32_t r = b >= kBigFrom ? big : (b < kSubBelow ? sub : normal);
    return static_cast<uint8_t>(r | (sign >> 24));
  }
  static MOECOMM_INLINE float decode(uint32_t c) {
    const uint32_t mag = c & 0x7Fu, e = mag >> 2, m = mag & 3u;
    const uint32_t normal = ((e + 112u) << 23) | (m << 21);
    const uint32_t sub = f2u(static_cast<float>(static_cast<int32_t>(m)) * 0x1p-16f);
    uint32_t v = e == 0 ? sub : normal;
    v = e == 31u ? (m == 0 ? 0x7F800000u : 0x7FC00000u) : v;
    return u2f(v | ((c & 0x80u) << 24));
  }
};

template <typename fp8_t>
using WireOf = std::conditional_t<std::is_same<fp8_t, c10::Float8_e4m3fn>::value, E4M3, E5M2>;

template <typename T>
MOECOMM_INLINE float load(const T* p, int64_t i) {
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    return u2f(static_cast<uint32_t>(p[i].x) << 16);
  } else {
    return static_cast<float>(p[i]);
  }
}

// |x| as bits: for non-NaN values their unsigned order is the order of the magnitudes
template <typename T>
MOECOMM_INLINE uint32_t abs_bits(const T* p, int64_t i) {
  if constexpr (std::is_same<T, float>::value) {
    uint32_t u;
    std::memcpy(&u, p + i, 4);
    return u & 0x7FFFFFFFu;
  } else if constexpr (std::is_same<T, c10::BFloat16>::value) {
    return (static_cast<uint32_t>(p[i].x) << 16) & 0x7FFFFFFFu;
  } else {
    return f2u(load(p, i)) & 0x7FFFFFFFu;
  }
}

template <typename T>
MOECOMM_INLINE void store(T* p, int64_t i, float v) {
  if constexpr (std::is_same<T, c10::BFloat16>::value) {  // c10's round_to_nearest_even
    const uint32_t u = f2u(v);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    p[i].x = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
  } else {
    p[i] = static_cast<T>(v);
  }
}

// One row: q bytes at q, nb scales at s (bytes; may be unaligned in packed rows).
template <typename scalar_t, typename W>
MOECOMM_INLINE void quantize_row_body(const scalar_t* x, int64_t d, int64_t block, uint8_t* q, uint8_t* s) {
  for (int64_t b0 = 0, k = 0; b0 < d; b0 += block, ++k) {
    const int64_t len = std::min(d - b0, block);
    const scalar_t* xb = x + b0;
    uint32_t amax_bits = 0;  // an integer max of |x|'s bits vectorizes where a float max does not
    for (int64_t i = 0; i < len; ++i) amax_bits = std::max(amax_bits, abs_bits(xb, i));
    const float amax = u2f(amax_bits);
    const float scale = amax == 0.0f ? 1.0f : amax / W::kMax;
    uint8_t* qb = q + b0;
    for (int64_t i = 0; i < len; ++i) qb[i] = W::encode(load(xb, i) / scale);
    std::memcpy(s + 4 * k, &scale, 4);
  }
}

template <typename scalar_t, typename W>
MOECOMM_INLINE void dequantize_row_body(const uint8_t* q, const uint8_t* s, int64_t d, int64_t block,
                                        scalar_t* out) {
  for (int64_t b0 = 0, k = 0; b0 < d; b0 += block, ++k) {
    const int64_t len = std::min(d - b0, block);
    float scale;
    std::memcpy(&scale, s + 4 * k, 4);
    const uint8_t* qb = q + b0;
    for (int64_t i = 0; i < len; ++i) store(out + b0, i, W::decode(qb[i]) * scale);
  }
}

// Each row function three times: for AVX-512 (explicit vectors below: what the compiler
// made of the loops above ran about half as fast) and for AVX2 (chosen at run time where the
// CPU has them) and for the baseline ISA. No FMA anywhere, so the arithmetic is the same.
#define MOECOMM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,prefer-vector-width=512")))
#if defined(__x86_64__)
namespace avx512 {

MOECOMM_AVX512 MOECOMM_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MOECOMM_AVX512 MOECOMM_INLINE __m512 load16(const c10::BFloat16* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
MOECOMM_AVX512 MOECOMM_INLINE __m512 load16(const c10::Half* p) {  // exact, as c10's conversion
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

MOECOMM_AVX512 MOECOMM_INLINE void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
MOECOMM_AVX512 MOECOMM_INLINE void store16(c10::BFloat16* p, __m512 v) {  // as store() above
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
MOECOMM_AVX512 MOECOMM_INLINE void store16(c10::Half* p, __m512 v) {  // IEEE round to nearest even
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// W::encode on 16 lanes
template <typename W>
MOECOMM_AVX512 MOECOMM_INLINE __m128i encode16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i b = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i magic = _mm512_set1_epi32(static_cast<int>(W::kSubMagic));
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(b), _mm512_castsi512_ps(magic))), magic);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, W::kShift), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(static_cast<int>(W::kRound))), lsb), W::kShift);
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(b, _mm512_set1_epi32(static_cast<int>(W::kSubBelow)));
  const __mmask16 is_big = _mm512_cmpge_epu32_mask(b, _mm512_set1_epi32(static_cast<int>(W::kBigFrom)));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(b, _mm512_set1_epi32(0x7F800000));
  __m512i r = _mm512_mask_blend_epi32(is_sub, normal, sub);
  r = _mm512_mask_blend_epi32(is_big, r, _mm512_set1_epi32(static_cast<int>(W::kBig)));
  r = _mm512_mask_blend_epi32(is_nan, r, _mm512_set1_epi32(0x7F));
  r = _mm512_or_si512(r, _mm512_srli_epi32(_mm512_andnot_si512(_mm512_set1_epi32(0x7FFFFFFF), bits), 24));
  return _mm512_cvtepi32_epi8(r);
}

// W::decode on 16 codes
template <typename W>
MOECOMM_AVX512 MOECOMM_INLINE __m512 decode16(__m128i codes) {
  const __m512i c = _mm512_cvtepu8_epi32(codes);
  const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
  const __m512i sh = _mm512_slli_epi32(mag, W::kShift);
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(sh, _mm512_set1_epi32(static_cast<int>(W::kNormalBias))));
  const __m512 sub = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_add_epi32(sh, _mm512_set1_epi32(static_cast<int>(W::kSubBias)))),
                                   _mm512_set1_ps(W::kSubOffset));
  __m512 v = _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(static_cast<int>(W::kSubCodes))),
                                  normal, sub);
  if constexpr (std::is_same<W, E4M3>::value) {
    v = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), v,
                             _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  } else {
    v = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7C)), v,
                             _mm512_castsi512_ps(_mm512_set1_epi32(0x7F800000)));
    v = _mm512_mask_blend_ps(_mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7C)), v,
                             _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  }
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

template <typename T>
constexpr bool kVectorized = std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value ||
                             std::is_same<T, c10::Half>::value;  // (double is dispatched, never called)

}  // namespace avx512

template <typename scalar_t, typename W>
MOECOMM_AVX512 void quantize_row_avx512(const scalar_t* x, int64_t d, int64_t block, uint8_t* q, uint8_t* s) {
  if constexpr (!avx512::kVectorized<scalar_t>) {
    quantize_row_body<scalar_t, W>(x, d, block, q, s);
    return;
  } else {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  for (int64_t b0 = 0, k = 0; b0 < d; b0 += block, ++k) {
    const int64_t len = std::min(d - b0, block), full = len & ~int64_t{15};
    const scalar_t* xb = x + b0;
    __m512i m = _mm512_setzero_si512();
    for (int64_t i = 0; i < full; i += 16) {
      m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(avx512::load16(xb + i)), abs_mask));
    }
    uint32_t amax_bits = _mm512_reduce_max_epu32(m);
    for (int64_t i = full; i < len; ++i) amax_bits = std::max(amax_bits, abs_bits(xb, i));
    const float amax = u2f(amax_bits);
    const float scale = amax == 0.0f ? 1.0f : amax / W::kMax;
    const __m512 vscale = _mm512_set1_ps(scale);
    uint8_t* qb = q + b0;
    for (int64_t i = 0; i < full; i += 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + i),
                       avx512::encode16<W>(_mm512_div_ps(avx512::load16(xb + i), vscale)));
    }
    for (int64_t i = full; i < len; ++i) qb[i] = W::encode(load(xb, i) / scale);
    std::memcpy(s + 4 * k, &scale, 4);
  }
  }
}
template <typename scalar_t, typename W>
MOECOMM_AVX512 void dequantize_row_avx512(const uint8_t* q, const uint8_t* s, int64_t d, int64_t block,
                                          scalar_t* out) {
  if constexpr (!avx512::kVectorized<scalar_t>) {
    dequantize_row_body<scalar_t, W>(q, s, d, block, out);
    return;
  } else {
  for (int64_t b0 = 0, k = 0; b0 < d; b0 += block, ++k) {
    const int64_t len = std::min(d - b0, block), full = len & ~int64_t{15};
    float scale;
    std::memcpy(&scale, s + 4 * k, 4);
    const __m512 vscale = _mm512_set1_ps(scale);
    const uint8_t* qb = q + b0;
    for (int64_t i = 0; i < full; i += 16) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + i));
      avx512::store16(out + b0 + i, _mm512_mul_ps(avx512::decode16<W>(codes), vscale));
    }
    for (int64_t i = full; i < len; ++i) store(out + b0, i, W::decode(qb[i]) * scale);
  }
  }
}
#else
template <typename scalar_t, typename W>
void quantize_row_avx512(const scalar_t* x, int64_t d, int64_t block, uint8_t* q, uint8_t* s) {
  quantize_row_body<scalar_t, W>(x, d, block, q, s);
}
template <typename scalar_t, typename W>
void dequantize_row_avx512(const uint8_t* q, const uint8_t* s, int64_t d, int64_t block, scalar_t* out) {
  dequantize_row_body<scalar_t, W>(q, s, d, block, out);
}
#endif
template <typename scalar_t, typename W>
__attribute__((target("avx2"))) void quantize_row_avx2(const scalar_t* x, int64_t d, int64_t block, uint8_t* q,
                                                       uint8_t* s) {
  quantize_row_body<scalar_t, W>(x, d, block, q, s);
}
template <typename scalar_t, typename W>
void quantize_row_base(const scalar_t* x, int64_t d, int64_t block, uint8_t* q, uint8_t* s) {
  quantize_row_body<scalar_t, W>(x, d, block, q, s);
}
template <typename scalar_t, typename W>
__attribute__((target("avx2"))) void dequantize_row_avx2(const uint8_t* q, const uint8_t* s, int64_t d,
                                                         int64_t block, scalar_t* out) {
  dequantize_row_body<scalar_t, W>(q, s, d, block, out);
}
template <typename scalar_t, typename W>
void dequantize_row_base(const uint8_t* q, const uint8_t* s, int64_t d, int64_t block, scalar_t* out) {
  dequantize_row_body<scalar_t, W>(q, s, d, block, out);
}

// 2: AVX-512 (F, BW, VL), 1: AVX2, 0: neither.
int simd_level() {
#if defined(__x86_64__) || defined(__i386__)
  static const int level = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl")) ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
  return level;
#else
  return 0;
#endif
}

void check_x(const at::Tensor& x, const char* fn) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), fn,
              ": 'x' must be a contiguous 2-D CPU tensor");
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, fn,
              ": 'x' must be float32, bfloat16 or float16");
}

void check_wire_block(int64_t wire, int64_t block, const char* fn) {
  TORCH_CHECK(wire == 0 || wire == 1, fn, ": 'wire' must be 0 (e4m3fn) or 1 (e5m2)");
  TORCH_CHECK(block > 0 && block % 16 == 0, fn, ": 'block' must be a positive multiple of 16");
}

// Runs f(row) for every row in parallel, with a grain of about kGrainBytes.
template <typename F>
void for_rows(int64_t n, int64_t row_bytes, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

template <typename fp8_t>
void quantize_into(const at::Tensor& x, int64_t block, uint8_t* q, int64_t q_stride, uint8_t* s,
                   int64_t s_stride, int64_t pad_to) {
  using W = WireOf<fp8_t>;
  const int64_t n = x.size(0), d = x.size(1);
  const int64_t nb = num_blocks(d, block), soff = scale_offset(d);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int level = simd_level();
    const auto row_fn = level == 2 ? &quantize_row_avx512<scalar_t, W>
                        : level == 1 ? &quantize_row_avx2<scalar_t, W> : &quantize_row_base<scalar_t, W>;
    for_rows(n, d * static_cast<int64_t>(sizeof(scalar_t)), [&](int64_t r) {
      uint8_t* qr = q + r * q_stride;
      row_fn(xp + r * d, d, block, qr, s + r * s_stride);
      if (pad_to > 0) {  // packed row: zero the gaps, so that no stale byte is ever sent
        std::memset(qr + d, 0, soff - d);
        std::memset(qr + soff + 4 * nb, 0, pad_to - soff - 4 * nb);
      }
    });
  });
}

template <typename fp8_t>
void dequantize_into(const uint8_t* q, int64_t q_stride, const uint8_t* s, int64_t s_stride, int64_t n,
                     int64_t d, int64_t block, at::Tensor& out) {
  using W = WireOf<fp8_t>;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_rows", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    const int level = simd_level();
    const auto row_fn = level == 2 ? &dequantize_row_avx512<scalar_t, W>
                        : level == 1 ? &dequantize_row_avx2<scalar_t, W> : &dequantize_row_base<scalar_t, W>;
    for_rows(n, d * static_cast<int64_t>(sizeof(scalar_t)), [&](int64_t r) {
      row_fn(q + r * q_stride, s + r * s_stride, d, block, op + r * d);
    });
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t wire, int64_t block) {
  check_x(x, "quantize_rows");
  check_wire_block(wire, block, "quantize_rows");
  const int64_t n = x.size(0), d = x.size(1), nb = num_blocks(d, block);
  at::Tensor q = at::empty({n, d}, x.options().dtype(at::kByte));
  at::Tensor s = at::empty({n, nb}, x.options().dtype(at::kFloat));
  if (n == 0 || d == 0) return {q, s};
  auto* qp = q.data_ptr<uint8_t>();
  auto* sp = reinterpret_cast<uint8_t*>(s.data_ptr<float>());
  if (wire == 0) {
    quantize_into<c10::Float8_e4m3fn>(x, block, qp, d, sp, 4 * nb, 0);
  } else {
    quantize_into<c10::Float8_e5m2>(x, block, qp, d, sp, 4 * nb, 0);
  }
  return {q, s};
}

// out: [N, row_bytes] contiguous uint8 to write into, or none (allocated)
at::Tensor quantize_pack(const at::Tensor& x, int64_t wire, int64_t block, int64_t row_bytes,
                         const std::optional<at::Tensor>& out) {
  check_x(x, "quantize_pack");
  check_wire_block(wire, block, "quantize_pack");
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(d == 0 ? row_bytes == 0 : row_bytes >= scale_offset(d) + 4 * num_blocks(d, block),
              "quantize_pack: 'row_bytes' is too small for rows of D elements");
  TORCH_CHECK(!out.has_value() || (out->device() == x.device() && out->scalar_type() == at::kByte &&
                                   out->dim() == 2 && out->size(0) == n && out->size(1) == row_bytes &&
                                   out->is_contiguous()),
              "quantize_pack: 'out' must be a contiguous [N, row_bytes] uint8 tensor on x's device");
  at::Tensor p = out.has_value() ? *out : at::empty({n, row_bytes}, x.options().dtype(at::kByte));
  if (n == 0 || d == 0) return p;
  auto* pp = p.data_ptr<uint8_t>();
  if (wire == 0) {
    quantize_into<c10::Float8_e4m3fn>(x, block, pp, row_bytes, pp + scale_offset(d), row_bytes, row_bytes);
  } else {
    quantize_into<c10::Float8_e5m2>(x, block, pp, row_bytes, pp + scale_offset(d), row_bytes, row_bytes);
  }
  return p;
}

template <typename fp8_t>
void gather_quantize_into(const at::Tensor& x, const int64_t* index, const float* row_scale, int64_t m,
                          int64_t block, uint8_t* p, int64_t row_bytes) {
  using W = WireOf<fp8_t>;
  const int64_t d = x.size(1), nb = num_blocks(d, block), soff = scale_offset(d);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gather_quantize_pack", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int level = simd_level();
    const auto row_fn = level == 2 ? &quantize_row_avx512<scalar_t, W>
                        : level == 1 ? &quantize_row_avx2<scalar_t, W> : &quantize_row_base<scalar_t, W>;
    const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, d * static_cast<int64_t>(sizeof(scalar_t))));
    at::parallel_for(0, m, grain, [&](int64_t r0, int64_t r1) {
      std::vector<scalar_t> row(d);  // a scaled or a missing row
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t src = index[r];  // in [-1, N): checked before the parallel section
        const scalar_t* xr = xp + src * d;
        if (src < 0) {
          std::fill(row.begin(), row.end(), static_cast<scalar_t>(0.0f));
          xr = row.data();
        } else if (row_scale != nullptr) {
          for (int64_t i = 0; i < d; ++i) store(row.data(), i, load(xr, i) * row_scale[r]);
          xr = row.data();
        }
        uint8_t* pr = p + r * row_bytes;
        row_fn(xr, d, block, pr, pr + soff);
        std::memset(pr + d, 0, soff - d);
        std::memset(pr + soff + 4 * nb, 0, row_bytes - soff - 4 * nb);
      }
    });
  });
}

// Every index in [-1, n), checked before the kernel (moecomm.quant checks them first, naming
// the values). The messages of this file's checks hold no formatted numbers: built by g++ 13
// against torch 2.11 (the GPU machine), formatting an integer into a TORCH_CHECK message
// crashed the process (SIGSEGV) where literal messages raise as they should (session 10).
void check_index(const int64_t* index, int64_t m, int64_t n) {
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(index[r] >= -1 && index[r] < n, "gather_quantize_pack: 'index' has entries outside [-1, N)");
  }
}

at::Tensor gather_quantize_pack(const at::Tensor& x, const at::Tensor& index, const std::optional<at::Tensor>& scale,
                                int64_t wire, int64_t block, int64_t row_bytes) {
  check_x(x, "gather_quantize_pack");
  check_wire_block(wire, block, "gather_quantize_pack");
  TORCH_CHECK(index.device().is_cpu() && index.dim() == 1 && index.is_contiguous() && index.scalar_type() == at::kLong,
              "gather_quantize_pack: 'index' must be a contiguous 1-D int64 CPU tensor");
  const int64_t m = index.size(0), d = x.size(1);
  const float* sp = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->device().is_cpu() && scale->dim() == 1 && scale->size(0) == m && scale->is_contiguous() &&
                    scale->scalar_type() == at::kFloat,
                "gather_quantize_pack: 'scale' must be a contiguous float32 [M] CPU tensor");
    sp = scale->data_ptr<float>();
  }
  TORCH_CHECK(d == 0 ? row_bytes == 0 : row_bytes >= scale_offset(d) + 4 * num_blocks(d, block),
              "gather_quantize_pack: 'row_bytes' is too small for rows of D elements");
  at::Tensor p = at::empty({m, row_bytes}, x.options().dtype(at::kByte));
  if (m == 0 || d == 0) return p;
  const int64_t* ip = index.data_ptr<int64_t>();
  check_index(ip, m, x.size(0));
  if (wire == 0) {
    gather_quantize_into<c10::Float8_e4m3fn>(x, ip, sp, m, block, p.data_ptr<uint8_t>(), row_bytes);
  } else {
    gather_quantize_into<c10::Float8_e5m2>(x, ip, sp, m, block, p.data_ptr<uint8_t>(), row_bytes);
  }
  return p;
}

at::Tensor dequantize_rows(const at::Tensor& q, const at::Tensor& s, int64_t wire, int64_t block,
                           at::ScalarType dtype) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kByte,
              "dequantize_rows: 'q' must be a contiguous 2-D uint8 CPU tensor");
  check_wire_block(wire, block, "dequantize_rows");
  const int64_t n = q.size(0), d = q.size(1), nb = num_blocks(d, block);
  TORCH_CHECK(s.device().is_cpu() && s.is_contiguous() && s.scalar_type() == at::kFloat && s.dim() == 2 &&
                  s.size(0) == n && s.size(1) == nb,
              "dequantize_rows: 'scales' must be contiguous float32 of shape [N, ceil(D / block)]");
  at::Tensor out = at::empty({n, d}, q.options().dtype(dtype));
  if (n == 0 || d == 0) return out;
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint8_t*>(s.data_ptr<float>());
  if (wire == 0) {
    dequantize_into<c10::Float8_e4m3fn>(qp, d, sp, 4 * nb, n, d, block, out);
  } else {
    dequantize_into<c10::Float8_e5m2>(qp, d, sp, 4 * nb, n, d, block, out);
  }
  return out;
}

at::Tensor unpack_dequantize(const at::Tensor& p, int64_t d, int64_t wire, int64_t block, at::ScalarType dtype,
                             const std::optional<at::Tensor>& out_opt) {
  TORCH_CHECK(p.device().is_cpu() && p.dim() == 2 && p.is_contiguous() && p.scalar_type() == at::kByte,
              "unpack_dequantize: 'packed' must be a contiguous 2-D uint8 CPU tensor");
  check_wire_block(wire, block, "unpack_dequantize");
  const int64_t n = p.size(0), row_bytes = p.size(1);
  TORCH_CHECK(d >= 0 && (d == 0 || row_bytes >= scale_offset(d) + 4 * num_blocks(d, block)),
              "unpack_dequantize: the packed rows cannot hold D elements");
  at::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == dtype && out.dim() == 2 &&
                    out.size(0) == n && out.size(1) == d,
                "unpack_dequantize: 'out' must be a contiguous [N, D] CPU tensor of the requested dtype");
  } else {
    out = at::empty({n, d}, p.options().dtype(dtype));
  }
  if (n == 0 || d == 0) return out;
  const auto* pp = p.data_ptr<uint8_t>();
  if (wire == 0) {
    dequantize_into<c10::Float8_e4m3fn>(pp, row_bytes, pp + scale_offset(d), row_bytes, n, d, block, out);
  } else {
    dequantize_into<c10::Float8_e5m2>(pp, row_bytes, pp + scale_offset(d), row_bytes, n, d, block, out);
  }
  return out;
}

}  // namespace

#include "source_hash.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("source_hash") = MOECOMM_EXT_SOURCE_HASH_STR;
  m.doc() = "moecomm_ext CPU FP8 row quantization (moecomm.quant)";
  m.def("quantize_rows", &quantize_rows, "(q uint8 [N,D], scales float32 [N,nb])", py::arg("x"),
        py::arg("wire"), py::arg("block"));
  m.def("gather_quantize_pack", &gather_quantize_pack, "[M,row_bytes] uint8: the rows x[index] (* scale) packed",
        py::arg("x"), py::arg("index"), py::arg("scale"), py::arg("wire"), py::arg("block"), py::arg("row_bytes"));
  m.def("dequantize_rows", &dequantize_rows, "[N,D] dtype from q uint8 and scales", py::arg("q"),
        py::arg("scales"), py::arg("wire"), py::arg("block"), py::arg("dtype"));
  m.def("quantize_pack", &quantize_pack, "[N,row_bytes] uint8 packed rows", py::arg("x"), py::arg("wire"),
        py::arg("block"), py::arg("row_bytes"), py::arg("out") = py::none());
  m.def("unpack_dequantize", &unpack_dequantize, "[N,D] dtype from packed rows", py::arg("packed"),
        py::arg("d"), py::arg("wire"), py::arg("block"), py::arg("dtype"), py::arg("out") = py::none());
  m.attr("device_type") = "cpu";
}
