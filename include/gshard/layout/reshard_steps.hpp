// gshard/layout/reshard_steps.hpp — plans a change of sharding as a short sequence of
// single-axis steps, each one collective or one local slice. The planner is
// constexpr: reshard<Target> computes its plan at compile time, tests can also
// run it on layouts built at run time. Knows nothing of MPI.
#pragma once

#include <cstdint>
#include <string_view>

#include "gshard/core/counters.hpp"
#include "gshard/layout/rlayout.hpp"
#include "gshard/layout/shard_geometry.hpp"

namespace gshard {

enum class step_kind : std::uint8_t { all_gather, slice, all_to_all, all_reduce, reduce_scatter, zero_partial, permute };

inline constexpr std::string_view name_of(step_kind k) {
  switch (k) {
    case step_kind::all_gather: return "all_gather";
    case step_kind::slice: return "slice";
    case step_kind::all_to_all: return "all_to_all";
    case step_kind::all_reduce: return "all_reduce";
    case step_kind::reduce_scatter: return "reduce_scatter";
    case step_kind::zero_partial: return "zero_partial";
    case step_kind::permute: return "permute";
  }
  return "?";
}

// The collective a step issues, or false for a local step.
inline constexpr bool is_collective(step_kind k) { return k != step_kind::slice && k != step_kind::zero_partial; }
inline constexpr collective collective_of(step_kind k) {
  switch (k) {
    case step_kind::all_gather: return collective::all_gather;
    case step_kind::all_to_all: return collective::all_to_all;
    case step_kind::all_reduce: return collective::all_reduce;
    case step_kind::reduce_scatter: return collective::reduce_scatter;
    default: return collective::permute;
  }
}

namespace detail {

inline constexpr int max_reshard_steps = 4 * max_mesh_axes + 1;

struct reshard_step {
  step_kind kind{};
  std::int8_t axis = -1;      // the mesh axis (permute: -1, it spans the mesh)
  std::int8_t from_dim = -1;  // all_gather, all_to_all: the dim the axis leaves
  std::int8_t to_dim = -1;    // slice, all_to_all, reduce_scatter: the dim it joins
  std::uint32_t mask = 0;     // the axes the step runs over: 1 << axis, every axis for
                              // permute, several for a merged all_reduce
  friend constexpr bool operator==(const reshard_step&, const reshard_step&) = default;
};

struct reshard_steps {
  int n = 0;
  reshard_step step[max_reshard_steps]{};
  rlayout state[max_reshard_steps + 1]{};  // state[i] is the layout before step i
  friend constexpr bool operator==(const reshard_steps&, const reshard_steps&) = default;

