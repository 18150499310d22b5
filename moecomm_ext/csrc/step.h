// The fused capacity step's ATen glue (step.cpp), and the device kernels it calls: each row
// extension (rows_cpu.cpp, rows_cuda_bind.cpp) binds it with its own StepKernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

namespace moecomm_ext {

struct StepKernels {
  at::Tensor (*gather_rows)(const at::Tensor& x, const at::Tensor& index, const std::optional<at::Tensor>& scale);
  at::Tensor (*gather_reduce_rows)(const at::Tensor& y, const at::Tensor& index,
                                   const std::optional<at::Tensor>& weight);
  at::Tensor (*gather_rowdot)(const at::Tensor& a, const at::Tensor& b, const at::Tensor& index);
  std::vector<at::Tensor> (*route_capacity)(const at::Tensor& topk_scores, const at::Tensor& topk_idx,
                                            int64_t num_experts, int64_t capacity, bool normalize);
  at::Tensor (*route_backward)(const at::Tensor& grad_gates, const at::Tensor& topk_scores,
                               const at::Tensor& topk_idx, const at::Tensor& scores, bool normalize,
                               const std::optional<at::Tensor>& aux_grad, const std::optional<at::Tensor>& aux_counts,
                               double aux_scale, bool split_bf16);
};

// step_route, step_ffn, step_combine_backward, step_ffn_backward, step_route_backward
void bind_step(py::module& m, const StepKernels& kernels);

}  // namespace moecomm_ext
