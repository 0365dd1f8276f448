#pragma once
// Test doubles shared by the allocator tests.

#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

#include "ferry/sim/memory/stream_markers.hpp"
#include "ferry/units.hpp"

namespace ferry {
/// Prints byte counts readably in test failures.
inline void PrintTo(Bytes bytes, std::ostream* os) { *os << bytes.count() << " B"; }
}  // namespace ferry

namespace ferry::sim::testing {

/// Markers that complete only when the test says so; synchronize completes one and counts.
class FakeMarkers final : public StreamMarkers {
 public:
  MarkerId record(StreamId stream) override {
    recorded.push_back(stream);
    done.push_back(false);
    return MarkerId(static_cast<MarkerId::rep_type>(recorded.size() - 1));
  }
  bool query(MarkerId marker) override {
    ++queries;
    return done.at(marker.value());
  }
  void synchronize(MarkerId marker) override {
    ++synchronizes;
    done.at(marker.value()) = true;
    ++completed;
  }
  void complete(MarkerId marker) {
    done.at(marker.value()) = true;
    ++completed;
  }
  void complete_all() {
    done.assign(done.size(), true);
    ++completed;
  }
  /// The completed count when `counts_completions` (as the simulated device keeps one).
  [[nodiscard]] std::optional<std::uint64_t> completions() const override {
    return counts_completions ? std::optional<std::uint64_t>(completed) : std::nullopt;
  }

  std::vector<StreamId> recorded;  // stream of each marker, indexed by marker id
  std::vector<bool> done;
  bool counts_completions = false;
  std::uint64_t completed = 0;
  int queries = 0;
  int synchronizes = 0;
};

}  // namespace ferry::sim::testing
