// bench/legacy/ (frozen copy of gshard/moe/backward.hpp — the MoE layer's backward. The collectives are the
// forward's transposed: the two all_to_alls run in the other order, the
// gating weights' gradient is a pending sum over the ranks that split the
// groups (one all_reduce), and the experts' gradients stay on their ranks
// (reduced only over "data", where it exists). The router receives gradient
// through the combine weights and through the aux loss; the choices
// themselves (top-2, capacity, random routing) are constants, as in GShard.
#pragma once

#include "gshard/grad.hpp"
#include "moe_layer.hpp"

namespace legacy::moe {
using namespace gshard;

namespace detail {

// The transpose of combine_rows: dy[e,g,c,:] = w_k · dout[g,s,:] for placed
// choices, zero elsewhere; and the gradient of each combine weight,
// dw_k = <dout[g,s,:], y[e_k,g,c_k,:]>.
template <class T>
void combine_rows_backward(const routing<T>& r, const T* dout, const T* y, index_t M, T* dy, std::vector<T>& dweight) {
  const index_t G = r.groups, S = r.tokens, C = r.capacity;
  std::memset(dy, 0, sizeof(T) * std::size_t(r.experts * G * C * M));
  dweight.assign(r.weight.size(), T(0));
  for (index_t g = 0; g < G; ++g)
    for (index_t s = 0; s < S; ++s)
      for (int k = 0; k < 2; ++k) {
        const std::size_t c = r.choice(g, s, k);
        if (r.expert[c] < 0) continue;
        const index_t at = ((index_t(r.expert[c]) * G + g) * C + r.slot[c]) * M;
        const T* go = dout + (g * S + s) * M;
        T dot = 0;
        for (index_t i = 0; i < M; ++i) {
          dy[at + i] = r.weight[c] * go[i];
          dot += go[i] * y[at + i];
        }
        dweight[c] = dot;
      }
}

// The transpose of dispatch_rows: dx[g,s,:] += Σ_k dxe[e_k,g,c_k,:].
template <class T>
void dispatch_rows_backward(const routing<T>& r, const T* dxe, index_t M, T* dx) {
  const index_t G = r.groups, S = r.tokens, C = r.capacity;
  for (index_t g = 0; g < G; ++g)
    for (index_t s = 0; s < S; ++s)
      for (int k = 0; k < 2; ++k) {
        const std::size_t c = r.choice(g, s, k);
        if (r.expert[c] < 0) continue;
        const T* row = dxe + ((index_t(r.expert[c]) * G + g) * C + r.slot[c]) * M;
        T* out = dx + (g * S + s) * M;
        for (index_t i = 0; i < M; ++i) out[i] += row[i];
      }
}

// d(loss)/d(logits) from the combine weights' gradients and the aux loss.
// w1 = g1/D, w2 = g2/D with D = g1 + g2 + 1e-9 (g_k = gates[wanted_k]);
// aux = (E / G_total) · Σ_g Σ_e (count1_e / S) · mean_S(gates_e), so
// ∂aux/∂gates[g,s,e] = E · count1_e[g] / (G_total · S²).
template <class T>
void gating_backward(const routing<T>& r, const std::vector<T>& dweight, double aux_grad, index_t G_total, T* dlogits) {
  const index_t G = r.groups, S = r.tokens, E = r.experts;
  std::vector<double> count1(static_cast<std::size_t>(E));
  std::vector<T> dg(static_cast<std::size_t>(E));
  for (index_t g = 0; g < G; ++g) {
    std::fill(count1.begin(), count1.end(), 0.0);
    for (index_t s = 0; s < S; ++s) {
      const int e1 = r.wanted[r.choice(g, s, 0)];
      if (e1 >= 0) count1[std::size_t(e1)] += 1.0;
    }
    for (index_t s = 0; s < S; ++s) {
      T* dl = dlogits + (g * S + s) * E;
      const std::size_t c0 = r.choice(g, s, 0);
      const int e1 = r.wanted[c0], e2 = r.wanted[c0 + 1];
      if (e1 < 0) {  // an invalid token: no gradient
        std::fill(dl, dl + E, T(0));
        continue;
      }
      const T* gates = r.gates.data() + (g * S + s) * E;
      for (index_t e = 0; e < E; ++e)
        dg[std::size_t(e)] = T(aux_grad * double(E) * count1[std::size_t(e)] / (double(G_total) * double(S) * double(S)));
      const T g1 = gates[e1], g2 = e2 >= 0 ? gates[e2] : T(0);
      const T D = g1 + g2 + T(1e-9), D2 = D * D;
      const T dw1 = dweight[c0], dw2 = dweight[c0 + 1];
      dg[std::size_t(e1)] += dw1 * (g2 + T(1e-9)) / D2 - dw2 * g2 / D2;
      if (e2 >= 0) dg[std::size_t(e2)] += -dw1 * g1 / D2 + dw2 * (g1 + T(1e-9)) / D2;
      T dot = 0;
      for (index_t e = 0; e < E; ++e) dot += dg[std::size_t(e)] * gates[e];
      for (index_t e = 0; e < E; ++e) dl[e] = gates[e] * (dg[std::size_t(e)] - dot);
    }
  }
}

}  // namespace detail

// dx of the MoE layer, accumulating the parameters' gradients into `grads`
// (which must have the parameters' shapes). `aux_grad` is d(loss)/d(aux loss)
// (the model's aux_coef); `x`, `out` and `c` are the forward's input, output
// and cache.
template <class T, mesh_type Mesh>
tensor<T, 3, Mesh, typename shardings<Mesh>::by_group> backward(
    const tensor<T, 3, Mesh, typename shardings<Mesh>::by_group>& dout,
    const tensor<T, 3, Mesh, typename shardings<Mesh>::by_group>& x, const params<T, Mesh>& p,
    const output<T, Mesh>& out, const cache<T, Mesh>& c, double aux_grad, params<T, Mesh>& grads) {
  using S = shardings<Mesh>;
  const Mesh& m = x.mesh();
  const routing<T>& r = out.route;
  const index_t G = x.extent(0), Sg = x.extent(1), M = x.extent(2), E = p.gate.extent(1), C = r.capacity;

  // Combine, transposed: into the expert outputs' gradient, and the combine weights'.
  tensor<T, 4, Mesh, typename S::egcm_by_group> dy(m, {E, G, C, M});  // [E,G{data,expert},C,M]
  std::vector<T> dweight;
  detail::combine_rows_backward(r, dout.data(), c.y->data(), M, dy.data(), dweight);
  const auto dye = reshard_backward<typename S::by_expert>(std::move(dy));  // all_to_all: [E{expert},G{data},C,M]

  // The experts, on their ranks (with a "model" axis, dxe's sum over the
  // split H is one all_reduce over it).
  auto [dh, dwo] = einsum_backward<"EGCH,EHM->EGCM">(dye, *c.h, p.wo);
  const auto da = relu_backward(std::move(dh), *c.h);
  auto [dxe, dwi] = einsum_backward<"EGCM,EMH->EGCH">(da, *c.xe, p.wi);
  grads.wo.local() += dwo.local();
  grads.wi.local() += dwi.local();

  // Dispatch, transposed: back to the groups, then to the tokens.
  const auto dxe_groups = reshard_backward<typename S::egcm_by_group>(std::move(dxe));  // all_to_all
  tensor<T, 3, Mesh, typename S::by_group> dx(m, {G, Sg, M});
  detail::dispatch_rows_backward(r, dxe_groups.data(), M, dx.data());

  // The router: through the combine weights and the aux loss.
  tensor<T, 3, Mesh, typename S::by_group> dlogits(m, {G, Sg, E});
  detail::gating_backward(r, dweight, aux_grad, G, dlogits.data());
  auto [dx_gate, dwg] = einsum_backward<"GSM,ME->GSE">(dlogits, x, p.gate);  // dwg: one all_reduce
  grads.gate.local() += dwg.local();
  dx.local() += dx_gate.local();
  return dx;
}

}  // namespace legacy::moe
