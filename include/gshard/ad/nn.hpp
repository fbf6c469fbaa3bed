// gshard/ad/nn.hpp — the layers a Transformer is built of, on the tape: the
// embedding lookup, the RMS norm, attention (causal, bidirectional, cross,
// with key padding), the feed-forward network
// (relu or SwiGLU; the dense blocks', each expert's and the shared experts'),
// dropout, and the mean cross-entropy of next-token predictions (with label
// smoothing).
//   auto h = rms_norm(x, scale);
//   auto y = x + ffn<at_tokens>(h, w);   // w: ffn_weights, declared once
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gshard/ad/communication.hpp"
#include "gshard/ad/operands.hpp"
#include "gshard/ad/ops.hpp"
#include "gshard/state/parameters.hpp"
#include "gshard/tensor/attention.hpp"
#include "gshard/kernels/softmax_row.hpp"
#include "gshard/layout/random.hpp"

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

// Label smoothing and what cross_entropy reports besides its loss.
struct cross_entropy_options {
  // ε: each target's distribution is (1 − ε)·onehot + ε/V, uniform over the
  // whole vocabulary (Szegedy et al.; PyTorch's CrossEntropyLoss and optax
  // smooth so); Lingvo's UniformLabelSmoother and fairseq give the other
  // V − 1 classes ε/(V − 1) each instead. 0: plain cross-entropy.
  double label_smoothing = 0;
  // Receives the mean cross-entropy without smoothing (carried by the same
  // all_reduce), e.g. to report bits per token while training smoothed.
  double* unsmoothed = nullptr;
};

namespace detail {
// cross_entropy's forward over `rows` rows of C logits: sum[0] += each
// counted row's loss, sum[1] += 1, and with ε > 0 sum[2] += its unsmoothed
// loss. A target of -1 is skipped; any other outside [0, C) ends the job.
template <class T>
void cross_entropy_sums(const T* lg, const std::int32_t* tg, index_t rows, index_t C, double eps, double* sum) {
  std::vector<T> p(static_cast<std::size_t>(C));  // a row's softmax, unused: -log p = log Σ exp - logit, and softmax_row gives log Σ exp
  for (index_t r = 0; r < rows; ++r, lg += C) {
    if (tg[r] == -1) continue;
    check_token(tg[r], 0, std::int32_t(C), r, 0, "cross_entropy");
    const double nll = softmax_row(lg, C, p.data()) - double(lg[tg[r]]);
    if (eps > 0) {
      // −Σ_c q_c log p_c with q = (1 − ε)·onehot + ε/C: (1 − ε)·nll + ε·(lse − mean logit).
      double mean_logit = 0;
      for (index_t c = 0; c < C; ++c) mean_logit += double(lg[c]);
      mean_logit /= double(C);
      sum[0] += (1 - eps) * nll + eps * (nll + double(lg[tg[r]]) - mean_logit);
      sum[2] += nll;
    } else {
      sum[0] += nll;
    }
    sum[1] += 1;
  }
}

// Its gradient: d = (softmax(lg) − q) · scale for each counted row, with q
// the smoothed target (1 − ε)·onehot + ε/C and scale = dloss / count; the
// rows of a -1 target are left as they are (d comes zeroed).
template <class T>
void cross_entropy_gradient(const T* lg, const std::int32_t* tg, index_t rows, index_t C, double eps, T scale, T* d) {
  const T uniform_part = T(eps / double(C)) * scale, target_part = T(1 - eps) * scale;
  for (index_t r = 0; r < rows; ++r, lg += C, d += C) {
    if (tg[r] == -1) continue;
    softmax_row(lg, C, d);
    for (index_t c = 0; c < C; ++c) d[c] = d[c] * scale - uniform_part;
    d[tg[r]] -= target_part;
  }
}
}  // namespace detail

// The mean over targets of -log softmax(logits)[target], in double: logits
// [.., V] with the class dim whole on each rank, targets an int32 tensor of
// the other dims, sharded like them. A target of -1 is ignored. One
// all_reduce over the axes that split the rows carries the sum and the count
// (and with label smoothing the unsmoothed sum); the result is replicated.
template <class V, class Tgt>
  requires(var_type<V> && sharded_tensor<Tgt>)
