// The router's choice of experts and their gate weights in one pass per token (select_cpu.cpp,
// select_cuda.cu): moecomm.moe.scoring.select_experts for the sigmoid, sqrt-softplus and
// softmax-before-top-k score functions, with an expert bias (choice only), group-limited
// top-k, renormalisation and a scaling factor; and its backward (the logits' gradient from
// the gates'). Arithmetic in the logits' dtype (float32 or float64), as the torch operations.
// See moecomm_ext/_select.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace moecomm_ext {

enum SelectScore : int64_t { kSelectSoftmax = 0, kSelectSigmoid = 1, kSelectSqrtSoftplus = 2 };
constexpr int64_t kSelectMaxK = 32;       // the chosen experts of a token are kept in registers
constexpr int64_t kSelectMaxGroups = 64;  // the chosen groups of a token: one 64-bit mask

#define MOECOMM_SELECT_DECLARE(suffix)                                                                         \
  std::vector<at::Tensor> select_experts_##suffix(const at::Tensor& logits, const std::optional<at::Tensor>& bias, \
                                                  int64_t k, int64_t score, bool normalize, double scale,         \
                                                  int64_t num_groups, int64_t group_topk);                       \
  at::Tensor select_experts_backward_##suffix(const at::Tensor& grad_gates, const at::Tensor& logits,              \
                                              const at::Tensor& idx, int64_t score, bool normalize, double scale)
MOECOMM_SELECT_DECLARE(cpu);
MOECOMM_SELECT_DECLARE(cuda);
#undef MOECOMM_SELECT_DECLARE

#if defined(__CUDACC__)
#define MOECOMM_SELECT_HD __host__ __device__ __forceinline__
#else
#define MOECOMM_SELECT_HD inline
#endif

// the elementwise score of one logit (softmax: exp(l - mx) / sum, given the row's max and sum)
template <typename T>
MOECOMM_SELECT_HD T select_score(int64_t score, T l, T mx, T sum) {
  using std::exp;
  using std::log1p;
  using std::sqrt;
  if (score == kSelectSigmoid) return T(1) / (T(1) + exp(-l));
  if (score == kSelectSqrtSoftplus) return sqrt(l > T(20) ? l : log1p(exp(l)));
  return exp(l - mx) / sum;
}

// a total order of the values, NaN above everything (as torch.topk ranks it)
template <typename T>
MOECOMM_SELECT_HD bool select_greater(T a, T b) {
  const bool an = a != a, bn = b != b;
  return (an || bn) ? (an && !bn) : a > b;
}

template <typename T>
MOECOMM_SELECT_HD bool select_equal(T a, T b) {
  const bool an = a != a, bn = b != b;
  return (an || bn) ? (an && bn) : a == b;
}

// (v, i) comes after (pv, pi) in the order "value descending, then index ascending"
template <typename T>
MOECOMM_SELECT_HD bool select_after(T v, int64_t i, T pv, int64_t pi) {
  return select_greater(pv, v) || (select_equal(v, pv) && i > pi);
}

// softmax's row max and sum of exp(l - max) (the other scores need neither: 0 and 1)
template <typename T>
MOECOMM_SELECT_HD void select_softmax_stats(const T* row, int64_t E, int64_t score, T& mx, T& sum) {
  using std::exp;
  mx = T(0);
  sum = T(1);
  if (score != kSelectSoftmax) return;
  mx = row[0];
  for (int64_t e = 1; e < E; ++e) mx = row[e] > mx ? row[e] : mx;
  sum = T(0);
  for (int64_t e = 0; e < E; ++e) sum += exp(row[e] - mx);
}

