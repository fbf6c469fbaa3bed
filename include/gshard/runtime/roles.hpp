// gshard/runtime/roles.hpp — what each mesh axis is for, declared: which axes carry
// the batch (and the MoE groups), which hold the experts, and which split the
// model dims (attention heads, hidden units). Nothing is read from an axis's
// name; a mesh axis without a role does not compile. From the roles come the
// two rule tables the MoE Transformer uses for every tensor it holds:
//   at_tokens   B, G -> the batch axes (expert axes minor-most); N, H -> model axes
//   at_experts  E -> the expert axes; B, G -> the other batch axes; N, H -> model axes
// Moving a tensor between them (GSM's G over every batch axis -> EGCM's E
// over the expert axes) is one all_to_all over the expert axes.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "gshard/layout/labels.hpp"
#include "gshard/runtime/mesh.hpp"

namespace gshard {

template <fixed_string... Axes>
struct batch_axes {
  static constexpr std::array<detail::name_t, sizeof...(Axes)> names{detail::name_t(Axes.view())...};
};
template <fixed_string... Axes>
struct expert_axes {
  static constexpr std::array<detail::name_t, sizeof...(Axes)> names{detail::name_t(Axes.view())...};
};
template <fixed_string... Axes>
struct model_axes {
  static constexpr std::array<detail::name_t, sizeof...(Axes)> names{detail::name_t(Axes.view())...};
};

// axis_roles<batch_axes<"dp", "ep">, expert_axes<"ep">, model_axes<"tp">>.
// Axes a role names that a mesh lacks are ignored, so one roles type serves
// meshes with and without (say) a model axis; every axis of the mesh needs
// a role. Expert axes also carry the batch (GShard splits the groups over
// every rank, the experts over some).
template <class Batch, class Expert = expert_axes<>, class Model = model_axes<>>
struct axis_roles {
  using batch = Batch;
  using expert = Expert;
  using model = Model;
};

// gshard's own roles: "data" and "expert" carry the batch, "expert" holds the
// experts, "model" splits heads and hidden units. A mesh with other axis
// names must declare its own.
using default_roles = axis_roles<batch_axes<"data", "expert">, expert_axes<"expert">, model_axes<"model">>;

namespace detail {

template <class R>
struct is_axis_roles : std::false_type {};
template <class B, class E, class M>
struct is_axis_roles<axis_roles<B, E, M>> : std::true_type {};

template <std::size_t N>
constexpr bool names_contain(const std::array<name_t, N>& a, const name_t& n) {
  for (const auto& x : a)
    if (x == n) return true;
  return false;
}

enum class roles_problem : std::uint8_t { none, no_role, expert_not_batch, batch_and_model };

// Diagnostics naming the axis (in the "required from" note).
template <fixed_string Axis, roles_problem P>
struct check_axis_role {
  static_assert(P != roles_problem::no_role,
                "gshard::axis_roles: a mesh axis has no role (the axis: see the instantiation above); list it in "
                "batch_axes<...> or model_axes<...> of the roles");
  static_assert(P != roles_problem::expert_not_batch,
                "gshard::axis_roles: an expert axis does not carry the batch; list it in batch_axes<...> too (the "
                "groups are split over every rank)");
  static_assert(P != roles_problem::batch_and_model,
                "gshard::axis_roles: an axis both carries the batch and splits the model dims; give it one role");
  static constexpr bool ok = true;
};

struct role_check {
  roles_problem problem = roles_problem::none;
  name_t axis{};
};

// The roles of Roles on Mesh: bit masks over Mesh's axes, checked.
template <class Mesh, class Roles>
struct resolved_roles {
  static_assert(is_axis_roles<Roles>::value, "gshard::axis_roles: the roles must be an axis_roles<batch_axes<...>, ...>");
  static constexpr int naxes = Mesh::axis_count;
  static constexpr auto mask_of = [](const auto& names) {
    std::uint32_t m = 0;
    for (int a = 0; a < naxes; ++a)
      if (names_contain(names, Mesh::names[std::size_t(a)])) m |= 1u << a;
    return m;
  };
  static constexpr std::uint32_t batch = mask_of(Roles::batch::names);
  static constexpr std::uint32_t expert = mask_of(Roles::expert::names);
  static constexpr std::uint32_t model = mask_of(Roles::model::names);
  static consteval role_check check_roles() {
    for (int a = 0; a < naxes; ++a) {
      const std::uint32_t bit = 1u << a;
      const name_t n = Mesh::names[std::size_t(a)];
      if (!((batch | model) & bit)) return {roles_problem::no_role, n};
      if ((expert & bit) && !(batch & bit)) return {roles_problem::expert_not_batch, n};
      if ((batch & bit) && (model & bit)) return {roles_problem::batch_and_model, n};
    }
    return {};
  }
  static constexpr role_check check = check_roles();
  static_assert(check_axis_role<to_fixed<check.axis.view().size()>(check.axis.view()), check.problem>::ok);

  // The axes of `mask` in mesh order, those of `last` (a subset) minor-most.
  static constexpr int axes_of(std::uint32_t mask, std::uint32_t last, name_t* out) {
    int n = 0;
    for (int a = 0; a < naxes; ++a)
      if (((mask & ~last) >> a) & 1u) out[n++] = Mesh::names[std::size_t(a)];
    for (int a = 0; a < naxes; ++a)
      if (((mask & last) >> a) & 1u) out[n++] = Mesh::names[std::size_t(a)];
    return n;
  }
  static constexpr rule_table table(bool at_experts) {
    rule_table t;
    name_t axes[max_mesh_axes]{};
    const std::uint32_t tokens = at_experts ? batch & ~expert : batch;
    int n = axes_of(tokens, expert, axes);
    if (n) {
      t.add('B', axes, n);
      t.add('G', axes, n);
    }
    if ((n = axes_of(model, 0, axes))) {
      t.add('H', axes, n);
      t.add('N', axes, n);
    }
    if (at_experts && (n = axes_of(expert, 0, axes))) t.add('E', axes, n);
    return t;
  }
  static constexpr rule_table tokens_table = table(false);
  static constexpr rule_table experts_table = table(true);
  using at_tokens = rules_text<to_fixed<render_rules(tokens_table).n>(render_rules(tokens_table).view())>;
  using at_experts = rules_text<to_fixed<render_rules(experts_table).n>(render_rules(experts_table).view())>;
};

}  // namespace detail

// The rule tables of the MoE Transformer on Mesh under Roles (see the top of
// this header); the masks say which axes play which role.
template <mesh_type Mesh, class Roles = default_roles>
struct roles_on {
  using resolved = detail::resolved_roles<Mesh, Roles>;
  using at_tokens = typename resolved::at_tokens;
  using at_experts = typename resolved::at_experts;
  static constexpr std::uint32_t batch_mask = resolved::batch;
  static constexpr std::uint32_t expert_mask = resolved::expert;
  static constexpr std::uint32_t model_mask = resolved::model;
};

}  // namespace gshard