auto cross_entropy(V&& logits_in, const Tgt& targets, cross_entropy_options o = {}) {
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
  const double eps = o.label_smoothing;
  if (!(eps >= 0 && eps < 1))
    throw error("gshard::cross_entropy: label_smoothing = " + std::to_string(eps) + "; it must lie in [0, 1)");
  const var<X> logits = logits_in;
  tape& t = logits.on_tape();
  const index_t C = logits.extent(R - 1);
  const index_t rows = logits.value().local().size() / std::max<index_t>(C, 1);
  using Sum = typename detail::sum_over_shards<X, 1, double>::type;  // sums in double whatever T
  Sum sum(logits.mesh(), {eps > 0 ? 3 : 2});  // [Σ loss, count(, Σ -log p)] over this rank's rows
  detail::cross_entropy_sums(logits.value().data(), targets.data(), rows, C, eps, sum.data());
  const auto total = reshard<replicate>(std::move(sum));  // one all_reduce: the sums and the count
  const double count = total.data()[1];
  tensor<double, 0, Mesh, replicate> mean(logits.mesh(), {});
  mean.local()() = count > 0 ? total.data()[0] / count : 0.0;
  if (o.unsmoothed) *o.unsmoothed = count > 0 ? total.data()[eps > 0 ? 2 : 0] / count : 0.0;
  auto y = t.output(std::move(mean), logits.tracked());
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs = logits.slot(), keep = logits.shared(), targets, count, eps] {
      auto dl = tp->slot<tensor<double, 0, Mesh, replicate>>(ys).template take<replicate>();
      if (!dl || count == 0) return;
      const index_t C = keep->extent(R - 1);
      detail::gradient_of<X> dx(keep->mesh(), keep->extents());
      detail::cross_entropy_gradient(keep->data(), targets.data(), dx.local().size() / std::max<index_t>(C, 1), C, eps,
                                     T(dl->local()() / count), dx.data());
      tp->slot<X>(xs).add(std::move(dx));
    });
  return y;
}

namespace detail {
// Attention on the tape over the keys `keys` gives each row, and with
// key_lengths (or null) each sequence's valid keys; `what` names the function.
template <class Q, class K, class V, class Len = std::nullptr_t>
auto attention_on_tape(const char* what, const Q& q_in, const K& k_in, const V& v_in, double scale, attention_keys keys,
                       attention_memory memory, const Len* key_lengths = nullptr) {
  tape& t = tape_of(q_in, k_in, v_in);
  const auto q = as_var(t, q_in);
  const auto k = as_var(t, k_in);
  const auto v = as_var(t, v_in);
  using XQ = tensor_of<decltype(q)>;
  using XK = tensor_of<decltype(k)>;
  using XV = tensor_of<decltype(v)>;
  static_assert(check_attention<XQ, XK, XV>());
  using T = typename XQ::value_type;
  const bool track = q.tracked() || k.tracked() || v.tracked();
  auto kept = track && t.recording() ? std::make_shared<attention_kept<T>>() : nullptr;
  // q, k and v held in bf16 (einsum<.., bf16_activation>) are the copies
  // the GEMMs multiply, taken as they are: their fp32 values are never made.
  const bool held = kept && q.held() && k.held() && v.held() && gemm_rounds_to_bf16();
  key_padding padding;
  if constexpr (!std::is_same_v<Len, std::nullptr_t>) {
    static_assert(check_key_padding<XQ, Len>());
    padding = held ? checked_key_padding(*q.held(), *key_lengths, k.extent(1))
                   : checked_key_padding(q.value(), *key_lengths, k.extent(1));
  }
  const auto forward = [&] {
    if constexpr (std::is_same_v<T, float>)
      if (held) {
        kept->q16.hold(q.held()), kept->k16.hold(k.held()), kept->v16.hold(v.held());
        return attention_forward<XQ>(what, *q.held(), *k.held(), *v.held(), scale, keys, std::move(padding), kept.get(),
                                     memory);
      }
    return attention_forward<XQ>(what, q.value(), k.value(), v.value(), scale, keys, std::move(padding), kept.get(), memory);
  };
  auto y = t.output(forward(), track);
  if (y.tracked()) {
    // A rounded forward's backward multiplies the bf16 copies it kept: the
    // fp32 operands are not kept.
    const bool fp32 = !kept->rounded;
    t.record([tp = &t, ys = y.slot(), qs = q.slot(), ks = k.slot(), vs = v.slot(), kq = fp32 ? q.shared() : nullptr,
              kk = fp32 ? k.shared() : nullptr, kv = fp32 ? v.shared() : nullptr, mesh = &q.mesh(), eq = q.extents(),
              ek = k.extents(), kept, scale] {
      auto dy = tp->slot<XQ>(ys).template take<gradient_sharding<typename XQ::sharding_type>>();
      if (!dy) return;
      const auto data = [](const auto& x) { return x ? x->data() : nullptr; };
      auto [dq, dk, dv] = attention_backward<gradient_of<XQ>, gradient_of<XK>, gradient_of<XV>>(
          *dy, data(kq), data(kk), data(kv), *mesh, eq, ek, *kept, scale);
      if (qs >= 0) tp->slot<XQ>(qs).add(std::move(dq));
      if (ks >= 0) tp->slot<XK>(ks).add(std::move(dk));
      if (vs >= 0) tp->slot<XV>(vs).add(std::move(dv));
    });
  }
  return y;
}
}  // namespace detail

