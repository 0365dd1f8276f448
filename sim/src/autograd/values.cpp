#include "values.hpp"

#include <algorithm>
#include <utility>

namespace ferry::sim {

namespace {

// Overwrites [lo, hi) of a piece list (offsets relative to a storage) with bytes
// [base, base + hi - lo) of value `id`.
void overwrite(Pieces& pieces, std::int64_t lo, std::int64_t hi, std::uint64_t id,
               std::int64_t base) {
  Pieces out;
  for (const ContentPiece& p : pieces) {
    const std::int64_t plo = p.offset.count();
    const std::int64_t phi = plo + p.bytes.count();
    if (phi <= lo || plo >= hi) {
      out.push_back(p);
      continue;
    }
    if (plo < lo) out.push_back(ContentPiece{p.offset, Bytes(lo - plo), p.id, p.base});
    if (phi > hi) {
      out.push_back(ContentPiece{Bytes(hi), Bytes(phi - hi), p.id, p.base + Bytes(hi - plo)});
    }
  }
  out.push_back(ContentPiece{Bytes(lo), Bytes(hi - lo), id, Bytes(base)});
  std::sort(out.begin(), out.end(),
            [](const ContentPiece& a, const ContentPiece& b) { return a.offset < b.offset; });
  pieces = std::move(out);
}

}  // namespace

void ContentMap::write(BufferId buffer, Bytes offset, Bytes bytes, std::uint64_t value) {
  overwrite(pieces_[buffer.value()], offset.count(), (offset + bytes).count(), value, 0);
}

void ContentMap::arrive(BufferId buffer, Bytes offset, const Pieces& saved) {
  Pieces& pieces = pieces_[buffer.value()];
  for (const ContentPiece& p : saved) {
    const std::int64_t lo = (offset + p.offset).count();
    overwrite(pieces, lo, lo + p.bytes.count(), p.id, p.base.count());
  }
}

Pieces ContentMap::slice(BufferId buffer, Bytes offset, Bytes bytes) const {
  Pieces out;
  const auto it = pieces_.find(buffer.value());
  const std::int64_t lo = offset.count();
  const std::int64_t hi = (offset + bytes).count();
  std::int64_t pos = lo;
  if (it != pieces_.end()) {
    for (const ContentPiece& p : it->second) {
      const std::int64_t a = std::max(lo, p.offset.count());
      const std::int64_t b = std::min(hi, p.offset.count() + p.bytes.count());
      if (a >= b) continue;
      if (a > pos) out.push_back(ContentPiece{Bytes(pos - lo), Bytes(a - pos), 0, Bytes(0)});
      out.push_back(
          ContentPiece{Bytes(a - lo), Bytes(b - a), p.id, p.base + Bytes(a - p.offset.count())});
      pos = b;
    }
  }
  if (pos < hi) out.push_back(ContentPiece{Bytes(pos - lo), Bytes(hi - pos), 0, Bytes(0)});
  return out;
}

std::uint64_t ContentMap::value(BufferId buffer, Bytes offset, Bytes bytes) const {
  return value_of(slice(buffer, offset, bytes));
}

std::uint64_t value_of(const Pieces& pieces) {
  if (pieces.size() == 1 && pieces[0].base.count() == 0) return pieces[0].id;
  std::uint64_t v = tag::kPieces;
  for (const ContentPiece& p : pieces) {
    v = mix_content(mix_content(v, p.id), static_cast<std::uint64_t>(p.base.count()));
  }
  return v;
}

Generators begin_replay(Generators& live, const Generators& start, bool restore) {
  Generators outer = live;
  if (restore) live = start;
  return outer;
}

}  // namespace ferry::sim
