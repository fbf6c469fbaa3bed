// Reverse mode on a tape: every differentiable operation against central
// finite differences in double at any world size; gradients in their
// parameters' shardings; contributions summed while pending and reduced once;
// the errors a model writer can make.
#include <gshard/ad/nn.hpp>
#include <gshard/gshard.hpp>

#include <bit>
#include <optional>

#include "gradcheck.hpp"
#include "layouts.hpp"
#include "testing.hpp"

using namespace gshard;
using gshard::testing::dot;
using gshard::testing::fd_check;
using gshard::testing::fd_check_params;
using gshard::testing::random_tensor;
using gshard::testing::sum_all;
using gshard::testing::world_size;

namespace {

using grid1 = mesh<axis<"x">>;
using grid2 = mesh<axis<"data">, axis<"model">>;
using rows = sharding<split<0, "x">>;

using grid_de = mesh<axis<"data">, axis<"expert">>;

// A "data" x "model" mesh of P ranks: model 2 where P is even, else 1.
std::array<index_t, 2> data_model_sizes(int P) {
  return P % 2 == 0 ? std::array<index_t, 2>{P / 2, 2} : std::array<index_t, 2>{P, 1};
}

template <class X>
X random_like(const X& t, std::uint64_t seed) {
  X r = t;
  fill_normal(r, 1.0, seed, 77);
  return r;
}
template <class V>
double loss_value(const V& v) {
  return double(v.value().local()());
}
template <class A, class B>
bool equal_tensors(const A& a, const B& b) {
  for (index_t i = 0; i < a.size(); ++i)
    if (a.data()[i] != b.data()[i]) return false;
  return a.size() == b.size();
}

}  // namespace

TEST_CASE("autodiff: einsum gradients match finite differences, in the parameters' shardings", "[autodiff][grad]") {
  grid1 m(MPI_COMM_WORLD);
  const index_t P = m.nranks();
  parameters ps(m, 1);
  param<tensor<double, 2, grid1, rows>> a(ps, "a", {2 * P, 5}, init::normal(1.0));
  param<tensor<double, 2, grid1, replicate>> b(ps, "b", {5, 3}, init::normal(1.0));
  param<tensor<double, 4, grid1, rows>> q(ps, "q", {P, 4, 2, 3}, init::normal(1.0));
  param<tensor<double, 4, grid1, rows>> k(ps, "k", {P, 4, 2, 3}, init::normal(1.0));
  param<tensor<double, 3, grid1, sharding<split<1, "x">>>> g(ps, "g", {2, 2 * P, 3}, init::normal(1.0));
  param<tensor<double, 2, grid1, sharding<split<1, "x">>>> w(ps, "w", {3, 2 * P}, init::normal(1.0));
  auto loss = [&](tape& t) {
    auto ab = einsum<"ij,jk->ik">(t.use(a), b);                          // [i{x},k]
    auto s1 = einsum<"ik,ik->">(ab, ab);                          // partial{x}
    auto qk = einsum<"BLNK,BTNK->BNLT">(t.use(q), k);                   // batch split in both
    auto s2 = einsum<"BNLT->">(qk);                               // a full reduction: gradient broadcast
    auto gs = all_reduce<"x">(einsum<"GSE->GE">(t.use(g)));              // S split and summed: broadcast back, sliced
    auto s3 = einsum<"GE,GE->">(gs, gs);                          // replicated (partial over nothing)
    auto ws = einsum<"ij,ij->j", sharding<split<0, "x">>>(t.use(w), w);  // natural j{x}
    auto s4 = einsum<"j->">(ws);
    return all_reduce<"x">(s1 + s2 + s4) + 0.5 * s3;
  };
  const double worst = fd_check_params(ps, loss, a, b, q, k, g, w);
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
}

namespace {
// <y, c> for a constant c drawn from `seed`: a partial or replicated scalar.
template <class V>
auto against(tape& t, const V& y, std::uint64_t seed) {
  using X = typename V::tensor_type;
  X c(y.mesh(), y.extents());
  fill_normal(c, 1.0, seed, 7);
  constexpr std::string_view all = "abcdefgh";
  if constexpr (X::rank == 2) return einsum<"ab,ab->">(relabel<"">(y), t.constant(relabel<"">(std::move(c))));
  else if constexpr (X::rank == 3) return einsum<"abc,abc->">(relabel<"">(y), t.constant(relabel<"">(std::move(c))));
  else {
    static_assert(X::rank == 1);
    (void)all;
    return einsum<"a,a->">(relabel<"">(y), t.constant(relabel<"">(std::move(c))));
  }
}
}  // namespace

TEST_CASE("autodiff: each gradient rule multiplies in the matmul_precision its forward ran in", "[autodiff][bf16]") {
  // ab = a·b runs in bf16, (ab)·c in fp32; the backward runs under the
  // opposite setting, or none. Every GEMM of ab's rule has the extent 16
  // (j) as a row or column count, none of (ab)·c's does.
  grid1 m(MPI_COMM_WORLD);
  const index_t P = m.nranks();
  const bool native = detail::gemm_bf16_native();
  auto run = [&](bool mixed, bool backward_in_bf16) {
    parameters ps(m, 1);
    param<tensor<float, 2, grid1, rows>> a(ps, "a", {8 * P, 16}, init::normal(1.0));
    param<tensor<float, 2, grid1, replicate>> b(ps, "b", {16, 12}, init::normal(1.0));
    param<tensor<float, 2, grid1, replicate>> c(ps, "c", {12, 8}, init::normal(1.0));
    tape t(ps);
    auto ab = [&] {
      const matmul_precision_scope s(mixed ? matmul_precision::bf16 : matmul_precision::f32);
      return einsum<"ij,jk->ik">(t.use(a), b);
    }();
    auto abc = einsum<"ik,kl->il">(ab, c);
    auto loss = all_reduce<"x">(einsum<"il,il->">(abc, abc));
    gemm_recorder rec;
    {
      const matmul_precision_scope s(backward_in_bf16 ? matmul_precision::bf16 : matmul_precision::f32);
      t.backward(loss);
    }
    int ab_rule = 0, abc_rule = 0;
    for (const gemm_call& g : rec.calls()) {
      const bool of_ab = g.m == 16 || g.n == 16;
      INFO("GEMM " << g.m << "x" << g.n << "x" << g.k << ", " << g.element_bytes << " bytes");
      GSHARD_REQUIRE(g.element_bytes == (of_ab && mixed && native ? 2 : 4));
      ++(of_ab ? ab_rule : abc_rule);
    }
    GSHARD_REQUIRE(ab_rule == 2);   // da, db
    GSHARD_REQUIRE(abc_rule >= 2);  // d(ab), dc
    return std::array{gather(a.grad()), gather(b.grad()), gather(c.grad())};
  };
  const auto f32 = run(false, false);
  for (const bool backward_in_bf16 : {false, true}) {
    const auto bf16 = run(true, backward_in_bf16);
    // Where the GEMMs round, within a few bf16 roundings (2^-8) of the fp32
    // gradient's scale; where they cannot, the fp32 gradient to the bit.
    for (std::size_t i = 0; i < f32.size(); ++i) {
      double worst = 0, scale = 0;
      for (index_t e = 0; e < f32[i].size(); ++e) {
        worst = std::max(worst, double(std::abs(f32[i].data()[e] - bf16[i].data()[e])));
        scale = std::max(scale, double(std::abs(f32[i].data()[e])));
      }
      INFO("gradient " << i << ": worst difference " << worst << " of " << scale);
      if (native) GSHARD_REQUIRE((worst > 0 && worst < 4 * 0x1p-8 * scale));
      else GSHARD_REQUIRE(worst == 0);
    }
  }
}

TEST_CASE("autodiff: an einsum in bf16 rounds its operands once; its value and gradients are the rounded products",
          "[autodiff][bf16]") {
  // Under matmul_precision::bf16 the tape rounds a and b once, multiplies
  // the copies and keeps them for the rule, which rounds dz once for both
  // gradients: the tensor einsums, whose GEMMs round each operand where
  // they read it, give the same bits.
  grid1 m(MPI_COMM_WORLD);
  const index_t P = m.nranks();
  parameters ps(m, 1);
  param<tensor<float, 2, grid1, rows>> a(ps, "a", {8 * P + 3, 16}, init::normal(1.0));
  param<tensor<float, 2, grid1, replicate>> b(ps, "b", {16, 12}, init::normal(1.0));
  param<tensor<float, 2, grid1, replicate>> b0(ps, "b0", {16, 12}, init::normal(1.0)),
      b1(ps, "b1", {16, 12}, init::normal(1.0)), b2(ps, "b2", {16, 12}, init::normal(1.0));
  const std::array bs{&b0, &b1, &b2};
  param<tensor<float, 2, grid1, replicate>> c(ps, "c", {12, 8}, init::normal(1.0));
  local_tensor<float, 2> gl(8 * P + 3, 12);
  for (index_t i = 0; i < gl.size(); ++i) gl.data()[i] = float(std::sin(0.37 * double(i) + 0.1));
  const auto G = distribute<rows>(m, gl);  // d(ab): the loss is Σ ab·G
  tape t(ps);
  gemm_recorder forward;
  auto ab = [&] {
    const matmul_precision_scope s(matmul_precision::bf16);
    return einsum<"ij,jk->ik">(t.use(a), b);
  }();
  // Without bf16 units nothing rounds, and the checks below compare fp32 with itself.
  const bool native = detail::gemm_bf16_native();
  INFO((native ? "bf16 units: the rounding path" : "no bf16 units: fp32 GEMMs only"));
  const std::vector<gemm_call> forward_gemms = forward.calls();
  GSHARD_REQUIRE(!forward_gemms.empty());
  GSHARD_REQUIRE(std::all_of(forward_gemms.begin(), forward_gemms.end(),
                             [&](const gemm_call& g) { return g.element_bytes == (native ? 2 : 4); }));
  t.backward(all_reduce<"x">(einsum<"ik,ik->">(ab, t.constant(G))));
  const matmul_precision_scope s(matmul_precision::bf16);
  const auto want_ab = einsum<"ij,jk->ik">(a.value(), b.value());
  const auto [want_da, want_db] = einsum_backward<"ij,jk->ik">(G, a.value(), b.value());
  auto same_bits = [](const auto& x, const auto& y) {
    return x.local().size() == y.local().size() &&
           std::equal(x.data(), x.data() + x.local().size(), y.data(), [](float u, float v) {
             return std::bit_cast<std::uint32_t>(u) == std::bit_cast<std::uint32_t>(v);
           });
  };
  GSHARD_REQUIRE(same_bits(ab.value(), want_ab));
  GSHARD_REQUIRE(same_bits(a.grad(), want_da));
  // b's gradient is summed over the ranks, by MPI in orders that may differ
  // with the message's size: fp32's rounding of the P parts apart.
  const auto db = gather(b.grad()), want = gather(want_db);
  double worst = 0, scale = 0;
  for (index_t e = 0; e < db.size(); ++e) {
    worst = std::max(worst, double(std::abs(db.data()[e] - want.data()[e])));
    scale = std::max(scale, double(std::abs(want.data()[e])));
  }
  INFO("b's gradient: worst difference " << worst << " of " << scale);
  GSHARD_REQUIRE(worst <= double(P) * 0x1p-23 * scale);

  // Two einsums of one var multiply one copy of it; a var freed, whose
  // address the next one may take, never lends its copy.
  tape t2(ps);
  bool own_copies = true;
  for (int i = 0; i < 3; ++i) {
    auto v = einsum<"ij,jk->ik">(t2.use(a), *bs[std::size_t(i)]);
    const auto y = einsum<"ik,kl->il">(v, c), y2 = einsum<"ik,kl->il">(v, c);
    const auto want_y = einsum<"ik,kl->il">(v.value(), c.value());
    own_copies = own_copies && same_bits(y.value(), want_y) && same_bits(y2.value(), want_y);
  }
  GSHARD_REQUIRE(own_copies);
  // One copy of a live var, and of a weight, however many einsums read it.
  auto round16 = [](const auto& x) { return convert<bf16>(x); };
  using W16 = with_element<tensor<float, 2, grid1, replicate>, bf16>;
  GSHARD_REQUIRE(t2.derived<W16>(t2.use(c).shared(), round16) == t2.derived<W16>(t2.use(c).shared(), round16));
  {
    auto v = einsum<"ij,jk->ik">(t2.use(a), b0);
    using V16 = with_element<decltype(v.value()), bf16>;
    GSHARD_REQUIRE(t2.derived<V16>(v.shared(), round16) == t2.derived<V16>(v.shared(), round16));
  }
  // The same address, another tensor: a copy made from the first is not the second's.
  using X = tensor<float, 2, grid1, rows>;
  X storage = a.value();
  auto round = [](const X& x) { return convert<bf16>(x); };
  auto first = std::make_shared<int>(0);
  const auto copy1 = t2.derived<with_element<X, bf16>>(std::shared_ptr<const X>(first, &storage), round);
  GSHARD_REQUIRE(copy1 == t2.derived<with_element<X, bf16>>(std::shared_ptr<const X>(first, &storage), round));
  first.reset();
  storage.local().setConstant(3.0f);
  const auto copy2 = t2.derived<with_element<X, bf16>>(std::shared_ptr<const X>(std::make_shared<int>(0), &storage), round);
  GSHARD_REQUIRE(copy2 != copy1);
  GSHARD_REQUIRE(std::all_of(copy2->data(), copy2->data() + copy2->local().size(), [](bf16 v) { return float(v) == 3.0f; }));

  // An operand that receives no gradient (a constant): only the weight's
  // gradient, the same as einsum_backward's.
  tape t3(ps);
  auto cb = einsum<"ij,jk->ik">(t3.constant(a.value()), b);
  const auto want_cb = einsum<"ij,jk->ik">(a.value(), b.value());
  GSHARD_REQUIRE(same_bits(cb.value(), want_cb));
  {
    const matmul_precision_scope f32(matmul_precision::f32);
    t3.backward(all_reduce<"x">(einsum<"ik,ik->">(cb, t3.constant(G))));
  }
  const auto db3 = gather(b.grad());
  double worst3 = 0;
  for (index_t e = 0; e < db3.size(); ++e) worst3 = std::max(worst3, double(std::abs(db3.data()[e] - want.data()[e])));
  INFO("b's gradient through a constant: worst difference " << worst3 << " of " << scale);
  GSHARD_REQUIRE(worst3 <= double(P) * 0x1p-23 * scale);
}

