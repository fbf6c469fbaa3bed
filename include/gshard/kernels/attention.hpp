// gshard/kernels/attention.hpp — attention on one rank's shard, per
// sequence in blocks of rows, every head at once: the kernels behind causal_attention()
// and dot_product_attention() (gshard/tensor/attention.hpp and their rule on
// the tape). Each query row sees a prefix of the keys (attention_keys: the
// causal mask at a query offset, a sequence's valid length, both or
// neither). The [L, T] logits never exist whole: a block of
// attention_block_rows() rows is made, normalised and used while it is in
// cache, and the columns no row of a block sees are never computed (causal,
// L = T = 128 and 32-row blocks: 5/8 of the dense product's FLOPs).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "gshard/kernels/gemm.hpp"
#include "gshard/kernels/softmax_row.hpp"
#include "gshard/core/bf16.hpp"
#include "gshard/core/error.hpp"
#include "gshard/core/types.hpp"
#include "gshard/core/progress.hpp"

namespace gshard::detail {

// The keys query row l of sequence b sees: those of the prefix t < end(b, l)
// = min(causal ? offset + l + 1 : T, lengths ? lengths[b] : T) that are not
// padding (`valid`, when given); end is 0 for a row that sees no key (its
// output and gradients 0). end grows with l.
struct attention_keys {
  bool causal = true;
  index_t offset = 0;                // causal: query row 0's position among the keys
  const index_t* lengths = nullptr;  // this rank's sequences' valid keys (the rest padding), or null: all T
  const char* valid = nullptr;       // [batch, T]: 0 at a padded key, or null: none
  const index_t* counted = nullptr;  // [batch, T + 1]: the valid keys before t (with `valid`)
  index_t end(index_t b, index_t l, index_t T) const {
    index_t e = causal ? std::min(offset + l + 1, T) : T;
    if (lengths) e = std::min(e, lengths[b]);
    return counted && counted[b * (T + 1) + e] == 0 ? 0 : e;
  }
  bool masks(index_t b, index_t t, index_t T) const { return valid && !valid[b * T + t]; }
};

// One rank's extents: q [batch, L, heads, dim], k and v [batch, T, heads, dim],
// and the keys each row sees.
struct attention_extents {
  index_t batch = 0, L = 0, T = 0, heads = 0, dim = 0;
  attention_keys keys{};
  // The rows of the output one block makes (attention_block_rows()). The
  // forward records it and its backward runs the same blocks.
  index_t block = 32;
  // Elements of the kept probabilities: [batch, heads, L, T].
  index_t probs_size() const { return batch * heads * L * T; }
  // FLOPs of the dense einsums attention stands for (BLNK,BTNK->BNLT and
  // BNLT,BTNK->BLNK), forward: what model FLOPs count for it.
  double dense_flops() const { return 2.0 * 2.0 * double(batch * heads) * double(L) * double(T) * double(dim); }
  // The columns block rows l0 .. l0 + rows of sequence b compute: those its
  // last row sees (end() grows with l).
  index_t block_columns(index_t b, index_t l0, index_t rows) const { return keys.end(b, l0 + rows - 1, T); }
  // FLOPs the blocks compute, forward (the backward computes twice these).
  double block_flops() const {
    double cols = 0;
    for (index_t b = 0; b < batch; ++b)
      for (index_t l0 = 0; l0 < L; l0 += block) {
        const index_t rows = std::min(block, L - l0);
        cols += double(rows) * double(block_columns(b, l0, rows));
      }
    return 2.0 * 2.0 * double(heads) * cols * double(dim);
  }
};

inline index_t& attention_block_rows_now() {
  thread_local index_t rows = 0;  // 0: attention_block_rows<T>() chooses
  return rows;
}

// The rows of one block for element type T: 128 where T's GEMMs run on
// oneDNN, whose calls cost microseconds each however small (the trainer's
// attention, L = T = 128 and 4 heads of 32, forward + backward on an EPYC
// Zen 5 VM: blocks of 32 took 1.11–1.26× the time of blocks of 128, and the
// bf16 step ran about 4% slower); 32 on OpenBLAS and Eigen, where that is
// fastest (128 took 1.24× and 1.33× as long there). docs/10 has the
// figures; attention_block_scope sets another for a stretch of code.
template <class T>
index_t attention_block_rows() {
  if (const index_t r = attention_block_rows_now()) return r;
  return std::is_same_v<T, float> && options().gemm == int(gemm_kind::onednn) ? 128 : 32;
}

// attention_block_scope rows(16): attention computed on this thread until
// the scope ends runs in blocks of 16 rows (its backward runs the blocks
// its forward ran, wherever it is called); 0 gives the choice back to
// attention_block_rows<T>(). For tests that must cross a block's edge with
// short sequences, and for measuring the block size.
class attention_block_scope {
 public:
  explicit attention_block_scope(index_t rows) : before_(attention_block_rows_now()) {
    if (rows < 0)
      throw error("gshard::attention_block_scope: rows = " + std::to_string(rows) + "; >= 1, or 0 for the default");
    attention_block_rows_now() = rows;
  }
  ~attention_block_scope() { attention_block_rows_now() = before_; }
  attention_block_scope(const attention_block_scope&) = delete;
  attention_block_scope& operator=(const attention_block_scope&) = delete;

