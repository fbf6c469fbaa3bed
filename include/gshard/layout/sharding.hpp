// gshard/layout/sharding.hpp — shardings as types: split, replicate, partial.
// A sharding says, per tensor dim, which mesh axes split it (major to minor),
// and which axes hold pending sums. Equal shardings are the same type, so
// std::is_same_v means semantic equality. Here: the parts, the value form
// (sharding_spec), and the canonical text that names the type. The same
// sharding resolved to a mesh's axis indices is layout/rlayout.hpp, where
// its shards lie layout/shard_geometry.hpp, its printed form notation.hpp.
// Knows nothing of MPI.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "gshard/core/fixed_string.hpp"
#include "gshard/core/types.hpp"

namespace gshard {

// split<Dim, Major, ..., Minor>: tensor dim `Dim` is split over the named mesh
// axes; the shard index is the row-major composite of the ranks' coordinates.
template <int Dim, fixed_string... Axes>
struct split {
  static_assert(((Axes.size() <= detail::max_name_length) && ...), "gshard::split: an axis name is longer than 23 characters");
  static constexpr int dim = Dim;
  static constexpr std::array<detail::name_t, sizeof...(Axes)> axes{detail::name_t(Axes.view())...};
};

// partial<Axes...>: every rank along these axes holds a summand; the value is their sum.
template <fixed_string... Axes>
struct partial {
  static_assert(((Axes.size() <= detail::max_name_length) && ...), "gshard::partial: an axis name is longer than 23 characters");
  static constexpr std::array<detail::name_t, sizeof...(Axes)> axes{detail::name_t(Axes.view())...};
};

// mesh_split<"data", "", "model,expert">: GSPMD's dims_mapping, one string per
// tensor dim; "" replicates the dim, "a,b" splits it over a (major) then b.
template <fixed_string... PerDim>
struct mesh_split {
  static constexpr std::array<std::string_view, sizeof...(PerDim)> dims{PerDim.view()...};
};

namespace detail {

// The canonical, name-based form of a sharding. Types carry it as text
// (sharding_text<"0{data}">); constexpr code works on this form.
struct dim_axes {
  int n = 0;
  name_t axes[max_mesh_axes]{};

  friend constexpr bool operator==(const dim_axes&, const dim_axes&) = default;
};

struct sharding_spec {
  dim_axes dims[max_rank]{};
  int npartial = 0;
  name_t partial[max_mesh_axes]{};  // sorted by name: canonical

  friend constexpr bool operator==(const sharding_spec&, const sharding_spec&) = default;

  // Highest dim that is split, or -1 when no dim is.
  constexpr int max_split_dim() const {
    int m = -1;
    for (int d = 0; d < max_rank; ++d)
      if (dims[d].n > 0) m = d;
    return m;
  }
  constexpr int dim_of(std::string_view axis) const {
    for (int d = 0; d < max_rank; ++d)
      for (int i = 0; i < dims[d].n; ++i)
        if (dims[d].axes[i].view() == axis) return d;
    return -1;
  }
  constexpr bool is_partial(std::string_view axis) const {
    for (int i = 0; i < npartial; ++i)
      if (partial[i].view() == axis) return true;
    return false;
  }
  constexpr bool mentions(std::string_view axis) const { return dim_of(axis) >= 0 || is_partial(axis); }
};

enum class spec_error : std::uint8_t {
  none,
  bad_axis_name,         // empty, too long, or holding one of ",{} "
  dim_out_of_range,      // a split<> dim below 0 or beyond max_rank
  dim_split_twice,       // two split<> parts for one dim
  axis_in_two_dims,      // one mesh axis splits two dims
  axis_split_and_partial,
  axis_repeated,         // an axis named twice in one split<> or partial<>
  empty_split,           // split<Dim> with no axes
  bad_mesh_split_string, // an empty name inside "a,,b" in mesh_split
  too_many_axes,
};

struct spec_result {
  sharding_spec spec{};
  spec_error error = spec_error::none;
  int dim = -1;
  name_t axis{};
};

// Axis names are 1 to 23 characters, none of them ',', '{', '}' or ' '
// (those structure the canonical text).
constexpr bool valid_axis_name(std::string_view n) {
  if (n.empty() || n.size() > max_name_length) return false;
  for (char c : n)
    if (c == ',' || c == '{' || c == '}' || c == ' ') return false;
  return true;
}

constexpr void add_split(spec_result& r, int dim, const name_t* axes, int n) {
  if (r.error != spec_error::none) return;
  for (int i = 0; i < n; ++i)
    if (!valid_axis_name(axes[i].view())) { r.error = spec_error::bad_axis_name; r.dim = dim; r.axis = axes[i]; return; }
  if (dim < 0 || dim >= max_rank) { r.error = spec_error::dim_out_of_range; r.dim = dim; return; }
  if (n == 0) { r.error = spec_error::empty_split; r.dim = dim; return; }
  if (r.spec.dims[dim].n != 0) { r.error = spec_error::dim_split_twice; r.dim = dim; return; }
  if (n > max_mesh_axes) { r.error = spec_error::too_many_axes; r.dim = dim; return; }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < i; ++j)
      if (axes[j] == axes[i]) { r.error = spec_error::axis_repeated; r.dim = dim; r.axis = axes[i]; return; }
    if (r.spec.dim_of(axes[i].view()) >= 0) { r.error = spec_error::axis_in_two_dims; r.dim = dim; r.axis = axes[i]; return; }
    if (r.spec.is_partial(axes[i].view())) { r.error = spec_error::axis_split_and_partial; r.dim = dim; r.axis = axes[i]; return; }
    r.spec.dims[dim].axes[i] = axes[i];
  }
  r.spec.dims[dim].n = n;
}

