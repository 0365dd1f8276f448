#pragma once
/// Executing a stream program on the simulator.

#include <optional>
#include <string>

#include "ferry/failure.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/engine/program.hpp"
#include "ferry/sim/engine/simulator.hpp"

namespace ferry::sim {

/// A finished simulation of a program. Simulator op i is program op i.
struct ProgramRun {
  Simulator sim;
  /// Set when the program stopped early: an allocation failed (out of memory).
  std::optional<Failure> failure;
  /// Number of program ops issued (all of them unless `failure`).
  std::size_t issued = 0;
};

/// Runs every op of `program` in order, then lets the devices drain. Misuse the simulator can
/// see at run time (use before alloc, use after free, double free, races) becomes hazards;
/// an alloc of a slot that already holds memory is an error naming the op. `observer`, when
/// given, hears the whole run (a trace writer, say).
Result<ProgramRun> run_program(const Program& program, SimOptions options = {},
                               SimFaults faults = {}, SimObserver* observer = nullptr);

}  // namespace ferry::sim
