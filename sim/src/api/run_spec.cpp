#include "ferry/sim/api/run_spec.hpp"

#include <fmt/format.h>

#include <charconv>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "ferry/sim/io/parallelism_json.hpp"
#include "ferry/sim/runs/compare_runs.hpp"
#include "ferry/sim/runs/horizon.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {
namespace {

// `option`'s `value` within lo..hi, or the error that says it is not (Note [One check for both
// edges]).
Status in_bounds(std::string_view option, std::int64_t value, std::int64_t lo, std::int64_t hi) {
  if (value >= lo && value <= hi) return Ok{};
  return Error{fmt::format("{}: {} is not in {}..{}", option, value, lo, hi)};
}

Status in_bounds(std::string_view option, const std::optional<std::int32_t>& value, std::int64_t lo,
                 std::int64_t hi) {
  return value ? in_bounds(option, *value, lo, hi) : Status{Ok{}};
}

// The byte count `text` of the option `option`; blank is an error, not "none".
Result<Bytes> byte_count(const std::string& text, std::string_view option) {
  if (text.find_first_not_of(" \t") == std::string::npos) {
    return Error{
        fmt::format("{}: empty; give a byte count such as 40GiB, or leave the option out", option)};
  }
  return parse_bytes(text, option);
}

}  // namespace

Result<AllocatorMode> allocator_mode(const std::optional<std::string>& name) {
  if (!name) return AllocatorMode::Default;
  if (const auto mode = parse_allocator_mode(*name)) return *mode;
  return Error{fmt::format("--allocator: \"{}\" is not default or expandable", *name)};
}

void adopt_model_allocator(std::optional<std::string>& allocator, const Model& model) {
  if (!allocator && !model.allocator.empty()) allocator = model.allocator;
}

Result<Reshard> parse_reshard(std::string_view text) {
  if (text == "true") return Reshard::True();
  if (text == "false") return Reshard::False();
  std::int32_t k = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), k);
  if (ec != std::errc() || end != text.data() + text.size() || k < 2) {
    return Error{fmt::format(
        "--reshard-after-forward: \"{}\" is not true, false or a number of ranks (2 or more)",
        text)};
  }
  return Reshard::K(k);
}

Result<Parallelism> parallelism_of(const FsdpSpec& spec) {
  for (const Status& bounded : {in_bounds("--fsdp", spec.ranks, 1, 1'000'000),
                                in_bounds("--nodes", spec.nodes, 1, 1'000'000),
                                in_bounds("--hsdp", spec.replicas, 1, 1'000'000)}) {
    if (!bounded) return bounded.error();
  }
  auto reshard = parse_reshard(spec.reshard_after_forward);
  if (!reshard) return reshard.error();
  const Parallelism p{.ranks = spec.ranks.value_or(0),
                      .nodes = spec.nodes.value_or(0),
                      .replicas = spec.replicas,
                      .reshard_after_forward = reshard.value()};
  if (!p.on() && (spec.nodes || p.replicas != 1 || p.reshard_after_forward != Reshard::True())) {
    return Error{"--nodes, --hsdp and --reshard-after-forward need --fsdp N"};
  }
  return p;
}

void adopt_model_parallelism(FsdpSpec& spec, const Model& model, std::int32_t devices) {
  adopt_parallelism(spec, model.parallelism, devices);
}

void adopt_parallelism(FsdpSpec& spec, const Parallelism& p, std::int32_t devices) {
  if (!p.on() || devices > 1) return;
  if (!spec.ranks) spec.ranks = p.ranks;
  if (!spec.nodes && p.nodes > 0) spec.nodes = p.nodes;
  if (spec.replicas == 1) spec.replicas = p.replicas;
  if (spec.reshard_after_forward == "true") {
    spec.reshard_after_forward = to_string(p.reshard_after_forward);
  }
}

std::string with_fsdp_json(std::string document, const Parallelism& p,
                           const DeviceProfile& device) {
  if (!p.on()) return document;
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(document);
  j["fsdp"] = parallelism_report_json(p, device.collectives.gpus_per_node);
  return j.dump(2) + "\n";
}

Status validate(const RunSpec& spec) {
  for (const Status& bounded : {
           in_bounds("--steps", spec.steps, 1, 1000),
           in_bounds("--stash", spec.stash, 1, std::int64_t{1} << 20),
           in_bounds("--min-bytes", spec.min_bytes, 0, std::int64_t{1} << 50),
           in_bounds("--window-mib", spec.window_mib, 0, std::int64_t{1} << 30),
           in_bounds("--prefetch-mib", spec.prefetch_mib, 0, std::int64_t{1} << 30),
           in_bounds("--host-cap-gib", spec.host_cap_gib, 0, std::int64_t{1} << 20),
       }) {
    if (!bounded) return bounded;
  }
  if (auto fsdp = parallelism_of(spec.fsdp); !fsdp) return fsdp.error();
  if (auto mode = allocator_mode(spec.allocator); !mode) return mode.error();
  return Ok{};
}

