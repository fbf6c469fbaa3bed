// gshard/kernels/local_einsum.hpp — the per-rank einsum on row-major local
// shards, mapped onto strided GEMMs:
//   C[L.., M.., N..] = Σ_K A[L.., M.., K..] · B[L.., K.., N..]
// L = batch labels (plus labels moved out of a group, see below), M = free
// labels of A, N = free labels of B, K = contracting labels. Each group must
// merge into one strided dim in every tensor it appears in; a label that
// breaks a merge moves to the loop L (a contracting one then accumulates).
// Operands are copied only when no stride pattern fits a GEMM; summed labels
// (in one input only) are summed out first.
#pragma once

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "gshard/kernels/gemm.hpp"
#include "gshard/layout/einsum_spec.hpp"
#include "gshard/core/bf16.hpp"
#include "gshard/core/error.hpp"
#include "gshard/core/progress.hpp"

namespace gshard::detail {

// A tensor seen through its labels: extents and strides in elements.
struct labeled_view {
  int rank = 0;
  char label[max_rank]{};
  index_t extent[max_rank]{};
  index_t stride[max_rank]{};

  int find(char l) const {
    for (int d = 0; d < rank; ++d)
      if (label[d] == l) return d;
    return -1;
  }
  bool has(char l) const { return find(l) >= 0; }
  index_t stride_of(char l) const {
    const int d = find(l);
    return d < 0 ? 0 : stride[d];
  }
  index_t size() const {
    index_t n = 1;
    for (int d = 0; d < rank; ++d) n *= extent[d];
    return n;
  }
};

inline labeled_view contiguous_view(std::string_view labels, const index_t* extent) {
  labeled_view v;
  v.rank = int(labels.size());
  index_t s = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.label[d] = labels[std::size_t(d)];
    v.extent[d] = extent[d];
    v.stride[d] = s;
    s *= extent[d];
  }
  return v;
}

// dst = src with the labels dst lacks summed out (in dst's type) and the
// rest permuted into dst's order. dst must be contiguous; it is overwritten.
template <class S, class D>
void sum_permute(const S* src, const labeled_view& sv, D* dst, const labeled_view& dv) {
  const index_t total = dv.size();
  std::fill(dst, dst + total, D(0));
  if (sv.size() == 0) return;
  if (sv.rank == 0) {
    dst[0] = D(src[0]);
    return;
  }
  index_t dstride[max_rank];
  for (int d = 0; d < sv.rank; ++d) dstride[d] = dv.stride_of(sv.label[d]);
  const int last = sv.rank - 1;
  const index_t run = sv.extent[last], ss = sv.stride[last], ds = dstride[last];
  index_t pos[max_rank] = {};
  while (true) {
    index_t so = 0, doff = 0;
    for (int d = 0; d < last; ++d) {
      so += pos[d] * sv.stride[d];
      doff += pos[d] * dstride[d];
    }
    const S* s = src + so;
    D* o = dst + doff;
    if (ds == 0) {  // the innermost label is summed
      D acc = D(0);
      for (index_t i = 0; i < run; ++i) acc += D(s[i * ss]);
      *o += acc;
    } else if (ds == 1 && ss == 1) {
      for (index_t i = 0; i < run; ++i) o[i] += D(s[i]);
    } else {
      for (index_t i = 0; i < run; ++i) o[i * ds] += D(s[i * ss]);
    }
    int d = last - 1;
    while (d >= 0 && ++pos[d] == sv.extent[d]) pos[d--] = 0;
    if (d < 0) break;
  }
}

// sum_permute with every sum taken in sum_t<T> and rounded once to T (bf16's
// in fp32); a permutation that sums nothing copies directly.
template <class T>
void sum_permute_rounded(const T* src, const labeled_view& sv, T* dst, const labeled_view& dv) {
  if constexpr (std::is_same_v<sum_t<T>, T>) {
    sum_permute(src, sv, dst, dv);
  } else {
    if (sv.size() == dv.size()) return sum_permute(src, sv, dst, dv);
    thread_local std::vector<sum_t<T>> acc;
    acc.resize(std::size_t(dv.size()));
    sum_permute(src, sv, acc.data(), dv);
    std::transform(acc.begin(), acc.end(), dst, [](sum_t<T> x) { return T(x); });
  }
}

struct label_group {
  int n = 0;
  char l[max_rank]{};
  void push(char c) { l[n++] = c; }
  void erase_front() {
    for (int i = 1; i < n; ++i) l[i - 1] = l[i];
    --n;
  }
};

