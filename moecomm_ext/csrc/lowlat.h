// The kernels of moecomm.LowLatencyBuffer's dispatch (moecomm/low_latency.py; lowlat_cpu.cpp,
// lowlat_cuda.cu), declared for the row extensions' Python bindings. Both write into the
// buffer's preallocated tensors and never synchronise with the host, so that a dispatch can be
// captured in a CUDA graph. Their pure-torch reference is the buffer's own op-by-op path.
//
// ll_dispatch_layout (the source): topk_idx [T, k] int64, T <= M; num_tokens none or a 0-dim
//   int64 tensor. Slot (t, j) is used when t < min(T, num_tokens) and 0 <= topk_idx < E; the
//   others become -1. Writes
//   - each token's k ids into its staged wire row (`staged` [M + 1, row_bytes] uint8, at byte
//     id_offset, id_bytes = 2 or 4 each; rows t < M);
//   - send_tok [W * M] int64: entry d * M + p is the token at position p of the block for rank
//     d (tokens that name one of d's experts, in token order), M (the spare row) past the end;
//   - bidx [M, k] int64: the combine's row of slot (t, j), d * M * kk + p * kk + i, with i the
//     place of the slot's expert among the token's distinct experts on rank d (in the order
//     of their first slots); -1 for unused slots;
//   - send_counts [W] int64 (when given): the used rows of each destination's block.
// ll_dispatch_place (the receiver): recv [R, row_bytes] uint8 rows from the peers (source
//   then position). Row r's distinct experts of this rank (ids in [rank * L, rank * L + L),
//   first slots, slot order) are its i = 0, 1, ...; the i-th goes to expert row
//   q = e * R + (rows before r naming e). Writes qic [R, kk] int64 (q, 0 where unused),
//   counts [L] int64, and copies bytes [src_offset, src_offset + row bytes of out) of row r to
//   row q of out ([>= L * R, *] contiguous), likewise for out2 (FP8 scales) when given. With
//   recv_counts ([W] int64: the rows each source sent, a transport that moves used rows only),
//   row r is read only when r % M < recv_counts[r / M] (the rest of a block is stale);
//   without, unused rows carry ids -1.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace moecomm_ext {

constexpr int64_t kLowLatencyMaxK = 32;  // the kernels keep a token's slots in registers

#define MOECOMM_LL_DECLARE(suffix)                                                                            \
  void ll_dispatch_layout_##suffix(const at::Tensor& topk_idx, const std::optional<at::Tensor>& num_tokens,     \
                                   int64_t num_experts, int64_t world, int64_t kk, at::Tensor staged,            \
                                   int64_t id_offset, int64_t id_bytes, at::Tensor send_tok, at::Tensor bidx,    \
                                   const std::optional<at::Tensor>& send_counts);                               \
  void ll_dispatch_place_##suffix(const at::Tensor& recv, int64_t id_offset, int64_t id_bytes, int64_t k,       \
                                  int64_t rank, int64_t local_experts, at::Tensor out, int64_t src_offset,       \
                                  const std::optional<at::Tensor>& out2, int64_t src_offset2, at::Tensor qic,   \
                                  at::Tensor counts, const std::optional<at::Tensor>& recv_counts)
MOECOMM_LL_DECLARE(cpu);
MOECOMM_LL_DECLARE(cuda);
#undef MOECOMM_LL_DECLARE

// The arguments' checks, shared by both devices (`device_ok(t, dim)` checks one tensor's device,
// dimensions and contiguity).
template <typename DeviceOk>
inline void check_ll_layout(const at::Tensor& topk_idx, const std::optional<at::Tensor>& num_tokens,
                            int64_t num_experts, int64_t world, int64_t kk, const at::Tensor& staged,
                            int64_t id_offset, int64_t id_bytes, const at::Tensor& send_tok, const at::Tensor& bidx,
                            const std::optional<at::Tensor>& send_counts, DeviceOk device_ok) {
  constexpr const char* fn = "ll_dispatch_layout";
  device_ok(topk_idx, 2);
  device_ok(staged, 2);
  device_ok(send_tok, 1);
  device_ok(bidx, 2);
  const int64_t M = staged.size(0) - 1, k = topk_idx.size(1);
  TORCH_CHECK(topk_idx.scalar_type() == at::kLong && send_tok.scalar_type() == at::kLong &&
                  bidx.scalar_type() == at::kLong && staged.scalar_type() == at::kByte,
              fn, ": topk_idx, send_tok and bidx must be int64, staged uint8");
  TORCH_CHECK(M >= 0 && topk_idx.size(0) <= M, fn, ": topk_idx has ", topk_idx.size(0), " rows, more than ", M);
  TORCH_CHECK(k >= 1 && k <= kLowLatencyMaxK, fn, ": k must be in [1, ", kLowLatencyMaxK, "], got ", k);
  TORCH_CHECK(world >= 1 && num_experts % world == 0 && kk >= 1 && kk <= k, fn, ": bad world ", world,
              ", num_experts ", num_experts, " or kk ", kk);
  TORCH_CHECK(id_bytes == 2 || id_bytes == 4, fn, ": id_bytes must be 2 or 4, got ", id_bytes);
  TORCH_CHECK(id_offset >= 0 && id_offset + k * id_bytes <= staged.size(1), fn, ": ids do not fit a staged row");
  TORCH_CHECK(send_tok.size(0) == world * M, fn, ": send_tok must have ", world * M, " entries");
  TORCH_CHECK(bidx.size(0) == M && bidx.size(1) == k, fn, ": bidx must be [", M, ", ", k, "]");
  if (send_counts.has_value()) {
    device_ok(*send_counts, 1);
    TORCH_CHECK(send_counts->scalar_type() == at::kLong && send_counts->size(0) == world, fn,
                ": send_counts must be int64 [", world, "]");
  }
  if (num_tokens.has_value()) {
    TORCH_CHECK(num_tokens->dim() == 0 && num_tokens->scalar_type() == at::kLong &&
                    num_tokens->device() == topk_idx.device(),
                fn, ": num_tokens must be a 0-dim int64 tensor on ", topk_idx.device());
  }
}