// One token: the k experts (idx, in descending order of score + bias, ties to the lower
// index) within its group_topk best groups, and their gates. `row`: the token's E logits;
// `bias`: E values or null. Softmax's max and sum are computed here.
template <typename T>
MOECOMM_SELECT_HD void select_token(const T* row, const T* bias, int64_t E, int64_t k, int64_t score, bool normalize,
                                    T scale, int64_t groups, int64_t group_topk, T* gates, int64_t* idx) {
  T mx, sum;
  select_softmax_stats(row, E, score, mx, sum);
  auto sel = [&](int64_t e) { return select_score(score, row[e], mx, sum) + (bias ? bias[e] : T(0)); };
  uint64_t allowed = ~uint64_t(0);
  if (groups > 1) {
    const int64_t n = E / groups, m = k / group_topk;
    T gs_prev = T(0);
    int64_t g_prev = -1;
    allowed = 0;
    for (int64_t pick = 0; pick < group_topk; ++pick) {  // the group_topk best groups
      T best_v = T(0);
      int64_t best = -1;
      for (int64_t g = 0; g < groups; ++g) {
        // the group's score: the sum of its m largest values
        T s = T(0), pv = T(0);
        int64_t pi = -1;
        for (int64_t j = 0; j < m; ++j) {
          T bv = T(0);
          int64_t bi = -1;
          for (int64_t e = g * n; e < (g + 1) * n; ++e) {
            const T v = sel(e);
            if ((pi < 0 || select_after(v, e, pv, pi)) && (bi < 0 || select_after(bv, bi, v, e))) {
              bv = v;
              bi = e;
            }
          }
          s += bv;
          pv = bv;
          pi = bi;
        }
        if ((g_prev < 0 || select_after(s, g, gs_prev, g_prev)) && (best < 0 || select_after(best_v, best, s, g))) {
          best_v = s;
          best = g;
        }
      }
      allowed |= uint64_t(1) << best;
      gs_prev = best_v;
      g_prev = best;
    }
  }
  const int64_t n = groups > 1 ? E / groups : E;
  T pv = T(0), total = T(0);
  int64_t pi = -1;
  for (int64_t j = 0; j < k; ++j) {
    T bv = T(0);
    int64_t bi = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (groups > 1 && !((allowed >> (e / n)) & 1)) continue;
      const T v = sel(e);
      if ((pi < 0 || select_after(v, e, pv, pi)) && (bi < 0 || select_after(bv, bi, v, e))) {
        bv = v;
        bi = e;
      }
    }
    idx[j] = bi;
    gates[j] = select_score(score, row[bi], mx, sum);
    total += gates[j];
    pv = bv;
    pi = bi;
  }
  if (normalize && k > 1) {
    // softmax: / max(sum, eps); the elementwise scores: / (sum + 1e-20) (as the torch operations)
    const T eps = sizeof(T) == 4 ? T(1.1920928955078125e-07) : T(2.220446049250313e-16);
    const T denom = score == kSelectSoftmax ? (total > eps ? total : eps) : total + T(1e-20);
    for (int64_t j = 0; j < k; ++j) gates[j] = gates[j] / denom;
  }
  if (scale != T(1)) {
    for (int64_t j = 0; j < k; ++j) gates[j] = gates[j] * scale;
  }
}

// One token's logits gradient (E values, written whole) from its gates' gradient `gg` (k).
template <typename T>
MOECOMM_SELECT_HD void select_token_backward(const T* gg, const T* row, const int64_t* idx, int64_t E, int64_t k,
                                             int64_t score, bool normalize, T scale, T* out) {
  using std::exp;
  T mx, sum;
  select_softmax_stats(row, E, score, mx, sum);
  T s[kSelectMaxK], ds[kSelectMaxK];
  T total = T(0), dot = T(0);
  for (int64_t j = 0; j < k; ++j) {
    s[j] = idx[j] >= 0 && idx[j] < E ? select_score(score, row[idx[j]], mx, sum) : T(0);
    total += s[j];
  }
  for (int64_t j = 0; j < k; ++j) {
    ds[j] = gg[j] * scale;
    dot += ds[j] * s[j];
  }
  if (normalize && k > 1) {
    const T eps = sizeof(T) == 4 ? T(1.1920928955078125e-07) : T(2.220446049250313e-16);
    const bool clamped = score == kSelectSoftmax && !(total > eps);
    const T denom = score == kSelectSoftmax ? (clamped ? eps : total) : total + T(1e-20);
    for (int64_t j = 0; j < k; ++j) ds[j] = clamped ? ds[j] / denom : ds[j] / denom - dot / (denom * denom);
  }
  for (int64_t e = 0; e < E; ++e) out[e] = T(0);
  if (score == kSelectSoftmax) {
    T inner = T(0);
    for (int64_t j = 0; j < k; ++j) inner += ds[j] * s[j];
    for (int64_t e = 0; e < E; ++e) out[e] = -select_score(score, row[e], mx, sum) * inner;
    for (int64_t j = 0; j < k; ++j) {
      if (idx[j] >= 0 && idx[j] < E) out[idx[j]] += s[j] * ds[j];
    }
    return;
  }
  for (int64_t j = 0; j < k; ++j) {
    if (idx[j] < 0 || idx[j] >= E) continue;  // (never from select_token: a total order always finds k)
    const T l = row[idx[j]];
    if (score == kSelectSigmoid) {
      out[idx[j]] = ds[j] * s[j] * (T(1) - s[j]);
    } else {  // sqrt(softplus(l)): softplus' = sigmoid(l) (1 above the threshold), then 1 / (2 s)
      const T dsp = l > T(20) ? T(1) : T(1) / (T(1) + exp(-l));
      out[idx[j]] = ds[j] * dsp / (T(2) * s[j]);
    }
  }
}

