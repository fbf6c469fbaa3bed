// Rules, labels and axis roles misused; one case per -DGSHARD_CASE_<name>.
#include <gshard/runtime/roles.hpp>
#include <gshard/tensor/reshard.hpp>

using namespace gshard;
using grid = mesh<axis<"data", 2>, axis<"model", 2>>;

#if defined(GSHARD_CASE_on_bad_label)
using r = rules<on<'1', "data">>;
r* p = nullptr;
#elif defined(GSHARD_CASE_on_no_axis)
using r = rules<on<'G'>>;
r* p = nullptr;
#elif defined(GSHARD_CASE_label_two_rules)
using r = rules<on<'G', "data">, on<'G', "model">>;
r* p = nullptr;
#elif defined(GSHARD_CASE_rule_axis_twice)
using r = rules<on<'G', "data", "data">>;
r* p = nullptr;
#elif defined(GSHARD_CASE_rule_bad_axis_name)
using r = rules<on<'G', "da ta">>;
r* p = nullptr;
#elif defined(GSHARD_CASE_rule_too_many_axes)
using r = rules<on<'G', "a", "b", "c", "d", "e", "f", "g">>;
r* p = nullptr;
#elif defined(GSHARD_CASE_bad_term)
using r = rules<on<'G', "data">>;
sharding_by<r, "GG">* p = nullptr;
#elif defined(GSHARD_CASE_two_labels_one_axis)
using r = rules<on<'G', "data">, on<'E', "data">>;
sharding_by<r, "GSEC">* p = nullptr;
#elif defined(GSHARD_CASE_reshard_by_rules_unlabelled)
void f(const tensor<float, 2, grid, replicate>& t) { (void)reshard<rules<on<'G', "data">>>(t); }
#elif defined(GSHARD_CASE_axis_without_role)
using named_grid = mesh<axis<"dp", 1>, axis<"ep", 1>, axis<"tp", 1>>;
constexpr auto m = roles_on<named_grid>::batch_mask;
#elif defined(GSHARD_CASE_expert_axis_not_batch)
using roles = axis_roles<batch_axes<"data">, expert_axes<"model">, model_axes<"model">>;
constexpr auto m = roles_on<grid, roles>::batch_mask;
#elif defined(GSHARD_CASE_batch_and_model)
using roles = axis_roles<batch_axes<"data", "model">, expert_axes<>, model_axes<"model">>;
constexpr auto m = roles_on<grid, roles>::batch_mask;
#elif defined(GSHARD_CASE_not_roles)
constexpr auto m = roles_on<grid, int>::batch_mask;
#else
#error "no GSHARD_CASE_ given"
#endif
