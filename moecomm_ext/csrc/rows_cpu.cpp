// CPU row-gather kernels of moecomm_ext.
//
// The Python wrappers (moecomm_ext/_ops.py) validate shapes, dtypes and index
// ranges and hand over contiguous tensors; the TORCH_CHECKs here only guard
// direct calls of this module.  An out-of-range index entry (possible when the
// wrapper's host check is turned off) never throws from inside the parallel
// loop: its row is zero-filled and its flat position is returned as the
// second result (-1 when every entry is in range); the wrapper raises.
//
//   gather_rows(x[N,D], index[M] int64, scale[M] opmath?)      -> ([M,D] x.dtype, bad)
//   gather_reduce_rows(y[M,D], index[T,K] int64, weight[T,K]?) -> ([T,D] y.dtype, bad)
//   gather_rowdot(a[T,D], b[M,D], index[T,K] int64)            -> ([T,K] opmath, bad)
//
// opmath is float for float16/bfloat16/float32 and double for float64.
// Index -1 means "no row": a zero row (gather_rows) or a skipped term.

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kChunkBytes = 64 * 1024;  // work per parallel_for grain

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, bytes_per_item));
}

void check_common(const at::Tensor& t, const char* fn, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": '", name, "' must be a CPU tensor");
  TORCH_CHECK(t.dim() == dim, fn, ": '", name, "' must be ", dim, "-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), fn, ": '", name, "' must be contiguous");
}

void check_index(const at::Tensor& index, const char* fn, int64_t dim) {
  check_common(index, fn, "index", dim);
  TORCH_CHECK(index.scalar_type() == at::kLong, fn, ": 'index' must be int64");
}

template <typename opmath_t>
void check_weight(const std::optional<at::Tensor>& w, const char* fn, const char* name,
                  at::IntArrayRef shape) {
  if (!w.has_value()) return;
  check_common(*w, fn, name, static_cast<int64_t>(shape.size()));
  TORCH_CHECK(w->sizes() == shape, fn, ": '", name, "' must have shape ", shape, ", got ",
              w->sizes());
  TORCH_CHECK(w->scalar_type() == c10::CppTypeToScalarType<opmath_t>::value, fn, ": '", name,
              "' must have dtype ", c10::CppTypeToScalarType<opmath_t>::value, ", got ",
              w->scalar_type());
}

// Smallest flat position of an out-of-range index entry (-1: none).
class BadIndex {
 public:
  // true when r is usable; otherwise records pos and returns false
  bool ok(int64_t r, int64_t n, int64_t pos) {
    if (r >= -1 && r < n) return true;
    int64_t cur = first_.load(std::memory_order_relaxed);
    while ((cur < 0 || pos < cur) &&
           !first_.compare_exchange_weak(cur, pos, std::memory_order_relaxed)) {
    }
    return false;
  }
  int64_t get() const { return first_.load(); }

 private:
  std::atomic<int64_t> first_{-1};
};

using Result = std::tuple<at::Tensor, int64_t>;

Result gather_rows(const at::Tensor& x, const at::Tensor& index,
                   const std::optional<at::Tensor>& scale) {
  constexpr const char* fn = "gather_rows";
  check_common(x, fn, "x", 2);
  check_index(index, fn, 1);
  const int64_t N = x.size(0), D = x.size(1), M = index.size(0);
  at::Tensor out = at::empty({M, D}, x.options());
  const int64_t* idx = index.const_data_ptr<int64_t>();
  BadIndex bad;

  if (!scale.has_value()) {
    // Any dtype: rows are copied as raw bytes.
    const int64_t row_bytes = D * static_cast<int64_t>(x.element_size());
    const char* src = static_cast<const char*>(x.const_data_ptr());
    char* dst = static_cast<char*>(out.mutable_data_ptr());
    at::parallel_for(0, M, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = idx[i];
        const bool ok = bad.ok(r, N, i);
        if (row_bytes == 0) continue;
        char* d = dst + i * row_bytes;
        if (r < 0 || !ok) {
          std::memset(d, 0, row_bytes);
        } else {
          std::memcpy(d, src + r * row_bytes, row_bytes);
        }
      }
    });
    return Result(out, bad.get());
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gather_rows_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    check_weight<opmath_t>(scale, fn, "scale", {M});
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    const opmath_t* s = scale->const_data_ptr<opmath_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, M, grain_for(D * static_cast<int64_t>(sizeof(scalar_t))), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = idx[i];
        const bool ok = bad.ok(r, N, i);
        scalar_t* d = dst + i * D;
        if (r < 0 || !ok) {
          std::fill(d, d + D, scalar_t(0));
          continue;
        }
        const scalar_t* row = src + r * D;
        const opmath_t w = s[i];
        for (int64_t c = 0; c < D; ++c) {
          d[c] = static_cast<scalar_t>(static_cast<opmath_t>(row[c]) * w);
        }
      }
    });
  });
  return Result(out, bad.get());
}