constexpr void add_partial(spec_result& r, const name_t* axes, int n) {
  for (int i = 0; i < n && r.error == spec_error::none; ++i) {
    const name_t a = axes[i];
    if (!valid_axis_name(a.view())) { r.error = spec_error::bad_axis_name; r.axis = a; return; }
    if (r.spec.is_partial(a.view())) { r.error = spec_error::axis_repeated; r.axis = a; return; }
    if (r.spec.dim_of(a.view()) >= 0) { r.error = spec_error::axis_split_and_partial; r.axis = a; return; }
    if (r.spec.npartial == max_mesh_axes) { r.error = spec_error::too_many_axes; return; }
    // insertion keeps the partial axes sorted by name: the canonical order
    int k = r.spec.npartial++;
    while (k > 0 && a < r.spec.partial[k - 1]) { r.spec.partial[k] = r.spec.partial[k - 1]; --k; }
    r.spec.partial[k] = a;
  }
}

constexpr void add_mesh_split(spec_result& r, int dim, std::string_view s) {
  if (s.empty() || r.error != spec_error::none) return;
  name_t axes[max_mesh_axes]{};
  int n = 0;
  std::size_t start = 0;
  while (start <= s.size()) {
    std::size_t end = s.find(',', start);
    if (end == std::string_view::npos) end = s.size();
    if (end == start) { r.error = spec_error::bad_mesh_split_string; r.dim = dim; return; }
    if (n == max_mesh_axes) { r.error = spec_error::too_many_axes; r.dim = dim; return; }
    axes[n++] = name_t(s.substr(start, end - start));
    start = end + 1;
  }
  add_split(r, dim, axes, n);
}

template <class Part>
struct part_traits;
template <int Dim, fixed_string... Axes>
struct part_traits<split<Dim, Axes...>> {
  static constexpr void apply(spec_result& r) {
    using P = split<Dim, Axes...>;
    add_split(r, Dim, P::axes.data(), int(P::axes.size()));
  }
};
template <fixed_string... Axes>
struct part_traits<partial<Axes...>> {
  static constexpr void apply(spec_result& r) {
    using P = partial<Axes...>;
    add_partial(r, P::axes.data(), int(P::axes.size()));
  }
};
template <fixed_string... PerDim>
struct part_traits<mesh_split<PerDim...>> {
  static constexpr void apply(spec_result& r) {
    int d = 0;
    for (std::string_view s : mesh_split<PerDim...>::dims) add_mesh_split(r, d++, s);
  }
};

template <class... Parts>
consteval spec_result make_spec() {
  spec_result r;
  (part_traits<Parts>::apply(r), ...);
  return r;
}

template <class Part>
concept sharding_part = requires(spec_result& r) { part_traits<Part>::apply(r); };

// The canonical texts that name types share one grammar: groups
// `key{axis,axis}` separated by spaces — a sharding's "0{data,expert}
// partial{x}", a rules table's "G{data} H{model}" (labels.hpp). Written
// into a fixed buffer of N chars (constexpr) and read back here.
template <std::size_t N>
struct braced_text {
  char s[N]{};
  std::size_t n = 0;
  constexpr void add(std::string_view v) {
    for (char c : v) s[n++] = c;
  }
  constexpr void add_group(std::string_view key, const name_t* axes, int count) {
    if (n) add(" ");
    add(key);
    add("{");
    for (int i = 0; i < count; ++i) {
      if (i) add(",");
      add(axes[i].view());
    }
    add("}");
  }
  constexpr std::string_view view() const { return {s, n}; }
};

// Calls f(key, axes, count) for each group of a braced_text, in order (only
// ever given text braced_text wrote).
template <class F>
constexpr void for_each_group(std::string_view text, F f) {
  std::size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ' ') {
      ++i;
      continue;
    }
    const std::size_t open = text.find('{', i);
    const std::string_view key = text.substr(i, open - i);
    i = open + 1;
    name_t axes[max_mesh_axes]{};
    int count = 0;
    while (text[i] != '}') {
      std::size_t j = i;
      while (text[j] != ',' && text[j] != '}') ++j;
      axes[count++] = name_t(text.substr(i, j - i));
      i = text[j] == ',' ? j + 1 : j;
    }
    ++i;
    f(key, static_cast<const name_t*>(axes), count);
  }
}

