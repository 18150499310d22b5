// The MoE layer's fused capacity step in ATen calls (moecomm_ext/_step.py): the router and
// the dispatch gather, the built-in FFN experts over uniform blocks, the combine's backward,
// the experts' backward, the router's and the dispatch's backward. Each function is the same
// sequence of operations as its reference in moecomm_ext/reference.py (the same bits),
// issued from C++: the host spends a few microseconds per operation instead of a Python
// call's tens. Compiled into both row extensions (host code only); the device's kernels
// come in a StepKernels (step.h).

#include "step.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/threshold_backward.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>
#include <vector>

namespace moecomm_ext {

namespace {

using Opt = std::optional<at::Tensor>;

// The row kernels take contiguous tensors only; every tensor reaching them (or a view()) from
// here goes through these (no copy when it already is): a caller's strided view, or a
// zero-stride one, is copied instead of refused.
at::Tensor dense(const at::Tensor& t) { return t.contiguous(); }
Opt dense(const Opt& t) { return t.has_value() ? Opt(t->contiguous()) : std::nullopt; }

// torch.mm / torch.bmm(..., out_dtype=): looked up at run time, so that the extension builds
// against torch versions without them (the Python side asks for them only where they run)
at::Tensor mm_dtype(const at::Tensor& a, const at::Tensor& b, at::ScalarType t) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("aten::mm", "dtype")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>();
  return op.call(a, b, t);
}

at::Tensor bmm_dtype(const at::Tensor& a, const at::Tensor& b, at::ScalarType t) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("aten::bmm", "dtype")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>();
  return op.call(a, b, t);
}

at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// rows [blocks * El * C, A] @ w[e] (+ bias[e]) per block: w [El, A, B] (used transposed:
// [El, B, A]); as moecomm.moe._ops.seg_gemm.seg_mm on a uniform layout. With a bias every row
// starts as its expert's (a row gather by `row_expert`: a broadcast copy is 4x slower), then
// each block adds its GEMM in place.
at::Tensor block_mm(const StepKernels& kern, const at::Tensor& x, const at::Tensor& w, const Opt& bias,
                    const Opt& row_expert, int64_t El, int64_t C, bool transpose_w) {
  const at::Tensor wt = transpose_w ? w.transpose(1, 2) : w;
  const int64_t R = x.size(0), B = wt.size(2);
  if (C == 0) return at::empty({R, B}, x.options());
  const at::Tensor xb = dense(x).view({-1, El, C, x.size(1)});
  const int64_t nb = xb.size(0);
  if (bias.has_value()) {
    at::Tensor out = kern.gather_rows(dense(*bias), dense(*row_expert), std::nullopt);
    at::Tensor ob = out.view({nb, El, C, B});
    for (int64_t b = 0; b < nb; ++b) ob.select(0, b).baddbmm_(xb.select(0, b), wt);
    return out;
  }
  at::Tensor out = at::empty({R, B}, x.options());
  at::Tensor ob = out.view({nb, El, C, B});
  for (int64_t b = 0; b < nb; ++b) {
    at::Tensor o = ob.select(0, b);
    at::bmm_out(o, xb.select(0, b), wt);
  }
  return out;
}

// sum over blocks of a[rows].T @ g[rows] per expert: [El, A, B] (seg_wgrad)
at::Tensor block_wgrad(const at::Tensor& a, const at::Tensor& g, int64_t El, int64_t C) {
  const int64_t A = a.size(1), B = g.size(1);
  if (C == 0 || a.size(0) == 0) return at::zeros({El, A, B}, a.options());
  const at::Tensor ab = dense(a).view({-1, El, C, A});
  const at::Tensor gb = dense(g).view({-1, El, C, B});
  at::Tensor out = at::bmm(ab.select(0, 0).transpose(1, 2), gb.select(0, 0));
  for (int64_t b = 1; b < ab.size(0); ++b) out.baddbmm_(ab.select(0, b).transpose(1, 2), gb.select(0, b));
  return out;
}

