// Einsum: many specs times every sharding of each operand over the meshes
// that fit the world — (P), and (2,2) at 4 ranks, (2,4) at 8 — in double,
// float and bf16, against plain loops on the global tensors (bf16 within the
// bound its fp32 sums rounded once give). Legal combinations must
// produce the natural output with no communication at all; asking for a
// replicated output must run exactly the planned collectives; a pending sum
// asked into a split output must be one reduce_scatter. The typed API is
// checked to run the same plans.
#include <gshard/gshard.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "layouts.hpp"
#include "testing.hpp"

using namespace gshard;
using detail::rlayout;
using gshard::testing::all_layouts;
using gshard::testing::random_tensor;
using gshard::testing::shard_of;
using gshard::testing::world_rank;
using gshard::testing::world_size;

namespace {

using dyn1 = mesh<axis<"x">>;
using dyn2 = mesh<axis<"x">, axis<"y">>;

// The global reference with plain loops over every label, in double.
template <class T, int RA, int RB, int RO>
local_tensor<double, RO> reference(const detail::einsum_spec& s, const local_tensor<T, RA>& a,
                                   const local_tensor<T, RB>* b, const index_t* ext) {
  std::string labels;
  for (int op = 0; op < s.nin; ++op)
    for (char l : s.term(op))
      if (labels.find(l) == std::string::npos) labels += l;
  shape<RO> oe{};
  for (int d = 0; d < RO; ++d) oe[std::size_t(d)] = ext[int(s.out[d])];
  local_tensor<double, RO> out(oe);
  out.setZero();
  for (char l : labels)
    if (ext[int(l)] == 0) return out;
  std::array<index_t, 128> idx{};
  auto offset = [&](std::string_view term, auto& dims) {
    index_t o = 0;
    for (std::size_t d = 0; d < term.size(); ++d) o = o * dims[d] + idx[std::size_t(term[d])];
    return o;
  };
  const auto da = a.dimensions();
  while (true) {
    double v = double(a.data()[offset(s.term(0), da)]);
    if (s.nin == 2) v *= double(b->data()[offset(s.term(1), b->dimensions())]);
    out.data()[offset(s.out_term(), oe)] += v;
    int k = int(labels.size()) - 1;
    while (k >= 0 && ++idx[std::size_t(labels[std::size_t(k)])] == ext[int(labels[std::size_t(k)])])
      idx[std::size_t(labels[std::size_t(k--)])] = 0;
    if (k < 0) break;
  }
  return out;
}

template <class T>
double widen(T x) {
  if constexpr (std::is_same_v<T, bf16>) return double(float(x));
  else return double(x);
}

// The local shard `got` (layout l; pending sums are summed here in double
// with raw, uncounted MPI) equals its slice of `ref` within tol·(1 + |ref|),
// or, given `mags` (the reference on the inputs' magnitudes), within
// tol·mags.
template <class T, int R>
bool matches(const local_tensor<T, R>& got_t, const rlayout& l, const local_tensor<double, R>& ref,
             const detail::mesh_base& m, double tol, std::string& why, const local_tensor<double, R>* mags = nullptr) {
  const shape<R> ge = detail::dims_of<R>(ref);
  const shape<R> le = detail::local_extents<R>(l, ge, m), off = detail::global_offsets<R>(l, ge, m), zero{};
  if (detail::dims_of<R>(got_t) != le) {
    why = "local extents differ";
    return false;
  }
  local_tensor<double, R> got(le);
  for (index_t i = 0; i < got.size(); ++i) got.data()[i] = widen(got_t.data()[i]);
  if (l.partial) MPI_Allreduce(MPI_IN_PLACE, got.data(), int(got.size()), MPI_DOUBLE, MPI_SUM, m.group(l.partial).comm);
  local_tensor<double, R> want(le), bound(le);
  if (want.size() > 0) {
    detail::copy_box(ref.data(), ge.data(), off.data(), want.data(), le.data(), zero.data(), le.data(), R);
    if (mags) detail::copy_box(mags->data(), ge.data(), off.data(), bound.data(), le.data(), zero.data(), le.data(), R);
  }
  for (index_t i = 0; i < want.size(); ++i) {
    const double allowed = tol * (mags ? bound.data()[i] : 1.0 + std::abs(want.data()[i]));
    if (!(std::abs(got.data()[i] - want.data()[i]) <= allowed)) {
      why = "element " + std::to_string(i) + ": " + std::to_string(got.data()[i]) + " vs " + std::to_string(want.data()[i]);
      return false;
    }
  }
  return true;
}

std::string show(const rlayout& l, const detail::mesh_base& m, std::string_view labels) {
  std::string s = "[";
  for (std::size_t d = 0; d < labels.size(); ++d) {
    if (d) s += ',';
    s += labels[d];
    if (l.dims[d].n) {
      s += '{';
      for (int i = 0; i < l.dims[d].n; ++i) {
        if (i) s += ',';
        s += m.axis_name(l.dims[d].ax[i]);
      }
      s += '}';
    }
  }
  s += ']';
  if (l.partial) s += " partial{" + m.label(l.partial) + "}";
  return s;
}

struct tally {
  int legal = 0, illegal = 0, requested = 0, reduce_scatters = 0;
  std::string first_failure;
  void fail(const std::string& s) {
    if (first_failure.empty()) first_failure = s;
  }
};

std::vector<collective_event> planned(const detail::reshard_steps& p, const detail::mesh_base& m, const index_t* global,
                                      int rank, std::size_t elem) {
  return gshard::testing::planned_collectives(p, m, global, rank, elem);
}

// Every pair of operand layouts for one spec on one mesh.
template <fixed_string Spec, class T>
void all_shardings(const detail::mesh_base& m, tally& t, bool requested_outputs, index_t zero_label = 0, bool uneven = false) {
  static constexpr detail::einsum_spec s = detail::parse_einsum(Spec.view());
  static_assert(s.problem == detail::spec_problem::none);
  constexpr int RA = s.in_rank[0], RB = s.nin == 2 ? s.in_rank[1] : 0, RO = s.out_rank;
  const index_t W = m.nranks();
  // Label extents: multiples of the mesh size, so every split divides; or
  // (uneven) none of them: one past a multiple, one short, and 1 (shards
  // left empty).
  index_t ext[128] = {};
  int k = 0;
  for (int op = 0; op < s.nin; ++op)
    for (char l : s.term(op))
      if (!ext[int(l)]) {
        const int i = k++;
        ext[int(l)] = !uneven ? W * (1 + (i % 2)) : i % 3 == 0 ? W + 1 : i % 3 == 1 ? 2 * W - 1 : 1;
      }
  if (zero_label) ext[zero_label] = 0;
  shape<RA> ga{};
  shape<RB> gb{};
  for (int d = 0; d < RA; ++d) ga[std::size_t(d)] = ext[int(s.in[0][d])];
  for (int d = 0; d < RB; ++d) gb[std::size_t(d)] = ext[int(s.in[1][d])];
  const auto A = random_tensor<RA, T>(ga, 11);
  const auto B = random_tensor<RB, T>(gb, 12);
  const auto ref = reference<T, RA, RB, RO>(s, A, s.nin == 2 ? &B : nullptr, ext);
  index_t contraction = 1;
  for (int op = 0; op < s.nin; ++op)
    for (char l : s.term(op))
      if (s.find_out(l) < 0) contraction *= std::max<index_t>(ext[int(l)], 1);
  double tol = (std::is_same_v<T, float> ? 1e-5 : 1e-12) * double(contraction) * 4;
  // bf16: every sum is taken in fp32 and rounded once; an einsum's result
  // passes through one rounding for each operand's sum over labels it holds
  // alone, one for the local result and one for each summing collective of
  // its plan, each within 2^-8 of a value no larger than the sum of the
  // products' magnitudes — the reference on |A| and |B| — plus fp32's
  // accumulation, 2^-24 for each of the contraction's terms.
  const bool by_magnitude = std::is_same_v<T, bf16>;
  auto magnitude = [](auto x) {
    for (index_t i = 0; i < x.size(); ++i) x.data()[i] = x.data()[i] < T(0) ? -x.data()[i] : x.data()[i];
    return x;
  };
  const auto A_mag = magnitude(A);
  const auto B_mag = magnitude(B);
  const auto mags = by_magnitude ? reference<T, RA, RB, RO>(s, A_mag, s.nin == 2 ? &B_mag : nullptr, ext) : ref;
  int alone = 0;  // operands with a label neither the other operand nor the output has
  for (int op = 0; op < s.nin; ++op) {
    bool has = false;
    for (char l : s.term(op)) has = has || (s.find_out(l) < 0 && (s.nin == 1 || s.term(1 - op).find(l) == std::string_view::npos));
    alone += has;
  }
  // The tolerance for a plan whose finish runs `sums` summing collectives.
  auto tol_for = [&](const detail::reshard_steps& finish) {
    if (!by_magnitude) return tol;
    int sums = 0;
    for (int i = 0; i < finish.n; ++i)
      sums += finish.step[i].kind == step_kind::all_reduce || finish.step[i].kind == step_kind::reduce_scatter;
    return (alone + 1 + sums) * std::ldexp(1.0, -8) + double(contraction) * std::ldexp(1.0, -24);
  };
  const local_tensor<double, RO>* const all_bound = by_magnitude ? &mags : nullptr;

  const auto layouts_a = all_layouts(RA, m.naxes());
  const auto layouts_b = s.nin == 2 ? all_layouts(RB, m.naxes()) : std::vector<rlayout>{rlayout{}};
  for (const rlayout& la : layouts_a)
    for (const rlayout& lb : layouts_b) {
      const rlayout in[2] = {la, lb};
      const detail::einsum_program p = detail::plan_einsum_program(s, in, nullptr, m);
      const local_tensor<double, RO>* bound = all_bound;
      if (p.sharding.problem != detail::einsum_problem::none) {
        ++t.illegal;
        continue;
      }
      ++t.legal;
      std::string what = std::string(Spec.view()) + " " + show(la, m, s.term(0));
      if (s.nin == 2) what += ", " + show(lb, m, s.term(1));
      what += " on " + m.describe();
      const auto a = shard_of<RA, T>(A, la, m);
      const auto b = shard_of<RB, T>(B, lb, m);
      // A partial bf16 operand's parts are rounded one by one, so they sum to
      // another tensor than A (or B): the reference is then taken on their
      // sum, and the bound on the sum of their magnitudes (exact in double).
      const local_tensor<double, RO>* want = &ref;
      local_tensor<double, RO> part_ref, part_mags;
      if constexpr (std::is_same_v<T, bf16>) {
        if (la.partial || (s.nin == 2 && lb.partial)) {
          auto global_of = [&](const auto& shard, const rlayout& l, const auto& ge, bool magnitudes) {
            constexpr int R = std::remove_cvref_t<decltype(ge)>().size();
            local_tensor<double, R> x(detail::dims_of<R>(shard));
            for (index_t i = 0; i < x.size(); ++i) x.data()[i] = magnitudes ? std::abs(widen(shard.data()[i])) : widen(shard.data()[i]);
            return detail::execute_reshard<double, R>(m, detail::plan_reshard(l, rlayout{}, m.naxes(), m.sizes()), x, ge);
          };
          const auto ae = global_of(a, la, ga, false), am = global_of(a, la, ga, true);
          const auto be = s.nin == 2 ? global_of(b, lb, gb, false) : local_tensor<double, RB>();
          const auto bm = s.nin == 2 ? global_of(b, lb, gb, true) : local_tensor<double, RB>();
          part_ref = reference<double, RA, RB, RO>(s, ae, s.nin == 2 ? &be : nullptr, ext);
          part_mags = reference<double, RA, RB, RO>(s, am, s.nin == 2 ? &bm : nullptr, ext);
          want = &part_ref;
          bound = &part_mags;
        }
      }
      shape<RO> go{};
      std::string why;
      {
        collective_recorder rec;
        const auto out = detail::execute_einsum<T, RA, RB, RO>(m, p, a, ga, &b, gb, go);
        if (!rec.events().empty()) t.fail(what + ": the natural output communicated");
        if (!matches<T, RO>(out, p.sharding.out, *want, m, tol_for(p.finish), why, bound)) t.fail(what + ": wrong natural output: " + why);
      }
      if (!requested_outputs) continue;
      // Requested: replicated.
      {
        const rlayout rep{};
        const detail::einsum_program p2 = detail::plan_einsum_program(s, in, &rep, m);
        collective_recorder rec;
        const auto out = detail::execute_einsum<T, RA, RB, RO>(m, p2, a, ga, &b, gb, go);
        ++t.requested;
        if (rec.events() != planned(p2.finish, m, go.data(), RO, sizeof(T)))
          t.fail(what + ": replicated output ran other collectives than planned");
        if (!matches<T, RO>(out, rep, *want, m, tol_for(p2.finish), why, bound)) t.fail(what + ": wrong replicated output: " + why);
      }
      // Requested: a pending sum split over an output dim -> one reduce_scatter, no all_reduce.
      for (int x = 0; x < m.naxes(); ++x) {
        if (!p.sharding.out.is_partial(x)) continue;
        for (int d = 0; d < RO; ++d) {
          rlayout target = p.sharding.out;
          target.partial &= ~(1u << x);
          target.push(d, x);
          const detail::einsum_program p3 = detail::plan_einsum_program(s, in, &target, m);
          collective_recorder rec;
          const auto out = detail::execute_einsum<T, RA, RB, RO>(m, p3, a, ga, &b, gb, go);
          ++t.reduce_scatters;
          const auto ev = rec.events();
          if (ev.size() != 1 || ev[0].kind != collective::reduce_scatter)
            t.fail(what + ": a pending sum into a split output was not one reduce_scatter");
          if (!matches<T, RO>(out, target, *want, m, tol_for(p3.finish), why, bound)) t.fail(what + ": wrong reduce_scatter output: " + why);
          break;
        }
      }
    }
}

template <fixed_string... Specs>
void run_specs(const char* group, bool uneven = false) {
  const auto meshes = gshard::testing::meshes_for_world(false, false);
  std::size_t ran = 0;
  for (const auto& mc : meshes) {
    tally td, tf, tb;
    (all_shardings<Specs, double>(*mc.mesh, td, true, 0, uneven), ...);
    (all_shardings<Specs, float>(*mc.mesh, tf, false, 0, uneven), ...);
    (all_shardings<Specs, bf16>(*mc.mesh, tb, true, 0, uneven), ...);
    INFO(group << " on mesh " << mc.name << ": " << td.legal << " legal and " << td.illegal << " rejected sharding pairs, "
               << td.requested << " replicated and " << td.reduce_scatters << " reduce_scatter outputs");
    GSHARD_REQUIRE_MSG(td.first_failure.empty(), td.first_failure);
    GSHARD_REQUIRE_MSG(tf.first_failure.empty(), tf.first_failure);
    GSHARD_REQUIRE_MSG(tb.first_failure.empty(), tb.first_failure);
    GSHARD_REQUIRE(td.legal > 0 && td.legal == tf.legal && td.legal == tb.legal && td.requested == td.legal);
    GSHARD_REQUIRE(tb.requested == td.requested && tb.reduce_scatters == td.reduce_scatters);
    ++ran;
  }
  GSHARD_REQUIRE(ran == (world_size() == 4 || world_size() == 6 || world_size() == 8 ? 2u : 1u));
}

}  // namespace

