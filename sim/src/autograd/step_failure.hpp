#pragma once
// Private to the simulated autograd: how a step stops early.

#include <string>
#include <utility>

#include "ferry/failure.hpp"

namespace ferry::sim {

/// Thrown inside a simulated step to stop it (a simulated OOM deep in a forward op); the
/// driver catches it at the top of the run and returns the Failure in its result.
struct StepFailure {
  Failure failure;
};

/// Stops the step: an allocation found no room.
[[noreturn]] inline void out_of_memory(std::string message) {
  throw StepFailure{Failure{FailureKind::OutOfMemory, std::move(message)}};
}

}  // namespace ferry::sim