// out: [T, D] contiguous of y's dtype to write into, or none (allocated)
Result gather_reduce_rows(const at::Tensor& y, const at::Tensor& index,
                          const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& into) {
  constexpr const char* fn = "gather_reduce_rows";
  check_common(y, fn, "y", 2);
  check_index(index, fn, 2);
  const int64_t M = y.size(0), D = y.size(1), T = index.size(0), K = index.size(1);
  at::Tensor out = into.has_value() ? *into : at::empty({T, D}, y.options());
  if (into.has_value()) {
    check_common(out, fn, "out", 2);
    TORCH_CHECK(out.sizes() == at::IntArrayRef({T, D}) && out.scalar_type() == y.scalar_type(), fn,
                ": 'out' must be [", T, ", ", D, "] of ", y.scalar_type(), ", got ", out.sizes(), " of ",
                out.scalar_type());
  }
  const int64_t* idx = index.const_data_ptr<int64_t>();
  BadIndex bad;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "gather_reduce_rows_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    check_weight<opmath_t>(weight, fn, "weight", {T, K});
    const scalar_t* src = y.const_data_ptr<scalar_t>();
    const opmath_t* w = weight.has_value() ? weight->const_data_ptr<opmath_t>() : nullptr;
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const int64_t item_bytes = std::max<int64_t>(1, K) * D * static_cast<int64_t>(sizeof(scalar_t));
    at::parallel_for(0, T, grain_for(item_bytes), [&](int64_t begin, int64_t end) {
      std::vector<opmath_t> acc(static_cast<size_t>(D));
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), opmath_t(0));
        for (int64_t j = 0; j < K; ++j) {
          const int64_t r = idx[t * K + j];
          if (!bad.ok(r, M, t * K + j) || r < 0) continue;
          const scalar_t* row = src + r * D;
          opmath_t* a = acc.data();
          if (w != nullptr) {
            const opmath_t wj = w[t * K + j];
            for (int64_t c = 0; c < D; ++c) a[c] += wj * static_cast<opmath_t>(row[c]);
          } else {
            for (int64_t c = 0; c < D; ++c) a[c] += static_cast<opmath_t>(row[c]);
          }
        }
        scalar_t* d = dst + t * D;
        for (int64_t c = 0; c < D; ++c) d[c] = static_cast<scalar_t>(acc[c]);
      }
    });
  });
  return Result(out, bad.get());
}