TEST_CASE("einsum: matmuls, transposes, reductions, outer products, every sharding", "[einsum][exhaustive]") {
  run_specs<"ij,jk->ik", "bij,bjk->bik", "ij->ji", "ijk->ki", "ij->i", "i,j->ij", "ij,ij->ij", "ij,j->i", "ab,cb->ac",
            "ab,cd->ad", "abc->">("basic specs");
}

TEST_CASE("einsum: the MoE einsums, every sharding", "[einsum][exhaustive][moe]") {
  run_specs<"GSM,ME->GSE", "GSEC,GSM->EGCM", "EGCM,EMH->EGCH", "EGCH,EHM->EGCM", "GSEC,EGCM->GSM", "GSE->GE">("MoE specs");
}

TEST_CASE("einsum: the attention and dense FFN einsums, every sharding", "[einsum][exhaustive][attention]") {
  run_specs<"BLM,MNK->BLNK", "BLNK,BTNK->BNLT", "BNLT,BTNK->BLNK", "BLNK,NKM->BLM", "BLM,MH->BLH", "BLH,HM->BLM">(
      "attention specs");
}

TEST_CASE("einsum: label extents that do not divide, every sharding", "[einsum][exhaustive][uneven]") {
  run_specs<"ij,jk->ik", "bij,bjk->bik", "ij->ji", "ij->i", "ij,j->i", "ab,cd->ad", "GSM,ME->GSE", "GSEC,GSM->EGCM",
            "EGCM,EMH->EGCH", "BLNK,BTNK->BNLT", "BNLT,BTNK->BLNK">("uneven specs", true);
}

