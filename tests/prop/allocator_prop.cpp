// Property tests of the allocator models: random sequences of malloc, free, record_stream, stream
// progress and empty_cache, checked after every step against a small model of what must hold.

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <iostream>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ferry/sim/memory/caching_allocator.hpp"
#include "ferry/sim/memory/host_allocator.hpp"

namespace ferry::sim {
namespace {

constexpr std::uint32_t kStreams = 3;
constexpr Bytes kDeviceBase{std::int64_t{1} << 32};
constexpr Bytes kHostBase{std::int64_t{1} << 40};

/// One step of a random scenario. `index` picks a live block (modulo their number).
struct Op {
  enum class Kind : std::uint8_t { Malloc, Free, RecordStream, Complete, EmptyCache };
  Kind kind = Kind::Malloc;
  std::uint32_t stream = 0;  // Malloc (device), RecordStream, Complete
  std::int64_t size = 0;     // Malloc
  std::size_t index = 0;     // Free, RecordStream
  bool exact = false;        // Malloc (pinned): the Exact pool rather than Caching
};

void showValue(const Op& op, std::ostream& os) {
  switch (op.kind) {
    case Op::Kind::Malloc:
      os << "malloc(stream " << op.stream << ", " << op.size << " B" << (op.exact ? ", exact" : "")
         << ")";
      return;
    case Op::Kind::Free:
      os << "free(#" << op.index << ")";
      return;
    case Op::Kind::RecordStream:
      os << "record_stream(#" << op.index << ", stream " << op.stream << ")";
      return;
    case Op::Kind::Complete:
      os << "complete(stream " << op.stream << ")";
      return;
    case Op::Kind::EmptyCache:
      os << "empty_cache()";
      return;
  }
}

/// Streams as counters of submitted and completed work; a marker is a point on one stream.
/// Nothing completes unless the scenario (or a synchronize) says so.
class StreamProgress final : public StreamMarkers {
 public:
  MarkerId record(StreamId stream) override {
    FERRY_CHECK(stream.value() < kStreams, "marker on unknown stream {}", stream.value());
    markers_.emplace_back(stream.value(), submitted_[stream.value()]);
    return MarkerId(static_cast<MarkerId::rep_type>(markers_.size() - 1));
  }
  bool query(MarkerId marker) override {
    const auto [stream, point] = markers_.at(marker.value());
    return completed_[stream] >= point;
  }
  void synchronize(MarkerId marker) override {
    const auto [stream, point] = markers_.at(marker.value());
    completed_[stream] = std::max(completed_[stream], point);
  }

  void submit(std::uint32_t stream) { ++submitted_[stream]; }
  void complete(std::uint32_t stream) { completed_[stream] = submitted_[stream]; }
  void complete_all() { completed_ = submitted_; }
  [[nodiscard]] std::int64_t submitted(std::uint32_t stream) const { return submitted_[stream]; }
  [[nodiscard]] bool reached(std::uint32_t stream, std::int64_t point) const {
    return completed_[stream] >= point;
  }

