// The MoE router kernels (route_cpu.cpp, route_cuda.cu), declared for the row extensions'
// Python bindings (rows_cpu.cpp, rows_cuda_bind.cpp). See moecomm_ext/_route.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace moecomm_ext {

std::vector<at::Tensor> route_capacity_cpu(const at::Tensor& topk_scores, const at::Tensor& topk_idx,
                                           int64_t num_experts, int64_t capacity, bool normalize);
at::Tensor route_backward_cpu(const at::Tensor& grad_gates, const at::Tensor& topk_scores,
                              const at::Tensor& topk_idx, const at::Tensor& scores, bool normalize,
                              const std::optional<at::Tensor>& aux_grad,
                              const std::optional<at::Tensor>& aux_counts, double aux_scale, bool split_bf16);

std::vector<at::Tensor> route_capacity_cuda(const at::Tensor& topk_scores, const at::Tensor& topk_idx,
                                            int64_t num_experts, int64_t capacity, bool normalize);
at::Tensor route_backward_cuda(const at::Tensor& grad_gates, const at::Tensor& topk_scores,
                               const at::Tensor& topk_idx, const at::Tensor& scores, bool normalize,
                               const std::optional<at::Tensor>& aux_grad,
                               const std::optional<at::Tensor>& aux_counts, double aux_scale, bool split_bf16);

// route_backward's argument checks, shared by both devices (`device_ok` checks one tensor's device)
template <typename DeviceOk>
inline void check_route_backward_args(const at::Tensor& grad_gates, const at::Tensor& topk_scores,
                                      const at::Tensor& topk_idx, const at::Tensor& scores,
                                      const std::optional<at::Tensor>& aux_grad,
                                      const std::optional<at::Tensor>& aux_counts, DeviceOk device_ok) {
  constexpr const char* fn = "route_backward";
  for (const at::Tensor* t : {&grad_gates, &topk_scores, &topk_idx, &scores}) {
    device_ok(*t, 2);
  }
  const auto dtype = scores.scalar_type();
  TORCH_CHECK(grad_gates.scalar_type() == dtype && topk_scores.scalar_type() == dtype, fn,
              ": floating arguments must share one dtype");
  TORCH_CHECK(aux_grad.has_value() == aux_counts.has_value(), fn, ": aux_grad and aux_counts go together");
  if (aux_grad.has_value()) {
    TORCH_CHECK(aux_grad->device() == scores.device() && aux_grad->numel() == 1 && aux_grad->scalar_type() == dtype,
                fn, ": bad aux_grad");
    device_ok(*aux_counts, 1);
    TORCH_CHECK(aux_counts->size(0) == scores.size(1) && aux_counts->scalar_type() == dtype, fn, ": bad aux_counts");
  }
}

}  // namespace moecomm_ext

// The bindings' shared text (pybind11 must be included before this macro is used).
#define MOECOMM_EXT_BIND_ROUTE(m, suffix)                                                                    \
  m.def("route_capacity", &moecomm_ext::route_capacity_##suffix,                                          \
        "(gates, locations, counts, first_counts, token_slots, slot_token, slot_route, slot_gate)",        \
        py::arg("topk_scores"), py::arg("topk_idx"), py::arg("num_experts"), py::arg("capacity"),          \
        py::arg("normalize"));                                                                              \
  m.def("route_backward", &moecomm_ext::route_backward_##suffix,                                          \
        "grad of the router logits [T,E], or [T,2E] bfloat16 hi|lo", py::arg("grad_gates"),               \
        py::arg("topk_scores"), py::arg("topk_idx"), py::arg("scores"), py::arg("normalize"),              \
        py::arg("aux_grad") = py::none(), py::arg("aux_counts") = py::none(), py::arg("aux_scale") = 1.0,  \
        py::arg("split_bf16") = false)
