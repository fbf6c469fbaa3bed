// gshard/model/train.hpp — one training step of the MoE Transformer (the
// forward on a tape, the derived backward, Adam) and byte batches from a
// text, both deterministic functions of (seed, step): the same losses at any
// rank count, bit-identical when run twice at the same one, and a resumed
// run continues the same curve.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "gshard/state/checkpoint.hpp"
#include "gshard/model/transformer.hpp"
#include "gshard/state/optim.hpp"

namespace gshard::model {

// B windows of L+1 bytes from text[begin, end), at positions drawn from
// (seed, step, row): every rank cuts the same batch.
inline local_tensor<std::int32_t, 2> text_batch(const std::string& text, std::size_t begin, std::size_t end, index_t B,
                                                index_t L, std::uint64_t seed, std::uint64_t step) {
  if (end < begin + std::size_t(L) + 1)
    throw shape_error("gshard::model::text_batch: " + std::to_string(end - begin) + " bytes of text cannot hold a window of " +
                      std::to_string(L + 1));
  local_tensor<std::int32_t, 2> tok(B, L + 1);
  const std::size_t span = end - begin - std::size_t(L);
  for (index_t b = 0; b < B; ++b) {
    const std::size_t at = begin + std::size_t(uniform(seed, 0xDA7A, step, std::uint64_t(b)) * double(span));
    for (index_t l = 0; l <= L; ++l) tok(b, l) = std::int32_t(static_cast<unsigned char>(text[at + std::size_t(l)]));
  }
  return tok;
}

struct step_result {
  double loss = 0, ce = 0, aux = 0, z = 0;  // this step's, before the update (aux, z: Σ over MoE layers)
  std::vector<moe::gating_stats> moe;  // per MoE layer, summed over every group
  double grad_norm = 0, lr = 0;
};

// Forward on a tape, backward, and one Adam update. `step` counts from 0
// (it seeds the routing noise); the trace's span names it as progress
// lines print it, from 1.
template <class T, mesh_type Mesh, class Roles>
step_result train_step(const transformer<T, Mesh, Roles>& model, parameters<Mesh>& ps, optimizer& opt,
                       const typename transformer<T, Mesh, Roles>::tokens_type& tokens, std::uint64_t step) {
  std::optional<trace::span> step_span;
  if (trace::enabled()) step_span.emplace("train step " + std::to_string(step + 1), "step");
  tape t(ps);
  auto out = [&] {
    trace::span s("forward", "model");
    return model.forward(t, tokens, step);
  }();
  step_result r;
  r.loss = out.loss.value().local()(), r.ce = out.ce, r.aux = out.aux, r.z = out.z;
  if (!std::isfinite(r.loss))  // the same on every rank: the loss is reduced
    throw error("gshard::model::train_step: the loss at step " + std::to_string(step + 1) + " is " + std::to_string(r.loss) +
                " (NaN or Inf in the inputs, the parameters or the gradients)");
  t.backward(out.loss);
  {
    trace::span s("optimizer", "model");
    std::tie(r.grad_norm, r.lr) = opt.update(ps);
  }
  r.moe = std::move(out.moe);
  return r;
}

struct eval_result {
  double ce = 0, aux = 0, z = 0, loss = 0;
  std::vector<moe::gating_stats> moe;  // per MoE layer, summed over the batches
  bool stopped = false;                // cut short by `stop`: the figures are not the mean
};

// Mean loss over `batches` batches of held-out text (no tape, no update).
// `stop`, when given, is asked before each batch (it must answer the same on
// every rank: preemption::requested(mesh) does); a yes ends the evaluation
// there, so a run told to stop saves within its launcher's grace.
template <class T, mesh_type Mesh, class Roles>
eval_result evaluate(const transformer<T, Mesh, Roles>& model, parameters<Mesh>& ps, const std::string& text,
                     std::size_t begin, std::size_t end, index_t B, index_t L, std::uint64_t seed, int batches,
                     const std::function<bool()>& stop = {}) {
  using tokens_t = typename transformer<T, Mesh, Roles>::tokens_type;
  eval_result sum;
  for (int i = 0; i < batches; ++i) {
    if (stop && stop()) {
      sum.stopped = true;
      break;
    }
    tape t(ps, tape::no_grad);
    const auto tok = distribute<tokens_t>(ps.mesh(), text_batch(text, begin, end, B, L, seed ^ 0xE7A1, std::uint64_t(i)));
    const auto out = model.forward(t, tok, std::uint64_t(1) << 40);
    sum.ce += out.ce / batches, sum.aux += out.aux / batches, sum.z += out.z / batches;
    sum.loss += out.loss.value().local()() / batches;
    if (sum.moe.empty()) sum.moe = out.moe;
    else
      for (std::size_t l = 0; l < out.moe.size(); ++l) sum.moe[l] += out.moe[l];
  }
  return sum;
}

// Parameters, the optimizer's state and the model's buffers, as checkpoint parts.
inline std::vector<checkpoint_part> checkpoint_parts(parameters_base& ps, optimizer& opt) {
  std::vector<checkpoint_part> parts{{"param.", &ps.values()}};
  for (const auto& p : opt.state_parts()) parts.push_back(p);
  parts.push_back({"buffer.", &ps.buffers()});
  return parts;
}

}  // namespace gshard::model