template <typename DeviceOk>
inline void check_select(const at::Tensor& logits, const std::optional<at::Tensor>& bias, int64_t k, int64_t score,
                         int64_t groups, int64_t group_topk, DeviceOk device_ok) {
  device_ok(logits, 2);
  const int64_t E = logits.size(1);
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble,
              "select_experts: logits must be float32 or float64, got ", logits.scalar_type());
  TORCH_CHECK(k >= 1 && k <= kSelectMaxK && k <= E, "select_experts: k must be in [1, min(", kSelectMaxK, ", E=", E,
              ")], got ", k);
  TORCH_CHECK(score >= kSelectSoftmax && score <= kSelectSqrtSoftplus, "select_experts: bad score code ", score);
  if (groups > 1) {
    TORCH_CHECK(groups <= kSelectMaxGroups && E % groups == 0 && group_topk >= 1 && group_topk <= groups &&
                    k >= group_topk && k / group_topk <= E / groups && k <= group_topk * (E / groups),
                "select_experts: bad groups ", groups, " / group_topk ", group_topk, " for E ", E, " and k ", k);
  }
  if (bias.has_value()) {
    device_ok(*bias, 1);
    TORCH_CHECK(bias->size(0) == E && bias->scalar_type() == logits.scalar_type() &&
                    bias->device() == logits.device(),
                "select_experts: bias must be [E] of the logits' dtype and device");
  }
}

template <typename DeviceOk>
inline void check_select_backward(const at::Tensor& grad_gates, const at::Tensor& logits, const at::Tensor& idx,
                                  int64_t score, DeviceOk device_ok) {
  device_ok(idx, 2);
  device_ok(grad_gates, 2);
  check_select(logits, std::nullopt, idx.size(1), score, 0, 0, device_ok);
  const int64_t T = logits.size(0), k = idx.size(1);
  TORCH_CHECK(grad_gates.size(0) == T && grad_gates.size(1) == k && idx.size(0) == T &&
                  grad_gates.scalar_type() == logits.scalar_type() && idx.scalar_type() == at::kLong,
              "select_experts_backward: grad_gates and idx must be [T, k] (the logits' dtype, int64)");
}

}  // namespace moecomm_ext

#define MOECOMM_EXT_BIND_SELECT(m, suffix)                                                                      \
  m.def("select_experts", &moecomm_ext::select_experts_##suffix, "(gates [T, k], idx [T, k] int64) (select.h)", \
        py::arg("logits"), py::arg("bias"), py::arg("k"), py::arg("score"), py::arg("normalize"),              \
        py::arg("scale"), py::arg("num_groups"), py::arg("group_topk"));                                        \
  m.def("select_experts_backward", &moecomm_ext::select_experts_backward_##suffix,                           \
        "the logits' gradient [T, E] (select.h)", py::arg("grad_gates"), py::arg("logits"), py::arg("idx"),     \
        py::arg("score"), py::arg("normalize"), py::arg("scale"))