TEST_CASE("einsum: zero-size labels give zeros or empty results", "[einsum]") {
  const auto meshes = gshard::testing::meshes_for_world(false, false);
  tally t;
  all_shardings<"ij,jk->ik", double>(*meshes[0].mesh, t, true, 'j');  // contraction over nothing: zeros
  all_shardings<"ij,jk->ik", double>(*meshes[0].mesh, t, true, 'i');  // an empty output
  all_shardings<"bij,bjk->bik", float>(*meshes[0].mesh, t, false, 'b');
  all_shardings<"ab,ba->", double>(*meshes[0].mesh, t, true, 'a');  // an empty label that breaks a GEMM merge
  GSHARD_REQUIRE_MSG(t.first_failure.empty(), t.first_failure);
  GSHARD_REQUIRE(t.legal > 0);
}

// ---------------------------------------------------------------------------
// The typed API runs the compile-time plans.

TEST_CASE("typed einsum: GShard's dispatch is one local einsum plus one all_to_all", "[einsum][moe]") {
  using grid = mesh<axis<"data">, axis<"expert">>;
  using by_group = sharding<split<0, "data", "expert">>;  // GSEC and GSM: G over every rank
  using by_expert = sharding<split<0, "expert">, split<1, "data">>;
  using plan = einsum_plan<"GSEC,GSM->EGCM", grid, by_group, by_group, by_expert>;
  static_assert(std::is_same_v<plan::natural, sharding<split<1, "data", "expert">>>);
  static_assert(plan::slice_a::steps.n == 0 && plan::slice_b::steps.n == 0);
  static_assert(plan::finish::steps.n == 1 && plan::finish::steps.step[0].kind == step_kind::all_to_all);

  const int P = world_size();
  const index_t D = P == 4 || P == 8 ? 2 : 1;
  grid m(MPI_COMM_WORLD, {D, P / D});
  const index_t G = 2 * P, S = 6, E = 2 * (P / D), C = 3, M = 5;
  const auto disp = random_tensor<4, float>({G, S, E, C}, 1);
  const auto x = random_tensor<3, float>({G, S, M}, 2);
  const auto d = distribute<by_group>(m, disp);
  const auto xs = distribute<by_group>(m, x);
  collective_recorder rec;
  const auto xe = einsum<"GSEC,GSM->EGCM", by_expert>(d, xs);
  static_assert(std::is_same_v<decltype(xe)::sharding_type, by_expert>);
  const auto ev = rec.events();
  GSHARD_REQUIRE(ev.size() == 1 && ev[0].kind == collective::all_to_all && ev[0].axes == "expert");
  index_t ext[128] = {};
  ext['G'] = G, ext['S'] = S, ext['E'] = E, ext['C'] = C, ext['M'] = M;
  const auto ref = reference<float, 4, 3, 4>(plan::spec, disp, &x, ext);
  std::string why;
  GSHARD_REQUIRE_MSG((matches<float, 4>(xe.local(), decltype(xe)::resolved, ref, m, 1e-5 * S, why)), why);

  // The plan prints the local step with its FLOPs and the collective with its bytes.
  const std::string text = plan_of<"GSEC,GSM->EGCM", by_expert>(d, xs);
  const index_t local_flops = 2 * (G / P) * S * E * C * M;
  GSHARD_REQUIRE(text.find("1. local einsum GSEC,GSM->EGCM -> f32[E,G{data,expert},C,M]   " + std::to_string(local_flops) +
                           " FLOP/rank") != std::string::npos);
  GSHARD_REQUIRE(text.find("2. all_to_all over expert: G -> E   f32[E{expert},G{data},C,M]   " +
                           std::to_string(E * (G / P) * C * M * 4) + " B/rank") != std::string::npos);
}

