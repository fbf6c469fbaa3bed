// bench/legacy/ (frozen copy of gshard/moe/layer.hpp — GShard's MoE layer on a mesh with an "expert" axis
// (and optionally a "data" axis): tokens split over groups on every rank,
// experts split over "expert". Forward = gating, dispatch, all_to_all, expert
// FFN, all_to_all back, combine — the two all_to_alls are the only
// collectives, and both fall out of reshards between the shardings below.
// Dispatch and combine run by index (the default) or as the one-hot einsums
// of the paper (the executable specification).
#pragma once

#include <cstring>
#include <optional>

#include "gshard/einsum.hpp"
#include "moe_gating.hpp"
#include "gshard/ops.hpp"

namespace legacy::moe {
using namespace gshard;

namespace detail {
using gshard::detail::layout_spec;
using gshard::detail::name_t;

// Every mesh axis except "model" carries groups (and batch): the ranks along
// "model" hold the same groups and split the heads and hidden units instead.
constexpr bool is_batch_axis(std::string_view axis) { return axis != "model"; }

// Dim `dim` split over the batch axes in mesh order, but with "expert" the
// minor-most (or left out if `without_expert`): then moving the groups'
// "expert" part onto E is one all_to_all whatever the mesh's axis order.
template <class Mesh>
constexpr layout_spec split_groups(int dim, bool without_expert) {
  gshard::detail::spec_result r;
  name_t axes[max_mesh_axes]{};
  int n = 0;
  for (const name_t& a : Mesh::names)
    if (is_batch_axis(a.view()) && a.view() != "expert") axes[n++] = a;
  if (!without_expert && Mesh::index_of("expert") >= 0) axes[n++] = name_t("expert");
  if (n) gshard::detail::add_split(r, dim, axes, n);
  return r.spec;
}
template <class Mesh>
constexpr layout_spec split_experts(int dim, int group_dim) {
  layout_spec s = group_dim >= 0 ? split_groups<Mesh>(group_dim, true) : layout_spec{};
  gshard::detail::spec_result r{s};
  const name_t expert[1] = {name_t("expert")};
  gshard::detail::add_split(r, dim, expert, 1);
  return r.spec;
}
// `s` with dim `dim` also split over "model", if the mesh has that axis.
template <class Mesh>
constexpr layout_spec over_model(layout_spec s, int dim) {
  gshard::detail::spec_result r{s};
  const name_t model[1] = {name_t("model")};
  if (Mesh::index_of("model") >= 0) gshard::detail::add_split(r, dim, model, 1);
  return r.spec;
}
template <const layout_spec& S>
using layout_of = layout<gshard::detail::text_of<gshard::detail::render(S).n>(S)>;

template <class Mesh>
struct specs {
  static constexpr layout_spec groups0 = split_groups<Mesh>(0, false);
  static constexpr layout_spec groups1 = split_groups<Mesh>(1, false);
  static constexpr layout_spec experts_in = over_model<Mesh>(split_experts<Mesh>(0, -1), 2);
  static constexpr layout_spec experts_out = over_model<Mesh>(split_experts<Mesh>(0, -1), 1);
  static constexpr layout_spec experts_groups = split_experts<Mesh>(0, 1);
  static constexpr layout_spec hidden = over_model<Mesh>(split_experts<Mesh>(0, 1), 3);
};
}  // namespace detail

// The shardings of the MoE layer on Mesh (here for mesh<data, expert>; with
// a "model" axis, each expert's hidden units H are also split over it):
template <mesh_type Mesh>
struct shardings {
  static_assert(Mesh::index_of("expert") >= 0, "gshard::moe: the mesh needs an axis named \"expert\"");
  using by_group = detail::layout_of<detail::specs<Mesh>::groups0>;           // GSM, GSE, GSEC: [G{data,expert},...]
  using egcm_by_group = detail::layout_of<detail::specs<Mesh>::groups1>;      // EGCM: [E,G{data,expert},C,M]
  using by_expert = detail::layout_of<detail::specs<Mesh>::experts_groups>;   // EGCM: [E{expert},G{data},C,M]
  using hidden = detail::layout_of<detail::specs<Mesh>::hidden>;              // EGCH: [E{expert},G{data},C,H{model}]
  using experts_in = detail::layout_of<detail::specs<Mesh>::experts_in>;      // EMH: [E{expert},M,H{model}]
  using experts_out = detail::layout_of<detail::specs<Mesh>::experts_out>;    // EHM: [E{expert},H{model},M]
};

template <class T, mesh_type Mesh>
struct params {
  using S = shardings<Mesh>;
  tensor<T, 2, Mesh, replicate> gate;             // wg [M, E]
  tensor<T, 3, Mesh, typename S::experts_in> wi;   // [E, M, H]
  tensor<T, 3, Mesh, typename S::experts_out> wo;  // [E, H, M]
};

// A normal-ish value that depends only on (seed, tensor id, global index): the
// same parameters at every rank count, each rank generating only its shard.
inline double init_value(std::uint64_t seed, std::uint64_t id, std::uint64_t index) {
  const double u1 = uniform(seed, id, index, 0x5EED), u2 = uniform(seed, id, index, 0xF00D);
  return std::sqrt(-2.0 * std::log(u1 + 1e-300)) * std::cos(6.283185307179586 * u2);
}
template <class X>
void init_normal(X& t, double stddev, std::uint64_t seed, std::uint64_t id) {
  const auto le = t.local_extents(), off = t.offsets(), ge = t.extents();
  constexpr int R = X::rank;
  std::array<index_t, std::size_t(R)> pos{};
  for (index_t i = 0, n = t.local().size(); i < n; ++i) {
    index_t global = 0;
    for (int d = 0; d < R; ++d) global = global * ge[std::size_t(d)] + off[std::size_t(d)] + pos[std::size_t(d)];
    t.data()[i] = typename X::value_type(stddev * init_value(seed, id, std::uint64_t(global)));
    for (int d = R - 1; d >= 0 && ++pos[std::size_t(d)] == le[std::size_t(d)]; --d) pos[std::size_t(d)] = 0;
  }
}

template <class T, mesh_type Mesh>
params<T, Mesh> init_params(const Mesh& m, index_t M, index_t H, index_t E, std::uint64_t seed, std::uint64_t id = 0) {
  using S = shardings<Mesh>;
  params<T, Mesh> p{tensor<T, 2, Mesh, replicate>(m, {M, E}), tensor<T, 3, Mesh, typename S::experts_in>(m, {E, M, H}),
                    tensor<T, 3, Mesh, typename S::experts_out>(m, {E, H, M})};
  init_normal(p.gate, 1.0 / std::sqrt(double(M)), seed, 3 * id);
  init_normal(p.wi, 1.0 / std::sqrt(double(M)), seed, 3 * id + 1);
  init_normal(p.wo, 1.0 / std::sqrt(double(H)), seed, 3 * id + 2);
  return p;
}

enum class dispatch_mode : std::uint8_t { index, einsum };

// What the backward needs from a forward (moe/backward.hpp).
template <class T, mesh_type Mesh>
struct cache {
  using S = shardings<Mesh>;
  std::optional<tensor<T, 4, Mesh, typename S::by_expert>> xe;      // dispatched tokens at the experts [E{expert},G{data},C,M]
  std::optional<tensor<T, 4, Mesh, typename S::hidden>> h;          // relu(EGCM,EMH->EGCH)  [E{expert},G{data},C,H{model}]
  std::optional<tensor<T, 4, Mesh, typename S::egcm_by_group>> y;   // expert outputs at the groups  [E,G{data,expert},C,M]
};

template <class T, mesh_type Mesh>
struct output {
  tensor<T, 3, Mesh, typename shardings<Mesh>::by_group> y;  // [G,S,M]
  gating_stats stats;                                         // this rank's groups
  double aux_partial = 0;  // this rank's share: the sum over group_axes(mesh) is the aux loss
  routing<T> route;
};

// The ranks that hold different groups: the batch axes (the ranks along
// "model" hold the same groups and compute the same routing).
template <mesh_type Mesh>
const gshard::detail::axis_group& group_axes(const Mesh& m) {
  std::uint32_t mask = 0;
  for (int a = 0; a < m.naxes(); ++a)
    if (detail::is_batch_axis(Mesh::names[std::size_t(a)].view())) mask |= 1u << a;
  return m.mesh_base::group(mask);
}

// Sums gating statistics over the ranks' groups (one all_reduce; call it
// outside the timed forward).
template <mesh_type Mesh>
gating_stats reduce(const gating_stats& s, const Mesh& m) {
  std::vector<double> v(s.expert_load.begin(), s.expert_load.end());
  v.insert(v.end(), {double(s.tokens), double(s.dropped_first), double(s.dropped_second), double(s.skipped_second),
                     double(s.invalid), s.aux_sum});
  all_reduce<double>(group_axes(m), v);
  gating_stats r;
  const std::size_t E = s.expert_load.size();
  for (std::size_t e = 0; e < E; ++e) r.expert_load.push_back(std::int64_t(v[e]));
  r.tokens = std::int64_t(v[E]), r.dropped_first = std::int64_t(v[E + 1]), r.dropped_second = std::int64_t(v[E + 2]);
  r.skipped_second = std::int64_t(v[E + 3]), r.invalid = std::int64_t(v[E + 4]), r.aux_sum = v[E + 5];
  return r;
}

namespace detail {

// xe[e, g, c, :] = x[g, s, :] for every placed choice; other slots zero.
template <class T>
void dispatch_rows(const routing<T>& r, const T* x, index_t M, T* xe) {
  const index_t G = r.groups, S = r.tokens, C = r.capacity;
  std::memset(xe, 0, sizeof(T) * std::size_t(r.experts * G * C * M));
  for (index_t g = 0; g < G; ++g)
    for (index_t s = 0; s < S; ++s)
      for (int k = 0; k < 2; ++k) {
        const std::size_t c = r.choice(g, s, k);
        if (r.expert[c] < 0) continue;
        std::memcpy(xe + ((index_t(r.expert[c]) * G + g) * C + r.slot[c]) * M, x + (g * S + s) * M, sizeof(T) * std::size_t(M));
      }
}

// y[g, s, :] = Σ_k weight_k · ye[e_k, g, c_k, :].
template <class T>
void combine_rows(const routing<T>& r, const T* ye, index_t M, T* y) {
  const index_t G = r.groups, S = r.tokens, C = r.capacity;
  for (index_t g = 0; g < G; ++g)
    for (index_t s = 0; s < S; ++s) {
      T* out = y + (g * S + s) * M;
      std::fill(out, out + M, T(0));
      for (int k = 0; k < 2; ++k) {
        const std::size_t c = r.choice(g, s, k);
        if (r.expert[c] < 0) continue;
        const T w = r.weight[c];
        const T* row = ye + ((index_t(r.expert[c]) * G + g) * C + r.slot[c]) * M;
        for (index_t i = 0; i < M; ++i) out[i] += w * row[i];
      }
    }
}

// The one-hot tensors of the paper: combine[g,s,e,c] = weight, dispatch = (combine ≠ 0).
template <class T>
void dense_tensors(const routing<T>& r, T* combine, T* dispatch) {
  const index_t E = r.experts, C = r.capacity;
  std::memset(combine, 0, sizeof(T) * std::size_t(r.groups * r.tokens * E * C));
  std::memset(dispatch, 0, sizeof(T) * std::size_t(r.groups * r.tokens * E * C));
  for (index_t g = 0; g < r.groups; ++g)
    for (index_t s = 0; s < r.tokens; ++s)
      for (int k = 0; k < 2; ++k) {
        const std::size_t c = r.choice(g, s, k);
        if (r.expert[c] < 0) continue;
        const index_t at = ((g * r.tokens + s) * E + r.expert[c]) * C + r.slot[c];
        combine[at] = r.weight[c];
        dispatch[at] = T(1);
      }
}

}  // namespace detail

// The MoE layer's forward: x [G{data,expert},S,M] -> y of the same sharding.
// `stream` keys the random routing (use the layer and step). Exactly two
// collectives run: the all_to_all into the experts and the one back — and,
// with a "model" axis splitting the experts' H, one all_reduce over it
// after the second expert einsum.
template <class T, mesh_type Mesh>
output<T, Mesh> forward(const tensor<T, 3, Mesh, typename shardings<Mesh>::by_group>& x, const params<T, Mesh>& p,
                        const gating_config& cfg, std::uint64_t stream, dispatch_mode mode = dispatch_mode::index,
                        cache<T, Mesh>* keep = nullptr) {
  using S = shardings<Mesh>;
  const Mesh& m = x.mesh();
  const index_t G = x.extent(0), Sg = x.extent(1), M = x.extent(2), E = p.gate.extent(1);
  if (p.gate.extent(0) != M || p.wi.extent(0) != E || p.wi.extent(1) != M || p.wo.extent(0) != E ||
      p.wo.extent(1) != p.wi.extent(2) || p.wo.extent(2) != M)
    throw shape_error("gshard::moe::forward: x " + x.notation("GSM") + " does not fit the weights " + p.gate.notation("ME") +
                      ", " + p.wi.notation("EMH") + ", " + p.wo.notation("EHM"));
  output<T, Mesh> out{tensor<T, 3, Mesh, typename S::by_group>(m, {G, Sg, M}), {}, 0.0, {}};

  const auto logits = einsum<"GSM,ME->GSE">(x, p.gate);  // [G{data,expert},S,E], local
  const index_t Gl = logits.local_extents()[0];
  {
    trace::span s("top-2 gating", "moe");
    out.stats = top2_gating<T>(logits.data(), Gl, Sg, E, x.offsets()[0], stream, cfg, out.route);
  }
  out.aux_partial = G > 0 ? out.stats.aux_sum / double(G) : 0.0;
  const index_t C = out.route.capacity;

  std::optional<tensor<T, 4, Mesh, typename S::by_group>> combine;
  auto xe_experts = [&] {  // [E{expert},G{data},C,M]: one all_to_all either way
    if (mode == dispatch_mode::index) {
      tensor<T, 4, Mesh, typename S::egcm_by_group> xe(m, {E, G, C, M});  // [E,G{data,expert},C,M]
      {
        trace::span s("dispatch", "moe");
        detail::dispatch_rows(out.route, x.data(), M, xe.data());
      }
      return reshard<typename S::by_expert>(std::move(xe));
    }
    tensor<T, 4, Mesh, typename S::by_group> dispatch(m, {G, Sg, E, C});  // [G{data,expert},S,E,C]
    combine.emplace(m, shape<4>{G, Sg, E, C});
    detail::dense_tensors(out.route, combine->data(), dispatch.data());
    return einsum<"GSEC,GSM->EGCM", typename S::by_expert>(dispatch, x);  // local, then all_to_all
  }();
  auto h = relu(einsum<"EGCM,EMH->EGCH">(xe_experts, p.wi));      // [E{expert},G{data},C,H{model}]: experts live here
  auto ye = einsum<"EGCH,EHM->EGCM", typename S::by_expert>(h, p.wo);  // [E{expert},G{data},C,M]
  auto y = reshard<typename S::egcm_by_group>(std::move(ye));     // all_to_all: [E,G{data,expert},C,M]
  if (mode == dispatch_mode::index) {
    trace::span s("combine", "moe");
    detail::combine_rows(out.route, y.data(), M, out.y.data());
  }
  else out.y = einsum<"GSEC,EGCM->GSM">(*combine, y);             // local
  if (keep) {
    keep->xe = std::move(xe_experts);
    keep->h = std::move(h);
    keep->y = std::move(y);
  }
  return out;
}

}  // namespace legacy::moe
