// gshard/layout/einsum_sharding.hpp — GShard's partitioning rules for an einsum, per
// mesh axis, at compile time: from the operands' shardings, the local slices
// (free: no communication), the natural output sharding, and the errors for
// combinations the rules do not cover (plan_einsum_sharding). Knows nothing of MPI.
#pragma once

#include <cstdint>

#include "gshard/layout/rlayout.hpp"
#include "gshard/layout/einsum_spec.hpp"

namespace gshard::detail {

enum class einsum_problem : std::uint8_t {
  none,
  axis_on_two_labels,   // axis x splits label p in one operand and q in the other
  lists_disagree,       // a shared label split over axis lists where neither extends the other
  partial_and_split,    // x is partial in one operand and splits a label of the other
  both_partial,         // x is partial in both operands
};

struct einsum_sharding {
  rlayout in[max_operands]{};  // operand layouts after the local slices
  rlayout out{};               // the natural output layout
  einsum_problem problem = einsum_problem::none;
  int axis = -1;
  char label_a = 0, label_b = 0;
};


// The label of operand `op` that axis `a` splits (0 if none).
constexpr char label_on(const einsum_spec& s, const rlayout& l, int op, int a) {
  const int d = l.dim_of(a);
  return d < 0 ? 0 : s.in[op][d];
}

// The rules, per mesh axis x:
//   operands on axis x                              natural output on x
//   both replicated                                 replicated
//   batch label b split in both                     split(b)
//   free label split in its operand                 split(that label)
//   contracting k split in both                     partial
//   k or b split in one, the other replicated       slice the other locally, then as above
//   summed label (one input, not the output) split  partial
//   one operand partial, the other replicated       partial
//   anything else                                   compile error naming x and the labels
constexpr einsum_sharding plan_einsum_sharding(const einsum_spec& s, const rlayout* in, int naxes) {
  einsum_sharding r;
  for (int op = 0; op < s.nin; ++op) r.in[op] = in[op];
  auto fail = [&](einsum_problem p, int axis, char la, char lb) {
    r.problem = p;
    r.axis = axis;
    r.label_a = la;
    r.label_b = lb;
    return r;
  };

  // Axes that cannot pair up across the operands.
  if (s.nin == 2)
    for (int a = 0; a < naxes; ++a) {
      const char la = label_on(s, in[0], 0, a), lb = label_on(s, in[1], 1, a);
      const bool pa = in[0].is_partial(a), pb = in[1].is_partial(a);
      if (pa && pb) return fail(einsum_problem::both_partial, a, 0, 0);
      if (pa && lb) return fail(einsum_problem::partial_and_split, a, 0, lb);
      if (pb && la) return fail(einsum_problem::partial_and_split, a, la, 0);
      if (la && lb && la != lb) return fail(einsum_problem::axis_on_two_labels, a, la, lb);
    }

  // Shared labels: the shorter axis list is sliced up to the longer one.
  if (s.nin == 2)
    for (int d = 0; d < s.in_rank[0]; ++d) {
      const char l = s.in[0][d];
      const int e = s.find(1, l);
      if (e < 0) continue;
      const rdim& la = in[0].dims[d];
      const rdim& lb = in[1].dims[e];
      if (is_prefix(la, lb)) r.in[0].dims[d] = lb;
      else if (is_prefix(lb, la)) r.in[1].dims[e] = la;
      else {
        int i = 0;
        while (la.ax[i] == lb.ax[i]) ++i;
        return fail(einsum_problem::lists_disagree, la.ax[i], l, l);
      }
    }

  // The natural output: output labels keep their axes; contracting and
  // summed labels' axes, and the inputs' pending sums, become pending sums.
  for (int d = 0; d < s.out_rank; ++d) {
    const char l = s.out[d];
    const int da = s.find(0, l);
    r.out.dims[d] = da >= 0 ? r.in[0].dims[da] : r.in[1].dims[s.find(1, l)];
  }
  for (int op = 0; op < s.nin; ++op) {
    r.out.partial |= r.in[op].partial;
    for (int d = 0; d < s.in_rank[op]; ++d)
      if (s.find_out(s.in[op][d]) < 0) r.out.partial |= axis_set(r.in[op].dims[d]);
  }
  return r;
}

}  // namespace gshard::detail
