// gshard/tensor/attention.hpp — attention in one operation:
//   o = causal_attention(q, k, v, scale)
// is einsum<"BNLT,BTNK->BLNK">(causal_softmax(einsum<"BLNK,BTNK->BNLT">(q, k),
// scale), v), and dot_product_attention(q, k, v, [key_lengths,] scale, opts)
// the same with the keys each row sees chosen: all (an encoder's
// self-attention, cross-attention), a causal prefix at a query offset
// (decoding with a cache), and each sequence's valid keys (key padding).
// Computed per sequence in blocks of rows, every head at once (kernels/attention.hpp):
// the [B, N, L, T] logits never go through memory whole and the columns no
// row sees are not computed.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gshard/core/counters.hpp"
#include "gshard/kernels/attention.hpp"
#include "gshard/core/error.hpp"
#include "gshard/tensor/ops.hpp"
#include "gshard/tensor/tensor.hpp"
#include "gshard/runtime/mpi.hpp"
#include "gshard/runtime/trace.hpp"

namespace gshard {

// What causal_attention keeps on a tape for its backward: q, k, v and the
// probabilities, or two numbers per row from which the backward computes
// each block's probabilities again (FlashAttention's trade: one more QKᵀ
// GEMM and exp per block; the gradients are the same bit for bit).
enum class attention_memory {
  keep_probabilities,       // [B, N, L, T]: the backward reads them
  recompute_probabilities,  // two numbers per row, [B, N, L]: the backward computes each block's again
};

namespace detail {

// Two operands' labels agree where both have them: at the batch, head and
// head dim, and at the position too when `position` (k and v).
template <class A, class B>
constexpr bool attention_labels_agree(bool position) {
  if constexpr (A::labels.size() == 0 || B::labels.size() == 0) return true;
  else
    return A::labels[0] == B::labels[0] && A::labels[2] == B::labels[2] && A::labels[3] == B::labels[3] &&
           (!position || A::labels[1] == B::labels[1]);
}

// The compile-time checks on attention's operands (one message, the first
// that fails).
template <class Q, class K, class V>
constexpr bool check_attention() {
  if constexpr (Q::rank != 4 || K::rank != 4 || V::rank != 4) {
    static_assert(Q::rank == 4 && K::rank == 4 && V::rank == 4,
                  "gshard::attention: q, k and v are rank-4 tensors [B, L, N, K] (batch, position, head, head dim)");
    return false;
  } else if constexpr (!std::is_same_v<typename Q::value_type, typename K::value_type> ||
                       !std::is_same_v<typename Q::value_type, typename V::value_type> ||
                       !std::floating_point<typename Q::value_type>) {
    static_assert(sizeof(Q) == 0, "gshard::attention: q, k and v hold one floating-point element type");
    return false;
  } else if constexpr (!std::is_same_v<typename Q::mesh_type, typename K::mesh_type> ||
                       !std::is_same_v<typename Q::mesh_type, typename V::mesh_type> || !(Q::resolved == K::resolved) ||
                       !(Q::resolved == V::resolved)) {
    static_assert(sizeof(Q) == 0, "gshard::attention: q, k and v are sharded differently; reshard them to one sharding");
    return false;
  } else if constexpr (has_pending_sums<Q>()) {
    static_assert(sizeof(Q) == 0, "gshard::attention: q, k and v have pending sums; all_reduce them first");
    return false;
  } else if constexpr (Q::resolved.dims[1].n != 0 || Q::resolved.dims[3].n != 0) {
    static_assert(sizeof(Q) == 0,
                  "gshard::attention: the position or head dim (1 or 3) is split; attention needs them whole on each rank");
    return false;
  } else if constexpr (!attention_labels_agree<Q, K>(false) || !attention_labels_agree<Q, V>(false) ||
                       !attention_labels_agree<K, V>(true)) {
    static_assert(sizeof(Q) == 0,
                  "gshard::attention: the labels disagree; k and v carry the same ones, and q shares their batch, "
                  "head and head dim (\"BLNK\", \"BTNK\", \"BTNK\")");
    return false;
  } else {
    return true;
  }
}

// "f32[4{data},8,2,16]", or with labels "f32[B{data},L,N,K] = [4,8,2,16]".
template <class X>
std::string shape_text(const X& x) {
  return X::labels.empty() ? x.notation() : x.notation() + " = " + extents_string(x.extents());
}

// The operands' extents checked against each other and against the keys
// each row sees (the same on every rank: global extents), and this rank's.
// `what` names the function in the messages; T is the element type the
// blocks compute in (q's, or fp32 for bf16 copies under bf16 GEMMs).
template <class Q, class K, class V, class T = typename Q::value_type>
attention_extents attention_shape(const char* what, const Q& q, const K& k, const V& v, const attention_keys& keys,
                                  double scale) {
  const std::string at = std::string("gshard::") + what + ": ";
  if (&q.mesh() != &k.mesh() || &q.mesh() != &v.mesh()) throw shape_error(at + "q, k and v are placed on different meshes");
  if (!(scale > 0) || !std::isfinite(scale))
    throw error(at + "scale = " + std::to_string(scale) + "; a finite number > 0 (1/sqrt(K) as a rule)");
  if (k.extents() != v.extents() || q.extent(0) != k.extent(0) || q.extent(2) != k.extent(2) || q.extent(3) != k.extent(3))
    throw shape_error(at + "q " + shape_text(q) + ", k " + shape_text(k) + ", v " + shape_text(v) +
                      ": k and v have equal extents [B, T, N, K], and q [B, L, N, K] the same B, N and K");
  if (keys.causal && (keys.offset < 0 || keys.offset + q.extent(1) != k.extent(1)))
    throw shape_error(at + "causal attention of L = " + std::to_string(q.extent(1)) + " queries at query_offset " +
                      std::to_string(keys.offset) + " over T = " + std::to_string(k.extent(1)) +
                      " keys; the last query must sit at the last key (query_offset + L = T, as when L new queries "
                      "follow T - L cached keys), or drop causal for cross-attention");
  const auto lq = q.local_extents(), lk = k.local_extents();
  // No block longer than the sequence: its scratch is [heads, rows, T].
  const index_t rows = std::max<index_t>(1, std::min(attention_block_rows<T>(), lq[1]));
  return {lq[0], lq[1], lk[1], lq[2], lq[3], keys, rows};
}

// Which keys each sequence has: valid counts, or a mask of padded keys.
struct key_padding {
  std::vector<index_t> lengths;  // per sequence of this rank, or empty
  std::vector<char> valid;       // [batch, T], or empty
  std::vector<index_t> counted;  // [batch, T + 1]: the valid keys before t
  bool empty() const { return lengths.empty() && valid.empty(); }
  attention_keys bind(attention_keys k) const {
    k.lengths = lengths.empty() ? nullptr : lengths.data();
    k.valid = valid.empty() ? nullptr : valid.data();
    k.counted = counted.empty() ? nullptr : counted.data();
    return k;
  }
};

// This rank's keys from key_lengths [B] (int32: each in [0, T]) or key
// paddings [B, T] (in q's type: 0 a key, 1 padding), sharded like the
// batch; any other value ends the job naming it — a fact of this rank's
// data alone.
template <class Len>
key_padding key_padding_of(const char* what, const Len& keys, index_t T) {
  key_padding out;
  const auto bad = [&](const std::string& v, index_t b, const std::string& allowed) {
    mpi::abort_job(("gshard::" + std::string(what) + ": " + (Len::rank == 1 ? "key_lengths" : "key_paddings") + " holds " +
                    v + " (sequence " + std::to_string(keys.offsets()[0] + b) + "), " + allowed)
                       .c_str());
  };
  const index_t B = keys.local_extents()[0];
  if constexpr (Len::rank == 1) {
    out.lengths.resize(std::size_t(B));
    for (index_t b = 0; b < B; ++b) {
      const index_t n = keys.data()[b];
      if (n < 0 || n > T) bad(std::to_string(n), b, "outside [0, T = " + std::to_string(T) + "]");
      out.lengths[std::size_t(b)] = n;
    }
  } else {
    out.valid.resize(std::size_t(B * T));
    out.counted.assign(std::size_t(B * (T + 1)), 0);
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < T; ++t) {
        const auto v = keys.data()[b * T + t];
        if (v != 0 && v != 1) {
          char text[32];
          std::snprintf(text, sizeof text, "%g", double(v));
          bad(text, b, "neither 0 (a key) nor 1 (padding)");
        }
        out.valid[std::size_t(b * T + t)] = v == 0;
        out.counted[std::size_t(b * (T + 1) + t + 1)] = out.counted[std::size_t(b * (T + 1) + t)] + (v == 0);
      }
  }
  return out;
}

// The FLOPs of the dense einsums over the global extents, this rank's share
// (the convention of model_flops()). Model FLOPs (counters.hpp) count the
// dense einsums attention stands for, so a step's model FLOPs and MFU do not
// depend on how attention is computed (as PaLM's MFU counts attention).
template <class Q, class K>
double attention_model_flops(const Q& q, const K& k) {
  const attention_extents g{q.extent(0), q.extent(1), k.extent(1), q.extent(2), q.extent(3)};
  return g.dense_flops() / double(q.mesh().nranks());
}

// The trace span gives the FLOPs the blocks run ("flops") and the dense count
// ("dense_flops").
inline void trace_attention(const char* name, double t0, const attention_extents& e, double passes) {
  if (trace::enabled())
    trace::add(name, "einsum", t0, trace::now(),
               "\"flops\":" + std::to_string(passes * e.block_flops()) +
                   ",\"dense_flops\":" + std::to_string(passes * e.dense_flops()));
}

// A bf16 copy of q, k or v that the GEMMs read: rounded here from the fp32
// tensor, or the bf16 tensor of a var held in bf16 (ad/var.hpp), kept alive.
struct bf16_copy {
  aligned_buffer<bf16> rounded;
  std::shared_ptr<const void> held;
  const bf16* data = nullptr;
  template <class X>
  void round(const X& x) {
    rounded.resize(x.local().size());
    to_bf16(x.data(), std::size_t(x.local().size()), rounded.data());
    data = rounded.data();
  }
  template <class X16>
  void hold(std::shared_ptr<const X16> x) {
    data = x->data();
    held = std::move(x);
  }
};

// What the forward keeps for the backward: the probabilities
// (attention_extents::probs_size() elements, aligned), or each row's
// softmax_row_stats (batch · heads · L), or nothing. Where its GEMMs round
// (fp32 under gemm_rounds_to_bf16()), the bf16 copies they read instead of
// q, k, v and fp32 probabilities (kernels/attention.hpp's attention_copies):
// the rule then keeps no fp32 operand, half the bytes.
template <class T>
struct attention_kept {
  attention_kept() = default;
  attention_kept(const attention_kept&) = delete;  // keys points into padding
  attention_kept& operator=(const attention_kept&) = delete;
  attention_memory memory = attention_memory::keep_probabilities;
  aligned_buffer<T> probs;
  std::vector<softmax_row_stats<T>> stats;
  attention_keys keys;   // the rows' keys, pointing into
  key_padding padding;   // ... these
  const char* what = "";  // the function, for messages and the trace
  attention_extents shape;  // this rank's, as the forward checked them
  double model_flops = 0;   // attention_model_flops of the forward
  bool rounded = false;     // the copies below hold what the GEMMs read
  bf16_copy q16, k16, v16;
  aligned_buffer<bf16> probs16;
  attention_copies copies() {
    return {q16.data, k16.data, v16.data, memory == attention_memory::keep_probabilities ? probs16.data() : nullptr};
  }
};

// o (of type Out) = attention of q, k, v (checked) over the keys `keys` and
// `padding` give each row, keeping in `kept` (unless null) what `memory`
// says. q, k and v are Out's element type — or bf16 for an fp32 Out whose
// GEMMs round (tensors held in bf16, ad/var.hpp), already held by kept's
// copies (bf16_copy::hold), which the forward then multiplies as they are.
template <class Out, class Q, class K, class V>
Out attention_forward(const char* what, const Q& q, const K& k, const V& v, double scale, attention_keys keys,
                      key_padding padding, attention_kept<typename Out::value_type>* kept,
                      attention_memory memory = attention_memory::keep_probabilities) {
  using T = typename Out::value_type;
  constexpr bool held = std::is_same_v<typename Q::value_type, bf16> && std::is_same_v<T, float>;
  static_assert(std::is_same_v<typename Q::value_type, typename K::value_type> &&
                std::is_same_v<typename Q::value_type, typename V::value_type> &&
                (held || std::is_same_v<typename Q::value_type, T>));
  if constexpr (held)  // (an empty shard's copy has no data, but is held)
    if (!kept || !kept->q16.held || !kept->k16.held || !kept->v16.held)
      throw error(std::string("gshard::") + what + ": bf16 q, k and v without their copies held (a gshard bug)");
  if (kept) {
    kept->padding = std::move(padding);
    keys = kept->padding.bind(keys);
    kept->keys = keys;
    kept->what = what;
  } else {
    keys = padding.bind(keys);
  }
  const attention_extents e = attention_shape<Q, K, V, T>(what, q, k, v, keys, scale);
  typename Out::local_type o(q.local_extents());
  T* probs = nullptr;
  softmax_row_stats<T>* stats = nullptr;
  const double model_flops = attention_model_flops(q, k);
  attention_copies copies;
  if (kept) {
    kept->memory = memory;
    kept->shape = e;
    kept->model_flops = model_flops;
    if constexpr (std::is_same_v<T, float>)
      if (held || gemm_rounds_to_bf16()) {
        if constexpr (!held) kept->q16.round(q), kept->k16.round(k), kept->v16.round(v);
        if (memory == attention_memory::keep_probabilities) kept->probs16.resize(e.probs_size());
        kept->rounded = true;
        copies = kept->copies();
      }
  }
  if (kept && memory == attention_memory::keep_probabilities && !kept->rounded) {
    kept->probs.resize(e.probs_size());
    probs = kept->probs.data();
  } else if (kept && memory != attention_memory::keep_probabilities) {
    kept->stats.resize(std::size_t(e.batch * e.heads * e.L));
    stats = kept->stats.data();
  }
  const double t0 = trace::enabled() ? trace::now() : 0.0;
  const auto fp32 = [](const auto& x) -> const T* {  // a held operand's: read through its copy only
    if constexpr (held) return nullptr;
    else return x.data();
  };
  attention_forward_blocks<T>(e, fp32(q), fp32(k), fp32(v), T(scale), o.data(), probs, stats,
                              kept && kept->rounded ? &copies : nullptr);
  add_model_flops(model_flops);
  trace_attention(what, t0, e, 1.0);
  return Out(q.mesh(), q.extents(), std::move(o));
}

// {dq, dk, dv} (of the types given: on `mesh`, q's extents eq, k's and v's
// ek) from dy and what the forward kept — and the forward's q, k and v,
// which a rounded forward's backward does not read (they may be null).
template <class DQ, class DK, class DV, class DY, class T = typename DY::value_type>
std::tuple<DQ, DK, DV> attention_backward(const DY& dy, const T* q, const T* k, const T* v,
                                          const typename DQ::mesh_type& mesh, const typename DQ::extents_type& eq,
                                          const typename DQ::extents_type& ek, attention_kept<T>& kept, double scale) {
  const attention_extents& e = kept.shape;
  typename DQ::local_type dq(e.batch, e.L, e.heads, e.dim);
  typename DK::local_type dk(e.batch, e.T, e.heads, e.dim);
  typename DV::local_type dv(e.batch, e.T, e.heads, e.dim);
  const bool again = kept.memory != attention_memory::keep_probabilities;  // as the forward kept
  const attention_copies copies = kept.rounded ? kept.copies() : attention_copies{};
  const double t0 = trace::enabled() ? trace::now() : 0.0;
  attention_backward_blocks<T>(e, dy.data(), q, k, v, again || kept.rounded ? nullptr : kept.probs.data(), T(scale),
                               dq.data(), dk.data(), dv.data(), again ? kept.stats.data() : nullptr,
                               kept.rounded ? &copies : nullptr);
  add_model_flops(2 * kept.model_flops);  // the four einsums of the two's backward
  if (again) {  // the logits computed again: work the hardware repeats, not the model's
    recomputing_flops r;
    add_model_flops(kept.model_flops / 2);
  }
  trace_attention((std::string(kept.what) + " backward").c_str(), t0, e, again ? 2.5 : 2.0);
  return {DQ(mesh, eq, std::move(dq)), DK(mesh, ek, std::move(dk)), DV(mesh, ek, std::move(dv))};
}

}  // namespace detail

