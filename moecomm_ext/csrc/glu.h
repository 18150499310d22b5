// Gated linear units in one pass (glu_cpu.cpp, glu_cuda.cu): the MoE experts' activation
// a = f(h[:, :H]) * h[:, H:] of a pre-activation h [N, 2H] (the gate's projection first, then
// the linear one: Megatron-core's gated_linear_unit order), and its backward. Arithmetic in
// float32 (float64 for float64 inputs), each output rounded once. See moecomm_ext/_glu.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <vector>

namespace moecomm_ext {

// the gate's function f, by code (moecomm_ext/_glu.py's GLU_CODES)
enum GluAct : int64_t { kGluSilu = 0, kGluGelu = 1, kGluGeluTanh = 2, kGluRelu = 3 };

#define MOECOMM_GLU_DECLARE(suffix)                                                         \
  at::Tensor glu_forward_##suffix(const at::Tensor& h, int64_t act);                        \
  std::vector<at::Tensor> glu_backward_##suffix(const at::Tensor& grad, const at::Tensor& h, \
                                                int64_t act, bool need_out)
MOECOMM_GLU_DECLARE(cpu);
MOECOMM_GLU_DECLARE(cuda);
#undef MOECOMM_GLU_DECLARE

// f(g) and f'(g) in the opmath type T (host and device)
#if defined(__CUDACC__)
#define MOECOMM_GLU_HD __host__ __device__ __forceinline__
#else
#define MOECOMM_GLU_HD inline
#endif

template <typename T>
MOECOMM_GLU_HD void glu_gate(int64_t act, T g, T& f, T& df, bool want_df) {
  using std::erf;
  using std::exp;
  using std::tanh;
  const T one = T(1), half = T(0.5);
  switch (act) {
    case kGluSilu: {
      const T s = one / (one + exp(-g));
      f = g * s;
      if (want_df) df = s * (one + g * (one - s));
      break;
    }
    case kGluGelu: {
      const T kInvSqrt2 = T(0.70710678118654752440), kInvSqrt2Pi = T(0.39894228040143267794);
      const T cdf = half * (one + erf(g * kInvSqrt2));
      f = g * cdf;
      if (want_df) df = cdf + g * kInvSqrt2Pi * exp(-half * g * g);
      break;
    }
    case kGluGeluTanh: {
      const T kBeta = T(0.79788456080286535588), kKappa = T(0.044715);
      const T inner = kBeta * (g + kKappa * g * g * g);
      const T t = tanh(inner);
      f = half * g * (one + t);
      if (want_df) df = half * (one + t) + half * g * (one - t * t) * kBeta * (one + T(3) * kKappa * g * g);
      break;
    }
    default: {  // kGluRelu
      f = g > T(0) ? g : T(0);
      if (want_df) df = g > T(0) ? one : T(0);
    }
  }
}

// argument checks shared by both devices (`device_ok` checks one tensor's device and layout)
template <typename DeviceOk>
inline int64_t check_glu(const at::Tensor& h, int64_t act, const at::Tensor* grad, DeviceOk device_ok) {
  device_ok(h);
  TORCH_CHECK(h.dim() == 2 && h.size(1) % 2 == 0, "glu: h must be [N, 2H], got sizes ", h.sizes());
  TORCH_CHECK(act >= kGluSilu && act <= kGluRelu, "glu: act must be a code in [0, 3], got ", act);
  const int64_t H = h.size(1) / 2;
  if (grad != nullptr) {
    device_ok(*grad);
    TORCH_CHECK(grad->dim() == 2 && grad->size(0) == h.size(0) && grad->size(1) == H &&
                    grad->scalar_type() == h.scalar_type(),
                "glu_backward: grad must be [", h.size(0), ", ", H, "] of h's dtype, got ", grad->sizes(), " ",
                grad->scalar_type());
  }
  return H;
}

}  // namespace moecomm_ext

#define MOECOMM_EXT_BIND_GLU(m, suffix)                                                                 \
  m.def("glu_forward", &moecomm_ext::glu_forward_##suffix, "a = f(h[:, :H]) * h[:, H:] (glu.h)",       \
        py::arg("h"), py::arg("act"));                                                                  \
  m.def("glu_backward", &moecomm_ext::glu_backward_##suffix,                                           \
        "[grad_h [N, 2H], and a [N, H] when need_out] (glu.h)", py::arg("grad"), py::arg("h"),          \
        py::arg("act"), py::arg("need_out"))