// The group merges into one dim of v: each label's stride is the next one's
// stride times its extent. Labels v lacks have stride 0 and never merge.
inline bool merges(const labeled_view& v, const label_group& g, const labeled_view& extents_from) {
  for (int i = 0; i + 1 < g.n; ++i) {
    const index_t inner_extent = extents_from.extent[extents_from.find(g.l[i + 1])];
    if (v.stride_of(g.l[i]) != v.stride_of(g.l[i + 1]) * inner_extent) return false;
  }
  return true;
}

// C (+)= op(A)·op(B): gemm, or for bf16 operands gemm_bf16 into an fp32 or bf16 C.
template <class T, class C>
void gemm_into(bool ta, bool tb, index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb,
               bool accumulate, C* c, index_t ldc) {
  if constexpr (std::is_same_v<T, bf16>)
    gemm_bf16<C>(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, accumulate ? 1.0f : 0.0f, c, ldc);
  else
    gemm<T>(ta, tb, m, n, k, T(1), a, lda, b, ldb, accumulate ? T(1) : T(0), c, ldc);
}

// One strided GEMM, C(m×n) (+)= A(m×k)·B(k×n) with element strides; false
// when no BLAS layout fits (then the caller copies).
template <class T, class C>
bool strided_gemm(index_t m, index_t n, index_t k, const T* a, index_t a_m, index_t a_k, const T* b, index_t b_k,
                  index_t b_n, bool accumulate, C* c, index_t c_m, index_t c_n) {
  // Which storage order fits a matrix (r×q) with strides (sr, sq): row-major
  // (returns ld) if sq is unit, transposed (sets trans) if sr is unit.
  auto fit = [](index_t r, index_t q, index_t sr, index_t sq, bool& trans, index_t& ld) {
    if (q <= 1 || sq == 1) {
      trans = false;
      ld = r <= 1 ? std::max<index_t>(q, 1) : sr;
      return ld >= std::max<index_t>(q, 1);
    }
    if (r <= 1 || sr == 1) {
      trans = true;
      ld = q <= 1 ? std::max<index_t>(r, 1) : sq;
      return ld >= std::max<index_t>(r, 1);
    }
    return false;
  };
  bool tc = false, ta = false, tb = false;
  index_t ldc = 0, lda = 0, ldb = 0;
  if (!fit(m, n, c_m, c_n, tc, ldc)) return false;
  if (!tc) {  // C row-major: C = op(A)·op(B)
    if (!fit(m, k, a_m, a_k, ta, lda) || !fit(k, n, b_k, b_n, tb, ldb)) return false;
    gemm_into(ta, tb, m, n, k, a, lda, b, ldb, accumulate, c, ldc);
  } else {  // C column-major: Cᵀ(n×m) = Bᵀ·Aᵀ
    if (!fit(n, k, b_n, b_k, tb, ldb) || !fit(k, m, a_k, a_m, ta, lda)) return false;
    gemm_into(tb, ta, n, m, k, b, ldb, a, lda, accumulate, c, ldc);
  }
  return true;
}

// The GEMM's label groups: C[L.., M.., N..] = Σ_K A[L.., M.., K..] · B[L.., K.., N..].
struct gemm_groups {
  label_group L, M, N, K;
  bool k_in_loop = false;  // a contracting label moved to the loop: C accumulates over it
};

// The extent of label l, from whichever operand has it.
inline index_t extent_in(const labeled_view& va, const labeled_view& vb, char l) {
  return va.has(l) ? va.extent[va.find(l)] : vb.extent[vb.find(l)];
}
inline index_t group_size(const label_group& g, const labeled_view& va, const labeled_view& vb) {
  index_t p = 1;
  for (int i = 0; i < g.n; ++i) p *= extent_in(va, vb, g.l[i]);
  return p;
}
// The stride of a group's innermost label in v (0 for an empty group).
inline index_t inner_stride(const labeled_view& v, const label_group& g) { return g.n ? v.stride_of(g.l[g.n - 1]) : 0; }

// Sorts the labels into the groups (labels of extent 1 take no part: their
// index is always 0), then moves the labels that break a merge to the loop,
// outermost first.
inline gemm_groups group_labels(const labeled_view& va, const labeled_view& vb, const labeled_view& vo) {
  gemm_groups g;
  for (int d = 0; d < vo.rank; ++d)
    if (vo.extent[d] != 1 && va.has(vo.label[d]) && vb.has(vo.label[d])) g.L.push(vo.label[d]);
  for (int d = 0; d < va.rank; ++d) {
    const char l = va.label[d];
    if (va.extent[d] == 1) continue;
    if (vb.has(l) && !vo.has(l)) g.K.push(l);
    else if (!vb.has(l)) g.M.push(l);
  }
  for (int d = 0; d < vb.rank; ++d)
    if (vb.extent[d] != 1 && !va.has(vb.label[d])) g.N.push(vb.label[d]);
  auto settle = [&](label_group& x, const labeled_view& v1, const labeled_view& v2, const labeled_view& ex, bool is_k) {
    while (x.n > 1 && !(merges(v1, x, ex) && merges(v2, x, ex))) {
      g.L.push(x.l[0]);
      x.erase_front();
      g.k_in_loop = g.k_in_loop || is_k;
    }
  };
  settle(g.M, va, vo, va, false);
  settle(g.N, vb, vo, vb, false);
  settle(g.K, va, vb, va, true);
  return g;
}

