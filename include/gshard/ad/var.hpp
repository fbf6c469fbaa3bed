// gshard/ad/var.hpp — var<X>: a value computed on a tape (gshard/ad/tape.hpp),
// the tensor (or, under mixed precision, its bf16 form) and whether (and
// where) its gradient is tracked; var_type, the concept the operations on
// the tape take.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "gshard/tensor/ops.hpp"
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

  // The tensor's bf16 form, for a var held in bf16.
  using held_type = with_element<X, bf16>;

  var(gshard::tape& t, std::shared_ptr<const X> value, int slot) : tape_(&t), value_(std::move(value)), slot_(slot) {}
  // A var held in bf16 (an einsum's output under mixed precision, written
  // in bf16 by its GEMM: einsum<Spec, Out, bf16_activation>): the readers
  // that round their operands to bf16 anyway take held() as it is; value()
  // is the bf16 values widened to X (exactly), made once, the first time
  // anyone asks, for every copy of this var — the lazy widening writes
  // state the copies share, so a var is read by one thread at a time, as
  // its tape runs.
  var(gshard::tape& t, std::shared_ptr<const held_type> held, int slot)
    requires std::is_same_v<value_type, float>
      : tape_(&t), held_(std::make_shared<held_value>(std::move(held))), slot_(slot) {}

  const X& value() const { return *shared(); }
  const std::shared_ptr<const X>& shared() const {
    if constexpr (std::is_same_v<value_type, float>)
      if (held_ && !held_->wide) held_->wide = std::make_shared<X>(convert<value_type>(*held_->bf16));
    return held_ ? held_->wide : value_;
  }
  // The bf16 tensor a var held in bf16 holds; null for any other var.
  std::shared_ptr<const held_type> held() const { return held_ ? held_->bf16 : nullptr; }
  gshard::tape& on_tape() const { return *tape_; }
  bool tracked() const { return slot_ >= 0; }
  int slot() const { return slot_; }
  const mesh_type& mesh() const { return held_ ? held_->bf16->mesh() : value_->mesh(); }
  const extents_type& extents() const { return held_ ? held_->bf16->extents() : value_->extents(); }
  index_t extent(int d) const { return extents()[std::size_t(d)]; }
  std::string notation() const {
    if (!held_) return value_->notation();
    const std::string n = held_->bf16->notation();  // "bf16[...]": named as X, its element type
    return std::string(detail::dtype_name<value_type>()) + n.substr(std::string_view(detail::dtype_name<bf16>()).size());
  }

  // The tensor, moved out when this is the only holder (an rvalue var whose
  // tensor no recorded rule keeps), else copied.
  X take_value() && {
    if constexpr (std::is_same_v<value_type, float>)
      if (held_ && held_.use_count() == 1 && !held_->wide) return convert<value_type>(*held_->bf16);  // read by none else
    if (held_) return *shared();
    if (value_.use_count() == 1) return std::move(const_cast<X&>(*value_));  // made by make_shared<X>: not const
    return *value_;
  }
  // The bf16 tensor of a var held in bf16 (held() is not null), moved out likewise.
  held_type take_held() && {
    if (!held_) throw error("gshard::var: take_held() of " + notation() + ", a var not held in bf16");
    if (held_.use_count() == 1 && held_->bf16.use_count() == 1)
      return std::move(const_cast<held_type&>(*held_->bf16));  // made by make_shared<held_type>: not const
    return *held_->bf16;
  }

 private:
  struct held_value {
    explicit held_value(std::shared_ptr<const held_type> b) : bf16(std::move(b)) {}
    std::shared_ptr<const held_type> bf16;
    std::shared_ptr<const X> wide;  // made on the first read of value()
  };
  gshard::tape* tape_;
  std::shared_ptr<const X> value_;       // null for a var held in bf16
  std::shared_ptr<held_value> held_;     // shared by the copies of a var held in bf16, else null
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
