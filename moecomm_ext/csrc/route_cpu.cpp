// CPU kernels of the MoE router's capacity routing (moecomm_ext/_route.py), bound by rows_cpu.cpp.
//
//   route_capacity(topk_scores[T,k], topk_idx[T,k] int64, E, C, normalize)   (C = -1: dropless, M = T*k)
//     -> (gates[T,k], locations[T,k] int64, counts[E] int64, first_counts[E],
//         token_slots[T,k] int64, slot_token[E*C] int64, slot_route[E*C] int64, slot_gate[E*C])
//   route_backward(grad_gates[T,k], topk_scores[T,k], topk_idx[T,k], scores[T,E], normalize,
//                  aux_grad[]?, aux_counts[E]?, aux_scale, split_bf16)
//     -> grad_logits[T,E] (scores' dtype), or [T,2E] bfloat16 (hi | lo) with split_bf16
//
// Floating tensors are all float32 or all float64. The semantics (queue order, the sums'
// order) are those of moecomm_ext.reference.route_capacity / route_backward; the Python
// wrappers validate shapes, dtypes and the expert ids before calling.

#include "route.h"

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace moecomm_ext {

namespace {

void check_cpu(const at::Tensor& t, const char* fn, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": '", name, "' must be a CPU tensor");
  TORCH_CHECK(t.dim() == dim, fn, ": '", name, "' must be ", dim, "-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), fn, ": '", name, "' must be contiguous");
}

// The normalised gate of every choice of one token, as the reference computes it:
// v[j] / max(v[0] + v[1] + ... (in that order), eps).
template <typename scalar_t>
scalar_t row_denominator(const scalar_t* v, int64_t k) {
  scalar_t s = v[0];
  for (int64_t j = 1; j < k; ++j) s += v[j];
  const scalar_t eps = std::numeric_limits<scalar_t>::epsilon();
  return s < eps ? eps : s;  // clamp(min=eps); a NaN sum stays NaN
}

}  // namespace

std::vector<at::Tensor> route_capacity_cpu(const at::Tensor& topk_scores, const at::Tensor& topk_idx,
                                           int64_t num_experts, int64_t capacity, bool normalize) {
  constexpr const char* fn = "route_capacity";
  check_cpu(topk_scores, fn, "topk_scores", 2);
  check_cpu(topk_idx, fn, "topk_idx", 2);
  TORCH_CHECK(topk_idx.scalar_type() == at::kLong, fn, ": 'topk_idx' must be int64");
  TORCH_CHECK(topk_idx.sizes() == topk_scores.sizes(), fn, ": 'topk_idx' and 'topk_scores' must have one shape");
  TORCH_CHECK(num_experts >= 1, fn, ": bad num_experts");
  const int64_t T = topk_scores.size(0), K = topk_scores.size(1), E = num_experts;
  const bool dropless = capacity < 0;  // every route kept, expert e's at [start_e, start_e + counts_e)
  const int64_t C = capacity;
  const int64_t M = dropless ? T * K : E * C;
  auto lopt = topk_idx.options();
  at::Tensor gates = at::empty({T, K}, topk_scores.options());
  at::Tensor locations = at::empty({T, K}, lopt);
  at::Tensor counts = at::empty({E}, lopt);
  at::Tensor first_counts = at::empty({E}, topk_scores.options());
  at::Tensor token_slots = at::empty({T, K}, lopt);
  at::Tensor slot_token = at::empty({M}, lopt);
  at::Tensor slot_route = at::empty({M}, lopt);
  at::Tensor slot_gate = at::empty({M}, topk_scores.options());
  AT_DISPATCH_FLOATING_TYPES(topk_scores.scalar_type(), "route_capacity_cpu", [&] {
    const scalar_t* v = topk_scores.const_data_ptr<scalar_t>();
    const int64_t* idx = topk_idx.const_data_ptr<int64_t>();
    scalar_t* g = gates.mutable_data_ptr<scalar_t>();
    int64_t* loc = locations.mutable_data_ptr<int64_t>();
    int64_t* cnt = counts.mutable_data_ptr<int64_t>();
    scalar_t* first = first_counts.mutable_data_ptr<scalar_t>();
    int64_t* ts = token_slots.mutable_data_ptr<int64_t>();
    int64_t* st = slot_token.mutable_data_ptr<int64_t>();
    int64_t* sr = slot_route.mutable_data_ptr<int64_t>();
    scalar_t* sg = slot_gate.mutable_data_ptr<scalar_t>();
    for (int64_t e = 0; e < E; ++e) cnt[e] = 0;
    for (int64_t m = 0; m < M; ++m) {
      st[m] = -1;
      sr[m] = -1;
      sg[m] = scalar_t(0);
    }
    const bool norm = normalize && K > 1;
    for (int64_t t = 0; t < T; ++t) {
      const scalar_t* row = v + t * K;
      if (norm) {
        const scalar_t d = row_denominator(row, K);
        for (int64_t j = 0; j < K; ++j) g[t * K + j] = row[j] / d;
      } else {
        for (int64_t j = 0; j < K; ++j) g[t * K + j] = row[j];
      }
    }
    // queue order: every first choice (in token order), then every second choice, ...
    for (int64_t j = 0; j < K; ++j) {
      if (j == 1) {
        for (int64_t e = 0; e < E; ++e) first[e] = static_cast<scalar_t>(cnt[e]);
      }
      for (int64_t t = 0; t < T; ++t) {
        const int64_t r = t * K + j;
        const int64_t e = idx[r];
        TORCH_CHECK(e >= 0 && e < E, fn, ": 'topk_idx' entry ", r, " = ", e, " is out of range [0, ", E, ")");
        loc[r] = cnt[e]++;
      }
    }
    if (K == 1) {
      for (int64_t e = 0; e < E; ++e) first[e] = static_cast<scalar_t>(cnt[e]);
    } else if (K == 0) {
      for (int64_t e = 0; e < E; ++e) first[e] = scalar_t(0);
    }
    std::vector<int64_t> start(static_cast<size_t>(E), 0);
    for (int64_t e = 1; e < E; ++e) start[e] = start[e - 1] + cnt[e - 1];
    for (int64_t r = 0; r < T * K; ++r) {
      const int64_t e = idx[r], q = loc[r];
      if (dropless || q < C) {
        const int64_t s = dropless ? start[e] + q : e * C + q;
        ts[r] = s;
        st[s] = r / K;
        sr[s] = r;
        sg[s] = g[r];
      } else {
        ts[r] = -1;
      }
    }
  });
  return {gates, locations, counts, first_counts, token_slots, slot_token, slot_route, slot_gate};
}

at::Tensor route_backward_cpu(const at::Tensor& grad_gates, const at::Tensor& topk_scores,
                              const at::Tensor& topk_idx, const at::Tensor& scores, bool normalize,
                              const std::optional<at::Tensor>& aux_grad,
                              const std::optional<at::Tensor>& aux_counts, double aux_scale, bool split_bf16) {
  check_route_backward_args(grad_gates, topk_scores, topk_idx, scores, aux_grad, aux_counts,
                            [](const at::Tensor& t, int64_t dim) { check_cpu(t, "route_backward", "tensor", dim); });
  const int64_t T = scores.size(0), E = scores.size(1), K = topk_idx.size(1);
  const auto dtype = scores.scalar_type();
  at::Tensor out = split_bf16 ? at::empty({T, 2 * E}, scores.options().dtype(at::kBFloat16))
                              : at::empty({T, E}, scores.options());
  AT_DISPATCH_FLOATING_TYPES(dtype, "route_backward_cpu", [&] {
    const scalar_t* gg = grad_gates.const_data_ptr<scalar_t>();
    const scalar_t* v = topk_scores.const_data_ptr<scalar_t>();
    const int64_t* idx = topk_idx.const_data_ptr<int64_t>();
    const scalar_t* p = scores.const_data_ptr<scalar_t>();
    std::vector<scalar_t> dense(static_cast<size_t>(E), scalar_t(0));
    if (aux_grad.has_value()) {
      // (grad * scale) * counts[e]: the GShard loss's gradient w.r.t. every score of column e
      const scalar_t g1 = aux_grad->const_data_ptr<scalar_t>()[0] * static_cast<scalar_t>(aux_scale);
      const scalar_t* c = aux_counts->const_data_ptr<scalar_t>();
      for (int64_t e = 0; e < E; ++e) dense[e] = g1 * c[e];
    }
    const bool norm = normalize && K > 1;
    const scalar_t eps = std::numeric_limits<scalar_t>::epsilon();
    at::parallel_for(0, T, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, E)), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> gin(static_cast<size_t>(E));
      std::vector<scalar_t> gtop(static_cast<size_t>(std::max<int64_t>(K, 1)));
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = v + t * K;
        const scalar_t* grow = gg + t * K;
        if (norm) {
          scalar_t s = row[0];
          for (int64_t j = 1; j < K; ++j) s += row[j];
          const scalar_t d = s < eps ? eps : s;
          // div's gradient w.r.t. the denominator: -grad * ((v / d) / d), summed over the choices
          scalar_t gd = 0;
          for (int64_t j = 0; j < K; ++j) gd += -grow[j] * ((row[j] / d) / d);
          if (!(s >= eps)) gd = 0;  // clamp(min=eps) passes no gradient below eps
          for (int64_t j = 0; j < K; ++j) gtop[j] = grow[j] / d + gd;
        } else {
          for (int64_t j = 0; j < K; ++j) gtop[j] = grow[j];
        }
        std::fill(gin.begin(), gin.end(), scalar_t(0));
        for (int64_t j = 0; j < K; ++j) gin[idx[t * K + j]] = gtop[j];
        const scalar_t* prow = p + t * E;
        scalar_t dot = 0;
        for (int64_t e = 0; e < E; ++e) {
          gin[e] += dense[e];
          dot += gin[e] * prow[e];
        }
        if (split_bf16) {
          c10::BFloat16* o = out.mutable_data_ptr<c10::BFloat16>() + t * 2 * E;
          for (int64_t e = 0; e < E; ++e) {
            const float gl = static_cast<float>(prow[e] * (gin[e] - dot));
            const c10::BFloat16 hi(gl);
            o[e] = hi;
            o[E + e] = c10::BFloat16(gl - static_cast<float>(hi));
          }
        } else {
          scalar_t* o = out.mutable_data_ptr<scalar_t>() + t * E;
          for (int64_t e = 0; e < E; ++e) o[e] = prow[e] * (gin[e] - dot);
        }
      }
    });
  });
  return out;
}

}  // namespace moecomm_ext
