// gshard/ad/nn.hpp — the two operations at a language model's ends: the
// embedding lookup (rows of a replicated table by token) and the mean
// cross-entropy of next-token predictions. Both are differentiable ops on a
// tape like those of ad/ops.hpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gshard/ad/ops.hpp"
#include "gshard/detail/softmax_row.hpp"

namespace gshard {

namespace detail {

// Ends the job naming the position of a token outside [lo, hi): a fact of
// this rank's data alone, which the other ranks cannot see.
inline void check_token(std::int32_t v, std::int32_t lo, std::int32_t hi, index_t row, index_t pos, const char* what) {
  if (v < lo || v >= hi)
    mpi::abort_job(("gshard::" + std::string(what) + ": token " + std::to_string(v) + " (row " + std::to_string(row) +
                    " of this rank, position " + std::to_string(pos) + ") is outside the vocabulary of " + std::to_string(hi))
                       .c_str());
}
}  // namespace detail

// x[b, l, :] = table[tokens[b, l], :]. tokens is an int32 tensor [B, L] of
// any sharding without pending sums; the table [V, M] is replicated. The
// table's gradient adds dx's rows into the looked-up rows: a sum over the
// token shards, pending over the axes that split them. Labels: the tokens'
// two and the table's second ("BL" and "VM" give "BLM").
template <class Tok, class P>
  requires(sharded_tensor<Tok> && detail::ad_operand<P>)
auto embedding(tape& t, const Tok& tokens, const P& table_in) {
  static_assert(std::is_same_v<typename Tok::value_type, std::int32_t> && Tok::rank == 2,
                "gshard::embedding: the tokens are an int32 tensor [B, L]");
  static_assert(!detail::has_pending_sums<Tok>(), "gshard::embedding: the tokens have pending sums");
  const auto table = detail::as_var(t, table_in);
  using XT = detail::tensor_of<decltype(table)>;
  using T = typename XT::value_type;
  using Mesh = typename XT::mesh_type;
  static_assert(XT::rank == 2 && XT::resolved == detail::rlayout{}, "gshard::embedding: the table [V, M] is replicated");
  constexpr auto labels = [] {
    if constexpr (Tok::labels.size() == 2 && XT::labels.size() == 2) {
      fixed_string<4> l;
      l.data[0] = Tok::labels[0], l.data[1] = Tok::labels[1], l.data[2] = XT::labels[1];
      return l;
    } else return fixed_string<1>{};
  }();
  using X = tensor<T, 3, Mesh, typename Tok::sharding_type, labels>;  // dims 0, 1 as the tokens'; M whole
  const index_t V = table.extent(0), M = table.extent(1);
  const auto le = tokens.local_extents();
  const std::int32_t* tok = tokens.data();
  X x(tokens.mesh(), {tokens.extent(0), tokens.extent(1), M});
  for (index_t i = 0; i < le[0] * le[1]; ++i) {
    detail::check_token(tok[i], 0, std::int32_t(V), i / le[1], i % le[1], "embedding");
    std::memcpy(x.data() + i * M, table.value().data() + index_t(tok[i]) * M, sizeof(T) * std::size_t(M));
  }
  auto y = t.output(std::move(x), table.tracked());
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), ts = table.slot(), tokens, V, M] {
      auto dx = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dx) return;
      typename detail::sum_over_shards<Tok, 2, T>::type dtable(tokens.mesh(), {V, M});
      dtable.local().setZero();
      const auto le = tokens.local_extents();
      for (index_t i = 0; i < le[0] * le[1]; ++i) {
        T* row = dtable.data() + index_t(tokens.data()[i]) * M;
        const T* d = dx->data() + i * M;
        for (index_t k = 0; k < M; ++k) row[k] += d[k];
      }
      tp->slot<XT>(ts).add(std::move(dtable));
    });
  return y;
}

// The mean over targets of -log softmax(logits)[target], in double: logits
// [.., V] with the class dim whole on each rank, targets an int32 tensor of
// the other dims, sharded like them. A target of -1 is ignored. One
// all_reduce over the axes that split the rows carries the sum and the count;
// the result is replicated.
template <class V, class Tgt>
  requires(var_type<V> && sharded_tensor<Tgt>)
auto cross_entropy(V&& logits_in, const Tgt& targets) {
  using X = detail::tensor_of<V>;
  using T = typename X::value_type;
  using Mesh = typename X::mesh_type;
  constexpr int R = X::rank;
  static_assert(R >= 1 && X::resolved.dims[R - 1].n == 0,
                "gshard::cross_entropy: the class dim (the last) is split; it must be whole on each rank");
  static_assert(!detail::has_pending_sums<X>(), "gshard::cross_entropy: the logits have pending sums; all_reduce them first");
  static_assert(std::is_same_v<typename Tgt::value_type, std::int32_t> && Tgt::rank == R - 1,
                "gshard::cross_entropy: the targets are an int32 tensor of the logits' dims but the last");
  static_assert([] {
    detail::rlayout a = X::resolved;
    return a == Tgt::resolved;
  }(), "gshard::cross_entropy: the targets are not sharded like the logits' rows");
  const var<X> logits = logits_in;
  tape& t = logits.on_tape();
  const index_t C = logits.extent(R - 1);
  const index_t rows = logits.value().local().size() / std::max<index_t>(C, 1);
  const T* lg = logits.value().data();
  const std::int32_t* tg = targets.data();
  using Sum = typename detail::sum_over_shards<X, 1, double>::type;  // sums in double whatever T
  Sum sum(logits.mesh(), {2});  // [Σ -log p, count] over this rank's rows
  std::vector<T> p(static_cast<std::size_t>(C));  // a row's softmax, unused: -log p = log Σ exp - logit, and softmax_row gives log Σ exp
  for (index_t r = 0; r < rows; ++r, lg += C) {
    if (tg[r] == -1) continue;
    detail::check_token(tg[r], 0, std::int32_t(C), r, 0, "cross_entropy");
    sum.data()[0] += detail::softmax_row(lg, C, p.data()) - double(lg[tg[r]]);
    sum.data()[1] += 1;
  }
  const auto total = reshard<replicate>(std::move(sum));  // one all_reduce: the sum and the count
  const double count = total.data()[1];
  tensor<double, 0, Mesh, replicate> mean(logits.mesh(), {});
  mean.local()() = count > 0 ? total.data()[0] / count : 0.0;
  auto y = t.output(std::move(mean), logits.tracked());
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs = logits.slot(), keep = logits.shared(), targets, count] {
      auto dl = tp->slot<tensor<double, 0, Mesh, replicate>>(ys).template take<replicate>();
      if (!dl || count == 0) return;
      const T scale = T(dl->local()() / count);
      const index_t C = keep->extent(R - 1);
      detail::gradient_of<X> dx(keep->mesh(), keep->extents());
      const index_t rows = dx.local().size() / std::max<index_t>(C, 1);
      const T* lg = keep->data();
      T* d = dx.data();
      const std::int32_t* tg = targets.data();
      for (index_t r = 0; r < rows; ++r, lg += C, d += C) {  // (softmax − onehot) · dloss / count
        if (tg[r] == -1) continue;
        detail::softmax_row(lg, C, d);
        for (index_t c = 0; c < C; ++c) d[c] *= scale;
        d[tg[r]] -= scale;
      }
      tp->slot<X>(xs).add(std::move(dx));
    });
  return y;
}

}  // namespace gshard
