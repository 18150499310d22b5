// Per-expert bias and column sums over a segmented row layout (seg_cpu.cpp, seg_cuda.cu): the
// dropless experts' rows are segments one after the other, segment s ending (exclusive) at row
// ends[s] (int32, the grouped GEMMs' offsets) and belonging to local expert s % num_local. The
// bias of a row and the sums of an expert's rows come from the segments alone, with no row map
// and no host synchronisation. See moecomm_ext/_seg.py.
//
//   seg_bias_act(h, bias, ends, relu): in place, h[r] = h[r] + bias[e(r)] (each element rounded
//     once from the opmath sum), then ReLU where asked; rows past the last end are untouched.
//   seg_colsum(g, ends, num_local): [num_local, cols] of g's dtype, out[e] = the sum of the rows of
//     expert e's segments, in opmath, in a fixed order (deterministic).
//
// Any `ends` is memory-safe: ends are clamped to [0, rows] and a segment's rows to its extent.
#pragma once

#include <ATen/core/Tensor.h>

namespace moecomm_ext {

#define MOECOMM_SEG_DECLARE(suffix)                                                                    \
  at::Tensor seg_bias_act_##suffix(at::Tensor& h, const at::Tensor& bias, const at::Tensor& ends, bool relu); \
  at::Tensor seg_colsum_##suffix(const at::Tensor& g, const at::Tensor& ends, int64_t num_local)
MOECOMM_SEG_DECLARE(cpu);
MOECOMM_SEG_DECLARE(cuda);
#undef MOECOMM_SEG_DECLARE

// argument checks shared by both devices (`device_ok` checks one tensor's device and layout)
template <typename DeviceOk>
inline void check_seg_ends(const at::Tensor& rows, const at::Tensor& ends, int64_t num_local, const char* op,
                           DeviceOk device_ok) {
  device_ok(rows);
  device_ok(ends);
  TORCH_CHECK(rows.dim() == 2, op, ": the rows must be 2-D [rows, cols], got sizes ", rows.sizes());
  TORCH_CHECK(ends.dim() == 1 && ends.scalar_type() == at::kInt, op, ": ends must be 1-D int32, got ",
              ends.scalar_type(), " of sizes ", ends.sizes());
  TORCH_CHECK(num_local >= 1 && ends.numel() >= num_local && ends.numel() % num_local == 0, op,
              ": ends must hold blocks * num_local segment ends (num_local = ", num_local, "), got ", ends.numel());
  TORCH_CHECK(rows.device() == ends.device(), op, ": ends must be on the rows' device ", rows.device(), ", got ",
              ends.device());
}

template <typename DeviceOk>
inline void check_seg_bias(const at::Tensor& h, const at::Tensor& bias, const at::Tensor& ends, DeviceOk device_ok) {
  device_ok(bias);
  TORCH_CHECK(bias.dim() == 2, "seg_bias_act: bias must be 2-D [num_local, cols], got sizes ", bias.sizes());
  check_seg_ends(h, ends, bias.size(0), "seg_bias_act", device_ok);
  TORCH_CHECK(bias.size(1) == h.size(1) && bias.scalar_type() == h.scalar_type() && bias.device() == h.device(),
              "seg_bias_act: bias must be [num_local, ", h.size(1), "] of h's dtype ", h.scalar_type(), " on ",
              h.device(), ", got ", bias.sizes(), " ", bias.scalar_type(), " on ", bias.device());
}

}  // namespace moecomm_ext

#define MOECOMM_EXT_BIND_SEG(m, suffix)                                                                        \
  m.def("seg_bias_act", &moecomm_ext::seg_bias_act_##suffix,                                                  \
        "h[r] += bias[expert of r], then ReLU if relu; in place, returns h (seg.h)", py::arg("h"),            \
        py::arg("bias"), py::arg("ends"), py::arg("relu"));                                                    \
  m.def("seg_colsum", &moecomm_ext::seg_colsum_##suffix, "[num_local, cols] sums of each expert's rows (seg.h)", \
        py::arg("g"), py::arg("ends"), py::arg("num_local"))
