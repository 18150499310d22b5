// Per-expert bias and column sums over segments on the CPU (seg.h): rows (bias) and experts
// (sums) split over the ATen thread pool; each expert's rows summed in row order.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "seg.h"

namespace moecomm_ext {

namespace {

void cpu_ok(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "seg: a CPU tensor was expected, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), "seg: a contiguous tensor was expected, got strides ", t.strides());
}

// segment s's rows [start(s), end(s)): its ends clamped to [0, rows] (empty where reversed), as on the GPU
int64_t seg_start(const int* ends, int64_t s, int64_t rows) {
  return s == 0 ? 0 : std::min<int64_t>(rows, std::max<int64_t>(0, ends[s - 1]));
}

int64_t seg_end(const int* ends, int64_t s, int64_t rows) {
  return std::min<int64_t>(rows, std::max<int64_t>(0, ends[s]));
}

}  // namespace

at::Tensor seg_bias_act_cpu(at::Tensor& h, const at::Tensor& bias, const at::Tensor& ends, bool relu) {
  check_seg_bias(h, bias, ends, cpu_ok);
  const int64_t rows = h.size(0), cols = h.size(1), El = bias.size(0), S = ends.numel();
  const int* ep = ends.const_data_ptr<int>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "seg_bias_act_cpu", [&] {
    using opmath = at::opmath_type<scalar_t>;
    scalar_t* hp = h.mutable_data_ptr<scalar_t>();
    const scalar_t* bp = bias.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, cols)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        int64_t lo = 0, hi = S;  // the first segment that ends past r (the GPU's search)
        while (lo < hi) {
          const int64_t mid = (lo + hi) >> 1;
          if (ep[mid] > r) hi = mid; else lo = mid + 1;
        }
        const int64_t s = lo;
        if (s == S || r < seg_start(ep, s, rows)) continue;  // in no segment: untouched
        const scalar_t* b = bp + (s % El) * cols;
        scalar_t* row = hp + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const scalar_t v = static_cast<scalar_t>(static_cast<opmath>(row[c]) + static_cast<opmath>(b[c]));
          row[c] = relu && static_cast<opmath>(v) < opmath(0) ? scalar_t(0) : v;  // (NaN stays, as torch's relu)
        }
      }
    });
  });
  return h;
}

at::Tensor seg_colsum_cpu(const at::Tensor& g, const at::Tensor& ends, int64_t num_local) {
  check_seg_ends(g, ends, num_local, "seg_colsum", cpu_ok);
  const int64_t rows = g.size(0), cols = g.size(1), El = num_local, S = ends.numel();
  const int* ep = ends.const_data_ptr<int>();
  at::Tensor out = at::empty({El, cols}, g.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "seg_colsum_cpu", [&] {
    using opmath = at::opmath_type<scalar_t>;
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, El, 1, [&](int64_t e0, int64_t e1) {
      std::vector<opmath> acc(cols);
      for (int64_t e = e0; e < e1; ++e) {
        std::fill(acc.begin(), acc.end(), opmath(0));
        for (int64_t s = e; s < S; s += El) {
          for (int64_t r = seg_start(ep, s, rows), end = seg_end(ep, s, rows); r < end; ++r) {
            const scalar_t* row = gp + r * cols;
            for (int64_t c = 0; c < cols; ++c) acc[c] += static_cast<opmath>(row[c]);
          }
        }
        for (int64_t c = 0; c < cols; ++c) op[e * cols + c] = static_cast<scalar_t>(acc[c]);
      }
    });
  });
  return out;
}

}  // namespace moecomm_ext