Result gather_rowdot(const at::Tensor& a, const at::Tensor& b, const at::Tensor& index) {
  constexpr const char* fn = "gather_rowdot";
  check_common(a, fn, "a", 2);
  check_common(b, fn, "b", 2);
  check_index(index, fn, 2);
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), fn, ": 'a' and 'b' must have the same dtype");
  TORCH_CHECK(a.size(1) == b.size(1), fn, ": 'a' and 'b' must have the same number of columns");
  const int64_t T = a.size(0), D = a.size(1), M = b.size(0), K = index.size(1);
  TORCH_CHECK(index.size(0) == T, fn, ": 'index' must have ", T, " rows, got ", index.size(0));
  const int64_t* idx = index.const_data_ptr<int64_t>();
  at::Tensor out;
  BadIndex bad;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "gather_rowdot_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    out = at::empty({T, K}, a.options().dtype(c10::CppTypeToScalarType<opmath_t>::value));
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    const scalar_t* pb = b.const_data_ptr<scalar_t>();
    opmath_t* dst = out.mutable_data_ptr<opmath_t>();
    constexpr int kLanes = 8;  // independent partial sums -> vectorisable, fixed order
    at::parallel_for(0, T * K, grain_for(2 * D * static_cast<int64_t>(sizeof(scalar_t))), [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t r = idx[p];
        if (!bad.ok(r, M, p) || r < 0) {
          dst[p] = opmath_t(0);
          continue;
        }
        const scalar_t* x = pa + (p / K) * D;
        const scalar_t* z = pb + r * D;
        opmath_t part[kLanes] = {};
        int64_t c = 0;
        for (; c + kLanes <= D; c += kLanes) {
          for (int l = 0; l < kLanes; ++l) {
            part[l] += static_cast<opmath_t>(x[c + l]) * static_cast<opmath_t>(z[c + l]);
          }
        }
        for (; c < D; ++c) part[0] += static_cast<opmath_t>(x[c]) * static_cast<opmath_t>(z[c]);
        opmath_t s = 0;
        for (int l = 0; l < kLanes; ++l) s += part[l];
        dst[p] = s;
      }
    });
  });
  return Result(out, bad.get());
}

// the step glue's kernels (step.h): an out-of-range index raises instead of returning its position
at::Tensor checked(Result r, const char* fn) {
  TORCH_CHECK(std::get<1>(r) < 0, fn, ": index entry ", std::get<1>(r), " (flat position) is out of range");
  return std::get<0>(r);
}
at::Tensor step_gather_rows(const at::Tensor& x, const at::Tensor& index, const std::optional<at::Tensor>& scale) {
  return checked(gather_rows(x, index, scale), "gather_rows");
}
at::Tensor step_gather_reduce_rows(const at::Tensor& y, const at::Tensor& index,
                                   const std::optional<at::Tensor>& weight) {
  return checked(gather_reduce_rows(y, index, weight, std::nullopt), "gather_reduce_rows");
}
at::Tensor step_gather_rowdot(const at::Tensor& a, const at::Tensor& b, const at::Tensor& index) {
  return checked(gather_rowdot(a, b, index), "gather_rowdot");
}

}  // namespace

#include "glu.h"
#include "seg.h"
#include "select.h"
#include "lowlat.h"
#include "route.h"
#include "step.h"
#include "source_hash.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("source_hash") = MOECOMM_EXT_SOURCE_HASH_STR;
  m.doc() = "moecomm_ext CPU row-gather and router kernels";
  m.def("gather_rows", &gather_rows,
        "(out, bad): out[i] = x[index[i]] * scale[i]; -1 -> zero row; bad = first out-of-range position or -1",
        py::arg("x"), py::arg("index"), py::arg("scale") = py::none());
  m.def("gather_reduce_rows", &gather_reduce_rows,
        "(out, bad): out[t] = sum_j weight[t,j] * y[index[t,j]]; -1 skipped", py::arg("y"), py::arg("index"),
        py::arg("weight") = py::none(), py::arg("out") = py::none());
  m.def("gather_rowdot", &gather_rowdot, "(out, bad): out[t,j] = dot(a[t], b[index[t,j]]); -1 -> 0",
        py::arg("a"), py::arg("b"), py::arg("index"));
  MOECOMM_EXT_BIND_ROUTE(m, cpu);
  MOECOMM_EXT_BIND_LOW_LATENCY(m, cpu);
  MOECOMM_EXT_BIND_GLU(m, cpu);
  MOECOMM_EXT_BIND_SEG(m, cpu);
  MOECOMM_EXT_BIND_SELECT(m, cpu);
  moecomm_ext::bind_step(m, {step_gather_rows, step_gather_reduce_rows, step_gather_rowdot,
                             moecomm_ext::route_capacity_cpu, moecomm_ext::route_backward_cpu});
  m.attr("device_type") = "cpu";
}
