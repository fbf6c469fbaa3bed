// gshard/layout/notation.hpp — a sharded tensor's type as text, the way errors,
// plans and describe() print it: f32[G{data},S,M] partial{expert}.
// Knows nothing of MPI.
#pragma once

#include <string>
#include <string_view>

#include "gshard/layout/sharding.hpp"
#include "gshard/core/types.hpp"

namespace gshard {
namespace detail {

template <class T>
constexpr std::string_view dtype_name() {
  return name_of(element_of<T>());
}

// `labels` names each dim (an einsum term such as "GSM"); when empty the dims
// print as their extents if `extents` is given, else as d0, d1, ...
inline std::string notation(const sharding_spec& s, int rank, std::string_view dtype, std::string_view labels = {},
                            const index_t* extents = nullptr) {
  std::string out(dtype);
  out += '[';
  for (int d = 0; d < rank; ++d) {
    if (d) out += ',';
    if (d < int(labels.size())) out += labels[std::size_t(d)];
    else if (extents) out += std::to_string(extents[d]);
    else {
      out += 'd';
      out += std::to_string(d);
    }
    if (d < max_rank && s.dims[d].n > 0) {
      out += '{';
      for (int i = 0; i < s.dims[d].n; ++i) {
        if (i) out += ',';
        out += s.dims[d].axes[i].view();
      }
      out += '}';
    }
  }
  out += ']';
  if (s.npartial > 0) {
    out += " partial{";
    for (int i = 0; i < s.npartial; ++i) {
      if (i) out += ',';
      out += s.partial[i].view();
    }
    out += '}';
  }
  return out;
}

}  // namespace detail

// The notation of a sharding type, e.g. to_string<sharding<split<0,"data">>>(3, "GSM") == "[G{data},S,M]".
template <sharding_type S>
std::string to_string(int rank, std::string_view labels = {}) {
  return detail::notation(S::spec, rank, "", labels);
}

}  // namespace gshard