// Which keys each query row sees in dot_product_attention, and what its
// tape keeps. causal: row l sees the keys t <= query_offset + l (a decoder;
// query_offset + L = T, e.g. the keys cached before L new queries); else
// every key (an encoder's self-attention, cross-attention).
struct attention_options {
  bool causal = false;
  index_t query_offset = 0;
  attention_memory memory = attention_memory::keep_probabilities;
};

namespace detail {
// The keys' padding checked against q's type: key_lengths int32 [B], or
// key paddings [B, T] in q's element type; the batch split as q's, T whole.
template <class Q, class Len>
constexpr bool check_key_padding() {
  static_assert(((Len::rank == 1 && std::is_same_v<typename Len::value_type, std::int32_t>) ||
                 (Len::rank == 2 && std::is_same_v<typename Len::value_type, typename Q::value_type> &&
                  Len::resolved.dims[1 % Len::rank].n == 0)) &&
                    Len::resolved.dims[0] == Q::resolved.dims[0] && Len::resolved.partial == 0,
                "gshard::attention: the keys' padding is key_lengths, an int32 tensor [B], or key paddings, a [B, T] "
                "tensor in q's element type (1 at a padded key); its batch split as q's, T whole");
  return true;
}
template <class Q, class Len>
key_padding checked_key_padding(const Q& q, const Len& keys, index_t T) {
  if (keys.extent(0) != q.extent(0) || (Len::rank == 2 && keys.extent(Len::rank - 1) != T))
    throw shape_error("gshard::dot_product_attention: " + std::string(Len::rank == 1 ? "key_lengths " : "key paddings ") +
                      keys.notation() + " for q " + shape_text(q) + " and " + std::to_string(T) + " keys: " +
                      (Len::rank == 1 ? "one length per sequence" : "[B, T], one value per key"));
  return key_padding_of("dot_product_attention", keys, T);
}
inline attention_keys keys_of(const attention_options& o) { return {o.causal, o.query_offset, nullptr}; }
}  // namespace detail

