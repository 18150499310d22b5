// CPU kernels of moecomm.quant: FP8 row quantization with per-block float32 scales,
// fused with the packing of a wire_dtype exchange (one pass over the rows each way).
//
// The Python side (moecomm/quant.py) validates arguments; the TORCH_CHECKs only guard
// direct calls.  The rule, per block of `block` elements of a row (the last may be
// shorter), is exactly moecomm.quant.quantize_rows_reference's:
//   amax = max |x| (float32);  scale = amax == 0 ? 1 : amax / FP8_MAX  (a true division)
//   q = fp8(x / scale) (c10's round-to-nearest-even conversion, the one torch's cast uses)
//   back: to(dtype)(float(q) * scale)
//
//   quantize_rows(x[N,D], wire, block)                 -> (q[N,D] uint8, scales[N,nb] float32)
//   dequantize_rows(q[N,D] uint8, scales, wire, block, dtype) -> [N,D] dtype
//   quantize_pack(x[N,D], wire, block, row_bytes)      -> [N,row_bytes] uint8
//   unpack_dequantize(p[N,row_bytes], D, wire, block, dtype, out?) -> [N,D] dtype (into out if given)
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

namespace {

constexpr int64_t kGrainBytes = 64 * 1024;

int64_t num_blocks(int64_t d, int64_t block) { return (d + block - 1) / block; }
int64_t scale_offset(int64_t d) { return (d + 3) / 4 * 4; }

template <typename fp8_t>
struct Wire {
  static constexpr float kMax = std::is_same<fp8_t, c10::Float8_e4m3fn>::value ? 448.0f : 57344.0f;
  static uint8_t encode(float v) { return fp8_t(v).x; }
  static float decode(uint8_t b) { return static_cast<float>(fp8_t(b, fp8_t::from_bits())); }
};

// One row: q bytes at q, nb scales at s (bytes; may be unaligned in packed rows).
template <typename scalar_t, typename fp8_t>
void quantize_row(const scalar_t* x, int64_t d, int64_t block, uint8_t* q, uint8_t* s) {
  for (int64_t b0 = 0, k = 0; b0 < d; b0 += block, ++k) {
    const int64_t b1 = std::min(d, b0 + block);
    float amax = 0.0f;
    for (int64_t i = b0; i < b1; ++i) amax = std::max(amax, std::abs(static_cast<float>(x[i])));
    const float scale = amax == 0.0f ? 1.0f : amax / Wire<fp8_t>::kMax;
    for (int64_t i = b0; i < b1; ++i) q[i] = Wire<fp8_t>::encode(static_cast<float>(x[i]) / scale);
    std::memcpy(s + 4 * k, &scale, 4);
  }
}

template <typename scalar_t, typename fp8_t>
void dequantize_row(const uint8_t* q, const uint8_t* s, int64_t d, int64_t block, const float* lut,
                    scalar_t* out) {
  for (int64_t b0 = 0, k = 0; b0 < d; b0 += block, ++k) {
    const int64_t b1 = std::min(d, b0 + block);
    float scale;
    std::memcpy(&scale, s + 4 * k, 4);
    for (int64_t i = b0; i < b1; ++i) out[i] = static_cast<scalar_t>(lut[q[i]] * scale);
  }
}

template <typename fp8_t>
void fill_lut(float* lut) {
  for (int b = 0; b < 256; ++b) lut[b] = Wire<fp8_t>::decode(static_cast<uint8_t>(b));
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
  const int64_t n = x.size(0), d = x.size(1);
  const int64_t nb = num_blocks(d, block), soff = scale_offset(d);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    for_rows(n, d * static_cast<int64_t>(sizeof(scalar_t)), [&](int64_t r) {
      uint8_t* qr = q + r * q_stride;
      quantize_row<scalar_t, fp8_t>(xp + r * d, d, block, qr, s + r * s_stride);
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
  float lut[256];
  fill_lut<fp8_t>(lut);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_rows", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(n, d * static_cast<int64_t>(sizeof(scalar_t)), [&](int64_t r) {
      dequantize_row<scalar_t, fp8_t>(q + r * q_stride, s + r * s_stride, d, block, lut, op + r * d);
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

at::Tensor quantize_pack(const at::Tensor& x, int64_t wire, int64_t block, int64_t row_bytes) {
  check_x(x, "quantize_pack");
  check_wire_block(wire, block, "quantize_pack");
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(d == 0 ? row_bytes == 0 : row_bytes >= scale_offset(d) + 4 * num_blocks(d, block),
              "quantize_pack: 'row_bytes' is too small for rows of ", d, " elements");
  at::Tensor p = at::empty({n, row_bytes}, x.options().dtype(at::kByte));
  if (n == 0 || d == 0) return p;
  auto* pp = p.data_ptr<uint8_t>();
  if (wire == 0) {
    quantize_into<c10::Float8_e4m3fn>(x, block, pp, row_bytes, pp + scale_offset(d), row_bytes, row_bytes);
  } else {
    quantize_into<c10::Float8_e5m2>(x, block, pp, row_bytes, pp + scale_offset(d), row_bytes, row_bytes);
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
              "unpack_dequantize: rows of ", row_bytes, " bytes cannot hold ", d, " elements");
  at::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == dtype && out.dim() == 2 &&
                    out.size(0) == n && out.size(1) == d,
                "unpack_dequantize: 'out' must be a contiguous [N, D] CPU tensor of dtype ", dtype);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moecomm_ext CPU FP8 row quantization (moecomm.quant)";
  m.def("quantize_rows", &quantize_rows, "(q uint8 [N,D], scales float32 [N,nb])", py::arg("x"),
        py::arg("wire"), py::arg("block"));
  m.def("dequantize_rows", &dequantize_rows, "[N,D] dtype from q uint8 and scales", py::arg("q"),
        py::arg("scales"), py::arg("wire"), py::arg("block"), py::arg("dtype"));
  m.def("quantize_pack", &quantize_pack, "[N,row_bytes] uint8 packed rows", py::arg("x"), py::arg("wire"),
        py::arg("block"), py::arg("row_bytes"));
  m.def("unpack_dequantize", &unpack_dequantize, "[N,D] dtype from packed rows", py::arg("packed"),
        py::arg("d"), py::arg("wire"), py::arg("block"), py::arg("dtype"), py::arg("out") = py::none());
  m.attr("device_type") = "cpu";
}
