// gshard/reshard.hpp — reshard<Target>(t): the same global tensor in another
// sharding (a sharding, or a rules table applied to its labels), with the
// collectives its plan (reshard_plan.hpp, computed at compile time) names,
// run by detail/execute_reshard.hpp. The one-collective forms and
// gather/scatter are in tensor_collectives.hpp, reshard's gradient in grad.hpp.
#pragma once

#include <type_traits>
#include <utility>

#include "gshard/detail/execute_reshard.hpp"
#include "gshard/labels.hpp"
#include "gshard/reshard_plan.hpp"
#include "gshard/tensor.hpp"

namespace gshard {

namespace detail {
// The sharding reshard<To> moves a tensor of type X to: To itself, or what
// the rules To give X's labels.
template <class To, class X>
struct reshard_target {
  using type = To;
};
template <fixed_string R, class X>
struct reshard_target<rules_text<R>, X> {
  static_assert(X::labels.size() == X::rank,
                "gshard::reshard: resharding by rules needs a labelled tensor; name its dims with relabel<\"...\">");
  using type = sharding_by<rules_text<R>, X::label_string>;
};
}  // namespace detail

// The same global tensor with sharding To — a sharding, or a rules table
// applied to the tensor's labels. Communication as the plan says. Given an
// rvalue, reuses its storage where a step allows (an all_reduce then runs in
// place).
template <class ToOrRules, class X>
  requires sharded_tensor<X>
auto reshard(X&& x) {
  using Y = std::remove_cvref_t<X>;
  using To = typename detail::reshard_target<ToOrRules, Y>::type;
  using out_t = with_sharding<Y, To>;
  using plan = reshard_plan<typename Y::mesh_type, Y::rank, typename Y::sharding_type, To>;
  using T = typename Y::value_type;
  const auto& mesh = x.mesh();
  const auto extents = x.extents();
  // Before any collective: a target that does not divide throws the same on every rank.
  detail::check_divisible<Y::rank>(out_t::resolved, To::spec, extents, mesh, detail::dtype_name<T>(), Y::labels);
  if constexpr (std::is_rvalue_reference_v<X&&> && !std::is_const_v<std::remove_reference_t<X>>) {
    return out_t(mesh, extents, detail::execute_reshard<T, Y::rank>(mesh, plan::steps, std::move(x.local()), extents));
  } else {
    return out_t(mesh, extents, detail::execute_reshard<T, Y::rank>(mesh, plan::steps, x.local(), extents));
  }
}

}  // namespace gshard
