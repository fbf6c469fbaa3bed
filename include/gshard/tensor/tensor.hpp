// gshard/tensor/tensor.hpp — a sharded tensor: global extents, the bound mesh, and
// this rank's shard as a row-major Eigen tensor. The sharding is part of the
// type; where each shard lives is computed by detail::dim_block alone.
#pragma once

#include <array>
#include <iterator>
#include <string>
#include <unsupported/Eigen/CXX11/Tensor>
#include <utility>

#include "gshard/kernels/copy_box.hpp"
#include "gshard/layout/rlayout.hpp"
#include "gshard/layout/shard_geometry.hpp"
#include "gshard/core/error.hpp"
#include "gshard/layout/labels.hpp"
#include "gshard/runtime/mesh.hpp"
#include "gshard/layout/notation.hpp"
#include "gshard/layout/sharding.hpp"

namespace gshard {

template <class T, int Rank>
using local_tensor = Eigen::Tensor<T, Rank, Eigen::RowMajor>;

template <int Rank>
using shape = std::array<index_t, std::size_t(Rank)>;

namespace detail {

// Diagnostics that name the offending value in the compiler's
// "required from" note.
template <fixed_string Axis>
struct axis_not_in_mesh {
  static_assert(Axis.size() == 0, "gshard::tensor: the sharding names a mesh axis that is not in the mesh (the axis: see the instantiation above)");
  static constexpr bool ok = true;
};
template <int Dim, index_t Extent, index_t Parts>
struct static_extent_not_divisible {
  static_assert(Extent % Parts == 0,
                "gshard::tensor: a static extent is not divisible by the number of shards of its dim (dim, extent, shards: see the instantiation above)");
  static constexpr bool ok = true;
};

// Checks a sharding against a mesh and a rank; yields its resolved layout.
template <class Mesh, int Rank, class S>
struct bind_layout {
  static_assert(sharding_type<S>, "gshard::tensor: the sharding must be a gshard::sharding<...> or gshard::replicate");
  static constexpr resolve_result r = resolve(S::spec, Mesh::names);
  static_assert(axis_not_in_mesh<to_fixed<r.unknown.view().size()>(r.unknown.view())>::ok);
  static_assert(S::spec.max_split_dim() < Rank, "gshard::tensor: the sharding splits a dim at or beyond the tensor's rank");
  static constexpr rlayout value = r.layout;
};

template <class Mesh>
constexpr index_t static_parts(const rlayout& l, int d) {
  index_t p = 1;
  for (int i = 0; i < l.dims[d].n; ++i) {
    const index_t s = Mesh::static_sizes[std::size_t(l.dims[d].ax[i])];
    if (s < 0) return -1;
    p *= s;
  }
  return p;
}

template <class Mesh, int Rank, class S, index_t... E>
constexpr bool check_static_extents() {
  constexpr rlayout L = bind_layout<Mesh, Rank, S>::value;
  if constexpr (sizeof...(E) > 0) {
    constexpr std::array<index_t, sizeof...(E)> e{E...};
    [&]<std::size_t... D>(std::index_sequence<D...>) {
      ((void)static_extent_not_divisible<int(D), (e[D] >= 0 && static_parts<Mesh>(L, int(D)) > 0 ? e[D] : 0),
                                         (static_parts<Mesh>(L, int(D)) > 0 ? static_parts<Mesh>(L, int(D)) : 1)>::ok,
       ...);
    }(std::make_index_sequence<sizeof...(E)>{});
  }
  return true;
}

// Local extents of every dim of a tensor with layout `l` on this rank.
template <int Rank>
shape<Rank> local_extents(const rlayout& l, const shape<Rank>& global, const mesh_base& m) {
  shape<Rank> e{};
  for (int d = 0; d < Rank; ++d) e[std::size_t(d)] = dim_block(l, d, global[std::size_t(d)], m.sizes(), m.coords()).extent;
  return e;
}
template <int Rank>
shape<Rank> global_offsets(const rlayout& l, const shape<Rank>& global, const mesh_base& m) {
  shape<Rank> o{};
  for (int d = 0; d < Rank; ++d) o[std::size_t(d)] = dim_block(l, d, global[std::size_t(d)], m.sizes(), m.coords()).offset;
  return o;
}

// "[4,16]": a shape<Rank> or a std::vector<index_t> of extents.
template <class Extents>
std::string extents_string(const Extents& e) {
  std::string s = "[";
  for (std::size_t d = 0; d < std::size(e); ++d) {
    if (d) s += ',';
    s += std::to_string(e[d]);
  }
  return s + "]";
}

// The dims whose blocks are not all equal, as text for a tensor's printed
// form: " (uneven: 8{expert} in shards 3,3,2)", "" when every dim divides.
// Shards listed in block order, the first 8 of them.
inline std::string uneven_note(const rlayout& l, const sharding_spec& spec, const index_t* global, int rank,
                               const mesh_base& m, std::string_view labels = {}) {
  std::string out;  // appended piece by piece: GCC 12 warns (-Wrestrict) on "literal" + std::string
  for (int d = 0; d < rank; ++d) {
    const index_t n = global[d];
    if (dim_even(l, d, n, m.sizes())) continue;
    out += out.empty() ? " (uneven: " : "; ";
    if (d < int(labels.size())) {
      out += labels[std::size_t(d)];
      out += '=';
    }
    out += std::to_string(n);
    out += '{';
    for (int i = 0; i < spec.dims[d].n; ++i) {
      if (i) out += ',';
      out += spec.dims[d].axes[i].view();
    }
    out += "} in shards ";
    const index_t parts = dim_parts(l, d, m.sizes());
    index_t c[max_mesh_axes] = {};
    for (index_t k = 0; k < parts && k < 8; ++k) {
      for (index_t r = k, i = l.dims[d].n - 1; i >= 0; --i) {  // block k's coordinates, row-major
        const int a = l.dims[d].ax[i];
        c[a] = r % m.sizes()[a];
        r /= m.sizes()[a];
      }
      if (k) out += ',';
      out += std::to_string(dim_block(l, d, n, m.sizes(), c).extent);
    }
    if (parts > 8) out += ",...";
  }
  if (!out.empty()) out += ')';
  return out;
}

}  // namespace detail

// tensor<float, 3, grid, sharding<split<0, "data">>> — f32[8{data},16,512].
// Optional dim labels name the dims in the type, e.g. "GSM": einsums check
// them against their terms, printing shows them (f32[G{data},S,M]), and
// rules (labels.hpp) give shardings by them. Optional static extents
// (gshard::dynamic for a dynamic one) are checked against the mesh at
// compile time where both are static.
template <class T, int Rank, mesh_type Mesh, class Sharding, fixed_string Labels = "", index_t... StaticExtents>
class tensor {
  static_assert(Rank >= 0 && Rank <= max_rank, "gshard::tensor: the rank is 0 to gshard::max_rank");
  static_assert(sizeof...(StaticExtents) == 0 || sizeof...(StaticExtents) == std::size_t(Rank),
                "gshard::tensor: give no static extents, or one per dim (gshard::dynamic where unknown)");
  static_assert(Labels.size() == 0 || (Labels.size() == std::size_t(Rank) && detail::valid_term(Labels.view())),
                "gshard::tensor: the labels name each dim with one distinct letter (as many as the rank), or are \"\"");

