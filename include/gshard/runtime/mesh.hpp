// gshard/runtime/mesh.hpp — the device mesh: named axes with static or dynamic sizes,
// bound to an MPI communicator. Ranks are laid out row-major over the axes;
// the bound mesh owns one sub-communicator per set of axes, created once.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gshard/core/error.hpp"
#include "gshard/core/fixed_string.hpp"
#include "gshard/runtime/mpi.hpp"
#include "gshard/layout/sharding.hpp"

namespace gshard {

// An axis size fixed when the mesh is bound (mdspan's dynamic_extent).
inline constexpr index_t dynamic = -1;

template <fixed_string Name, index_t Size = dynamic>
struct axis {
  static_assert(detail::valid_axis_name(Name.view()) && Name.size() <= detail::max_name_length,
                "gshard::axis: an axis name has 1 to 23 characters, none of them ',', '{', '}' or ' '");
  static_assert(Size == dynamic || Size >= 1, "gshard::axis: the size is at least 1, or gshard::dynamic");
  static constexpr detail::name_t name{Name.view()};
  static constexpr index_t size = Size;
};

namespace detail {

// A communicator over a set of mesh axes. Its ranks are ordered by the
// row-major composite of their coordinates on those axes (in mesh order), so
// for one axis the communicator rank is the coordinate.
struct axis_group {
  MPI_Comm comm = MPI_COMM_NULL;
  int size = 1;
  int rank = 0;
  std::uint32_t mask = 0;
  std::string label;                   // "data", or "data,expert"
  MPI_Comm mesh_comm = MPI_COMM_NULL;  // every rank of the mesh (the checked mode compares over it)
  std::uint64_t* sequence = nullptr;   // the mesh's count of collectives, for the checked mode
};

// Everything about a bound mesh that does not depend on its type.
class mesh_base {
 public:
  virtual ~mesh_base() {
    // MPI_Comm_free only marks the communicators for release; it does not
    // synchronise the ranks, so this destructor runs no collective.
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (auto& g : groups_)
      if (g.comm != MPI_COMM_NULL) MPI_Comm_free(&g.comm);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  mesh_base(const mesh_base&) = delete;
  mesh_base& operator=(const mesh_base&) = delete;

  int naxes() const { return naxes_; }
  std::string_view axis_name(int a) const { return names_[std::size_t(a)]; }
  index_t size(int a) const { return sizes_[std::size_t(a)]; }
  index_t coord(int a) const { return coords_[std::size_t(a)]; }
  const index_t* sizes() const { return sizes_.data(); }
  const index_t* coords() const { return coords_.data(); }
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  MPI_Comm comm() const { return comm_; }

  // The communicator over the axes in `mask` (bit a = axis a).
  const axis_group& group(std::uint32_t mask) const { return groups_.at(mask); }
  // The communicator over every axis: all ranks of the mesh.
  const axis_group& all_axes() const { return groups_.back(); }

  // Coordinates of rank q (in comm()): row-major over the axes.
  std::vector<index_t> coords_of(int q) const {
    std::vector<index_t> c(static_cast<std::size_t>(naxes_));
    for (int a = naxes_ - 1; a >= 0; --a) {
      c[std::size_t(a)] = q % sizes_[std::size_t(a)];
      q = int(q / sizes_[std::size_t(a)]);
    }
    return c;
  }

  // Rank (in comm()) of the process at `coords`.
  int rank_of(const index_t* coords) const {
    index_t r = 0;
    for (int a = 0; a < naxes_; ++a) r = r * sizes_[std::size_t(a)] + coords[a];
    return int(r);
  }

  // "mesh(data=2, expert=4)"
  std::string describe() const {
    std::string s = "mesh(";
    for (int a = 0; a < naxes_; ++a) {
      if (a) s += ", ";
      const index_t n = a < int(sizes_.size()) ? sizes_[std::size_t(a)] : dynamic;
      s += names_[std::size_t(a)] + "=" + (n == dynamic ? std::string("dynamic") : std::to_string(n));
    }
    return s + ")";
  }

  // Names of the axes in `mask`, in mesh order, joined by commas.
  std::string label(std::uint32_t mask) const {
    std::string s;
    for (int a = 0; a < naxes_; ++a)
      if ((mask >> a) & 1u) {
        if (!s.empty()) s += ',';
        s += names_[std::size_t(a)];
      }
    return s;
  }

 protected:
  // `sizes` may hold `dynamic` only where `dynamic_sizes` supplies a value, or
  // in one place when the communicator's size decides it.
  mesh_base(MPI_Comm comm, const std::vector<std::string>& names, std::vector<index_t> sizes) : naxes_(int(names.size())) {
    names_ = names;
    int nranks = 0;
    check(MPI_Comm_size(comm, &nranks), "MPI_Comm_size");
    infer_dynamic(sizes, nranks);
    index_t total = 1;
    for (index_t s : sizes) total *= s;
    sizes_ = sizes;
    if (total != nranks)
      throw mesh_error("gshard::mesh: " + describe() + " needs " + std::to_string(total) + " ranks but the communicator has " +
                       std::to_string(nranks) + "; run with mpirun -np " + std::to_string(total) + " or choose a mesh of " +
                       std::to_string(nranks) + " ranks");
    check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    nranks_ = nranks;
    coords_ = coords_of(rank_);
    // One communicator per subset of axes: color = position on the other axes,
    // key = composite position on these (row-major in mesh order).
    groups_.resize(std::size_t(1) << naxes_);
    for (std::uint32_t mask = 0; mask < groups_.size(); ++mask) {
      index_t color = 0, key = 0;
      for (int a = 0; a < naxes_; ++a) {
        if ((mask >> a) & 1u) key = key * sizes_[std::size_t(a)] + coords_[std::size_t(a)];
        else color = color * sizes_[std::size_t(a)] + coords_[std::size_t(a)];
      }
      axis_group& g = groups_[mask];
      check(MPI_Comm_split(comm_, int(color), int(key), &g.comm), "MPI_Comm_split");
      MPI_Comm_set_errhandler(g.comm, MPI_ERRORS_RETURN);
      MPI_Comm_size(g.comm, &g.size);
      MPI_Comm_rank(g.comm, &g.rank);
      g.mask = mask;
      g.label = label(mask);
      g.mesh_comm = comm_;
      g.sequence = &sequence_;
    }
  }



 private:
  static void check(int rc, const char* call) { mpi::check(rc, call); }

  void infer_dynamic(std::vector<index_t>& sizes, int nranks) {
    for (std::size_t a = 0; a < sizes.size(); ++a)
      if (sizes[a] != dynamic && sizes[a] < 1) {
        sizes_ = sizes;
        throw mesh_error("gshard::mesh: axis " + names_[a] + " was given size " + std::to_string(sizes[a]) +
                         "; sizes are at least 1");
      }
    int unknown = 0;
    index_t known = 1;
    for (index_t s : sizes) {
      if (s == dynamic) ++unknown;
      else known *= s;
    }
    if (unknown == 0) return;
    if (unknown > 1) {
      sizes_ = sizes;
      throw mesh_error("gshard::mesh: " + std::to_string(unknown) +
                       " axes have dynamic size; pass their sizes when binding the mesh");
    }
    for (index_t& s : sizes)
      if (s == dynamic) {
        if (nranks % known != 0) {
          sizes_ = sizes;
          throw mesh_error("gshard::mesh: the static axes hold " + std::to_string(known) +
                           " ranks, which does not divide the communicator's " + std::to_string(nranks) + " ranks");
        }
        s = nranks / known;
      }
  }

  int naxes_;
  std::vector<std::string> names_;
  std::vector<index_t> sizes_;
  std::vector<index_t> coords_;
  int rank_ = 0;
  int nranks_ = 1;
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::vector<axis_group> groups_;
  std::uint64_t sequence_ = 0;
};

template <class... Axes>
constexpr bool unique_axis_names() {
  constexpr std::array<name_t, sizeof...(Axes)> n{Axes::name...};
  for (std::size_t i = 0; i < n.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (n[i] == n[j]) return false;
  return true;
}

}  // namespace detail

// mesh<axis<"data", 2>, axis<"expert", 4>> — 8 ranks, rank = data*4 + expert.
// Binding checks the communicator's size and throws gshard::mesh_error on
// every rank when it differs. The mesh must outlive the tensors placed on it;
// it is neither copyable nor movable.
template <class... Axes>
class mesh : public detail::mesh_base {
  static_assert(sizeof...(Axes) >= 1, "gshard::mesh: a mesh has at least one axis");
  static_assert(sizeof...(Axes) <= max_mesh_axes, "gshard::mesh: a mesh has at most gshard::max_mesh_axes axes");
  static_assert(detail::unique_axis_names<Axes...>(), "gshard::mesh: two axes have the same name");

