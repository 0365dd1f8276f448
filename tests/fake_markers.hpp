#pragma once
// Test doubles shared by the allocator tests.

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
  }
  void complete(MarkerId marker) { done.at(marker.value()) = true; }
  void complete_all() { done.assign(done.size(), true); }

  std::vector<StreamId> recorded;  // stream of each marker, indexed by marker id
  std::vector<bool> done;
  int queries = 0;
  int synchronizes = 0;
};

}  // namespace ferry::sim::testing