 public:
  using value_type = T;
  using mesh_type = Mesh;
  using sharding_type = Sharding;
  using local_type = local_tensor<T, Rank>;
  using extents_type = shape<Rank>;
  static constexpr int rank = Rank;
  static constexpr auto label_string = Labels;           // fixed_string, "" when unlabelled
  static constexpr std::string_view labels = Labels.view();
  // The sharding resolved to Mesh's axis indices (layout/rlayout.hpp): what
  // the planners and the shard geometry compute on.
  static constexpr detail::rlayout resolved = detail::bind_layout<Mesh, Rank, Sharding>::value;
  static_assert(detail::check_static_extents<Mesh, Rank, Sharding, StaticExtents...>());

  // Zero-filled shards of a tensor of global `extents`.
  tensor(const Mesh& m, const extents_type& global) : mesh_(&m), extents_(global) {
    validate();
    local_ = local_type(local_extents());
    local_.setZero();
  }

  // From this rank's shard; its extents must be the ones dim_block gives.
  // A wrong shard is a fact about this rank alone, which the others cannot
  // see: throwing here would leave them waiting in their next collective, so
  // the job ends (mpi::abort_job) with the rank and the extents.
  tensor(const Mesh& m, const extents_type& global, local_type local)
      : mesh_(&m), extents_(global), local_(std::move(local)) {
    validate();
    const extents_type want = local_extents();
    for (int d = 0; d < Rank; ++d)
      if (local_.dimension(d) != want[std::size_t(d)]) wrong_shard(want);
  }