TEST_CASE("autodiff: element-wise, last-dim and collective gradients match finite differences", "[autodiff][grad]") {
  const int P = world_size();
  grid1 m(MPI_COMM_WORLD);
  parameters ps(m, 2);
  param<tensor<double, 2, grid1, rows>> x(ps, "x", {2 * index_t(P), 6}, init::normal(1.0));
  param<tensor<double, 2, grid1, rows>> y(ps, "y", {2 * index_t(P), 6}, init::normal(1.0));
  param<tensor<double, 1, grid1, replicate>> s(ps, "s", {6}, init::normal(1.0));
  param<tensor<double, 3, grid1, rows>> lg(ps, "lg", {index_t(P), 5, 5}, init::normal(1.0));
  auto loss = [&](tape& t) {
    auto xv = t.use(x), yv = t.use(y);
    auto e = against(t, relu(xv), 1) + against(t, gelu(xv), 2) + against(t, silu(xv), 3) + against(t, sigmoid(xv), 4) +
             against(t, tanh(xv), 5) + against(t, sqrt(exp(xv)), 6) + against(t, log(exp(yv) + exp(xv)), 7) +
             against(t, xv * yv - xv / 3.0, 8) + against(t, -(2.0 * yv), 9) + against(t, softmax(xv), 10) +
             against(t, rms_norm(yv, s), 11) + against(t, softmax(causal_mask(1.5 * t.use(lg))), 12) +
             against(t, causal_softmax(t.use(lg), 1.5), 13);
    return all_reduce<"x">(std::move(e));
  };
  const double worst = fd_check_params(ps, loss, x, y, s, lg);
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
}

TEST_CASE("autodiff: causal_softmax is softmax(causal_mask(scale * x)) in value and gradient, for L <, = and > T",
          "[autodiff][grad]") {
  const int P = world_size();
  grid1 m(MPI_COMM_WORLD);
  parameters ps(m, 3);
  for (const auto& [L, Tn] : {std::pair<index_t, index_t>{3, 5}, {5, 5}, {6, 2}, {1, 1}}) {
    param<tensor<double, 3, grid1, rows>> lg(ps, "lg" + std::to_string(L) + "x" + std::to_string(Tn), {index_t(P), L, Tn},
                                             init::normal(3.0));
    const auto run = [&](bool fused) {
      tape t(ps);
      auto p = fused ? causal_softmax(t.use(lg), 0.7) : softmax(causal_mask(0.7 * t.use(lg)));
      auto value = gather(p.value());
      t.backward(all_reduce<"x">(against(t, p, 5)));
      return std::pair{value, gather(lg.grad())};
    };
    const auto [y1, g1] = run(true);
    const auto [y0, g0] = run(false);
    double worst = 0, zero_above = 0;
    for (index_t i = 0; i < y1.size(); ++i) worst = std::max({worst, std::abs(y1.data()[i] - y0.data()[i]), std::abs(g1.data()[i] - g0.data()[i])});
    for (index_t b = 0; b < index_t(P); ++b)
      for (index_t l = 0; l < L; ++l)
        for (index_t k = l + 1; k < Tn; ++k) zero_above += std::abs(y1(b, l, k)) + std::abs(g1(b, l, k));
    INFO("L " << L << ", T " << Tn << ": worst difference " << worst);
    GSHARD_REQUIRE(worst < 1e-12);
    GSHARD_REQUIRE(zero_above == 0.0);
  }
}

namespace {
// Attention by its definition, in long double, on gathered global tensors
// q [B,L,N,K], k and v [B,T,N,K]: the single-process reference. Row l of
// sequence b sees the keys t with sees(b, l, t) (0 where it sees none);
// causal attention's are t <= l.
template <class G, class Sees>
G attention_reference(const G& q, const G& k, const G& v, double scale, Sees&& sees) {
  const index_t B = q.dimension(0), L = q.dimension(1), N = q.dimension(2), K = q.dimension(3), T = k.dimension(1);
  G o(B, L, N, K);
  for (index_t b = 0; b < B; ++b)
    for (index_t n = 0; n < N; ++n)
      for (index_t l = 0; l < L; ++l) {
        std::vector<long double> s(std::size_t(T), 0);
        std::vector<index_t> seen;
        long double mx = -INFINITY, sum = 0;
        for (index_t t = 0; t < T; ++t) {
          if (!sees(b, l, t)) continue;
          seen.push_back(t);
          long double d = 0;
          for (index_t c = 0; c < K; ++c) d += (long double)q(b, l, n, c) * k(b, t, n, c);
          s[std::size_t(t)] = scale * d;
          mx = std::max(mx, s[std::size_t(t)]);
        }
        for (index_t t : seen) sum += (s[std::size_t(t)] = std::exp(s[std::size_t(t)] - mx));
        for (index_t c = 0; c < K; ++c) {
          long double acc = 0;
          for (index_t t : seen) acc += s[std::size_t(t)] / sum * v(b, t, n, c);
          o(b, l, n, c) = typename G::Scalar(acc);
        }
      }
  return o;
}
template <class G>
G attention_reference(const G& q, const G& k, const G& v, double scale) {
  return attention_reference(q, k, v, scale, [](index_t, index_t l, index_t t) { return t <= l; });
}

template <class T>
double attention_worst(const T& a, const T& b) {
  double worst = 0;
  for (index_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double(a.data()[i]) - double(b.data()[i])));
  return a.size() == b.size() ? worst : INFINITY;
}
}  // namespace

TEST_CASE("autodiff: causal_attention is the einsums around causal_softmax in value and gradient, split over batch "
          "and heads, across its row blocks",
          "[autodiff][grad][attention]") {
  const int P = world_size();
  const auto sizes = data_model_sizes(P);
  grid2 m(MPI_COMM_WORLD, sizes);
  parameters ps(m, 7);
  using bn = sharding<split<0, "data">, split<2, "model">>;  // [B{data},L,N{model},K]
  const index_t B = 2 * sizes[0], N = 2 * sizes[1], K = 3;
  const double scale = 0.6;
  // rows of a block: 0 the backend's (32 for double), 64 one edge at 64
  for (const auto& [L, Tn, rows] : {std::array<index_t, 3>{5, 5, 0}, {33, 33, 0}, {70, 70, 0}, {70, 70, 64}, {1, 1, 0}}) {
    const detail::attention_block_scope blocks(rows);
    const std::string at = std::to_string(L) + "x" + std::to_string(Tn) + "r" + std::to_string(rows);
    param<tensor<double, 4, grid2, bn, "BLNK">> q(ps, "q" + at, {B, L, N, K}, init::normal(1.0));
    param<tensor<double, 4, grid2, bn, "BTNK">> k(ps, "k" + at, {B, Tn, N, K}, init::normal(1.0));
    param<tensor<double, 4, grid2, bn, "BTNK">> v(ps, "v" + at, {B, Tn, N, K}, init::normal(1.0));
    tensor<double, 4, grid2, bn, "BLNK"> r(m, {B, L, N, K});
    fill_normal(r, 1.0, 11, 3);
    enum form { fused, recomputing, composed };
    const auto run = [&](form f) {
      tape t(ps);
      auto o = f == fused         ? causal_attention(t.use(q), t.use(k), t.use(v), scale)
               : f == recomputing ? causal_attention(t.use(q), t.use(k), t.use(v), scale, attention_memory::recompute_probabilities)
                                  : relabel<"BLNK">(einsum<"BNLT,BTNK->BLNK">(
                                        causal_softmax(einsum<"BLNK,BTNK->BNLT">(t.use(q), t.use(k)), scale), t.use(v)));
      auto value = gather(o.value());
      t.backward(reshard<replicate>(einsum<"BLNK,BLNK->">(o, t.constant(r))));
      return std::array{value, gather(q.grad()), gather(k.grad()), gather(v.grad())};
    };
    collective_recorder rec;
    {  // the forward alone communicates nothing
      tape t(ps, tape::no_grad);
      (void)causal_attention(t.use(q), t.use(k), t.use(v), scale);
    }
    GSHARD_REQUIRE(rec.events().empty());
    const double model0 = model_flops(), again0 = recomputed_flops();
    const auto kept = run(fused);
    const double model1 = model_flops(), again1 = recomputed_flops();
    const auto recomputed = run(recomputing);
    const double model2 = model_flops(), again2 = recomputed_flops();
    const auto einsums = run(composed);
    const auto reference = attention_reference(gather(q.value()), gather(k.value()), gather(v.value()), scale);
    INFO("L " << L << ", T " << Tn << " in blocks of " << detail::attention_block_rows<double>() << " rows on " << sizes[0]
              << " x " << sizes[1] << " ranks");
    GSHARD_REQUIRE(attention_worst(kept[0], reference) < 1e-12);
    for (std::size_t i = 0; i < kept.size(); ++i) {
      INFO("output and gradients of q, k, v: " << i);
      GSHARD_REQUIRE(attention_worst(kept[i], einsums[i]) < 1e-12);
      GSHARD_REQUIRE(attention_worst(kept[i], recomputed[i]) == 0.0);  // the same probabilities, bit for bit
    }
    // Model FLOPs: the dense einsums', forward and backward, whichever the
    // form; the recomputed logits count as recomputed.
    const double dense = 2.0 * 2.0 * double(B * N * L * Tn * K) / double(P);
    GSHARD_REQUIRE(std::abs((model1 - model0) - (model2 - model1)) < 1e-9 * dense);
    GSHARD_REQUIRE(std::abs((again2 - again1) - dense / 2) < 1e-9 * dense);
    GSHARD_REQUIRE(again1 == again0);
  }
  // Finite differences, with positions beyond a row block of 32.
  param<tensor<double, 4, grid2, bn, "BLNK">> q(ps, "q_fd", {B, 36, N, K}, init::normal(1.0));
  param<tensor<double, 4, grid2, bn, "BTNK">> k(ps, "k_fd", {B, 36, N, K}, init::normal(1.0));
  param<tensor<double, 4, grid2, bn, "BTNK">> v(ps, "v_fd", {B, 36, N, K}, init::normal(1.0));
  tensor<double, 4, grid2, bn, "BLNK"> r(m, {B, 36, N, K});
  fill_normal(r, 1.0, 12, 3);
  auto loss = [&](tape& t) {
    return reshard<replicate>(einsum<"BLNK,BLNK->">(causal_attention(t.use(q), t.use(k), t.use(v), scale), t.constant(r)));
  };
  const double worst = fd_check_params(ps, loss, q, k, v);
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
}

