// gshard/core/fixed_string.hpp — compile-time strings for template arguments.
// `fixed_string` carries a literal such as "data" or "GSEC,GSM->EGCM" as a
// non-type template parameter; `detail::name_t` is a bounded copy of a short
// name that can live inside the structural specs the planners compute with.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string_view>

namespace gshard {

template <std::size_t N>
struct fixed_string {
  char data[N]{};

  constexpr fixed_string() = default;
  consteval fixed_string(const char (&s)[N]) { std::copy_n(s, N, data); }  // NOLINT: implicit by design

  static constexpr std::size_t size() { return N - 1; }
  constexpr std::string_view view() const { return {data, N - 1}; }
  constexpr char operator[](std::size_t i) const { return data[i]; }
};

template <std::size_t N>
fixed_string(const char (&)[N]) -> fixed_string<N>;

namespace detail {

inline constexpr std::size_t max_name_length = 23;

// A short name (an axis name) stored by value, usable inside structural types.
struct name_t {
  char s[max_name_length + 1]{};

  constexpr name_t() = default;
  constexpr name_t(std::string_view v) {  // NOLINT: implicit from string_view
    for (std::size_t i = 0; i < v.size() && i < max_name_length; ++i) s[i] = v[i];
  }

  constexpr std::string_view view() const {
    std::size_t n = 0;
    while (n < max_name_length && s[n] != '\0') ++n;
    return {s, n};
  }
  constexpr bool empty() const { return s[0] == '\0'; }
  friend constexpr bool operator==(const name_t&, const name_t&) = default;
  friend constexpr bool operator<(const name_t& a, const name_t& b) { return a.view() < b.view(); }
};

// A fixed_string of exactly v's length (every element written explicitly).
template <std::size_t Len>
consteval fixed_string<Len + 1> to_fixed(std::string_view v) {
  fixed_string<Len + 1> f;
  for (std::size_t i = 0; i < Len; ++i) f.data[i] = v[i];
  f.data[Len] = '\0';
  return f;
}

}  // namespace detail
}  // namespace gshard
