// gshard/layout/einsum_spec.hpp — parses an einsum spec such as "GSEC,GSM->EGCM" at
// compile time and classifies its labels (batch, contracting, free, summed).
// A malformed spec stops the compiler with a gshard::einsum message; the
// spec itself shows in the "required from" note. Knows nothing of MPI.
#pragma once

#include <cstdint>
#include <string_view>

#include "gshard/core/fixed_string.hpp"
#include "gshard/layout/sharding.hpp"

namespace gshard {

// How a label takes part in a contraction.
enum class label_class : std::uint8_t {
  batch,        // in both inputs and the output
  contracting,  // in both inputs, not the output
  free_left,    // in the first input and the output only
  free_right,   // in the second input and the output only
  summed,       // in one input only, not the output
};

namespace detail {

inline constexpr int max_operands = 2;

enum class spec_problem : std::uint8_t {
  none,
  no_arrow,             // "->" missing
  too_many_operands,    // more than two inputs
  empty_input,          // an input term with no labels ("GS,,M->...")
  bad_character,        // a label that is not a letter
  repeated_in_operand,  // "GSG,..." : diagonals are not supported
  repeated_in_output,
  output_not_in_input,
  term_too_long,        // more than gshard::max_rank labels
};

struct einsum_spec {
  int nin = 0;
  char in[max_operands][max_rank + 1]{};
  int in_rank[max_operands]{};
  char out[max_rank + 1]{};
  int out_rank = 0;
  spec_problem problem = spec_problem::none;
  char bad_label = 0;

  constexpr int find(int operand, char l) const {  // dim of label l in an input, or -1
    for (int d = 0; d < in_rank[operand]; ++d)
      if (in[operand][d] == l) return d;
    return -1;
  }
  constexpr int find_out(char l) const {
    for (int d = 0; d < out_rank; ++d)
      if (out[d] == l) return d;
    return -1;
  }
  constexpr label_class classify(char l) const {
    const bool a = find(0, l) >= 0, b = nin > 1 && find(1, l) >= 0, o = find_out(l) >= 0;
    if (a && b) return o ? label_class::batch : label_class::contracting;
    if (o) return a ? label_class::free_left : label_class::free_right;
    return label_class::summed;
  }
  constexpr std::string_view term(int operand) const { return {in[operand], std::size_t(in_rank[operand])}; }
  constexpr std::string_view out_term() const { return {out, std::size_t(out_rank)}; }
  // FLOPs for label extents by letter: 2 per multiply-add (one operand: 1
  // per element summed). The one count the plans print (local extents), the
  // trace records (local) and model_flops() adds up (global).
  constexpr double flops(const index_t* by_letter) const {
    double f = nin == 2 ? 2.0 : 1.0;
    bool seen[128] = {};
    for (int op = 0; op < nin; ++op)
      for (int d = 0; d < in_rank[op]; ++d)
        if (const char l = in[op][d]; !seen[int(l)]) {
          seen[int(l)] = true;
          f *= double(by_letter[int(l)]);
        }
    return f;
  }
};

constexpr bool is_label(char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); }

constexpr einsum_spec parse_einsum(std::string_view s) {
  einsum_spec r;
  const std::size_t arrow = s.find("->");
  if (arrow == std::string_view::npos) {
    r.problem = spec_problem::no_arrow;
    return r;
  }
  auto fill = [&](std::string_view t, char* dst, int& rank) {
    if (t.size() > std::size_t(max_rank)) {
      r.problem = spec_problem::term_too_long;
      return;
    }
    for (std::size_t i = 0; i < t.size(); ++i) {
      const char c = t[i];
      if (!is_label(c)) {
        r.problem = spec_problem::bad_character;
        r.bad_label = c;
        return;
      }
      for (std::size_t j = 0; j < i; ++j)
        if (t[j] == c) {
          r.problem = spec_problem::repeated_in_operand;
          r.bad_label = c;
          return;
        }
      dst[i] = c;
    }
    rank = int(t.size());
  };
  std::string_view ins = s.substr(0, arrow);
  while (r.problem == spec_problem::none) {
    const std::size_t comma = ins.find(',');
    const std::string_view t = ins.substr(0, comma);
    if (r.nin == max_operands) {
      r.problem = spec_problem::too_many_operands;
      break;
    }
    if (t.empty()) {
      r.problem = spec_problem::empty_input;
      break;
    }
    fill(t, r.in[r.nin], r.in_rank[r.nin]);
    ++r.nin;
    if (comma == std::string_view::npos) break;
    ins = ins.substr(comma + 1);
  }
  if (r.problem != spec_problem::none) return r;
  fill(s.substr(arrow + 2), r.out, r.out_rank);
  if (r.problem == spec_problem::repeated_in_operand) r.problem = spec_problem::repeated_in_output;
  if (r.problem != spec_problem::none) return r;
  for (int d = 0; d < r.out_rank; ++d)
    if (r.find(0, r.out[d]) < 0 && (r.nin < 2 || r.find(1, r.out[d]) < 0)) {
      r.problem = spec_problem::output_not_in_input;
      r.bad_label = r.out[d];
      return r;
    }
  return r;
}

// The checks, one static_assert per problem; instantiated as
// check_einsum_spec<"GSEC,GSM->EGCM"> so the spec shows in the diagnostic.
template <fixed_string Spec>
struct check_einsum_spec {
  static constexpr einsum_spec spec = parse_einsum(Spec.view());
  static_assert(spec.problem != spec_problem::no_arrow,
                "gshard::einsum: the spec has no \"->\"; write it as \"GSM,ME->GSE\" (inputs, arrow, output)");
  static_assert(spec.problem != spec_problem::too_many_operands, "gshard::einsum: at most two operands are supported");
  static_assert(spec.problem != spec_problem::empty_input, "gshard::einsum: an input term of the spec is empty");
  static_assert(spec.problem != spec_problem::bad_character,
                "gshard::einsum: labels are single letters A-Z or a-z, without spaces");
  static_assert(spec.problem != spec_problem::repeated_in_operand,
                "gshard::einsum: a label is repeated within one operand (diagonals are not supported); rename one of them");
  static_assert(spec.problem != spec_problem::repeated_in_output, "gshard::einsum: a label is repeated in the output term");
  static_assert(spec.problem != spec_problem::output_not_in_input,
                "gshard::einsum: an output label appears in no input; every output label must come from an input");
  static_assert(spec.problem != spec_problem::term_too_long, "gshard::einsum: a term has more than gshard::max_rank labels");
  static constexpr bool ok = spec.problem == spec_problem::none;
};

template <fixed_string Spec, int Operand, int GivenRank>
struct check_operand_rank {
  static constexpr einsum_spec spec = parse_einsum(Spec.view());
  static_assert(spec.in_rank[Operand] == GivenRank,
                "gshard::einsum: an operand's rank differs from its term in the spec (operand and its rank: see the instantiation above)");
  static constexpr bool ok = true;
};

}  // namespace detail
}  // namespace gshard