TEST_CASE("autodiff: dot_product_attention — bidirectional, cross, causal at a query offset, with key lengths or "
          "paddings — against long double and finite differences, split over batch and heads",
          "[autodiff][grad][attention][padding]") {
  const int P = world_size();
  const auto sizes = data_model_sizes(P);
  grid2 m(MPI_COMM_WORLD, sizes);
  parameters ps(m, 9);
  using bn = sharding<split<0, "data">, split<2, "model">>;
  using bs = sharding<split<0, "data">>;
  const index_t B = 3 * sizes[0], N = 2 * sizes[1], K = 3;
  const double scale = 0.7;
  // Valid keys per sequence: all, none, one, and one short of a row block's edge or past it.
  const auto length_of = [](index_t b, index_t T) {
    const index_t pattern[] = {T, 0, 1, std::max<index_t>(T - 1, 0), std::min<index_t>(33, T), T / 2};
    return pattern[b % 6];
  };
  // Padded keys in the [B, T] form: holes, and sequences with none or no real key.
  const auto padded_key = [](index_t b, index_t t) { return b % 6 == 1 || (b % 6 != 0 && (t + b) % 3 == 1); };
  enum keys_given { all_keys, lengths_given, paddings_given };
  struct form {
    index_t L, T;
    bool causal;
    keys_given keys;
  };
  for (const form f : {form{5, 5, false, all_keys}, form{5, 9, false, lengths_given}, form{40, 70, false, lengths_given},
                       form{70, 40, false, lengths_given}, form{1, 37, true, all_keys}, form{3, 40, true, lengths_given},
                       form{36, 36, true, lengths_given}, form{33, 65, true, all_keys}, form{5, 9, false, paddings_given},
                       form{40, 70, false, paddings_given}, form{36, 36, true, paddings_given}}) {
    const index_t offset = f.causal ? f.T - f.L : 0;
    const std::string at = std::to_string(f.L) + "x" + std::to_string(f.T) + (f.causal ? "c" : "") + std::to_string(int(f.keys));
    INFO("L " << f.L << ", T " << f.T << (f.causal ? ", causal at offset " + std::to_string(offset) : "")
              << (f.keys == lengths_given ? ", key lengths" : f.keys == paddings_given ? ", key paddings" : ""));
    param<tensor<double, 4, grid2, bn, "BLNK">> q(ps, "q" + at, {B, f.L, N, K}, init::normal(1.0));
    param<tensor<double, 4, grid2, bn, "BTNK">> k(ps, "k" + at, {B, f.T, N, K}, init::normal(1.0));
    param<tensor<double, 4, grid2, bn, "BTNK">> v(ps, "v" + at, {B, f.T, N, K}, init::normal(1.0));
    tensor<std::int32_t, 1, grid2, bs> lengths(m, {B});
    for (index_t b = 0; b < lengths.local_extents()[0]; ++b)
      lengths.data()[b] = std::int32_t(length_of(lengths.offsets()[0] + b, f.T));
    tensor<double, 2, grid2, bs> paddings(m, {B, f.T});
    for (index_t b = 0; b < paddings.local_extents()[0]; ++b)
      for (index_t t = 0; t < f.T; ++t) paddings.data()[b * f.T + t] = padded_key(paddings.offsets()[0] + b, t) ? 1.0 : 0.0;
    tensor<double, 4, grid2, bn, "BLNK"> r(m, {B, f.L, N, K});
    fill_normal(r, 1.0, 13, 3);
    const attention_options opts{f.causal, offset};
    auto forward = [&](tape& t, attention_memory memory) {
      attention_options o = opts;
      o.memory = memory;
      return f.keys == lengths_given    ? dot_product_attention(t.use(q), t.use(k), t.use(v), lengths, scale, o)
             : f.keys == paddings_given ? dot_product_attention(t.use(q), t.use(k), t.use(v), paddings, scale, o)
                                        : dot_product_attention(t.use(q), t.use(k), t.use(v), scale, o);
    };
    const auto sees = [&](index_t b, index_t l, index_t t) {
      if (f.causal && t > offset + l) return false;
      if (f.keys == lengths_given) return t < length_of(b, f.T);
      return f.keys != paddings_given || !padded_key(b, t);
    };
    const auto sees_none = [&](index_t b, index_t l) {
      for (index_t t = 0; t < f.T; ++t)
        if (sees(b, l, t)) return false;
      return true;
    };
    const auto run = [&](attention_memory memory) {
      tape t(ps);
      auto o = forward(t, memory);
      auto value = gather(o.value());
      t.backward(reshard<replicate>(einsum<"BLNK,BLNK->">(o, t.constant(r))));
      return std::array{value, gather(q.grad()), gather(k.grad()), gather(v.grad())};
    };
    {  // the forward alone communicates nothing
      collective_recorder rec;
      tape t(ps, tape::no_grad);
      (void)forward(t, attention_memory::keep_probabilities);
      GSHARD_REQUIRE(rec.events().empty());
    }
    const auto kept = run(attention_memory::keep_probabilities);
    const auto recomputed = run(attention_memory::recompute_probabilities);
    const auto reference = attention_reference(gather(q.value()), gather(k.value()), gather(v.value()), scale, sees);
    GSHARD_REQUIRE(attention_worst(kept[0], reference) < 1e-12);
    for (std::size_t i = 0; i < kept.size(); ++i) GSHARD_REQUIRE(attention_worst(kept[i], recomputed[i]) == 0.0);
    // A row that sees no key: output 0 and no gradient for its query; keys
    // past a sequence's length (padding) get no gradient either.
    for (index_t b = 0; b < B; ++b)
      for (index_t l = 0; l < f.L; ++l)
        for (index_t n = 0; n < N; ++n)
          for (index_t c = 0; c < K; ++c) {
            if (sees_none(b, l)) GSHARD_REQUIRE((kept[0](b, l, n, c) == 0.0 && kept[1](b, l, n, c) == 0.0));
            GSHARD_REQUIRE(std::isfinite(kept[0](b, l, n, c)));
          }
    for (index_t b = 0; b < B; ++b)
      for (index_t tt = 0; tt < f.T; ++tt)
        if ((f.keys == lengths_given && tt >= length_of(b, f.T)) || (f.keys == paddings_given && padded_key(b, tt)))
          for (index_t n = 0; n < N; ++n)
            for (index_t c = 0; c < K; ++c) GSHARD_REQUIRE((kept[2](b, tt, n, c) == 0.0 && kept[3](b, tt, n, c) == 0.0));
    // The plain tensors' form computes the same.
    const auto plain =
        gather(f.keys == lengths_given    ? dot_product_attention(q.value(), k.value(), v.value(), lengths, scale, opts)
               : f.keys == paddings_given ? dot_product_attention(q.value(), k.value(), v.value(), paddings, scale, opts)
                                          : dot_product_attention(q.value(), k.value(), v.value(), scale, opts));
    GSHARD_REQUIRE(attention_worst(plain, kept[0]) == 0.0);
    if (f.L <= 40 && f.T <= 40) {  // finite differences, blocks of 32 straddling the padding
      auto loss = [&](tape& t) { return reshard<replicate>(einsum<"BLNK,BLNK->">(forward(t, attention_memory::keep_probabilities), t.constant(r))); };
      const double worst = fd_check_params(ps, loss, q, k, v);
      INFO("finite differences: worst relative error " << worst);
      GSHARD_REQUIRE(worst < 1e-6);
    }
  }
  // Bad key lengths: extents refused on every rank; a length outside [0, T]
  // ends the job (test/faults.cpp, key_length); causal with a query offset that does not
  // put the last query at the last key: refused.
  param<tensor<double, 4, grid2, bn, "BLNK">> q(ps, "q_bad", {B, 4, N, K}, init::normal(1.0));
  param<tensor<double, 4, grid2, bn, "BTNK">> k(ps, "k_bad", {B, 6, N, K}, init::normal(1.0));
  tensor<std::int32_t, 1, grid2, bs> wrong(m, {2 * B});
  tape t(ps, tape::no_grad);
  GSHARD_REQUIRE_THROWS_WITH(dot_product_attention(t.use(q), t.use(k), t.use(k), wrong, scale), shape_error,
                             "gshard::dot_product_attention: key_lengths i32[" + std::to_string(2 * B));
  GSHARD_REQUIRE_THROWS_WITH(dot_product_attention(t.use(q), t.use(k), t.use(k), 0.0), error,
                             "gshard::dot_product_attention: scale = 0.000000; a finite number > 0");
  GSHARD_REQUIRE_THROWS_WITH(dot_product_attention(t.use(q), t.use(k), t.use(k), scale, {.causal = true, .query_offset = 1}),
                             shape_error, "gshard::dot_product_attention: causal attention of L = 4 queries at query_offset 1 over T = 6 keys");
}