// per-expert column sums [El, B] (seg_sum): with `ones` ([blocks * El * C] of g's dtype),
// one bfloat16 GEMM with float32 sums, else a reduction in the accumulation dtype
at::Tensor block_sum(const at::Tensor& g, int64_t El, int64_t C, const Opt& ones) {
  const int64_t B = g.size(1);
  if (C == 0 || g.size(0) == 0) return at::zeros({El, B}, g.options());
  const at::ScalarType acc = acc_type(g);
  if (ones.has_value()) {
    const at::Tensor blocks = dense(g).view({-1, C, B});
    const int64_t nb = blocks.size(0);
    at::Tensor sums = bmm_dtype(ones->view({nb, 1, C}), blocks, acc);
    at::Tensor s = nb == El ? sums.view({El, B}) : sums.view({-1, El, B}).sum(0);
    return s.to(g.scalar_type());
  }
  return dense(g).view({-1, El, C, B}).sum(at::IntArrayRef{0, 2}, false, acc).to(g.scalar_type());
}

}  // namespace

std::vector<at::Tensor> step_route(const StepKernels& kern, const at::Tensor& x, const at::Tensor& wg, int64_t k,
                                   int64_t capacity, bool normalize, bool gshard, bool wide, bool gather) {
  const int64_t T = x.size(0), E = wg.size(0);
  const at::Tensor logits = wide ? mm_dtype(x, wg.t(), at::kFloat) : at::mm(x.to(at::kFloat), wg.to(at::kFloat).t());
  const at::Tensor scores = at::softmax(logits, 1);
  at::Tensor topv, topi;
  if (T > 0) {
    std::tie(topv, topi) = at::topk(scores, k, 1);
  } else {
    topv = at::empty({0, k}, scores.options());
    topi = at::empty({0, k}, scores.options().dtype(at::kLong));
  }
  std::vector<at::Tensor> rt = kern.route_capacity(dense(topv), dense(topi), E, capacity, normalize);
  // rt: gates, locations, counts, first_counts, token_slots, slot_token, slot_route, slot_gate
  at::Tensor aux;
  if (!gshard) {
    aux = at::zeros({}, scores.options());
  } else if (T > 0) {
    aux = at::mul(at::sum(at::mul(at::sum(scores, {0}), rt[3])), static_cast<double>(E) / (double(T) * double(T)));
  } else {
    aux = at::mul(at::sum(scores), 0.0);
  }
  at::Tensor send = gather ? kern.gather_rows(dense(x), rt[5], std::nullopt) : at::Tensor();  // undefined: None
  return {send, logits, scores, topv, topi, rt[0], rt[1], rt[2], rt[3], rt[4], rt[5], rt[7], aux};
}

std::vector<at::Tensor> step_ffn(const StepKernels& kern, const at::Tensor& rows, const at::Tensor& w1, const Opt& b1,
                                 const at::Tensor& w2, const Opt& b2, const Opt& row_expert, int64_t num_local,
                                 int64_t capacity) {
  at::Tensor h = block_mm(kern, rows, w1, b1, row_expert, num_local, capacity, false);
  h.relu_();
  return {h, block_mm(kern, h, w2, b2, row_expert, num_local, capacity, false)};
}

std::vector<at::Tensor> step_combine_backward(const StepKernels& kern, const at::Tensor& gy,
                                              const at::Tensor& slot_token, const at::Tensor& slot_gate,
                                              const at::Tensor& back, const at::Tensor& token_slots,
                                              at::ScalarType gate_dtype) {
  const at::Tensor g = dense(gy), tokens = dense(token_slots);
  return {kern.gather_rows(g, dense(slot_token), dense(slot_gate)),
          kern.gather_rowdot(g, dense(back), tokens).to(gate_dtype)};
}

std::vector<Opt> step_ffn_backward(const StepKernels& kern, const at::Tensor& gy, const at::Tensor& h, const at::Tensor& rows,
                                   const at::Tensor& w1, const at::Tensor& w2, bool has_b1, bool has_b2,
                                   std::vector<bool> need, int64_t num_local, int64_t capacity, const Opt& ones) {
  // need: rows, w1, b1, w2, b2
  const int64_t El = num_local, C = capacity;
  Opt gw2, gb2, gw1, gb1, grows;
  if (need[3]) gw2 = block_wgrad(h, gy, El, C);
  if (has_b2 && need[4]) gb2 = block_sum(gy, El, C, ones);
  const at::Tensor gh = at::threshold_backward(block_mm(kern, gy, w2, std::nullopt, std::nullopt, El, C, true), h, 0);
  if (need[1]) gw1 = block_wgrad(rows, gh, El, C);
  if (has_b1 && need[2]) gb1 = block_sum(gh, El, C, ones);
  if (need[0]) grows = block_mm(kern, gh, w1, std::nullopt, std::nullopt, El, C, true);
  return {grows, gw1, gb1, gw2, gb2};
}