  constexpr int collectives() const {
    int c = 0;
    for (int i = 0; i < n; ++i) c += is_collective(step[i].kind) ? 1 : 0;
    return c;
  }
};

// Dim d still gains axes on the way to `dst`: its axes so far are a proper prefix.
constexpr bool growing(const rlayout& cur, const rlayout& dst, int d) {
  return cur.dims[d].n < dst.dims[d].n && is_prefix(cur.dims[d], dst.dims[d]);
}
constexpr int next_axis(const rlayout& cur, const rlayout& dst, int d) { return dst.dims[d].ax[cur.dims[d].n]; }
// Dim d holds an axis it must lose.
constexpr bool excess(const rlayout& cur, const rlayout& dst, int d) { return !is_prefix(cur.dims[d], dst.dims[d]); }
constexpr int minor_axis(const rlayout& l, int d) { return l.dims[d].ax[l.dims[d].n - 1]; }

// One permute suffices when every dim keeps its block size and the pending
// sums stay on the same axes: then each rank's target block is exactly one
// rank's source block. Block sizes are known equal when a dim keeps its set
// of axes, or when the sizes involved are known, at least 2 (so that a mesh
// with axes of size 1 plans like any other), and their products agree.
constexpr bool permute_suffices(const rlayout& src, const rlayout& dst, const index_t* sizes) {
  if (src == dst || src.partial != dst.partial) return false;
  auto product = [&](const rdim& dim) -> index_t {
    index_t p = 1;
    for (int i = 0; i < dim.n; ++i) {
      if (sizes[dim.ax[i]] < 2) return -1;
      p *= sizes[dim.ax[i]];
    }
    return p;
  };
  for (int d = 0; d < max_rank; ++d) {
    if (axis_set(src.dims[d]) == axis_set(dst.dims[d])) continue;
    const index_t ps = product(src.dims[d]), pd = product(dst.dims[d]);
    if (ps < 0 || ps != pd) return false;
  }
  return true;
}

constexpr void apply(rlayout& l, const reshard_step& s) {
  switch (s.kind) {
    case step_kind::all_gather: l.pop(s.from_dim); break;
    case step_kind::slice: l.push(s.to_dim, s.axis); break;
    case step_kind::all_to_all:
      l.pop(s.from_dim);
      l.push(s.to_dim, s.axis);
      break;
    case step_kind::all_reduce: l.partial &= ~s.mask; break;
    case step_kind::reduce_scatter:
      l.partial &= ~(1u << s.axis);
      l.push(s.to_dim, s.axis);
      break;
    case step_kind::zero_partial: l.partial |= 1u << s.axis; break;
    case step_kind::permute: break;  // the caller sets the target layout
  }
}

// The elements one rank hands a collective step on a tensor of extents
// `global` of rank `rank` (the step's state before is `before`, after it
// `after`): its block, or where a dim the step cuts does not divide, its
// pieces padded to the longest (tensor/execute_reshard.hpp): an all_gather
// sends one piece, an all_to_all and a reduce_scatter one per group rank.
constexpr index_t step_elements(const reshard_step& s, const rlayout& before, const rlayout& after, const index_t* global,
                                int rank, const index_t* sizes, const index_t* coords) {
  index_t n = 1;
  for (int d = 0; d < rank; ++d) {
    index_t e = dim_block(before, d, global[d], sizes, coords).extent;
    if (s.kind == step_kind::all_gather && d == s.from_dim)
      e = piece_capacity(dim_block(after, d, global[d], sizes, coords).extent, sizes[s.axis]);
    if (s.kind == step_kind::all_to_all && d == s.from_dim)
      e = piece_capacity(dim_block(after, d, global[d], sizes, coords).extent, sizes[s.axis]);
    if ((s.kind == step_kind::all_to_all || s.kind == step_kind::reduce_scatter) && d == s.to_dim)
      e = piece_capacity(e, sizes[s.axis]) * sizes[s.axis];
    n *= e;
  }
  return n;
}

// Whether every dim of a tensor of extents `global` has equal blocks in
// every layout of the plan: a value of the global extents and the mesh's
// sizes alone, so every rank decides alike (the gradient buckets stack only
// such plans: their members' blocks then have one size on every rank, and
// every rank cuts its buckets at the same members).
constexpr bool plan_even(const reshard_steps& p, const index_t* global, int rank, const index_t* sizes) {
  for (int i = 0; i <= p.n; ++i)
    for (int d = 0; d < rank; ++d)
      if (!dim_even(p.state[i], d, global[d], sizes)) return false;
  return true;
}

// Plans src -> dst over a mesh of `naxes` axes whose sizes are `sizes`
// (gshard::dynamic, i.e. -1, where unknown). Greedy and deterministic: local
// steps first; then all_to_all, reduce_scatter, all_reduce, all_gather, each
// only where it moves an axis toward its place in dst: the rules in their
// order of priority, as chapter 3 of the docs lists them. Per mesh axis
// (docs/03_resharding.md's table):
//   split(d) -> replicate    all_gather        (the axis must be d's minor-most)
//   replicate -> split(d)    slice, local      (the axis becomes d's minor-most)
//   split(a) -> split(b)     all_to_all
//   partial -> replicate     all_reduce (one over all such axes at once)
//   partial -> split(d)      reduce_scatter
//   replicate -> partial     zero_partial, local (coordinate 0 keeps the value)
//   same blocks, other ranks permute           (one step for the whole mesh)
// `permute` false plans without the permute step (for extents whose blocks
// are not all equal, where one rank's block is not another's).
constexpr reshard_steps plan_reshard(const rlayout& src, const rlayout& dst, int naxes, const index_t* sizes,
                                     bool permute = true) {
  reshard_steps p;
  rlayout cur = src;
  auto emit = [&](reshard_step s) {
    s.mask = s.kind == step_kind::permute ? (naxes >= 32 ? ~0u : (1u << naxes) - 1u) : 1u << s.axis;
    if (s.kind == step_kind::all_reduce && p.n > 0 && p.step[p.n - 1].kind == step_kind::all_reduce) {
      p.step[p.n - 1].mask |= s.mask;  // one all_reduce over the union of the axes
      apply(cur, s);
      return;
    }
    p.state[p.n] = cur;
    if (s.kind == step_kind::permute) cur = dst;
    else apply(cur, s);
    p.step[p.n++] = s;
  };
  auto i8 = [](int v) { return std::int8_t(v); };

  if (permute && permute_suffices(src, dst, sizes)) {
    emit({step_kind::permute, -1, -1, -1});
    p.state[p.n] = cur;
    return p;
  }
  for (int guard = 0; guard < max_reshard_steps && !(cur == dst); ++guard) {
    bool local = false;
    for (int d = 0; d < max_rank; ++d)
      while (growing(cur, dst, d) && cur.is_free(next_axis(cur, dst, d))) {
        emit({step_kind::slice, i8(next_axis(cur, dst, d)), -1, i8(d)});
        local = true;
      }
    for (int a = 0; a < naxes; ++a)
      if (dst.is_partial(a) && cur.is_free(a)) {
        emit({step_kind::zero_partial, i8(a), -1, -1});
        local = true;
      }
    if (local) continue;

    bool done = false;
    for (int d1 = 0; d1 < max_rank && !done; ++d1) {
      if (!excess(cur, dst, d1)) continue;
      const int x = minor_axis(cur, d1);
      for (int d2 = 0; d2 < max_rank && !done; ++d2)
        if (d2 != d1 && growing(cur, dst, d2) && next_axis(cur, dst, d2) == x) {
          emit({step_kind::all_to_all, i8(x), i8(d1), i8(d2)});
          done = true;
        }
    }
    for (int a = 0; a < naxes && !done; ++a) {
      if (!cur.is_partial(a) || dst.is_partial(a)) continue;
      for (int d2 = 0; d2 < max_rank && !done; ++d2)
        if (growing(cur, dst, d2) && next_axis(cur, dst, d2) == a) {
          emit({step_kind::reduce_scatter, i8(a), -1, i8(d2)});
          done = true;
        }
      if (!done && dst.dim_of(a) < 0) {
        emit({step_kind::all_reduce, i8(a), -1, -1});
        done = true;
      }
    }
    for (int d = 0; d < max_rank && !done; ++d)
      if (excess(cur, dst, d)) {
        emit({step_kind::all_gather, i8(minor_axis(cur, d)), i8(d), -1});
        done = true;
      }
    for (int a = 0; a < naxes && !done; ++a)
      if (cur.is_partial(a) && !dst.is_partial(a)) {
        emit({step_kind::all_reduce, i8(a), -1, -1});
        done = true;
      }
  }
  p.state[p.n] = cur;
  return p;
}

// The steps that run `p` on a tensor of extents `global`: `p` itself, but a
// permute (a plan's only step) whose blocks differ goes step by step, since
// one rank's block is then not another's. The executor runs, and a printed
// plan shows, these.
constexpr reshard_steps plan_to_run(const reshard_steps& p, const index_t* global, int rank, int naxes,
                                    const index_t* sizes) {
  if (p.n != 1 || p.step[0].kind != step_kind::permute || plan_even(p, global, rank, sizes)) return p;
  return plan_reshard(p.state[0], p.state[1], naxes, sizes, false);
}

}  // namespace detail
}  // namespace gshard
