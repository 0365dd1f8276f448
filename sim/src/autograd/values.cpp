#include "values.hpp"

#include <algorithm>
#include <optional>
#include <utility>

#include "ferry/sim/support/by_id.hpp"

namespace ferry::sim {

// Note [Content pieces]
// A storage's pieces are sorted by offset and never overlap. The planner runs this for every
// op of every simulation, so a write rebuilds the list into a scratch list that then swaps
// with it (the two trade capacity; neither allocates once they are large enough), and a
// read walks the pieces in place.

// Calls f(piece) for each piece of [lo, hi) of `pieces` in offset order, offsets relative to
// lo; never-written gaps are pieces of id 0.
template <class F>
void for_each_piece(const Pieces* pieces, std::int64_t lo, std::int64_t hi, F&& f) {
  std::int64_t pos = lo;
  if (pieces != nullptr) {
    for (const ContentPiece& p : *pieces) {
      const std::int64_t a = std::max(lo, p.offset.count());
      const std::int64_t b = std::min(hi, p.offset.count() + p.bytes.count());
      if (a >= b) continue;
      if (a > pos) f(ContentPiece{Bytes(pos - lo), Bytes(a - pos), 0, Bytes(0)});
      f(ContentPiece{Bytes(a - lo), Bytes(b - a), p.id, p.base + Bytes(a - p.offset.count())});
      pos = b;
    }
  }
  if (pos < hi) f(ContentPiece{Bytes(pos - lo), Bytes(hi - pos), 0, Bytes(0)});
}

// Folds pieces, in order, into what value_of() gives for them.
class PieceValue {
 public:
  void add(const ContentPiece& p) {
    if (count_++ == 0) first_ = p;
    mixed_ = mix_content(mix_content(mixed_, p.id), static_cast<std::uint64_t>(p.base.count()));
  }
  [[nodiscard]] std::uint64_t value() const {
    return count_ == 1 && first_.base.count() == 0 ? first_.id : mixed_;
  }

 private:
  std::size_t count_ = 0;
  ContentPiece first_;
  std::uint64_t mixed_ = tag::kPieces;
};

void ContentMap::overwrite(Pieces& pieces, std::int64_t lo, std::int64_t hi, std::uint64_t id,
                           std::int64_t base) {
  Pieces& out = scratch_;
  out.clear();
  std::size_t k = 0;
  for (; k < pieces.size() && pieces[k].offset.count() + pieces[k].bytes.count() <= lo; ++k)
    out.push_back(pieces[k]);
  std::optional<ContentPiece> right;  // what is left after hi of the last piece it overlaps
  for (; k < pieces.size() && pieces[k].offset.count() < hi; ++k) {
    const ContentPiece& p = pieces[k];
    const std::int64_t plo = p.offset.count();
    const std::int64_t phi = plo + p.bytes.count();
    if (plo < lo) out.push_back(ContentPiece{p.offset, Bytes(lo - plo), p.id, p.base});
    if (phi > hi) right = ContentPiece{Bytes(hi), Bytes(phi - hi), p.id, p.base + Bytes(hi - plo)};
  }
  // A write of no bytes keeps no piece, but still splits a piece around it at lo.
  if (lo < hi) out.push_back(ContentPiece{Bytes(lo), Bytes(hi - lo), id, Bytes(base)});
  if (right) out.push_back(*right);
  out.append(pieces.begin() + static_cast<std::ptrdiff_t>(k), pieces.end());
  pieces.swap(out);
}

Pieces& ContentMap::pieces_of(BufferId buffer) {
  cover(pieces_, buffer.value());
  return pieces_[buffer.value()];
}

const Pieces* ContentMap::find(BufferId buffer) const {
  return buffer.value() < pieces_.size() ? &pieces_[buffer.value()] : nullptr;
}

void ContentMap::write(BufferId buffer, Bytes offset, Bytes bytes, std::uint64_t value) {
  if (!kept_) return;
  overwrite(pieces_of(buffer), offset.count(), (offset + bytes).count(), value, 0);
}

void ContentMap::arrive(BufferId buffer, Bytes offset, const Pieces& saved) {
  if (!kept_) return;
  Pieces& pieces = pieces_of(buffer);
  for (const ContentPiece& p : saved) {
    const std::int64_t lo = (offset + p.offset).count();
    overwrite(pieces, lo, lo + p.bytes.count(), p.id, p.base.count());
  }
}

Pieces ContentMap::slice(BufferId buffer, Bytes offset, Bytes bytes) const {
  Pieces out;
  if (!kept_) return out;
  for_each_piece(find(buffer), offset.count(), (offset + bytes).count(),
                 [&](const ContentPiece& p) { out.push_back(p); });
  return out;
}

std::uint64_t ContentMap::value(BufferId buffer, Bytes offset, Bytes bytes) const {
  if (!kept_) return 0;
  PieceValue v;  // value_of(slice(...)), without the list
  for_each_piece(find(buffer), offset.count(), (offset + bytes).count(),
                 [&](const ContentPiece& p) { v.add(p); });
  return v.value();
}

std::uint64_t value_of(const Pieces& pieces) {
  PieceValue v;
  for (const ContentPiece& p : pieces) v.add(p);
  return v.value();
}

Generators begin_replay(Generators& live, const Generators& start, bool restore) {
  Generators outer = live;
  if (restore) live = start;
  return outer;
}

}  // namespace ferry::sim