// v without the labels neither `other` nor the output `vo` has (to be summed
// out first), contiguous.
inline labeled_view without_alone_labels(const labeled_view& v, const labeled_view& other, const labeled_view& vo) {
  std::string keep;
  index_t ext[max_rank];
  for (int d = 0; d < v.rank; ++d)
    if (other.has(v.label[d]) || vo.has(v.label[d])) {
      ext[keep.size()] = v.extent[d];
      keep += v.label[d];
    }
  return contiguous_view(keep, ext);
}

// v's labels contiguous in the order [L.., g1.., g2.., the rest (extent-1
// labels)], skipping those v lacks: a layout every GEMM of the loop fits.
inline labeled_view grouped_view(const labeled_view& v, const label_group& L, const label_group& g1, const label_group& g2) {
  std::string order;
  index_t ext[max_rank];
  auto add = [&](char l) {
    if (v.has(l) && order.find(l) == std::string::npos) {
      ext[order.size()] = v.extent[v.find(l)];
      order += l;
    }
  };
  for (const label_group* g : {&L, &g1, &g2})
    for (int i = 0; i < g->n; ++i) add(g->l[i]);
  for (int d = 0; d < v.rank; ++d) add(v.label[d]);
  return contiguous_view(order, ext);
}

// The operand (p, v) copied into `buf` laid out as `to` (labels `to` lacks
// summed out); p and v then describe the copy.
template <class T>
void relayout(const T*& p, labeled_view& v, const labeled_view& to, std::vector<T>& buf) {
  buf.resize(std::size_t(to.size()));
  sum_permute_rounded(p, v, buf.data(), to);
  p = buf.data();
  v = to;
}

// Whether a matrix (r×q) with element strides (sr, sq) fits a BLAS layout.
inline bool blas_fits(index_t r, index_t q, index_t sr, index_t sq) { return r <= 1 || q <= 1 || sr == 1 || sq == 1; }

// C (+)= A·B for every index of the loop labels L, one strided GEMM each (a
// label an operand lacks has stride 0 there), the collectives in flight
// tested between them (detail::progress(): the experts' GEMMs, one per local
// expert, let a started all_to_all move). Not within one GEMM: cutting the
// MoE layer's expert GEMMs into blocks of 256 rows to test between them
// cost 10% of its forward + backward (bench_layers moe_layer, 733 against
// 805-821 ms on an AVX-512 Xeon), more than it let the all_to_alls gain.
template <class T, class C>
void gemm_over_loop(const einsum_spec& s, const gemm_groups& g, const T* a, const labeled_view& va, const T* b,
                    const labeled_view& vb, C* c, const labeled_view& vc, bool accumulate) {
  const index_t m = group_size(g.M, va, vb), n = group_size(g.N, va, vb), k = group_size(g.K, va, vb);
  index_t loop_ext[max_rank], sa[max_rank], sb[max_rank], sc[max_rank];
  for (int i = 0; i < g.L.n; ++i) {
    loop_ext[i] = extent_in(va, vb, g.L.l[i]);
    sa[i] = va.stride_of(g.L.l[i]);
    sb[i] = vb.stride_of(g.L.l[i]);
    sc[i] = vc.stride_of(g.L.l[i]);
  }
  const index_t a_m = inner_stride(va, g.M), a_k = inner_stride(va, g.K), b_k = inner_stride(vb, g.K),
                b_n = inner_stride(vb, g.N), c_m = inner_stride(vc, g.M), c_n = inner_stride(vc, g.N);
  index_t pos[max_rank] = {};
  while (true) {
    index_t oa = 0, ob = 0, oc = 0;
    for (int i = 0; i < g.L.n; ++i) {
      oa += pos[i] * sa[i];
      ob += pos[i] * sb[i];
      oc += pos[i] * sc[i];
    }
    const bool ok = strided_gemm(m, n, k, a + oa, a_m, a_k, b + ob, b_k, b_n, accumulate, c + oc, c_m, c_n);
    if (!ok) throw error("gshard::einsum: internal error: no GEMM layout for " + std::string(s.term(0)) + "," +
                         std::string(s.term(1)) + "->" + std::string(s.out_term()));
    progress();
    int i = g.L.n - 1;
    while (i >= 0 && ++pos[i] == loop_ext[i]) pos[i--] = 0;
    if (i < 0) break;
  }
}

