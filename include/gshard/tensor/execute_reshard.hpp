// gshard/tensor/execute_reshard.hpp — runs a reshard plan (reshard_steps.hpp)
// on one rank's shard: each step as Pack / Communicate / Unpack, one
// collective or one local slice. Instantiated per element type and rank only
// (the plan is a value), so every sharding of a rank-R tensor shares one
// executor. reshard<>, einsum, the tape and the sharded weight update call
// it (the buckets run their stackable steps themselves).
#pragma once

#include <algorithm>
#include <limits>
#include <span>
#include <type_traits>

#include "gshard/core/raw_storage.hpp"
#include "gshard/runtime/collectives.hpp"
#include "gshard/runtime/nonblocking.hpp"
#include "gshard/kernels/copy_box.hpp"
#include "gshard/layout/shard_geometry.hpp"
#include "gshard/layout/reshard_steps.hpp"
#include "gshard/tensor/tensor.hpp"

namespace gshard::detail {

template <int Rank>
index_t product(const shape<Rank>& e, int from = 0, int to = Rank) {
  index_t p = 1;
  for (int d = from; d < to; ++d) p *= e[std::size_t(d)];
  return p;
}

// The rank whose `from` block is the `to` block of the rank at `coords`
// (a bijection when permute_suffices(from, to)).
inline int permute_source(const mesh_base& m, const rlayout& from, const rlayout& to, const index_t* coords) {
  const index_t* size = m.sizes();
  index_t src[max_mesh_axes] = {};
  for (int d = 0; d < max_rank; ++d) {
    index_t b = 0;
    for (int i = 0; i < to.dims[d].n; ++i) b = b * size[to.dims[d].ax[i]] + coords[to.dims[d].ax[i]];
    for (int i = from.dims[d].n - 1; i >= 0; --i) {
      const int a = from.dims[d].ax[i];
      src[a] = b % size[a];
      b /= size[a];
    }
  }
  for (int a = 0; a < m.naxes(); ++a)
    if (from.is_partial(a)) src[a] = coords[a];
  // Axes that split nothing: map the position on to's free axes onto from's.
  index_t u = 0;
  for (int a = 0; a < m.naxes(); ++a)
    if (!((to.used_mask() >> a) & 1u)) u = u * size[a] + coords[a];
  for (int a = m.naxes() - 1; a >= 0; --a)
    if (!((from.used_mask() >> a) & 1u)) {
      src[a] = u % size[a];
      u /= size[a];
    }
  return m.rank_of(src);
}

// Copies piece `j` of `in` along dim d (the j-th of `parts`, by the rule
// of shard_geometry.hpp) into `out`, whose extents are `slot` (e with dim d
// at least the piece's extent; the piece at its origin).
template <class T, int Rank>
void take_piece(const T* in, const shape<Rank>& e, int d, index_t parts, index_t j, T* out, const shape<Rank>& slot) {
  if (d < 0 || d >= Rank) __builtin_unreachable();  // tells GCC the stores below stay in the arrays
  const block p = piece_of(e[std::size_t(d)], parts, j);
  shape<Rank> piece = e, off{}, zero{};
  piece[std::size_t(d)] = p.extent;
  off[std::size_t(d)] = p.offset;
  copy_box(in, e.data(), off.data(), out, slot.data(), zero.data(), piece.data(), Rank);
}
template <class T, int Rank>
void take_piece(const T* in, const shape<Rank>& e, int d, index_t parts, index_t j, T* out) {
  shape<Rank> piece = e;
  piece[std::size_t(d)] = piece_of(e[std::size_t(d)], parts, j).extent;
  take_piece<T, Rank>(in, e, d, parts, j, out, piece);
}
// Copies the box `pe` at the origin of `piece` (extents `slot`) into `out`
// (extents e) at piece j of `parts` along dim d.
template <class T, int Rank>
void put_piece(const T* piece, const shape<Rank>& slot, const shape<Rank>& pe, int d, index_t parts, index_t j, T* out,
               const shape<Rank>& e) {
  if (d < 0 || d >= Rank) __builtin_unreachable();
  shape<Rank> off{}, zero{};
  off[std::size_t(d)] = piece_of(e[std::size_t(d)], parts, j).offset;
  copy_box(piece, slot.data(), zero.data(), out, e.data(), off.data(), pe.data(), Rank);
}

// A collective step's pieces when its dims do not divide: every piece
// travels in a slot of the longest piece's extents, padded with zeros, so
// that the collective moves equal blocks; the receiver copies out the real
// part. `slot` is the local extents with each split dim at its capacity.
template <int Rank>
shape<Rank> padded_slot(shape<Rank> e, int d, index_t len, index_t parts) {
  e[std::size_t(d)] = piece_capacity(len, parts);
  return e;
}

// An all_to_all step (.., a{..,x}, .., b{..}, ..) |-> (.., a{..}, .., b{..,x}, ..)
// as Pack / Communicate / Unpack: piece j of dim b goes to group rank j, the
// piece from group rank i is block i of dim a. Where both dims divide, each
// of Pack and Unpack is needed only when its dim has others outside it (else
// the pieces lie in order already); where one does not, every piece goes
// padded to the longest (padded_slot). The blocking step (run_step) and the one
// started now and finished later (reshard_request, gshard/tensor/reshard.hpp)
// share it.
template <class T, int Rank>
struct all_to_all_geometry {
  shape<Rank> e, eo;   // local extents before and after
  shape<Rank> slot;    // one piece as it travels
  int a, b;            // the dim gathered (from_dim) and the dim split (to_dim)
  index_t P;           // the group's size
  bool even;           // both dims divide: pieces are equal, no padding
  std::size_t piece;   // elements per piece (per slot)
  std::size_t n;       // elements sent (and received)
  all_to_all_geometry(const mesh_base& m, const reshard_step& s, const rlayout& before, const rlayout& after,
                      const shape<Rank>& global)
      : e(local_extents<Rank>(before, global, m)), eo(local_extents<Rank>(after, global, m)), a(s.from_dim), b(s.to_dim),
        P(m.group(1u << s.axis).size) {
    even = eo[std::size_t(a)] % P == 0 && e[std::size_t(b)] % P == 0;
    slot = padded_slot<Rank>(padded_slot<Rank>(e, b, e[std::size_t(b)], P), a, eo[std::size_t(a)], P);
    piece = std::size_t(product<Rank>(slot));
    n = piece * std::size_t(P);
  }
  // A piece as wire::trimmed sees it: matrices of rows() rows of row() elements (its last two dims).
  std::size_t rows() const {
    if constexpr (Rank >= 2) return std::size_t(slot[std::size_t(Rank - 2)]);
    else return 1;
  }
  std::size_t row() const { return std::size_t(slot[std::size_t(Rank - 1)]); }
  // Whether `w` trims this all_to_all's pieces: wire::trimmed, and each
  // piece's largest message fits one MPI message of bytes.
  bool trims(wire w) const {
    return trims_rows(w) && piece > 0 &&
           trimmed_room<T>(piece, rows(), row()) <= std::size_t(std::numeric_limits<int>::max());
  }
  // Communicate: send's P pieces to the group's ranks, recv's from them,
  // now or started.
  void run(const mesh_base& m, const reshard_step& s, const T* send, T* recv, wire w) const {
    const axis_group& g = m.group(1u << s.axis);
    if (trims(w)) all_to_all_trimmed<T>(g, {send, n}, {recv, n}, rows(), row());
    else all_to_all<T>(g, {send, n}, {recv, n});
  }
  collective_request start(const mesh_base& m, const reshard_step& s, const T* send, T* recv, wire w) const {
    const axis_group& g = m.group(1u << s.axis);
    if (trims(w)) return start_all_to_all_trimmed<T>(g, {send, n}, {recv, n}, rows(), row());
    return start_all_to_all<T>(g, {send, n}, {recv, n});
  }
  bool packs() const { return !even || product<Rank>(e, 0, b) != 1; }
  bool unpacks() const { return !even || product<Rank>(eo, 0, a) != 1; }
  void pack(const T* in, T* send) const {
    if (!even) std::fill(send, send + n, T(0));
    for (index_t j = 0; j < P; ++j) take_piece<T, Rank>(in, e, b, P, j, send + std::size_t(j) * piece, slot);
  }
  void unpack(const T* recv, T* out) const {
    for (index_t i = 0; i < P; ++i) {
      shape<Rank> pe = eo;
      pe[std::size_t(a)] = piece_of(eo[std::size_t(a)], P, i).extent;
      put_piece<T, Rank>(recv + std::size_t(i) * piece, slot, pe, a, P, i, out, eo);
    }
  }
};

// An all_gather step (.., d{..,x}, ..) |-> (.., d{..}, ..): the pieces lie
// in order in the gathered buffer when dim d is the outermost (and they are
// equal); else each lands at its place, and where they differ each travels
// in a zero-padded slot.
template <class T, int Rank>
local_tensor<T, Rank> gather_step(const mesh_base& m, const reshard_step& s, const local_tensor<T, Rank>& in,
                                  const shape<Rank>& e, const shape<Rank>& eo) {
  const std::size_t n = std::size_t(product<Rank>(e));
  const axis_group& g = m.group(1u << s.axis);
  const int d = s.from_dim;
  local_tensor<T, Rank> out(eo);
  const index_t len = eo[std::size_t(d)];
  if (len % g.size == 0 && product<Rank>(e, 0, d) == 1) {
    all_gather<T>(g, {in.data(), n}, {out.data(), std::size_t(out.size())});
    return out;
  }
  // Pack (only where the pieces are short: into a zero-padded slot)
  const shape<Rank> slot = padded_slot<Rank>(e, d, len, g.size);
  const std::size_t piece = std::size_t(product<Rank>(slot));
  uninitialized_buffer<T> send_buf;
  const T* send = in.data();
  if (piece != n) {
    send_buf = uninitialized<T>(piece);
    std::fill(send_buf.get(), send_buf.get() + piece, T(0));
    copy_box(in.data(), e.data(), shape<Rank>{}.data(), send_buf.get(), slot.data(), shape<Rank>{}.data(), e.data(), Rank);
    send = send_buf.get();
  }
  const auto recv = uninitialized<T>(piece * std::size_t(g.size));  // Communicate
  all_gather<T>(g, {send, piece}, {recv.get(), piece * std::size_t(g.size)});
  for (int p = 0; p < g.size; ++p) {  // Unpack
    shape<Rank> pe = e;
    pe[std::size_t(d)] = piece_of(len, g.size, p).extent;
    put_piece<T, Rank>(recv.get() + std::size_t(p) * piece, slot, pe, d, g.size, p, out.data(), eo);
  }
  return out;
}

// A reduce_scatter step partial{x} |-> (.., d{..,x}, ..): piece j of dim d
// summed onto group rank j; pieces packed when d is not the outermost or
// they differ (then each padded to the longest, and this rank's real part
// copied out of its slot).
template <class T, int Rank>
local_tensor<T, Rank> reduce_scatter_step(const mesh_base& m, const reshard_step& s, const local_tensor<T, Rank>& in,
                                          const shape<Rank>& e, const shape<Rank>& eo) {
  const axis_group& g = m.group(1u << s.axis);
  const index_t P = g.size;
  const int d = s.to_dim;
  local_tensor<T, Rank> out(eo);
  const bool even = e[std::size_t(d)] % P == 0;
  const shape<Rank> slot = padded_slot<Rank>(e, d, e[std::size_t(d)], P);
  const std::size_t piece = std::size_t(product<Rank>(slot));
  uninitialized_buffer<T> send_buf, recv_buf;
  const T* send = in.data();
  if (!even || product<Rank>(e, 0, d) != 1) {  // Pack
    send_buf = uninitialized<T>(piece * std::size_t(P));
    if (!even) std::fill(send_buf.get(), send_buf.get() + piece * std::size_t(P), T(0));
    for (index_t j = 0; j < P; ++j) take_piece<T, Rank>(in.data(), e, d, P, j, send_buf.get() + std::size_t(j) * piece, slot);
    send = send_buf.get();
  }
  if (!even) recv_buf = uninitialized<T>(piece);
  T* recv = even ? out.data() : recv_buf.get();
  reduce_scatter<T>(g, {send, piece * std::size_t(P)}, {recv, piece});  // Communicate
  if (!even)  // Unpack: the real part of this rank's slot
    copy_box(recv, slot.data(), shape<Rank>{}.data(), out.data(), eo.data(), shape<Rank>{}.data(), eo.data(), Rank);
  return out;
}

// Runs one step; `before` is the layout of `in`, and the result has `after`:
// a case per step kind, each its Pack / Communicate / Unpack, sharing the
// step's geometry (the extents, the group, the block sizes).
template <class T, int Rank>
GSHARD_NOINLINE local_tensor<T, Rank> run_step(const mesh_base& m, const reshard_step& s, const rlayout& before, const rlayout& after,
                               const local_tensor<T, Rank>& in, const shape<Rank>& global, wire w = wire::same) {
  const shape<Rank> e = local_extents<Rank>(before, global, m);
  const shape<Rank> eo = local_extents<Rank>(after, global, m);
  const std::size_t n = std::size_t(product<Rank>(e));
  switch (s.kind) {
    case step_kind::all_gather: return gather_step<T, Rank>(m, s, in, e, eo);
    case step_kind::slice: {  // (.., d{..}, ..) |-> (.., d{..,x}, ..), local
      local_tensor<T, Rank> out(eo);
      take_piece<T, Rank>(in.data(), e, s.to_dim, m.size(s.axis), m.coord(s.axis), out.data());
      return out;
    }
    case step_kind::all_to_all: {  // (.., a{..,x}, .., b{..}, ..) |-> (.., a{..}, .., b{..,x}, ..)
      const all_to_all_geometry<T, Rank> geo(m, s, before, after, global);
      local_tensor<T, Rank> out(eo);
      uninitialized_buffer<T> send_buf, recv_buf;
      const T* send = in.data();
      if (geo.packs()) {  // Pack
        send_buf = uninitialized<T>(geo.n);
        geo.pack(in.data(), send_buf.get());
        send = send_buf.get();
      }
      if (geo.unpacks()) recv_buf = uninitialized<T>(geo.n);
      T* recv = geo.unpacks() ? recv_buf.get() : out.data();
      geo.run(m, s, send, recv, w);  // Communicate
      if (geo.unpacks()) geo.unpack(recv, out.data());  // Unpack
      return out;
    }
    case step_kind::all_reduce: {  // partial{x} |-> replicated on x
      local_tensor<T, Rank> out(eo);
      all_reduce<T>(m.group(s.mask), {in.data(), n}, {out.data(), n});
      return out;
    }
    case step_kind::reduce_scatter: return reduce_scatter_step<T, Rank>(m, s, in, e, eo);
    case step_kind::zero_partial: {  // replicated on x |-> partial{x}: coordinate 0 keeps the value
      local_tensor<T, Rank> out(eo);
      if (m.coord(s.axis) != 0) out.setZero();
      else out = in;
      return out;
    }
    case step_kind::permute: {  // same blocks, other ranks
      const axis_group& g = m.all_axes();
      const int source = permute_source(m, before, after, m.coords());
      int dest = -1;
      for (int q = 0; q < m.nranks() && dest < 0; ++q)
        if (permute_source(m, before, after, m.coords_of(q).data()) == m.rank()) dest = q;
      local_tensor<T, Rank> out(eo);
      permute<T>(g, {in.data(), n}, dest, {out.data(), std::size_t(out.size())}, source);
      return out;
    }
  }
  return in;
}

// Runs steps [first, n) on a shard it owns: all_reduce and zero_partial
// work in place, the other steps write a fresh shard. `w`: wire::trimmed
// sends the all_to_all steps' pieces without their trailing rows of zeros
// (its other flags are execute_reshard_on's).
template <class T, int Rank>
GSHARD_NOINLINE local_tensor<T, Rank> execute_reshard(const mesh_base& m, const reshard_steps& planned, local_tensor<T, Rank>&& local,
                                      const shape<Rank>& global, int first = 0, wire w = wire::same) {
  const reshard_steps p = plan_to_run(planned, global.data(), Rank, m.naxes(), m.sizes());
  for (int i = first; i < p.n; ++i) {
    const reshard_step& s = p.step[i];
    if (s.kind == step_kind::all_reduce) {
      all_reduce<T>(m.group(s.mask), std::span<T>(local.data(), std::size_t(local.size())));
    } else if (s.kind == step_kind::zero_partial) {
      if (m.coord(s.axis) != 0) local.setZero();
    } else {
      local = run_step<T, Rank>(m, s, p.state[i], p.state[i + 1], local, global, w);
    }
  }
  return std::move(local);
}

// Runs a plan on a shard it only reads: the first step writes a fresh shard.
template <class T, int Rank>
GSHARD_NOINLINE local_tensor<T, Rank> execute_reshard(const mesh_base& m, const reshard_steps& planned, const local_tensor<T, Rank>& local,
                                      const shape<Rank>& global, wire w = wire::same) {
  if (planned.n == 0) return local;
  const reshard_steps p = plan_to_run(planned, global.data(), Rank, m.naxes(), m.sizes());
  return execute_reshard<T, Rank>(m, p, run_step<T, Rank>(m, p.step[0], p.state[0], p.state[1], local, global, w), global, 1, w);
}

// x's elements converted to To (to bf16: rounded to nearest even; a double
// through fp32), in one flat loop whatever the rank.
template <class To, class From, int Rank>
local_tensor<To, Rank> converted(const local_tensor<From, Rank>& x) {
  local_tensor<To, Rank> y(x.dimensions());
  convert_elements(x.data(), std::size_t(x.size()), y.data());
  return y;
}

// An rvalue's storage freed once its values were converted: it is not
// held to the end of the caller's expression.
template <class Local>
void release(Local&& x) {
  if constexpr (std::is_rvalue_reference_v<Local&&> && !std::is_const_v<std::remove_reference_t<Local>>)
    x = std::remove_cvref_t<Local>();
}

// Runs a plan with `w` on the wire. wire::bf16: the shard rounded to bf16,
// the plan run on bf16 (each summing step adds in fp32 and rounds once), the result widened
// back — rounded even where the plan sends nothing, so that every rank
// count computes the same values. wire::same, or a bf16 shard: the plan.
template <class T, int Rank, class Local>
local_tensor<T, Rank> execute_reshard_on(wire w, const mesh_base& m, const reshard_steps& p, Local&& local,
                                         const shape<Rank>& global) {
  if (narrows<T>(w)) {
    auto narrow = converted<bf16>(local);
    release(std::forward<Local>(local));
    if (p.n == 0) return converted<T>(narrow);
    return converted<T>(execute_reshard<bf16, Rank>(m, p, std::move(narrow), global, 0, w));
  }
  if constexpr (std::is_rvalue_reference_v<Local&&> && !std::is_const_v<std::remove_reference_t<Local>>)
    return execute_reshard<T, Rank>(m, p, std::move(local), global, 0, w);
  else
    return execute_reshard<T, Rank>(m, p, local, global, w);
}

// Plans at run time with the mesh's real sizes, then executes: for layouts
// that exist only at run time (the exhaustive tests).
template <class T, int Rank>
local_tensor<T, Rank> reshard_dynamic(const mesh_base& m, const rlayout& from, const rlayout& to,
                                      const local_tensor<T, Rank>& local, const shape<Rank>& global) {
  const reshard_steps p = plan_reshard(from, to, m.naxes(), m.sizes());
  return execute_reshard<T, Rank>(m, p, local, global);
}

}  // namespace gshard::detail