TEST_CASE("autodiff: under bf16 GEMMs attention and relu keep the bf16 copies their GEMMs read, not their fp32 values",
          "[autodiff][attention][bf16]") {
  // Attention's GEMMs read q, k, v and the probabilities rounded to bf16:
  // its rule keeps those copies, the backward multiplies them and its
  // dS = P ⊙ (dP − Σ dP ⊙ P) reads the rounded P. A ReLU keeps the bf16
  // copy of its output that the next einsum multiplies. Their fp32 values
  // are then freed after the forward.
  const int P = world_size();
  const auto sizes = data_model_sizes(P);
  grid2 m(MPI_COMM_WORLD, sizes);
  parameters ps(m, 10);
  using bn = sharding<split<0, "data">, split<2, "model">>;  // [B{data},L,N{model},K]
  using bs = sharding<split<0, "data">>;
  const index_t B = 4 * sizes[0], N = 2 * sizes[1], K = 8;
  const double scale = 0.35;
  const bool native = detail::gemm_bf16_native();
  INFO((native ? "bf16 units: the rounding path" : "no bf16 units: fp32 GEMMs only"));
  auto same_bits = [](const auto& x, const auto& y) {
    return x.size() == y.size() && std::equal(x.data(), x.data() + x.size(), y.data(), [](float u, float v) {
             return std::bit_cast<std::uint32_t>(u) == std::bit_cast<std::uint32_t>(v);
           });
  };
  enum keys_given { all_keys, lengths_given, paddings_given };
  struct form {
    index_t L, T;
    bool causal;
    keys_given keys;
    index_t rows;  // of a block; 0: the backend's (on oneDNN 128: one block for these sequences)
  };
  for (const form f : {form{40, 40, true, all_keys, 16}, form{40, 40, true, all_keys, 0}, form{5, 37, false, lengths_given, 0},
                       form{36, 36, true, paddings_given, 16}}) {
    const detail::attention_block_scope blocks(f.rows);
    const std::string at = std::to_string(f.L) + "x" + std::to_string(f.T) + "k" + std::to_string(int(f.keys)) + "r" +
                           std::to_string(f.rows);
    param<tensor<float, 4, grid2, bn, "BLNK">> q(ps, "q" + at, {B, f.L, N, K}, init::normal(1.0));
    param<tensor<float, 4, grid2, bn, "BTNK">> k(ps, "k" + at, {B, f.T, N, K}, init::normal(1.0));
    param<tensor<float, 4, grid2, bn, "BTNK">> v(ps, "v" + at, {B, f.T, N, K}, init::normal(1.0));
    tensor<float, 4, grid2, bn, "BLNK"> r(m, {B, f.L, N, K});
    fill_normal(r, 1.0, 14, 3);
    local_tensor<std::int32_t, 1> lengths_global(B);
    local_tensor<float, 2> paddings_global(B, f.T);
    for (index_t b = 0; b < B; ++b) {  // all keys, none (the last sequence: its rows see nothing), some
      lengths_global(b) = std::int32_t(b % 2 == 0 ? f.T : b == B - 1 ? 0 : (3 * b) % (f.T + 1));
      for (index_t t = 0; t < f.T; ++t)  // holes in every other sequence; the last one all padding
        paddings_global(b, t) = b == B - 1 || (b % 2 == 1 && (t + b) % 3 == 1) ? 1.0f : 0.0f;
    }
    const auto lengths = distribute<bs>(m, lengths_global);
    const auto paddings = distribute<bs>(m, paddings_global);
    const attention_options opts{.causal = f.causal};
    // backward_in: the rows of the blocks in force when the backward runs
    // (it runs the forward's blocks whatever they are).
    const auto run = [&](matmul_precision precision, attention_memory memory, index_t backward_in = -1) {
      tape t(ps);
      const matmul_precision_scope s(precision);
      const attention_options o{.causal = f.causal, .memory = memory};
      auto out = f.keys == lengths_given    ? dot_product_attention(t.use(q), t.use(k), t.use(v), lengths, scale, o)
                 : f.keys == paddings_given ? dot_product_attention(t.use(q), t.use(k), t.use(v), paddings, scale, o)
                                            : dot_product_attention(t.use(q), t.use(k), t.use(v), scale, o);
      auto value = gather(out.value());
      std::optional<detail::attention_block_scope> later;
      if (backward_in >= 0) later.emplace(backward_in);
      t.backward(reshard<replicate>(einsum<"BLNK,BLNK->">(out, t.constant(r))));
      return std::array{value, gather(q.grad()), gather(k.grad()), gather(v.grad())};
    };
    const auto f32 = run(matmul_precision::f32, attention_memory::keep_probabilities);
    const auto kept = run(matmul_precision::bf16, attention_memory::keep_probabilities);
    const auto again = run(matmul_precision::bf16, attention_memory::recompute_probabilities);
    if (f.rows != 0) {  // blocks of 128 rows (oneDNN) or 32 in force at the backward: the same bits
      const auto later = run(matmul_precision::bf16, attention_memory::recompute_probabilities, 0);
      for (std::size_t i = 0; i < later.size(); ++i) GSHARD_REQUIRE(same_bits(later[i], again[i]));
    }
    INFO("L " << f.L << ", T " << f.T << (f.causal ? ", causal" : "")
              << (f.keys == lengths_given ? ", key lengths" : f.keys == paddings_given ? ", key paddings" : "") << ", blocks of "
              << detail::attention_block_rows<float>() << " rows");
    {  // the value is the tensor form's under bf16, to the bit
      const matmul_precision_scope s(matmul_precision::bf16);
      const auto want =
          gather(f.keys == lengths_given    ? dot_product_attention(q.value(), k.value(), v.value(), lengths, scale, opts)
                 : f.keys == paddings_given ? dot_product_attention(q.value(), k.value(), v.value(), paddings, scale, opts)
                                            : dot_product_attention(q.value(), k.value(), v.value(), scale, opts));
      GSHARD_REQUIRE(same_bits(kept[0], want));
      GSHARD_REQUIRE(same_bits(again[0], want));
    }
    // dv = Pᵀ·dout multiplies the same rounded P either way; dq and dk
    // differ by dS's P (rounded when kept, fp32 when computed again).
    GSHARD_REQUIRE(same_bits(kept[3], again[3]));
    if (native) GSHARD_REQUIRE(!same_bits(kept[1], again[1]));  // the kept P is the rounded one
    if (!native) GSHARD_REQUIRE((same_bits(kept[1], f32[1]) && same_bits(kept[2], f32[2]) && same_bits(kept[3], f32[3])));
    // Against fp32: each logit's products and P·v's carry operands rounded
    // to bf16 (2⁻⁸ relative each), P and dS once more.
    for (std::size_t i = 1; i < 4; ++i) {
      double largest = 0, worst_kept = 0, worst_again = 0;
      for (index_t e = 0; e < f32[i].size(); ++e) {
        largest = std::max(largest, double(std::abs(f32[i].data()[e])));
        worst_kept = std::max(worst_kept, double(std::abs(kept[i].data()[e] - f32[i].data()[e])));
        worst_again = std::max(worst_again, double(std::abs(again[i].data()[e] - f32[i].data()[e])));
      }
      INFO("gradient " << i << " (q, k, v): kept " << worst_kept << ", computed again " << worst_again << " of " << largest);
      GSHARD_REQUIRE(worst_kept <= 8 * 0x1p-8 * largest);
      GSHARD_REQUIRE(worst_again <= 8 * 0x1p-8 * largest);
    }
  }

  // What the rules keep: attention's q (an einsum's output), a ReLU's
  // output and an RMS norm's input are freed after the forward where the
  // GEMMs round, and kept where they do not.
  param<tensor<float, 3, grid2, bs, "BLM">> x(ps, "x", {B, 12, 16}, init::normal(1.0));
  param<tensor<float, 3, grid2, sharding<split<1, "model">>, "MNK">> wq(ps, "wq", {16, N, K}, init::normal(0.25));
  param<tensor<float, 2, grid2, sharding<split<1, "model">>, "MH">> w1(ps, "w1", {16, 8 * sizes[1]}, init::normal(0.25));
  param<tensor<float, 2, grid2, sharding<split<0, "model">>, "HM">> w2(ps, "w2", {8 * sizes[1], 16}, init::normal(0.25));
  param<tensor<float, 1, grid2, replicate>> gain(ps, "gain", {16}, init::normal(1.0));
  using W1 = tensor<float, 2, grid2, sharding<split<1, "model">>, "MH">;
  using W2 = tensor<float, 2, grid2, sharding<split<0, "model">>, "HM">;
  const ffn_weights<W1, W2> relu_ffn(ps, ffn_kind::relu, {"r1", "r1_up", "r2"}, {16, 4 * sizes[1]}, {4 * sizes[1], 16});
  const ffn_weights<W1, W2> swiglu_ffn(ps, ffn_kind::swiglu, {"s1", "s1_up", "s2"}, {16, 4 * sizes[1]}, {4 * sizes[1], 16});
  std::array<std::array<std::vector<float>, 2>, 2> norm_grads;  // [f32, bf16][w2, the gain]
  for (const matmul_precision precision : {matmul_precision::f32, matmul_precision::bf16}) {
    const matmul_precision_scope s(precision);
    tape t(ps);
    std::weak_ptr<const void> q_alive, relu_alive;
    auto o = [&] {
      auto qv = einsum<"BLM,MNK->BLNK">(t.use(x), wq);
      q_alive = qv.shared();
      return causal_attention(qv, relabel<"BTNK">(einsum<"BLM,MNK->BLNK">(t.use(x), wq)),
                              relabel<"BTNK">(einsum<"BLM,MNK->BLNK">(t.use(x), wq)), scale);
    }();
    const bool rounds = precision == matmul_precision::bf16 && native;
    INFO((rounds ? "GEMMs round" : "fp32 GEMMs"));
    auto y = [&] {
      auto h = relu(einsum<"BLM,MH->BLH">(t.use(x), w1));
      relu_alive = h.shared();
      auto out = einsum<"BLH,HM->BLM">(h, w2);
      // One bf16 copy of h, which the ReLU's rule and the einsum's keep
      // (the tape's cache holds it weakly), and nobody else.
      using H16 = with_element<detail::tensor_of<decltype(h)>, bf16>;
      const auto copy = t.derived<H16>(h.shared(), [](const auto& u) { return convert<bf16>(u); });
      GSHARD_REQUIRE(copy.use_count() == (rounds ? 3 : 1));
      return out;
    }();
    GSHARD_REQUIRE(q_alive.expired() == rounds);
    GSHARD_REQUIRE(relu_alive.expired() == rounds);
    {
      // An rvalue var given to an einsum, as ffn gives its hidden
      // activations to the second GEMM: where the GEMMs round, it is let go
      // once rounded and its fp32 value freed before the einsum returns;
      // where they do not, the rule keeps it.
      auto h = relu(einsum<"BLM,MH->BLH">(t.use(x), w1));
      const std::weak_ptr<const void> h_alive = h.shared();
      const auto out = einsum<"BLH,HM->BLM">(std::move(h), w2);
      GSHARD_REQUIRE(h_alive.expired() == rounds);
    }
    for (const ffn_weights<W1, W2>* fw : {&relu_ffn, &swiglu_ffn}) {
      // ffn gives up an rvalue input at its last up-projection.
      auto in = 1.0 * t.use(x);  // an owned var (x is a view)
      const std::weak_ptr<const void> in_alive = in.shared();
      const auto out = ffn<natural_sharding>(std::move(in), *fw);
      INFO((fw == &relu_ffn ? "relu" : "swiglu"));
      GSHARD_REQUIRE(in_alive.expired() == rounds);
    }
    std::weak_ptr<const void> norm_in_alive;
    auto normed = [&] {
      auto ys = all_reduce<"model">(std::move(y));
      norm_in_alive = ys.shared();
      return rms_norm(ys, gain);
    }();
    GSHARD_REQUIRE(norm_in_alive.expired() == rounds);
    t.backward(reshard<replicate>(einsum<"BLNK,BLNK->">(o, o)) + reshard<replicate>(einsum<"BLM,BLM->">(normed, normed)));
    const auto g1 = gather(w1.grad());
    GSHARD_REQUIRE(std::any_of(g1.data(), g1.data() + g1.size(), [](float g) { return g != 0.0f; }));
    const auto g2 = gather(w2.grad());
    const auto& gg = gain.grad();
    norm_grads[precision == matmul_precision::bf16 ? 1 : 0] = {std::vector<float>(g2.data(), g2.data() + g2.size()),
                                                               std::vector<float>(gg.data(), gg.data() + 16)};
  }
  // The norm's gradients (w2's passes through it; the gain's is its own)
  // from the rounded x and fp32 statistics: within bf16 roundings of fp32's.
  for (std::size_t i = 0; i < 2; ++i) {
    const auto& want = norm_grads[0][i];
    const auto& got = norm_grads[1][i];
    double largest = 0, worst = 0;
    for (std::size_t e = 0; e < want.size(); ++e) {
      largest = std::max(largest, double(std::abs(want[e])));
      worst = std::max(worst, double(std::abs(got[e] - want[e])));
    }
    INFO("gradient of " << (i == 0 ? "w2" : "the gain") << ": " << worst << " of " << largest);
    GSHARD_REQUIRE(largest > 0);
    GSHARD_REQUIRE(worst <= 8 * 0x1p-8 * largest);
    if (!native) GSHARD_REQUIRE(worst == 0);
  }

  // The ReLU's gradient passes where the kept copy is > 0: y > 2⁻¹³⁴ (at
  // most 2⁻¹³⁴ rounds to 0) where the GEMMs round, y > 0 where they do not.
  grid1 line(MPI_COMM_WORLD);
  parameters ps1(line, 11);
  const std::array<float, 7> values{-1.0f, 0.0f, 0x1p-140f, 0x1p-134f, 0x1p-133f, 0x1p-130f, 1.0f};
  param<tensor<float, 2, grid1, rows>> z(ps1, "z", {index_t(P), 7}, init::zeros());
  local_tensor<float, 2> ones(index_t(P), 7);
  ones.setConstant(1.0f);
  for (index_t i = 0; i < z.value().local().dimension(0); ++i)
    for (index_t j = 0; j < 7; ++j) z.value().local()(i, j) = values[std::size_t(j)];
  {
    const matmul_precision_scope s(matmul_precision::bf16);
    tape t(ps1);
    t.backward(all_reduce<"x">(einsum<"ij,ij->">(relu(t.use(z)), t.constant(distribute<rows>(line, ones)))));
  }
  for (index_t i = 0; i < z.grad().local().dimension(0); ++i)
    for (index_t j = 0; j < 7; ++j) {
      INFO("relu at " << values[std::size_t(j)]);
      GSHARD_REQUIRE(z.grad().local()(i, j) == (values[std::size_t(j)] > (native ? 0x1p-134f : 0.0f) ? 1.0f : 0.0f));
    }
}

