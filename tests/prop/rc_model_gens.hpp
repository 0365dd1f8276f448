#pragma once
// RapidCheck generator for random models' layer choices, and how a counterexample prints an
// offload policy.

#include <rapidcheck.h>

#include <ostream>

#include "ferry/offload/options.hpp"
#include "prop/random_model.hpp"

namespace ferry {

inline void showValue(Policy p, std::ostream& os) { os << policy_name(p); }

}  // namespace ferry

namespace ferry::sim::testing {

inline rc::Gen<LayerChoice> gen_layer() {
  return rc::gen::apply(
      [](std::uint32_t a, std::uint32_t b, std::uint32_t c, std::uint32_t d, std::uint32_t e,
         std::uint32_t f) { return LayerChoice{a, b, c, d, e, f}; },
      rc::gen::inRange<std::uint32_t>(0, 4), rc::gen::inRange<std::uint32_t>(0, 9),
      rc::gen::inRange<std::uint32_t>(0, 6), rc::gen::inRange<std::uint32_t>(0, 16),
      rc::gen::inRange<std::uint32_t>(0, 64), rc::gen::inRange<std::uint32_t>(0, 8));
}

}  // namespace ferry::sim::testing
