// gshard/ad/var.hpp — var<X>: a value computed on a tape (gshard/ad/tape.hpp),
// the tensor and whether (and where) its gradient is tracked; var_type, the
// concept the operations on the tape take.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "gshard/tensor/tensor.hpp"

namespace gshard {

class tape;

// A value computed on a tape: the tensor, and whether (and where) its
// gradient is tracked. Copies share the tensor. Operations on vars (einsum,
// reshard, +, relu, ...; gshard/ad/ops.hpp) compute like their tensor forms
// and, while the tape records, note their gradient rule.
template <class X>
class var {
 public:
  // The member names of tensor<> (param<> has most of them too), so generic
  // code reads them from any of the three; written out, as a dependent base
  // class would hide them from the member functions.
  using tensor_type = X;
  using value_type = typename X::value_type;
  using mesh_type = typename X::mesh_type;
  using sharding_type = typename X::sharding_type;
  using extents_type = typename X::extents_type;
  static constexpr int rank = X::rank;
  static constexpr auto label_string = X::label_string;
  static constexpr std::string_view labels = X::labels;
  static constexpr detail::rlayout resolved = X::resolved;
  static_assert(std::is_floating_point_v<value_type> || std::is_integral_v<value_type>,
                "gshard::var: the tape computes in float or double (bf16 tensors are moved, resharded and multiplied "
                "outside it)");

  var(gshard::tape& t, std::shared_ptr<const X> value, int slot) : tape_(&t), value_(std::move(value)), slot_(slot) {}

  const X& value() const { return *value_; }
  const std::shared_ptr<const X>& shared() const { return value_; }
  gshard::tape& on_tape() const { return *tape_; }
  bool tracked() const { return slot_ >= 0; }
  int slot() const { return slot_; }
  const mesh_type& mesh() const { return value_->mesh(); }
  const extents_type& extents() const { return value_->extents(); }
  index_t extent(int d) const { return value_->extent(d); }
  std::string notation() const { return value_->notation(); }

  // The tensor, moved out when this is the only holder (an rvalue var whose
  // tensor no recorded rule keeps), else copied.
  X take_value() && {
    if (value_.use_count() == 1) return std::move(const_cast<X&>(*value_));  // made by make_shared<X>: not const
    return *value_;
  }

 private:
  gshard::tape* tape_;
  std::shared_ptr<const X> value_;
  int slot_;
};

namespace detail {
template <class V>
struct is_var : std::false_type {};
template <class X>
struct is_var<var<X>> : std::true_type {};
// The tensor type of a var (of a reference to one).
template <class V>
using tensor_of = typename std::remove_cvref_t<V>::tensor_type;
}  // namespace detail

template <class V>
concept var_type = detail::is_var<std::remove_cvref_t<V>>::value;

}  // namespace gshard
