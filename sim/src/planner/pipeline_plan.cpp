#include "ferry/sim/planner/pipeline_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/pipeline/schedule.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/runs/compare_runs.hpp"
#include "workers.hpp"

namespace ferry::sim {
namespace {

using Json = nlohmann::ordered_json;

// A probe's device (Note [Per-stage plans]): this many times the device's and the pinned host's
// memory.
constexpr std::int64_t kProbeScale = 4;

// The ferry knob the plan space adds to the fixed rows' (Note [A pipeline's plan space]).
constexpr Bytes kWidePrefetch{2LL << 30};

// The candidates of one schedule, the fixed rows of `ferry compare` (pipeline_rows) among them.
std::vector<PipelineCandidate> schedule_space(const PipelinePlanOptions& o, Schedule schedule) {
  std::vector<PipelineCandidate> out;
  const auto add = [&](CheckpointMode mode, Policy policy, bool wide, bool fixed) {
    PipelineCandidate c;
    c.options.devices = o.devices;
    c.options.micro_batches = o.micro_batches;
    c.options.schedule = schedule;
    c.options.virtual_stages = o.virtual_stages;
    c.options.split = o.split;
    c.options.checkpoint = mode;
    c.options.mesh = o.mesh;
    if (policy != Policy::None) {
      c.options.offload = OffloadOptions{};
      c.options.offload.policy = policy;
      if (wide) c.options.offload.prefetch_bytes = kWidePrefetch;
    }
    c.name = pipeline_row_name(c.options);
    if (wide) c.name += " prefetch=2GiB";
    c.fixed = fixed;
    out.push_back(std::move(c));
  };
  const CheckpointMode modes[] = {CheckpointMode::Never, CheckpointMode::ExceptLast,
                                  CheckpointMode::Always};
  for (const CheckpointMode m : modes) add(m, Policy::None, false, true);
  // Zero bubble's stages do not offload (pipeline_rows).
  if (pipeline::splits_backward(schedule)) return out;
  for (const CheckpointMode m : modes) {
    for (const Policy p : {Policy::Trl, Policy::Ferry}) {
      add(m, p, false, m != CheckpointMode::Always);
    }
    add(m, Policy::Ferry, true, false);
  }
  return out;
}

// Runs `c` (the checks on or off) and takes its figures.
void run_candidate(PipelineCandidate& c, const CheckedModel& model, const DeviceProfile& device,
                   const PipelineFaults& faults, bool check) {
  PipelineOptions o = c.options;
  o.sim.check_hazards = check;
  o.sim.track_content = check;
  auto run = simulate_pipeline(model, device, o, faults);
  c.checked = check;
  if (!run.ok()) {
    c.failure = Failure{FailureKind::Infeasible, run.error().message};
    return;
  }
  const PipelineRun& r = run.value();
  c.failure = r.failure;
  c.step_time = r.step_time;
  c.recompute_time = r.recompute_time;
  c.hazards = r.hazards().size() + r.content_mismatches().size();
  c.peak_allocated = r.peak_allocated;
  c.peak_reserved.clear();
  for (std::size_t d = 0; d < r.peak_allocated.size(); ++d) {
    c.peak_reserved.push_back(
        r.sim.device_allocator(DeviceId(static_cast<std::uint32_t>(d))).stats().reserved_peak);
  }
  c.max_reserved = Bytes(0);
  for (std::size_t d = 0; d < c.peak_reserved.size(); ++d) {
    if (c.peak_reserved[d] > c.max_reserved) {
      c.max_reserved = c.peak_reserved[d];
      c.binding = d;
    }
  }
  c.d2h = Bytes(0);
  for (const OffloadTelemetry& t : r.telemetry) c.d2h += t.bytes_d2h;
  c.span = r.pipeline_span;
  c.busy = r.busy;
  c.peak_in_flight = r.peak_in_flight;
}

// A uniform candidate's configuration without its schedule and counts ("always ferry").
std::string config_label(const std::string& name) {
  const std::size_t first = name.find(' ');
  const std::size_t second = name.find(' ', first + 1);
  return second == std::string::npos ? name : name.substr(second + 1);
}

// The per-stage peaks the search reads: measured, or from the probe; null when neither.
const std::vector<Bytes>* search_peaks(const PipelineCandidate& c) {
  if (!c.failure && !c.peak_reserved.empty()) return &c.peak_reserved;
  if (!c.probe_reserved.empty()) return &c.probe_reserved;
  return nullptr;
}

SimTime search_step(const PipelineCandidate& c) { return c.failure ? c.probe_step : c.step_time; }

// "gpu0-1 always ferry, gpu2-7 never": runs of stages with one configuration.
std::string stage_runs(const std::vector<std::string>& configs) {
  std::string out;
  for (std::size_t d = 0; d < configs.size();) {
    std::size_t e = d;
    while (e + 1 < configs.size() && configs[e + 1] == configs[d]) ++e;
    if (!out.empty()) out += ", ";
    out += e == d ? fmt::format("gpu{} {}", d, configs[d])
                  : fmt::format("gpu{}-{} {}", d, e, configs[d]);
    d = e + 1;
  }
  return out;
}

// Each uniform configuration that ran out of memory, measured again with kProbeScale times the
// device's and pinned host's memory for its per-stage peaks and step (Note [Per-stage plans]).
void probe_failures(PipelinePlan& p, const CheckedModel& model, const DeviceProfile& device) {
  std::vector<std::size_t> failed;
  for (std::size_t i = 0; i < p.candidates.size(); ++i) {
    const PipelineCandidate& c = p.candidates[i];
    if (c.failure && c.failure->kind == FailureKind::OutOfMemory) failed.push_back(i);
  }
  DeviceProfile roomy = device;
  roomy.memory = Bytes(device.memory.count() * kProbeScale);
  roomy.pinned_host_capacity = Bytes(device.pinned_host_capacity.count() * kProbeScale);
  std::vector<PipelineCandidate> probes(failed.size());
  planning::for_each_parallel(failed.size(), planning::workers_for(p.options.jobs),
                              [&](std::size_t i) {
                                probes[i].options = p.candidates[failed[i]].options;
                                run_candidate(probes[i], model, roomy, p.options.faults, false);
                              });
  p.simulations += static_cast<std::int64_t>(failed.size());
  for (std::size_t i = 0; i < failed.size(); ++i) {
    if (probes[i].failure) continue;
    p.candidates[failed[i]].probe_reserved = probes[i].peak_reserved;
    p.candidates[failed[i]].probe_step = probes[i].step_time;
  }
}

// Schedule `s`'s per-stage plan, as Note [Per-stage plans] says; each mix it ran is appended
// to the candidates (none when the fastest uniform configuration fits every stage or a stage
// fits under none).
void per_stage_plan(PipelinePlan& p, const CheckedModel& model, const DeviceProfile& device,
                    Schedule s) {
  std::vector<std::size_t> uniform;
  for (std::size_t i = 0; i < p.candidates.size(); ++i) {
    const PipelineCandidate& c = p.candidates[i];
    if (c.options.schedule == s && c.stage_configs.empty() && search_peaks(c) != nullptr) {
      uniform.push_back(i);
    }
  }
  if (uniform.empty()) return;
  std::stable_sort(uniform.begin(), uniform.end(), [&](std::size_t a, std::size_t b) {
    return search_step(p.candidates[a]) < search_step(p.candidates[b]);
  });
  const auto devices = static_cast<std::size_t>(p.options.devices);
  const auto fits_on = [&](std::size_t k, std::size_t d) {
    const std::vector<Bytes>& peaks = *search_peaks(p.candidates[uniform[k]]);
    return d < peaks.size() && peaks[d] <= p.planned_budget;
  };
  // The next configuration (in step order) after `from` whose peak on stage d fits.
  const auto next_fit = [&](std::size_t from, std::size_t d) -> std::optional<std::size_t> {
    for (std::size_t k = from + 1; k < uniform.size(); ++k) {
      if (fits_on(k, d)) return k;
    }
    return std::nullopt;
  };
  std::vector<std::size_t> choice(devices, 0);
  bool mixed = false;
  for (std::size_t d = 0; d < devices; ++d) {
    if (fits_on(0, d)) continue;
    const auto k = next_fit(0, d);
    if (!k) return;  // no configuration fits this stage
    choice[d] = *k;
    mixed = true;
  }
  if (!mixed) return;  // the fastest configuration fits every stage: it is a uniform plan
  for (std::size_t round = 0; round < uniform.size(); ++round) {
    PipelineCandidate c;
    c.options = p.candidates[uniform[0]].options;
    for (std::size_t d = 0; d < devices; ++d) {
      const PipelineCandidate& u = p.candidates[uniform[choice[d]]];
      c.options.stages.push_back(stage_policy(u.options, 0));
      c.stage_configs.push_back(config_label(u.name));
    }
    std::string prefix = config_label(p.candidates[uniform[0]].name);
    prefix = p.candidates[uniform[0]].name.substr(
        0, p.candidates[uniform[0]].name.size() - prefix.size());
    c.name = prefix + "per stage: " + stage_runs(c.stage_configs);
    run_candidate(c, model, device, p.options.faults, false);
    ++p.simulations;
    std::vector<std::size_t> over;
    for (std::size_t d = 0; d < c.peak_reserved.size() && d < devices; ++d) {
      if (c.peak_reserved[d] > p.planned_budget) over.push_back(d);
    }
    const bool done = over.empty();
    p.candidates.push_back(std::move(c));
    if (done) return;
    for (const std::size_t d : over) {
      const auto k = next_fit(choice[d], d);
      if (!k) return;
      choice[d] = *k;
    }
  }
}

// A failure's first line (an out-of-memory failure lists the live blocks after it).
std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// Idle compute time over stages x span, in percent with one decimal.
std::string bubble_text(const PipelineCandidate& c) {
  std::int64_t busy = 0;
  for (const SimTime b : c.busy) busy += b.ns();
  const std::int64_t total = c.span.ns() * static_cast<std::int64_t>(c.busy.size());
  if (total <= 0) return "0.0 %";
  const std::int64_t permille = ((total - busy) * 2000 + total) / (2 * total);
  return fmt::format("{}.{} %", permille / 10, permille % 10);
}

std::string schedule_list(const std::vector<Schedule>& schedules) {
  std::string out;
  for (const Schedule s : schedules) {
    if (!out.empty()) out += ", ";
    out += pipeline::schedule_name(s);
  }
  return out;
}

// Why no candidate is the plan (a refusal): the floor as a budget where one completed.
Error refusal(const PipelinePlan& p, const DeviceProfile& device, Bytes* floor) {
  const PipelinePlanOptions& o = p.options;
  std::string asked =
      fmt::format("{} of peak reserved memory on every stage", format_bytes(o.budget));
  if (o.margin_permille > 0) {
    asked += fmt::format(" (the budget less its {} margin, {})", margin_text(o.margin_permille),
                         format_bytes(p.planned_budget));
  }
  const std::string head = fmt::format(
      "infeasible budget: no pipeline configuration ({} over {} devices, {} "
      "micro-batches) fits {} on {}",
      schedule_list(o.schedules), o.devices, o.micro_batches, asked, device.name);
  const PipelineCandidate* low = nullptr;
  const PipelineCandidate* failed_check = nullptr;
  for (const PipelineCandidate& c : p.candidates) {
    if (c.checked && c.hazards > 0 && failed_check == nullptr) failed_check = &c;
    if (c.failure || c.peak_reserved.empty()) continue;
    if (low == nullptr || c.max_reserved < low->max_reserved) low = &c;
  }
  if (failed_check != nullptr) {
    return Error{fmt::format("{}: the configurations that fit have hazards when checked ({}: {})",
                             head, failed_check->name, failed_check->hazards)};
  }
  if (low == nullptr) {
    if (floor != nullptr) *floor = Bytes(0);
    return Error{fmt::format(
        "{}: every configuration ran out of memory on the device's {}, so no floor is known; "
        "more stages (--pp) hold fewer layers each",
        head, format_bytes(device.memory))};
  }
  if (floor != nullptr) *floor = low->max_reserved;
  const Bytes budget = smallest_budget_for(low->max_reserved, o.margin_permille);
  const std::string peak =
      fmt::format("{} (gpu{} of {}, {} bytes)", format_bytes(low->max_reserved), low->binding,
                  low->name, low->max_reserved.count());
  if (budget > device.memory) {
    std::string out = fmt::format(
        "{}; no budget on {} plans: the smallest binding stage's peak reserved is {}, so the "
        "floor (the smallest budget that plans) would be {} ({} bytes), above the device's {}",
        head, device.name, peak, format_bytes(budget), budget.count(), format_bytes(device.memory));
    const std::int32_t smaller =
        largest_margin_within(low->max_reserved, device.memory, o.margin_permille);
    if (smaller >= 0) {
      const std::string percent = margin_text(smaller);
      out += fmt::format(", or at its whole memory with a margin of at most {} (--margin {})",
                         percent, percent.substr(0, percent.size() - 2));
    }
    return Error{out + "; more stages (--pp) hold fewer layers each"};
  }
  return Error{fmt::format(
      "{}; the floor (the smallest budget that plans) is {} ({} bytes): the smallest binding "
      "stage's peak reserved, {}{}",
      head, format_bytes(budget), budget.count(), peak,
      o.margin_permille > 0
          ? fmt::format(", with the {} margin added back", margin_text(o.margin_permille))
          : std::string())};
}

Json bytes_list(const std::vector<Bytes>& v) {
  Json out = Json::array();
  for (const Bytes b : v) out.push_back(b.count());
  return out;
}

Json candidate_json(const PipelineCandidate& c) {
  Json j;
  j["name"] = c.name;
  j["schedule"] = pipeline::schedule_name(c.options.schedule);
  const bool per_stage = !c.stage_configs.empty();
  j["checkpoint"] = per_stage ? Json(nullptr) : Json(checkpoint_mode_name(c.options.checkpoint));
  j["policy"] = per_stage ? Json(nullptr) : Json(policy_name(c.options.offload.policy));
  j["prefetch_bytes"] = per_stage || c.options.offload.policy == Policy::None
                            ? Json(nullptr)
                            : Json(c.options.offload.prefetch_bytes.count());
  Json stages = per_stage ? Json::array() : Json(nullptr);
  for (std::size_t d = 0; d < c.stage_configs.size(); ++d) {
    const StagePolicy& sp = c.options.stages[d];
    Json st;
    st["configuration"] = c.stage_configs[d];
    st["checkpoint"] = checkpoint_mode_name(sp.checkpoint);
    st["policy"] = policy_name(sp.offload.policy);
    st["prefetch_bytes"] =
        sp.offload.policy == Policy::None ? Json(nullptr) : Json(sp.offload.prefetch_bytes.count());
    stages.push_back(std::move(st));
  }
  j["stages"] = std::move(stages);
  j["slower_than_uniform"] = c.slower;
  if (c.probe_reserved.empty()) {
    j["probe"] = nullptr;
  } else {
    Json probe;
    probe["step_time_ns"] = c.probe_step.ns();
    probe["stage_peak_reserved_bytes"] = bytes_list(c.probe_reserved);
    j["probe"] = std::move(probe);
  }
  j["fixed"] = c.fixed;
  j["failure"] = c.failure ? Json(first_line(c.failure->message)) : Json(nullptr);
  j["fits"] = c.fits;
  j["checked"] = c.checked;
  j["hazards"] = c.checked ? Json(c.hazards) : Json(nullptr);
  j["step_time_ns"] = c.step_time.ns();
  j["max_stage_peak_reserved_bytes"] = c.max_reserved.count();
  j["binding_stage"] = c.binding;
  j["stage_peak_reserved_bytes"] = bytes_list(c.peak_reserved);
  j["stage_peak_allocated_bytes"] = bytes_list(c.peak_allocated);
  Json in_flight = Json::array();
  for (const std::int32_t n : c.peak_in_flight) in_flight.push_back(n);
  j["stage_peak_in_flight"] = std::move(in_flight);
  j["recompute_ns"] = c.recompute_time.ns();
  j["d2h_bytes"] = c.d2h.count();
  j["span_ns"] = c.span.ns();
  Json busy = Json::array();
  for (const SimTime b : c.busy) busy.push_back(b.ns());
  j["stage_busy_ns"] = std::move(busy);
  return j;
}

// Per schedule: the fastest candidate that fits, or none.
struct ScheduleBest {
  Schedule schedule;
  const PipelineCandidate* best = nullptr;
};

std::vector<ScheduleBest> schedule_bests(const PipelinePlan& p) {
  std::vector<ScheduleBest> out;
  for (const Schedule s : p.options.schedules) {
    bool skipped = false;
    for (const SkippedSchedule& k : p.skipped) skipped = skipped || k.schedule == s;
    if (skipped) continue;
    ScheduleBest b{s};
    for (const PipelineCandidate& c : p.candidates) {
      if (c.options.schedule != s || !c.fits) continue;
      if (b.best == nullptr || c.step_time < b.best->step_time) b.best = &c;
    }
    out.push_back(b);
  }
  return out;
}

// Why the plan runs its schedule: one line.
std::string schedule_reason(const PipelinePlan& p) {
  const PipelineCandidate& c = p.candidates[p.chosen];
  const std::string_view name = pipeline::schedule_name(c.options.schedule);
  if (p.options.schedules.size() == 1) {
    if (p.options.schedule_defaulted) {
      return fmt::format(
          "schedule: {} (none asked: torchtitan's default, pipeline_parallel_schedule \"1F1B\"; "
          "--schedule auto plans each and keeps the fastest)",
          name);
    }
    return fmt::format("schedule: {} (asked)", name);
  }
  std::string out = fmt::format("schedule: {}, the fastest that fits of", name);
  std::string sep = " ";
  for (const ScheduleBest& b : schedule_bests(p)) {
    out += sep + std::string(pipeline::schedule_name(b.schedule)) + " " +
           (b.best != nullptr ? format_time(b.best->step_time) : std::string("(none fits)"));
    sep = ", ";
  }
  for (const SkippedSchedule& k : p.skipped) {
    out += fmt::format("{}{} (not run: {})", sep, pipeline::schedule_name(k.schedule), k.why);
    sep = ", ";
  }
  return out;
}

// The fastest candidate that fits, checked: one with a hazard (or that no longer fits) is passed
// over; none: every one was. Sets p.best_fixed, the fastest fixed row that fits.
std::optional<std::size_t> choose_checked(PipelinePlan& p, const CheckedModel& model,
                                          const DeviceProfile& device) {
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < p.candidates.size(); ++i) {
    if (p.candidates[i].fits) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return p.candidates[a].step_time < p.candidates[b].step_time;
  });
  for (const std::size_t i : order) {
    if (p.candidates[i].fixed && !p.best_fixed) p.best_fixed = i;
  }
  for (const std::size_t i : order) {
    PipelineCandidate& c = p.candidates[i];
    run_candidate(c, model, device, p.options.faults, true);
    ++p.simulations;
    c.fits = !c.failure && c.max_reserved <= p.planned_budget && c.hazards == 0;
    if (c.fits) return i;
  }
  return std::nullopt;
}

}  // namespace

