// moecomm.LowLatencyBuffer's dispatch kernels on the CPU (see lowlat.h): one pass over the
// tokens (source) and over the received rows (receiver), in order, which is what makes every
// position deterministic. Decode batches are small: no thread pool.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "lowlat.h"

namespace moecomm_ext {

namespace {

void cpu_ok(const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), "low-latency kernels: a CPU tensor was expected, got one on ", t.device());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous(), "low-latency kernels: a contiguous ", dim,
              "-D tensor was expected, got sizes ", t.sizes(), " strides ", t.strides());
}

int64_t read_id(const uint8_t* p, int64_t id_bytes) {
  if (id_bytes == 2) {
    int16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void write_id(uint8_t* p, int64_t id_bytes, int64_t v) {
  if (id_bytes == 2) {
    const int16_t s = static_cast<int16_t>(v);
    std::memcpy(p, &s, 2);
  } else {
    const int32_t s = static_cast<int32_t>(v);
    std::memcpy(p, &s, 4);
  }
}

}  // namespace

void ll_dispatch_layout_cpu(const at::Tensor& topk_idx, const std::optional<at::Tensor>& num_tokens,
                            int64_t num_experts, int64_t world, int64_t kk, at::Tensor staged, int64_t id_offset,
                            int64_t id_bytes, at::Tensor send_tok, at::Tensor bidx,
                            const std::optional<at::Tensor>& send_counts) {
  check_ll_layout(topk_idx, num_tokens, num_experts, world, kk, staged, id_offset, id_bytes, send_tok, bidx,
                  send_counts, cpu_ok);
  const int64_t M = staged.size(0) - 1, T = topk_idx.size(0), k = topk_idx.size(1), row_bytes = staged.size(1);
  const int64_t E = num_experts, L = E / world;
  const int64_t n = num_tokens.has_value() ? std::clamp<int64_t>(num_tokens->item<int64_t>(), 0, T) : T;
  const int64_t* idx = topk_idx.const_data_ptr<int64_t>();
  uint8_t* rows = staged.mutable_data_ptr<uint8_t>();
  int64_t* tok = send_tok.mutable_data_ptr<int64_t>();
  int64_t* b = bidx.mutable_data_ptr<int64_t>();
  std::fill(tok, tok + world * M, M);
  std::vector<int64_t> filled(static_cast<size_t>(world), 0);
  int64_t v[kLowLatencyMaxK], first[kLowLatencyMaxK], pos[kLowLatencyMaxK];
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = t < n ? idx[t * k + j] : -1;
      v[j] = e >= 0 && e < E ? e : -1;
      write_id(rows + t * row_bytes + id_offset + j * id_bytes, id_bytes, v[j]);
    }
    for (int64_t j = 0; j < k; ++j) {
      first[j] = j;
      for (int64_t i = 0; i < j; ++i) {
        if (v[i] == v[j]) {
          first[j] = i;
          break;
        }
      }
    }
    // the token's place in each destination's block, given at the first slot naming that rank
    for (int64_t j = 0; j < k; ++j) {
      pos[j] = -1;
      if (v[j] < 0) continue;
      const int64_t d = v[j] / L;
      for (int64_t i = 0; i < j && pos[j] < 0; ++i) {
        if (v[i] >= 0 && v[i] / L == d) pos[j] = pos[i];
      }
      if (pos[j] < 0) {
        pos[j] = filled[d]++;
        tok[d * M + pos[j]] = t;
      }
    }
    for (int64_t j = 0; j < k; ++j) {
      if (v[j] < 0) {
        b[t * k + j] = -1;
        continue;
      }
      const int64_t d = v[j] / L;
      int64_t before = 0;  // distinct experts of rank d whose first slot comes before this one's
      for (int64_t i = 0; i < first[j]; ++i) before += v[i] >= 0 && first[i] == i && v[i] / L == d;
      b[t * k + j] = d * M * kk + pos[j] * kk + before;
    }
  }
  if (send_counts.has_value()) std::copy(filled.begin(), filled.end(), send_counts->mutable_data_ptr<int64_t>());
}

void ll_dispatch_place_cpu(const at::Tensor& recv, int64_t id_offset, int64_t id_bytes, int64_t k, int64_t rank,
                           int64_t local_experts, at::Tensor out, int64_t src_offset,
                           const std::optional<at::Tensor>& out2, int64_t src_offset2, at::Tensor qic,
                           at::Tensor counts, const std::optional<at::Tensor>& recv_counts) {
  check_ll_place(recv, id_offset, id_bytes, k, rank, local_experts, out, src_offset, out2, src_offset2, qic, counts,
                 recv_counts, cpu_ok);
  const int64_t R = recv.size(0), row_bytes = recv.size(1), L = local_experts, kk = qic.size(1);
  const int64_t lo = rank * L;
  const uint8_t* rows = recv.const_data_ptr<uint8_t>();
  int64_t* q = qic.mutable_data_ptr<int64_t>();
  int64_t* c = counts.mutable_data_ptr<int64_t>();
  std::fill(c, c + L, 0);
  std::fill(q, q + R * kk, 0);
  const int64_t out_bytes = out.size(1) * int64_t(out.element_size());
  uint8_t* dst = static_cast<uint8_t*>(out.mutable_data_ptr());
  const int64_t out2_bytes = out2.has_value() ? out2->size(1) * int64_t(out2->element_size()) : 0;
  uint8_t* dst2 = out2.has_value() ? static_cast<uint8_t*>(out2->mutable_data_ptr()) : nullptr;
  int64_t v[kLowLatencyMaxK];
  const int64_t W = recv_counts.has_value() ? recv_counts->size(0) : 1, per = R / W;
  const int64_t* sent = recv_counts.has_value() ? recv_counts->const_data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; r < R; ++r) {
    if (sent != nullptr && r % per >= sent[r / per]) continue;  // past what the source sent: stale
    const uint8_t* row = rows + r * row_bytes;
    int64_t i = 0;
    for (int64_t j = 0; j < k; ++j) {
      v[j] = read_id(row + id_offset + j * id_bytes, id_bytes);
      if (v[j] < lo || v[j] >= lo + L) continue;
      bool again = false;
      for (int64_t p = 0; p < j && !again; ++p) again = v[p] == v[j];
      if (again || i >= kk) continue;
      const int64_t e = v[j] - lo;
      const int64_t at = e * R + c[e]++;
      q[r * kk + i++] = at;
      std::memcpy(dst + at * out_bytes, row + src_offset, static_cast<size_t>(out_bytes));
      if (dst2 != nullptr) std::memcpy(dst2 + at * out2_bytes, row + src_offset2, static_cast<size_t>(out2_bytes));
    }
  }
}

}  // namespace moecomm_ext
