#pragma once
/// Records the stream operations a backend is asked for as a program (`ferry.program/1`,
/// docs/program-format.md), so that `ferry check` audits a real run.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/backend.hpp"
#include "ferry/program/program.hpp"
#include "ferry/units.hpp"

namespace ferry {

// Note [Recording a real run]
// A real device only sees the copies, events and allocations the scheduler asks for; the
// kernels that produce and consume activations run inside the framework. The recorder stands
// them in with two kernels on the compute stream: one that writes a storage when it is handed
// to the scheduler (its producer ran before the pack hook), and one that reads the range a
// backward node gets back (its consumer runs after the unpack hook). Every buffer handle gets
// its own slot; a slot is allocated when the handle is created and freed when its last
// scheduler reference is dropped.
class Recorder {
 public:
  explicit Recorder(std::string profile = "h100-sxm-pcie5");

  std::uint32_t add_stream(std::string_view name);
  std::uint32_t add_event();
  std::uint32_t add_buffer(Place place, Bytes bytes);

  void alloc(std::uint32_t buffer, std::int64_t stream);  ///< stream < 0: a host buffer
  void free(std::uint32_t buffer);
  void produce(std::uint32_t stream, std::uint32_t buffer, Bytes offset, Bytes bytes);
  void consume(std::uint32_t stream, std::uint32_t buffer, Bytes offset, Bytes bytes);
  void copy(std::uint32_t stream, std::uint32_t src, Bytes src_offset, std::uint32_t dst,
            Bytes dst_offset, Bytes bytes);
  void record(std::uint32_t event, std::uint32_t stream);
  void wait(std::uint32_t stream, std::uint32_t event);
  void record_stream(std::uint32_t buffer, std::uint32_t stream);
  void synchronize(std::uint32_t stream);  ///< the host waits for the stream

  /// The program so far.
  [[nodiscard]] const Program& program() const { return program_; }
  /// The program so far, as a JSON document (program_to_json).
  [[nodiscard]] std::string json() const;

 private:
  void add(OpKind kind, StreamId stream, EventId event, SlotId slot);
  void kernel(const char* label, std::uint32_t stream, SlotRange range, bool writes);
  [[nodiscard]] SlotRange range(std::uint32_t buffer, Bytes offset, Bytes bytes) const;

  Program program_;
};

}  // namespace ferry
