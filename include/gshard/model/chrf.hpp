// gshard/model/chrf.hpp — chrF (Popović 2015), the character n-gram F-score
// of translations, exactly as sacreBLEU 2.x's default CHRF computes it: its
// corpus_chrf(hyps, [refs]) and sentence_chrf(hyp, [ref]) give these values.
//   double c = model::corpus_chrf(hypotheses, references);  // 0..100
//
// Characters are Unicode code points (UTF-8 decoded; a byte that is not part
// of valid UTF-8 counts as one character of its own); whitespace is removed
// (Python's str.split() whitespace). For each order n = 1..6, the n-grams of
// hypothesis and reference are counted; matches = Σ min(hyp count, ref count).
// As sacreBLEU does, a hypothesis's n-grams of an order its reference has none
// of count 0. Statistics are summed over the corpus, then
//   P = mean over effective orders of matches/hyp n-grams,
//   R = mean over effective orders of matches/ref n-grams,
//   chrF = 100 · (1 + β²)·P·R / (β²·P + R), β = 2,
// the effective orders being those with hyp > 0 and ref > 0 (sacreBLEU's
// default; its eps_smoothing option is not this); no effective order, or
// P + R = 0, scores 0.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "gshard/core/error.hpp"

namespace gshard::model {

inline constexpr int chrf_order = 6;  // character n-grams of 1 to 6 characters
inline constexpr double chrf_beta = 2;  // recall weighs β² = 4 times precision

// n-gram counts of a sentence pair or a corpus; index n - 1 for order n.
struct chrf_stats {
  std::array<std::uint64_t, chrf_order> hyp{}, ref{}, match{};

  chrf_stats& operator+=(const chrf_stats& o) {
    for (int i = 0; i < chrf_order; ++i) hyp[i] += o.hyp[i], ref[i] += o.ref[i], match[i] += o.match[i];
    return *this;
  }
};

namespace detail_chrf {

// Python's str.isspace(), which str.split() splits at.
constexpr bool python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

// The code points of UTF-8 text without its whitespace. A byte that starts no
// valid sequence (stray continuation, overlong form, surrogate, beyond
// U+10FFFF, cut short) becomes 0x110000 + byte: one character, equal only to
// the same invalid byte.
inline std::u32string chrf_characters(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const std::size_t len = b < 0x80 ? 1 : b >= 0xc2 && b < 0xe0 ? 2 : b >= 0xe0 && b < 0xf0 ? 3 : b >= 0xf0 && b < 0xf5 ? 4 : 0;
    char32_t c = len == 1 ? b : len == 2 ? b & 0x1f : len == 3 ? b & 0x0f : b & 0x07;
    bool valid = len > 0 && i + len <= s.size();
    for (std::size_t k = 1; valid && k < len; ++k) {
      const auto t = static_cast<unsigned char>(s[i + k]);
      valid = (t & 0xc0) == 0x80;
      c = (c << 6) | (t & 0x3f);
    }
    if (valid && len == 3) valid = c >= 0x800 && (c < 0xd800 || c > 0xdfff);
    if (valid && len == 4) valid = c >= 0x10000 && c <= 0x10ffff;
    if (!valid) c = 0x110000 + b;
    if (!python_space(c)) out.push_back(c);
    i += valid ? len : 1;
  }
  return out;
}

}  // namespace detail_chrf

// One sentence pair's counts.
inline chrf_stats chrf_statistics(std::string_view hyp, std::string_view ref) {
  const std::u32string h = detail_chrf::chrf_characters(hyp), r = detail_chrf::chrf_characters(ref);
  chrf_stats s;
  for (std::size_t n = 1; n <= chrf_order; ++n) {
    if (r.size() < n) continue;  // no reference n-grams: the hypothesis's count 0 too
    std::map<std::u32string_view, std::uint64_t> ref_counts;
    for (std::size_t i = 0; i + n <= r.size(); ++i) ++ref_counts[std::u32string_view(r).substr(i, n)];
    std::uint64_t matched = 0;  // Σ min(hyp, ref) over n-grams: each reference n-gram matched once
    for (std::size_t i = 0; i + n <= h.size(); ++i) {
      const auto it = ref_counts.find(std::u32string_view(h).substr(i, n));
      if (it != ref_counts.end() && it->second > 0) --it->second, ++matched;
    }
    s.hyp[n - 1] = h.size() >= n ? h.size() - n + 1 : 0;
    s.ref[n - 1] = r.size() - n + 1;
    s.match[n - 1] = matched;
  }
  return s;
}

// chrF of (summed) counts, 0..100; the operations in sacreBLEU's order, so
// the doubles agree bit for bit.
inline double chrf_score(const chrf_stats& s) {
  double precision = 0, recall = 0;
  int effective = 0;
  for (int i = 0; i < chrf_order; ++i)
    if (s.hyp[i] > 0 && s.ref[i] > 0) {
      precision += double(s.match[i]) / double(s.hyp[i]);
      recall += double(s.match[i]) / double(s.ref[i]);
      ++effective;
    }
  if (effective == 0) return 0;
  precision /= effective;
  recall /= effective;
  if (precision + recall == 0) return 0;
  const double factor = chrf_beta * chrf_beta;
  double score = (1 + factor) * precision * recall;
  score /= factor * precision + recall;
  return 100 * score;
}

// One sentence's chrF (sacreBLEU's sentence_chrf).
inline double chrf(std::string_view hyp, std::string_view ref) { return chrf_score(chrf_statistics(hyp, ref)); }

// A corpus's chrF: the counts of every pair summed, then scored once — not
// the mean of sentence scores.
inline double corpus_chrf(const std::vector<std::string>& hyps, const std::vector<std::string>& refs) {
  if (hyps.size() != refs.size())
    throw error("gshard::model::corpus_chrf: " + std::to_string(hyps.size()) + " hypotheses but " +
                std::to_string(refs.size()) + " references; give one reference per hypothesis");
  chrf_stats total;
  for (std::size_t i = 0; i < hyps.size(); ++i) total += chrf_statistics(hyps[i], refs[i]);
  return chrf_score(total);
}

}  // namespace gshard::model
