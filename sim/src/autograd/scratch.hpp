#pragma once
// Private to the simulated autograd: vectors lent for one call and kept for their capacity.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "ferry/check.hpp"

namespace ferry::sim {

// Note [Scratch]
// The planner simulates one step of one model thousands of times, and each simulation makes a
// call per forward op and per backward node. What such a call needs only while it runs (the
// regions its kernel reads and writes, their values, the label it gives the kernel, the
// replay's scope of bound tensors) is lent from the Trainer and given back for the next call,
// so that after the first few ops a step allocates for what it keeps, not for what it passes.

/// Vectors of T lent for the length of a call and then kept, cleared, for their capacity: a
/// call made for every op or node of every simulated step allocates nothing once the pool's
/// vectors have grown. A call that runs inside another (a recomputation inside a backward
/// node) borrows a vector of its own. Room to keep every lent vector is reserved when it is
/// lent, so giving it back never allocates.
template <class T>
class ScratchPool {
 public:
  class Lease {
   public:
    explicit Lease(ScratchPool& pool) : pool_(&pool) {
      if (!pool.kept_.empty()) {
        vector_ = std::move(pool.kept_.back());
        pool.kept_.pop_back();
      }
      ++pool.lent_;
      pool.kept_.reserve(pool.kept_.size() + pool.lent_);
    }
    ~Lease() {
      vector_.clear();
      --pool_->lent_;
      pool_->kept_.push_back(std::move(vector_));
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lease(Lease&&) = delete;
    Lease& operator=(Lease&&) = delete;

    std::vector<T>& operator*() { return vector_; }
    std::vector<T>* operator->() { return &vector_; }

   private:
    ScratchPool* pool_;
    std::vector<T> vector_;
  };

  /// An empty vector, the pool's until the lease ends.
  [[nodiscard]] Lease borrow() { return Lease(*this); }

 private:
  std::vector<std::vector<T>> kept_;
  std::size_t lent_ = 0;
};

/// A value or none for each tensor index of a model, in place of a map keyed by tensor index:
/// a look-up is an index, and for_each visits the entries in index order, as a map's iteration
/// would.
template <class T>
class TensorSlots {
 public:
  explicit TensorSlots(std::size_t tensors = 0) : slots_(tensors) {}
  [[nodiscard]] bool contains(std::uint32_t t) const {
    return t < slots_.size() && slots_[t].has_value();
  }
  [[nodiscard]] const T& at(std::uint32_t t) const {
    FERRY_CHECK(contains(t), "tensor {} has no entry", t);
    return *slots_[t];
  }
  /// The entry of `t`, made (value-initialised) if it has none.
  T& operator[](std::uint32_t t) {
    FERRY_CHECK(t < slots_.size(), "tensor {} is outside the model", t);
    if (!slots_[t]) slots_[t].emplace();
    return *slots_[t];
  }
  void erase(std::uint32_t t) {
    if (t < slots_.size()) slots_[t].reset();
  }
  void clear() {
    for (std::optional<T>& s : slots_) s.reset();
  }
  template <class F>
  void for_each(F f) const {
    for (std::uint32_t t = 0; t < slots_.size(); ++t) {
      if (slots_[t]) f(t, *slots_[t]);
    }
  }

 private:
  std::vector<std::optional<T>> slots_;
};

}  // namespace ferry::sim
