// Einsum misuse that must not compile; one case per -DGSHARD_CASE_<name>.
#include <gshard/gshard.hpp>

using namespace gshard;
using grid = mesh<axis<"data", 2>, axis<"model", 2>>;
template <int R, class S>
using t = tensor<float, R, grid, S>;
using rep = replicate;

#if defined(GSHARD_CASE_no_arrow)
void f(const t<2, rep>& a, const t<2, rep>& b) { (void)einsum<"ij,jk">(a, b); }
#elif defined(GSHARD_CASE_output_not_in_input)
void f(const t<2, rep>& a, const t<2, rep>& b) { (void)einsum<"ij,jk->iz">(a, b); }
#elif defined(GSHARD_CASE_repeated_in_operand)
void f(const t<2, rep>& a, const t<2, rep>& b) { (void)einsum<"ii,jk->ik">(a, b); }
#elif defined(GSHARD_CASE_repeated_in_output)
void f(const t<2, rep>& a, const t<2, rep>& b) { (void)einsum<"ij,jk->ii">(a, b); }
#elif defined(GSHARD_CASE_rank_mismatch)
void f(const t<2, rep>& a, const t<3, rep>& b) { (void)einsum<"ij,jk->ik">(a, b); }
#elif defined(GSHARD_CASE_bad_character)
void f(const t<2, rep>& a, const t<2, rep>& b) { (void)einsum<"i j,jk->ik">(a, b); }
#elif defined(GSHARD_CASE_too_many_operands)
void f(const t<2, rep>& a, const t<2, rep>& b) { (void)einsum<"ij,jk,kl->il">(a, b); }
#elif defined(GSHARD_CASE_two_free_labels_on_one_axis)
// Both operands split on different free labels over 'data': no hidden all_gather.
void f(const t<2, sharding<split<0, "data">>>& a, const t<2, sharding<split<1, "data">>>& b) {
  (void)einsum<"ij,jk->ik">(a, b);
}
#elif defined(GSHARD_CASE_both_partial)
void f(const t<2, sharding<partial<"model">>>& a, const t<2, sharding<partial<"model">>>& b) { (void)einsum<"ij,jk->ik">(a, b); }
#elif defined(GSHARD_CASE_partial_and_split)
void f(const t<2, sharding<partial<"model">>>& a, const t<2, sharding<split<1, "model">>>& b) { (void)einsum<"ij,jk->ik">(a, b); }
#elif defined(GSHARD_CASE_lists_disagree)
void f(const t<2, sharding<split<1, "data", "model">>>& a, const t<2, sharding<split<0, "model", "data">>>& b) {
  (void)einsum<"ij,jk->ik">(a, b);
}
#elif defined(GSHARD_CASE_different_types)
void f(const t<2, rep>& a, const tensor<double, 2, grid, rep>& b) { (void)einsum<"ij,jk->ik">(a, b); }
#elif defined(GSHARD_CASE_result_type)
void f(const t<2, rep>& a, const t<2, rep>& b) { (void)einsum<"ij,jk->ik", natural_sharding, double>(a, b); }
#elif defined(GSHARD_CASE_result_type_one_operand)
void f(const tensor<bf16, 2, grid, rep>& a) { (void)einsum<"ij->j", natural_sharding, double>(a); }
#elif defined(GSHARD_CASE_empty_input)
void f(const t<2, rep>& a, const t<2, rep>& b) { (void)einsum<",jk->ik">(a, b); }
#elif defined(GSHARD_CASE_term_too_long)
void f(const t<2, rep>& a, const t<2, rep>& b) { (void)einsum<"abcdefghi,jk->ik">(a, b); }
#elif defined(GSHARD_CASE_operand_count)
void f(const t<2, rep>& a) { (void)einsum<"ij,jk->ik">(a); }
#elif defined(GSHARD_CASE_different_meshes)
using other = mesh<axis<"data", 2>>;
void f(const t<2, rep>& a, const tensor<float, 2, other, rep>& b) { (void)einsum<"ij,jk->ik">(a, b); }
#elif defined(GSHARD_CASE_labels_differ)
using blnk = tensor<float, 4, grid, sharding<split<0, "data">>, "BLNK">;
void f(const blnk& q, const blnk& k) { (void)einsum<"BLNK,BTNK->BNLT">(q, k); }
#else
#error "no GSHARD_CASE_ given"
#endif
