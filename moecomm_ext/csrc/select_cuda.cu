// The router's expert choice on the GPU (select.h): one thread per token.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "select.h"

namespace moecomm_ext {

namespace {

void cuda_ok(const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), "select_experts: a CUDA tensor was expected, got one on ", t.device());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous(), "select_experts: a contiguous ", dim,
              "-D tensor was expected, got sizes ", t.sizes());
}

constexpr int kThreads = 128;

template <typename T>
__global__ void select_kernel(const T* __restrict__ logits, const T* __restrict__ bias, int64_t T_, int64_t E,
                              int64_t k, int64_t score, bool normalize, T scale, int64_t groups, int64_t group_topk,
                              T* __restrict__ gates, int64_t* __restrict__ idx) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (t >= T_) return;
  select_token<T>(logits + t * E, bias, E, k, score, normalize, scale, groups, group_topk, gates + t * k, idx + t * k);
}

template <typename T>
__global__ void select_backward_kernel(const T* __restrict__ gg, const T* __restrict__ logits,
                                       const int64_t* __restrict__ idx, int64_t T_, int64_t E, int64_t k,
                                       int64_t score, bool normalize, T scale, T* __restrict__ out) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (t >= T_) return;
  select_token_backward<T>(gg + t * k, logits + t * E, idx + t * k, E, k, score, normalize, scale, out + t * E);
}

}  // namespace

std::vector<at::Tensor> select_experts_cuda(const at::Tensor& logits, const std::optional<at::Tensor>& bias, int64_t k,
                                            int64_t score, bool normalize, double scale, int64_t num_groups,
                                            int64_t group_topk) {
  check_select(logits, bias, k, score, num_groups, group_topk, cuda_ok);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(0), E = logits.size(1);
  at::Tensor gates = at::empty({T, k}, logits.options());
  at::Tensor idx = at::empty({T, k}, logits.options().dtype(at::kLong));
  if (T == 0) return {gates, idx};
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const unsigned blocks = static_cast<unsigned>((T + kThreads - 1) / kThreads);
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "select_experts_cuda", [&] {
    select_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        logits.const_data_ptr<scalar_t>(), bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr, T, E, k,
        score, normalize, static_cast<scalar_t>(scale), num_groups, group_topk, gates.mutable_data_ptr<scalar_t>(),
        idx.mutable_data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {gates, idx};
}

at::Tensor select_experts_backward_cuda(const at::Tensor& grad_gates, const at::Tensor& logits, const at::Tensor& idx,
                                        int64_t score, bool normalize, double scale) {
  check_select_backward(grad_gates, logits, idx, score, cuda_ok);
  const int64_t T = logits.size(0), E = logits.size(1), k = idx.size(1);
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor out = at::empty({T, E}, logits.options());
  if (T == 0) return out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const unsigned blocks = static_cast<unsigned>((T + kThreads - 1) / kThreads);
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "select_experts_backward_cuda", [&] {
    select_backward_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        grad_gates.const_data_ptr<scalar_t>(), logits.const_data_ptr<scalar_t>(), idx.const_data_ptr<int64_t>(), T, E,
        k, score, normalize, static_cast<scalar_t>(scale), out.mutable_data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace moecomm_ext