  const Mesh& mesh() const { return *mesh_; }
  const extents_type& extents() const { return extents_; }
  index_t extent(int d) const { return extents_[std::size_t(d)]; }
  index_t size() const {
    index_t n = 1;
    for (index_t e : extents_) n *= e;
    return n;
  }
  local_type& local() { return local_; }
  const local_type& local() const { return local_; }
  T* data() { return local_.data(); }
  const T* data() const { return local_.data(); }

  extents_type local_extents() const { return detail::local_extents<Rank>(resolved, extents_, *mesh_); }
  // Global index of this shard's first element along each dim.
  extents_type offsets() const { return detail::global_offsets<Rank>(resolved, extents_, *mesh_); }

  // "f32[8{data},16,512]"; with labels (the type's, or these) "f32[G{data},S,M]".
  // A dim whose shards differ is named after it: "f32[8{expert},16] (uneven:
  // 8{expert} in shards 3,3,2)".
  std::string notation(std::string_view names = {}) const {
    const std::string_view l = names.empty() ? labels : names;
    return detail::notation(Sharding::spec, Rank, detail::dtype_name<T>(), l, extents_.data()) +
           detail::uneven_note(resolved, Sharding::spec, extents_.data(), Rank, *mesh_, l);
  }

 private:
  void validate() const {
    if constexpr (sizeof...(StaticExtents) > 0) {
      constexpr extents_type fixed{StaticExtents...};
      for (int d = 0; d < Rank; ++d)
        if (fixed[std::size_t(d)] != dynamic && fixed[std::size_t(d)] != extents_[std::size_t(d)])
          throw shape_error("gshard::tensor: dim " + std::to_string(d) + " has static extent " +
                            std::to_string(fixed[std::size_t(d)]) + " but was given " +
                            std::to_string(extents_[std::size_t(d)]));
    }
    for (int d = 0; d < Rank; ++d)
      if (extents_[std::size_t(d)] < 0)
        throw shape_error("gshard::tensor: dim " + std::to_string(d) + " of " +
                          detail::notation(Sharding::spec, Rank, detail::dtype_name<T>(), labels, extents_.data()) +
                          " has a negative extent");
  }

  [[noreturn]] GSHARD_NOINLINE void wrong_shard(const extents_type& want) const {
    extents_type got{};
    for (int k = 0; k < Rank; ++k) got[std::size_t(k)] = local_.dimension(k);
    mpi::abort_job(("gshard::tensor: rank " + std::to_string(mesh_->rank()) + " was given a local shard of extents " +
                    detail::extents_string(got) + " but " + notation() + " places " +
                    detail::extents_string(want) + " there")
                       .c_str());
  }

