#include "ferry/program/program_json.hpp"

#include <fmt/format.h>

#include <string_view>
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/json_quote.hpp"

namespace ferry {

namespace {

// One JSON object on one line, members in the order they are added.
class Object {
 public:
  Object& raw(std::string_view key, std::string_view json) {
    text_ += fmt::format("{}{}: {}", text_.empty() ? "" : ", ", json_quote(key), json);
    return *this;
  }
  Object& str(std::string_view key, std::string_view value) { return raw(key, json_quote(value)); }
  Object& num(std::string_view key, std::int64_t value) { return raw(key, std::to_string(value)); }
  [[nodiscard]] std::string json() const { return "{" + text_ + "}"; }

 private:
  std::string text_;
};

std::string list(const std::vector<std::string>& items) {
  std::string out = "[";
  for (std::size_t i = 0; i < items.size(); ++i) out += (i == 0 ? "" : ", ") + items[i];
  return out + "]";
}

std::string copy_path(const CopyPath& path, bool with_permille) {
  Object out;
  out.num("bytes_per_s", path.bandwidth.bytes_per_s()).num("latency_ns", path.latency.ns());
  if (with_permille) out.num("bidirectional_permille", path.bidirectional_permille);
  return out.json();
}

std::string profile(const DeviceProfile& p) {
  Object out;
  out.str("name", p.name);
  if (!p.description.empty()) out.str("description", p.description);
  if (p.compute_capability.known()) out.str("compute_capability", p.compute_capability.text());
  const TorchDefaults defaults = torch_defaults_on(p.compute_capability);
  out.num("memory_bytes", p.memory.count()).num("flops_per_s", p.flops_per_s);
  if (p.fp32_flops_per_s > 0) out.num("fp32_flops_per_s", p.fp32_flops_per_s);
  if (p.tf32_flops_per_s > 0) out.num("tf32_flops_per_s", p.tf32_flops_per_s);
  out.num("memory_bytes_per_s", p.memory_bandwidth.bytes_per_s())
      .raw("h2d", copy_path(p.h2d, true))
      .raw("d2h", copy_path(p.d2h, true))
      .raw("pageable", Object()
                           .num("h2d_bytes_per_s", p.pageable_h2d.bytes_per_s())
                           .num("d2h_bytes_per_s", p.pageable_d2h.bytes_per_s())
                           .json())
      .raw("d2d", copy_path(p.d2d, false))
      .raw("peer", copy_path(p.peer, false))
      .num("pinned_host_capacity_bytes", p.pinned_host_capacity.count());
  if (p.blas_workspace != defaults.blas_workspace) {
    out.num("blas_workspace_bytes", p.blas_workspace.count());
  }
  Object overheads;
  for (const OverheadField& field : kOverheadFields) {
    overheads.num(field.key, (p.overheads.*field.field).ns());
  }
  if (p.overheads.host_alloc.ns() > 0) overheads.num(kHostAllocKey, p.overheads.host_alloc.ns());
  out.raw("overheads_ns", overheads.json());
  const CollectiveLinks& c = p.collectives;
  if (c.intra_node.known() || c.inter_node.known()) {
    const auto link = [](const CollectiveLink& l) {
      return Object()
          .num("bytes_per_s", l.bandwidth.bytes_per_s())
          .num("latency_ns", l.latency.ns())
          .json();
    };
    out.raw("collectives", Object()
                               .num("gpus_per_node", c.gpus_per_node)
                               .raw("intra_node", link(c.intra_node))
                               .raw("inter_node", link(c.inter_node))
                               .json());
  }
  const KernelFigures& k = p.kernels;
  const bool figures_given =
      k != KernelFigures{.sdpa_backend = k.sdpa_backend, .grouped_mm = k.grouped_mm};
  const bool choices_given =
      k.sdpa_backend != defaults.sdpa_backend || k.grouped_mm != defaults.grouped_mm;
  if (figures_given || choices_given) {
    Object kernels;
    if (k.tiled()) {
      kernels.num("sm_count", k.sm_count)
          .num("matmul_tile_m", k.matmul_tile_m)
          .num("matmul_tile_n", k.matmul_tile_n);
    }
    for (const auto& [key, value] :
         {std::pair{"matmul_permille", k.matmul_permille},
          std::pair{"flash_forward_permille", k.flash_forward_permille},
          std::pair{"flash_backward_permille", k.flash_backward_permille},
          std::pair{"cudnn_forward_permille", k.cudnn_forward_permille},
          std::pair{"cudnn_backward_permille", k.cudnn_backward_permille},
          std::pair{"efficient_forward_permille", k.efficient_forward_permille},
          std::pair{"efficient_backward_permille", k.efficient_backward_permille},
          std::pair{"memory_permille", k.memory_permille},
          std::pair{"collective_overlap_permille", k.collective_overlap_permille}}) {
      if (value > 0) kernels.num(key, value);
    }
    if (k.sdpa_backend != defaults.sdpa_backend) {
      kernels.str("sdpa_backend", sdpa_backend_name(k.sdpa_backend));
    }
    if (k.grouped_mm != defaults.grouped_mm) {
      kernels.str("grouped_mm", grouped_mm_kernel_name(k.grouped_mm));
    }
    out.raw("kernels", kernels.json());
  }
  return out.json();
}

template <class Item, class Id>
const std::string& name_of(const std::vector<Item>& items, Id id, std::string_view what) {
  FERRY_CHECK(id.valid() && id.value() < items.size(), "{} id {} out of range ({} declared)", what,
              id.value(), items.size());
  return items[id.value()].name;
}

std::string range(const Program& program, const SlotRange& r) {
  FERRY_CHECK(r.slot.valid() && r.slot.value() < program.buffers.size(),
              "buffer id {} out of range", r.slot.value());
  const ProgramBuffer& buffer = program.buffers[r.slot.value()];
  Object out;
  out.str("buffer", buffer.name);
  if (r.offset.count() != 0) out.num("offset", r.offset.count());
  if (r.bytes != buffer.bytes - r.offset) out.num("bytes", r.bytes.count());
  return out.json();
}

std::string ranges(const Program& program, const std::vector<SlotRange>& rs) {
  std::vector<std::string> items;
  items.reserve(rs.size());
  for (const SlotRange& r : rs) items.push_back(range(program, r));
  return list(items);
}

std::string op_json(const Program& program, const ProgramOp& op) {
  Object out;
  out.str("op", op_kind_name(op.kind));
  if (!op.label.empty()) out.str("label", op.label);
  const auto stream = [&] { out.str("stream", name_of(program.streams, op.stream, "stream")); };
  const auto event = [&] { out.str("event", name_of(program.events, op.event, "event")); };
  const auto buffer = [&] { out.str("buffer", name_of(program.buffers, op.slot, "buffer")); };
  const auto device = [&] { out.str("device", name_of(program.devices, op.device, "device")); };
  switch (op.kind) {
    case OpKind::Alloc:
      buffer();
      if (op.stream.valid()) stream();
      break;
    case OpKind::Free:
      buffer();
      break;
    case OpKind::RecordStream:
      buffer();
      stream();
      break;
    case OpKind::Kernel:
      stream();
      out.num("duration_ns", op.duration.ns());
      if (!op.reads.empty()) out.raw("reads", ranges(program, op.reads));
      if (!op.writes.empty()) out.raw("writes", ranges(program, op.writes));
      break;
    case OpKind::Copy:
      stream();
      out.raw("src", range(program, op.src)).raw("dst", range(program, op.dst));
      break;
    case OpKind::Record:
      event();
      stream();
      break;
    case OpKind::Wait:
      stream();
      event();
      break;
    case OpKind::SyncStream:
      stream();
      break;
    case OpKind::SyncEvent:
    case OpKind::Query:
      event();
      break;
    case OpKind::SyncDevice:
    case OpKind::EmptyCache:
      device();
      break;
    case OpKind::HostRead:
      out.raw("reads", ranges(program, op.reads));
      break;
    case OpKind::HostWrite:
      out.raw("writes", ranges(program, op.writes));
      break;
  }
  return out.json();
}

// `"key": [` then one item a line, as the last member or not.
void member_lines(std::string& out, std::string_view key, const std::vector<std::string>& items,
                  bool last) {
  out += fmt::format("  {}: [", json_quote(key));
  for (std::size_t i = 0; i < items.size(); ++i) out += (i == 0 ? "\n    " : ",\n    ") + items[i];
  out += items.empty() ? "]" : "\n  ]";
  out += last ? "\n" : ",\n";
}

}  // namespace

std::string device_profile_to_json(const DeviceProfile& p) { return profile(p) + "\n"; }

std::string program_to_json(const Program& program) {
  std::string out = fmt::format("{{\n  \"format\": {},\n", json_quote(kProgramFormat));
  if (!program.description.empty()) {
    out += fmt::format("  \"description\": {},\n", json_quote(program.description));
  }
  std::vector<std::string> items;
  for (const ProgramDevice& d : program.devices) {
    items.push_back(Object()
                        .str("name", d.name)
                        .raw("profile", d.profile_name.empty() ? profile(d.profile)
                                                               : json_quote(d.profile_name))
                        .json());
  }
  member_lines(out, "devices", items, false);
  if (!program.links.empty()) {
    items.clear();
    for (const ProgramLink& link : program.links) {
      items.push_back(Object()
                          .str("from", name_of(program.devices, link.from, "device"))
                          .str("to", name_of(program.devices, link.to, "device"))
                          .num("bytes_per_s", link.bandwidth.bytes_per_s())
                          .num("latency_ns", link.latency.ns())
                          .json());
    }
    member_lines(out, "links", items, false);
  }
  items.clear();
  for (const ProgramStream& s : program.streams) {
    items.push_back(Object()
                        .str("name", s.name)
                        .str("device", name_of(program.devices, s.device, "device"))
                        .json());
  }
  member_lines(out, "streams", items, false);
  items.clear();
  for (const ProgramBuffer& b : program.buffers) {
    Object item;
    item.str("name", b.name).str("kind", memory_kind_name(b.kind));
    if (b.kind == MemoryKind::Device) {
      item.str("device", name_of(program.devices, b.device, "device"));
    }
    item.num("bytes", b.bytes.count());
    if (b.kind == MemoryKind::Pinned)
      item.str("pool", b.pool == PinnedPool::Exact ? "exact" : "caching");
    items.push_back(item.json());
  }
  member_lines(out, "buffers", items, false);
  items.clear();
  for (const ProgramEvent& e : program.events) items.push_back(json_quote(e.name));
  member_lines(out, "events", items, false);
  items.clear();
  for (const ProgramOp& op : program.ops) items.push_back(op_json(program, op));
  member_lines(out, "ops", items, true);
  return out + "}\n";
}

}  // namespace ferry