// Causal self-attention (gshard/tensor/attention.hpp): q, k and v
// [B, L, N, K] to softmax(causal_mask(scale · q·kᵀ))·v, per sequence in
// blocks of rows, every head at once. Keeps q, k, v and the probabilities [B, N, L, T] (as
// the einsums and softmax it stands for keep them; not the logits), or with
// attention_memory::recompute_probabilities two numbers per row instead.
template <class Q, class K, class V>
  requires(detail::ad_operand<Q> && detail::ad_operand<K> && detail::ad_operand<V>)
auto causal_attention(const Q& q, const K& k, const V& v, double scale,
                      attention_memory memory = attention_memory::keep_probabilities) {
  return detail::attention_on_tape("causal_attention", q, k, v, scale, {}, memory);
}

// dot_product_attention on the tape (gshard/tensor/attention.hpp): every
// key, or a causal prefix at a query offset, per `opts`; with key_lengths
// (int32 [B]) or key paddings ([B, T], 1 at a padded key), split like the
// batch, each sequence's real keys only. Keeps what causal_attention keeps;
// a row that sees no key gets 0 and no gradient.
//   auto ctx = dot_product_attention(q, enc_k, enc_v, src_lengths, scale);            // cross-attention
//   auto o = dot_product_attention(q, k_cache, v_cache, scale, {.causal = true, .query_offset = t});
template <class Q, class K, class V>
  requires(detail::ad_operand<Q> && detail::ad_operand<K> && detail::ad_operand<V>)
auto dot_product_attention(const Q& q, const K& k, const V& v, double scale, attention_options opts = {}) {
  return detail::attention_on_tape("dot_product_attention", q, k, v, scale, detail::keys_of(opts), opts.memory);
}
template <class Q, class K, class V, sharded_tensor Len>
  requires(detail::ad_operand<Q> && detail::ad_operand<K> && detail::ad_operand<V>)
auto dot_product_attention(const Q& q, const K& k, const V& v, const Len& key_lengths, double scale,
                           attention_options opts = {}) {
  return detail::attention_on_tape("dot_product_attention", q, k, v, scale, detail::keys_of(opts), opts.memory, &key_lengths);
}

// Vars mixed with plain tensors: a tensor nobody declared would silently
// receive no gradient, so it does not compile (as einsum's).
template <class Q, class K, class V>
  requires((detail::ad_operand<Q> || detail::ad_operand<K> || detail::ad_operand<V>) &&
           (sharded_tensor<Q> || sharded_tensor<K> || sharded_tensor<V>))
