#include "prop/random_program.hpp"

#include <string>

namespace ferry::sim::testing {

namespace {

struct Builder {
  const ProgramShape& shape;
  const RandomProgramOptions& options;
  Program program;
  std::vector<bool> live;

  StreamId stream_on(std::uint32_t device, std::uint32_t pick) const {
    // Streams are spread round-robin over devices: stream i lives on device i % devices.
    const std::uint32_t per = (shape.streams + shape.devices - 1 - device) / shape.devices;
    const std::uint32_t k = per == 0 ? 0 : pick % per;
    return StreamId(device + k * shape.devices);
  }

  // The `pick`-th live slot accepted by `ok`, if any.
  template <class Ok>
  SlotId live_slot(std::uint32_t pick, Ok ok) const {
    std::vector<std::uint32_t> candidates;
    for (std::uint32_t i = 0; i < live.size(); ++i) {
      if (live[i] && ok(shape.slots[i])) candidates.push_back(i);
    }
    if (candidates.empty()) return SlotId();
    return SlotId(candidates[pick % candidates.size()]);
  }

  SlotRange range(SlotId slot, std::uint32_t x, std::uint32_t y) const {
    const std::int64_t size = shape.slots[slot.value()].bytes;
    const std::int64_t offset = static_cast<std::int64_t>(x % 4 == 0 ? 0 : x) % size;
    const std::int64_t room = size - offset;
    const std::int64_t bytes = y % 3 == 0 ? room : 1 + static_cast<std::int64_t>(y) % room;
    return SlotRange{slot, Bytes(offset), Bytes(bytes)};
  }

  void add(ProgramOp op) { program.ops.push_back(std::move(op)); }

