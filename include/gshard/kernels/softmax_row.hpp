// gshard/kernels/softmax_row.hpp — the softmax of one row and its gradient,
// the kernels behind softmax() and causal_softmax() (tensor/ops.hpp), the
// router's gates (moe/gating.hpp) and the cross-entropy's loss and gradient
// (ad/nn.hpp).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "gshard/core/bf16.hpp"
#include "gshard/core/types.hpp"
#include "gshard/kernels/blockwise.hpp"

namespace gshard::detail {

namespace softmax_detail {
namespace ei = Eigen::internal;
template <class T>
using packet = typename ei::packet_traits<T>::type;
template <class T>
constexpr index_t width = ei::packet_traits<T>::size;
// Float and double rows run on Eigen's packets (with its vectorised exp);
// other types, or a build without it, take the same steps on scalars.
template <class T>
constexpr bool on_packets = (std::is_same_v<T, float> || std::is_same_v<T, double>) && ei::packet_traits<T>::HasExp;

template <class T>
constexpr T lowest = std::is_same_v<T, float> ? T(-80) : T(-700);  // exp of it is still a normal number

// The last rest (0 < rest < width) entries of a row: loaded into one packet
// with the lanes after them `pad`, and stored back. Eigen 3.4 has masked
// loads and stores for float packets of 8 (AVX) and 16 (AVX-512) lanes: the
// lanes past the row are not touched. The others go through an aligned
// copy (a store the load cannot forward from: it cost a softmax row of
// 1 to 128 entries a third of its time).
template <class T>
constexpr bool masked = std::is_same_v<T, float> && (width<T> == 8 || width<T> == 16);
template <class T>
using lane_mask = std::conditional_t<width<T> == 16, std::uint16_t, std::uint8_t>;
template <class T>
packet<T> load_partial(const T* p, index_t rest, T pad) {
  if constexpr (masked<T>) {
    const packet<T> v = ei::ploadu<packet<T>>(p, lane_mask<T>((1u << rest) - 1));
    const packet<T> in_row = ei::pcmp_lt(ei::plset<packet<T>>(T(0)), ei::pset1<packet<T>>(T(rest)));
    return ei::pselect(in_row, v, ei::pset1<packet<T>>(pad));
  } else {
    EIGEN_ALIGN_MAX T t[width<T>];
    for (index_t j = 0; j < width<T>; ++j) t[j] = j < rest ? p[j] : pad;
    return ei::pload<packet<T>>(t);
  }
}
template <class T>
void store_partial(T* p, const packet<T>& v, index_t rest) {
  if constexpr (masked<T>) {
    ei::pstoreu(p, v, lane_mask<T>((1u << rest) - 1));
  } else {
    EIGEN_ALIGN_MAX T t[width<T>];
    ei::pstore(t, v);
    std::copy_n(t, rest, p);
  }
}

// Pass 1: out = scale · in (skipped when scale is 1: out is in then), and
// the largest of them into *mx (unless null). Returns where the scaled row is.
template <class T>
const T* scale_and_max(const T* in, index_t n, T* out, T scale, T* mx) {
  if constexpr (!on_packets<T>) {  // the same steps on scalars
    const T* x = in;
    if (scale != T(1)) {
      for (index_t i = 0; i < n; ++i) out[i] = in[i] * scale;
      x = out;
    }
    if (mx) {
      *mx = -std::numeric_limits<T>::infinity();
      for (index_t i = 0; i < n; ++i) *mx = x[i] > *mx ? x[i] : *mx;
    }
    return x;
  } else {
    constexpr index_t w = width<T>;
    const T inf = std::numeric_limits<T>::infinity();
    packet<T> m = ei::pset1<packet<T>>(-inf);
    const index_t whole = n / w * w;
    if (scale == T(1)) {
      if (!mx) return in;
      for (index_t i = 0; i < whole; i += w) m = ei::pmax(m, ei::ploadu<packet<T>>(in + i));
      if (whole < n) m = ei::pmax(m, load_partial(in + whole, n - whole, -inf));
      *mx = ei::predux_max(m);
      return in;
    }
    const packet<T> s = ei::pset1<packet<T>>(scale);
    for (index_t i = 0; i < whole; i += w) {
      const packet<T> x = ei::pmul(ei::ploadu<packet<T>>(in + i), s);
      ei::pstoreu(out + i, x);
      m = ei::pmax(m, x);
    }
    if (whole < n) {
      const packet<T> x = ei::pmul(load_partial(in + whole, n - whole, -inf), s);
      store_partial(out + whole, x, n - whole);
      m = ei::pmax(m, load_partial(out + whole, n - whole, -inf));  // the pad is -inf whatever the scale's sign
    }
    if (mx) *mx = ei::predux_max(m);
    return out;
  }
}

// Pass 2: out = exp(x − mx) for the scaled row x, clamped at `lowest`, the
// clamped entries 0 (NaN stays); returns their sum. Every entry, the row's
// last ones too (in a padded packet), takes the same instructions.
template <class T>
T exp_shifted(const T* x, index_t n, T* out, T mx) {
  if constexpr (!on_packets<T>) {
    const T cut = std::exp(lowest<T> + 1);
    T sum = 0;
    for (index_t i = 0; i < n; ++i) {
      const T d = x[i] - mx, e = std::exp(d < lowest<T> ? lowest<T> : d);  // a NaN d stays NaN
      sum += (out[i] = e <= cut ? T(0) : e);
    }
    return sum;
  } else {
    constexpr index_t w = width<T>;
    const packet<T> shift = ei::pset1<packet<T>>(mx), low = ei::pset1<packet<T>>(lowest<T>);
    const packet<T> cut = ei::pset1<packet<T>>(std::exp(lowest<T> + 1));  // with a margin for exp's last bits
    auto one = [&](const packet<T>& v) {
      // pmax(a, b) keeps a NaN a (std::max's order), so a NaN entry stays NaN.
      const packet<T> e = ei::pexp(ei::pmax(ei::psub(v, shift), low));
      return ei::pandnot(e, ei::pcmp_le(e, cut));
    };
    packet<T> sum = ei::pzero(shift);
    const index_t whole = n / w * w;
    for (index_t i = 0; i < whole; i += w) {
      const packet<T> e = one(ei::ploadu<packet<T>>(x + i));
      ei::pstoreu(out + i, e);
      sum = ei::padd(sum, e);
    }
    if (whole < n) {
      const packet<T> e = one(load_partial(x + whole, n - whole, -std::numeric_limits<T>::infinity()));  // the pad's exp: 0
      store_partial(out + whole, e, n - whole);
      sum = ei::padd(sum, e);
    }
    return ei::predux(sum);
  }
}

// Pass 3: out /= sum.
template <class T>
void divide(T* out, index_t n, T sum) {
  if constexpr (!on_packets<T>) {
    for (index_t i = 0; i < n; ++i) out[i] /= sum;
  } else {
    constexpr index_t w = width<T>;
    const packet<T> s = ei::pset1<packet<T>>(sum);
    const index_t whole = n / w * w;
    for (index_t i = 0; i < whole; i += w) ei::pstoreu(out + i, ei::pdiv(ei::ploadu<packet<T>>(out + i), s));
    if (whole < n) store_partial(out + whole, ei::pdiv(load_partial(out + whole, n - whole, T(1)), s), n - whole);
  }
}
}  // namespace softmax_detail

// softmax_row's two numbers of a row, kept to compute it again
// (softmax_row_again): the largest scaled entry and the sum of the shifted exps.
template <class T>
struct softmax_row_stats {
  T max, sum;
};

// out = softmax(scale · in) over n entries (none: returns -inf), shifted by the
// largest for stability (in may be out). Entries of -inf get 0. Returns the log of the
// partition function, log Σ exp(in), in double. The caller decides what NaN,
// +inf or a row of only -inf mean.
//
// Three passes, on Eigen's packets for float and double: the scaled row and
// its largest entry; the exps of the shifted entries clamped at -80
// (float) or -700 (double) and their sum; the division. An entry 79 (699)
// or more below the row's largest gets 0 (its share is under 5e-35, or
// 3e-304; -inf entries exactly 0, as std::exp gives). The clamp keeps the
// exp away from subnormal results, which cost a microcode assist each:
// measured on a Zen 3 core over float rows of 128 with masked entries, 2.2
// against 7.5 ns per element for std::exp (3.4x), within 5e-7 relative.
// Every entry takes the same instructions wherever the row sits (the last
// partial packet goes through a padded one, unaligned loads elsewhere): the
// same logits give the same probabilities on every rank and at every
// address, so they route alike (test_moe). The scale is applied (in T) and
// the scaled row stored before the shift, so softmax_row(x, n, out, s)
// equals softmax_row of s·x. On float rows of 1 to 128 entries (the
// trainer's causal attention, one-off on an AVX-512 Xeon) a row takes 81–85
// ns, against 109 for the Eigen expressions on a copy padded to whole
// packets that these passes replaced. With `stats`, the row's largest
// scaled entry and sum of exps are kept.
template <class T>
double softmax_row(const T* in, index_t n, T* out, T scale = T(1), softmax_row_stats<T>* stats = nullptr) {
  if (n == 0) return -std::numeric_limits<double>::infinity();  // log Σ over nothing
  T mx;
  const T* x = softmax_detail::scale_and_max(in, n, out, scale, &mx);
  const T sum = softmax_detail::exp_shifted(x, n, out, mx);
  softmax_detail::divide(out, n, sum);
  if (stats) *stats = {mx, sum};
  return double(mx) + std::log(double(sum));
}

// The row softmax_row(in, n, out, scale, &stats) gave, computed again from
// the same logits and its stats: bit for bit the same (the same passes).
template <class T>
void softmax_row_again(const T* in, index_t n, T* out, T scale, const softmax_row_stats<T>& stats) {
  if (n == 0) return;
  const T* x = softmax_detail::scale_and_max(in, n, out, scale, static_cast<T*>(nullptr));
  (void)softmax_detail::exp_shifted(x, n, out, stats.max);
  softmax_detail::divide(out, n, stats.sum);
}

// The gradient through y = softmax(scale · x) of one row of n entries, in
// place: g = scale · p ⊙ (g − <g, p>). Float and double take Eigen's
// packets (the dot in several accumulators), which -O2 would not vectorise.
template <class T>
void softmax_row_backward(T* g, const T* p, index_t n, T scale = T(1)) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    using row = Eigen::Array<T, Eigen::Dynamic, 1>;
    Eigen::Map<row> gv(g, n);
    const Eigen::Map<const row> pv(p, n);
    const T dot = gv.matrix().dot(pv.matrix());
    gv = scale * pv * (gv - dot);
  } else {
    T dot = 0;
    for (index_t i = 0; i < n; ++i) dot += g[i] * p[i];
    for (index_t i = 0; i < n; ++i) g[i] = scale * p[i] * (g[i] - dot);
  }
}

// The same with p in bf16 (the probabilities a bf16 forward kept), widened
// as they are read: the dot summed in 16 lanes, then across them in order
// — the same sum wherever the row sits. Both passes run in blocks of 16 (a
// fixed trip count: GCC vectorizes them at -O2) and a tail.
inline void softmax_row_backward(float* g, const bf16* p, index_t n, float scale = 1.0f) {
  using bf16_detail::widen;
  constexpr index_t lanes = 16;
  const index_t whole = n - n % lanes;
  float lane[lanes] = {};
  for (index_t i = 0; i < whole; i += lanes)
    for (index_t k = 0; k < lanes; ++k) lane[k] += g[i + k] * widen(p[i + k]);
  float dot = 0;
  for (const float l : lane) dot += l;
  for (index_t i = whole; i < n; ++i) dot += g[i] * widen(p[i]);
  for (index_t i = 0; i < whole; i += lanes)
    for (index_t k = 0; k < lanes; ++k) g[i + k] = scale * widen(p[i + k]) * (g[i + k] - dot);
  for (index_t i = whole; i < n; ++i) g[i] = scale * widen(p[i]) * (g[i] - dot);
}

}  // namespace gshard::detail