 private:
  index_t before_;
};

// An aligned buffer of T (Eigen's heap arrays are aligned to its largest packet).
// Replicas stay bit-identical: the GEMMs and the softmax rows compute the
// same sums in the same order wherever the rows sit (softmax_row works in its
// own aligned buffer; the kept P and the backward's scratch are aligned, so
// softmax_row_backward's dot takes the same head on every rank).
template <class T>
using aligned_buffer = Eigen::Array<T, Eigen::Dynamic, 1>;

// An operand of the blocks' GEMMs, a batch of matrices — one per head —
// with rows ld apart and matrices `stride` apart; and where gemm rounds
// fp32 operands to bf16 (gemm_rounds_to_bf16()) its bf16 copy: of a
// sequence's q, k, v and dout once (each block of query rows reads every
// key and value before it, the backward's q, k and dout twice), of a
// block's probabilities and dS once per block (dS goes into two GEMMs).
template <class T>
struct block_operand {
  const T* f = nullptr;
  index_t ld = 0, stride = 0;
  const bf16* h = nullptr;  // the bf16 copy, or null: multiplied as T
  index_t h_ld = 0, h_stride = 0;
  // The operand from `offset` elements on (a copy in f's own layout: q, k, v, dout).
  block_operand operator+(index_t offset) const {
    return {f ? f + offset : nullptr, ld, stride, h ? h + offset : nullptr, h_ld, h_stride};
  }
};

// The bf16 copies a forward whose GEMMs round (gemm_rounds_to_bf16()) keeps
// for its backward in place of the fp32 tensors, as mixed-precision
// training keeps a bf16 GEMM's operands: q, k and v ([batch, positions,
// heads, dim], as the fp32 ones) — the backward reads them only through
// GEMMs, so it needs neither their fp32 values nor to round them again —
// and, when it keeps the probabilities, the bf16 ones ([batch, heads, L, T])
// that P·v multiplied. The backward's dS = P ⊙ (dP − Σ dP ⊙ P) then reads
// the rounded P.
struct attention_copies {
  const bf16* q = nullptr;
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  bf16* probs = nullptr;  // written by the forward, read by the backward
};

// One sequence's q, k, v or dout ([positions, heads, dim], n elements):
// head h's rows at f + h·dim, ld = heads·dim apart; the copy in the same
// layout: `copy` (the sequence's in a kept whole copy) or, where gemm
// rounds, made in buf.
template <class T>
block_operand<T> heads_operand(bool rounds, const T* f, index_t n, const attention_extents& e, std::vector<bf16>& buf,
                               const bf16* copy = nullptr) {
  const index_t ld = e.heads * e.dim;
  if (copy) return {f, ld, e.dim, copy, ld, e.dim};
  if constexpr (std::is_same_v<T, float>)
    if (rounds) return {f, ld, e.dim, packed(f, 1, n, n, buf), ld, e.dim};
  return {f, ld, e.dim};
}

// A block's per-head matrices (count of rows × cols, leading dim ld,
// `stride` apart); the copy packed: [count, rows, cols].
template <class T>
block_operand<T> block_operand_of(bool rounds, const T* f, index_t count, index_t rows, index_t cols, index_t ld,
                                  index_t stride, std::vector<bf16>& buf) {
  if constexpr (std::is_same_v<T, float>)
    if (rounds) {
      buf.resize(std::size_t(count * rows * cols));
      for (index_t i = 0; i < count; ++i) convert_rows(f + i * stride, rows, cols, ld, buf.data() + i * rows * cols, cols);
      return {f, ld, stride, buf.data(), cols, rows * cols};
    }
  return {f, ld, stride};
}

// For each head n: C_n (+)= op(A_n)·op(B_n), C_n at c + n·c_stride — on
// the operands' bf16 copies when they have them; one batched GEMM.
template <class T>
void block_gemm(index_t heads, bool ta, bool tb, index_t m, index_t n, index_t k, const block_operand<T>& a,
                const block_operand<T>& b, T beta, T* c, index_t ldc, index_t c_stride) {
  if constexpr (std::is_same_v<T, float>)
    if (a.h && b.h)
      return gemm_batched<bf16, float>({heads, a.h_stride, b.h_stride, c_stride}, ta, tb, m, n, k, 1.0f, a.h, a.h_ld,
                                       b.h, b.h_ld, beta, c, ldc);
  gemm_batched<T, T>({heads, a.stride, b.stride, c_stride}, ta, tb, m, n, k, T(1), a.f, a.ld, b.f, b.ld, beta, c, ldc);
}

// One block's probabilities — rows l0 .. l0 + rows of sequence b, every
// head (q, k: the sequence's first rows) — into p (row stride T, head
// stride p_stride): the logits against the c > 0 keys the block sees, then
// row(n, i, p_ni, kept) normalises row i's kept entries and the rest up to c
// get 0. The forward makes them and the recomputing backward makes them
// again, the same way.
template <class T, class Row>
void block_probabilities(const attention_extents& e, index_t b, const block_operand<T>& q, const block_operand<T>& k,
                         index_t l0, index_t rows, T* p, index_t p_stride, Row&& row) {
  const index_t c = e.block_columns(b, l0, rows);
  block_gemm<T>(e.heads, false, true, rows, c, e.dim, q + l0 * q.ld, k, T(0), p, e.T, p_stride);
  for (index_t n = 0; n < e.heads; ++n)
    for (index_t i = 0; i < rows; ++i) {
      T* r = p + n * p_stride + i * e.T;
      const index_t kept = e.keys.end(b, l0 + i, e.T);
      if (e.keys.valid)  // padded keys inside the prefix: -inf, so exactly 0 after the softmax
        for (index_t t = 0; t < kept; ++t)
          if (e.keys.masks(b, t, e.T)) r[t] = -std::numeric_limits<T>::infinity();
      row(n, i, r, kept);
      std::fill(r + kept, r + c, T(0));
    }
}

// For each sequence b and head n, with q [L, D], k and v [T, D] (rows of the
// [B, L, N, D] shards, strided by N·D), rows l0..l1 of the output take
//   S = q[l0:l1] · k[0:c]ᵀ   c = e.block_columns(): the columns any of the rows sees
//   P = softmax(scale · S) over t < e.keys.end(b, l) in each row, 0 after
//   o[l0:l1] = P · v[0:c]   (0 where a block sees no key)
// each GEMM for all heads at once. Collectives in flight are tested after
// each block (progress(), the hook runtime/nonblocking.hpp sets), as
// between an einsum's GEMMs; the backward does the same.
//
// o = attention of q, k, v; the probabilities go to `probs`
// ([batch, heads, L, T], aligned; entries above a block's last column left
// unwritten) or, when it is null, to a scratch block. `stats` (null, or
// [batch, heads, L]) receives each row's softmax_row_stats, from which the
// backward can compute the probabilities again instead of keeping them.
//
// With `copies` (fp32 only; q, k and v may then be null), the GEMMs
// multiply copies.q, .k and .v, and the probabilities go, rounded, to
// copies.probs (probs null) — unless it is null too: no probabilities kept.
template <class T>
void attention_forward_blocks(const attention_extents& e, const T* q, const T* k, const T* v, T scale, T* o, T* probs,
                              softmax_row_stats<T>* stats = nullptr, const attention_copies* copies = nullptr) {
  const index_t ld = e.heads * e.dim, R = e.block;
  if (e.batch * e.heads * e.L * e.dim == 0) return;  // no output
  if (e.T == 0) {  // a sum over no positions
    std::fill(o, o + e.batch * e.L * ld, T(0));
    return;
  }
  thread_local aligned_buffer<T> scratch;  // one block's probabilities, every head: [heads, R, T]
  if (!probs && scratch.size() < e.heads * R * e.T) scratch.resize(e.heads * R * e.T);
  const index_t p_stride = probs ? e.L * e.T : R * e.T;
  const bool rounds = copies || gemm_rounds_to_bf16();
  bf16* const probs16 = copies ? copies->probs : nullptr;
  thread_local std::vector<bf16> q16, k16, v16, p16;
  for (index_t b = 0; b < e.batch; ++b) {
    const index_t at = b * e.L * ld, kt = b * e.T * ld;
    const auto from = [](const T* p, index_t offset) { return p ? p + offset : nullptr; };  // null: read through a copy
    const block_operand<T> Q = heads_operand(rounds, from(q, at), e.L * ld, e, q16, copies ? copies->q + at : nullptr),
                           K = heads_operand(rounds, from(k, kt), e.T * ld, e, k16, copies ? copies->k + kt : nullptr),
                           V = heads_operand(rounds, from(v, kt), e.T * ld, e, v16, copies ? copies->v + kt : nullptr);
    T* ob = o + at;
    for (index_t l0 = 0; l0 < e.L; l0 += R, progress()) {
      const index_t rows = std::min(R, e.L - l0), c = e.block_columns(b, l0, rows);
      if (c == 0) {  // every key of these rows is padding: a sum over nothing
        std::fill_n(ob + l0 * ld, rows * ld, T(0));
        continue;
      }
      T* p = probs ? probs + (b * e.heads * e.L + l0) * e.T : scratch.data();
      softmax_row_stats<T>* st = stats ? stats + b * e.heads * e.L + l0 : nullptr;
      block_probabilities(e, b, Q, K, l0, rows, p, p_stride,
                          [&](index_t n, index_t i, T* row, index_t kept) {
                            softmax_row(row, kept, row, scale, st ? st + n * e.L + i : nullptr);
                          });
      block_operand<T> P;
      if (probs16) {  // rounded once, into the kept copy the GEMM reads
        bf16* const h = probs16 + (b * e.heads * e.L + l0) * e.T;
        for (index_t n = 0; n < e.heads; ++n) convert_rows(p + n * p_stride, rows, c, e.T, h + n * e.L * e.T, e.T);
        P = {p, e.T, p_stride, h, e.T, e.L * e.T};
      } else {
        P = block_operand_of(rounds, p, e.heads, rows, c, e.T, p_stride, p16);
      }
      block_gemm<T>(e.heads, false, false, rows, e.dim, c, P, V, T(0), ob + l0 * ld, ld, e.dim);
    }
  }
}

// Block l0's probabilities (rows l0 .. l0 + rows of sequence b, every
// head) as the backward reads them, as the forward made them: .f the fp32
// rows dS reads — the kept probs, or in `again` ([heads, R, T]) the block
// computed again from each row's stats; null where the forward kept bf16
// rows (probs16), which dS reads as they are — and .h the bf16 ones Pᵀ·dout
// multiplies: the kept ones, or made in p16 where the GEMMs round.
template <class T>
block_operand<T> backward_probabilities(const attention_extents& e, index_t b, index_t l0, index_t rows, const T* probs,
                                        const bf16* probs16, const softmax_row_stats<T>* stats, const block_operand<T>& Q,
                                        const block_operand<T>& K, T scale, bool rounds, T* again, std::vector<bf16>& p16) {
  const index_t c = e.block_columns(b, l0, rows), first = (b * e.heads * e.L + l0) * e.T;
  if (probs) return block_operand_of(rounds, probs + first, e.heads, rows, c, e.T, e.L * e.T, p16);
  const index_t p_stride = e.block * e.T;
  if (probs16) return {nullptr, 0, 0, probs16 + first, e.T, e.L * e.T};
  const softmax_row_stats<T>* st = stats + b * e.heads * e.L + l0;
  block_probabilities(e, b, Q, K, l0, rows, again, p_stride, [&](index_t n, index_t i, T* row, index_t kept) {
    softmax_row_again(row, kept, row, scale, st[n * e.L + i]);
  });
  return block_operand_of(rounds, static_cast<const T*>(again), e.heads, rows, c, e.T, p_stride, p16);
}

// dq, dk, dv (overwritten) from dout and the forward's q, k, v and probs —
// or, with probs null, the forward's row stats: each block's probabilities
// computed again (one more GEMM and exp per block), bit for bit the
// forward's; as FlashAttention's backward does, that keeps [B, N, L] pairs
// (each row's largest logit and sum of exps) instead of [B, N, L, T]. Per
// block, each GEMM for all heads at once:
//   dv[0:c] += Pᵀ · do[l0:l1]     dP = do[l0:l1] · v[0:c]ᵀ
//   dS = scale · P ⊙ (dP − Σ_t dP ⊙ P)   (softmax_row_backward, kept entries)
//   dq[l0:l1] = dS · k[0:c]       dk[0:c] += dSᵀ · q[l0:l1]
//
// With `copies` (fp32 only; q, k and v may then be null), the GEMMs
// multiply copies.q, .k and .v, and the kept probabilities are
// copies.probs (probs null) — unless it is null too: computed again.
template <class T>
void attention_backward_blocks(const attention_extents& e, const T* dout, const T* q, const T* k, const T* v,
                               const T* probs, T scale, T* dq, T* dk, T* dv, const softmax_row_stats<T>* stats = nullptr,
                               const attention_copies* copies = nullptr) {
  const index_t ld = e.heads * e.dim, R = e.block;
  std::fill(dk, dk + e.batch * e.T * ld, T(0));  // accumulated over the row blocks; rows t >= L get nothing
  std::fill(dv, dv + e.batch * e.T * ld, T(0));
  if (e.T == 0 || e.L == 0) {
    std::fill(dq, dq + e.batch * e.L * ld, T(0));
    return;
  }
  if (e.batch * e.heads * e.dim == 0) return;
  // dP, then dS, of one block: [heads, rows, c]; its probabilities computed
  // again: [heads, R, T]
  thread_local aligned_buffer<T> scratch, again;
  if (scratch.size() < e.heads * R * e.T) scratch.resize(e.heads * R * e.T);
  const bool recomputes = !probs && !(copies && copies->probs);
  if (recomputes && again.size() < e.heads * R * e.T) again.resize(e.heads * R * e.T);
  T* g = scratch.data();
  const bool rounds = copies || gemm_rounds_to_bf16();
  thread_local std::vector<bf16> do16, q16, k16, v16, p16, g16;
  for (index_t b = 0; b < e.batch; ++b) {
    const index_t at = b * e.L * ld, kt = b * e.T * ld;
    const auto in = [&](const T* f, index_t offset, index_t n, std::vector<bf16>& buf, const bf16* copy) {
      return heads_operand(rounds, f ? f + offset : nullptr, n, e, buf, copy ? copy + offset : nullptr);
    };
    const block_operand<T> dO = in(dout, at, e.L * ld, do16, nullptr), Q = in(q, at, e.L * ld, q16, copies ? copies->q : nullptr),
                           K = in(k, kt, e.T * ld, k16, copies ? copies->k : nullptr),
                           V = in(v, kt, e.T * ld, v16, copies ? copies->v : nullptr);
    for (index_t l0 = 0; l0 < e.L; l0 += R, progress()) {
      const index_t rows = std::min(R, e.L - l0), c = e.block_columns(b, l0, rows);
      if (c == 0) {  // rows that saw no key: no gradient
        std::fill_n(dq + at + l0 * ld, rows * ld, T(0));
        continue;
      }
      const block_operand<T> P = backward_probabilities(e, b, l0, rows, probs, copies ? copies->probs : nullptr, stats, Q, K,
                                                          scale, rounds, again.data(), p16);
      const auto row_backward = [&](T* gi, index_t n, index_t i, index_t kept) {
        if constexpr (std::is_same_v<T, float>)
          if (!P.f) return softmax_row_backward(gi, P.h + n * P.h_stride + i * P.h_ld, kept, scale);  // kept in bf16
        softmax_row_backward(gi, P.f + n * P.stride + i * e.T, kept, scale);
      };
      const block_operand<T> dob = dO + l0 * ld;
      block_gemm<T>(e.heads, true, false, c, e.dim, rows, P, dob, T(1), dv + kt, ld, e.dim);
      block_gemm<T>(e.heads, false, true, rows, c, e.dim, dob, V, T(0), g, c, rows * c);
      for (index_t n = 0; n < e.heads; ++n)
        for (index_t i = 0; i < rows; ++i) {
          T* gi = g + (n * rows + i) * c;
          const index_t kept = e.keys.end(b, l0 + i, e.T);
          row_backward(gi, n, i, kept);
          std::fill(gi + kept, gi + c, T(0));
        }
      const block_operand<T> ds = block_operand_of(rounds, static_cast<const T*>(g), e.heads, rows, c, c, rows * c, g16);
      block_gemm<T>(e.heads, false, false, rows, e.dim, c, ds, K, T(0), dq + at + l0 * ld, ld, e.dim);
      block_gemm<T>(e.heads, true, false, c, e.dim, rows, ds, Q + l0 * ld, T(1), dk + kt, ld, e.dim);
    }
  }
}

}  // namespace gshard::detail