std::vector<Opt> step_route_backward(const StepKernels& kern, const Opt& grad_send, const at::Tensor& token_slots,
                                     const at::Tensor& grad_gates, const at::Tensor& topk_scores,
                                     const at::Tensor& topk_idx, const at::Tensor& scores, bool normalize,
                                     const Opt& aux_grad, const at::Tensor& aux_counts, double aux_scale,
                                     const at::Tensor& x, const at::Tensor& wg, bool wide, bool need_x,
                                     bool need_wg) {
  Opt gx, gwg;
  if (need_x) gx = kern.gather_reduce_rows(dense(*grad_send), dense(token_slots), std::nullopt);
  if (!(need_x || need_wg)) return {gx, gwg};
  const Opt counts = aux_grad.has_value() ? Opt(aux_counts) : std::nullopt;
  const at::Tensor gl = kern.route_backward(dense(grad_gates), dense(topk_scores), dense(topk_idx),
                                            dense(scores), normalize, dense(aux_grad), dense(counts), aux_scale,
                                            wide);
  const int64_t E = wg.size(0);
  if (wide) {  // gl is [T, 2E] bfloat16: hi | lo of the float32 gradient
    if (need_x) gx = at::add(*gx, at::mm(gl, at::cat({wg, wg}, 0)));
    if (need_wg) {
      const at::Tensor both = mm_dtype(gl.t(), x, at::kFloat);
      gwg = at::add(both.narrow(0, 0, E), both.narrow(0, E, E)).to(wg.scalar_type());
    }
  } else {
    if (need_x) {
      const at::Tensor gxg = gl.mm(wg.to(at::kFloat));
      gx = at::add(*gx, x.scalar_type() == at::kFloat ? gxg : gxg.to(x.scalar_type()));
    }
    if (need_wg) {
      const at::Tensor gw = gl.t().mm(x.to(at::kFloat));
      gwg = wg.scalar_type() == at::kFloat ? gw : gw.to(wg.scalar_type());
    }
  }
  return {gx, gwg};
}

void bind_step(py::module& m, const StepKernels& kern) {
  m.def("step_route", [kern](const at::Tensor& x, const at::Tensor& wg, int64_t k, int64_t capacity, bool normalize,
                             bool gshard, bool wide, bool gather) {
    return step_route(kern, x, wg, k, capacity, normalize, gshard, wide, gather);
  });
  m.def("step_ffn", [kern](const at::Tensor& rows, const at::Tensor& w1, const Opt& b1, const at::Tensor& w2,
                           const Opt& b2, const Opt& row_expert, int64_t num_local, int64_t capacity) {
    return step_ffn(kern, rows, w1, b1, w2, b2, row_expert, num_local, capacity);
  });
  m.def("step_combine_backward", [kern](const at::Tensor& gy, const at::Tensor& slot_token,
                                        const at::Tensor& slot_gate, const at::Tensor& back,
                                        const at::Tensor& token_slots, at::ScalarType gate_dtype) {
    return step_combine_backward(kern, gy, slot_token, slot_gate, back, token_slots, gate_dtype);
  });
  m.def("step_ffn_backward", [kern](const at::Tensor& gy, const at::Tensor& h, const at::Tensor& rows,
                                    const at::Tensor& w1, const at::Tensor& w2, bool has_b1, bool has_b2,
                                    std::vector<bool> need, int64_t num_local, int64_t capacity, const Opt& ones) {
    return step_ffn_backward(kern, gy, h, rows, w1, w2, has_b1, has_b2, std::move(need), num_local, capacity, ones);
  });
  m.def("step_route_backward",
        [kern](const Opt& grad_send, const at::Tensor& token_slots, const at::Tensor& grad_gates,
               const at::Tensor& topk_scores, const at::Tensor& topk_idx, const at::Tensor& scores, bool normalize,
               const Opt& aux_grad, const at::Tensor& aux_counts, double aux_scale, const at::Tensor& x,
               const at::Tensor& wg, bool wide, bool need_x, bool need_wg) {
          return step_route_backward(kern, grad_send, token_slots, grad_gates, topk_scores, topk_idx, scores,
                                     normalize, aux_grad, aux_counts, aux_scale, x, wg, wide, need_x, need_wg);
        });
}

}  // namespace moecomm_ext
