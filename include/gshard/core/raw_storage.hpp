// gshard/core/raw_storage.hpp — memory for elements that are written before
// they are read: a fixed buffer and a growable array whose new elements are
// left unwritten. A std::vector zeroes what it grows by — a pass over the
// memory for nothing when a copy, a conversion or a collective fills it next
// — and bf16's default constructor writes 0 too, so even
// make_unique_for_overwrite zeroes bf16. Elements must be trivially copyable
// and destructible: they begin their lifetime as they are written.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

namespace gshard::detail {

struct raw_delete {
  void operator()(void* p) const { ::operator delete[](p); }
};
template <class T>
using uninitialized_buffer = std::unique_ptr<T[], raw_delete>;

// n elements, not initialized.
template <class T>
uninitialized_buffer<T> uninitialized(std::size_t n) {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>);
  if (n > std::numeric_limits<std::size_t>::max() / sizeof(T)) throw std::bad_array_new_length();
  return uninitialized_buffer<T>(static_cast<T*>(::operator new[](n * sizeof(T))));
}

// A growable array whose resize() leaves new elements unwritten; it keeps
// its memory through clear(), so a buffer reused step after step touches
// fresh pages only when it grows.
template <class T>
class raw_vector {
 public:
  raw_vector() = default;
  raw_vector(raw_vector&& o) noexcept
      : data_(std::move(o.data_)), size_(std::exchange(o.size_, 0)), capacity_(std::exchange(o.capacity_, 0)) {}
  raw_vector& operator=(raw_vector&& o) noexcept {
    data_ = std::move(o.data_);
    size_ = std::exchange(o.size_, 0);
    capacity_ = std::exchange(o.capacity_, 0);
    return *this;
  }

  std::size_t size() const { return size_; }
  std::size_t capacity() const { return capacity_; }
  bool empty() const { return size_ == 0; }
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  operator std::span<T>() { return {data(), size_}; }
  operator std::span<const T>() const { return {data(), size_}; }

  void clear() { size_ = 0; }
  // n elements: the first min(n, size()) kept, the rest not initialized.
  void resize(std::size_t n) {
    reserve(n);
    size_ = n;
  }
  // Room for n without moving: grows at least geometrically, keeping size().
  void reserve(std::size_t n) {
    if (n <= capacity_) return;
    const std::size_t c = std::max(n, capacity_ + capacity_ / 2);
    uninitialized_buffer<T> grown = uninitialized<T>(c);
    if (size_ > 0) std::memcpy(grown.get(), data_.get(), size_ * sizeof(T));
    data_ = std::move(grown);
    capacity_ = c;
  }
  void append(std::span<const T> v) {
    reserve(size_ + v.size());
    if (!v.empty()) std::memcpy(data_.get() + size_, v.data(), v.size() * sizeof(T));
    size_ += v.size();
  }

 private:
  uninitialized_buffer<T> data_;
  std::size_t size_ = 0, capacity_ = 0;
};

}  // namespace gshard::detail
