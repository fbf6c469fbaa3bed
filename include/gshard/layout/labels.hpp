// gshard/layout/labels.hpp — shardings by dim label. A rule table maps dim labels
// to mesh axes (G -> data, expert; H -> model); the sharding of any term
// ("GSM", "EGCM") follows from it, so one placement is written once for every
// tensor layout. Rules resolve to the canonical sharding types of
// sharding.hpp, so std::is_same_v still means semantic equality. Knows
// nothing of MPI.
//
//   using at_groups = rules<on<'G', "data", "expert">, on<'H', "model">>;
//   sharding_by<at_groups, "GSM">   == sharding<split<0, "data", "expert">>
//   sharding_by<at_groups, "EGCH">  == sharding<split<1, "data", "expert">, split<3, "model">>
#pragma once

#include <string_view>

#include "gshard/core/fixed_string.hpp"
#include "gshard/layout/sharding.hpp"

namespace gshard {

// on<'G', "data", "expert">: label G is split over data (major) and expert.
template <char Label, fixed_string... Axes>
struct on {
  static_assert((Label >= 'A' && Label <= 'Z') || (Label >= 'a' && Label <= 'z'),
                "gshard::on: a dim label is one letter A-Z or a-z");
  static_assert(sizeof...(Axes) >= 1, "gshard::on: name at least one mesh axis; a label without a rule is replicated");
  static constexpr char label = Label;
  static constexpr std::array<detail::name_t, sizeof...(Axes)> axes{detail::name_t(Axes.view())...};
};

namespace detail {

inline constexpr int max_rules = 52;  // one per letter

// True when `labels` has at most max_rank distinct letters: a valid term.
constexpr bool valid_term(std::string_view labels) {
  if (labels.size() > std::size_t(max_rank)) return false;
  for (std::size_t i = 0; i < labels.size(); ++i) {
    const char c = labels[i];
    if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'))) return false;
    for (std::size_t j = 0; j < i; ++j)
      if (labels[j] == c) return false;
  }
  return true;
}

struct label_rule {
  char label = 0;
  dim_axes axes{};
  friend constexpr bool operator==(const label_rule&, const label_rule&) = default;
};

enum class rules_error : std::uint8_t { none, label_twice, axis_repeated, bad_axis_name, too_many_axes };

struct rule_table {
  int n = 0;
  label_rule rule[max_rules]{};  // sorted by label: canonical
  rules_error error = rules_error::none;

  constexpr const label_rule* find(char l) const {
    for (int i = 0; i < n; ++i)
      if (rule[i].label == l) return &rule[i];
    return nullptr;
  }
  constexpr void add(char l, const name_t* axes, int count) {
    if (error != rules_error::none) return;
    if (find(l)) { error = rules_error::label_twice; return; }
    if (count > max_mesh_axes) { error = rules_error::too_many_axes; return; }
    label_rule r{l, {}};
    for (int i = 0; i < count; ++i) {
      if (!valid_axis_name(axes[i].view())) { error = rules_error::bad_axis_name; return; }
      for (int j = 0; j < i; ++j)
        if (axes[j] == axes[i]) { error = rules_error::axis_repeated; return; }
      r.axes.axes[i] = axes[i];
    }
    r.axes.n = count;
    int k = n++;
    while (k > 0 && l < rule[k - 1].label) { rule[k] = rule[k - 1]; --k; }
    rule[k] = r;
  }
};

// "G{data,expert} H{model}": the canonical text that names a rules type
// (the grammar of sharding.hpp's braced_text).
using rules_buffer = braced_text<max_rules * (4 + max_mesh_axes * (max_name_length + 1))>;
constexpr rules_buffer render_rules(const rule_table& t) {
  rules_buffer s;
  for (int i = 0; i < t.n; ++i) {
    const char l[2] = {t.rule[i].label, '\0'};
    s.add_group(l, t.rule[i].axes.axes, t.rule[i].axes.n);
  }
  return s;
}

// The inverse of render_rules (only ever given its output).
constexpr rule_table parse_rules(std::string_view text) {
  rule_table t;
  for_each_group(text, [&](std::string_view key, const name_t* axes, int n) { t.add(key[0], axes, n); });
  return t;
}

// The layout of a term under a table: each labelled dim split over its
// rule's axes; labels without a rule are replicated.
constexpr spec_result apply_rules(const rule_table& t, std::string_view term) {
  spec_result r;
  for (std::size_t d = 0; d < term.size(); ++d)
    if (const label_rule* rule = t.find(term[d])) add_split(r, int(d), rule->axes.axes, rule->axes.n);
  return r;
}

}  // namespace detail

// The canonical rules type, named by its text: rules_text<"G{data,expert} H{model}">
// (as sharding_text<"..."> names a sharding: sharding.hpp).
template <fixed_string Text>
struct rules_text {
  static constexpr detail::rule_table table = detail::parse_rules(Text.view());
  static constexpr std::string_view text = Text.view();
};

namespace detail {
template <class... Ons>
struct make_rules {
  static constexpr rule_table table = [] {
    rule_table t;
    (t.add(Ons::label, Ons::axes.data(), int(Ons::axes.size())), ...);
    return t;
  }();
  static_assert(table.error != rules_error::label_twice, "gshard::rules: a label has two rules; list all its axes in one on<>");
  static_assert(table.error != rules_error::axis_repeated, "gshard::rules: a mesh axis is named twice in one on<>");
  static_assert(table.error != rules_error::bad_axis_name,
                "gshard::rules: an axis name is empty, longer than 23 characters, or holds ',', '{', '}' or ' '");
  static_assert(table.error != rules_error::too_many_axes, "gshard::rules: an on<> names more than gshard::max_mesh_axes axes");
  using type = rules_text<to_fixed<render_rules(table).n>(render_rules(table).view())>;
};

template <class R>
struct is_rules : std::false_type {};
template <fixed_string S>
struct is_rules<rules_text<S>> : std::true_type {};
}  // namespace detail

// rules<on<'G', "data", "expert">, on<'H', "model">>: the canonical rules type.
template <class... Ons>
using rules = typename detail::make_rules<Ons...>::type;

template <class R>
concept rules_type = detail::is_rules<R>::value;

namespace detail {
// Names the term and the rules when two labels of the term land on one axis.
template <fixed_string Term, fixed_string Rules, spec_error E>
struct check_rules_on_term {
  static_assert(valid_term(Term.view()), "gshard::rules: a term is one distinct letter per dim (at most gshard::max_rank)");
  static_assert(E != spec_error::axis_in_two_dims,
                "gshard::rules: two labels of the term map to the same mesh axis; a mesh axis may split one dim of a "
                "tensor (the term and the rules: see the instantiation above)");
  static constexpr bool ok = true;
};

template <class Rules, fixed_string Term>
struct sharding_by_impl {
  static constexpr spec_result r = apply_rules(Rules::table, Term.view());
  static_assert(check_rules_on_term<Term, to_fixed<Rules::text.size()>(Rules::text), r.error>::ok);
  using type = GSHARD_SHARDING_OF(r.spec);
};
}  // namespace detail

// The sharding a rule table gives the dims of `Term`.
template <rules_type Rules, fixed_string Term>
using sharding_by = typename detail::sharding_by_impl<Rules, Term>::type;

}  // namespace gshard
