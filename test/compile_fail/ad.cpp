// The autodiff and MoE operations misused; one case per -DGSHARD_CASE_<name>.
#include <gshard/ad/nn.hpp>
#include <gshard/ad/remat.hpp>
#include <gshard/moe/layer.hpp>

using namespace gshard;
using grid = mesh<axis<"data", 2>, axis<"expert", 2>>;
template <int R, class S, fixed_string L = "">
using t = tensor<float, R, grid, S, L>;
using rep = replicate;
using rows = sharding<split<0, "data">>;
using pend = sharding<partial<"data">>;

#if defined(GSHARD_CASE_plain_tensor_with_var)
void f(const var<t<2, rep>>& a, const t<2, rep>& w) { (void)einsum<"ij,jk->ik">(a, w); }
#elif defined(GSHARD_CASE_var_plus_tensor)
void f(const var<t<2, rep>>& a, const t<2, rep>& b) { (void)(a + b), (void)(b - a); }
#elif defined(GSHARD_CASE_var_labels_differ)
void f(const var<t<2, rows, "BM">>& a, const var<t<2, rows>>& b) { (void)(a + b); }
#elif defined(GSHARD_CASE_var_shards_differ)
void f(const var<t<2, rows>>& a, const var<t<2, rep>>& b) { (void)(a * b); }
#elif defined(GSHARD_CASE_var_scalar_pending)
void f(const var<t<1, pend>>& a) { (void)(a + 1.0); }
#elif defined(GSHARD_CASE_positions_tokens)
void f(const t<2, rows>& x) { (void)positions_of(x); }
#elif defined(GSHARD_CASE_chunk_dim)
void f(const var<t<2, rows>>& a) { (void)chunk<2>(a, 2); }
#elif defined(GSHARD_CASE_chunk_split)
void f(const var<t<2, rows>>& a) { (void)chunk<0>(a, 2); }
#elif defined(GSHARD_CASE_concat_dim)
void f(const std::vector<var<t<2, rows>>>& a) { (void)concat<-1>(a); }
#elif defined(GSHARD_CASE_concat_split)
void f(const std::vector<var<t<2, rows>>>& a) { (void)concat<0>(a); }
#elif defined(GSHARD_CASE_cut_blocks_dim)
void f(const t<2, rows>& a) { (void)cut_blocks<2>(a, 1); }
#elif defined(GSHARD_CASE_halve_blocks_dim)
void f(const t<2, rows>& a) { (void)halve_blocks<3>(a); }
#elif defined(GSHARD_CASE_join_blocks_dim)
void f(const var<t<2, rows>>& a) { (void)join_blocks<-1>(a, a); }
#elif defined(GSHARD_CASE_params_alone)
void f(const param<t<2, rep>>& a, const param<t<2, rep>>& b) { (void)einsum<"ij,jk->ik">(a, b); }
#elif defined(GSHARD_CASE_product_pending)
void f(const var<t<1, pend>>& a) { (void)(a * a); }
#elif defined(GSHARD_CASE_unary_pending)
void f(const var<t<1, pend>>& a) {
  (void)relu(a), (void)gelu(a), (void)silu(a), (void)sigmoid(a), (void)exp(a), (void)log(a), (void)tanh(a), (void)sqrt(a);
}
#elif defined(GSHARD_CASE_mask_rank)
void f(const var<t<1, rep>>& a) { (void)causal_mask(a), (void)causal_softmax(a); }
#elif defined(GSHARD_CASE_mask_split)
void f(const var<t<2, sharding<split<1, "data">>>>& a) { (void)causal_mask(a), (void)causal_softmax(a); }
#elif defined(GSHARD_CASE_mask_pending)
void f(const var<t<2, pend>>& a) { (void)causal_mask(a), (void)causal_softmax(a); }
#elif defined(GSHARD_CASE_attention_rank)  // the tape's form and the plain tensors'
void f(const var<t<3, rep>>& a) { (void)causal_attention(a, a, a, 1.0), (void)causal_attention(a.value(), a.value(), a.value(), 1.0); }
#elif defined(GSHARD_CASE_attention_type)
void f(const var<t<4, rep>>& q, const var<tensor<double, 4, grid, rep>>& k) { (void)causal_attention(q, k, k, 1.0); }
#elif defined(GSHARD_CASE_attention_shards)
void f(const var<t<4, rows>>& q, const var<t<4, rep>>& k) { (void)causal_attention(q, k, k, 1.0); }
#elif defined(GSHARD_CASE_attention_pending)
void f(const var<t<4, pend>>& q) { (void)causal_attention(q, q, q, 1.0); }
#elif defined(GSHARD_CASE_attention_split)
void f(const t<4, sharding<split<3, "data">>>& q) { (void)causal_attention(q, q, q, 1.0); }
#elif defined(GSHARD_CASE_attention_labels)  // k and v differ
void f(const var<t<4, rows, "BLNK">>& q, const var<t<4, rows, "BTNK">>& k, const var<t<4, rows, "BSNK">>& v) {
  (void)causal_attention(q, k, v, 1.0);
}
#elif defined(GSHARD_CASE_attention_labels_partial)  // q and k differ, v unlabelled
void f(const var<t<4, rows, "BLNK">>& q, const var<t<4, rows, "XTNK">>& k, const var<t<4, rows>>& v) {
  (void)causal_attention(q, k, v, 1.0);
}
#elif defined(GSHARD_CASE_attention_plain_tensor)
void f(const var<t<4, rows>>& q, const t<4, rows>& k) {
  (void)causal_attention(q, k, k, 1.0), (void)dot_product_attention(q, k, k, 1.0);
}
#elif defined(GSHARD_CASE_norm_scale)
void f(const var<t<2, rows>>& x, const var<t<1, sharding<split<0, "expert">>>>& s) { (void)rms_norm(x, s); }
#elif defined(GSHARD_CASE_param_other_mesh)
using other = mesh<axis<"data", 2>>;
void f(parameters<other>& ps) { param<t<1, rep>> p(ps, "p", {2}, init::zeros()); }
#elif defined(GSHARD_CASE_param_pending)
void f(parameters<grid>& ps) { param<t<1, pend>> p(ps, "p", {2}, init::zeros()); }
#elif defined(GSHARD_CASE_update_axes_kind)
void f(const grid& m) { parameters<grid> ps(m, 1, shard_weight_update<expert_axes<"expert">>{}); }
#elif defined(GSHARD_CASE_update_axes_none)
void f(const grid& m) { parameters<grid> ps(m, 1, shard_weight_update<batch_axes<"dp", "ep">>{}); }
#elif defined(GSHARD_CASE_backward_not_scalar)
void f(tape& tp, const var<t<1, rep>>& l) { tp.backward(l); }
#elif defined(GSHARD_CASE_remat_no_input)
void f() { (void)remat([] { return 0; }); }
#elif defined(GSHARD_CASE_remat_output)
void f(const var<t<1, rep>>& x) { (void)remat([](const auto&) { return 1.0; }, x); }
#elif defined(GSHARD_CASE_embedding_tokens)
void f(tape& tp, const t<2, rows>& tok, const param<t<2, rep>>& table) { (void)embedding(tp, tok, table); }
#elif defined(GSHARD_CASE_embedding_tokens_pending)
void f(tape& tp, const tensor<std::int32_t, 2, grid, pend>& tok, const param<t<2, rep>>& table) { (void)embedding(tp, tok, table); }
#elif defined(GSHARD_CASE_embedding_table)
void f(tape& tp, const tensor<std::int32_t, 2, grid, rows>& tok, const param<t<2, rows>>& table) { (void)embedding(tp, tok, table); }
#elif defined(GSHARD_CASE_ce_class_split)
void f(const var<t<2, sharding<split<1, "data">>>>& lg, const tensor<std::int32_t, 1, grid, rep>& y) { (void)cross_entropy(lg, y); }
#elif defined(GSHARD_CASE_ce_pending)
void f(const var<t<2, pend>>& lg, const tensor<std::int32_t, 1, grid, rep>& y) { (void)cross_entropy(lg, y); }
#elif defined(GSHARD_CASE_ce_targets_type)
void f(const var<t<2, rows>>& lg, const tensor<float, 1, grid, rows>& y) { (void)cross_entropy(lg, y); }
#elif defined(GSHARD_CASE_ce_targets_sharding)
void f(const var<t<2, rows>>& lg, const tensor<std::int32_t, 1, grid, rep>& y) { (void)cross_entropy(lg, y); }
#elif defined(GSHARD_CASE_attention_key_lengths)
void f(const var<t<4, rows>>& q, const t<1, rep>& len) { (void)dot_product_attention(q, q, q, len, 1.0); }
#elif defined(GSHARD_CASE_mask_padding_shards)
void f(const var<t<3, rows>>& x, const t<2, rep>& p) { (void)mask_padding(x, p); }
#elif defined(GSHARD_CASE_gate_paddings)
void f(const var<t<3, rows>>& lg, const t<2, rep>& p) { (void)moe::gate(lg, p, moe::gating_config{}, 0); }
#elif defined(GSHARD_CASE_gate_logits)
void f(const var<t<3, sharding<split<2, "expert">>>>& lg) { (void)moe::gate(lg, {}, 0); }
#elif defined(GSHARD_CASE_dispatch_tokens)
void f(const moe::gate_output<t<3, rows>>& g, const var<t<3, sharding<split<2, "expert">>>>& x) { (void)moe::dispatch(g, x); }
#elif defined(GSHARD_CASE_combine_outputs)
void f(const moe::gate_output<t<3, rows>>& g, const var<t<4, sharding<split<0, "expert">>>>& y) { (void)moe::combine(g, y); }
#elif defined(GSHARD_CASE_gating_type)
void f(const std::int32_t* l, moe::routing<std::int32_t>& r) { (void)moe::choose_experts<std::int32_t>(l, 1, 1, 1, 0, 0, {}, nullptr, r); }
#elif defined(GSHARD_CASE_layer_input)
void f(const moe::layer<float, grid>& l, const var<t<3, rows>>& x) { (void)l(x, {}, 0); }
#elif defined(GSHARD_CASE_var_bf16)
void f(const var<tensor<bf16, 2, grid, rep>>& a) { (void)a.value(); }
#else
#error "no GSHARD_CASE_ given"
#endif
