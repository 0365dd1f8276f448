#pragma once
/// A free list of equal-sized nodes for the node-based maps on the simulator's hot paths.
///
/// The hazard checker's shadow and the content shadow split and merge byte ranges on nearly
/// every access: a node allocated and another freed each time. NodePool keeps freed nodes for
/// the next allocation and carves new ones from slabs, so those maps stop calling the general
/// allocator once they reach their largest size; the slabs are returned when the pool dies.
/// See Note [Node pools].

#include <algorithm>
#include <cstddef>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <vector>

namespace ferry::sim {

// Note [Node pools]
// A map allocates only its node type, one node at a time, so a pool serves a single size: the
// first single-node request fixes it. Requests of any other size or count (none from a map,
// but an allocator must serve them) go to the general allocator. A map and its pool have one
// owner: the owner holds the pool through a unique_ptr, so moving the owner moves neither the
// pool nor the nodes, and the map's allocator, a pointer to the pool, stays right. Copying
// such a map would share the pool between owners; the owners are move-only.

class NodePool {
 public:
  NodePool() = default;
  NodePool(const NodePool&) = delete;
  NodePool& operator=(const NodePool&) = delete;

  [[nodiscard]] void* allocate(std::size_t bytes) {
    if (node_bytes_ == 0) node_bytes_ = std::max(bytes, sizeof(Free));
    if (bytes != node_bytes_) return ::operator new(bytes);
    if (free_ == nullptr) grow();
    Free* node = free_;
    free_ = node->next;
    return node;
  }
  void deallocate(void* p, std::size_t bytes) {
    if (bytes != node_bytes_) {
      ::operator delete(p);
      return;
    }
    free_ = ::new (p) Free{free_};
  }

 private:
  struct Free {
    Free* next;
  };
  static constexpr std::size_t kSlabNodes = 64;
  // Nodes sit at a stride of max_align_t: map nodes need no stricter alignment.
  void grow() {
    constexpr std::size_t kAlign = alignof(std::max_align_t);
    const std::size_t stride = (node_bytes_ + kAlign - 1) / kAlign * kAlign;
    slabs_.emplace_back(new std::max_align_t[stride / kAlign * kSlabNodes]);
    auto* base = reinterpret_cast<std::byte*>(slabs_.back().get());
    for (std::size_t i = kSlabNodes; i-- > 0;) free_ = ::new (base + i * stride) Free{free_};
  }

  std::size_t node_bytes_ = 0;
  Free* free_ = nullptr;
  std::vector<std::unique_ptr<std::max_align_t[]>> slabs_;
};

/// The allocator a map uses to draw its nodes from a NodePool.
template <class T>
class NodePoolAllocator {
 public:
  using value_type = T;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;

  explicit NodePoolAllocator(NodePool* pool) noexcept : pool_(pool) {}
  template <class U>
  NodePoolAllocator(const NodePoolAllocator<U>& other) noexcept : pool_(other.pool()) {}

  [[nodiscard]] T* allocate(std::size_t n) {
    if (n != 1)
      return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{alignof(T)}));
    return static_cast<T*>(pool_->allocate(sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (n != 1) {
      ::operator delete (p, std::align_val_t{alignof(T)});
      return;
    }
    pool_->deallocate(p, sizeof(T));
  }
  [[nodiscard]] NodePool* pool() const noexcept { return pool_; }

  template <class U>
  friend bool operator==(const NodePoolAllocator& a, const NodePoolAllocator<U>& b) noexcept {
    return a.pool() == b.pool();
  }

 private:
  NodePool* pool_;
};

/// A std::map or std::set whose nodes come from a NodePool.
template <class K, class V, class Compare = std::less<>>
using PooledMap = std::map<K, V, Compare, NodePoolAllocator<std::pair<const K, V>>>;
template <class K, class Compare = std::less<>>
using PooledSet = std::set<K, Compare, NodePoolAllocator<K>>;

}  // namespace ferry::sim