  const Mesh* mesh_;
  extents_type extents_;
  local_type local_;
};

// named<float, "GSM", Mesh, Rules>: a tensor whose dims carry the labels and
// whose sharding the rule table gives them (labels.hpp), e.g. with
// at_groups = rules<on<'G', "data", "expert">> the type of f32[G{data,expert},S,M].
template <class T, fixed_string Labels, mesh_type Mesh, class Rules = rules<>>
using named = tensor<T, int(Labels.size()), Mesh, sharding_by<Rules, Labels>, Labels>;

namespace detail {
template <class X>
struct is_tensor : std::false_type {};
template <class T, int R, class M, class S, fixed_string L, index_t... E>
struct is_tensor<tensor<T, R, M, S, L, E...>> : std::true_type {};

template <int Rank, class Derived>
shape<Rank> dims_of(const Eigen::TensorBase<Derived, Eigen::ReadOnlyAccessors>& t) {
  const auto& d = static_cast<const Derived&>(t).dimensions();
  shape<Rank> e{};
  for (int k = 0; k < Rank; ++k) e[std::size_t(k)] = d[k];
  return e;
}
}  // namespace detail

template <class X>
concept sharded_tensor = detail::is_tensor<std::remove_cvref_t<X>>::value;

// The same tensor type (and labels) with another sharding.
template <sharded_tensor X, class S>
using with_sharding = tensor<typename X::value_type, X::rank, typename X::mesh_type, S, X::label_string>;
// The same tensor type with other labels ("" for none).
template <sharded_tensor X, fixed_string Labels>
using with_labels = tensor<typename X::value_type, X::rank, typename X::mesh_type, typename X::sharding_type, Labels>;

namespace detail {
template <class X, class U>
struct with_element_of;
template <class T, int R, class M, class S, fixed_string L, index_t... E, class U>
struct with_element_of<tensor<T, R, M, S, L, E...>, U> {
  using type = tensor<U, R, M, S, L, E...>;
};
}  // namespace detail
// The same tensor type (sharding, labels, static extents) with elements of type U.
template <sharded_tensor X, class U>
using with_element = typename detail::with_element_of<std::remove_cvref_t<X>, U>::type;

// The same tensor with its dims renamed (or unnamed, with ""): free for an
// rvalue (the shard moves), one copy of the shard for an lvalue.
//   auto kt = relabel<"BTNK">(std::move(k));   // k was BLNK
template <fixed_string Labels, class X>
  requires sharded_tensor<X>
auto relabel(X&& x) {
  using Y = std::remove_cvref_t<X>;
  using out_t = with_labels<Y, Labels>;
  static_assert(Labels.size() == 0 || Labels.size() == std::size_t(Y::rank),
                "gshard::relabel: give one label per dim (as many as the rank), or \"\"");
  if constexpr (std::is_rvalue_reference_v<X&&> && !std::is_const_v<std::remove_reference_t<X>>)
    return out_t(x.mesh(), x.extents(), std::move(x.local()));
  else
    return out_t(x.mesh(), x.extents(), typename Y::local_type(x.local()));
}

namespace detail {
template <class S, class T, int Rank, class Mesh>
struct distributed_type {
  using type = tensor<T, Rank, Mesh, S>;
};
template <class T, int Rank, class Mesh, class S, fixed_string L, class T2, int R2, class M2, index_t... E>
struct distributed_type<tensor<T2, R2, M2, S, L, E...>, T, Rank, Mesh> {
  static_assert(std::is_same_v<T, T2> && Rank == R2 && std::is_same_v<Mesh, M2>,
                "gshard::distribute: the global tensor's element type, rank or mesh differ from the requested tensor type");
  using type = tensor<T2, R2, M2, S, L, E...>;
};
}  // namespace detail

// Every rank slices its own shard of `global` (which every rank holds); no
// communication. For a partial sharding, coordinate 0 of each partial axis
// holds the value and the others hold zeros.
// distribute<X> with a tensor type X gives that type (its sharding and labels).
template <class ShardingOrTensor, mesh_type Mesh, class T, int Rank>
auto distribute(const Mesh& m, const local_tensor<T, Rank>& global) {
  using out_t = typename detail::distributed_type<ShardingOrTensor, T, Rank, Mesh>::type;
  const shape<Rank> g = detail::dims_of<Rank>(global);
  out_t out(m, g);
  bool zero = false;
  for (int a = 0; a < m.naxes(); ++a)
    if (out_t::resolved.is_partial(a) && m.coord(a) != 0) zero = true;
  if (zero || out.local().size() == 0) return out;
  const shape<Rank> le = out.local_extents(), off = out.offsets();
  const shape<Rank> zero_off{};
  detail::copy_box(global.data(), g.data(), off.data(), out.data(), le.data(), zero_off.data(), le.data(), Rank);
  return out;
}

}  // namespace gshard