// The canonical text of a spec, e.g. "0{data,expert} 2{model} partial{x}";
// "" for replicate. It names the sharding type: sharding_text<"0{data}">.
static_assert(max_rank <= 10, "gshard: a dim's key in the canonical text is one digit");
using spec_text =
    braced_text<max_rank * (4 + max_mesh_axes * (max_name_length + 1)) + 16 + max_mesh_axes * (max_name_length + 1)>;

constexpr spec_text render(const sharding_spec& spec) {
  spec_text t;
  for (int d = 0; d < max_rank; ++d)
    if (spec.dims[d].n > 0) {
      const char digit[2] = {char('0' + d), '\0'};
      t.add_group(digit, spec.dims[d].axes, spec.dims[d].n);
    }
  if (spec.npartial) t.add_group("partial", spec.partial, spec.npartial);
  return t;
}

// The inverse of render (only ever given render's output).
constexpr sharding_spec parse(std::string_view text) {
  spec_result r;
  for_each_group(text, [&](std::string_view key, const name_t* axes, int n) {
    if (key == "partial") add_partial(r, axes, n);
    else add_split(r, key[0] - '0', axes, n);
  });
  return r.spec;
}

}  // namespace detail

// The canonical type of a sharding, named by its canonical text. Write it as
// sharding<...> or replicate; errors show it as sharding_text<"0{data} partial{x}">.
template <fixed_string Text>
struct sharding_text {
  static constexpr detail::sharding_spec spec = detail::parse(Text.view());
  static constexpr std::string_view text = Text.view();
};

namespace detail {

// The canonical text of a spec as a template argument (Len: its length).
template <std::size_t Len>
consteval fixed_string<Len + 1> text_of(const sharding_spec& s) {
  return to_fixed<Len>(render(s).view());
}

}  // namespace detail

// The sharding type of a spec held in a constant (a constexpr variable or
// a static constexpr member): `using S = GSHARD_SHARDING_OF(spec);`. A
// macro, because the alias `template <sharding_spec S> using sharding_of =
// sharding_text<text_of<render(S).n>(S)>` is what GCC 12 mis-resolves:
// tried, the trainer's einsums saw their operands replicated (a
// sharding_spec as a template argument compares wrongly there, though a
// small test of it passes). The macro only spells the spec-to-text step once.
#define GSHARD_SHARDING_OF(spec) \
  ::gshard::sharding_text<::gshard::detail::text_of<::gshard::detail::render(spec).n>(spec)>

namespace detail {

template <class... Parts>
struct make_sharding {
  static_assert((sharding_part<Parts> && ...),
                "gshard::sharding: every part must be split<Dim, \"axis\"...>, partial<\"axis\"...> or mesh_split<...>");
  static constexpr spec_result r = make_spec<Parts...>();
  static_assert(r.error != spec_error::bad_axis_name,
                "gshard::sharding: an axis name is empty, longer than 23 characters, or holds ',', '{', '}' or ' '; "
                "list several axes as separate arguments: split<0, \"data\", \"expert\">");
  static_assert(r.error != spec_error::dim_out_of_range,
                "gshard::sharding: split<Dim, ...> names a dim below 0 or at least gshard::max_rank");
  static_assert(r.error != spec_error::dim_split_twice,
                "gshard::sharding: one dim appears in two split<> parts; list all its axes in one split<Dim, \"major\", \"minor\">");
  static_assert(r.error != spec_error::axis_in_two_dims,
                "gshard::sharding: one mesh axis splits two dims; a mesh axis may split at most one dim of a tensor");
  static_assert(r.error != spec_error::axis_split_and_partial,
                "gshard::sharding: a mesh axis is both split and partial; an axis either splits a dim or holds summands");
  static_assert(r.error != spec_error::axis_repeated,
                "gshard::sharding: a mesh axis is named twice in one split<> or partial<>");
  static_assert(r.error != spec_error::empty_split,
                "gshard::sharding: split<Dim> names no mesh axis; omit it to replicate the dim");
  static_assert(r.error != spec_error::bad_mesh_split_string,
                "gshard::sharding: mesh_split<> has an empty axis name; use \"\" for a replicated dim and \"a,b\" for several axes");
  static_assert(r.error != spec_error::too_many_axes, "gshard::sharding: more than gshard::max_mesh_axes axes");
  using type = GSHARD_SHARDING_OF(r.spec);
};

template <class T>
struct is_sharding_text : std::false_type {};
template <fixed_string S>
struct is_sharding_text<sharding_text<S>> : std::true_type {};

}  // namespace detail

// sharding<split<0, "data">, partial<"model">>: the canonical sharding type.
template <class... Parts>
using sharding = typename detail::make_sharding<Parts...>::type;

// Every dim replicated on every axis, no pending sums.
using replicate = sharding_text<"">;

template <class S>
concept sharding_type = detail::is_sharding_text<S>::value;

}  // namespace gshard