Result<PipelinePlan> plan_pipeline(const CheckedModel& model, const DeviceProfile& device,
                                   const PipelinePlanOptions& options, Bytes* floor) {
  if (floor != nullptr) *floor = Bytes(0);
  PipelinePlan p;
  p.options = options;
  p.planned_budget = budget_less_margin(options.budget, options.margin_permille);
  // The cut is the same for every candidate: a split the model cannot take is the request's
  // error, not every candidate's failure.
  auto parts = partition_model(*model, options.devices * options.virtual_stages, options.split);
  if (!parts) return parts.error();
  p.stages = stage_spans(*model, parts.value().starts);
  p.split = std::move(parts.value().split);
  for (const Schedule s : options.schedules) {
    if (const auto why =
            pipeline::schedule_error(s, static_cast<std::uint32_t>(options.micro_batches),
                                     static_cast<std::uint32_t>(options.devices),
                                     static_cast<std::uint32_t>(options.virtual_stages))) {
      if (options.schedules.size() == 1) {
        return Error{fmt::format("--schedule {}: {}", pipeline::schedule_name(s), *why)};
      }
      p.skipped.push_back(SkippedSchedule{s, *why});
      continue;
    }
    for (PipelineCandidate& c : schedule_space(options, s)) p.candidates.push_back(std::move(c));
  }
  if (p.candidates.empty()) {
    return Error{fmt::format(
        "--schedule auto: no schedule runs {} micro-batches over {} devices "
        "with {} stages a device ({})",
        options.micro_batches, options.devices, options.virtual_stages, p.skipped.front().why)};
  }
  // Timing and peaks with the checks off, on the workers (Note [Parallel simulations]).
  planning::for_each_parallel(
      p.candidates.size(), planning::workers_for(options.jobs),
      [&](std::size_t i) { run_candidate(p.candidates[i], model, device, options.faults, false); });
  p.simulations = static_cast<std::int64_t>(p.candidates.size());
  const auto within = [&](const PipelineCandidate& c) {
    return !c.failure && !c.peak_reserved.empty() && c.max_reserved <= p.planned_budget;
  };
  std::optional<SimTime> best_uniform;
  for (PipelineCandidate& c : p.candidates) {
    c.fits = within(c);
    if (c.fits && (!best_uniform || c.step_time < *best_uniform)) best_uniform = c.step_time;
  }
  // Per-stage plans (Note [Per-stage plans]), one schedule after another.
  probe_failures(p, model, device);
  const std::size_t uniform_count = p.candidates.size();
  for (const Schedule s : options.schedules) {
    bool skipped = false;
    for (const SkippedSchedule& k : p.skipped) skipped = skipped || k.schedule == s;
    if (!skipped) per_stage_plan(p, model, device, s);
  }
  for (std::size_t i = uniform_count; i < p.candidates.size(); ++i) {
    PipelineCandidate& c = p.candidates[i];
    c.slower = within(c) && best_uniform && c.step_time > *best_uniform;
    c.fits = within(c) && !c.slower;
  }
  const std::optional<std::size_t> chosen = choose_checked(p, model, device);
  if (!chosen) return refusal(p, device, floor);
  p.chosen = *chosen;
  return p;
}

