#include "ferry/sim/runs/compare_runs.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "ferry/sim/runs/configurations.hpp"

namespace ferry::sim {

Result<CheckpointPlan> parse_checkpoint_spec(std::string_view spec, const Model& model) {
  auto number = [&](std::string_view prefix) -> std::optional<std::int32_t> {
    if (spec.substr(0, prefix.size()) != prefix) return std::nullopt;
    const std::string digits(spec.substr(prefix.size()));
    if (digits.empty() || digits.size() > 6 ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
      return std::nullopt;
    }
    const int n = std::stoi(digits);
    return n >= 1 ? std::optional<std::int32_t>(n) : std::nullopt;
  };
  if (spec == "none") return CheckpointPlan{};
  if (spec == "selective") {
    // Asked for by name, a recomputation with nothing to recompute is an error, not `none`.
    CheckpointPlan plan = checkpoint_attention_cores(model);
    if (plan.regions.empty()) {
      return Error{fmt::format(
          "checkpoint spec \"selective\" recomputes each layer's attention core, and model \"{}\" "
          "has none: no op in a layer runs an attention kernel, or a softmax between two batched "
          "matmuls (the ops' \"kind\", docs/checkpoint.md)",
          model.name)};
    }
    return plan;
  }
  if (spec == "op-sac" || spec == "op-sac-all") {
    CheckpointPlan plan = checkpoint_every(model, 1);
    const MatmulSaving matmuls = spec == "op-sac" ? MatmulSaving::Alternate : MatmulSaving::Every;
    if (auto status = apply_op_sac_policy(plan, model, matmuls); !status.ok()) {
      return status.error();
    }
    return plan;
  }
  if (auto k = number("every:")) return checkpoint_every(model, *k);
  if (auto n = number("segments:")) return checkpoint_segments(model, *n, false);
  if (auto n = number("reentrant-segments:")) return checkpoint_segments(model, *n, true);
  return Error{
      fmt::format("unknown checkpoint spec \"{}\" (none, every:K, selective, "
                  "op-sac, op-sac-all, segments:N, reentrant-segments:N)",
                  spec)};
}

Result<SideStreamOptions> parse_side_streams(std::string_view spec) {
  SideStreamOptions side;
  if (spec == "none") return side;
  auto layer = [](std::string_view digits) -> std::optional<std::int32_t> {
    if (digits.empty() || digits.size() > 6 ||
        digits.find_first_not_of("0123456789") != std::string_view::npos) {
      return std::nullopt;
    }
    return std::stoi(std::string(digits));
  };
  std::size_t start = 0;
  while (start <= spec.size()) {
    const std::size_t comma = std::min(spec.find(',', start), spec.size());
    const std::string_view item = spec.substr(start, comma - start);
    const std::size_t dash = item.find('-');
    std::optional<std::int32_t> first;
    std::optional<std::int32_t> last;
    if (item == "recompute") {
      side.recompute = true;
    } else if (item == "all-reduce") {
      side.all_reduce = true;
    } else if (dash == std::string_view::npos && (first = layer(item))) {
      side.layers.push_back(*first);
    } else if (dash != std::string_view::npos && (first = layer(item.substr(0, dash))) &&
               (last = layer(item.substr(dash + 1))) && *first <= *last) {
      for (std::int32_t l = *first; l <= *last; ++l) side.layers.push_back(l);
    } else {
      return Error{fmt::format(
          "unknown side-stream item \"{}\" in \"{}\" (none, or a comma-separated list of "
          "layers L, ranges A-B, recompute, all-reduce)",
          item, spec)};
    }
    start = comma + 1;
  }
  return side;
}

PipelineRow run_pipeline_row(const CheckedModel& model, const DeviceProfile& device,
                             std::string name, const PipelineOptions& options) {
  PipelineRow row;
  row.name = std::move(name);
  row.options = options;
  auto run = simulate_pipeline(model, device, options);
  if (!run.ok()) {
    row.failure = Failure{FailureKind::Infeasible, run.error().message};
    return row;
  }
  const PipelineRun& r = run.value();
  row.failure = r.failure;
  row.step_time = r.step_time;
  row.recompute_time = r.recompute_time;
  row.hazards = r.hazards().size();
  row.device_peaks = r.peak_allocated;
  for (const Bytes b : r.peak_allocated) row.max_device_peak = std::max(row.max_device_peak, b);
  for (const OffloadTelemetry& t : r.telemetry) row.d2h += t.bytes_d2h;
  row.span = r.pipeline_span;
  row.busy = r.busy;
  row.peak_in_flight = r.peak_in_flight;
  row.stages = r.stages;
  row.split = r.split;
  return row;
}

namespace {

// idle / total in permille, rounded half up, in integers.
std::int64_t permille(std::int64_t idle, std::int64_t total) {
  if (total <= 0) return 0;
  return (idle * 2000 + total) / (2 * total);
}

}  // namespace

std::int64_t bubble_permille(const PipelineRow& row) {
  std::int64_t busy = 0;
  for (const SimTime b : row.busy) busy += b.ns();
  const auto total = row.span.ns() * static_cast<std::int64_t>(row.busy.size());
  return permille(total - busy, total);
}

std::int64_t bubble_permille(const PipelineRow& row, std::size_t device) {
  if (device >= row.busy.size()) return 0;
  return permille(row.span.ns() - row.busy[device].ns(), row.span.ns());
}

Result<Schedule> parse_schedule(std::string_view text) {
  for (const Schedule s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B,
                           Schedule::InterleavedZeroBubble, Schedule::ZeroBubbleV}) {
    if (text == pipeline::schedule_name(s)) return s;
  }
  return Error{fmt::format(
      "unknown pipeline schedule \"{}\" (gpipe, 1f1b, interleaved-1f1b, interleaved-zero-bubble, "
      "zbv)",
      text)};
}