TEST_CASE("autodiff: an activation held in bf16 is its einsum's output rounded; attention, relu and einsums read it to the bit",
          "[autodiff][attention][bf16]") {
  // einsum<.., bf16_activation> under bf16 GEMMs writes its product in
  // bf16: the readers that round it anyway (attention's GEMMs, ReLU then
  // the next einsum) compute what they computed from the fp32 product, so
  // a block built of held activations gives the plain block's value and
  // gradients to the bit. Elsewhere the option changes nothing. (Without
  // bf16 units only the last parts below test the held form.)
  const int P = world_size();
  const auto sizes = data_model_sizes(P);
  grid2 m(MPI_COMM_WORLD, sizes);
  parameters ps(m, 12);
  using bs = sharding<split<0, "data">>;
  using by_heads = sharding<split<1, "model">>;
  const bool native = detail::gemm_bf16_native();
  INFO((native ? "bf16 units: the held path" : "no bf16 units: fp32 GEMMs only"));
  auto same_bits = [](const auto& u, const auto& v) {
    return u.size() == v.size() && std::equal(u.data(), u.data() + u.size(), v.data(), [](float a, float b) {
             return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
           });
  };
  // L = 40: one block of rows on oneDNN, two of 32 elsewhere (attention_block_rows).
  // One sequence and one head as well: a rank of more than one along an
  // axis then holds an empty shard.
  const index_t L = 40, M = 16, K = 8, H = 6 * sizes[1];
  for (const auto [B, N] : {std::array<index_t, 2>{2 * sizes[0], 2 * sizes[1]}, std::array<index_t, 2>{1, 1}}) {
    INFO("B " << B << ", N " << N);
    const std::string at = std::to_string(B) + "x" + std::to_string(N);
    param<tensor<float, 3, grid2, bs, "BLM">> x(ps, "x" + at, {B, L, M}, init::normal(1.0));
    param<tensor<float, 3, grid2, by_heads, "MNK">> wq(ps, "wq" + at, {M, N, K}, init::normal(0.3)),
        wk(ps, "wk" + at, {M, N, K}, init::normal(0.3)), wv(ps, "wv" + at, {M, N, K}, init::normal(0.3));
    param<tensor<float, 3, grid2, sharding<split<0, "model">>, "NKM">> wo(ps, "wo" + at, {N, K, M}, init::normal(0.3));
    param<tensor<float, 2, grid2, by_heads, "MH">> w1(ps, "w1" + at, {M, H}, init::normal(0.3));
    param<tensor<float, 2, grid2, sharding<split<0, "model">>, "HM">> w2(ps, "w2" + at, {H, M}, init::normal(0.3));
    tensor<float, 3, grid2, bs, "BLM"> r(m, {B, L, M});
    fill_normal(r, 1.0, 15, 3);
    // The block: attention on q, k, v projected from x, its output
    // projected back, plus a ReLU FFN on x; the loss Σ out·r. Returns the
    // vars held in bf16 (q, k, v, the ReLU's output), and in `gemms` the
    // GEMMs the step ran, as (m, n, k, operand bytes).
    using gemm_shape = std::array<std::int64_t, 4>;
    const auto run = [&](matmul_precision precision, bool held, std::vector<gemm_shape>& gemms) {
      const matmul_precision_scope s(precision);
      gemm_recorder recorder;
      tape t(ps);
      int held_vars = 0;
      const auto count = [&](const auto& v) { held_vars += v.held() != nullptr; };
      const auto project = [&](const auto& w) {
        auto p = held ? einsum<"BLM,MNK->BLNK", natural_sharding, bf16_activation>(t.use(x), w)
                      : einsum<"BLM,MNK->BLNK">(t.use(x), w);
        count(p);
        return p;
      };
      auto o = causal_attention(project(wq), relabel<"BTNK">(project(wk)), relabel<"BTNK">(project(wv)), 0.35);
      auto a = relu(held ? einsum<"BLM,MH->BLH", natural_sharding, bf16_activation>(t.use(x), w1)
                         : einsum<"BLM,MH->BLH">(t.use(x), w1));
      count(a);
      auto out = all_reduce<"model">(einsum<"BLNK,NKM->BLM">(o, wo) + einsum<"BLH,HM->BLM">(std::move(a), w2));
      const auto flat = [](const auto& u) {
        const auto g = gather(u);
        return std::vector<float>(g.data(), g.data() + g.size());
      };
      auto value = flat(out.value());
      t.backward(reshard<replicate>(einsum<"BLM,BLM->">(out, t.constant(r))));
      for (const gemm_call& g : recorder.calls()) gemms.push_back({g.m, g.n, g.k, g.element_bytes});
      return std::pair{held_vars, std::array{value, flat(x.grad()), flat(wq.grad()), flat(wk.grad()), flat(wv.grad()),
                                             flat(w1.grad()), flat(w2.grad())}};
    };
    for (const matmul_precision precision : {matmul_precision::f32, matmul_precision::bf16}) {
      const bool rounds = precision == matmul_precision::bf16 && native;
      INFO((rounds ? "GEMMs round" : "fp32 GEMMs"));
      std::vector<gemm_shape> plain_gemms, held_gemms;
      const auto [plain_held, plain] = run(precision, false, plain_gemms);
      const auto [held_held, held] = run(precision, true, held_gemms);
      GSHARD_REQUIRE(plain_held == 0);
      GSHARD_REQUIRE(held_held == (rounds ? 4 : 0));  // held only where the GEMMs round
      // The same GEMMs: attention on held copies runs the blocks fp32 q, k, v would.
      if (B == 2 * sizes[0]) GSHARD_REQUIRE(!plain_gemms.empty());  // (a rank of empty shards multiplies nothing)
      GSHARD_REQUIRE(held_gemms == plain_gemms);
      for (std::size_t i = 0; i < plain.size(); ++i) {
        INFO("result " << i << " (the value, then the gradients of x, wq, wk, wv, w1, w2)");
        GSHARD_REQUIRE(same_bits(held[i], plain[i]));
      }
    }
    if (B != 2 * sizes[0]) continue;

    // A held var's value: the einsum's fp32 output rounded to nearest even,
    // widened once for all its copies; relabelling keeps it held.
    const matmul_precision_scope s(matmul_precision::bf16);
    tape t(ps);
    auto q = einsum<"BLM,MNK->BLNK", natural_sharding, bf16_activation>(t.use(x), wq);
    GSHARD_REQUIRE((q.held() != nullptr) == native);
    const auto want = convert<float>(convert<bf16>(einsum<"BLM,MNK->BLNK">(x.value(), wq.value())));
    GSHARD_REQUIRE(same_bits(q.value().local(), want.local()));
    GSHARD_REQUIRE(q.extents() == want.extents());
    // Untracked (the tape not recording): an ordinary fp32 einsum.
    tape quiet(ps, tape::no_grad);
    GSHARD_REQUIRE(einsum<"BLM,MNK->BLNK", natural_sharding, bf16_activation>(quiet.use(x), wq).held() == nullptr);
  }

  // The held form itself, on any machine: a var made held (as the option
  // makes it) reads as its bf16 values widened, once for all its copies,
  // is named as the fp32 tensor it stands for, stays held (its storage
  // moved, not copied) through an rvalue relabel, and take_held() of a var
  // not held says so.
  {
    using X = tensor<float, 2, grid2, bs, "BM">;
    X v(m, {2 * sizes[0] + 1, 5});  // uneven over the data axis where it has more than one rank
    fill_normal(v, 1.0, 16, 3);
    tape t(ps);
    auto h = t.output_held(convert<bf16>(v), true);
    static_assert(std::is_same_v<decltype(h), var<X>>);
    const auto copy = h;
    const auto want = convert<float>(convert<bf16>(v));
    GSHARD_REQUIRE(same_bits(h.value().local(), want.local()));
    GSHARD_REQUIRE(&copy.value() == &h.value());
    GSHARD_REQUIRE(h.notation() == v.notation());
    GSHARD_REQUIRE(h.extents() == v.extents());
    auto moved = relabel<"TM">(std::move(h));
    GSHARD_REQUIRE(moved.held() != nullptr);
    GSHARD_REQUIRE(same_bits(moved.value().local(), want.local()));
    auto alone = relabel<"SM">(relabel<"TM">(t.output_held(convert<bf16>(v), true)));
    const bf16* before = alone.held()->data();
    auto last = relabel<"RM">(std::move(alone));
    GSHARD_REQUIRE(last.held()->data() == before);  // nothing else held it: moved
    var<X> plain = t.constant(v);
    GSHARD_REQUIRE_THROWS_WITH(std::move(plain).take_held(), error,
                               "gshard::var: take_held() of " + v.notation() + ", a var not held in bf16");
  }

  // ReLU on held values is relu_op::f on each widened value, bit for bit:
  // x <= 0 (-0 and -inf too) gives +0, NaN of either sign stays. 40 values:
  // a block of 32 and a tail.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::array<float, 10> kinds{-inf, -3.5f, -0x1p-130f, -0.0f, 0.0f, 0x1p-130f, 2.25f, inf, nan, -nan};
  std::vector<bf16> held(40);
  for (std::size_t i = 0; i < held.size(); ++i) held[i] = bf16(kinds[(i * 7) % kinds.size()]);
  const std::vector<bf16> before = held;
  detail::relu_in_place(held.data(), index_t(held.size()));
  for (std::size_t i = 0; i < held.size(); ++i) {
    INFO("relu of " << float(before[i]) << " at " << i);
    const float want = detail::relu_op::f(float(before[i]));
    GSHARD_REQUIRE(std::bit_cast<std::uint32_t>(float(held[i])) == std::bit_cast<std::uint32_t>(want));
  }
}

TEST_CASE("autodiff: the RMS norm's backward from its bf16 input uses x rounded and the forward's fp32 statistic",
          "[autodiff][bf16]") {
  // The kernels alone, so every machine runs them (the tape takes them
  // only where the GEMMs round): the forward with its statistics is the
  // plain norm to the bit; the backward from x rounded to bf16 and the
  // forward's r is the formula's, in double, on those two.
  grid1 line(MPI_COMM_WORLD);
  const index_t P = world_size(), R = 3, M = 37;  // rows of M elements: not a whole number of packets
  tensor<float, 2, grid1, rows> x(line, {R * P, M}), dy(line, {R * P, M});
  fill_normal(x, 1.0, 21, 3);
  fill_normal(dy, 1.0, 22, 3);
  local_tensor<float, 1> scale(M);
  for (index_t i = 0; i < M; ++i) scale(i) = 0.5f + 0.03f * float(i);
  const double eps = 1e-6;
  std::vector<double> inverse(static_cast<std::size_t>(R));
  const auto y = detail::rms_norm_keeping(x, scale, eps, inverse.data());
  const auto plain = rms_norm(x, scale, eps);
  GSHARD_REQUIRE(std::equal(y.data(), y.data() + R * M, plain.data(), [](float u, float v) {
    return std::bit_cast<std::uint32_t>(u) == std::bit_cast<std::uint32_t>(v);
  }));
  std::vector<bf16> x16(static_cast<std::size_t>(R * M));
  detail::to_bf16(x.data(), x16.size(), x16.data());
  std::vector<float> ds(static_cast<std::size_t>(M), 0.0f);
  const auto dx = detail::rms_norm_backward_rounded(dy, x16.data(), inverse.data(), scale, ds.data());
  double worst = 0, largest = 0, worst_ds = 0, largest_ds = 0;
  std::vector<double> want_ds(static_cast<std::size_t>(M), 0.0);
  for (index_t r = 0; r < R; ++r) {
    const float* xr = x.data() + r * M;
    const float* g = dy.data() + r * M;
    double squares = 0, dot = 0;
    for (index_t i = 0; i < M; ++i) squares += double(xr[i]) * double(xr[i]);
    const double inv = 1.0 / std::sqrt(squares / double(M) + eps);  // from the fp32 x
    GSHARD_REQUIRE(std::abs(inverse[std::size_t(r)] - inv) <= 1e-6 * inv);
    std::vector<double> rounded(static_cast<std::size_t>(M));
    for (index_t i = 0; i < M; ++i) rounded[std::size_t(i)] = double(float(x16[std::size_t(r * M + i)]));
    for (index_t i = 0; i < M; ++i) dot += double(g[i]) * double(scale(i)) * rounded[std::size_t(i)];
    for (index_t i = 0; i < M; ++i) {
      const double want = double(scale(i)) * inv * double(g[i]) - rounded[std::size_t(i)] * inv * inv * inv * dot / double(M);
      worst = std::max(worst, std::abs(double(dx.data()[r * M + i]) - want));
      largest = std::max(largest, std::abs(want));
      want_ds[std::size_t(i)] += double(g[i]) * rounded[std::size_t(i)] * inv;
    }
  }
  for (index_t i = 0; i < M; ++i) {
    worst_ds = std::max(worst_ds, std::abs(double(ds[std::size_t(i)]) - want_ds[std::size_t(i)]));
    largest_ds = std::max(largest_ds, std::abs(want_ds[std::size_t(i)]));
  }
  // fp32 arithmetic on the rounded x: within a few 2⁻²⁴. The fp32 x, or r
  // from the rounded x, would be off by about 2⁻⁹ and 2⁻¹² of the largest.
  INFO("dx " << worst << " of " << largest << ", the scale's " << worst_ds << " of " << largest_ds);
  GSHARD_REQUIRE(worst <= 1e-5 * largest);
  GSHARD_REQUIRE(worst_ds <= 1e-5 * largest_ds);
}

TEST_CASE("autodiff: causal_attention in float; operands that do not fit", "[autodiff][attention][errors]") {
  const int P = world_size();
  grid1 m(MPI_COMM_WORLD);
  parameters ps(m, 8);
  using b_ = sharding<split<0, "x">>;
  param<tensor<float, 4, grid1, b_>> q(ps, "q", {index_t(P), 130, 2, 16}, init::normal(1.0));
  param<tensor<float, 4, grid1, b_>> k(ps, "k", {index_t(P), 130, 2, 16}, init::normal(1.0));
  param<tensor<float, 4, grid1, b_>> v(ps, "v", {index_t(P), 130, 2, 16}, init::normal(1.0));
  tape t(ps, tape::no_grad);
  const auto o = gather(causal_attention(t.use(q), t.use(k), t.use(v), 0.25).value());
  const auto want = attention_reference(gather(q.value()), gather(k.value()), gather(v.value()), 0.25);
  GSHARD_REQUIRE(attention_worst(o, want) < 2e-6);
  // The plain tensors' form computes the same.
  const auto plain = gather(causal_attention(q.value(), k.value(), v.value(), 0.25));
  GSHARD_REQUIRE(attention_worst(o, plain) == 0.0);
  GSHARD_REQUIRE_THROWS_WITH(detail::attention_block_scope(-1), error,
                             "gshard::attention_block_scope: rows = -1; >= 1, or 0 for the default");
  // Extents that do not fit: the same error on every rank, before any work.
  param<tensor<float, 4, grid1, b_>> k_short(ps, "k_short", {index_t(P), 130, 2, 8}, init::normal(1.0));
  const std::string p = std::to_string(P);
  GSHARD_REQUIRE_THROWS_WITH(causal_attention(t.use(q), t.use(k_short), t.use(v), 0.25), shape_error,
                             "gshard::causal_attention: q f32[" + p + "{x},130,2,16], k f32[" + p + "{x},130,2,8], v f32[" +
                                 p + "{x},130,2,16]: k and v have equal extents [B, T, N, K], and q [B, L, N, K] the same B, N and K");
  // Causal attention with L != T and no query offset: refused, naming the fix.
  param<tensor<float, 4, grid1, b_>> k_long(ps, "k_long", {index_t(P), 131, 2, 16}, init::normal(1.0));
  GSHARD_REQUIRE_THROWS_WITH(causal_attention(t.use(q), t.use(k_long), t.use(k_long), 0.25), shape_error,
                             "gshard::causal_attention: causal attention of L = 130 queries at query_offset 0 over T = 131 "
                             "keys; the last query must sit at the last key (query_offset + L = T, as when L new queries "
                             "follow T - L cached keys), or drop causal for cross-attention");
  // No positions to attend to: zero; no head dim: nothing.
  param<tensor<float, 4, grid1, b_>> none(ps, "none", {index_t(P), 0, 2, 16}, init::normal(1.0));
  const auto zero = gather(dot_product_attention(t.use(q), t.use(none), t.use(none), 0.25).value());
  GSHARD_REQUIRE(zero.size() == q.value().size() / P * P);
  std::remove_cvref_t<decltype(zero)> zeros(zero.dimensions());
  zeros.setZero();
  GSHARD_REQUIRE(attention_worst(zero, zeros) == 0.0);
}

