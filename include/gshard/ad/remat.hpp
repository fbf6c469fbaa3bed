// gshard/ad/remat.hpp — rematerialisation: remat(f, x...) runs f's forward
// keeping nothing but its inputs, and runs it again in the backward to take
// its gradient (gradient checkpointing). The model code in f is unchanged:
// the same ops, the same collectives, recorded only the second time.
//
//   auto y = remat([&blk](const auto& x) { return blk(x); }, x);
//   auto [y, aux, stats] = remat(moe_block, x);   // a tuple: its vars tracked
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gshard/ad/tape.hpp"
#include "gshard/core/counters.hpp"
#include "gshard/runtime/trace.hpp"

namespace gshard {

namespace detail {

template <class T>
struct is_tuple : std::false_type {};
template <class... T>
struct is_tuple<std::tuple<T...>> : std::true_type {};

// Calls fn(a_v, b_v) for each pair of vars at the same place of two outputs
// of one type: the output itself if it is a var, or each var and engaged
// optional var of a tuple. Anything else is not a value on the tape.
template <class Out, class Fn>
void for_each_var_pair(Out& a, Out& b, Fn&& fn) {
  if constexpr (is_var<Out>::value) {
    fn(a, b);
  } else if constexpr (is_tuple<Out>::value) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (for_each_var_pair(std::get<I>(a), std::get<I>(b), fn), ...);
    }(std::make_index_sequence<std::tuple_size_v<Out>>{});
  } else if constexpr (requires { typename Out::value_type; } &&
                       std::is_same_v<Out, std::optional<typename Out::value_type>>) {
    if constexpr (is_var<typename Out::value_type>::value) {
      if (a.has_value() != b.has_value())
        throw error("gshard::remat: the recomputed forward returned another set of values than the first one; f must be deterministic");
      if (a) fn(*a, *b);
    }
  }
}
template <class Out, class Fn>
void for_each_var(Out& a, Fn&& fn) {
  for_each_var_pair(a, a, [&](auto& v, auto&) { fn(v); });
}

template <class Out>
constexpr void check_remat_output() {
  constexpr bool ok = is_var<Out>::value || is_tuple<Out>::value;
  static_assert(ok, "gshard::remat: f returns a var or a std::tuple of values (vars, std::optional vars, anything else)");
}

}  // namespace detail

// f takes vars and returns a var, or a std::tuple whose elements are vars,
// std::optional vars or anything else (passed through, from the first
// forward). f must be deterministic (the same outputs from the same inputs
// and state: random routing is keyed by its stream, state moves through
// tape::after_step) and read every tracked value it uses through its
// arguments or as a declared parameter: a tracked value captured from
// outside throws (its gradient would arrive twice). f is kept by value
// until the backward. Cost: the forward of f once more, in the backward —
// its collectives too (counted and traced as such); its FLOPs go to
// recomputed_flops(), not model_flops(). On a tape that does not record, or
// inside a forward that is itself being recomputed, remat(f, x...) is f(x...).
template <class F, class... X>
auto remat(F f, const var<X>&... inputs) {
  static_assert(sizeof...(X) > 0, "gshard::remat: give f at least one var input (it names the tape)");
  tape& t = std::get<0>(std::tie(inputs...)).on_tape();
  using Out = std::remove_cvref_t<decltype(f(inputs...))>;
  detail::check_remat_output<Out>();
  if (!t.recording_ || t.recomputing_ > 0 || t.suspended_ > 0) return Out(f(inputs...));

  // The first forward: untracked inputs, parameters untracked, nothing recorded.
  Out out = [&] {
    struct suspend {
      tape& t;
      explicit suspend(tape& tp) : t(tp) { ++t.suspended_; }
      ~suspend() { --t.suspended_; }
    } guard(t);
    return Out(f(var<X>(t, inputs.shared(), -1)...));
  }();
  detail::for_each_var(out, [&](auto& v) { v = t.track(v); });

  // The backward: f's forward again, recording into a list of its own with
  // the inputs' slots; the outputs' gradients moved into its outputs' slots;
  // its rules run in reverse.
  t.record([tp = &t, f = std::move(f), kept = std::make_tuple(inputs.shared()...),
            in_slots = std::array<int, sizeof...(X)>{inputs.slot()...}, first = out]() mutable {
    tape& t = *tp;
    bool any = false;
    detail::for_each_var(first, [&](auto& v) { any = any || !t.slot<detail::tensor_of<decltype(v)>>(v.slot()).empty(); });
    if (!any) return;  // no gradient reaches f's outputs
    std::optional<trace::span> span;
    if (trace::enabled()) span.emplace("recompute", "backward");
    std::vector<tape::rule> rules;
    struct recompute {
      tape& t;
      std::vector<tape::rule>* saved;
      detail::recomputing_flops flops;
      recompute(tape& tp, std::vector<tape::rule>& into) : t(tp), saved(tp.recording_into_) {
        ++t.recomputing_;
        t.recording_into_ = &into;
      }
      ~recompute() {
        --t.recomputing_;
        t.recording_into_ = saved;
      }
    };
    Out again = [&]<std::size_t... I>(std::index_sequence<I...>) {
      recompute guard(t, rules);
      return Out(f(var<X>(t, std::get<I>(kept), in_slots[I])...));
    }(std::index_sequence_for<X...>{});
    detail::for_each_var_pair(first, again, [&](auto& v1, auto& v2) {
      using V = detail::tensor_of<decltype(v1)>;
      auto dy = t.slot<V>(v1.slot()).template take<gradient_sharding<typename V::sharding_type>>();
      if (dy && v2.tracked()) t.slot<V>(v2.slot()).add(std::move(*dy));
    });
    for (std::size_t i = rules.size(); i-- > 0;) {
      rules[i].run();  // each in its own forward's precision: the router's in fp32 within a bf16 block
      detail::progress_in_flight();  // as between the tape's own rules
    }
  });
  return out;
}

}  // namespace gshard