Result<CheckpointMode> parse_checkpoint_mode(std::string_view text) {
  for (const CheckpointMode m :
       {CheckpointMode::Always, CheckpointMode::ExceptLast, CheckpointMode::Never}) {
    if (text == checkpoint_mode_name(m)) return m;
  }
  return Error{
      fmt::format("unknown pipeline checkpoint mode \"{}\" (always, except_last, never)", text)};
}

std::string pipeline_row_name(const PipelineOptions& options) {
  std::string name = fmt::format("{} {}x{}", pipeline::schedule_name(options.schedule),
                                 options.devices, options.micro_batches);
  if (options.schedule == Schedule::Interleaved1F1B ||
      options.schedule == Schedule::InterleavedZeroBubble ||
      options.schedule == Schedule::ZeroBubbleV) {
    name += fmt::format("x{}", options.virtual_stages);
  }
  name += fmt::format(" {}", checkpoint_mode_name(options.checkpoint));
  if (options.offload.policy != Policy::None)
    name += fmt::format(" {}", policy_name(options.offload.policy));
  return name;
}

std::vector<PipelineRow> pipeline_rows(const CheckedModel& model, const DeviceProfile& device,
                                       std::int32_t devices, std::int32_t micro_batches,
                                       Schedule schedule, std::int32_t virtual_stages,
                                       const Mesh& mesh, const PipelineSplit& split) {
  std::vector<PipelineOptions> configs;
  for (const CheckpointMode m :
       {CheckpointMode::Never, CheckpointMode::ExceptLast, CheckpointMode::Always}) {
    PipelineOptions o;
    o.devices = devices;
    o.micro_batches = micro_batches;
    o.schedule = schedule;
    o.virtual_stages = virtual_stages;
    o.split = split;
    o.checkpoint = m;
    o.mesh = mesh;
    configs.push_back(o);
  }
  // Each stage offloading what its grad-mode forwards save (Note [Offload in stages]), with
  // the knobs of the single-device trl and ferry rows.
  // (Not under zero bubble, whose stages do not offload.)
  for (const CheckpointMode m : {CheckpointMode::Never, CheckpointMode::ExceptLast}) {
    if (pipeline::splits_backward(schedule)) break;
    for (const Policy policy : {Policy::Trl, Policy::Ferry}) {
      PipelineOptions o = configs[m == CheckpointMode::Never ? 0 : 1];
      o.offload = OffloadOptions{};
      o.offload.policy = policy;
      configs.push_back(o);
    }
  }
  std::vector<PipelineRow> rows;
  for (const PipelineOptions& o : configs) {
    rows.push_back(run_pipeline_row(model, device, pipeline_row_name(o), o));
  }
  return rows;
}

}  // namespace ferry::sim