std::string pipeline_plan_text(const PipelinePlan& p, const Model& model,
                               const DeviceProfile& device) {
  const PipelinePlanOptions& o = p.options;
  const PipelineCandidate& c = p.candidates[p.chosen];
  std::string out = fmt::format(
      "ferry plan: {} on {}, pipeline over {} devices, {} micro-batches{}, budget {} peak "
      "reserved a stage",
      model.name, device.name, o.devices, o.micro_batches,
      o.virtual_stages > 1 ? fmt::format(", {} stages a device", o.virtual_stages) : std::string(),
      format_bytes(o.budget));
  if (o.margin_permille > 0) {
    out += fmt::format(", planned to {} (margin {})", format_bytes(p.planned_budget),
                       margin_text(o.margin_permille));
  }
  out += "\n" + schedule_reason(p) + "\n";
  out += fmt::format("plan: {}\n", c.name);
  if (!c.stage_configs.empty()) {
    out += "stage configurations:";
    for (std::size_t d = 0; d < c.stage_configs.size(); ++d) {
      out += fmt::format("{} gpu{} {}", d == 0 ? "" : ",", d, c.stage_configs[d]);
    }
    out += "\n";
  }
  out += fmt::format("step time: {} ({} per micro-batch), bubble {}\n", format_time(c.step_time),
                     format_time(SimTime(c.step_time.ns() / std::max(1, o.micro_batches))),
                     bubble_text(c));
  out += fmt::format("binding stage: gpu{}, peak reserved {}\n", c.binding,
                     format_bytes(c.max_reserved));
  out += fmt::format("split {}: {}\n", p.split,
                     stage_spans_text(p.stages, c.options.schedule, o.devices));
  out += "stage peaks reserved (allocated, micro-batches in flight):";
  for (std::size_t d = 0; d < c.peak_reserved.size(); ++d) {
    out += fmt::format("{} gpu{} {} ({}, {})", d == 0 ? "" : ",", d,
                       format_bytes(c.peak_reserved[d]), format_bytes(c.peak_allocated[d]),
                       d < c.peak_in_flight.size() ? c.peak_in_flight[d] : 0);
  }
  out += "\n";
  out += fmt::format("recompute {}, offloaded (D2H, all stages) {}\n",
                     format_time(c.recompute_time), format_bytes(c.d2h));
  if (p.best_fixed) {
    const PipelineCandidate& f = p.candidates[*p.best_fixed];
    out += fmt::format("best fixed row that fits: {}, {} (binding stage gpu{}, {})\n", f.name,
                       format_time(f.step_time), f.binding, format_bytes(f.max_reserved));
  } else {
    out += "best fixed row that fits: none of them fits\n";
  }
  out += fmt::format(
      "hazards: {} (the plan's run checked: hazard checker and content checks on); {} "
      "simulations\n",
      c.hazards, p.simulations);
  out += "configurations (step, binding stage's peak reserved):\n";
  for (const PipelineCandidate& k : p.candidates) {
    std::string note;
    if (k.failure) {
      note = "failed: " + first_line(k.failure->message);
    } else if (k.checked && k.hazards > 0) {
      note = fmt::format("{} hazards", k.hazards);
    } else {
      note = k.fits ? "fits" : k.slower ? "fits, slower than the uniform plan" : "over budget";
    }
    if (!k.probe_reserved.empty()) {
      note += fmt::format(
          " (on {}x the memory: {}, binding stage {})", kProbeScale, format_time(k.probe_step),
          format_bytes(*std::max_element(k.probe_reserved.begin(), k.probe_reserved.end())));
    }
    if (&k == &c) note += ", the plan";
    if (k.fixed) note += ", fixed row";
    out += fmt::format("  {:<46} {:>9} {:>11} {:>5}  {}\n", k.name,
                       k.failure ? std::string("-") : format_time(k.step_time),
                       k.failure ? std::string("-") : format_bytes(k.max_reserved),
                       k.failure ? std::string("-") : fmt::format("gpu{}", k.binding), note);
  }
  return out;
}