TEST_CASE("autodiff: the maximum and minimum over a dim, split or whole, pass the gradient to the extreme", "[autodiff][grad]") {
  const int P = world_size();
  grid1 m(MPI_COMM_WORLD);
  parameters ps(m, 4);
  param<tensor<double, 2, grid1, rows>> x(ps, "x", {2 * index_t(P), 6}, init::normal(1.0));
  // Over the split dim: one all_reduce(max) forward, one all_reduce(min) of the winners' indices backward.
  auto over_split = [&](tape& t) { return against(t, reduce_max<0>(t.use(x)), 1); };
  // Over the whole dim: local; the rows stay split, so the scalar is partial until the all_reduce.
  auto over_whole = [&](tape& t) { return all_reduce<"x">(against(t, reduce_min<1>(t.use(x)), 2)); };
  const double worst = std::max(fd_check_params(ps, over_split, x), fd_check_params(ps, over_whole, x));
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
  {  // the gradient is dy at the global argmax only: one nonzero per column, summing to the column's dy
    tape t(ps);
    t.backward(einsum<"a->">(relabel<"">(reduce_max<0>(t.use(x)))));
    const auto g = gather(x.grad());
    const auto v = gather(x.value());
    bool ok = true;
    for (index_t c = 0; c < 6; ++c) {
      index_t best = 0, ones = 0;
      for (index_t r = 0; r < g.dimension(0); ++r) {
        if (v(r, c) > v(best, c)) best = r;
        ones += g(r, c) != 0;
      }
      ok = ok && ones == 1 && g(best, c) == 1.0;
    }
    GSHARD_REQUIRE(ok);
  }
}

TEST_CASE("autodiff: reshards and the one-collective forms transpose their collectives", "[autodiff][grad]") {
  const int P = world_size();
  const auto sizes = data_model_sizes(P);
  grid2 m(MPI_COMM_WORLD, sizes);
  parameters ps(m, 3);
  using bm = sharding<split<0, "data">, split<1, "model">>;
  param<tensor<double, 2, grid2, bm, "BM">> x(ps, "x", {2 * index_t(P), 2 * index_t(P)}, init::normal(1.0));
  param<tensor<double, 2, grid2, replicate, "MN">> w(ps, "w", {2 * index_t(P), 2 * index_t(P)}, init::normal(1.0));
  auto loss = [&](tape& t) {
    auto g = all_gather<"model">(t.use(x));                              // [B{data},M]
    auto a = reshard<rules<on<'M', "data">>>(g);                         // all_to_all over data: [B,M{data}]
    auto h = einsum<"BM,MN->BN">(a, w);                                  // partial{data}
    auto r = reduce_scatter<"data", 1>(std::move(h));                    // [B,N{data}]
    auto back = all_to_all<"data", 0>(relabel<"BN">(std::move(r)));      // [B{data},N]
    return all_reduce<"data">(against(t, back, 1)) + against(t, reshard<replicate>(g), 2);
  };
  const double worst = fd_check_params(ps, loss, x, w);
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
  // The same chain where dims do not divide: M = 2 over data (empty shards
  // where data has more ranks), N = 2P + 1 (short shards), through the
  // all_to_all, the einsum's pending sum, the reduce_scatter and back.
  parameters ps2(m, 4);
  param<tensor<double, 2, grid2, bm, "BM">> odd(ps2, "odd", {2 * index_t(P), sizes[1]}, init::normal(1.0));
  param<tensor<double, 2, grid2, replicate, "MN">> v(ps2, "v", {sizes[1], 2 * index_t(P) + 1}, init::normal(1.0));
  collective_recorder rec;
  auto uneven = [&](tape& t) {
    auto g = all_gather<"model">(t.use(odd));
    auto a = reshard<rules<on<'M', "data">>>(g);
    auto h = einsum<"BM,MN->BN">(a, v);
    auto r = reduce_scatter<"data", 1>(std::move(h));
    auto back = all_to_all<"data", 0>(relabel<"BN">(std::move(r)));
    return all_reduce<"data">(against(t, back, 1)) + against(t, reshard<replicate>(g), 2);
  };
  const double worst_uneven = fd_check_params(ps2, uneven, odd, v);
  INFO("extents that do not divide: worst relative error " << worst_uneven);
  GSHARD_REQUIRE(worst_uneven < 1e-6);
  GSHARD_REQUIRE(rec.calls(collective::all_to_all) > 0);
}

TEST_CASE("autodiff: reshards started and finished later, chunks and concat: the blocking forms' values and gradients",
          "[autodiff][grad][nonblocking]") {
  const int P = world_size();
  const auto sizes = data_model_sizes(P);
  grid2 m(MPI_COMM_WORLD, sizes);
  const index_t D = sizes[0];
  parameters ps(m, 5);
  using by_rows = sharding<split<0, "data">>;  // [B{data},C,M]
  using by_cols = sharding<split<2, "data">>;  // [B,C,M{data}]: one all_to_all away
  param<tensor<double, 3, grid2, by_rows, "BCM">> x(ps, "x", {2 * D, 5, 2 * D}, init::normal(1.0));
  param<tensor<double, 2, grid2, replicate, "MN">> w(ps, "w", {2 * D, 3}, init::normal(1.0));
  // Five capacity rows in three chunks (2, 2, 1): each goes out, meets w
  // (a sum pending over data), and comes back — a reduce_scatter, which
  // start_reshard runs when it starts — while the next one travels.
  auto pipelined = [&](tape& t) {
    auto pieces = chunk<1>(t.use(x), 3);
    using going_t = decltype(start_reshard<by_cols>(pieces[0]));
    std::vector<going_t> going;
    for (auto& p : pieces) going.push_back(start_reshard<by_cols>(std::move(p)));
    std::vector<decltype(start_reshard<by_rows>(einsum<"BCM,MN->BCN">(going[0].wait(), w)).wait())> back;
    for (auto& g : going) back.push_back(start_reshard<by_rows>(einsum<"BCM,MN->BCN">(g.wait(), w)).wait());
    return concat<1>(back);
  };
  auto blocking = [&](tape& t) { return reshard<by_rows>(einsum<"BCM,MN->BCN">(reshard<by_cols>(t.use(x)), w)); };
  auto loss = [&](tape& t) { return reshard<replicate>(against(t, pipelined(t), 3)); };
  const double worst = fd_check_params(ps, loss, x, w);
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
  {  // the value and the gradients of the blocking form, and three all_to_alls each way
    tape tp(ps), tb(ps);
    collective_recorder rec;
    auto lp = loss(tp);
    GSHARD_REQUIRE(rec.calls(collective::all_to_all, "data") == 3);
    tp.backward(lp);
    GSHARD_REQUIRE(rec.calls(collective::all_to_all, "data") == 6);
    const auto gx = x.grad();
    const auto gw = w.grad();
    auto lb = reshard<replicate>(against(tb, blocking(tb), 3));
    tb.backward(lb);
    double d = std::abs(lp.value().local()() - lb.value().local()());
    for (index_t i = 0; i < gx.local().size(); ++i) d = std::max(d, std::abs(gx.data()[i] - x.grad().data()[i]));
    for (index_t i = 0; i < gw.local().size(); ++i) d = std::max(d, std::abs(gw.data()[i] - w.grad().data()[i]));
    GSHARD_REQUIRE(d < 1e-12);
  }
  {  // bf16 on the wire, both ways: the blocking form's values and gradients, in a quarter of the bytes
    auto on_wire = [&](tape& t, bool pipelined_form) {
      if (!pipelined_form)
        return reshard<replicate>(against(
            t, reshard<by_rows>(einsum<"BCM,MN->BCN">(reshard<by_cols>(t.use(x), wire::bf16), w), wire::bf16), 3));
      auto pieces = chunk<1>(t.use(x), 3);
      using going_t = decltype(start_reshard<by_cols>(pieces[0], wire::bf16));
      std::vector<going_t> going;
      for (auto& p : pieces) going.push_back(start_reshard<by_cols>(std::move(p), wire::bf16));
      std::vector<decltype(start_reshard<by_rows>(einsum<"BCM,MN->BCN">(going[0].wait(), w)).wait())> back;
      for (auto& g : going) back.push_back(start_reshard<by_rows>(einsum<"BCM,MN->BCN">(g.wait(), w), wire::bf16).wait());
      return reshard<replicate>(against(t, concat<1>(back), 3));
    };
    tape t64(ps), tp(ps), tb(ps);
    auto l64 = loss(t64);
    t64.backward(l64);
    const auto gx64 = x.grad();
    collective_recorder rec;
    auto lp = on_wire(tp, true);
    tp.backward(lp);
    const auto a2a_bytes = rec.bytes(collective::all_to_all, "data");
    const auto gx = x.grad();
    const auto gw = w.grad();
    auto lb = on_wire(tb, false);
    tb.backward(lb);
    double d = std::abs(lp.value().local()() - lb.value().local()()), scale = 0, off = 0;
    for (index_t i = 0; i < gw.local().size(); ++i) d = std::max(d, std::abs(gw.data()[i] - w.grad().data()[i]));
    for (index_t i = 0; i < gx.local().size(); ++i) {
      d = std::max(d, std::abs(gx.data()[i] - x.grad().data()[i]));
      scale = std::max(scale, std::abs(gx64.data()[i]));
      off = std::max(off, std::abs(gx.data()[i] - gx64.data()[i]));
    }
    INFO("pipelined against blocking: " << d << "; the gradient against no rounding: " << off << " of " << scale);
    GSHARD_REQUIRE(d < 1e-12);
    // Rounded four times on its way (x out, the product back, and their gradients): within 4·2⁻⁸ of its scale.
    GSHARD_REQUIRE(off > 0);
    GSHARD_REQUIRE(off < 4 * std::ldexp(1.0, -8) * scale);
    collective_recorder rec64;
    tape t2(ps);
    auto l2 = loss(t2);
    t2.backward(l2);
    GSHARD_REQUIRE(4 * a2a_bytes == rec64.bytes(collective::all_to_all, "data"));  // 2-byte elements, not 8
  }
  // Misuse: chunks that do not fit the dim, a second wait.
  tape t(ps);
  GSHARD_REQUIRE_THROWS_WITH(chunk<1>(t.use(x), 0), shape_error, "gshard::chunk: 0 pieces of dim 1 of f64[B{data},C,M]");
  GSHARD_REQUIRE_THROWS_WITH(chunk<1>(t.use(x), 6), shape_error, "between 1 and its extent");
  auto once = start_reshard<by_cols>(t.use(x));
  (void)once.wait();
  GSHARD_REQUIRE_THROWS_WITH(once.wait(), error, "gshard::var_in_flight: wait() was called before");
  auto plain = start_reshard<by_cols>(x.value());  // the tensor form, tested until its data has arrived
  while (!plain.test()) {
  }
  GSHARD_REQUIRE(equal_tensors(plain.wait().local(), reshard<by_cols>(x.value()).local()));
  GSHARD_REQUIRE_THROWS_WITH(plain.wait(), error, "gshard::reshard_request: wait() was called before");
  GSHARD_REQUIRE(detail::in_flight::running().empty());  // nothing left in flight once waited
  std::vector<var<tensor<double, 3, grid2, by_rows, "BCM">>> none, odd;
  GSHARD_REQUIRE_THROWS_WITH(concat<1>(none), shape_error, "gshard::concat: no pieces to join");
  odd.push_back(t.use(x));
  odd.push_back(chunk<2>(t.use(x), 2)[0]);
  GSHARD_REQUIRE_THROWS_WITH(concat<1>(odd), shape_error, "differ outside dim 1");
}