TEST_CASE("model FLOPs: each einsum's global FLOPs once, however it is split or repeated", "[einsum]") {
  using grid = mesh<axis<"x">, axis<"y">>;
  const int P = world_size();
  const index_t X = P == 4 || P == 8 ? 2 : 1;
  const grid m(MPI_COMM_WORLD, {X, P / X});
  const index_t B = 4 * P, K = 12, N = 10;  // K splits over y (1 to 4 ranks) and x
  const auto a = random_tensor<2, double>({B, K}, 1);
  const auto w = random_tensor<2, double>({K, N}, 2);
  // The job's count: this rank's difference, summed over the ranks.
  auto job_flops = [&](const auto& run) {
    const double before = model_flops();
    run();
    return all_reduce(m.all_axes(), model_flops() - before, reduction::sum);
  };
  const double product = 2.0 * double(B * K * N);
  // Rows split over every rank; K split (a pending sum, then its all_reduce);
  // everything replicated (each rank repeats the whole product); one operand.
  const double split_rows = job_flops([&] {
    (void)einsum<"BK,KN->BN">(distribute<sharding<split<0, "x", "y">>>(m, a), distribute<replicate>(m, w));
  });
  const double split_k = job_flops([&] {
    (void)all_reduce<"y">(einsum<"BK,KN->BN">(distribute<sharding<split<1, "y">>>(m, a), distribute<sharding<split<0, "y">>>(m, w)));
  });
  const double repeated = job_flops([&] { (void)einsum<"BK,KN->BN">(distribute<replicate>(m, a), distribute<replicate>(m, w)); });
  const double sum = job_flops([&] { (void)einsum<"BK->B">(distribute<sharding<split<1, "x">>>(m, a)); });
  GSHARD_REQUIRE(std::abs(split_rows - product) < 1e-6 * product);
  GSHARD_REQUIRE(std::abs(split_k - product) < 1e-6 * product);
  GSHARD_REQUIRE(std::abs(repeated - product) < 1e-6 * product);
  GSHARD_REQUIRE(std::abs(sum - double(B * K)) < 1e-6 * double(B * K));
}

TEST_CASE("gemm_recorder: the local GEMMs an einsum runs, in order, with their shapes", "[einsum]") {
  using grid = mesh<axis<"x">>;
  const grid m(MPI_COMM_WORLD);
  const index_t P = m.nranks(), B = 4 * P, K = 12, N = 10, E = 3;
  const auto a = distribute<sharding<split<0, "x">>>(m, random_tensor<2, double>({B, K}, 1));
  const auto w = distribute<replicate>(m, random_tensor<2, double>({K, N}, 2));
  const auto xe = distribute<sharding<split<1, "x">>>(m, random_tensor<3, double>({E, B, K}, 3));
  const auto we = distribute<replicate>(m, random_tensor<3, double>({E, N, K}, 4));
  (void)einsum<"BK,KN->BN">(a, w);  // before the recorder: not listed
  gemm_recorder rec;
  (void)einsum<"BK,KN->BN">(a, w);
  {
    const auto calls = rec.calls();
    GSHARD_REQUIRE(calls.size() == 1);
    const gemm_call& c = calls[0];
    GSHARD_REQUIRE(c.element_bytes == 8 && !c.trans_a && !c.trans_b && !c.accumulate);
    GSHARD_REQUIRE(c.m == B / P && c.n == N && c.k == K && c.lda == K && c.ldb == N && c.ldc == N);
    GSHARD_REQUIRE(rec.flops() == 2.0 * double(B / P * N * K));
  }
  // One GEMM per expert, the weight transposed (EKN stored as E,N,K).
  (void)einsum<"EBK,ENK->EBN">(xe, we);
  const auto calls = rec.calls();
  GSHARD_REQUIRE(calls.size() == std::size_t(1 + E));
  for (std::size_t i = 1; i < calls.size(); ++i)
    GSHARD_REQUIRE(!calls[i].trans_a && calls[i].trans_b && calls[i].m == B / P && calls[i].n == N && calls[i].k == K &&
                   calls[i].ldb == K);
  gemm_recorder inner;  // a second recorder sees only what runs in its lifetime
  GSHARD_REQUIRE(inner.calls().empty() && rec.calls().size() == calls.size());
}

namespace {
// Whether /proc/cpuinfo lists `flag` (false where there is no such file).
bool cpu_has(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("flags", 0) == 0) return (line + " ").find(" " + flag + " ") != std::string::npos;
  return false;
}
}  // namespace

