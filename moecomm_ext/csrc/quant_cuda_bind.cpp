// Python bindings of the CUDA FP8 quantization kernels (quant_cuda.cu); a host-only
// translation unit, so that nvcc never parses pybind11.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>

namespace moecomm_ext {
std::tuple<at::Tensor, at::Tensor> quantize_rows_cuda(const at::Tensor& x, int64_t wire, int64_t block);
at::Tensor quantize_pack_cuda(const at::Tensor& x, int64_t wire, int64_t block, int64_t row_bytes,
                              const std::optional<at::Tensor>& out);
at::Tensor gather_quantize_pack_cuda(const at::Tensor& x, const at::Tensor& index,
                                     const std::optional<at::Tensor>& row_scale, int64_t wire, int64_t block,
                                     int64_t row_bytes);
at::Tensor dequantize_rows_cuda(const at::Tensor& q, const at::Tensor& s, int64_t wire, int64_t block,
                                at::ScalarType dtype);
at::Tensor unpack_dequantize_cuda(const at::Tensor& p, int64_t d, int64_t wire, int64_t block, at::ScalarType dtype,
                                  const std::optional<at::Tensor>& out);
}  // namespace moecomm_ext

#include "source_hash.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("source_hash") = MOECOMM_EXT_SOURCE_HASH_STR;
  m.doc() = "moecomm_ext CUDA FP8 row quantization (moecomm.quant)";
  m.def("quantize_rows", &moecomm_ext::quantize_rows_cuda, "(q uint8 [N,D], scales float32 [N,nb])", py::arg("x"),
        py::arg("wire"), py::arg("block"));
  m.def("dequantize_rows", &moecomm_ext::dequantize_rows_cuda, "[N,D] dtype from q uint8 and scales", py::arg("q"),
        py::arg("scales"), py::arg("wire"), py::arg("block"), py::arg("dtype"));
  m.def("quantize_pack", &moecomm_ext::quantize_pack_cuda, "[N,row_bytes] uint8 packed rows", py::arg("x"),
        py::arg("wire"), py::arg("block"), py::arg("row_bytes"), py::arg("out") = py::none());
  m.def("gather_quantize_pack", &moecomm_ext::gather_quantize_pack_cuda,
        "[M,row_bytes] uint8: the rows x[index] (* scale) quantized and packed", py::arg("x"), py::arg("index"),
        py::arg("scale"), py::arg("wire"), py::arg("block"), py::arg("row_bytes"));
  m.def("unpack_dequantize", &moecomm_ext::unpack_dequantize_cuda, "[N,D] dtype from packed rows",
        py::arg("packed"), py::arg("d"), py::arg("wire"), py::arg("block"), py::arg("dtype"),
        py::arg("out") = py::none());
  m.attr("device_type") = "cuda";
}
