#pragma once
/// A vector that keeps up to N elements in place and moves to the heap beyond them, for lists
/// that the simulator makes per op and that are nearly always short (the content pieces of one
/// tensor: one piece unless views of it were written apart).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <type_traits>

#include "ferry/check.hpp"

namespace ferry::sim {

/// A contiguous sequence of trivially copyable T, its first N elements stored in the object.
/// Copies copy the elements; a move takes the heap storage when there is one.
template <class T, std::size_t N>
class SmallVector {
  static_assert(std::is_trivially_copyable_v<T> && std::is_default_constructible_v<T>);
  static_assert(N > 0);

 public:
  using value_type = T;
  using iterator = T*;
  using const_iterator = const T*;

  SmallVector() = default;
  SmallVector(std::initializer_list<T> items) { append(items.begin(), items.end()); }
  SmallVector(const SmallVector& other) { append(other.begin(), other.end()); }
  SmallVector(SmallVector&& other) noexcept { take(other); }
  SmallVector& operator=(const SmallVector& other) {
    if (this != &other) {
      clear();
      append(other.begin(), other.end());
    }
    return *this;
  }
  SmallVector& operator=(SmallVector&& other) noexcept {
    if (this != &other) take(other);
    return *this;
  }
  ~SmallVector() = default;

  [[nodiscard]] std::size_t size() const { return size_; }
  [[nodiscard]] bool empty() const { return size_ == 0; }
  [[nodiscard]] std::size_t capacity() const { return heap_ ? capacity_ : N; }
  [[nodiscard]] T* data() { return heap_ ? heap_.get() : inline_.data(); }
  [[nodiscard]] const T* data() const { return heap_ ? heap_.get() : inline_.data(); }
  [[nodiscard]] T* begin() { return data(); }
  [[nodiscard]] T* end() { return data() + size_; }
  [[nodiscard]] const T* begin() const { return data(); }
  [[nodiscard]] const T* end() const { return data() + size_; }
  [[nodiscard]] T& operator[](std::size_t i) { return data()[i]; }
  [[nodiscard]] const T& operator[](std::size_t i) const { return data()[i]; }
  [[nodiscard]] T& back() { return data()[size_ - 1]; }
  [[nodiscard]] const T& back() const { return data()[size_ - 1]; }

  void clear() { size_ = 0; }
  void reserve(std::size_t count) {
    if (count <= capacity()) return;
    FERRY_CHECK(count <= UINT32_MAX, "a small vector of {} elements", count);
    auto grown = std::make_unique_for_overwrite<T[]>(count);
    std::copy(begin(), end(), grown.get());
    heap_ = std::move(grown);
    capacity_ = static_cast<std::uint32_t>(count);
  }
  void push_back(T item) {  // by value: `item` may be one of this vector's elements
    if (size_ == capacity()) reserve(2 * capacity());
    data()[size_++] = item;
  }
  template <class It>
  void append(It first, It last) {
    reserve(size_ + static_cast<std::size_t>(std::distance(first, last)));
    for (; first != last; ++first) data()[size_++] = *first;
  }
  /// Exchanges contents; each keeps its own in-place storage.
  void swap(SmallVector& other) noexcept {
    SmallVector held(std::move(other));
    other.take(*this);
    take(held);
  }

  friend bool operator==(const SmallVector& a, const SmallVector& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  // Takes other's elements (its heap storage when it has one) and leaves it empty.
  void take(SmallVector& other) noexcept {
    if (other.heap_) {
      heap_ = std::move(other.heap_);
      capacity_ = other.capacity_;
    } else {
      heap_.reset();
      std::copy(other.inline_.begin(), other.inline_.begin() + other.size_, inline_.begin());
    }
    size_ = other.size_;
    other.size_ = 0;
  }

  std::array<T, N> inline_{};
  std::unique_ptr<T[]> heap_;  // the elements, once more than N were held
  std::uint32_t size_ = 0;
  std::uint32_t capacity_ = 0;  // heap_'s
};

}  // namespace ferry::sim
