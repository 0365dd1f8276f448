#include <string>
#include <vector>

#include "ferry/sim/export/memory_snapshot.hpp"

namespace ferry::sim {

Result<std::vector<AllocatorHistory>> allocator_history(const Simulator& sim) {
  const AllocatorLog* log = sim.allocator_log();
  if (log == nullptr) {
    return Error{std::string(
        "the run kept no allocator actions; a memory snapshot needs SimOptions::record_allocator "
        "set before the run")};
  }
  std::vector<AllocatorHistory> out;
  for (std::uint32_t d = 0; d < sim.device_count(); ++d) {
    AllocatorHistory h;
    h.device = DeviceId(d);
    h.events = log->events(h.device);
    h.segments = sim.device_allocator(h.device).segments();
    h.mode = sim.device_allocator(h.device).mode();
    // The blocks still allocated or pending at the end, and who obtained each segment left.
    for (const AllocatorEvent& e : h.events) {
      switch (e.action) {
        case AllocatorEvent::Action::Alloc:
          h.block_buffers[e.address] = e.buffer;
          break;
        case AllocatorEvent::Action::FreeCompleted:
          h.block_buffers.erase(e.address);
          break;
        case AllocatorEvent::Action::SegmentAlloc:
          h.segment_ops[e.address] = e.op;
          break;
        case AllocatorEvent::Action::SegmentFree:
          h.segment_ops.erase(e.address);
          break;
        case AllocatorEvent::Action::SegmentMap:
          h.segment_ops[e.address] = e.op;
          break;
        case AllocatorEvent::Action::SegmentUnmap:
          // The maps wholly inside the unmapped pages are gone; one that began before them
          // still names the mapped range in front.
          h.segment_ops.erase(h.segment_ops.lower_bound(e.address),
                              h.segment_ops.lower_bound(e.address + e.size));
          break;
        default:
          break;
      }
    }
    out.push_back(std::move(h));
  }
  return out;
}

}  // namespace ferry::sim