auto causal_attention(const Q&, const K&, const V&, double, attention_memory = attention_memory::keep_probabilities) {
  static_assert(sizeof(Q) == 0,
                "gshard::attention: some operands are vars or parameters, others plain tensors; declare the "
                "tensors as gshard::param (to train them) or pass tape.constant(t) (to hold them fixed)");
}
template <class Q, class K, class V, class... Rest>
  requires((detail::ad_operand<Q> || detail::ad_operand<K> || detail::ad_operand<V>) &&
           (sharded_tensor<Q> || sharded_tensor<K> || sharded_tensor<V>))
auto dot_product_attention(const Q&, const K&, const V&, const Rest&...) {
  static_assert(sizeof(Q) == 0,
                "gshard::attention: some operands are vars or parameters, others plain tensors; declare the "
                "tensors as gshard::param (to train them) or pass tape.constant(t) (to hold them fixed)");
}

namespace detail {
// What rms_norm's rule keeps of a float x where the GEMMs round to bf16:
// x rounded, and each row's r computed from the fp32 x.
struct rms_norm_rounded {
  Eigen::Array<bf16, Eigen::Dynamic, 1> x;  // written whole by to_bf16: Eigen leaves bf16 uninitialised
  std::vector<double> inverse;
};
}  // namespace detail

// GShard's RMS norm over the last dim: x · rsqrt(mean(x²) + eps) · scale.
// The scale's gradient is a sum over x's rows: pending over the axes that
// split them, reduced once with the scale's other contributions. Where the
// GEMMs round to bf16 (float under gemm_rounds_to_bf16()) the rule keeps x
// in bf16 and each row's r in double (the statistic from the fp32 x), not
// the fp32 x: the residual stream a pre-norm block normalises is then
// freed after the forward; the gradients see x rounded (at most 2⁻⁸ relative).
template <class V, class S>
  requires(var_type<V> && detail::ad_operand<S>)
auto rms_norm(V&& x, const S& scale_in, double eps = 1e-6) {
  using X = detail::tensor_of<V>;
  tape& t = x.on_tape();
  const auto sc = detail::as_var(t, scale_in);
  using XS = detail::tensor_of<decltype(sc)>;
  static_assert(XS::rank == 1 && XS::resolved == detail::rlayout{},
                "gshard::rms_norm: the scale is a replicated vector of the last dim's extent");
  const int xs = x.slot(), ss = sc.slot();
  const bool keeps = x.tracked() || sc.tracked();
  std::shared_ptr<detail::rms_norm_rounded> rounded;
  if constexpr (std::is_same_v<typename X::value_type, float>)
    if (keeps && detail::gemm_rounds_to_bf16()) {
      const X& v = x.value();
      const index_t n = v.local().dimension(X::rank - 1), size = index_t(v.local().size());
      rounded = std::make_shared<detail::rms_norm_rounded>();
      rounded->x.resize(size);
      detail::to_bf16(v.data(), std::size_t(size), rounded->x.data());
      rounded->inverse.resize(std::size_t(n > 0 ? size / n : 0));
    }
  std::shared_ptr<const X> keep_x = keeps && !rounded ? x.shared() : nullptr;
  auto y = t.output(detail::rms_norm_keeping(detail::value_of(std::forward<V>(x)), sc.value().local(), eps,
                                             rounded ? rounded->inverse.data() : nullptr),
                    xs >= 0 || ss >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs, ss, keep_x, rounded, keep_s = sc.shared(), eps] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      using DS = typename detail::sum_over_shards<X, 1>::type;
      DS ds(keep_s->mesh(), {keep_s->extent(0)});
      auto dx = rounded ? detail::rms_norm_backward_rounded(std::move(*dy), rounded->x.data(), rounded->inverse.data(),
                                                            keep_s->local(), ds.data())
                        : rms_norm_backward(std::move(*dy), *keep_x, keep_s->local(), ds.data(), eps);
      if (xs >= 0) tp->slot<X>(xs).add(std::move(dx));
      if (ss >= 0) tp->slot<XS>(ss).add(std::move(ds));
    });
  return y;
}