template <typename DeviceOk>
inline void check_ll_place(const at::Tensor& recv, int64_t id_offset, int64_t id_bytes, int64_t k, int64_t rank,
                           int64_t local_experts, const at::Tensor& out, int64_t src_offset,
                           const std::optional<at::Tensor>& out2, int64_t src_offset2, const at::Tensor& qic,
                           const at::Tensor& counts, const std::optional<at::Tensor>& recv_counts,
                           DeviceOk device_ok) {
  constexpr const char* fn = "ll_dispatch_place";
  device_ok(recv, 2);
  device_ok(out, 2);
  device_ok(qic, 2);
  device_ok(counts, 1);
  const int64_t R = recv.size(0), row_bytes = recv.size(1);
  TORCH_CHECK(recv.scalar_type() == at::kByte && qic.scalar_type() == at::kLong && counts.scalar_type() == at::kLong,
              fn, ": recv must be uint8, qic and counts int64");
  TORCH_CHECK(k >= 1 && k <= kLowLatencyMaxK, fn, ": k must be in [1, ", kLowLatencyMaxK, "], got ", k);
  TORCH_CHECK(id_bytes == 2 || id_bytes == 4, fn, ": id_bytes must be 2 or 4, got ", id_bytes);
  TORCH_CHECK(id_offset >= 0 && id_offset + k * id_bytes <= row_bytes, fn, ": ids do not fit a row");
  TORCH_CHECK(local_experts >= 1 && rank >= 0 && counts.size(0) == local_experts, fn, ": counts must have ",
              local_experts, " entries");
  TORCH_CHECK(qic.size(0) == R && qic.size(1) >= 1 && qic.size(1) <= k, fn, ": qic must be [", R, ", kk <= k]");
  auto fits = [&](const at::Tensor& t, int64_t off, const char* name) {
    TORCH_CHECK(t.size(0) >= local_experts * R, fn, ": '", name, "' must have at least ", local_experts * R, " rows");
    TORCH_CHECK(off >= 0 && off + t.size(1) * int64_t(t.element_size()) <= row_bytes, fn, ": '", name,
                "' rows do not fit a received row from byte ", off);
  };
  fits(out, src_offset, "out");
  if (recv_counts.has_value()) {
    device_ok(*recv_counts, 1);
    const int64_t W = recv_counts->size(0);
    TORCH_CHECK(recv_counts->scalar_type() == at::kLong && W >= 1 && R % W == 0, fn,
                ": recv_counts must be int64 [W] with W dividing the ", R, " received rows");
  }
  if (out2.has_value()) {
    device_ok(*out2, 2);
    fits(*out2, src_offset2, "out2");
  }
}

}  // namespace moecomm_ext

// The bindings' shared text (pybind11 must be included before this macro is used).
#define MOECOMM_EXT_BIND_LOW_LATENCY(m, suffix)                                                               \
  m.def("ll_dispatch_layout", &moecomm_ext::ll_dispatch_layout_##suffix,                                   \
        "LowLatencyBuffer.dispatch, the source: ids into the staged rows, send_tok, bidx (lowlat.h)",          \
        py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_experts"), py::arg("world"), py::arg("kk"), \
        py::arg("staged"), py::arg("id_offset"), py::arg("id_bytes"), py::arg("send_tok"), py::arg("bidx"),   \
        py::arg("send_counts") = py::none());                                                                  \
  m.def("ll_dispatch_place", &moecomm_ext::ll_dispatch_place_##suffix,                                     \
        "LowLatencyBuffer.dispatch, the receiver: rows into the expert-major output, qic, counts (lowlat.h)", \
        py::arg("recv"), py::arg("id_offset"), py::arg("id_bytes"), py::arg("k"), py::arg("rank"),             \
        py::arg("local_experts"), py::arg("out"), py::arg("src_offset"), py::arg("out2"),                       \
        py::arg("src_offset2"), py::arg("qic"), py::arg("counts"), py::arg("recv_counts") = py::none())