 public:
  static constexpr int axis_count = sizeof...(Axes);  // the number of axes (mesh_base::naxes() at run time)
  static constexpr std::array<detail::name_t, sizeof...(Axes)> names{Axes::name...};
  static constexpr std::array<index_t, sizeof...(Axes)> static_sizes{Axes::size...};
  static constexpr int ndynamic = ((Axes::size == dynamic ? 1 : 0) + ...);
  // Number of ranks when every size is static, else gshard::dynamic.
  static constexpr index_t static_nranks = ndynamic ? dynamic : (Axes::size * ...);

  static constexpr int index_of(std::string_view name) {
    for (std::size_t i = 0; i < names.size(); ++i)
      if (names[i].view() == name) return int(i);
    return -1;
  }

  // Binds to `comm`. With one dynamic axis its size is the communicator's size
  // over the static axes' product.
  explicit mesh(MPI_Comm comm = MPI_COMM_WORLD) : mesh_base(comm, name_list(), {Axes::size...}) {}

  // Binds to `comm` with the sizes of the dynamic axes, in axis order.
  mesh(MPI_Comm comm, std::array<index_t, std::size_t(ndynamic)> dynamic_sizes)
      : mesh_base(comm, name_list(), fill(dynamic_sizes)) {}

  using mesh_base::group;
  // The communicator over the named axes, e.g. group<"expert">().
  template <fixed_string... Names>
  const detail::axis_group& group() const {
    static_assert(((index_of(Names.view()) >= 0) && ...), "gshard::mesh: group<> names an axis that is not in the mesh");
    return mesh_base::group(((1u << index_of(Names.view())) | ...));
  }