// Positions. The sinusoids of "Attention Is All You Need" as a table
// [P, M] (replicated): channel 2i of position p is sin(p / 10000^(2i/M)),
// channel 2i+1 its cos. Added to token embeddings by looking the table up
// with positions_of(tokens) — embedding(t, positions_of(tok), t.constant(table))
// — or, for learned positions, a declared table of the same shape.
template <class T, mesh_type Mesh>
tensor<T, 2, Mesh, replicate, "PM"> sinusoidal_positions(const Mesh& m, index_t P, index_t M) {
  tensor<T, 2, Mesh, replicate, "PM"> table(m, {P, M});
  for (index_t p = 0; p < P; ++p)
    for (index_t i = 0; i < M; ++i) {
      const double angle = double(p) / std::pow(10000.0, double(i - i % 2) / double(M));
      table.data()[p * M + i] = T(i % 2 == 0 ? std::sin(angle) : std::cos(angle));
    }
  return table;
}

// The position of every token of `tokens` [B, L] (offset + l), sharded and
// labelled like them: the rows to look up in a positions table.
template <sharded_tensor Tok>
Tok positions_of(const Tok& tokens, index_t offset = 0) {
  static_assert(std::is_same_v<typename Tok::value_type, std::int32_t> && Tok::rank == 2,
                "gshard::positions_of: the tokens are an int32 tensor [B, L]");
  Tok pos(tokens.mesh(), tokens.extents());
  const auto le = pos.local_extents();
  const index_t first = pos.offsets()[1];
  for (index_t b = 0; b < le[0]; ++b)
    for (index_t l = 0; l < le[1]; ++l) pos.data()[b * le[1] + l] = std::int32_t(offset + first + l);
  return pos;
}

// x [.., S, M] with every row whose `paddings` [.., S] value is nonzero set
// to 0 — selected, not multiplied, so whatever a padded row held (NaN
// included) is gone — and its gradient 0. `paddings` is sharded like x's
// dims before the last and in x's element type (1: padding, as Lingvo's).
template <class V, sharded_tensor P>
  requires var_type<V>
auto mask_padding(V&& x, const P& paddings) {
  using X = detail::tensor_of<V>;
  using T = typename X::value_type;
  static_assert(P::rank + 1 == X::rank && std::is_same_v<typename P::value_type, T> && P::resolved.partial == 0 &&
                    [] {
                      for (int d = 0; d < P::rank; ++d)
                        if (!(P::resolved.dims[d] == X::resolved.dims[d])) return false;
                      return true;
                    }(),
                "gshard::mask_padding: the paddings are x's dims but the last, sharded like them, in x's element type "
                "and without pending sums");
  for (int d = 0; d < P::rank; ++d)
    if (paddings.extent(d) != x.extent(d))
      throw shape_error("gshard::mask_padding: the paddings " + paddings.notation() + " do not fit " + x.notation());
  tape& t = x.on_tape();
  const int xs = x.slot();
  X v = detail::value_of(std::forward<V>(x));
  const index_t rows = paddings.local().size(), width = rows > 0 ? v.local().size() / rows : 0;
  auto keep = std::make_shared<std::vector<char>>(std::size_t(rows));
  for (index_t r = 0; r < rows; ++r)
    if (((*keep)[std::size_t(r)] = paddings.data()[r] == T(0)) == 0) std::fill_n(v.data() + r * width, width, T(0));
  auto y = t.output(std::move(v), xs >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs, keep, width] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      for (std::size_t r = 0; r < keep->size(); ++r)
        if (!(*keep)[r]) std::fill_n(dy->data() + index_t(r) * width, width, T(0));
      tp->slot<X>(xs).add(std::move(*dy));
    });
  return y;
}

