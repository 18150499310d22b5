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