TEST_CASE("autodiff: embedding and cross-entropy gradients, ignored targets", "[autodiff][grad]") {
  const int P = world_size();
  grid1 m(MPI_COMM_WORLD);
  parameters ps(m, 4);
  const index_t B = 2 * P, L = 3, V = 7, M = 5;
  param<tensor<double, 2, grid1, replicate, "VM">> table(ps, "table", {V, M}, init::normal(1.0));
  param<tensor<double, 2, grid1, replicate, "MV">> proj(ps, "proj", {M, V}, init::normal(1.0));
  local_tensor<std::int32_t, 2> tok(B, L), tgt(B, L);
  for (index_t i = 0; i < tok.size(); ++i) {
    tok.data()[i] = std::int32_t((i * 5 + 1) % V);
    tgt.data()[i] = i % 4 == 3 ? -1 : std::int32_t((i * 3 + 2) % V);  // every fourth ignored
  }
  const auto tokens = relabel<"BL">(distribute<rows>(m, tok));
  const auto targets = distribute<rows>(m, tgt);
  auto loss = [&](tape& t) {
    auto x = embedding(t, tokens, table);                 // [B{x},L,M]
    return cross_entropy(einsum<"BLM,MV->BLV">(x, proj), targets);
  };
  const double worst = fd_check_params(ps, loss, table, proj);
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
  tape t(ps, tape::no_grad);  // the mean over the targets that count: ln V for uniform logits
  param<tensor<double, 2, grid1, replicate, "MV">> zero(ps, "zero", {M, V}, init::zeros());
  const double uniform = loss_value(cross_entropy(einsum<"BLM,MV->BLV">(embedding(t, tokens, table), zero), targets));
  GSHARD_REQUIRE(std::abs(uniform - std::log(double(V))) < 1e-12);

  // Label smoothing ε: the mean over the counted targets of
  // −Σ_c ((1 − ε)·[c = y] + ε/V)·log softmax(row)_c, against long double;
  // its gradient by finite differences; the unsmoothed value reported too.
  const double eps = 0.1;
  auto smoothed = [&](tape& t) {
    return cross_entropy(einsum<"BLM,MV->BLV">(embedding(t, tokens, table), proj), targets, {.label_smoothing = eps});
  };
  const double worst_smoothed = fd_check_params(ps, smoothed, table, proj);
  INFO("label smoothing: worst relative error " << worst_smoothed);
  GSHARD_REQUIRE(worst_smoothed < 1e-6);
  tape ts(ps, tape::no_grad);
  double plain = 0;
  auto logits = einsum<"BLM,MV->BLV">(embedding(ts, tokens, table), proj);
  const double value =
      loss_value(cross_entropy(logits, targets, {.label_smoothing = eps, .unsmoothed = &plain}));
  const auto all = reshard<replicate>(logits.value());
  long double want = 0, want_plain = 0;
  int count = 0;
  for (index_t r = 0; r < B * L; ++r) {
    if (tgt.data()[r] == -1) continue;
    long double mx = -1e300L, z = 0;
    for (index_t c = 0; c < V; ++c) mx = std::max(mx, (long double)all.data()[r * V + c]);
    for (index_t c = 0; c < V; ++c) z += std::exp((long double)all.data()[r * V + c] - mx);
    for (index_t c = 0; c < V; ++c) {
      const long double logp = (long double)all.data()[r * V + c] - mx - std::log(z);
      want -= ((c == tgt.data()[r] ? 1 - eps : 0.0L) + eps / V) * logp;
      if (c == tgt.data()[r]) want_plain -= logp;
    }
    ++count;
  }
  GSHARD_REQUIRE(std::abs(value - double(want / count)) < 1e-12);
  GSHARD_REQUIRE(std::abs(plain - double(want_plain / count)) < 1e-12);
  GSHARD_REQUIRE_THROWS_WITH(cross_entropy(logits, targets, {.label_smoothing = 1.0}), error,
                             "gshard::cross_entropy: label_smoothing = 1.000000; it must lie in [0, 1)");
  GSHARD_REQUIRE_THROWS_WITH(cross_entropy(logits, targets, {.label_smoothing = std::nan("")}), error,
                             "label_smoothing = nan");
}

TEST_CASE("autodiff: dropout drops the same elements at every rank count, in value and gradient", "[autodiff][grad][dropout]") {
  grid1 m(MPI_COMM_WORLD);
  const index_t P = m.nranks(), B = 3 * P, L = 5, M = 21;  // rows of a block of 16 and 5 more
  parameters ps(m, 6);
  param<tensor<double, 3, grid1, rows, "BLM">> x(ps, "x", {B, L, M}, init::normal(1.0));
  const double rate = 0.25;
  const std::uint64_t seed = 9, stream = 4;
  tape t(ps);
  auto y = dropout(t.use(x), rate, seed, stream);
  // Against the global tensor: element i kept iff uniform32(seed, stream, i) ≥ rate.
  const auto gx = reshard<replicate>(x.value()), gy = reshard<replicate>(y.value());
  bool same = true;
  index_t kept = 0;
  for (index_t i = 0; i < B * L * M; ++i) {
    const bool keep = uniform32(seed, stream, std::uint64_t(i)) >= rate;
    kept += keep;
    same = same && gy.data()[i] == (keep ? gx.data()[i] * (1.0 / (1.0 - rate)) : 0.0);
  }
  GSHARD_REQUIRE(same);
  INFO("kept " << kept << " of " << B * L * M);
  GSHARD_REQUIRE(std::abs(double(kept) / double(B * L * M) - (1 - rate)) < 0.1);
  {  // In float, split on the last dim: shards start inside rows, and do not divide at most rank counts.
    using by_m = sharding<split<2, "x">>;
    const index_t Mm = 3 * P + 2;
    tensor<float, 3, grid1, by_m, "BLM"> xm(m, {2, 3, Mm});
    fill_normal(xm, 1.0, 5, 1);
    const auto gxm = reshard<replicate>(xm), gym = reshard<replicate>(dropout(t.constant(xm), rate, seed, stream).value());
    bool same_m = true;
    for (index_t i = 0; i < 2 * 3 * Mm; ++i) {
      const bool keep = uniform32(seed, stream, std::uint64_t(i)) >= rate;
      same_m = same_m && gym.data()[i] == (keep ? gxm.data()[i] * float(1.0 / (1.0 - rate)) : 0.0f);
    }
    GSHARD_REQUIRE(same_m);
  }
  // The keep test in integers is uniform32's: at the rates where rounding could tell them apart,
  // and across 2^32 in the global index, where the row key changes; in float too, where a
  // dropped NaN is 0 and a kept one NaN.
  for (const double p : {0.0, 0x1p-32, 0x1.8p-32, 0.1, 0.5, 1 - 0x1p-32, std::nextafter(1.0, 0.0)}) {
    detail::dropout_mask<double> mask(p, seed, stream);
    std::vector<double> ones(64, 1.0);
    const std::uint64_t g0 = (std::uint64_t(1) << 32) - 37;
    mask.apply(ones.data(), index_t(ones.size()), g0);
    bool agree = true;
    for (std::uint64_t j = 0; j < ones.size(); ++j) {
      const double u = uniform32(seed, stream, g0 + j);
      agree = agree && ones[j] == (u >= p ? 1.0 / (1.0 - p) : 0.0);
    }
    detail::dropout_mask<float> mask_f(p, seed, stream);
    std::vector<float> nans(64, std::nanf(""));
    mask_f.apply(nans.data(), index_t(nans.size()), g0);
    for (std::uint64_t j = 0; j < nans.size(); ++j)
      agree = agree && (uniform32(seed, stream, g0 + j) >= p ? std::isnan(nans[j]) : nans[j] == 0.0f);
    for (std::uint64_t i = 0; i < 20000; ++i) {
      const double u = uniform32(seed, stream, i);
      const std::uint64_t bits = detail::random_bits32(detail::random_key32(detail::random_key(seed, stream), 0), std::uint32_t(i));
      agree = agree && (u >= p) == (bits >= detail::random_threshold32(p)) && (u >= u) == (bits >= detail::random_threshold32(u));
    }
    INFO("rate " << p);
    GSHARD_REQUIRE(agree);
  }
  {  // uniform32 looks uniform and independent: 2^20 draws fill 64 bins of their high bits and
     // 64 of their low bits as uniform draws would (chi-square, 63 degrees of freedom: mean 63,
     // sd 11), and correlate neither with their neighbours nor with the next stream's (sd 0.001).
    const std::uint64_t N = std::uint64_t(1) << 20;
    std::array<double, 64> high{}, low{};
    double next = 0, other = 0;
    for (std::uint64_t i = 0; i < N; ++i) {
      const double u = uniform32(seed, stream, i);
      const auto w = std::uint64_t(std::ldexp(u, 32));
      high[w >> 26] += 1, low[w & 63] += 1;
      next += (u - 0.5) * (uniform32(seed, stream, i + 1) - 0.5);
      other += (u - 0.5) * (uniform32(seed, stream + 1, i) - 0.5);
    }
    const auto chi2 = [&](const std::array<double, 64>& bins) {
      double c = 0;
      for (const double b : bins) c += (b - double(N) / 64) * (b - double(N) / 64) / (double(N) / 64);
      return c;
    };
    INFO("chi-square " << chi2(high) << " (high bits), " << chi2(low) << " (low bits); correlations " << 12 * next / double(N)
                       << " (neighbours), " << 12 * other / double(N) << " (streams)");
    GSHARD_REQUIRE((chi2(high) < 130 && chi2(low) < 130 && std::abs(12 * next / double(N)) < 0.006 &&
                    std::abs(12 * other / double(N)) < 0.006));
  }
  // The gradient: the same mask, drawn again.
  auto loss = [&](tape& tl) {
    const tensor<double, 3, grid1, rows, "BLM"> c = random_like(x.value(), 3);
    return reshard<replicate>(einsum<"BLM,BLM->">(dropout(tl.use(x), rate, seed, stream), tl.constant(c)));
  };
  const double worst = fd_check_params(ps, loss, x);
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
  // Another stream draws another mask; rate 0 is the identity; a dropped NaN is 0.
  auto y2 = dropout(t.use(x), rate, seed, stream + 1);
  bool differs = false;
  for (index_t i = 0; i < y.value().local().size(); ++i) differs = differs || y.value().data()[i] != y2.value().data()[i];
  GSHARD_REQUIRE(sum_all(differs ? 1 : 0) > 0);
  auto same0 = dropout(t.use(x), 0.0, seed, stream);
  GSHARD_REQUIRE(equal_tensors(same0.value().local(), x.value().local()));
  tensor<double, 3, grid1, rows, "BLM"> nans(m, {B, L, M});
  nans.local().setConstant(std::nan(""));
  auto dn = dropout(t.constant(nans), 0.5, seed, stream);
  bool zeros_or_nan = true;
  index_t zeros = 0;
  for (index_t i = 0; i < dn.value().local().size(); ++i) {
    const double v = dn.value().data()[i];
    zeros += v == 0.0;
    zeros_or_nan = zeros_or_nan && (v == 0.0 || std::isnan(v));
  }
  GSHARD_REQUIRE(zeros_or_nan);
  GSHARD_REQUIRE(sum_all(double(zeros)) > 0);
  GSHARD_REQUIRE_THROWS_WITH(dropout(t.use(x), 1.0, seed, stream), error,
                             "gshard::dropout: rate = 1.000000; it must lie in [0, 1)");
  GSHARD_REQUIRE_THROWS_WITH(dropout(t.use(x), -0.1, seed, stream), error, "rate = -0.100000");
}

TEST_CASE("autodiff: a scalar added to or subtracted from a var or a tensor", "[autodiff][grad]") {
  grid1 m(MPI_COMM_WORLD);
  const index_t P = m.nranks();
  parameters ps(m, 3);
  param<tensor<double, 2, grid1, rows>> x(ps, "x", {2 * P, 3}, init::normal(1.0));
  tensor<double, 2, grid1, rows> c(m, {2 * P, 3});
  fill_normal(c, 1.0, 4, 5);
  // Plain tensors: every element shifted, on each rank's shard.
  const auto& xv = x.value();
  const auto a = xv + 2.0, b = 3.0 - xv, d = xv - 0.5, e = 1.5 + xv;
  bool values = true;
  for (index_t i = 0; i < xv.local().size(); ++i) {
    const double v = xv.data()[i];
    values = values && a.data()[i] == v + 2.0 && b.data()[i] == 3.0 - v && d.data()[i] == v - 0.5 && e.data()[i] == 1.5 + v;
  }
    tape t(ps);
  auto y = 3.0 - (t.use(x) + 2.0);
  auto l = reshard<replicate>(einsum<"ij,ij->">(y - 1.0, t.constant(c)));
  t.backward(l);
  bool grads = true;  // d/dx <3 - (x + 2) - 1, c> = -c
  const auto g = x.grad();
  for (index_t i = 0; i < g.local().size(); ++i) grads = grads && g.data()[i] == -c.data()[i];
  for (index_t i = 0; i < y.value().local().size(); ++i) values = values && y.value().data()[i] == 3.0 - (xv.data()[i] + 2.0);
  GSHARD_REQUIRE(values);
  GSHARD_REQUIRE(grads);
  tape t2(ps);
  auto l2 = reshard<replicate>(einsum<"ij,ij->">(0.5 + t2.use(x), t2.constant(c)));  // d/dx = c
  t2.backward(l2);
  bool grads2 = true;
  for (index_t i = 0; i < g.local().size(); ++i) grads2 = grads2 && x.grad().data()[i] == c.data()[i];
  GSHARD_REQUIRE(grads2);
}

TEST_CASE("positions: the sinusoid table and each token's position, sharded like the tokens", "[autodiff][positions]") {
  grid1 m(MPI_COMM_WORLD);
  const index_t P = m.nranks(), L = 5, M = 6;
  const auto table = sinusoidal_positions<double>(m, L, M);
  bool ok = true;  // channel 2i: sin(p / 10000^(2i/M)); 2i+1: its cos
  for (index_t p = 0; p < L; ++p)
    for (index_t i = 0; i < M; i += 2) {
      const long double rate = std::pow(10000.0L, -(long double)i / (long double)M);
      ok = ok && std::abs(table.data()[p * M + i] - double(std::sin((long double)p * rate))) < 1e-15 &&
           std::abs(table.data()[p * M + i + 1] - double(std::cos((long double)p * rate))) < 1e-15;
    }
  GSHARD_REQUIRE(table.data()[0] == 0.0 && table.data()[1] == 1.0);
  tensor<std::int32_t, 2, grid1, rows, "BL"> tok(m, {2 * P, L});
  const auto pos = positions_of(tok, 3);
  for (index_t i = 0; i < pos.local().size(); ++i) ok = ok && pos.data()[i] == std::int32_t(3 + i % L);
  GSHARD_REQUIRE(ok);
}