TEST_CASE("bf16 local einsums sum in fp32 and round once, under every GEMM backend", "[einsum][bf16]") {
  // 256 + 256 ones: 512 in fp32. Summed in bf16 it stays 256 (8 significant
  // bits: 257 rounds to 256 at every step).
  using detail::local_einsum;
  using detail::parse_einsum;
  const int chosen = detail::options().gemm;
  std::vector<bf16> x(257, bf16(1.0f)), ones(257, bf16(1.0f)), out(4);
  x[0] = bf16(256.0f);
  const index_t n[1] = {257}, none[1] = {1};
  for (const detail::gemm_kind kind : detail::gemm_kinds()) {
    detail::options().gemm = int(kind);
    static constexpr detail::einsum_spec sum = parse_einsum("i->"), dot = parse_einsum("i,i->"),
                                         matvec = parse_einsum("ji,i->j");
    local_einsum(sum, x.data(), n, static_cast<const bf16*>(nullptr), none, out.data(), none);
    GSHARD_CHECK(float(out[0]) == 512.0f);
    local_einsum(dot, x.data(), n, ones.data(), n, out.data(), none);
    GSHARD_CHECK(float(out[0]) == 512.0f);
    const index_t rows_cols[2] = {1, 257}, rows[1] = {1};
    local_einsum(matvec, x.data(), rows_cols, ones.data(), n, out.data(), rows);
    GSHARD_CHECK(float(out[0]) == 512.0f);
    // j cannot merge with k in A [j,i,k] (I = 2): one GEMM per j, summed
    // in an fp32 C — 256 + 513 ones is 769, rounded once to 768. Summed in
    // a bf16 C it would stick at 512 (512 + 2 rounds back to even).
    static constexpr detail::einsum_spec looped = parse_einsum("jik,jk->i");
    std::vector<bf16> a3(257 * 2 * 2, bf16(1.0f)), b2(257 * 2, bf16(1.0f));
    a3[0] = bf16(256.0f);
    const index_t jik[3] = {257, 2, 2}, jk[2] = {257, 2}, i2[1] = {2};
    local_einsum(looped, a3.data(), jik, b2.data(), jk, out.data(), i2);
    GSHARD_CHECK(float(out[0]) == 768.0f);
    GSHARD_CHECK(float(out[1]) == 512.0f);  // 514 ones: rounded once, to 512
    // Into an fp32 result nothing is rounded: 257 ones are 257 (in bf16, 256).
    std::vector<float> out32(2);
    local_einsum(sum, ones.data(), n, static_cast<const bf16*>(nullptr), none, out32.data(), none);
    GSHARD_CHECK(out32[0] == 257.0f);
    local_einsum(dot, ones.data(), n, ones.data(), n, out32.data(), none);
    GSHARD_CHECK(out32[0] == 257.0f);
    local_einsum(looped, a3.data(), jik, b2.data(), jk, out32.data(), i2);
    GSHARD_CHECK((out32[0] == 769.0f && out32[1] == 514.0f));
  }
  detail::options().gemm = chosen;
}

TEST_CASE("einsum with an fp32 result of bf16 operands; convert between element types", "[einsum][bf16]") {
  dyn1 m(MPI_COMM_WORLD);
  const index_t P = m.nranks();
  using rows = sharding<split<0, "x">>;
  // Values with 24 significant bits: most are not bf16 numbers.
  local_tensor<float, 2> xg(4 * P + 1, 33), wg(33, 5);
  std::uint64_t seed = 7;
  for (auto* t : {&xg, &wg})
    for (index_t i = 0; i < t->size(); ++i) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      t->data()[i] = float(std::int32_t(seed >> 40) - (1 << 23)) * 0x1p-23f;
    }
  const auto x = distribute<rows>(m, xg);
  const auto w = distribute<replicate>(m, wg);

  // convert: each element as Eigen rounds it to bf16, back exactly; the
  // sharding, labels and extents kept.
  const auto x16 = convert<bf16>(x);
  const auto w16 = convert<bf16>(w);
  static_assert(std::is_same_v<decltype(x16), const tensor<bf16, 2, dyn1, rows>>);
  GSHARD_REQUIRE(x16.notation().rfind("bf16[" + std::to_string(4 * P + 1) + "{x},33]", 0) == 0);  // then any uneven note
  const auto xr = gather(x16), wr = gather(w16);
  const auto back = gather(convert<float>(x16));
  bool rounded = true, exact = true;
  for (index_t i = 0; i < xg.size(); ++i) {
    rounded = rounded && xr.data()[i].value == bf16(xg.data()[i]).value;
    exact = exact && back.data()[i] == float(xr.data()[i]);
  }
  GSHARD_REQUIRE(rounded);
  GSHARD_REQUIRE(exact);
  const auto xd = gather(convert<double>(x));
  const auto xi = gather(convert<float>(convert<std::int32_t>(convert<double>(x))));
  bool widened = true, truncated = true;
  for (index_t i = 0; i < xg.size(); ++i) {
    widened = widened && xd.data()[i] == double(xg.data()[i]);
    truncated = truncated && xi.data()[i] == float(std::int32_t(xg.data()[i]));
  }
  GSHARD_REQUIRE(widened);
  GSHARD_REQUIRE(truncated);

  // The product of the rounded operands, in fp32: within the fp32 sum's
  // rounding (33 terms) of the exact one, and the bf16 product's value
  // before its rounding.
  const auto y = einsum<"ij,jk->ik", natural_sharding, float>(x16, w16);
  static_assert(std::is_same_v<decltype(y)::value_type, float>);
  const auto y16 = einsum<"ij,jk->ik">(x16, w16);
  const auto yg = gather(y);
  const auto y16g = gather(y16);
  double worst = 0;
  bool same_rounded = true;
  for (index_t i = 0; i < yg.dimension(0); ++i)
    for (index_t k = 0; k < yg.dimension(1); ++k) {
      double exact_sum = 0, magnitude = 0;
      for (index_t j = 0; j < 33; ++j) {
        const double p = double(float(xr(i, j))) * double(float(wr(j, k)));
        exact_sum += p, magnitude += std::abs(p);
      }
      worst = std::max(worst, std::abs(double(yg(i, k)) - exact_sum) / (33 * 0x1p-24 * magnitude + 1e-30));
      same_rounded = same_rounded && bf16(yg(i, k)).value == y16g(i, k).value;
    }
  INFO("worst error in units of 33·2^-24·Σ|ab|: " << worst);
  GSHARD_REQUIRE(worst <= 1.0);
  GSHARD_REQUIRE(same_rounded);

  // Contracting the split dim: the pending sum reduced in fp32 (4P + 1
  // terms, P parts); the one-operand form sums bf16 into fp32.
  const auto g = einsum<"ij,ik->jk", replicate, float>(x16, x16);
  const auto s = einsum<"ij->j", replicate, float>(x16);
  static_assert(std::is_same_v<decltype(s)::value_type, float>);
  const auto gg = gather(g);
  const auto sg = gather(s);
  double worst_g = 0, worst_s = 0;
  const index_t I = xg.dimension(0);
  for (index_t j = 0; j < 33; ++j) {
    double col = 0, col_mag = 0;
    for (index_t i = 0; i < I; ++i) col += double(float(xr(i, j))), col_mag += std::abs(double(float(xr(i, j))));
    worst_s = std::max(worst_s, std::abs(double(sg(j)) - col) / (double(I + P) * 0x1p-24 * col_mag + 1e-30));
    for (index_t k = 0; k < 33; ++k) {
      double dot = 0, mag = 0;
      for (index_t i = 0; i < I; ++i) {
        const double p = double(float(xr(i, j))) * double(float(xr(i, k)));
        dot += p, mag += std::abs(p);
      }
      worst_g = std::max(worst_g, std::abs(double(gg(j, k)) - dot) / (double(I + P) * 0x1p-24 * mag + 1e-30));
    }
  }
  INFO("worst errors in units of (I + P)·2^-24·Σ|ab|: " << worst_g << ", " << worst_s);
  GSHARD_REQUIRE(worst_g <= 1.0);
  GSHARD_REQUIRE(worst_s <= 1.0);
}