  void apply(const OpChoice& c) {
    const std::uint32_t n_kinds = 14;
    ProgramOp op;
    switch (c.kind % n_kinds) {
      case 0:
      case 1: {  // alloc a free slot
        std::vector<std::uint32_t> dead;
        for (std::uint32_t i = 0; i < live.size(); ++i) {
          if (!live[i]) dead.push_back(i);
        }
        if (dead.empty()) return;
        const std::uint32_t slot = dead[c.a % dead.size()];
        op.kind = OpKind::Alloc;
        op.slot = SlotId(slot);
        if (shape.slots[slot].kind == MemoryKind::Device) {
          op.stream = stream_on(shape.slots[slot].device, c.b);
        }
        live[slot] = true;
        break;
      }
      case 2: {  // free
        op.slot = live_slot(c.a, [](const SlotShape&) { return true; });
        if (!op.slot.valid()) return;
        op.kind = OpKind::Free;
        live[op.slot.value()] = false;
        break;
      }
      case 3:
      case 4:
      case 5: {  // kernel
        op.kind = OpKind::Kernel;
        op.stream = StreamId(c.a % shape.streams);
        const std::uint32_t device = op.stream.value() % shape.devices;
        auto usable = [&](const SlotShape& s) {
          return (s.kind == MemoryKind::Device && s.device == device) ||
                 s.kind == MemoryKind::Pinned;
        };
        op.duration = SimTime(1 + c.x % 5000);
        const SlotId r = live_slot(c.b, usable);
        const SlotId w = live_slot(c.c, usable);
        if (r.valid() && c.b % 3 != 0) op.reads.push_back(range(r, c.x / 7, c.y / 5));
        if (w.valid() && c.c % 3 != 1) op.writes.push_back(range(w, c.y / 3, c.x / 11));
        break;
      }
      case 6:
      case 7: {  // copy
        const SlotId dev =
            live_slot(c.a, [](const SlotShape& s) { return s.kind == MemoryKind::Device; });
        const SlotId other = live_slot(c.b, [](const SlotShape&) { return true; });
        if (!dev.valid() || !other.valid() || dev == other) return;
        op.kind = OpKind::Copy;
        const bool to_device = c.c % 2 == 0;
        const SlotRange r1 = range(dev, c.x, c.y);
        const SlotRange r2 = range(other, c.y / 13, c.x / 17);
        const Bytes bytes = std::min(r1.bytes, r2.bytes);
        SlotRange d{r1.slot, r1.offset, bytes};
        SlotRange o{r2.slot, r2.offset, bytes};
        op.src = to_device ? o : d;
        op.dst = to_device ? d : o;
        op.stream = stream_on(shape.slots[dev.value()].device, c.c / 2);
        break;
      }
      case 8:
        op.kind = OpKind::Record;
        op.event = EventId(c.a % shape.events);
        op.stream = StreamId(c.b % shape.streams);
        break;
      case 9:
      case 10:
        op.kind = OpKind::Wait;
        op.event = EventId(c.a % shape.events);
        op.stream = StreamId(c.b % shape.streams);
        break;
      case 11: {  // a synchronization of one of three kinds, or a query
        const std::uint32_t which = c.a % (options.query ? 4 : 3);
        if (which == 0) {
          op.kind = OpKind::SyncStream;
          op.stream = StreamId(c.b % shape.streams);
        } else if (which == 1) {
          op.kind = OpKind::SyncEvent;
          op.event = EventId(c.b % shape.events);
        } else if (which == 2) {
          op.kind = OpKind::SyncDevice;
          op.device = DeviceId(c.b % shape.devices);
        } else {
          op.kind = OpKind::Query;
          op.event = EventId(c.b % shape.events);
        }
        break;
      }
      case 12: {  // host access
        const SlotId s =
            live_slot(c.a, [](const SlotShape& sh) { return sh.kind != MemoryKind::Device; });
        if (!s.valid()) return;
        if (c.b % 2 == 0) {
          op.kind = OpKind::HostRead;
          op.reads.push_back(range(s, c.x, c.y));
        } else {
          op.kind = OpKind::HostWrite;
          op.writes.push_back(range(s, c.x, c.y));
        }
        break;
      }
      case 13: {
        if (options.record_stream && c.a % 2 == 0) {
          op.slot =
              live_slot(c.b, [](const SlotShape& s) { return s.kind != MemoryKind::Pageable; });
          if (!op.slot.valid()) return;
          op.kind = OpKind::RecordStream;
          op.stream = StreamId(c.c % shape.streams);
        } else if (options.empty_cache) {
          op.kind = OpKind::EmptyCache;
          op.device = DeviceId(c.b % shape.devices);
        } else {
          return;
        }
        break;
      }
    }
    add(std::move(op));
  }
};

}  // namespace

Program build_random_program(const ProgramShape& shape, std::span<const OpChoice> choices,
                             const RandomProgramOptions& options) {
  Builder b{shape, options, {}, std::vector<bool>(shape.slots.size(), false)};
  Program& p = b.program;
  for (std::uint32_t d = 0; d < shape.devices; ++d) {
    p.devices.push_back(ProgramDevice{"gpu" + std::to_string(d), shape.profile});
  }
  for (std::uint32_t s = 0; s < shape.streams; ++s) {
    p.streams.push_back(ProgramStream{"s" + std::to_string(s), DeviceId(s % shape.devices)});
  }
  for (std::uint32_t e = 0; e < shape.events; ++e)
    p.events.push_back(ProgramEvent{"e" + std::to_string(e)});
  for (std::size_t i = 0; i < shape.slots.size(); ++i) {
    const SlotShape& s = shape.slots[i];
    p.buffers.push_back(ProgramBuffer{"b" + std::to_string(i), s.kind, DeviceId(s.device),
                                      Bytes(s.bytes), PinnedPool::Exact});
  }
  for (const OpChoice& c : choices) b.apply(c);
  if (options.free_all_at_end) {
    for (std::uint32_t i = 0; i < b.live.size(); ++i) {
      if (!b.live[i]) continue;
      ProgramOp op;
      op.kind = OpKind::Free;
      op.slot = SlotId(i);
      b.add(std::move(op));
    }
  }
  return std::move(b.program);
}

DeviceProfile random_profile(std::mt19937_64& rng) {
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  DeviceProfile p;
  p.name = "random";
  p.memory = Bytes(1LL << 30);
  p.flops_per_s = 1'000'000'000'000;
  p.memory_bandwidth = Bandwidth(1'000'000'000'000);
  p.h2d = CopyPath{Bandwidth(pick(1, 64) * 1'000'000'000), SimTime(pick(0, 3000)),
                   static_cast<std::int32_t>(pick(300, 1000))};
  p.d2h = CopyPath{Bandwidth(pick(1, 64) * 1'000'000'000), SimTime(pick(0, 3000)),
                   static_cast<std::int32_t>(pick(300, 1000))};
  p.pageable_h2d = Bandwidth(pick(1, 32) * 500'000'000);
  p.pageable_d2h = Bandwidth(pick(1, 32) * 500'000'000);
  p.d2d = CopyPath{Bandwidth(pick(100, 2000) * 1'000'000'000), SimTime(pick(0, 1000)), 1000};
  p.peer = CopyPath{Bandwidth(pick(10, 400) * 1'000'000'000), SimTime(pick(0, 5000)), 1000};
  p.pinned_host_capacity = Bytes(1LL << 30);
  p.overheads = LaunchOverheads{
      SimTime(pick(0, 5000)), SimTime(pick(0, 7000)), SimTime(pick(0, 500)), SimTime(pick(0, 500)),
      SimTime(pick(0, 1000)), SimTime(pick(0, 2000)), SimTime(pick(0, 500)), SimTime(pick(0, 500)),
      SimTime(pick(0, 500)),  SimTime(pick(0, 20000))};
  return p;
}

DeviceProfile with_random_links(DeviceProfile p, std::mt19937_64& rng) {
  p.collectives.gpus_per_node = 8;
  p.collectives.intra_node = CollectiveLink{
      Bandwidth(1'000'000'000 * std::int64_t(1 + rng() % 400)), SimTime(rng() % 5000)};
  p.collectives.inter_node = CollectiveLink{Bandwidth(1'000'000'000 * std::int64_t(1 + rng() % 50)),
                                            SimTime(rng() % 20000)};
  return p;
}

std::vector<OpChoice> random_choices(std::mt19937_64& rng, std::size_t count) {
  std::vector<OpChoice> out(count);
  for (OpChoice& c : out) {
    const std::uint64_t r1 = rng();
    const std::uint64_t r2 = rng();
    const std::uint64_t r3 = rng();
    c = OpChoice{static_cast<std::uint32_t>(r1), static_cast<std::uint32_t>(r1 >> 32),
                 static_cast<std::uint32_t>(r2), static_cast<std::uint32_t>(r2 >> 32),
                 static_cast<std::uint32_t>(r3), static_cast<std::uint32_t>(r3 >> 32)};
  }
  return out;
}

ProgramShape random_shape(std::mt19937_64& rng, std::uint32_t slots) {
  ProgramShape shape;
  shape.devices = 1 + static_cast<std::uint32_t>(rng() % 2);
  shape.streams = 2 + static_cast<std::uint32_t>(rng() % 3);
  shape.events = 1 + static_cast<std::uint32_t>(rng() % 3);
  for (std::uint32_t i = 0; i < slots; ++i) {
    const std::uint64_t r = rng();
    const auto kind = static_cast<MemoryKind>(r % 5 < 3 ? 0 : r % 5 == 3 ? 1 : 2);
    shape.slots.push_back(SlotShape{kind, static_cast<std::uint32_t>((r >> 8) % shape.devices),
                                    512 + static_cast<std::int64_t>((r >> 16) % 65536)});
  }
  shape.profile = random_profile(rng);
  return shape;
}

}  // namespace ferry::sim::testing