// Causal self-attention: softmax(causal_mask(scale · q·kᵀ))·v per sequence
// and head, q [B, L, N, K], k and v [B, L, N, K] (batch, position, head, head
// dim), row l attending to positions t <= l. Returns q's type. No
// communication: q, k and v share one sharding, which may split the batch and
// the heads but not the positions or the head dim.
template <sharded_tensor Q, sharded_tensor K, sharded_tensor V>
std::remove_cvref_t<Q> causal_attention(const Q& q, const K& k, const V& v, double scale) {
  using XQ = std::remove_cvref_t<Q>;
  static_assert(detail::check_attention<XQ, std::remove_cvref_t<K>, std::remove_cvref_t<V>>());
  return detail::attention_forward<XQ>("causal_attention", q, k, v, scale, {}, {}, nullptr);
}

// softmax(scale · q·kᵀ)·v over the keys `opts` gives each row — all, or a
// causal prefix — and, with the keys' padding, only sequence b's real keys:
// key_lengths (int32 [B]: the first key_lengths[b]) or key paddings ([B, T]
// in q's type, 1 at a padded key), split like the batch. A row that sees
// no key gives 0. q [B, L, N, K], k and v [B, T, N, K]; padded keys and
// values enter the products with weight 0, so they must be finite.
template <sharded_tensor Q, sharded_tensor K, sharded_tensor V>
std::remove_cvref_t<Q> dot_product_attention(const Q& q, const K& k, const V& v, double scale, attention_options opts = {}) {
  using XQ = std::remove_cvref_t<Q>;
  static_assert(detail::check_attention<XQ, std::remove_cvref_t<K>, std::remove_cvref_t<V>>());
  return detail::attention_forward<XQ>("dot_product_attention", q, k, v, scale, detail::keys_of(opts), {}, nullptr);
}
template <sharded_tensor Q, sharded_tensor K, sharded_tensor V, sharded_tensor Len>
std::remove_cvref_t<Q> dot_product_attention(const Q& q, const K& k, const V& v, const Len& key_lengths, double scale,
                                              attention_options opts = {}) {
  using XQ = std::remove_cvref_t<Q>;
  static_assert(detail::check_attention<XQ, std::remove_cvref_t<K>, std::remove_cvref_t<V>>() &&
                detail::check_key_padding<XQ, Len>());
  return detail::attention_forward<XQ>("dot_product_attention", q, k, v, scale, detail::keys_of(opts),
                                       detail::checked_key_padding(q, key_lengths, k.extent(1)), nullptr);
}

}  // namespace gshard
