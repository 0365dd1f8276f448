#include "ferry/sim/report/tables.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ferry/sim/io/parallelism_json.hpp"
#include "ferry/sim/report/row_fields.hpp"
#include "ferry/sim/workload/rank_model.hpp"

namespace ferry::sim {

namespace {

using Json = nlohmann::ordered_json;

const RowResult* baseline(const std::vector<RowResult>& rows) {
  for (const RowResult& r : rows) {
    if (r.policy == Policy::None && r.step_time.ns() > 0) return &r;
  }
  return nullptr;
}

Json row_json(const RowResult& r, const RowResult* base) {
  Json j;
  put_row(
      j, r,
      {RowField::Name, RowField::Policy, RowField::Fits, RowField::Failure, RowField::StepTime,
       RowField::ForwardTime, RowField::ForwardStall, RowField::BackwardStall, RowField::Recompute,
       RowField::Overlap, RowField::PeakAllocated, RowField::PeakReserved, RowField::PinnedPeak,
       RowField::D2h, RowField::H2d, RowField::Hazards, RowField::Horizon});
  if (base != nullptr) {
    j["time_vs_none_permille"] =
        base->step_time.ns() > 0 ? r.step_time.ns() * 1000 / base->step_time.ns() : 0;
    j["memory_vs_none_permille"] =
        base->peak_allocated.count() > 0
            ? r.peak_allocated.count() * 1000 / base->peak_allocated.count()
            : 0;
  }
  put_row(j, r, {RowField::Telemetry});
  return j;
}

Json context_json(const Model& model, const DeviceProfile& device) {
  Json j;
  j["model"] = model.name;
  j["device"] = device.name;
  j["device_memory_bytes"] = device.memory.count();
  return j;
}

}  // namespace

std::string simulate_text(const RowResult& r, const Model& model, const DeviceProfile& device,
                          const Parallelism& parallelism) {
  std::string out =
      fmt::format("ferry simulate: {} on {}, policy {}\n", model.name, device.name, r.name);
  if (r.failure) out += fmt::format("failure: {}\n", r.failure->message);
  if (!r.fits)
    out += fmt::format("does not fit in {}: the figures below need more memory\n",
                       format_bytes(device.memory));
  out += fmt::format(
      "step time: {}, forward pass done on the device at {} (simulated time from "
      "the last step's start)\n",
      format_time(r.step_time), format_time(r.forward_time));
  out += row_lines(r, {RowLine::PeakAllocatedReserved, RowLine::PinnedPeak, RowLine::Moved,
                       RowLine::Recompute, RowLine::StallOverlap});
  const OffloadTelemetry& t = r.telemetry;
  out += fmt::format(
      "saved tensors in the last step: {} packed, {} offloaded, {} kept, {} deduplicated, {} "
      "host-cap fallbacks\n",
      t.packed, t.offloaded, t.kept, t.deduplicated, t.host_fallbacks);
  if (r.horizon) {
    out += fmt::format(
        "offload horizon: {} a forward ({} bytes; {} saved tensors after it kept on the "
        "device)\n",
        format_bytes(*r.horizon), r.horizon->count(), t.past_horizon);
  }
  out += fmt::format(
      "reloads in the last step: {} prefetched, {} on demand, {} forward-stash hits, {} "
      "record_stream fallbacks\n",
      t.prefetched, t.on_demand, t.stash_hits, t.record_stream_fallbacks);
  if (const auto& s = r.paged_stash) {
    out += fmt::format(
        "paged stash in the last step: {} saved tensors, {} of rows from {} of padded buffers; "
        "pool {} ({} pages)\n",
        s->stashed, format_bytes(s->data), format_bytes(s->padded), format_bytes(s->pool),
        s->pages);
  }
  out += fmt::format("hazards: {}\n", r.hazards);
  return out + parallelism_text(parallelism, device, model);
}

std::string document_text(const Json& document) { return document.dump(2) + "\n"; }

nlohmann::ordered_json with_parallelism(nlohmann::ordered_json j, const Parallelism& p,
                                        const DeviceProfile& device, const Model& model) {
  return with_parallelism_report(std::move(j), p, device.collectives.gpus_per_node,
                                 expert_routing(model));
}

std::string parallelism_text(const Parallelism& p, const DeviceProfile& device,
                             const Model& model) {
  if (!p.sharded()) return {};
  const std::int32_t nodes = p.node_count(device.collectives.gpus_per_node);
  // The mesh axes in use, each with what the simulation assumes of it.
  std::vector<std::string> axes;
  if (p.tp > 1)
    axes.push_back(fmt::format("tensor parallelism over {} GPUs (sequence parallel)", p.tp));
  if (p.cp > 1) {
    axes.push_back(fmt::format("context parallelism over {} GPUs (K and V all-gathered)", p.cp));
  }
  if (p.ep > 1) {
    axes.push_back(fmt::format("expert parallelism over {} GPUs ({}{})", p.ep,
                               expert_routing(model) == ExpertRouting::Balanced
                                   ? "routing balanced"
                                   : "each layer at the rank its traced routing loads most",
                               p.expert_capacity > 0
                                   ? fmt::format(", routed rows padded to {}x", p.expert_capacity)
                                   : std::string()));
  }
  const std::string mesh = fmt::format("{}", fmt::join(axes, " and "));
  if (!p.on()) {
    return fmt::format(
        "{}; every figure is one GPU's (its pinned memory: its part of the node's)\n", mesh);
  }
  return fmt::format(
      "{} over {} ranks on {} node{}{}, reshard after forward: {}{}{}; every figure is one "
      "rank's (its pinned memory: its part of the node's)\n",
      p.impl == FsdpImpl::Simple         ? "SimpleFSDP"
      : p.impl == FsdpImpl::Fsdp2Torch24 ? "FSDP2 (torch 2.4)"
                                         : "FSDP2",
      p.ranks, nodes, nodes == 1 ? "" : "s",
      p.replicas > 1 ? fmt::format(", {} HSDP replica groups", p.replicas) : "",
      to_string(p.reshard_after_forward),
      p.reduce == ReduceDtype::Float32 ? ", gradients reduced in float32" : "",
      mesh.empty() ? mesh : ", each rank " + mesh);
}

Json simulate_json(const RowResult& r, const Model& model, const DeviceProfile& device,
                   const Parallelism& parallelism) {
  Json j;
  j["format"] = "ferry.simulate/1";
  j.update(context_json(model, device));
  j["result"] = row_json(r, nullptr);
  // Per layer of the packing op (-1: outside the layers), last step: what
  // `python -m ferry validate` compares with a real run's.
  Json layers = Json::array();
  for (const auto& [layer, d] : r.layers) {
    layers.push_back({{"layer", layer},
                      {"packed", d.packed},
                      {"offloaded", d.offloaded},
                      {"kept", d.kept},
                      {"deduplicated", d.deduplicated},
                      {"recomputed", d.recomputed}});
  }
  j["result"]["layers"] = std::move(layers);
  if (const auto& s = r.paged_stash) {
    j["result"]["paged_stash"] = {{"stashed", s->stashed},
                                  {"data_bytes", s->data.count()},
                                  {"padded_bytes", s->padded.count()},
                                  {"pool_bytes", s->pool.count()},
                                  {"pages", s->pages}};
  }
  return with_parallelism(std::move(j), parallelism, device, model);
}

std::string compare_text(const std::vector<RowResult>& rows, const Model& model,
                         const DeviceProfile& device, const std::vector<PipelineRow>& pipeline,
                         const Parallelism& parallelism) {
  const RowResult* base = baseline(rows);
  std::string out = fmt::format("ferry compare: {} on {} ({} device memory)\n", model.name,
                                device.name, format_bytes(device.memory));
  out += fmt::format("{:<22} {:>9} {:>6} {:>10} {:>6} {:>11} {:>9} {:>9} {:>9} {:>9} {:>7} {}\n",
                     "policy", "step", "time", "peak alloc", "memory", "peak pinned", "D2H", "H2D",
                     "recompute", "bwd stall", "overlap", "note");
  for (const RowResult& r : rows) {
    std::string note;
    if (!r.fits) {
      note = "does not fit";
    } else if (r.failure) {
      note = "failed: " + r.failure->message;
    } else if (r.hazards > 0) {
      note = fmt::format("{} hazards", r.hazards);
    }
    // A run out of memory reports its run with room ("does not fit"); one that completed no step
    // has no step time (its memory is what it reached).
    const bool stepped = r.step_time.ns() > 0;
    out +=
        fmt::format("{:<22} {:>9} {:>6} {:>10} {:>6} {:>11} {:>9} {:>9} {:>9} {:>9} {:>7} {}\n",
                    r.name, stepped ? format_time(r.step_time) : "-",
                    base && stepped ? ratio_text(r.step_time.ns(), base->step_time.ns()) : "-",
                    format_bytes(r.peak_allocated),
                    base ? ratio_text(r.peak_allocated.count(), base->peak_allocated.count()) : "-",
                    format_bytes(r.pinned_peak), format_bytes(r.d2h), format_bytes(r.h2d),
                    format_time(r.recompute_time), format_time(r.backward_stall),
                    percent_text(r.overlap_permille), note);
  }
  out +=
      "time and memory are ratios to the none row; step (simulated device time), bytes moved, "
      "recompute and bwd stall (compute stream waiting on copies) are of the last simulated "
      "step\n";
  if (!pipeline.empty()) out += "\n" + pipeline_text(pipeline);
  return out + parallelism_text(parallelism, device, model);
}

std::string pipeline_text(const std::vector<PipelineRow>& rows) {
  const auto percent = [](std::int64_t permille) {
    return fmt::format("{}.{}%", permille / 10, permille % 10);
  };
  std::string out = fmt::format("{:<40} {:>9} {:>15} {:>12} {:>9} {:>9} {:>7} {:>9} {}\n",
                                "pipeline", "step", "per micro-batch", "max dev peak", "recompute",
                                "D2H", "bubble", "in flight", "note");
  for (const PipelineRow& r : rows) {
    std::string note = r.failure       ? "failed: " + r.failure->message
                       : r.hazards > 0 ? fmt::format("{} hazards", r.hazards)
                                       : std::string();
    const std::int64_t mb = std::max(1, r.options.micro_batches);
    const std::string in_flight =
        r.peak_in_flight.empty() ? std::string("-") : std::to_string(r.peak_in_flight.front());
    // A failed pipeline step stopped part way: its time and bubble are none, its peaks what it
    // reached.
    const bool stepped = !r.failure;
    out += fmt::format("{:<40} {:>9} {:>15} {:>12} {:>9} {:>9} {:>7} {:>9} {}\n", r.name,
                       stepped ? format_time(r.step_time) : "-",
                       stepped ? format_time(SimTime(r.step_time.ns() / mb)) : "-",
                       format_bytes(r.max_device_peak), format_time(r.recompute_time),
                       format_bytes(r.d2h), stepped ? percent(bubble_permille(r)) : "-", in_flight,
                       note);
    std::string stages;
    for (std::size_t d = 0; d < r.device_peaks.size(); ++d) {
      stages += fmt::format("{}gpu{} {}", d == 0 ? "" : ", ", d, format_bytes(r.device_peaks[d]));
      if (stepped) stages += fmt::format(" bubble {}", percent(bubble_permille(r, d)));
      if (d < r.peak_in_flight.size()) stages += fmt::format(" in flight {}", r.peak_in_flight[d]);
    }
    if (!stages.empty()) out += "  " + stages + "\n";
  }
  // Every row of a compare cuts the model the same way: the split is printed once.
  for (const PipelineRow& r : rows) {
    if (r.stages.empty()) continue;
    out += fmt::format("split {}: {}\n", r.split,
                       stage_spans_text(r.stages, r.options.schedule, r.options.devices));
    break;
  }
  out +=
      "per-device peaks are allocated bytes; D2H is offloaded bytes, all stages; bubble is the "
      "devices' idle compute time over the span from the first task kernel to the last; in "
      "flight is the most micro-batch tasks holding activations at once on gpu0; the model "
      "describes one micro-batch\n";
  return out;
}

namespace {

Json pipeline_list(const std::vector<PipelineRow>& rows) {
  Json list = Json::array();
  for (const PipelineRow& r : rows) {
    Json j;
    j["name"] = r.name;
    j["devices"] = r.options.devices;
    j["micro_batches"] = r.options.micro_batches;
    j["schedule"] = pipeline::schedule_name(r.options.schedule);
    j["virtual_stages"] = r.options.virtual_stages;
    j["checkpoint"] = checkpoint_mode_name(r.options.checkpoint);
    j["policy"] = policy_name(r.options.offload.policy);
    j["failure"] = r.failure ? Json(r.failure->message) : Json(nullptr);
    j["step_time_ns"] = r.step_time.ns();
    j["recompute_ns"] = r.recompute_time.ns();
    j["hazards"] = r.hazards;
    j["d2h_bytes"] = r.d2h.count();
    Json peaks = Json::array();
    for (const Bytes b : r.device_peaks) peaks.push_back(b.count());
    j["device_peak_allocated_bytes"] = std::move(peaks);
    j["span_ns"] = r.span.ns();
    j["bubble_permille"] = bubble_permille(r);
    Json busy = Json::array();
    Json bubbles = Json::array();
    for (std::size_t d = 0; d < r.busy.size(); ++d) {
      busy.push_back(r.busy[d].ns());
      bubbles.push_back(bubble_permille(r, d));
    }
    j["device_busy_ns"] = std::move(busy);
    j["device_bubble_permille"] = std::move(bubbles);
    Json in_flight = Json::array();
    for (const std::int32_t n : r.peak_in_flight) in_flight.push_back(n);
    j["device_peak_in_flight"] = std::move(in_flight);
    j["split"] = r.split;
    Json stages = Json::array();
    for (std::size_t s = 0; s < r.stages.size(); ++s) {
      const StageSpan& span = r.stages[s];
      stages.push_back({{"stage", s},
                        {"device", pipeline::rank_of_stage(
                                       r.options.schedule, static_cast<std::uint32_t>(s),
                                       static_cast<std::uint32_t>(std::max(1, r.options.devices)))},
                        {"first_op", span.begin},
                        {"end_op", span.end},
                        {"first_layer", span.first_layer},
                        {"last_layer", span.last_layer}});
    }
    j["stages"] = std::move(stages);
    list.push_back(std::move(j));
  }
  return list;
}

}  // namespace

std::string pipeline_json(const std::vector<PipelineRow>& rows) {
  return pipeline_list(rows).dump(2);
}

Json pipeline_document(const std::vector<PipelineRow>& rows) {
  Json j;
  j["format"] = "ferry.pipeline/1";
  j["rows"] = pipeline_list(rows);
  return j;
}

Json compare_json(const std::vector<RowResult>& rows, const Model& model,
                  const DeviceProfile& device, const std::vector<PipelineRow>& pipeline,
                  const Parallelism& parallelism) {
  const RowResult* base = baseline(rows);
  Json j;
  j["format"] = "ferry.compare/1";
  j.update(context_json(model, device));
  Json list = Json::array();
  for (const RowResult& r : rows) list.push_back(row_json(r, base));
  j["rows"] = std::move(list);
  if (!pipeline.empty()) j["pipeline"] = pipeline_list(pipeline);
  return with_parallelism(std::move(j), parallelism, device, model);
}

}  // namespace ferry::sim
