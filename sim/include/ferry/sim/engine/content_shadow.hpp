#pragma once
/// Shadow content: which value each byte of an address range holds, as an interval map. The
/// simulator keeps one per memory space to see what a kernel actually reads.

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "ferry/sim/support/node_pool.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// A piece of shadow content: bytes [offset, offset+bytes) of a region hold bytes
/// [base, base+bytes) of the value identified by `id` (0: never written).
struct ContentPiece {
  Bytes offset;
  Bytes bytes;
  std::uint64_t id = 0;
  Bytes base;
  friend bool operator==(const ContentPiece&, const ContentPiece&) = default;
};

/// Combines content ids into a new one (never 0): the value an op computes from its inputs.
[[nodiscard]] constexpr std::uint64_t mix_content(std::uint64_t a, std::uint64_t b) {
  std::uint64_t z = a * 0x9e3779b97f4a7c15ULL + b + 0x632be59bd9b4e019ULL;
  z = (z ^ (z >> 30U)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27U)) * 0x94d049bb133111ebULL;
  z ^= z >> 31U;
  return z == 0 ? 1 : z;
}

/// Content ids of one address space by byte range: maximal runs of one value, never
/// overlapping; bytes never written hold id 0 and take no room.
class ContentShadow {
 public:
  ContentShadow() = default;
  // Move-only, and not move-assignable: the map's nodes live in the pool it owns.
  ContentShadow(ContentShadow&&) noexcept = default;
  ContentShadow& operator=(ContentShadow&&) = delete;

  /// Bytes [lo, hi) now hold bytes [base, base + (hi - lo)) of value `id` (0 forgets them).
  void write(Bytes lo, Bytes hi, std::uint64_t id, Bytes base);
  /// Copies what [src, src + bytes) of `from` holds into [dst, dst + bytes) of this space.
  void copy_from(const ContentShadow& from, Bytes src, Bytes dst, Bytes bytes);
  /// The content of [lo, hi) in address order, offsets relative to `lo`, unwritten runs as
  /// pieces of id 0.
  [[nodiscard]] std::vector<ContentPiece> read(Bytes lo, Bytes hi) const;
  /// Whether [lo, hi) holds exactly `expected` (as read() would give it), without the list.
  [[nodiscard]] bool holds(Bytes lo, Bytes hi, std::span<const ContentPiece> expected) const;

 private:
  struct Run {
    Bytes hi;
    std::uint64_t id = 0;
    Bytes base;
  };
  // Calls f(piece) for each piece read() gives.
  template <class F>
  void for_each_piece(Bytes lo, Bytes hi, F&& f) const;

  // start -> run; nodes from pool_ (Note [Node pools] in node_pool.hpp)
  std::unique_ptr<NodePool> pool_ = std::make_unique<NodePool>();
  std::map<Bytes, Run, std::less<>, NodePoolAllocator<std::pair<const Bytes, Run>>> runs_{
      NodePoolAllocator<std::pair<const Bytes, Run>>(pool_.get())};
};

}  // namespace ferry::sim