// The result types an einsum of T operands gives: T, or float for bf16 operands.
template <class T, class C>
inline constexpr bool einsum_result_type_ok = std::is_same_v<C, T> || (std::is_same_v<T, bf16> && std::is_same_v<C, float>);

// out (contiguous, spec.out term) = einsum of a (and b) over their labels;
// every sum taken in sum_t<T> (bf16's in fp32: the products in the GEMM's
// accumulators, across the loop's GEMMs in an fp32 C) and rounded once to
// the output's type C: T, or float for bf16 operands (nothing rounded).
template <class T, class C>
void local_einsum(const einsum_spec& s, const T* a, const index_t* a_ext, const T* b, const index_t* b_ext, C* out,
                  const index_t* out_ext) {
  static_assert(einsum_result_type_ok<T, C>);  // the public einsums (tensor/einsum.hpp) say so in words
  const labeled_view vo = contiguous_view(s.out_term(), out_ext);
  labeled_view va = contiguous_view(s.term(0), a_ext);
  if (s.nin == 1) {
    if constexpr (std::is_same_v<C, T>) sum_permute_rounded(a, va, out, vo);
    else sum_permute(a, va, out, vo);  // summed in C = sum_t<T>
    return;
  }
  labeled_view vb = contiguous_view(s.term(1), b_ext);
  if (va.size() == 0 || vb.size() == 0) {  // an empty label: empty output, or a sum over nothing
    std::fill(out, out + vo.size(), C(0));
    return;
  }
  // 1. Sum out the labels each input holds alone and the output lacks.
  std::vector<T> a_red, b_red, a_copy, b_copy;
  if (const labeled_view r = without_alone_labels(va, vb, vo); r.rank != va.rank) relayout(a, va, r, a_red);
  if (const labeled_view r = without_alone_labels(vb, va, vo); r.rank != vb.rank) relayout(b, vb, r, b_red);
  // 2. The groups, with the labels that break a merge moved to the loop.
  const gemm_groups g = group_labels(va, vb, vo);
  const index_t m = group_size(g.M, va, vb), n = group_size(g.N, va, vb), k = group_size(g.K, va, vb);
  // 3. Copy an operand into [loop.., M.., K..] (or [loop.., K.., N..]) when
  // no BLAS layout fits its strides; compute C into [loop.., M.., N..] likewise.
  if (!blas_fits(m, k, inner_stride(va, g.M), inner_stride(va, g.K))) relayout(a, va, grouped_view(va, g.L, g.M, g.K), a_copy);
  if (!blas_fits(k, n, inner_stride(vb, g.K), inner_stride(vb, g.N))) relayout(b, vb, grouped_view(vb, g.L, g.K, g.N), b_copy);
  // 4. The GEMMs, accumulating when a contracting label loops (or k = 0) —
  // in sum_t<T>: a bf16 C that accumulates is an fp32 buffer, rounded once.
  const bool accumulate = g.k_in_loop || k == 0;
  const bool c_direct = blas_fits(m, n, inner_stride(vo, g.M), inner_stride(vo, g.N));
  const labeled_view vc = c_direct ? vo : grouped_view(vo, g.L, g.M, g.N);
  auto multiply = [&](const auto* ap, const auto* bp) {
    if (c_direct && (std::is_same_v<sum_t<T>, C> || !accumulate)) {
      if (accumulate) std::fill(out, out + vc.size(), C(0));
      if (vc.size() > 0 && k > 0) gemm_over_loop(s, g, ap, va, bp, vb, out, vc, accumulate);
      return;
    }
    std::vector<sum_t<T>> c(std::size_t(vc.size()), sum_t<T>(0));
    if (vc.size() > 0 && k > 0) gemm_over_loop(s, g, ap, va, bp, vb, c.data(), vc, accumulate);
    sum_permute(c.data(), vc, out, vo);  // a permutation: one rounding to C per element
  };
  // fp32 operands the GEMMs would round to bf16 are rounded once, here: a
  // loop's GEMMs would each round again an operand the loop does not index
  // (x[B, L, M]·w[M, N] into [B, N, L]: one GEMM per sequence, w in each).
  if constexpr (std::is_same_v<T, float>)
    if (vc.size() > 0 && k > 0 && gemm_rounds_to_bf16()) {
      thread_local std::vector<bf16> a16, b16;  // every operand is dense: va.size() elements from a
      return multiply(packed(a, 1, va.size(), va.size(), a16), packed(b, 1, vb.size(), vb.size(), b16));
    }
  multiply(a, b);
}

}  // namespace gshard::detail
