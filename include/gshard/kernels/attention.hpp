// gshard/kernels/attention.hpp — attention on one rank's shard, per
// sequence and head, in blocks of rows: the kernels behind causal_attention()
// and dot_product_attention() (gshard/tensor/attention.hpp and their rule on
// the tape). Each query row sees a prefix of the keys (attention_keys: the
// causal mask at a query offset, a sequence's valid length, both or
// neither). The [L, T] logits never exist whole: a block of
// attention_extents::block rows is made, normalised and used while it is in
// cache, and the columns no row of a block sees are never computed (causal,
// L = T = 128 and 32-row blocks: 5/8 of the dense product's FLOPs).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <limits>

#include "gshard/kernels/gemm.hpp"
#include "gshard/kernels/softmax_row.hpp"
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
  // The rows of the output one block makes. On an AVX-512 Xeon with
  // OpenBLAS, L = T = 128, D = 32, forward and backward: blocks of 32 rows
  // 1.4x faster than the dense GEMMs with a softmax pass between, blocks of
  // 64 1.35x, one block of 128 1.15x (docs/10).
  static constexpr index_t block = 32;
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

// An aligned buffer of T (Eigen's heap arrays are aligned to its largest packet).
// Replicas stay bit-identical: the GEMMs and the softmax rows compute the
// same sums in the same order wherever the rows sit (softmax_row works in its
// own aligned buffer; the kept P and the backward's scratch are aligned, so
// softmax_row_backward's dot takes the same head on every rank).
template <class T>
using aligned_buffer = Eigen::Array<T, Eigen::Dynamic, 1>;

// One block's probabilities — rows l0 .. l0 + rows of sequence b and one
// head (qb, kb: its first row of q and of k) — into p (row stride T): the
// logits against the c > 0 keys the block sees, then row(i, p_i, kept)
// normalises row i's kept entries and the rest up to c get 0. The forward
// makes them and the recomputing backward makes them again, the same way.
template <class T, class Row>
void block_probabilities(const attention_extents& e, index_t b, const T* qb, const T* kb, index_t l0, index_t rows, T* p,
                         Row&& row) {
  const index_t ld = e.heads * e.dim, c = e.block_columns(b, l0, rows);
  gemm<T>(false, true, rows, c, e.dim, T(1), qb + l0 * ld, ld, kb, ld, T(0), p, e.T);
  for (index_t i = 0; i < rows; ++i) {
    const index_t kept = e.keys.end(b, l0 + i, e.T);
    if (e.keys.valid)  // padded keys inside the prefix: -inf, so exactly 0 after the softmax
      for (index_t t = 0; t < kept; ++t)
        if (e.keys.masks(b, t, e.T)) p[i * e.T + t] = -std::numeric_limits<T>::infinity();
    row(i, p + i * e.T, kept);
    std::fill(p + i * e.T + kept, p + i * e.T + c, T(0));
  }
}

// For each sequence b and head n, with q [L, D], k and v [T, D] (rows of the
// [B, L, N, D] shards, strided by N·D), rows l0..l1 of the output take
//   S = q[l0:l1] · k[0:c]ᵀ   c = e.block_columns(): the columns any of the rows sees
//   P = softmax(scale · S) over t < e.keys.end(b, l) in each row, 0 after
//   o[l0:l1] = P · v[0:c]   (0 where a block sees no key)
// Collectives in flight are tested after each sequence and head (progress(),
// the hook runtime/nonblocking.hpp sets), as between an einsum's GEMMs; the backward
// does the same.
//
// o = attention of q, k, v; the probabilities go to `probs`
// ([batch, heads, L, T], aligned; entries above a block's last column left
// unwritten) or, when it is null, to a scratch block. `stats` (null, or
// [batch, heads, L]) receives each row's softmax_row_stats, from which the
// backward can compute the probabilities again instead of keeping them.
template <class T>
void attention_forward_blocks(const attention_extents& e, const T* q, const T* k, const T* v, T scale, T* o, T* probs,
                              softmax_row_stats<T>* stats = nullptr) {
  const index_t ld = e.heads * e.dim, R = attention_extents::block;
  if (e.batch * e.heads * e.L * e.dim == 0) return;  // no output
  if (e.T == 0) {  // a sum over no positions
    std::fill(o, o + e.batch * e.L * ld, T(0));
    return;
  }
  thread_local aligned_buffer<T> scratch;
  if (!probs && scratch.size() < R * e.T) scratch.resize(R * e.T);
  for (index_t b = 0; b < e.batch; ++b)
    for (index_t n = 0; n < e.heads; ++n) {
      const T* qb = q + b * e.L * ld + n * e.dim;
      const T* kb = k + b * e.T * ld + n * e.dim;
      const T* vb = v + b * e.T * ld + n * e.dim;
      T* ob = o + b * e.L * ld + n * e.dim;
      for (index_t l0 = 0; l0 < e.L; l0 += R) {
        const index_t rows = std::min(R, e.L - l0), c = e.block_columns(b, l0, rows);
        if (c == 0) {  // every key of these rows is padding: a sum over nothing
          for (index_t i = 0; i < rows; ++i) std::fill_n(ob + (l0 + i) * ld, e.dim, T(0));
          continue;
        }
        T* p = probs ? probs + ((b * e.heads + n) * e.L + l0) * e.T : scratch.data();
        softmax_row_stats<T>* st = stats ? stats + (b * e.heads + n) * e.L + l0 : nullptr;
        block_probabilities(e, b, qb, kb, l0, rows, p, [&](index_t i, T* row, index_t kept) {
          softmax_row(row, kept, row, scale, st ? st + i : nullptr);
        });
        gemm<T>(false, false, rows, e.dim, c, T(1), p, e.T, vb, ld, T(0), ob + l0 * ld, ld);
      }
      progress();
    }
}