nlohmann::ordered_json pipeline_plan_json(const PipelinePlan& p, const Model& model,
                                          const DeviceProfile& device) {
  const PipelinePlanOptions& o = p.options;
  Json j;
  j["format"] = "ferry.pipeline-plan/1";
  j["model"] = model.name;
  j["device"] = device.name;
  j["device_memory_bytes"] = device.memory.count();
  j["devices"] = o.devices;
  j["micro_batches"] = o.micro_batches;
  j["virtual_stages"] = o.virtual_stages;
  j["split"] = p.split;
  Json stages = Json::array();
  for (std::size_t s = 0; s < p.stages.size(); ++s) {
    const StageSpan& span = p.stages[s];
    stages.push_back(
        {{"stage", s},
         {"device", pipeline::rank_of_stage(p.candidates[p.chosen].options.schedule,
                                            static_cast<std::uint32_t>(s),
                                            static_cast<std::uint32_t>(std::max(1, o.devices)))},
         {"first_op", span.begin},
         {"end_op", span.end},
         {"first_layer", span.first_layer},
         {"last_layer", span.last_layer}});
  }
  j["stages"] = std::move(stages);
  Json schedules = Json::array();
  for (const Schedule s : o.schedules) schedules.push_back(pipeline::schedule_name(s));
  j["schedules"] = std::move(schedules);
  j["schedule_defaulted"] = o.schedule_defaulted;
  j["budget_bytes"] = o.budget.count();
  j["margin_permille"] = o.margin_permille;
  j["planned_budget_bytes"] = p.planned_budget.count();
  j["plan"] = candidate_json(p.candidates[p.chosen]);
  j["schedule_reason"] = schedule_reason(p);
  j["best_fixed"] = p.best_fixed ? Json(p.candidates[*p.best_fixed].name) : Json(nullptr);
  Json skipped = Json::array();
  for (const SkippedSchedule& k : p.skipped) {
    Json s;
    s["schedule"] = pipeline::schedule_name(k.schedule);
    s["why"] = k.why;
    skipped.push_back(std::move(s));
  }
  j["skipped_schedules"] = std::move(skipped);
  j["simulations"] = p.simulations;
  Json all = Json::array();
  for (const PipelineCandidate& k : p.candidates) all.push_back(candidate_json(k));
  j["configurations"] = std::move(all);
  return j;
}

}  // namespace ferry::sim
