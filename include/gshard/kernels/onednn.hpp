// gshard/kernels/onednn.hpp — GEMMs by oneDNN 2.x's matmul (built with
// GSHARD_USE_ONEDNN, Meson option onednn): fp32 × fp32 → fp32, and bf16 ×
// bf16 with fp32 accumulation into fp32 or bf16. A primitive is made once
// per shape, layout and scaling and kept (a few hundred shapes in a
// training step); where oneDNN cannot make one, onednn_gemm returns false
// and the caller computes another way. One thread per process calls it
// (the state is the process's, as gemm()'s backend choice is).
#pragma once

#include "gshard/core/types.hpp"

namespace gshard::detail {
// Products of one batched call: C_i = op(A_i)·op(B_i) for i < count, A_i
// at a + i·a_stride (likewise B, C). One product: count 1.
struct gemm_batch {
  index_t count = 1, a_stride = 0, b_stride = 0, c_stride = 0;
  bool operator==(const gemm_batch&) const = default;
};

}  // namespace gshard::detail

#if defined(GSHARD_USE_ONEDNN)

#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_version.h>

static_assert(DNNL_VERSION_MAJOR == 2, "gshard::onednn: this is written for oneDNN 2.x (Debian 12's libdnnl-dev 2.6); "
                                        "configure with -Donednn=disabled for another version");

#include <Eigen/Core>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <unordered_map>

namespace gshard::detail {

template <class T>
constexpr dnnl::memory::data_type onednn_type() {
  if constexpr (std::is_same_v<T, float>) return dnnl::memory::data_type::f32;
  else {
    static_assert(std::is_same_v<T, Eigen::bfloat16>, "gshard::onednn_gemm: the element types are float and bf16");
    return dnnl::memory::data_type::bf16;
  }
}

// What a primitive is made for: the types, the layouts and the scaling.
struct onednn_key {
  int a_type = 0, c_type = 0;
  bool trans_a = false, trans_b = false;
  index_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  gemm_batch batch{};
  float alpha = 1, beta = 0;
  bool operator==(const onednn_key&) const = default;
};
struct onednn_key_hash {
  std::size_t operator()(const onednn_key& k) const {
    std::uint64_t h = 1469598103934665603ull;
    auto mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(std::uint64_t(k.a_type) | std::uint64_t(k.c_type) << 8 | std::uint64_t(k.trans_a) << 16 | std::uint64_t(k.trans_b) << 17);
    for (index_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldc, k.batch.count, k.batch.a_stride, k.batch.b_stride, k.batch.c_stride})
      mix(std::uint64_t(v));
    std::uint32_t a = 0, b = 0;
    std::memcpy(&a, &k.alpha, 4), std::memcpy(&b, &k.beta, 4);
    mix(std::uint64_t(a) << 32 | b);
    return std::size_t(h);
  }
};

// The engine, the stream and the primitives made so far (one rank, one thread).
struct onednn_state {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  struct entry {
    bool made = false;  // false: oneDNN cannot run this on this CPU
    dnnl::matmul prim;
    dnnl::memory a, b, c;  // made once; each call points them at its operands
  };
  std::unordered_map<onednn_key, entry, onednn_key_hash> primitives;
  static constexpr std::size_t max_primitives = 4096;  // then the cache starts over
};
inline onednn_state& onednn() {
  static onednn_state s;
  return s;
}