namespace detail {
// row[j] = keep(lo + j) ? row[j] · scale : 0 for j < n, keep(lo) = random_bits32(row_key, lo)
// ≥ at_least (lo + n ≤ 2^32). Blocks of 16: a loop of fixed length over arguments that no
// store can change, which GCC vectorizes at -O2 in 32-bit lanes.
template <class T>
void dropout_row(T* row, index_t n, std::uint32_t lo, std::uint64_t row_key, std::uint32_t at_least, T scale) {
  const auto kept = [=](T x, std::uint32_t at) { return random_bits32(row_key, at) >= at_least ? x * scale : T(0); };
  index_t j = 0;
  for (; j + 16 <= n; j += 16) {
    T* x = row + j;
    const std::uint32_t at = lo + std::uint32_t(j);
    for (int k = 0; k < 16; ++k) x[k] = kept(x[k], at + std::uint32_t(k));
  }
  for (; j < n; ++j) row[j] = kept(row[j], lo + std::uint32_t(j));
}

// Dropout's mask at one rate for one (seed, stream): x[j] ·= keep(g + j) / (1 − rate),
// keep(g) = uniform32(seed, stream, g) ≥ rate, a dropped element 0 whatever it held.
template <class T>
class dropout_mask {
 public:
  dropout_mask(double rate, std::uint64_t seed, std::uint64_t stream)
      : key_(random_key(seed, stream)), at_least_(random_threshold32(rate)), scale_(T(1.0 / (1.0 - rate))) {}
  // The n elements from x, at global indices g, g + 1, …
  void apply(T* x, index_t n, std::uint64_t g) {
    if (at_least_ > 0xFFFFFFFFu) {  // no 32-bit draw reaches a rate this close to 1
      std::fill_n(x, n, T(0));
      return;
    }
    while (n > 0) {  // in segments that do not cross a multiple of 2^32, each with its row key
      const index_t m = index_t(std::min<std::uint64_t>(std::uint64_t(n), (std::uint64_t(1) << 32) - (g & 0xFFFFFFFFu)));
      if ((g >> 32) != hi_) hi_ = g >> 32, row_key_ = random_key32(key_, hi_);
      dropout_row(x, m, std::uint32_t(g), row_key_, std::uint32_t(at_least_), scale_);
      x += m, g += std::uint64_t(m), n -= m;
    }
  }

 private:
  std::uint64_t key_, at_least_;
  T scale_;
  std::uint64_t hi_ = ~std::uint64_t(0), row_key_ = 0;  // the row key of the last segment's high bits
};

// Dropout's mask over t, keyed by each element's global index.
template <class X>
void apply_dropout(X& t, double rate, std::uint64_t seed, std::uint64_t stream) {
  dropout_mask<typename X::value_type> mask(rate, seed, stream);
  for_each_global_row(t, [&](index_t i, std::uint64_t g, index_t n) { mask.apply(t.data() + i, n, g); });
}
}  // namespace detail

// Inverted dropout: each element of x kept with probability 1 − rate and
// scaled by 1 / (1 − rate), or set to 0. Whether element i is kept is
// uniform32(seed, stream, i's global index) ≥ rate: a function of the
// element's place in the global tensor, so every rank count drops the same
// elements, and the backward draws the same mask again instead of keeping
// it. Give each use its own stream (a step and a site). A rate of 0 is x
// itself; pending sums are fine (the mask is linear and the same on every
// rank holding a part).
template <class V>
  requires var_type<V>
auto dropout(V&& x, double rate, std::uint64_t seed, std::uint64_t stream) {
  using X = detail::tensor_of<V>;
  if (!(rate >= 0 && rate < 1)) throw error("gshard::dropout: rate = " + std::to_string(rate) + "; it must lie in [0, 1)");
  if (rate == 0) return var<X>(std::forward<V>(x));
  tape& t = x.on_tape();
  const int xs = x.slot();
  X v = detail::value_of(std::forward<V>(x));
  detail::apply_dropout(v, rate, seed, stream);
  auto y = t.output(std::move(v), xs >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs, rate, seed, stream] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      detail::apply_dropout(*dy, rate, seed, stream);
      tp->slot<X>(xs).add(std::move(*dy));
    });
  return y;
}

// The feed-forward network: GShard's relu(x·w1)·w2, or the gated SwiGLU
// (silu(x·w1) ⊙ (x·w1_up))·w2 of PaLM and Llama.
enum class ffn_kind : std::uint8_t { relu, swiglu };

// An FFN's weights: w1 and (SwiGLU) w1_up [.., M, H], w2 [.., H, M] — W1 and
// W2 name the tensor types, e.g. [M,H{model}] and [H{model},M] for a dense
// block, [E{expert},M,H] and [E{expert},H,M] for the experts. They are
// declared in the order ffn() uses them (w1, w1_up, w2), so their gradients
// complete in the reverse of that order, which the gradient buckets and the
// cost model's list of weights follow.
template <class W1, class W2>
struct ffn_weights {
  param<W1> w1;
  std::optional<param<W1>> w1_up;  // SwiGLU
  param<W2> w2;

