// The code around each fragment of README.md and docs/*.md — a ```cpp block
// that is not a whole program. test/check_doc_programs.py compiles every
// fragment (-fsyntax-only, all in one translation unit, each in a namespace
// of its own) inside the context its marker names:
//   <!-- compile: context=NAME -->      (on the line before the block)
// A context runs from `// context: NAME` to the next context; the fragment
// goes where `//@fragment` stands. Templates are instantiated (explicitly or
// through decltype) so the fragment's body is checked, not only parsed.
// `prelude` comes first, once. Errors point into the Markdown file.

// context: prelude
#include <cassert>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <utility>

#include <gshard/gshard.hpp>
#include <gshard/model/seq2seq.hpp>

using namespace gshard;

// context: swiglu_on_data_model
// README: a block of the user's own, over a mesh with a model axis.
using grid = mesh<axis<"data">, axis<"model">>;
using roles = axis_roles<batch_axes<"data">, expert_axes<>, model_axes<"model">>;
//@fragment
using checked = decltype(std::declval<const swiglu_block<float>&>()(
    std::declval<tape&>().constant(std::declval<const named<float, "BM", grid, at>&>())));

// context: swiglu_whole
// docs/09: the block with its constructor; the fragment declares the mesh itself.
//@fragment
using checked = decltype(std::declval<const swiglu_block<float>&>()(
    std::declval<tape&>().constant(std::declval<const named<float, "BM", grid, at>&>())));

// context: sharded_update
// docs/12: parameters whose replicated weights' update is sharded.
using grid = mesh<axis<"data">, axis<"expert">>;
inline void fragment(const grid& m, const model::config& c) {
//@fragment
}

// context: remat_block
// docs/12: remat around a function of vars, returning a var or a tuple.
using grid = mesh<axis<"data">>;
using act = tensor<float, 2, grid, sharding<split<0, "data">>>;
template <class Block, class MoeBlock>
void fragment(const var<act>& x, const Block& block, const MoeBlock& moe_block) {
//@fragment
}
inline void instantiate(tape& t, const act& a) {
  const auto block = [](const var<act>& in) { return relu(in); };
  const auto moe_block = [](const var<act>& in) { return std::tuple{relu(in), in}; };
  fragment(t.constant(a), block, moe_block);
}

// context: statements
inline void fragment() {
//@fragment
}

// context: with_mesh
template <class M>
int run(const M&) {
  return 0;
}
inline int fragment() {
//@fragment
}

// context: declarations
//@fragment

// context: reshard_plan_describe
inline void fragment(const mesh<axis<"data", 2>, axis<"expert", 4>>& g) {
//@fragment
}

// context: reshard_recorder
using grid = mesh<axis<"data", 2>, axis<"expert", 4>>;
using by_group = sharding<split<1, "data", "expert">>;
using by_expert = sharding<split<0, "expert">, split<1, "data">>;
inline void fragment(const grid& g) {
  const auto x = distribute<by_group>(g, local_tensor<float, 4>(8, 8, 4, 16));
//@fragment
}

// context: gemm_recorder
using grid = mesh<axis<"expert">>;
inline void fragment(const grid& g) {
  const auto x = distribute<sharding<split<0, "expert">>>(g, local_tensor<float, 3>(4, 8, 16));  // [E,B,K]
  const auto w = distribute<sharding<split<0, "expert">>>(g, local_tensor<float, 3>(4, 32, 16)); // [E,N,K]
//@fragment
}

// context: einsum_moe_terms
using grid = mesh<axis<"data">, axis<"expert">>;
using by_group = sharding<split<0, "data", "expert">>;
using by_expert = sharding<split<0, "expert">, split<1, "data">>;
inline void fragment(const grid& g) {
  const auto x = distribute<by_group>(g, local_tensor<float, 3>(8, 4, 16));          // [G,S,M]
  const auto wg = distribute<replicate>(g, local_tensor<float, 2>(16, 8));           // [M,E]
  const auto dispatch = distribute<by_group>(g, local_tensor<float, 4>(8, 4, 8, 2)); // [G,S,E,C]
  const auto gates = distribute<by_group>(g, local_tensor<float, 3>(8, 4, 8));       // [G,S,E]
//@fragment
}

