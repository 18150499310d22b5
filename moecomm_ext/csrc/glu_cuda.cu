// Gated linear units on the GPU (glu.h): one thread per VEC adjacent columns of a row (16-byte
// loads and stores where the rows allow, vec_cuda.h), a grid-stride loop over the [N, H] outputs.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "glu.h"
#include "vec_cuda.h"

namespace moecomm_ext {

namespace {

void cuda_ok(const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), "glu: a CUDA tensor was expected, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), "glu: a contiguous tensor was expected, got strides ", t.strides());
}

using vec::grid_for;
using vec::load;
using vec::Pack;
using vec::pick_vec;
using vec::store;

template <typename T, int VEC>
__global__ void glu_forward_kernel(const T* __restrict__ h, T* __restrict__ out, int64_t N, int64_t H, int64_t act) {
  using opmath = at::opmath_type<T>;
  const int64_t per_row = H / VEC, total = N * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i - r * per_row) * VEC;
    const T* g = h + r * 2 * H + c;
    const Pack<T, VEC> gv = load<T, VEC>(g), uv = load<T, VEC>(g + H);
    Pack<T, VEC> ov;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      opmath f, df;
      glu_gate<opmath>(act, static_cast<opmath>(gv.v[j]), f, df, false);
      ov.v[j] = static_cast<T>(f * static_cast<opmath>(uv.v[j]));
    }
    store<T, VEC>(out + r * H + c, ov);
  }
}

template <typename T, int VEC>
__global__ void glu_backward_kernel(const T* __restrict__ grad, const T* __restrict__ h, T* __restrict__ gh,
                                    T* __restrict__ out, int64_t N, int64_t H, int64_t act) {
  using opmath = at::opmath_type<T>;
  const int64_t per_row = H / VEC, total = N * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i - r * per_row) * VEC;
    const T* g = h + r * 2 * H + c;
    const Pack<T, VEC> gv = load<T, VEC>(g), uv = load<T, VEC>(g + H), av = load<T, VEC>(grad + r * H + c);
    Pack<T, VEC> gg, gu, ov;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      opmath f, df;
      glu_gate<opmath>(act, static_cast<opmath>(gv.v[j]), f, df, true);
      const opmath a = static_cast<opmath>(av.v[j]), u = static_cast<opmath>(uv.v[j]);
      gg.v[j] = static_cast<T>(a * u * df);
      gu.v[j] = static_cast<T>(a * f);
      ov.v[j] = static_cast<T>(f * u);
    }
    store<T, VEC>(gh + r * 2 * H + c, gg);
    store<T, VEC>(gh + r * 2 * H + H + c, gu);
    if (out != nullptr) store<T, VEC>(out + r * H + c, ov);
  }
}

}  // namespace

at::Tensor glu_forward_cuda(const at::Tensor& h, int64_t act) {
  const int64_t H = check_glu(h, act, nullptr, cuda_ok), N = h.size(0);
  const c10::cuda::CUDAGuard guard(h.device());
  at::Tensor out = at::empty({N, H}, h.options());
  if (N == 0 || H == 0) return out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  constexpr int kThreads = 256;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "glu_forward_cuda", [&] {
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const int vec = pick_vec<scalar_t>(H, {hp, op});
    const dim3 grid = grid_for(N * (H / vec), kThreads);
    switch (vec) {
      case 8: glu_forward_kernel<scalar_t, 8><<<grid, kThreads, 0, stream>>>(hp, op, N, H, act); break;
      case 4: glu_forward_kernel<scalar_t, 4><<<grid, kThreads, 0, stream>>>(hp, op, N, H, act); break;
      case 2: glu_forward_kernel<scalar_t, 2><<<grid, kThreads, 0, stream>>>(hp, op, N, H, act); break;
      default: glu_forward_kernel<scalar_t, 1><<<grid, kThreads, 0, stream>>>(hp, op, N, H, act);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::vector<at::Tensor> glu_backward_cuda(const at::Tensor& grad, const at::Tensor& h, int64_t act, bool need_out) {
  const int64_t H = check_glu(h, act, &grad, cuda_ok), N = h.size(0);
  const c10::cuda::CUDAGuard guard(h.device());
  at::Tensor gh = at::empty({N, 2 * H}, h.options());
  at::Tensor out = need_out ? at::empty({N, H}, h.options()) : at::Tensor();
  if (N > 0 && H > 0) {
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    constexpr int kThreads = 256;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "glu_backward_cuda", [&] {
      const scalar_t* hp = h.const_data_ptr<scalar_t>();
      const scalar_t* gp = grad.const_data_ptr<scalar_t>();
      scalar_t* ghp = gh.mutable_data_ptr<scalar_t>();
      scalar_t* op = need_out ? out.mutable_data_ptr<scalar_t>() : nullptr;
      const int vec = pick_vec<scalar_t>(H, {hp, gp, ghp, op});
      const dim3 grid = grid_for(N * (H / vec), kThreads);
      switch (vec) {
        case 8: glu_backward_kernel<scalar_t, 8><<<grid, kThreads, 0, stream>>>(gp, hp, ghp, op, N, H, act); break;
        case 4: glu_backward_kernel<scalar_t, 4><<<grid, kThreads, 0, stream>>>(gp, hp, ghp, op, N, H, act); break;
        case 2: glu_backward_kernel<scalar_t, 2><<<grid, kThreads, 0, stream>>>(gp, hp, ghp, op, N, H, act); break;
        default: glu_backward_kernel<scalar_t, 1><<<grid, kThreads, 0, stream>>>(gp, hp, ghp, op, N, H, act);
      }
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (need_out) return {gh, out};
  return {gh};
}

}  // namespace moecomm_ext
