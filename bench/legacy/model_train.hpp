// bench/legacy/ (frozen copy of gshard/model/train.hpp — one training step of the MoE Transformer (forward
// with the cache, backward, Adam) and byte batches from a text, both
// deterministic functions of (seed, step): the same losses at any rank count,
// bit-identical when run twice at the same one, and a resumed run continues
// the same curve.
#pragma once

#include <string>


#include "model_transformer.hpp"
#include "optim.hpp"

namespace legacy::model {
using namespace gshard;

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
    const std::size_t at = begin + std::size_t(moe::uniform(seed, 0xDA7A, step, std::uint64_t(b)) * double(span));
    for (index_t l = 0; l <= L; ++l) tok(b, l) = std::int32_t(static_cast<unsigned char>(text[at + std::size_t(l)]));
  }
  return tok;
}

template <class T, mesh_type Mesh>
struct step_result {
  loss value;                         // this step's loss, before the update
  std::vector<moe::gating_stats> moe;  // per MoE layer, summed over every group
  double grad_norm = 0, lr = 0;
};

// Forward, backward and one Adam update on `tokens` [B{data,expert}, L+1].
template <class T, mesh_type Mesh>
step_result<T, Mesh> train_step(const tensor<std::int32_t, 2, Mesh, batch_split<Mesh>>& tokens, params<T, Mesh>& p,
                                adam<params<T, Mesh>>& opt, const config& c, std::uint64_t step) {
  const Mesh& m = tokens.mesh();
  trace::span step_span("train step " + std::to_string(step), "step");
  model_cache<T, Mesh> keep;
  const auto fwd = [&] {
    trace::span s("forward", "model");
    return forward(tokens, p, c, step, moe::dispatch_mode::index, &keep);
  }();
  auto g = backward(tokens, p, c, keep);
  step_result<T, Mesh> r;
  r.value = reduce_loss(fwd.second, c, m);
  if (!std::isfinite(r.value.total))  // the same on every rank: the loss is reduced
    throw error("gshard::model::train_step: the loss at step " + std::to_string(step) + " is " +
                std::to_string(r.value.total) + " (NaN or Inf in the inputs, the parameters or the gradients)");
  {
    trace::span s("optimizer", "model");
    std::tie(r.grad_norm, r.lr) = opt.update(p, g, m);
  }
  for (const auto& s : fwd.second.moe) r.moe.push_back(moe::reduce(s, m));
  return r;
}

// Mean loss over `batches` batches of held-out text (no update).
template <class T, mesh_type Mesh>
loss evaluate(const Mesh& m, const params<T, Mesh>& p, const config& c, const std::string& text, std::size_t begin,
              std::size_t end, index_t B, index_t L, std::uint64_t seed, int batches) {
  loss sum{0, 0, 0};
  for (int i = 0; i < batches; ++i) {
    const auto tok = distribute<batch_split<Mesh>>(m, text_batch(text, begin, end, B, L, seed ^ 0xE7A1, std::uint64_t(i)));
    const auto l = reduce_loss(forward(tok, p, c, std::uint64_t(1) << 40).second, c, m);
    sum.ce += l.ce / batches, sum.aux += l.aux / batches, sum.total += l.total / batches;
  }
  return sum;
}

}  // namespace legacy::model
