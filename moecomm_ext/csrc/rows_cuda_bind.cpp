// Python bindings of the CUDA row-gather kernels (rows_cuda.cu).  Kept in a
// separate host-only translation unit so that nvcc never parses pybind11.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

namespace moecomm_ext {
at::Tensor gather_rows_cuda(const at::Tensor& x, const at::Tensor& index,
                            const std::optional<at::Tensor>& scale);
at::Tensor gather_reduce_rows_cuda(const at::Tensor& y, const at::Tensor& index,
                                   const std::optional<at::Tensor>& weight);
at::Tensor gather_reduce_rows_into_cuda(const at::Tensor& y, const at::Tensor& index,
                                        const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& into);
at::Tensor gather_rowdot_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& index);
}  // namespace moecomm_ext

#include "glu.h"
#include "seg.h"
#include "select.h"
#include "lowlat.h"
#include "route.h"
#include "step.h"
#include "source_hash.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("source_hash") = MOECOMM_EXT_SOURCE_HASH_STR;
  m.doc() = "moecomm_ext CUDA row-gather and router kernels";
  m.def("gather_rows", &moecomm_ext::gather_rows_cuda,
        "out[i] = x[index[i]] * scale[i]; -1 -> zero row", py::arg("x"), py::arg("index"),
        py::arg("scale") = py::none());
  m.def("gather_reduce_rows", &moecomm_ext::gather_reduce_rows_into_cuda,
        "out[t] = sum_j weight[t,j] * y[index[t,j]]; -1 skipped", py::arg("y"), py::arg("index"),
        py::arg("weight") = py::none(), py::arg("out") = py::none());
  m.def("gather_rowdot", &moecomm_ext::gather_rowdot_cuda,
        "out[t,j] = dot(a[t], b[index[t,j]]); -1 -> 0", py::arg("a"), py::arg("b"),
        py::arg("index"));
  MOECOMM_EXT_BIND_ROUTE(m, cuda);
  MOECOMM_EXT_BIND_LOW_LATENCY(m, cuda);
  MOECOMM_EXT_BIND_GLU(m, cuda);
  MOECOMM_EXT_BIND_SEG(m, cuda);
  MOECOMM_EXT_BIND_SELECT(m, cuda);
  moecomm_ext::bind_step(m, {moecomm_ext::gather_rows_cuda, moecomm_ext::gather_reduce_rows_cuda,
                             moecomm_ext::gather_rowdot_cuda, moecomm_ext::route_capacity_cuda,
                             moecomm_ext::route_backward_cuda});
  m.attr("device_type") = "cuda";
}
