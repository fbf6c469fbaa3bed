// Misuse that must not compile. Each case is selected with -DGSHARD_CASE_<name>;
// test/compile_fail.py checks that the compiler stops with the expected text.
#include <gshard/gshard.hpp>
#include <gshard/tensor/einsum_backward.hpp>
#include <gshard/tensor/ops.hpp>

#include <span>
#include <vector>

using namespace gshard;
using grid = mesh<axis<"data", 2>, axis<"expert", 4>>;

#if defined(GSHARD_CASE_axis_not_in_mesh)
constexpr auto n = sizeof(tensor<float, 2, grid, sharding<split<0, "model">>>);
#elif defined(GSHARD_CASE_axis_in_two_dims)
using s = sharding<split<0, "data">, split<1, "data">>;
s* p = nullptr;
#elif defined(GSHARD_CASE_dim_out_of_range)
constexpr auto n = sizeof(tensor<float, 2, grid, sharding<split<2, "data">>>);
#elif defined(GSHARD_CASE_static_not_divisible)
constexpr auto n = sizeof(tensor<float, 2, grid, sharding<split<1, "expert">>, "", 8, 6>);
#elif defined(GSHARD_CASE_dim_split_twice)
sharding<split<0, "data">, split<0, "expert">>* p = nullptr;
#elif defined(GSHARD_CASE_split_and_partial)
sharding<split<0, "data">, partial<"data">>* p = nullptr;
#elif defined(GSHARD_CASE_duplicate_axis_names)
mesh<axis<"data", 2>, axis<"data", 2>>* p = nullptr;
int n = sizeof(*p);
#elif defined(GSHARD_CASE_all_gather_not_minor)
void f(const tensor<float, 1, grid, sharding<split<0, "data", "expert">>>& t) { (void)all_gather<"data">(t); }
#elif defined(GSHARD_CASE_all_reduce_not_partial)
void f(const tensor<float, 1, grid, replicate>& t) { (void)all_reduce<"data">(t); }
#elif defined(GSHARD_CASE_broadcast_split_axis)
void f(const tensor<float, 1, grid, sharding<split<0, "data">>>& t) { (void)broadcast<"data">(t); }
#elif defined(GSHARD_CASE_comma_in_axis_name)
sharding<split<0, "data,expert">>* p = nullptr;
#elif defined(GSHARD_CASE_bad_axis_name)
constexpr auto n = axis<"da ta", 2>::size;
#elif defined(GSHARD_CASE_axis_size_zero)
constexpr auto n = axis<"data", 0>::size;
#elif defined(GSHARD_CASE_mesh_without_axes)
int n = sizeof(mesh<>);
#elif defined(GSHARD_CASE_mesh_too_many_axes)
int n = sizeof(mesh<axis<"a", 1>, axis<"b", 1>, axis<"c", 1>, axis<"d", 1>, axis<"e", 1>, axis<"f", 1>, axis<"g", 1>>);
#elif defined(GSHARD_CASE_group_not_in_mesh)
void f(const grid& g) { (void)g.group<"model">(); }
#elif defined(GSHARD_CASE_with_mesh_empty)
void f() { with_mesh<>(MPI_COMM_WORLD, [](const auto&) {}); }
#elif defined(GSHARD_CASE_with_mesh_dynamic)
void f() { with_mesh<mesh<axis<"data">>>(MPI_COMM_WORLD, [](const auto&) {}); }
#elif defined(GSHARD_CASE_split_name_too_long)
using s = split<0, "an_axis_name_longer_than_23">;
int n = int(s::axes.size());
#elif defined(GSHARD_CASE_partial_name_too_long)
using s = partial<"an_axis_name_longer_than_23">;
int n = int(s::axes.size());
#elif defined(GSHARD_CASE_not_a_part)
sharding<int>* p = nullptr;
#elif defined(GSHARD_CASE_split_dim_negative)
sharding<split<-1, "data">>* p = nullptr;
#elif defined(GSHARD_CASE_axis_named_twice)
sharding<split<0, "data", "data">>* p = nullptr;
#elif defined(GSHARD_CASE_empty_split)
sharding<split<0>>* p = nullptr;
#elif defined(GSHARD_CASE_bad_mesh_split)
sharding<mesh_split<"data,,expert">>* p = nullptr;
#elif defined(GSHARD_CASE_sharding_too_many_axes)
sharding<split<0, "a", "b", "c", "d", "e", "f", "g">>* p = nullptr;
#elif defined(GSHARD_CASE_tensor_not_a_sharding)
constexpr auto n = sizeof(tensor<float, 2, grid, split<0, "data">>);
#elif defined(GSHARD_CASE_tensor_rank)
constexpr auto n = sizeof(tensor<float, 9, grid, replicate>);
#elif defined(GSHARD_CASE_static_extents_count)
constexpr auto n = sizeof(tensor<float, 2, grid, replicate, "", 8>);
#elif defined(GSHARD_CASE_tensor_labels)
constexpr auto n = sizeof(tensor<float, 2, grid, replicate, "GG">);
#elif defined(GSHARD_CASE_relabel_count)
void f(tensor<float, 2, grid, replicate> t) { (void)relabel<"GSM">(std::move(t)); }
#elif defined(GSHARD_CASE_distribute_other_type)
void f(const grid& g, const local_tensor<float, 2>& x) { (void)distribute<tensor<double, 2, grid, replicate>>(g, x); }
#elif defined(GSHARD_CASE_no_mpi_datatype)
void f(const grid& g) { std::vector<short> v(2); all_reduce<short>(g.group<"data">(), std::span<short>(v)); }
#elif defined(GSHARD_CASE_relu_pending)
void f(const tensor<float, 1, grid, sharding<partial<"data">>>& t) { (void)relu(t); }
#elif defined(GSHARD_CASE_plain_unary_pending)
void f(const tensor<float, 1, grid, sharding<partial<"data">>>& t) {
  (void)gelu(t), (void)silu(t), (void)sigmoid(t), (void)exp(t), (void)log(t), (void)tanh(t), (void)sqrt(t);
}
#elif defined(GSHARD_CASE_plain_kinds_differ)
void f(const tensor<float, 2, grid, replicate>& a, const tensor<double, 2, grid, replicate>& b) { (void)(a + b); }
#elif defined(GSHARD_CASE_plain_labels_differ)
void f(const tensor<float, 2, grid, replicate, "BM">& a, const tensor<float, 2, grid, replicate, "BN">& b) { (void)(a - b); }
#elif defined(GSHARD_CASE_plain_shards_differ)
void f(const tensor<float, 2, grid, replicate>& a, const tensor<float, 2, grid, sharding<split<0, "data">>>& b) { (void)(a * b); }
#elif defined(GSHARD_CASE_plain_scalar_pending)
void f(const tensor<float, 1, grid, sharding<partial<"data">>>& t) { (void)(t + 1.0f); }
#elif defined(GSHARD_CASE_plain_product_pending)
void f(const tensor<float, 1, grid, sharding<partial<"data">>>& t) { (void)(t * t); }
#elif defined(GSHARD_CASE_scalar_not_rank0)
void f(const tensor<float, 1, grid, replicate>& t) { (void)scalar(t); }
#elif defined(GSHARD_CASE_reduce_dim)
void f(const tensor<float, 2, grid, replicate>& t) { (void)reduce_max<2>(t); }
#elif defined(GSHARD_CASE_reduce_pending)
void f(const tensor<float, 2, grid, sharding<partial<"data">>>& t) { (void)reduce_sum<0>(t); }
#elif defined(GSHARD_CASE_softmax_pending)
void f(const tensor<float, 1, grid, sharding<partial<"data">>>& t) { (void)softmax(t); }
#elif defined(GSHARD_CASE_softmax_split)
void f(const tensor<float, 1, grid, sharding<split<0, "data">>>& t) { (void)softmax(t); }
#elif defined(GSHARD_CASE_rms_norm_pending)
void f(const tensor<float, 1, grid, sharding<partial<"data">>>& t, const local_tensor<float, 1>& s) { (void)rms_norm(t, s); }
#elif defined(GSHARD_CASE_rms_norm_split)
void f(const tensor<float, 1, grid, sharding<split<0, "data">>>& t, const local_tensor<float, 1>& s) { (void)rms_norm(t, s); }
#elif defined(GSHARD_CASE_all_reduce_axis)
void f(const tensor<float, 1, grid, sharding<partial<"data">>>& t) { (void)all_reduce<"model">(t); }
#elif defined(GSHARD_CASE_all_gather_axis)
void f(const tensor<float, 1, grid, sharding<split<0, "data">>>& t) { (void)all_gather<"model">(t); }
#elif defined(GSHARD_CASE_all_gather_unsplit)
void f(const tensor<float, 1, grid, replicate>& t) { (void)all_gather<"data">(t); }
#elif defined(GSHARD_CASE_reduce_scatter_axis)
void f(const tensor<float, 1, grid, sharding<partial<"data">>>& t) { (void)reduce_scatter<"model", 0>(t); }
#elif defined(GSHARD_CASE_reduce_scatter_not_partial)
void f(const tensor<float, 1, grid, replicate>& t) { (void)reduce_scatter<"data", 0>(t); }
#elif defined(GSHARD_CASE_reduce_scatter_dim)
void f(const tensor<float, 1, grid, sharding<partial<"data">>>& t) { (void)reduce_scatter<"data", 1>(t); }
#elif defined(GSHARD_CASE_all_to_all_axis)
void f(const tensor<float, 2, grid, sharding<split<0, "data">>>& t) { (void)all_to_all<"model", 1>(t); }
#elif defined(GSHARD_CASE_all_to_all_unsplit)
void f(const tensor<float, 2, grid, replicate>& t) { (void)all_to_all<"data", 1>(t); }
#elif defined(GSHARD_CASE_all_to_all_dim)
void f(const tensor<float, 2, grid, sharding<split<0, "data">>>& t) { (void)all_to_all<"data", 0>(t); }
#elif defined(GSHARD_CASE_all_to_all_not_minor)
void f(const tensor<float, 2, grid, sharding<split<0, "data", "expert">>>& t) { (void)all_to_all<"data", 1>(t); }
#elif defined(GSHARD_CASE_broadcast_axis)
void f(const tensor<float, 1, grid, replicate>& t) { (void)broadcast<"model">(t); }
#elif defined(GSHARD_CASE_convert_to_non_number)
void f(const tensor<float, 1, grid, replicate>& t) { (void)convert<bool>(t); }
#elif defined(GSHARD_CASE_relu_backward_shards)
void f(const tensor<float, 1, grid, replicate>& dy, const tensor<float, 1, grid, sharding<split<0, "data">>>& x) {
  (void)relu_backward(dy, x);
}
#elif defined(GSHARD_CASE_softmax_backward_shards)
void f(const tensor<float, 2, grid, replicate>& dy, const tensor<float, 2, grid, sharding<split<0, "data">>>& y) {
  (void)softmax_backward(dy, y), (void)causal_softmax_backward(dy, y, 1.0);
}
#elif defined(GSHARD_CASE_rms_norm_backward_shards)
void f(const tensor<float, 2, grid, replicate>& dy, const tensor<float, 2, grid, sharding<split<0, "data">>>& x,
       const local_tensor<float, 1>& s, float* ds) {
  (void)rms_norm_backward(dy, x, s, ds);
}
#elif defined(GSHARD_CASE_gemm_bf16_output)
void f(const Eigen::bfloat16* a, double* c) { detail::gemm_bf16<double>(false, false, 1, 1, 1, 1.0f, a, 1, a, 1, 0.0f, c, 1); }
#elif defined(GSHARD_CASE_softmax_bf16)
void f(const tensor<bf16, 2, grid, replicate>& t) { (void)softmax(t); }
#elif defined(GSHARD_CASE_rms_norm_bf16)
void f(const tensor<bf16, 2, grid, replicate>& t, const local_tensor<bf16, 1>& s) { (void)rms_norm(t, s); }
#elif defined(GSHARD_CASE_tensor_set_bf16)
void f(tensor_set& s, const tensor<bf16, 1, grid, replicate>& t) { s.add("w", t); }
#else
#error "no GSHARD_CASE_ given"
#endif