TEST_CASE("autodiff: uses of one value are summed while pending and reduced once", "[autodiff][collectives]") {
  const int P = world_size();
  const auto sizes = data_model_sizes(P);
  grid2 m(MPI_COMM_WORLD, sizes);
  parameters ps(m, 5);
  const index_t B = 2 * P, M = 4, N = 4;
  // h read by three projections split over "model" (attention's q, k, v).
  param<tensor<double, 2, grid2, sharding<split<0, "data">>, "BM">> h(ps, "h", {B, M}, init::normal(1.0));
  using wsplit = sharding<split<1, "model">>;
  param<tensor<double, 2, grid2, wsplit, "MN">> wq(ps, "wq", {M, N}, init::normal(1.0)), wk(ps, "wk", {M, N}, init::normal(1.0)),
      wv(ps, "wv", {M, N}, init::normal(1.0));
  param<tensor<double, 2, grid2, replicate, "MN">> shared(ps, "shared", {M, N}, init::normal(1.0));
  auto loss = [&](tape& t) {
    auto hv = t.use(h);
    auto q = einsum<"BM,MN->BN">(hv, wq), k = einsum<"BM,MN->BN">(hv, wk), v = einsum<"BM,MN->BN">(hv, wv);
    // one replicated weight used three times with batch-split activations
    auto u = einsum<"BM,MN->BN">(hv, shared) + einsum<"BM,MN->BN">(2.0 * hv, shared);
    auto e = all_reduce<"model">(against(t, q, 1) + against(t, k, 2) + against(t, v, 3)) +
             against(t, einsum<"BN,MN->BM">(u, shared), 4);
    return all_reduce<"data">(std::move(e));
  };
  // One collective per weight (no buckets), then the weights in one bucket.
  for (std::size_t bucket : {std::size_t(0), default_bucket_bytes}) {
    ps.set_bucket_bytes(bucket);
    tape t(ps);
    auto l = loss(t);
    collective_recorder rec;
    t.backward(l);
    const auto seen = rec.tally();
    std::string got;
    for (const auto& [kind, n] : seen) got += kind + " x" + std::to_string(n) + " ";
    INFO("buckets of " << bucket << " B: the backward ran: " << got);
    // h's three contributions from q, k, v are partial over "model": one all_reduce;
    // each weight's gradient is pending over "data" until its one all_reduce —
    // or, in buckets, the four weights' one.
    GSHARD_REQUIRE(seen == std::map<std::string, int>{{"all_reduce(model)", 1}, {"all_reduce(data)", bucket == 0 ? 4 : 1}});
  }
  GSHARD_REQUIRE(fd_check_params(ps, loss, h, wq, wk, wv, shared) < 1e-6);
}

TEST_CASE("autodiff: parameters declared once; the errors a model writer can make", "[autodiff][errors]") {
  grid1 m(MPI_COMM_WORLD);
  parameters ps(m, 6), other(m, 6);
  param<tensor<float, 2, grid1, replicate>> w(ps, "w", {3, 3}, init::normal(1.0));
  param<tensor<float, 2, grid1, replicate>> stray(other, "stray", {3, 3}, init::normal(1.0));
  GSHARD_REQUIRE_THROWS_WITH((param<tensor<float, 2, grid1, replicate>>(ps, "w", {2, 2}, init::zeros())), error,
                             "gshard::tensor_set: the name 'w' is declared twice (first as f32[3,3], now as f32[2,2])");
  tape t(ps);
  GSHARD_REQUIRE_THROWS_WITH(t.use(stray), error,
                             "gshard::tape: parameter 'stray' f32[3,3] is declared in another gshard::parameters");
  // Same seed and name: the same initial values at every rank count; other names differ.
  parameters again(m, 6);
  param<tensor<float, 2, grid1, replicate>> w2(again, "w", {3, 3}, init::normal(1.0));
  GSHARD_REQUIRE(equal_tensors(w.value().local(), w2.value().local()));
  GSHARD_REQUIRE(!equal_tensors(w.value().local(), stray.value().local()));
  // An unused parameter gets a zero gradient and has_grad false; backward runs once.
  param<tensor<float, 2, grid1, replicate>> unused(ps, "unused", {3, 3}, init::normal(1.0));
  auto l = reshard<replicate>(einsum<"ij,ij->">(t.use(w), w));
  t.backward(l);
  GSHARD_REQUIRE(ps.has_grad(w.index()) && !ps.has_grad(unused.index()));
  GSHARD_REQUIRE_THROWS_WITH(t.backward(l), error, "gshard::tape::backward: this tape's backward has run");
  tape frozen(ps, tape::no_grad);
  auto l2 = reshard<replicate>(einsum<"ij,ij->">(frozen.use(w), w));
  GSHARD_REQUIRE(!l2.tracked());
  GSHARD_REQUIRE_THROWS_WITH(frozen.backward(l2), error, "this tape does not record");
}

TEST_CASE("autodiff: einsum, relu, softmax and the RMS norm on sharded operands match finite differences", "[autodiff][grad]") {
  grid1 m(MPI_COMM_WORLD);
  const index_t P = m.nranks();
  using rows = sharding<split<0, "x">>;
  double worst = 0;
  {  // einsum with a split operand and a replicated weight
    auto a = distribute<rows>(m, random_tensor<2, double>({2 * P, 5}, 1));
    auto b = distribute<replicate>(m, random_tensor<2, double>({5, 3}, 2));
    const auto r = random_like(einsum<"ij,jk->ik">(a, b), 3);
    auto f = [&] { return dot(einsum<"ij,jk->ik">(a, b), r); };
    auto [da, db] = einsum_backward<"ij,jk->ik">(r, a, b);
    worst = std::max({worst, fd_check(a, da, f), fd_check(b, db, f)});
  }
  {  // a batched contraction, batch split in both operands
    using bsplit = sharding<split<0, "x">>;
    auto q = distribute<bsplit>(m, random_tensor<4, double>({P, 4, 2, 3}, 4));
    auto k = distribute<bsplit>(m, random_tensor<4, double>({P, 4, 2, 3}, 5));
    const auto r = random_like(einsum<"BLNK,BTNK->BNLT">(q, k), 6);
    auto f = [&] { return dot(einsum<"BLNK,BTNK->BNLT">(q, k), r); };
    auto [dq, dk] = einsum_backward<"BLNK,BTNK->BNLT">(r, q, k);
    worst = std::max({worst, fd_check(q, dq, f), fd_check(k, dk, f)});
  }
  {  // relu, softmax, RMS norm (the scale's gradient reduced over the ranks)
    auto x = distribute<rows>(m, random_tensor<2, double>({2 * P, 6}, 7));
    const auto r = random_like(x, 8);
    auto frelu = [&] { return dot(relu(x), r); };
    worst = std::max(worst, fd_check(x, relu_backward(r, x), frelu));
    auto fsoft = [&] { return dot(softmax(x), r); };
    worst = std::max(worst, fd_check(x, softmax_backward(r, softmax(x)), fsoft));
    auto s = distribute<replicate>(m, random_tensor<1, double>({6}, 9));
    auto fnorm = [&] { return dot(rms_norm(x, s), r); };
    tensor<double, 1, grid1, sharding<partial<"x">>> ds(m, {6});
    const auto dx = rms_norm_backward(r, x, s, ds.data());
    const auto ds_full = reshard<replicate>(ds);
    worst = std::max({worst, fd_check(x, dx, fnorm), fd_check(s, ds_full, fnorm)});
  }
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
}

TEST_CASE("autodiff: the attention block and the MoE layer, derived, match finite differences", "[autodiff][grad][moe]") {
  const int P = world_size();
  grid_de m(MPI_COMM_WORLD, {1, P});
  double worst = 0;
  {  // attention, batch split, weights replicated
    model::config c;
    c.model = 6, c.heads = 2, c.head_dim = 3, c.layers = 1;
    parameters ps(m, 1);
    const model::transformer<double, grid_de> tr(ps, c);
    param<model::transformer<double, grid_de>::activation> h(ps, "h", {P, 5, 6}, init::normal(1.0));
    const auto& a = tr.blocks()[0].attn;
    const auto r = random_like(h.value(), 4);
    auto loss = [&](tape& t) {
      return reshard<replicate>(einsum<"BLM,BLM->">(tr.attention(t.use(h), a), t.constant(r)));
    };
    worst = std::max(worst, fd_check_params(ps, loss, h, a.wq, a.wk, a.wv, a.wo));
  }
  // The MoE layer, through the combine weights, the aux loss and the z-loss:
  // GShard's top-2, SwiGLU experts, top-1 and top-4 with shared experts.
  // With a binding capacity and random routing, the normalisation runs over
  // every chosen expert, placed or not (the discrete choices do not move
  // under the probes).
  // And the all_to_alls pipelined with the experts (overlap_degree 3).
  struct variant {
    ffn_kind ffn;
    int k, shared;
    bool binding = false;
    int overlap = 1;
  };
  for (const variant v : {variant{ffn_kind::relu, 2, 0}, variant{ffn_kind::swiglu, 2, 0}, variant{ffn_kind::relu, 1, 1},
                          variant{ffn_kind::swiglu, 4, 2}, variant{ffn_kind::relu, 2, 0, true},
                          variant{ffn_kind::swiglu, 2, 0, false, 3}}) {
    INFO("k = " << v.k << ", " << v.shared << " shared experts, " << (v.ffn == ffn_kind::relu ? "relu" : "swiglu")
                << (v.binding ? ", binding capacity, random routing" : "") << ", overlap_degree " << v.overlap);
    const index_t E = 8, G = 2 * P, S = 8, M = 5, H = 7;
    parameters ps(m, 11);
    const moe::layer<double, grid_de> layer(ps, "moe.", M, H, E,
                                          moe::layer_options{v.ffn, v.shared, moe::balance_mode::aux, v.overlap});
    param<named<double, "GSM", grid_de, moe::layer<double, grid_de>::at_tokens>> x(ps, "x", {G, S, M}, init::normal(1.0));
    moe::gating_config cfg;
    cfg.top_k = v.k;
    cfg.capacity_factor = v.binding ? 0.5 : 8.0;
    cfg.min_capacity = v.binding ? 1 : 4;
    cfg.second = v.binding ? moe::second_policy::random : moe::second_policy::all;
    const auto r = random_like(x.value(), 14);
    auto loss_in = [&](tape& t, moe::dispatch_mode mode) {
      auto out = layer(t.use(x), cfg, 1, mode);
      return reshard<replicate>(einsum<"GSM,GSM->">(out.y, t.constant(r))) + 0.5 * out.aux + 0.03 * out.z_loss;
    };
    auto loss = [&](tape& t) { return loss_in(t, moe::dispatch_mode::index); };
    double w = fd_check_params(ps, loss, x, layer.router, layer.expert_ffn.w1, layer.expert_ffn.w2);
    if (layer.expert_ffn.w1_up) w = std::max(w, fd_check_params(ps, loss, *layer.expert_ffn.w1_up));
    if (layer.shared) {
      w = std::max(w, fd_check_params(ps, loss, layer.shared->w1, layer.shared->w2));
      if (layer.shared->w1_up) w = std::max(w, fd_check_params(ps, loss, *layer.shared->w1_up));
    }
    worst = std::max(worst, w);
    {  // every parameter gets a gradient (a layer term left out would pass the FD check as 0 = 0)
      tape tg(ps);
      auto l = loss(tg);
      tg.backward(l);
      double least = 1e300;
      auto norm = [](const auto& t) {
        double n = 0;
        for (index_t i = 0; i < t.local().size(); ++i) n += double(t.data()[i]) * double(t.data()[i]);
        return gshard::testing::sum_all(n);
      };
      for (double n : {norm(layer.router.grad()), norm(layer.expert_ffn.w1.grad()), norm(layer.expert_ffn.w2.grad())}) least = std::min(least, n);
      if (layer.shared) least = std::min({least, norm(layer.shared->w1.grad()), norm(layer.shared->w2.grad())});
      GSHARD_REQUIRE(least > 0);
      if (v.binding) {
        tape tn(ps, tape::no_grad);
        const auto out = layer(tn.use(x), cfg, 1);
        GSHARD_REQUIRE(out.stats.total_dropped() > 0 && out.stats.skipped_at(1) > 0);
      }
    }
    // The einsum form of dispatch and combine: the same gradients.
    tape ti(ps), te(ps);
    auto li = loss(ti);
    ti.backward(li);
    const auto gwi = layer.expert_ffn.w1.grad();
    const auto ggate = layer.router.grad();
    auto le = loss_in(te, moe::dispatch_mode::einsum);
    te.backward(le);
    double d = 0;
    for (index_t i = 0; i < gwi.local().size(); ++i) d = std::max(d, std::abs(gwi.data()[i] - layer.expert_ffn.w1.grad().data()[i]));
    for (index_t i = 0; i < ggate.local().size(); ++i)
      d = std::max(d, std::abs(ggate.data()[i] - layer.router.grad().data()[i]));
    GSHARD_REQUIRE(std::abs(loss_value(li) - loss_value(le)) < 1e-12 && d < 1e-12);
  }
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
}