  // Declares names[0], names[1] (SwiGLU only) and names[2]: w1 and w1_up of
  // extents `in` ([.., M, H]), w2 of `out` ([.., H, M]), each drawn from
  // normal(1/√fan-in).
  template <class Mesh>
  ffn_weights(parameters<Mesh>& ps, ffn_kind kind, const std::array<std::string, 3>& names, const typename W1::extents_type& in,
              const typename W2::extents_type& out)
      : w1(ps, names[0], in, init::normal(1.0 / std::sqrt(double(in[W1::rank - 2])))),
        w1_up(kind == ffn_kind::swiglu
                  ? std::optional<param<W1>>(std::in_place, ps, names[1], in, init::normal(1.0 / std::sqrt(double(in[W1::rank - 2]))))
                  : std::nullopt),
        w2(ps, names[2], out, init::normal(1.0 / std::sqrt(double(out[W2::rank - 2])))) {}
};

namespace detail {
// The FFN's two einsums for an input labelled X ("BLM", "EGCM", ...), its
// last label the model dim: X,W1->Xh (Xh: X with W1's last label, the
// hidden dim, in place of its last) and Xh,W2->X.
template <fixed_string X, fixed_string W1, fixed_string W2>
struct ffn_specs {
  static constexpr std::size_t nx = X.size(), n1 = W1.size(), n2 = W2.size();
  static constexpr auto up = [] {
    fixed_string<2 * nx + n1 + 4> s;
    std::size_t i = 0;
    for (std::size_t j = 0; j < nx; ++j) s.data[i++] = X[j];
    s.data[i++] = ',';
    for (std::size_t j = 0; j < n1; ++j) s.data[i++] = W1[j];
    s.data[i++] = '-', s.data[i++] = '>';
    for (std::size_t j = 0; j + 1 < nx; ++j) s.data[i++] = X[j];
    s.data[i++] = W1[n1 - 1];
    return s;
  }();
  static constexpr auto down = [] {
    fixed_string<2 * nx + n2 + 4> s;
    std::size_t i = 0;
    for (std::size_t j = 0; j + 1 < nx; ++j) s.data[i++] = X[j];
    s.data[i++] = W1[n1 - 1];
    s.data[i++] = ',';
    for (std::size_t j = 0; j < n2; ++j) s.data[i++] = W2[j];
    s.data[i++] = '-', s.data[i++] = '>';
    for (std::size_t j = 0; j < nx; ++j) s.data[i++] = X[j];
    return s;
  }();
};
}  // namespace detail

// The FFN on x [.., M] (a labelled var): relu(x·w1)·w2 or SwiGLU, the output
// resharded by `Out` (rules or a sharding: e.g. at_tokens, whose model axes
// turn w2's contraction over a split H into one all_reduce).
//   auto y = ffn<at_tokens>(h, block.ffn);                  // [B,L,M]: "BLM,MH->BLH", "BLH,HM->BLM"
//   auto ye = ffn<at_experts>(xe, experts);                  // [E,G,C,M]: "EGCM,EMH->EGCH", "EGCH,EHM->EGCM"
// An rvalue x is given up at its last einsum, as the hidden activations are
// at theirs: under bf16 GEMMs each fp32 tensor is then freed once rounded,
// and ReLU's hidden layer is never fp32 (held in bf16: bf16_activation).
template <class Out, class V, class W1, class W2>
  requires var_type<V>
auto ffn(V&& x, const ffn_weights<W1, W2>& w) {
  using S = detail::ffn_specs<detail::tensor_of<V>::label_string, W1::label_string, W2::label_string>;
  auto h = [&] {
    if (!w.w1_up) return relu(einsum<S::up, natural_sharding, bf16_activation>(std::forward<V>(x), w.w1));
    auto gated = silu(einsum<S::up>(std::as_const(x), w.w1));  // w1 before w1_up: their declaration order
    return std::move(gated) * einsum<S::up>(std::forward<V>(x), *w.w1_up);
  }();
  return einsum<S::down, Out>(std::move(h), w.w2);
}

}  // namespace gshard