// Operands for the GEMM tests: a fixed sequence in [-1, 1) with 24
// significant bits (every value exact in fp32, most not in bf16).
struct gemm_values {
  std::uint64_t seed;
  float operator()() {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return float(std::int64_t(seed >> 40) - (1 << 23)) / float(1 << 23);
  }
};

TEST_CASE("GEMM backends: each gives the product for every transpose, leading dim, alpha and beta; bf16 within its rounding",
          "[einsum][gemm]") {
  // Each backend this build has, against a double product of the same
  // operands: C = alpha·op(A)·op(B) + beta·C with padded leading dims.
  // fp32: within 4·(k+1)·2^-24 of Σ|alpha·a·b| + |beta·c| (the
  // accumulation's bound). bf16: the operands rounded to bf16, against the
  // double product of the rounded values — their products are exact in
  // fp32, so the same bound; a bf16 C adds one rounding, 2^-8 of |C|
  // (8 significant bits).
  using detail::gemm_kind;
  const int chosen = detail::options().gemm;
  const std::vector<gemm_kind> kinds = detail::gemm_kinds();  // gemm_bf16 widens to fp32 under all but oneDNN
  gemm_values value{1};
  auto to_bf16 = [](const std::vector<float>& v) { return std::vector<Eigen::bfloat16>(v.begin(), v.end()); };
  auto to_f32 = [](const std::vector<Eigen::bfloat16>& v) { return std::vector<float>(v.begin(), v.end()); };
  double worst32 = 0, worst16 = 0, worst16out = 0;
  for (const gemm_kind kind : kinds) {
    detail::options().gemm = int(kind);
    for (const auto& [m, n, k] : std::vector<std::array<index_t, 3>>{{1, 1, 1}, {5, 7, 3}, {33, 17, 65}, {64, 48, 128}, {3, 4, 0}})
      for (const bool ta : {false, true})
        for (const bool tb : {false, true})
          for (const auto& [alpha, beta] : std::vector<std::pair<float, float>>{{1, 0}, {0.5f, 1}, {-2, -0.75f}}) {
            const index_t ra = ta ? k : m, ca = ta ? m : k, rb = tb ? n : k, cb = tb ? k : n;
            const index_t lda = ca + 3, ldb = cb + 1, ldc = n + 2;
            std::vector<float> a(std::size_t(std::max<index_t>(ra, 1) * lda)), b(std::size_t(std::max<index_t>(rb, 1) * ldb)),
                c(std::size_t(m * ldc));
            for (float& x : a) x = value();
            for (float& x : b) x = value();
            for (float& x : c) x = value();
            // How far `out` is from the double product of a, b and c, over the bound (plus `extra` of |C|).
            auto over_bound = [&](const std::vector<float>& a_, const std::vector<float>& b_, const std::vector<float>& c_,
                                  const auto& out, double extra) {
              double w = 0;
              for (index_t i = 0; i < m; ++i)
                for (index_t j = 0; j < n; ++j) {
                  double sum = 0, mag = 0;
                  for (index_t p = 0; p < k; ++p) {
                    const double x = a_[std::size_t(ta ? p * lda + i : i * lda + p)], y = b_[std::size_t(tb ? j * ldb + p : p * ldb + j)];
                    sum += x * y, mag += std::abs(x * y);
                  }
                  const double cij = c_[std::size_t(i * ldc + j)], r = alpha * sum + beta * cij;
                  const double bound = 4.0 * double(k + 1) * 0x1p-24 * (std::abs(alpha) * mag + std::abs(beta * cij)) + 1e-30;
                  w = std::max(w, std::abs(double(out[std::size_t(i * ldc + j)]) - r) / (bound * (1 + extra) + extra * std::abs(r)));
                }
              return w;
            };
            std::vector<float> c32 = c;
            detail::gemm<float>(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c32.data(), ldc);
            // bf16: the operands rounded; their double product is the reference.
            const std::vector<Eigen::bfloat16> a16 = to_bf16(a), b16 = to_bf16(b);
            std::vector<Eigen::bfloat16> c16 = to_bf16(c);
            const std::vector<float> c16_in = to_f32(c16);
            std::vector<float> cf = c;
            detail::gemm_bf16<float>(ta, tb, m, n, k, alpha, a16.data(), lda, b16.data(), ldb, beta, cf.data(), ldc);
            detail::gemm_bf16<Eigen::bfloat16>(ta, tb, m, n, k, alpha, a16.data(), lda, b16.data(), ldb, beta, c16.data(), ldc);
            INFO(detail::gemm_name(kind) << " m " << m << " n " << n << " k " << k << (ta ? " A^T" : "") << (tb ? " B^T" : "")
                                         << " alpha " << alpha << " beta " << beta);
            worst32 = std::max(worst32, over_bound(a, b, c, c32, 0.0));
            worst16 = std::max(worst16, over_bound(to_f32(a16), to_f32(b16), c, cf, 0.0));
            worst16out = std::max(worst16out, over_bound(to_f32(a16), to_f32(b16), c16_in, c16, 0x1p-8));
            // The padding between rows is left alone.
            bool pads = true;
            for (index_t i = 0; i < m; ++i)
              for (index_t j = n; j < ldc; ++j)
                pads = pads && c32[std::size_t(i * ldc + j)] == c[std::size_t(i * ldc + j)] &&
                       cf[std::size_t(i * ldc + j)] == c[std::size_t(i * ldc + j)] &&
                       float(c16[std::size_t(i * ldc + j)]) == c16_in[std::size_t(i * ldc + j)];
            GSHARD_REQUIRE(pads);
          }
  }
  detail::options().gemm = chosen;
  INFO("worst error over its bound: fp32 " << worst32 << ", bf16 -> fp32 " << worst16 << ", bf16 -> bf16 " << worst16out);
  GSHARD_REQUIRE(worst32 <= 1.0);
  GSHARD_REQUIRE(worst16 <= 1.0);
  GSHARD_REQUIRE(worst16out <= 1.0);
  // Where oneDNN is built in and the CPU has bf16 units, they run gemm_bf16
  // under oneDNN, and never under another backend.
  for (const gemm_kind kind : kinds) {
    detail::options().gemm = int(kind);
    GSHARD_REQUIRE(detail::gemm_bf16_native() == (kind == gemm_kind::onednn && cpu_has("avx512_bf16")));
  }
  detail::options().gemm = chosen;
  // A recorder lists a bf16 GEMM once, with 2-byte elements, whichever path ran it.
  std::vector<Eigen::bfloat16> x(12, Eigen::bfloat16(1.0f));
  std::vector<float> y(9);
  gemm_recorder rec;
  detail::gemm_bf16<float>(false, false, 3, 3, 4, 1.0f, x.data(), 4, x.data(), 3, 0.0f, y.data(), 3);
  GSHARD_REQUIRE(rec.calls().size() == 1 && rec.calls()[0].element_bytes == 2 && y[4] == 4.0f);
}

