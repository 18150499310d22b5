// Gated linear units on the CPU (glu.h): rows split over the ATen thread pool.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/OpMathType.h>

#include "glu.h"

namespace moecomm_ext {

namespace {

void cpu_ok(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "glu: a CPU tensor was expected, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), "glu: a contiguous tensor was expected, got strides ", t.strides());
}

int64_t grain(int64_t H) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, 3 * H)); }

}  // namespace

at::Tensor glu_forward_cpu(const at::Tensor& h, int64_t act) {
  const int64_t H = check_glu(h, act, nullptr, cpu_ok), N = h.size(0);
  at::Tensor out = at::empty({N, H}, h.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "glu_forward_cpu", [&] {
    using opmath = at::opmath_type<scalar_t>;
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, N, grain(H), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* g = hp + r * 2 * H;
        const scalar_t* u = g + H;
        scalar_t* o = op + r * H;
        for (int64_t c = 0; c < H; ++c) {
          opmath f, df;
          glu_gate<opmath>(act, static_cast<opmath>(g[c]), f, df, false);
          o[c] = static_cast<scalar_t>(f * static_cast<opmath>(u[c]));
        }
      }
    });
  });
  return out;
}

std::vector<at::Tensor> glu_backward_cpu(const at::Tensor& grad, const at::Tensor& h, int64_t act, bool need_out) {
  const int64_t H = check_glu(h, act, &grad, cpu_ok), N = h.size(0);
  at::Tensor gh = at::empty({N, 2 * H}, h.options());
  at::Tensor out = need_out ? at::empty({N, H}, h.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "glu_backward_cpu", [&] {
    using opmath = at::opmath_type<scalar_t>;
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    scalar_t* ghp = gh.mutable_data_ptr<scalar_t>();
    scalar_t* op = need_out ? out.mutable_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, N, grain(H), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* g = hp + r * 2 * H;
        const scalar_t* u = g + H;
        const scalar_t* ga = gp + r * H;
        scalar_t* gg = ghp + r * 2 * H;
        for (int64_t c = 0; c < H; ++c) {
          opmath f, df;
          glu_gate<opmath>(act, static_cast<opmath>(g[c]), f, df, true);
          const opmath a = static_cast<opmath>(ga[c]), uc = static_cast<opmath>(u[c]);
          gg[c] = static_cast<scalar_t>(a * uc * df);
          gg[H + c] = static_cast<scalar_t>(a * f);
          if (op != nullptr) op[r * H + c] = static_cast<scalar_t>(f * uc);
        }
      }
    });
  });
  if (need_out) return {gh, out};
  return {gh};
}

}  // namespace moecomm_ext
