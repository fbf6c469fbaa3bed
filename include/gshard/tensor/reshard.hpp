// gshard/tensor/reshard.hpp — reshard<Target>(t): the same global tensor in another
// sharding (a sharding, or a rules table applied to its labels), with the
// collectives its plan (reshard_plan.hpp, computed at compile time) names,
// run by tensor/execute_reshard.hpp; start_reshard<Target>(t), the same
// started now and finished later. The one-collective forms and
// gather/scatter are in tensor_collectives.hpp. reshard_backward: its gradient.
#pragma once

#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "gshard/tensor/execute_reshard.hpp"
#include "gshard/layout/labels.hpp"
#include "gshard/runtime/nonblocking.hpp"
#include "gshard/tensor/reshard_plan.hpp"
#include "gshard/tensor/tensor.hpp"

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

// What reshard<ToOrRules>(x) and start_reshard<ToOrRules>(x) work out for
// an x of type X: the target sharding, the result's type, the plan.
template <class ToOrRules, class X>
struct reshard_of {
  using Y = std::remove_cvref_t<X>;
  using To = typename reshard_target<ToOrRules, Y>::type;
  using out_t = with_sharding<Y, To>;
  using plan = reshard_plan<typename Y::mesh_type, Y::rank, typename Y::sharding_type, To>;
  using T = typename Y::value_type;
};
}  // namespace detail

// The same global tensor with sharding To — a sharding, or a rules table
// applied to the tensor's labels. Communication as the plan says, with `w`
// on the wire (wire::bf16: every value rounded to bf16, at any rank count,
// and its messages half of fp32's bytes). Given an rvalue, reuses its
// storage where a step allows (an all_reduce then runs in place).
template <class ToOrRules, class X>
  requires sharded_tensor<X>
auto reshard(X&& x, wire w = wire::same) {
  using R = detail::reshard_of<ToOrRules, X>;
  using Y = typename R::Y;
  using out_t = typename R::out_t;
  using plan = typename R::plan;
  using T = typename R::T;
  const auto& mesh = x.mesh();
  const auto extents = x.extents();
  if constexpr (std::is_rvalue_reference_v<X&&> && !std::is_const_v<std::remove_reference_t<X>>) {
    return out_t(mesh, extents, detail::execute_reshard_on<T, Y::rank>(w, mesh, plan::steps, std::move(x.local()), extents));
  } else {
    return out_t(mesh, extents, detail::execute_reshard_on<T, Y::rank>(w, mesh, plan::steps, x.local(), extents));
  }
}

namespace detail {
// One started reshard of a rank-R shard of W: the steps before a last
// all_to_all run at once and that all_to_all is posted (start); finish()
// waits and unpacks. Per element type and rank only, as the executor.
template <class W, int R>
struct reshard_flight {  // on the heap: the request may move while MPI writes into it
  local_tensor<W, R> in;
  std::vector<W> send, recv;
  local_tensor<W, R> out;
  std::optional<all_to_all_geometry<W, R>> unpack;
  collective_request request;  // last: destroyed (finished) before the buffers it uses

  template <class Local>
  static GSHARD_NOINLINE std::unique_ptr<reshard_flight> start(const mesh_base& m, const reshard_steps& p, Local&& in,
                                                               const shape<R>& global, wire w) {
    auto f = std::make_unique<reshard_flight>();
    const int last = p.n - 1;
    if (p.n == 0 || p.step[last].kind != step_kind::all_to_all) {
      f->out = run_plan(m, p, std::forward<Local>(in), global, w);
    } else if (last > 0) {  // the steps before the all_to_all, now
      reshard_steps head = p;
      head.n = last;
      f->post(m, p, last, run_plan(m, head, std::forward<Local>(in), global, w), global, w);
    } else {
      f->post(m, p, last, std::forward<Local>(in), global, w);
    }
    return f;
  }
  template <class Local>
  static local_tensor<W, R> run_plan(const mesh_base& m, const reshard_steps& p, Local&& in, const shape<R>& global, wire w) {
    if constexpr (std::is_rvalue_reference_v<Local&&> && !std::is_const_v<std::remove_reference_t<Local>>)
      return execute_reshard<W, R>(m, p, std::move(in), global, 0, w);
    else
      return execute_reshard<W, R>(m, p, in, global, w);
  }

  // Packs `x` (in state i of the plan) and posts step i, an all_to_all.
  template <class Local>
  void post(const mesh_base& m, const reshard_steps& p, int i, Local&& x, const shape<R>& global, wire w) {
    const all_to_all_geometry<W, R> geo(m, p.step[i], p.state[i], p.state[i + 1], global);
    const W* s = x.data();
    if (geo.packs()) {
      send.resize(geo.n);
      geo.pack(x.data(), send.data());
      s = send.data();
    } else {
      in = std::forward<Local>(x);  // moved from an rvalue, else copied: it must outlive the collective
      s = in.data();
    }
    out = local_tensor<W, R>(geo.eo);
    if (geo.unpacks()) {
      recv.resize(geo.n);
      unpack.emplace(geo);
    }
    W* r = geo.unpacks() ? recv.data() : out.data();
    request = geo.start(m, p.step[i], s, r, w);
  }