TEST_CASE("matmul_precision bf16: fp32 GEMMs multiply their operands rounded to bf16 on bf16 units, else in fp32",
          "[einsum][gemm][bf16]") {
  using detail::gemm_kind;
  const int chosen = detail::options().gemm;
  gemm_values value{7};
  GSHARD_REQUIRE(current_matmul_precision() == matmul_precision::f32);  // unless set
  const index_t m = 19, n = 23, k = 37;
  for (const gemm_kind kind : detail::gemm_kinds())
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        detail::options().gemm = int(kind);
        INFO(detail::gemm_name(kind) << (ta ? " A^T" : "") << (tb ? " B^T" : ""));
        // C (m×n) += op(A)·op(B), every matrix with padded rows.
        const index_t ra = ta ? k : m, ca = ta ? m : k, rb = tb ? n : k, cb = tb ? k : n;
        const index_t lda = ca + 3, ldb = cb + 2, ldc = n + 1;
        std::vector<float> a(std::size_t(ra * lda)), b(std::size_t(rb * ldb)), c0(std::size_t(m * ldc));
        for (float& x : a) x = value();
        for (float& x : b) x = value();
        for (float& x : c0) x = value();
        const std::vector<Eigen::bfloat16> a16(a.begin(), a.end()), b16(b.begin(), b.end());
        std::vector<float> f32 = c0, bf16 = c0, rounded = c0;
        detail::gemm<float>(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 1.0f, f32.data(), ldc);
        std::vector<gemm_call> calls;
        {
          gemm_recorder rec;
          const matmul_precision_scope outer(matmul_precision::bf16);
          {
            const matmul_precision_scope inner(matmul_precision::f32);
            GSHARD_REQUIRE(current_matmul_precision() == matmul_precision::f32);
          }
          GSHARD_REQUIRE(current_matmul_precision() == matmul_precision::bf16);  // the inner scope gave it back
          detail::gemm<float>(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 1.0f, bf16.data(), ldc);
          // double is never rounded
          std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end()), cd(std::size_t(m * ldc)), cf(cd.size());
          detail::gemm<double>(ta, tb, m, n, k, 1.0, ad.data(), lda, bd.data(), ldb, 0.0, cd.data(), ldc);
          const matmul_precision_scope off(matmul_precision::f32);
          detail::gemm<double>(ta, tb, m, n, k, 1.0, ad.data(), lda, bd.data(), ldb, 0.0, cf.data(), ldc);
          GSHARD_REQUIRE(cd == cf);
          calls = rec.calls();
        }
        GSHARD_REQUIRE(current_matmul_precision() == matmul_precision::f32);
        detail::gemm_bf16<float>(ta, tb, m, n, k, 0.5f, a16.data(), lda, b16.data(), ldb, 1.0f, rounded.data(), ldc);
        // On bf16 units: the product of the rounded operands, to the bit,
        // recorded as a 2-byte GEMM; the padding between C's rows untouched.
        // Elsewhere: the fp32 GEMM's, unrounded.
        const bool native = detail::gemm_bf16_native();
        GSHARD_REQUIRE(bf16 == (native ? rounded : f32));
        GSHARD_REQUIRE(calls.size() == 3);
        GSHARD_REQUIRE(calls[0].element_bytes == (native ? 2 : 4));
        GSHARD_REQUIRE(calls[1].element_bytes == 8);
        bool pads = true;
        for (index_t i = 0; i < m; ++i) pads = pads && bf16[std::size_t(i * ldc + n)] == c0[std::size_t(i * ldc + n)];
        GSHARD_REQUIRE(pads);
        if (native) {  // the rounding shows: some element moved (the operands have 24 significant bits)
          double moved = 0;
          for (std::size_t i = 0; i < f32.size(); ++i) moved = std::max(moved, double(std::abs(f32[i] - bf16[i])));
          GSHARD_REQUIRE(moved > 1e-4);
        }
      }
  detail::options().gemm = chosen;
}

TEST_CASE("gemm_batched: a batch of strided products, each as its own GEMM computes it, on every backend",
          "[einsum][gemm][bf16]") {
  using detail::gemm_kind;
  const int chosen = detail::options().gemm;
  gemm_values value{11};
  // Three products interleaved as the attention's heads are: matrix i's
  // rows at i·cols, rows count·cols + 1 apart (one padding element).
  const index_t count = 3, m = 7, n = 5, k = 6;
  for (const gemm_kind kind : detail::gemm_kinds())
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const float beta : {0.0f, 1.0f}) {
          detail::options().gemm = int(kind);
          INFO(detail::gemm_name(kind) << (ta ? " A^T" : "") << (tb ? " B^T" : "") << " beta " << beta);
          const index_t ra = ta ? k : m, ca = ta ? m : k, rb = tb ? n : k, cb = tb ? k : n;
          const index_t lda = count * ca + 1, ldb = count * cb + 1, ldc = count * n + 1;
          std::vector<float> a(std::size_t(ra * lda)), b(std::size_t(rb * ldb)), c0(std::size_t(m * ldc));
          for (float& x : a) x = value();
          for (float& x : b) x = value();
          for (float& x : c0) x = value();
          const std::vector<Eigen::bfloat16> a16(a.begin(), a.end()), b16(b.begin(), b.end());
          const detail::gemm_batch batch{count, ca, cb, n};
          std::vector<float> c32 = c0, c16 = c0;
          std::vector<gemm_call> calls;
          {
            gemm_recorder rec;
            detail::gemm_batched<float, float>(batch, ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, beta,
                                               c32.data(), ldc);
            detail::gemm_batched<Eigen::bfloat16, float>(batch, ta, tb, m, n, k, 0.5f, a16.data(), lda, b16.data(), ldb,
                                                         beta, c16.data(), ldc);
            calls = rec.calls();
          }
          GSHARD_REQUIRE(calls.size() == std::size_t(2 * count));  // one record per product
          GSHARD_REQUIRE((calls[0].element_bytes == 4 && calls[count].element_bytes == 2));
          // Against f64 of the same (fp32 or bf16-rounded) operands: within
          // k + 2 fp32 roundings of the sum of |terms|; the padding untouched.
          double worst = 0;
          bool pads = true;
          for (index_t p = 0; p < count; ++p)
            for (index_t i = 0; i < m; ++i)
              for (index_t j = 0; j < n; ++j) {
                double exact32 = 0, exact16 = 0, size32 = 0, size16 = 0;
                for (index_t q = 0; q < k; ++q) {
                  const std::size_t ai = std::size_t(ta ? q * lda + p * ca + i : i * lda + p * ca + q);
                  const std::size_t bi = std::size_t(tb ? j * ldb + p * cb + q : q * ldb + p * cb + j);
                  exact32 += double(a[ai]) * double(b[bi]), size32 += std::abs(double(a[ai]) * double(b[bi]));
                  exact16 += double(float(a16[ai])) * double(float(b16[bi]));
                  size16 += std::abs(double(float(a16[ai])) * double(float(b16[bi])));
                }
                const std::size_t ci = std::size_t(i * ldc + p * n + j);
                const double before = double(c0[ci]) * double(beta), eps = std::ldexp(1.0, -23) * double(k + 2);
                worst = std::max(worst, std::abs(double(c32[ci]) - (0.5 * exact32 + before)) /
                                            (eps * (0.5 * size32 + std::abs(before)) + 1e-30));
                worst = std::max(worst, std::abs(double(c16[ci]) - (0.5 * exact16 + before)) /
                                            (eps * (0.5 * size16 + std::abs(before)) + 1e-30));
              }
          for (index_t i = 0; i < m; ++i)
            pads = pads && c32[std::size_t(i * ldc + count * n)] == c0[std::size_t(i * ldc + count * n)] &&
                   c16[std::size_t(i * ldc + count * n)] == c0[std::size_t(i * ldc + count * n)];
          INFO("worst error over its bound " << worst);
          GSHARD_REQUIRE(worst <= 1.0);
          GSHARD_REQUIRE(pads);
        }
  detail::options().gemm = chosen;
}

