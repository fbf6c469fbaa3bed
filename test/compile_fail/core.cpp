// Misuse that must not compile. Each case is selected with -DGSHARD_CASE_<name>;
// test/compile_fail.py checks that the compiler stops with the expected text.
#include <gshard/gshard.hpp>

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
#else
#error "no GSHARD_CASE_ given"
#endif