// dq, dk, dv (overwritten) from dout and the forward's q, k, v and probs —
// or, with probs null, the forward's row stats: each block's probabilities
// computed again (one more GEMM and exp per block), bit for bit the
// forward's; as FlashAttention's backward does, that keeps [B, N, L] pairs
// (each row's largest logit and sum of exps) instead of [B, N, L, T]. Per block:
//   dv[0:c] += Pᵀ · do[l0:l1]     dP = do[l0:l1] · v[0:c]ᵀ
//   dS = scale · P ⊙ (dP − Σ_t dP ⊙ P)   (softmax_row_backward, kept entries)
//   dq[l0:l1] = dS · k[0:c]       dk[0:c] += dSᵀ · q[l0:l1]
template <class T>
void attention_backward_blocks(const attention_extents& e, const T* dout, const T* q, const T* k, const T* v,
                               const T* probs, T scale, T* dq, T* dk, T* dv, const softmax_row_stats<T>* stats = nullptr) {
  const index_t ld = e.heads * e.dim, R = attention_extents::block;
  std::fill(dk, dk + e.batch * e.T * ld, T(0));  // accumulated over the row blocks; rows t >= L get nothing
  std::fill(dv, dv + e.batch * e.T * ld, T(0));
  if (e.T == 0 || e.L == 0) {
    std::fill(dq, dq + e.batch * e.L * ld, T(0));
    return;
  }
  if (e.batch * e.heads * e.dim == 0) return;
  thread_local aligned_buffer<T> scratch, again;  // dP, then dS, of one block: [rows, c]; its probabilities: [rows, T]
  if (scratch.size() < R * e.T) scratch.resize(R * e.T);
  if (!probs && again.size() < R * e.T) again.resize(R * e.T);
  T* g = scratch.data();
  for (index_t b = 0; b < e.batch; ++b)
    for (index_t n = 0; n < e.heads; ++n) {
      const index_t at = b * e.L * ld + n * e.dim, kt = b * e.T * ld + n * e.dim;
      for (index_t l0 = 0; l0 < e.L; l0 += R) {
        const index_t rows = std::min(R, e.L - l0), c = e.block_columns(b, l0, rows);
        if (c == 0) {  // rows that saw no key: no gradient
          for (index_t i = 0; i < rows; ++i) std::fill_n(dq + at + (l0 + i) * ld, e.dim, T(0));
          continue;
        }
        const T* p = probs ? probs + ((b * e.heads + n) * e.L + l0) * e.T : again.data();
        if (!probs) {  // the forward's block again, each row from its stats
          const softmax_row_stats<T>* st = stats + (b * e.heads + n) * e.L + l0;
          block_probabilities(e, b, q + at, k + kt, l0, rows, again.data(), [&](index_t i, T* row, index_t kept) {
            softmax_row_again(row, kept, row, scale, st[i]);
          });
        }
        const T* dob = dout + at + l0 * ld;
        gemm<T>(true, false, c, e.dim, rows, T(1), p, e.T, dob, ld, T(1), dv + kt, ld);
        gemm<T>(false, true, rows, c, e.dim, T(1), dob, ld, v + kt, ld, T(0), g, c);
        for (index_t i = 0; i < rows; ++i) {
          const index_t kept = e.keys.end(b, l0 + i, e.T);
          softmax_row_backward(g + i * c, p + i * e.T, kept, scale);
          std::fill(g + i * c + kept, g + i * c + c, T(0));
        }
        gemm<T>(false, false, rows, e.dim, c, T(1), g, c, k + kt, ld, T(0), dq + at + l0 * ld, ld);
        gemm<T>(true, false, c, e.dim, rows, T(1), g, c, q + at + l0 * ld, ld, T(1), dk + kt, ld);
      }
      progress();
    }
}

}  // namespace gshard::detail