TEST_CASE("typed einsum: the rules' natural outputs, slices and reduce_scatter", "[einsum]") {
  using grid = mesh<axis<"x">>;
  grid m(MPI_COMM_WORLD);
  const index_t P = m.nranks();
  using rows = sharding<split<0, "x">>;
  using cols = sharding<split<1, "x">>;
  const auto a = random_tensor<2, double>({2 * P, 3 * P}, 3);
  const auto b = random_tensor<2, double>({3 * P, 4}, 4);
  index_t ext[128] = {};
  ext['i'] = 2 * P, ext['j'] = 3 * P, ext['k'] = 4;
  const auto ref = reference<double, 2, 2, 2>(detail::parse_einsum("ij,jk->ik"), a, &b, ext);
  std::string why;

  // Contracting label split in both: partial, no communication.
  {
    const auto A = distribute<cols>(m, a);
    const auto B = distribute<rows>(m, b);
    collective_recorder rec;
    const auto c = einsum<"ij,jk->ik">(A, B);
    static_assert(std::is_same_v<decltype(c)::sharding_type, sharding<partial<"x">>>);
    GSHARD_REQUIRE(rec.events().empty());
    GSHARD_REQUIRE_MSG((matches<double, 2>(c.local(), decltype(c)::resolved, ref, m, 1e-12 * 3 * double(P), why)), why);
    // Asked for a split output: one reduce_scatter, not all_reduce + slice.
    const auto r = einsum<"ij,jk->ik", rows>(A, B);
    const auto ev = rec.events();
    GSHARD_REQUIRE(ev.size() == 1 && ev[0].kind == collective::reduce_scatter);
    GSHARD_REQUIRE_MSG((matches<double, 2>(r.local(), decltype(r)::resolved, ref, m, 1e-12 * 3 * double(P), why)), why);
  }
  // Contracting label split in one, the other replicated: a local slice.
  {
    const auto A = distribute<cols>(m, a);
    const auto B = distribute<replicate>(m, b);
    using plan = einsum_plan<"ij,jk->ik", grid, cols, replicate>;
    static_assert(plan::slice_b::steps.n == 1 && plan::slice_b::steps.step[0].kind == step_kind::slice);
    collective_recorder rec;
    const auto c = einsum<"ij,jk->ik", replicate>(A, B);
    const auto ev = rec.events();
    GSHARD_REQUIRE(ev.size() == 1 && ev[0].kind == collective::all_reduce);
    GSHARD_REQUIRE_MSG((matches<double, 2>(c.local(), decltype(c)::resolved, ref, m, 1e-12 * 3 * double(P), why)), why);
    GSHARD_REQUIRE(plan::describe("f64").find("1. slice B over x: j   (local)") != std::string::npos);
  }
  // Free label split: a split output, no communication.
  {
    const auto A = distribute<rows>(m, a);
    const auto B = distribute<replicate>(m, b);
    collective_recorder rec;
    const auto c = einsum<"ij,jk->ik">(A, B);
    static_assert(std::is_same_v<decltype(c)::sharding_type, rows>);
    GSHARD_REQUIRE(rec.events().empty());
    GSHARD_REQUIRE_MSG((matches<double, 2>(c.local(), decltype(c)::resolved, ref, m, 1e-12 * 3 * double(P), why)), why);
  }
  // Integers: a transpose, and a product by the plain loop.
  {
    local_tensor<std::int32_t, 2> ia(2 * P, 3);
    for (index_t i = 0; i < ia.size(); ++i) ia.data()[i] = std::int32_t(i);
    const auto IA = distribute<rows>(m, ia);
    const auto t = gather(einsum<"ij->ji">(IA));
    bool ok = t.dimension(0) == 3 && t.dimension(1) == 2 * P;
    for (index_t i = 0; i < 2 * P && ok; ++i)
      for (index_t j = 0; j < 3; ++j) ok = ok && t(j, i) == ia(i, j);
    const auto sq = gather(einsum<"ij,ij->i">(IA, IA));
    for (index_t i = 0; i < 2 * P && ok; ++i) ok = ok && sq(i) == ia(i, 0) * ia(i, 0) + ia(i, 1) * ia(i, 1) + ia(i, 2) * ia(i, 2);
    GSHARD_REQUIRE(ok);
  }
  // Operands placed on two meshes of one type: refused on every rank.
  {
    grid other(MPI_COMM_WORLD);
    const auto A = distribute<replicate>(m, a);
    const auto B = distribute<replicate>(other, b);
    GSHARD_REQUIRE_THROWS_WITH((einsum<"ij,jk->ik">(A, B)), shape_error, "the operands are placed on two different meshes");
  }
  // Operands that disagree on a label's extent: one clear error on every rank.
  {
    const auto A = distribute<replicate>(m, a);
    const auto B = distribute<replicate>(m, random_tensor<2, double>({3 * P + 1, 4}, 5));
    GSHARD_REQUIRE_THROWS_WITH((einsum<"ij,jk->ik">(A, B)), shape_error,
                               "gshard::einsum ij,jk->ik: label j has extent " + std::to_string(3 * P) + " in f64[i,j] but " +
                                   std::to_string(3 * P + 1) + " in f64[j,k]");
  }
}