 private:
  std::array<std::int64_t, kStreams> submitted_{};
  std::array<std::int64_t, kStreams> completed_{};
  std::vector<std::pair<std::uint32_t, std::int64_t>> markers_;
};

/// A freed range that other streams were still using: it must not be handed out again before
/// those streams reached the work submitted up to the free.
struct Guard {
  Bytes address;
  Bytes size;
  std::vector<std::pair<std::uint32_t, std::int64_t>> waits;  // (stream, submitted at free)
};

/// A block the model believes is handed out.
struct Live {
  std::uint32_t block = 0;  // BlockId or HostBlockId value
  Bytes address;
  Bytes size;
  Bytes requested;
  std::uint32_t stream = 0;                  // allocation stream (device only)
  std::vector<std::uint32_t> other_streams;  // recorded streams that need a guard
};

bool overlaps(Bytes a, Bytes a_size, Bytes b, Bytes b_size) {
  return a < b + b_size && b < a + a_size;
}

/// Fails when [address, address + size) meets a guard whose streams have not reached their
/// point; forgets guards that are satisfied.
void check_guards(std::vector<Guard>& guards, const StreamProgress& progress, Bytes address,
                  Bytes size) {
  std::erase_if(guards, [&progress](const Guard& g) {
    return std::all_of(g.waits.begin(), g.waits.end(),
                       [&progress](const auto& w) { return progress.reached(w.first, w.second); });
  });
  for (const Guard& g : guards) {
    if (overlaps(address, size, g.address, g.size)) {
      RC_FAIL(
          fmt::format("block at {:#x} ({} B) handed out before the marker of a recorded "
                      "stream completed for the earlier free at {:#x}",
                      address.count(), size.count(), g.address.count()));
    }
  }
}

void check_no_overlap(std::vector<Live> live) {
  std::sort(live.begin(), live.end(),
            [](const Live& a, const Live& b) { return a.address < b.address; });
  for (std::size_t i = 1; i < live.size(); ++i) {
    RC_ASSERT(live[i - 1].address + live[i - 1].size <= live[i].address);
  }
}

rc::Gen<std::uint32_t> any_stream() { return rc::gen::inRange<std::uint32_t>(0, kStreams); }
rc::Gen<std::size_t> any_index() { return rc::gen::inRange<std::size_t>(0, 64); }

/// The steps other than malloc, shared by both allocators.
std::vector<std::pair<std::size_t, rc::Gen<Op>>> common_ops() {
  return {
      {3, rc::gen::map(any_index(),
                       [](std::size_t i) {
                         return Op{Op::Kind::Free, 0, 0, i};
                       })},
      {2, rc::gen::apply(
              [](std::size_t i, std::uint32_t s) {
                return Op{Op::Kind::RecordStream, s, 0, i};
              },
              any_index(), any_stream())},
      {2, rc::gen::map(any_stream(),
                       [](std::uint32_t s) {
                         return Op{Op::Kind::Complete, s};
                       })},
      {1, rc::gen::just(Op{Op::Kind::EmptyCache})},
  };
}

rc::Gen<Op> weighted(rc::Gen<Op> malloc_op) {
  const auto rest = common_ops();
  return rc::gen::weightedOneOf<Op>(
      {{5, std::move(malloc_op)}, rest[0], rest[1], rest[2], rest[3]});
}

rc::Gen<std::int64_t> device_size() {
  return rc::gen::weightedOneOf<std::int64_t>({
      {5, rc::gen::inRange<std::int64_t>(0, 8 * 1024 + 1)},                    // tiny
      {3, rc::gen::inRange<std::int64_t>(256 * 1024, 3 * 1024 * 1024)},        // medium
      {2, rc::gen::inRange<std::int64_t>(8 * 1024 * 1024, 40 * 1024 * 1024)},  // huge
  });
}

rc::Gen<Op> device_op() {
  return weighted(rc::gen::apply(
      [](std::uint32_t s, std::int64_t n) {
        return Op{Op::Kind::Malloc, s, n};
      },
      any_stream(), device_size()));
}

void check_device(const CachingAllocator& alloc, const std::vector<Live>& live) {
  const AllocatorStats& stats = alloc.stats();
  const std::vector<SegmentInfo> segments = alloc.segments();
  Bytes reserved;
  Bytes allocated;
  Bytes requested;
  std::array<Bytes, 2> pool_allocated{};
  std::array<Bytes, 2> pool_reserved{};
  std::vector<BlockInfo> handed_out;
  const bool expandable = alloc.mode() == AllocatorMode::Expandable;
  Bytes previous_end = alloc.base();
  for (const SegmentInfo& seg : segments) {
    RC_ASSERT(seg.address >= previous_end);  // address order, no overlap
    previous_end = seg.address + seg.size;
    const auto pool = static_cast<std::size_t>(seg.pool);
    RC_ASSERT(seg.expandable == expandable);
    if (expandable) {
      // A mapped range is whole pages of its pool.
      RC_ASSERT(seg.size.count() % expandable_page_size(seg.pool).count() == 0);
    } else if (seg.pool == PoolKind::Small) {
      RC_ASSERT(seg.size == kSmallBuffer);
    } else {
      RC_ASSERT(seg.size >= kMinLargeAlloc && seg.size.count() % kRoundLarge.count() == 0);
    }
    reserved += seg.size;
    pool_reserved[pool] += seg.size;
    Bytes cursor = seg.address;
    bool previous_free = false;
    for (const BlockInfo& b : seg.blocks) {
      RC_ASSERT(b.address == cursor);  // blocks tile the segment
      RC_ASSERT(b.size > Bytes(0) && b.size.count() % kMinBlockSize.count() == 0);
      RC_ASSERT(b.stream == seg.stream);
      cursor += b.size;
      const bool is_free = b.state == BlockInfo::State::Free;
      RC_ASSERT(!(is_free && previous_free));  // free neighbours are merged
      previous_free = is_free;
      if (is_free) {
        RC_ASSERT(b.requested == Bytes(0));
        continue;
      }
      allocated += b.size;
      requested += b.requested;
      pool_allocated[pool] += b.size;
      if (b.state == BlockInfo::State::Allocated) {
        handed_out.push_back(b);
      }
    }
    RC_ASSERT(cursor == seg.address + seg.size);
  }
  RC_ASSERT(previous_end <=
            alloc.base() + (expandable ? kExpandableAddressSpan : alloc.capacity()));
  RC_ASSERT(stats.reserved == reserved);
  RC_ASSERT(stats.allocated == allocated);
  RC_ASSERT(stats.requested == requested);
  RC_ASSERT(stats.pool_allocated == pool_allocated);
  RC_ASSERT(stats.pool_reserved == pool_reserved);
  RC_ASSERT(stats.reserved >= stats.allocated);
  RC_ASSERT(stats.reserved <= alloc.capacity());
  RC_ASSERT(stats.allocated_peak >= stats.allocated);
  RC_ASSERT(stats.reserved_peak >= stats.reserved);
  RC_ASSERT(stats.pool_reserved_peak[0] >= stats.pool_reserved[0]);
  RC_ASSERT(stats.pool_reserved_peak[1] >= stats.pool_reserved[1]);
  if (!expandable) {
    RC_ASSERT(stats.segment_allocs - stats.segment_frees ==
              static_cast<std::int64_t>(segments.size()));
  }

  // What is handed out is exactly what the model holds.
  std::vector<Live> expected = live;
  std::sort(expected.begin(), expected.end(),
            [](const Live& a, const Live& b) { return a.address < b.address; });
  RC_ASSERT(handed_out.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    RC_ASSERT(handed_out[i].address == expected[i].address);
    RC_ASSERT(handed_out[i].size == expected[i].size);
    RC_ASSERT(handed_out[i].requested == expected[i].requested);
    RC_ASSERT(handed_out[i].stream == StreamId(expected[i].stream));
  }
  check_no_overlap(live);
}

/// Runs `ops` against a fresh caching allocator and checks it after every step; returns the
/// addresses handed out, for determinism checks.
// Frees the op's live block; blocks used on other streams leave a guard: the allocator must
// not hand their bytes out before those streams' work at free time completed.
template <class Id, class Alloc>
void model_free(Alloc& alloc, std::vector<Live>& live, std::vector<Guard>& guards,
                StreamProgress& progress, const Op& op) {
  if (live.empty()) return;
  const auto at = live.begin() + static_cast<std::ptrdiff_t>(op.index % live.size());
  if (!at->other_streams.empty()) {
    Guard guard{at->address, at->size, {}};
    for (const std::uint32_t s : at->other_streams) {
      guard.waits.emplace_back(s, progress.submitted(s));
    }
    guards.push_back(std::move(guard));
  }
  alloc.free(Id(at->block), progress);
  live.erase(at);
}

// Records a use of the op's live block on another stream (work is submitted there). A device
// block's own allocation stream needs no guard; a pinned block has no own stream.
template <class Id, class Alloc>
void model_record_stream(Alloc& alloc, std::vector<Live>& live, StreamProgress& progress,
                         const Op& op, bool has_own_stream = true) {
  if (live.empty()) return;
  Live& l = live[op.index % live.size()];
  progress.submit(op.stream);
  alloc.record_stream(Id(l.block), StreamId(op.stream));
  if ((!has_own_stream || op.stream != l.stream) &&
      std::find(l.other_streams.begin(), l.other_streams.end(), op.stream) ==
          l.other_streams.end()) {
    l.other_streams.push_back(op.stream);
  }
}

std::vector<Bytes> run_device(const std::vector<Op>& ops, Bytes capacity, AllocatorFaults faults,
                              AllocatorMode mode = AllocatorMode::Default) {
  CachingAllocator alloc(capacity, kDeviceBase, mode, faults);
  StreamProgress progress;
  std::vector<Live> live;
  std::vector<Guard> guards;
  std::vector<Bytes> addresses;
  for (const Op& op : ops) {
    switch (op.kind) {
      case Op::Kind::Malloc: {
        const std::int64_t ooms = alloc.stats().ooms;
        Result<DeviceAllocation> r = alloc.malloc(StreamId(op.stream), Bytes(op.size), progress);
        if (!r.ok()) {
          RC_ASSERT(r.error().message.rfind("out of memory: tried to allocate", 0) == 0);
          RC_ASSERT(alloc.stats().ooms == ooms + 1);
          break;
        }
        const DeviceAllocation a = r.value();
        RC_ASSERT(a.size >= round_size(Bytes(op.size)));
        check_guards(guards, progress, a.address, a.size);
        live.push_back(Live{a.block.value(), a.address, a.size, Bytes(op.size), op.stream, {}});
        addresses.push_back(a.address);
        break;
      }
      case Op::Kind::Free:
        model_free<BlockId>(alloc, live, guards, progress, op);
        break;
      case Op::Kind::RecordStream:
        model_record_stream<BlockId>(alloc, live, progress, op);
        break;
      case Op::Kind::Complete:
        progress.complete(op.stream);
        break;
      case Op::Kind::EmptyCache:
        alloc.empty_cache(progress);
        if (mode == AllocatorMode::Expandable && alloc.stats().allocated == Bytes(0)) {
          // Nothing live and nothing pending: every page is unmapped.
          RC_ASSERT(alloc.stats().reserved == Bytes(0));
        }
        break;
    }
    check_device(alloc, live);
  }

  RC_CLASSIFY(alloc.stats().deferred_frees > 0, "deferred frees");
  RC_CLASSIFY(alloc.stats().segment_frees > 0, "segments released");
  RC_CLASSIFY(alloc.stats().ooms > 0, "out of memory");
  for (const Live& l : live) {
    alloc.free(BlockId(l.block), progress);
  }
  progress.complete_all();
  alloc.empty_cache(progress);
  RC_ASSERT(alloc.stats().reserved == Bytes(0));
  RC_ASSERT(alloc.stats().allocated == Bytes(0));
  RC_ASSERT(alloc.stats().requested == Bytes(0));
  RC_ASSERT(alloc.segments().empty());
  RC_ASSERT(alloc.live_blocks().empty());
  return addresses;
}

Bytes any_device_capacity() {
  return Bytes(*rc::gen::element<std::int64_t>(48, 96, 256).as("device capacity, MiB") *
               kMiB.count());
}

void device_property(AllocatorFaults faults, AllocatorMode mode = AllocatorMode::Default) {
  const Bytes capacity = any_device_capacity();
  const auto ops = *rc::gen::container<std::vector<Op>>(device_op());
  run_device(ops, capacity, faults, mode);
}

rc::Gen<std::int64_t> host_size() {
  return rc::gen::weightedOneOf<std::int64_t>({
      {5, rc::gen::inRange<std::int64_t>(0, 8 * 1024 + 1)},
      {3, rc::gen::inRange<std::int64_t>(64 * 1024, 1024 * 1024)},
      {2, rc::gen::inRange<std::int64_t>(2 * 1024 * 1024, 12 * 1024 * 1024)},
  });
}

rc::Gen<Op> host_op() {
  return weighted(rc::gen::apply(
      [](std::int64_t n, bool exact) {
        return Op{Op::Kind::Malloc, 0, n, 0, exact};
      },
      host_size(), rc::gen::arbitrary<bool>()));
}

void check_host(const PinnedHostAllocator& alloc, const std::vector<Live>& live) {
  const HostAllocatorStats& stats = alloc.stats();
  const std::vector<HostBlockInfo> blocks = alloc.blocks();
  Bytes reserved;
  Bytes allocated;
  std::vector<HostBlockInfo> handed_out;
  Bytes previous_end = alloc.base();
  for (const HostBlockInfo& b : blocks) {
    RC_ASSERT(b.address >= previous_end);
    RC_ASSERT(b.size > Bytes(0) && b.size.count() % kMinBlockSize.count() == 0);
    previous_end = b.address + b.size;
    reserved += b.size;
    if (b.state == HostBlockInfo::State::Free) {
      RC_ASSERT(b.requested == Bytes(0));
      continue;
    }
    allocated += b.size;
    if (b.state == HostBlockInfo::State::Allocated) {
      handed_out.push_back(b);
    }
  }
  RC_ASSERT(previous_end <= alloc.base() + alloc.capacity());
  RC_ASSERT(stats.reserved == reserved);
  RC_ASSERT(stats.allocated == allocated);
  RC_ASSERT(stats.reserved <= alloc.capacity());
  RC_ASSERT(stats.allocated_peak >= stats.allocated);
  RC_ASSERT(stats.reserved_peak >= stats.reserved);
  RC_ASSERT(stats.host_allocs - stats.host_frees == static_cast<std::int64_t>(blocks.size()));

  std::vector<Live> expected = live;
  std::sort(expected.begin(), expected.end(),
            [](const Live& a, const Live& b) { return a.address < b.address; });
  RC_ASSERT(handed_out.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    RC_ASSERT(handed_out[i].address == expected[i].address);
    RC_ASSERT(handed_out[i].size == expected[i].size);
    RC_ASSERT(handed_out[i].requested == expected[i].requested);
  }
  check_no_overlap(live);
}

void run_host(const std::vector<Op>& ops, Bytes capacity, AllocatorFaults faults) {
  PinnedHostAllocator alloc(capacity, kHostBase, faults);
  StreamProgress progress;
  std::vector<Live> live;
  std::vector<Guard> guards;
  for (const Op& op : ops) {
    switch (op.kind) {
      case Op::Kind::Malloc: {
        const PinnedPool pool = op.exact ? PinnedPool::Exact : PinnedPool::Caching;
        const std::int64_t refusals = alloc.stats().cap_refusals;
        Result<HostAllocation> r = alloc.malloc(Bytes(op.size), pool, progress);
        if (!r.ok()) {
          RC_ASSERT(r.error().message.rfind("pinned host memory cap of", 0) == 0);
          RC_ASSERT(alloc.stats().cap_refusals == refusals + 1);
          break;
        }
        const HostAllocation a = r.value();
        RC_ASSERT(a.size == pinned_block_size(Bytes(op.size), pool));
        check_guards(guards, progress, a.address, a.size);
        live.push_back(Live{a.block.value(), a.address, a.size, Bytes(op.size), 0, {}});
        break;
      }
      case Op::Kind::Free:
        model_free<HostBlockId>(alloc, live, guards, progress, op);
        break;
      case Op::Kind::RecordStream:
        model_record_stream<HostBlockId>(alloc, live, progress, op, false);  // no own stream
        break;
      case Op::Kind::Complete:
        progress.complete(op.stream);
        break;
      case Op::Kind::EmptyCache:
        alloc.empty_cache(progress);
        break;
    }
    check_host(alloc, live);
  }

  RC_CLASSIFY(alloc.stats().deferred_frees > 0, "deferred frees");
  RC_CLASSIFY(alloc.stats().host_frees > 0, "blocks unpinned");
  RC_CLASSIFY(alloc.stats().cap_refusals > 0, "cap refusals");
  for (const Live& l : live) {
    alloc.free(HostBlockId(l.block), progress);
  }
  progress.complete_all();
  alloc.empty_cache(progress);
  RC_ASSERT(alloc.stats().reserved == Bytes(0));
  RC_ASSERT(alloc.stats().allocated == Bytes(0));
  RC_ASSERT(alloc.blocks().empty());
}

void host_property(AllocatorFaults faults) {
  const Bytes capacity =
      Bytes(*rc::gen::element<std::int64_t>(8, 32).as("pinned cap, MiB") * kMiB.count());
  const auto ops = *rc::gen::container<std::vector<Op>>(host_op());
  run_host(ops, capacity, faults);
}

/// Runs rc::check with its report (written to std::cerr) captured; returns whether the property
/// held and the report. No description is passed: without one, RapidCheck does not list this
/// expected failure in its end-of-run "reproduce" message.
template <class Property>
std::pair<bool, std::string> check_quietly(Property property) {
  std::ostringstream report;
  std::streambuf* const previous = std::cerr.rdbuf(report.rdbuf());
  const bool held = rc::check(std::move(property));
  std::cerr.rdbuf(previous);
  return {held, report.str()};
}

/// The line of a RapidCheck report that says how a property was falsified.
std::string falsified_line(const std::string& report) {
  const std::size_t at = report.find("Falsifiable");
  return at == std::string::npos ? std::string() : report.substr(at, report.find('\n', at) - at);
}

RC_GTEST_PROP(CachingAllocatorProperties, InvariantsHoldOverRandomOperations, ()) {
  device_property(AllocatorFaults{});
}

RC_GTEST_PROP(CachingAllocatorProperties, SameOperationsGiveSameAddresses, ()) {
  const Bytes capacity = any_device_capacity();
  const auto ops = *rc::gen::container<std::vector<Op>>(device_op());
  RC_ASSERT(run_device(ops, capacity, AllocatorFaults{}) ==
            run_device(ops, capacity, AllocatorFaults{}));
}

RC_GTEST_PROP(CachingAllocatorProperties, InvariantsHoldWithExpandableSegments, ()) {
  device_property(AllocatorFaults{}, AllocatorMode::Expandable);
}

RC_GTEST_PROP(CachingAllocatorProperties, SameOperationsGiveSameAddressesWithExpandableSegments,
              ()) {
  const Bytes capacity = any_device_capacity();
  const auto ops = *rc::gen::container<std::vector<Op>>(device_op());
  RC_ASSERT(run_device(ops, capacity, AllocatorFaults{}, AllocatorMode::Expandable) ==
            run_device(ops, capacity, AllocatorFaults{}, AllocatorMode::Expandable));
}

RC_GTEST_PROP(PinnedHostAllocatorProperties, InvariantsHoldOverRandomOperations, ()) {
  host_property(AllocatorFaults{});
}

TEST(CachingAllocatorProperties, CatchesAPlantedFaultThatIgnoresRecordStream) {
  const auto [held, report] =
      check_quietly([] { device_property(AllocatorFaults{.ignore_record_stream = true}); });
  EXPECT_FALSE(held) << report;
  EXPECT_NE(report.find("handed out before the marker"), std::string::npos) << report;
  std::cout << "planted fault caught: " << falsified_line(report) << "\n";
}

TEST(CachingAllocatorProperties,
     CatchesAPlantedFaultThatIgnoresRecordStreamWithExpandableSegments) {
  const auto [held, report] = check_quietly([] {
    device_property(AllocatorFaults{.ignore_record_stream = true}, AllocatorMode::Expandable);
  });
  EXPECT_FALSE(held) << report;
  EXPECT_NE(report.find("handed out before the marker"), std::string::npos) << report;
  std::cout << "planted fault caught: " << falsified_line(report) << "\n";
}

TEST(PinnedHostAllocatorProperties, CatchesAPlantedFaultThatIgnoresRecordStream) {
  const auto [held, report] =
      check_quietly([] { host_property(AllocatorFaults{.ignore_record_stream = true}); });
  EXPECT_FALSE(held) << report;
  EXPECT_NE(report.find("handed out before the marker"), std::string::npos) << report;
  std::cout << "planted fault caught: " << falsified_line(report) << "\n";
}

}  // namespace
}  // namespace ferry::sim
