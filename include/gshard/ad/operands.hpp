// gshard/ad/operands.hpp — what every operation on the tape starts with:
// which operands are vars or parameters, the tape they record on, a var's
// tensor taken (moved when nothing else holds it), and the sharding of a sum
// over a tensor's shards (a scale's or a table's gradient).
#pragma once

#include <type_traits>
#include <utility>

#include "gshard/ad/tape.hpp"

namespace gshard {

namespace detail {

template <class A>
concept ad_operand = is_var<std::remove_cvref_t<A>>::value || is_param<std::remove_cvref_t<A>>::value;

// The tape of the first var among the operands.
template <class A, class... Rest>
tape& tape_of(const A& a, const Rest&... rest) {
  if constexpr (is_var<A>::value) return a.on_tape();
  else if constexpr (sizeof...(Rest) > 0) return tape_of(rest...);
  else {
    static_assert(sizeof...(Rest) > 0,
                  "gshard::tape: an operation on parameters alone has no tape to record on; pass tape.use(p) for one of them");
    return *static_cast<tape*>(nullptr);
  }
}

template <class A>
auto as_var(tape& t, const A& a) {
  if constexpr (is_param<A>::value) return t.use(a);
  else return a;
}

// The tensor of a var to compute on: moved out of an rvalue var nothing else
// holds, copied otherwise.
template <class V>
tensor_of<V> value_of(V&& v) {
  if constexpr (std::is_rvalue_reference_v<V&&> && !std::is_const_v<std::remove_reference_t<V>>)
    return std::move(v).take_value();
  else return v.value();
}

// The bf16 tensor of a var held in bf16 (var::held()), taken as value_of
// takes the tensor.
template <class V>
typename std::remove_cvref_t<V>::held_type held_of(V&& v) {
  if constexpr (std::is_rvalue_reference_v<V&&> && !std::is_const_v<std::remove_reference_t<V>>)
    return std::move(v).take_held();
  else return *v.held();
}

// The layout with every axis that splits X pending instead: the sharding of
// a sum over X's shards (a norm scale's or an embedding table's gradient).
template <class X, int R, class T = typename X::value_type>
struct sum_over_shards {
  static constexpr rlayout value = [] {
    rlayout l{};
    l.partial = X::resolved.split_mask();
    return l;
  }();
  static constexpr sharding_spec spec = unresolve(value, X::mesh_type::names);
  using type = tensor<T, R, typename X::mesh_type, GSHARD_SHARDING_OF(spec)>;
};


}  // namespace detail

}  // namespace gshard