 private:
  static std::vector<std::string> name_list() { return {std::string(Axes::name.view())...}; }
  static std::vector<index_t> fill(const std::array<index_t, std::size_t(ndynamic)>& dyn) {
    std::vector<index_t> s{Axes::size...};
    std::size_t k = 0;
    for (std::size_t a = 0; a < s.size(); ++a)
      if (s[a] == dynamic) {
        if (dyn[k] < 1)
          throw mesh_error("gshard::mesh: axis " + std::string(names[a].view()) + " was given size " + std::to_string(dyn[k]) +
                           "; sizes are at least 1");
        s[a] = dyn[k++];
      }
    return s;
  }
};

namespace detail {
template <class T>
struct is_mesh : std::false_type {};
template <class... A>
struct is_mesh<mesh<A...>> : std::true_type {};
}  // namespace detail

template <class M>
concept mesh_type = detail::is_mesh<M>::value;

// Runs f(mesh) with the first of Meshes whose size fits `comm` — one binary
// for mpirun -np 1, 2, 4 and 8:
//   with_mesh<mesh<axis<"data",1>>, mesh<axis<"data",2>>, mesh<axis<"data",2>, axis<"expert",2>>>(
//       MPI_COMM_WORLD, [&]<class Mesh>(const Mesh& m) { ... });
// Throws gshard::mesh_error (on every rank) when none fits. The mesh lives
// only while f runs, so f must not return tensors placed on it.
template <mesh_type... Meshes, class F>
decltype(auto) with_mesh(MPI_Comm comm, F&& f) {
  static_assert(sizeof...(Meshes) >= 1, "gshard::with_mesh: list at least one mesh");
  static_assert(((Meshes::ndynamic == 0) && ...), "gshard::with_mesh: every candidate mesh has static sizes");
  int nranks = 0;
  mpi::check(MPI_Comm_size(comm, &nranks), "MPI_Comm_size");
  using R = std::common_type_t<decltype(f(std::declval<const Meshes&>()))...>;
  constexpr std::array<index_t, sizeof...(Meshes)> sizes{Meshes::static_nranks...};
  std::size_t pick = sizes.size();
  for (std::size_t i = 0; i < sizes.size(); ++i)
    if (sizes[i] == nranks) { pick = i; break; }
  if (pick == sizes.size()) {
    std::string list;
    for (index_t s : sizes) list += (list.empty() ? "" : ", ") + std::to_string(s);
    throw mesh_error("gshard::with_mesh: no mesh fits " + std::to_string(nranks) + " ranks; this program supports " + list);
  }
  auto run = [&]<class M>(std::type_identity<M>) -> R {
    const M mesh(comm);  // lives while f runs: f must not return tensors placed on it
    return f(mesh);
  };
  return [&]<std::size_t... I>(std::index_sequence<I...>) -> R {
    if constexpr (std::is_void_v<R>) {
      ((I == pick ? run(std::type_identity<Meshes>{}) : void()), ...);
    } else {
      std::optional<R> out;
      ((I == pick ? (void)out.emplace(run(std::type_identity<Meshes>{})) : void()), ...);
      return std::move(*out);
    }
  }(std::index_sequence_for<Meshes...>{});
}

}  // namespace gshard