Result<TrainingOptions> run_options(const RunSpec& spec, const Model& model, bool with_checkpoint) {
  if (auto valid = validate(spec); !valid) return valid.error();
  TrainingOptions o;
  o.steps = spec.steps;
  o.sim.check_hazards = !spec.no_checker;
  o.sim.track_content = !spec.no_checker;
  o.sim.allocator = allocator_mode(spec.allocator).value();
  o.offload.min_bytes = Bytes(spec.min_bytes);
  o.offload.window_bytes = spec.window_mib * kMiB;
  o.offload.prefetch_bytes = spec.prefetch_mib * kMiB;
  o.offload.host_cap = spec.host_cap_gib * kGiB;
  o.offload.trl_stash_count = spec.stash;
  o.offload.prefetch = !spec.no_prefetch;
  o.offload.dedup = !spec.no_dedup;
  if (with_checkpoint) {
    auto plan = parse_checkpoint_spec(spec.checkpoint, model);
    if (!plan) return Error{fmt::format("--checkpoint: {}", plan.error().message)};
    o.checkpoint = std::move(plan).value();
  }
  if (spec.no_early_stop) o.checkpoint.global_early_stop = false;
  auto side = parse_side_streams(spec.side_streams);
  if (!side) return Error{fmt::format("--side-streams: {}", side.error().message)};
  o.side = std::move(side).value();
  auto fsdp = parallelism_of(spec.fsdp);
  if (!fsdp) return fsdp.error();
  o.fsdp.parallelism = fsdp.value();
  if (spec.horizon == "none") {
    o.offload.horizon_bytes = Bytes(std::numeric_limits<std::int64_t>::max());
  } else if (spec.horizon != "auto") {
    auto horizon = parse_bytes(spec.horizon, "--horizon");
    if (!horizon) return Error{fmt::format("{} (or auto, none)", horizon.error().message)};
    o.offload.horizon_bytes = horizon.value();
  }
  return o;
}

Result<PlannerOptions> planner_options(const PlanSpec& spec) {
  PlannerOptions options;
  if (spec.budget) {
    auto budget = byte_count(*spec.budget, "--budget");
    if (!budget) return budget.error();
    options.budget = budget.value();
  }
  if (spec.host_budget) {
    auto host = byte_count(*spec.host_budget, "--host-budget");
    if (!host) return host.error();
    options.host_budget = host.value();
  }
  if (auto steps = in_bounds("--steps", spec.steps, 1, 100); !steps) return steps.error();
  options.steps = spec.steps;
  auto fsdp = parallelism_of(spec.fsdp);
  if (!fsdp) return fsdp.error();
  options.fsdp.parallelism = fsdp.value();
  auto mode = allocator_mode(spec.allocator);
  if (!mode) return mode.error();
  options.allocator = mode.value();
  options.margin_permille = kDefaultPlanMarginPermille;
  if (spec.margin) {
    auto margin = margin_permille(*spec.margin);
    if (!margin) return margin.error();
    options.margin_permille = margin.value();
  }
  return options;
}

Result<std::int32_t> margin_permille(const std::string& text) {
  const auto refused = [&] {
    return Error{fmt::format(
        "--margin: \"{}\" is not a percentage of the budget such as 6, 5.5 or 6%", text)};
  };
  std::string_view s = text;
  const auto trim = [&s] {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  };
  trim();
  if (!s.empty() && s.back() == '%') {
    s.remove_suffix(1);
    trim();
  }
  // Whole percent, then at most one decimal: at most "50.0".
  std::int64_t whole = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), whole);
  if (ec != std::errc{} || end == s.data()) return refused();
  std::int64_t tenths = 0;
  std::string_view rest(end, static_cast<std::size_t>(s.data() + s.size() - end));
  if (!rest.empty()) {
    if (rest.size() != 2 || rest[0] != '.' || rest[1] < '0' || rest[1] > '9') return refused();
    tenths = rest[1] - '0';
  }
  if (s.front() == '-' || whole > kMaxPlanMarginPermille / 10 ||
      whole * 10 + tenths > kMaxPlanMarginPermille) {
    return Error{fmt::format("--margin: {} % is not in 0..{} %", s, kMaxPlanMarginPermille / 10)};
  }
  return static_cast<std::int32_t>(whole * 10 + tenths);
}

Result<RowResult> simulate_one(const Workload& workload, const RunSpec& spec,
                               std::optional<TrainingRun>* keep, bool record_allocator) {
  auto options = run_options(spec, workload.model, true);
  if (!options) return options.error();
  const auto policy = parse_policy(spec.policy);
  if (!policy) return Error{fmt::format("unknown policy \"{}\" ({})", spec.policy, kPolicyNames)};
  if (auto valid =
          validate_parallelism(options.value().fsdp.parallelism, workload.device, kFsdpFlags);
      !valid) {
    return valid.error();
  }
  PolicyRow row{spec.policy, std::move(options).value()};
  row.options.offload.policy = *policy;
  row.options.sim.record_allocator = record_allocator;
  if (!row.options.offload.horizon_bytes) {
    row.options.offload.horizon_bytes =
        offload_horizon(workload.model, workload.device, row.options);
  }
  return run_row(workload.model, workload.device, row, keep);
}

}  // namespace ferry::sim
