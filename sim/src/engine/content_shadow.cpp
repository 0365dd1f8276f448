#include "ferry/sim/engine/content_shadow.hpp"

#include <algorithm>
#include <iterator>

namespace ferry::sim {

void ContentShadow::write(Bytes lo, Bytes hi, std::uint64_t id, Bytes base) {
  auto it = runs_.lower_bound(lo);
  // The usual case, a buffer written whole again: one run is exactly [lo, hi).
  if (it != runs_.end() && it->first == lo && it->second.hi == hi) {
    if (id == 0) {
      runs_.erase(it);
    } else {
      it->second.id = id;
      it->second.base = base;
    }
    return;
  }
  // Trim runs overlapping [lo, hi), keeping their outside parts.
  if (it != runs_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.hi > lo) {
      const Run old = prev->second;
      prev->second.hi = lo;
      if (old.hi > hi) runs_.emplace(hi, Run{old.hi, old.id, old.base + (hi - prev->first)});
    }
  }
  it = runs_.lower_bound(lo);
  while (it != runs_.end() && it->first < hi) {
    const Run old = it->second;
    const Bytes start = it->first;
    it = runs_.erase(it);
    if (old.hi > hi) {
      it = runs_.emplace_hint(it, hi, Run{old.hi, old.id, old.base + (hi - start)});
      break;
    }
  }
  // `it` is the first run at or after hi: the new run goes just before it.
  if (id != 0) runs_.emplace_hint(it, lo, Run{hi, id, base});
}

void ContentShadow::copy_from(const ContentShadow& from, Bytes src, Bytes dst, Bytes bytes) {
  if (bytes == Bytes(0)) return;
  for (const ContentPiece& p : from.read(src, src + bytes)) {
    const Bytes lo = dst + p.offset;
    write(lo, lo + p.bytes, p.id, p.base);
  }
}

template <class F>
void ContentShadow::for_each_piece(Bytes lo, Bytes hi, F&& f) const {
  auto it = runs_.upper_bound(lo);
  if (it != runs_.begin()) --it;
  Bytes pos = lo;
  for (; it != runs_.end() && it->first < hi; ++it) {
    const Bytes run_lo = std::max(it->first, lo);
    const Bytes run_hi = std::min(it->second.hi, hi);
    if (run_lo >= run_hi) continue;
    if (run_lo > pos) f(ContentPiece{pos - lo, run_lo - pos, 0, {}});
    f(ContentPiece{run_lo - lo, run_hi - run_lo, it->second.id,
                   it->second.base + (run_lo - it->first)});
    pos = run_hi;
  }
  if (pos < hi) f(ContentPiece{pos - lo, hi - pos, 0, {}});
}

std::vector<ContentPiece> ContentShadow::read(Bytes lo, Bytes hi) const {
  std::vector<ContentPiece> out;
  for_each_piece(lo, hi, [&](const ContentPiece& p) { out.push_back(p); });
  return out;
}

bool ContentShadow::holds(Bytes lo, Bytes hi, std::span<const ContentPiece> expected) const {
  std::size_t k = 0;
  bool same = true;
  for_each_piece(lo, hi, [&](const ContentPiece& p) {
    same = same && k < expected.size() && expected[k] == p;
    ++k;
  });
  return same && k == expected.size();
}

}  // namespace ferry::sim