// context: held_projections
// docs/15: attention's projections held in bf16.
using grid = mesh<axis<"data">>;
using tokens = sharding<split<0, "data">>;
template <class H, class W>
auto fragment(const H& h, const W& wq, const W& wk, const W& wv) {
//@fragment
}
using weight = param<tensor<float, 3, grid, replicate, "MNK">>;
using checked = decltype(fragment(std::declval<const var<tensor<float, 3, grid, tokens, "BLM">>&>(),
                                  std::declval<const weight&>(), std::declval<const weight&>(),
                                  std::declval<const weight&>()));

// context: moe_layer_use
inline void fragment(const mesh<axis<"data", 2>, axis<"expert", 4>>& g, index_t G, index_t S, std::uint64_t step) {
//@fragment
}

// context: moe_layer_body
// docs/05: the layer's forward, abridged to top-2 relu experts.
using grid = mesh<axis<"data">, axis<"expert">>;
using at_tokens = roles_on<grid>::at_tokens;
using at_experts = roles_on<grid>::at_experts;
template <class X, class Wg, class Wi, class Wo>
auto forward(const X& x, const Wg& gate, const Wi& wi, const Wo& wo, const moe::gating_config& cfg,
             std::uint64_t stream) {
//@fragment
}
using checked = decltype(forward(std::declval<const var<named<float, "GSM", grid, at_tokens>>&>(),
                                 std::declval<const param<named<float, "ME", grid, at_tokens>>&>(),
                                 std::declval<const param<named<float, "EMH", grid, at_experts>>&>(),
                                 std::declval<const param<named<float, "EHM", grid, at_experts>>&>(),
                                 moe::gating_config{}, 0));

// context: training_step
// docs/06: one step of the trainer's model.
using grid = mesh<axis<"data">, axis<"expert">>;
inline void fragment(parameters<grid>& ps, const model::transformer<float, grid>& model,
                     const model::transformer<float, grid>::tokens_type& tokens, std::uint64_t step,
                     adam& opt) {
//@fragment
}

// context: adafactor
// docs/06: Adafactor over a model's declared parameters.
using grid = mesh<axis<"data">, axis<"expert">>;
inline void fragment(parameters<grid>& ps) {
//@fragment
}

// context: trace_phase
inline void fragment(const gshard::mesh<axis<"x">>& mesh) {
//@fragment
}

// context: training_loop
// docs/09: the loop around a model of the user's own (here a linear regressor).
using grid = mesh<axis<"data">, axis<"model">>;
using at = rules<on<'B', "data">>;
template <class T>
struct regressor {
  param<named<T, "MO", grid, at>> head;
  regressor(parameters<grid>& ps, index_t M, index_t, index_t O) : head(ps, "head", {M, O}, init::normal(0.1)) {}
  template <class X, class Y>
  auto loss(tape& t, const X& x, const Y& y) const {
    auto err = einsum<"BM,MO->BO">(t.constant(x), head) - t.constant(y);
    return all_reduce<"data">(einsum<"BO,BO->">(err, err));
  }
};
inline void fragment(const grid& mesh, index_t M, index_t H, index_t O, int steps, const named<float, "BM", grid, at>& x,
                     const named<float, "BO", grid, at>& y) {
//@fragment
}

// context: rows_product
inline void fragment(const local_tensor<double, 2>& x_global, const local_tensor<double, 2>& w_global) {
//@fragment
}

// context: rows_contraction
using rows = mesh<axis<"rows">>;
inline void fragment(const rows& m, const local_tensor<double, 2>& x_global, const local_tensor<double, 2>& w_global) {
//@fragment
}

// context: moe_layer_deepspeed
// docs/11: the fragment declares the mesh, so the function is a template
// instantiated on it.
template <class Parameters, class X>
void fragment(Parameters& ps, tape& t, const X& x, std::uint64_t step) {
//@fragment
}
using dp_ep = mesh<axis<"dp", 2>, axis<"ep", 4>>;
using dp_ep_tokens = roles_on<dp_ep, axis_roles<batch_axes<"dp", "ep">, expert_axes<"ep">>>::at_tokens;
template void fragment(parameters<dp_ep>&, tape&, const named<float, "GSM", dp_ep, dp_ep_tokens>&, std::uint64_t);

// context: seq2seq_use
// docs/13: training and decoding an encoder–decoder.
using s2s_grid = mesh<axis<"data">, axis<"expert">>;
using s2s_net = model::seq2seq<float, s2s_grid>;
inline void fragment(const s2s_grid& m, const s2s_net::tokens_type& src, const s2s_net::lengths_type& src_lengths,
                     const s2s_net::tokens_type& tgt, int steps) {
//@fragment
}