// C = alpha·op(A)·op(B) + beta·C, row-major as gemm() — for each product
// of `batch`, in one call; false when oneDNN cannot make the primitive on
// this CPU (then nothing was written).
template <class In, class Out>
bool onednn_gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, float alpha, const In* a, index_t lda,
                 const In* b, index_t ldb, float beta, Out* c, index_t ldc, const gemm_batch& batch = {}) {
  using dims = dnnl::memory::dims;
  onednn_state& s = onednn();
  // + 0.0f: -0 and +0 scale alike, and are one key.
  const onednn_key key{int(onednn_type<In>()), int(onednn_type<Out>()), trans_a, trans_b, m, n, k, lda, ldb, ldc,
                       batch, alpha + 0.0f, beta + 0.0f};
  auto it = s.primitives.find(key);
  if (it == s.primitives.end()) {
    if (s.primitives.size() >= onednn_state::max_primitives) s.primitives.clear();
    onednn_state::entry e;
    try {
      // op(A) is m×k: stored k×m (strides 1, lda) when transposed. A batch
      // is the outer dimension, strided.
      auto desc = [&](dnnl::memory::data_type t, index_t r, index_t q, index_t sr, index_t sq, index_t sb) {
        return batch.count == 1 ? dnnl::memory::desc(dims{r, q}, t, dims{sr, sq})
                                : dnnl::memory::desc(dims{batch.count, r, q}, t, dims{sb, sr, sq});
      };
      const dnnl::memory::desc ad = trans_a ? desc(onednn_type<In>(), m, k, 1, lda, batch.a_stride)
                                            : desc(onednn_type<In>(), m, k, lda, 1, batch.a_stride),
                               bd = trans_b ? desc(onednn_type<In>(), k, n, 1, ldb, batch.b_stride)
                                            : desc(onednn_type<In>(), k, n, ldb, 1, batch.b_stride),
                               cd = desc(onednn_type<Out>(), m, n, ldc, 1, batch.c_stride);
      // dst = alpha·(A·B) + beta·dst: the output scale, then the sum post-op.
      dnnl::primitive_attr attr;
      if (alpha != 1) attr.set_output_scales(0, {alpha});
      if (beta != 0) {
        dnnl::post_ops po;
        po.append_sum(beta);
        attr.set_post_ops(po);
      }
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), attr, s.engine);
      e.prim = dnnl::matmul(pd);
      e.a = dnnl::memory(ad, s.engine, DNNL_MEMORY_NONE), e.b = dnnl::memory(bd, s.engine, DNNL_MEMORY_NONE);
      e.c = dnnl::memory(cd, s.engine, DNNL_MEMORY_NONE);
      e.made = true;
    } catch (const dnnl::error&) {
      e.made = false;  // not supported here (bf16 without AVX-512)
    }
    it = s.primitives.emplace(key, std::move(e)).first;
  }
  onednn_state::entry& e = it->second;
  if (!e.made) return false;
  // The entry's memory objects pointed at this call's operands (so one thread at a time), and
  // the arguments passed as an array: the C++ execute() takes them as a std::unordered_map.
  e.a.set_data_handle(const_cast<In*>(a)), e.b.set_data_handle(const_cast<In*>(b)), e.c.set_data_handle(c);
  const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, e.a.get()}, {DNNL_ARG_WEIGHTS, e.b.get()}, {DNNL_ARG_DST, e.c.get()}};
  dnnl::error::wrap_c_api(dnnl_primitive_execute(e.prim.get(), s.stream.get(), 3, args), "gshard: oneDNN matmul");
  s.stream.wait();
  return true;
}

// Whether oneDNN runs bf16 × bf16 matmuls on this CPU's bf16 units
// (AVX512_BF16 or AMX). oneDNN also emulates them with AVX512_CORE alone,
// slower than fp32 there; that does not count.
inline bool onednn_has_bf16() {
  static const bool yes = [] {
    const auto isa = unsigned(dnnl::get_effective_cpu_isa()), bf16 = unsigned(dnnl::cpu_isa::avx512_core_bf16);
    if ((isa & bf16) != bf16) return false;
    const Eigen::bfloat16 a[1] = {Eigen::bfloat16(1.0f)};
    float c[1] = {0};
    return onednn_gemm<Eigen::bfloat16, float>(false, false, 1, 1, 1, 1.0f, a, 1, a, 1, 0.0f, c, 1) && c[0] == 1.0f;
  }();
  return yes;
}

}  // namespace gshard::detail

#endif
