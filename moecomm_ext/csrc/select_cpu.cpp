// The router's expert choice on the CPU (select.h): tokens split over the ATen thread pool.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "select.h"

namespace moecomm_ext {

namespace {

void cpu_ok(const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), "select_experts: a CPU tensor was expected, got one on ", t.device());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous(), "select_experts: a contiguous ", dim,
              "-D tensor was expected, got sizes ", t.sizes());
}

}  // namespace

std::vector<at::Tensor> select_experts_cpu(const at::Tensor& logits, const std::optional<at::Tensor>& bias, int64_t k,
                                           int64_t score, bool normalize, double scale, int64_t num_groups,
                                           int64_t group_topk) {
  check_select(logits, bias, k, score, num_groups, group_topk, cpu_ok);
  const int64_t T = logits.size(0), E = logits.size(1);
  at::Tensor gates = at::empty({T, k}, logits.options());
  at::Tensor idx = at::empty({T, k}, logits.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "select_experts_cpu", [&] {
    const scalar_t* l = logits.const_data_ptr<scalar_t>();
    const scalar_t* b = bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* g = gates.mutable_data_ptr<scalar_t>();
    int64_t* ix = idx.mutable_data_ptr<int64_t>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        select_token<scalar_t>(l + t * E, b, E, k, score, normalize, static_cast<scalar_t>(scale), num_groups,
                               group_topk, g + t * k, ix + t * k);
      }
    });
  });
  return {gates, idx};
}

at::Tensor select_experts_backward_cpu(const at::Tensor& grad_gates, const at::Tensor& logits, const at::Tensor& idx,
                                       int64_t score, bool normalize, double scale) {
  check_select_backward(grad_gates, logits, idx, score, cpu_ok);
  const int64_t T = logits.size(0), E = logits.size(1), k = idx.size(1);
  at::Tensor out = at::empty({T, E}, logits.options());
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "select_experts_backward_cpu", [&] {
    const scalar_t* gg = grad_gates.const_data_ptr<scalar_t>();
    const scalar_t* l = logits.const_data_ptr<scalar_t>();
    const int64_t* ix = idx.const_data_ptr<int64_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        select_token_backward<scalar_t>(gg + t * k, l + t * E, ix + t * k, E, k, score, normalize,
                                        static_cast<scalar_t>(scale), o + t * E);
      }
    });
  });
  return out;
}

}  // namespace moecomm_ext