  local_tensor<W, R> finish() {
    request.wait();
    if (unpack) unpack->unpack(recv.data(), out.data());
    return std::move(out);
  }
};

// A started reshard of a rank-R shard of T by a plan known at run time:
// reshard_request's work, without the tensor type it hands out. With
// wire::bf16 the shard is rounded to bf16 first, travels so, and wait()
// widens it back; a plan with no step rounds it all the same.
template <class T, int R>
class started_reshard {
  using wide_flight = reshard_flight<T, R>;
  using narrow_flight = reshard_flight<bf16, R>;

 public:
  template <class Local>
  started_reshard(const mesh_base& m, const shape<R>& global, const reshard_steps& p, Local&& in, wire w) {
    if (narrows<T>(w)) {
      auto narrow = converted<bf16>(in);
      release(std::forward<Local>(in));
      if (p.n == 0)  // nothing travels: the values rounded all the same
        wide_ = wide_flight::start(m, p, converted<T>(narrow), global, w);
      else
        narrow_ = narrow_flight::start(m, p, std::move(narrow), global, w);
      return;
    }
    wide_ = wide_flight::start(m, p, std::forward<Local>(in), global, w);
  }

  bool test() {
    if (wide_) return wide_->request.test();
    return !narrow_ || narrow_->request.test();
  }

  local_tensor<T, R> wait() {
    if (!wide_ && !narrow_) throw error("gshard::reshard_request: wait() was called before; it hands the tensor out once");
    if (narrow_) {
      local_tensor<T, R> out = converted<T>(narrow_->finish());
      narrow_.reset();
      return out;
    }
    local_tensor<T, R> out = wide_->finish();
    wide_.reset();
    return out;
  }

 private:
  std::unique_ptr<wide_flight> wide_;
  std::unique_ptr<narrow_flight> narrow_;  // wire::bf16
};
}  // namespace detail

// A reshard started now and finished later (start_reshard<To>(t)); wait()
// gives the tensor in To. A plan that ends in an all_to_all — a split moved
// from one dim to another, as the MoE layer's dispatch and combine, after
// any steps before it — runs those steps at once and posts the all_to_all
// (start_all_to_all, packed), which travels while the rank computes;
// wait() unpacks it. Any other plan runs whole when it starts and wait()
// hands its result out: the same values and the same collectives either way.
// With wire::bf16 the shard is rounded to bf16 first, travels so, and
// wait() widens it back.
template <class Out>
class [[nodiscard]] reshard_request {
  using T = typename Out::value_type;
  static constexpr int R = Out::rank;

 public:
  // Runs plan `p` (of Out's mesh; its last state is Out's layout) on `in`,
  // the shard in its first state.
  template <class Local>
  reshard_request(const typename Out::mesh_type& m, const shape<R>& global, const detail::reshard_steps& p, Local&& in,
                  wire w = wire::same)
      : mesh_(&m), extents_(global), started_(m, global, p, std::forward<Local>(in), w) {}

  // Moves it on without blocking; true once its data has arrived.
  bool test() { return started_.test(); }

  // The tensor in To; once.
  Out wait() { return Out(*mesh_, extents_, started_.wait()); }

 private:
  const typename Out::mesh_type* mesh_;
  shape<R> extents_;
  detail::started_reshard<T, R> started_;
};

// reshard<To>(x), started: the same checks and plan, the collectives posted
// now (reshard_request). The caller computes, then wait()s.
template <class ToOrRules, class X>
  requires sharded_tensor<X>
[[nodiscard]] auto start_reshard(X&& x, wire w = wire::same) {
  using R = detail::reshard_of<ToOrRules, X>;
  if constexpr (std::is_rvalue_reference_v<X&&> && !std::is_const_v<std::remove_reference_t<X>>)
    return reshard_request<typename R::out_t>(x.mesh(), x.extents(), R::plan::steps, std::move(x.local()), w);
  else
    return reshard_request<typename R::out_t>(x.mesh(), x.extents(), R::plan::steps, x.local(), w);
}

namespace detail {
template <class S>
struct gradient_spec {  // S without its pending sums
  static constexpr sharding_spec value = [] {
    sharding_spec g = S::spec;
    g.npartial = 0;
    for (name_t& a : g.partial) a = name_t{};
    return g;
  }();
};
}  // namespace detail

// The sharding of the gradient of a tensor sharded S: S without its pending
// sums. A summand's gradient is the gradient of the sum, the same on every
// rank along those axes — so there it is replicated.
template <class S>
using gradient_sharding =
    GSHARD_SHARDING_OF(detail::gradient_spec<S>::value);

namespace detail {
template <class X>
using gradient_of = tensor<typename X::value_type, X::rank, typename X::mesh_type, gradient_sharding<typename X::sharding_type>>;

}  // namespace detail

// The gradient of x for y = reshard<To>(x), given y's gradient dy — reduced
// (in To's gradient sharding) or still pending (partial over axes where y is
// replicated, e.g. straight from an einsum's backward). It comes back in
// gradient_sharding<From> with the forward's collectives transposed:
// all_to_all <-> the reverse all_to_all, all_reduce <-> nothing (or an
// all_reduce of a pending dy), a local slice <-> all_gather, and all_gather
// <-> a local slice when dy is reduced or one reduce_scatter when it is
// pending (the cheaper way: keep dy partial).
template <class From, class DY>
  requires sharded_tensor<DY>
auto reshard_backward(DY&& dy) {
  return reshard<gradient_sharding<From>>(std::forward<DY>(dy));
}

}  // namespace gshard
