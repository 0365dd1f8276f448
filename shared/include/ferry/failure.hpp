#pragma once
/// Failure: an expected way for a run to stop, carried as a value in the run's result: what
/// kind it is, and a message that names the place.

#include <cstdint>
#include <string>

namespace ferry {

enum class FailureKind : std::uint8_t {
  OutOfMemory,  ///< an allocation found no room (device or pinned host memory)
  Misuse,       ///< an error the reference systems raise too (untracked id, checkpoint misuse)
  Infeasible,   ///< the configuration cannot run (bad options, plan or model)
};

/// "out of memory", "misuse", "infeasible".
[[nodiscard]] const char* failure_kind_name(FailureKind kind);

struct Failure {
  FailureKind kind = FailureKind::Misuse;
  std::string message;
};

}  // namespace ferry
