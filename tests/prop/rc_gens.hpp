#pragma once
// RapidCheck generators for random programs.

#include <rapidcheck.h>

#include <ostream>

#include "prop/random_program.hpp"

namespace ferry::sim::testing {

inline void showValue(const OpChoice& c, std::ostream& os) {
  os << "{" << c.kind << "," << c.a << "," << c.b << "," << c.c << "," << c.x << "," << c.y << "}";
}

inline void showValue(const ProgramShape& s, std::ostream& os) {
  os << s.devices << " device(s), " << s.streams << " streams, " << s.events << " events, "
     << s.slots.size() << " buffers";
}

inline rc::Gen<OpChoice> gen_choice() {
  return rc::gen::apply(
      [](std::uint32_t kind, std::uint32_t a, std::uint32_t b, std::uint32_t c, std::uint32_t x,
         std::uint32_t y) { return OpChoice{kind, a, b, c, x, y}; },
      rc::gen::inRange<std::uint32_t>(0, 14), rc::gen::inRange<std::uint32_t>(0, 64),
      rc::gen::inRange<std::uint32_t>(0, 64), rc::gen::inRange<std::uint32_t>(0, 64),
      rc::gen::arbitrary<std::uint32_t>(), rc::gen::arbitrary<std::uint32_t>());
}

/// A shape: 1-2 devices, 2-4 streams, 1-3 events, 2-6 small buffers, random speeds.
inline rc::Gen<ProgramShape> gen_shape() {
  return rc::gen::map(rc::gen::arbitrary<std::uint64_t>(), [](std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    return random_shape(rng, 2 + static_cast<std::uint32_t>(seed % 5));
  });
}

/// Up to RapidCheck's size parameter (100 by default) choices.
inline rc::Gen<std::vector<OpChoice>> gen_choices() {
  return rc::gen::container<std::vector<OpChoice>>(gen_choice());
}

}  // namespace ferry::sim::testing
