// `ferry simulate`: training steps of a model under one offload policy and checkpoint plan, on
// one device or a GPipe pipeline; or, with --plan, a plan written by `ferry plan`.

#include <fmt/format.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "command.hpp"
#include "ferry/offload/options.hpp"
#include "ferry/sim/export/trace.hpp"
#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/planner/lower.hpp"
#include "ferry/sim/report/tables.hpp"
#include "ferry/sim/runs/horizon.hpp"
#include "io.hpp"
#include "run_options.hpp"

namespace ferry::cli {
namespace {

class SimulateCommand final : public Command {
 public:
  explicit SimulateCommand(CLI::App* cmd) : Command(cmd) { add_run_options(cmd, a_, true); }

  [[nodiscard]] int run() const override;

 private:
  // The plan in the file at a_.plan, replayed on `w`.
  [[nodiscard]] int replay_plan(const sim::Workload& w, const sim::TrainingOptions& base,
                                const sim::RunSpec& spec) const;
  [[nodiscard]] int run_pipeline(const sim::Workload& w, const sim::TrainingOptions& base) const;
  [[nodiscard]] int run_one_device(const sim::Workload& w, const sim::RunSpec& spec) const;
  // Writes the kept run's trace and memory snapshot where asked; 0 or the exit code.
  [[nodiscard]] int write_files(const std::optional<sim::TrainingRun>& run) const;

  RunArgs a_;
};

int SimulateCommand::run() const {
  auto workload = sim::load_workload(a_.model, a_.device, a_.scenarios);
  if (!workload) {
    fmt::print(stderr, "ferry simulate: error: {}\n", workload.error().message);
    return kExitBadInput;
  }
  sim::RunSpec spec = a_.run;
  sim::adopt_model_parallelism(spec.fsdp, workload.value().model, a_.devices);
  sim::adopt_model_allocator(spec.allocator, workload.value().model);
  auto base = sim::run_options(spec, workload.value().model, true);
  if (!base) {
    fmt::print(stderr, "ferry simulate: error: {}\n", base.error().message);
    return kExitBadInput;
  }
  if (!a_.plan.empty()) return replay_plan(workload.value(), base.value(), spec);
  if (a_.devices > 1) return run_pipeline(workload.value(), base.value());
  return run_one_device(workload.value(), spec);
}

int SimulateCommand::replay_plan(const sim::Workload& w, const sim::TrainingOptions& base,
                                 const sim::RunSpec& spec) const {
  auto text = sim::read_input(a_.plan, "plan");
  if (!text) {
    fmt::print(stderr, "ferry simulate: error: {}\n", text.error().message);
    return kExitBadInput;
  }
  auto plan = sim::parse_plan(text.value(), a_.plan);
  if (!plan) {
    fmt::print(stderr, "ferry simulate: error: {}\n", plan.error().message);
    return kExitBadInput;
  }
  // The plan's parallelism where neither the command line nor the model file gave one.
  sim::TrainingOptions options = base;
  sim::FsdpSpec adopted = spec.fsdp;
  sim::adopt_parallelism(adopted, plan.value().parallelism);
  if (adopted.ranks != spec.fsdp.ranks) {
    auto fsdp = sim::parallelism_of(adopted);
    if (fsdp) {
      if (auto valid = sim::validate_parallelism(fsdp.value(), w.device, sim::kFsdpFlags); !valid) {
        fsdp = valid.error();
      }
    }
    if (!fsdp) {
      fmt::print(stderr, "ferry simulate: error: {}: parallelism: {}\n", a_.plan,
                 fsdp.error().message);
      return kExitBadInput;
    }
    options.fsdp.parallelism = fsdp.value();
  } else if (auto valid =
                 sim::validate_parallelism(options.fsdp.parallelism, w.device, sim::kFsdpFlags);
             !valid) {
    fmt::print(stderr, "ferry simulate: error: {}\n", valid.error().message);
    return kExitBadInput;
  }
  auto row = sim::replay_plan(plan.value(), w.model, w.device, options);
  if (!row) {
    fmt::print(stderr, "ferry simulate: error: {}: {}\n", a_.plan, row.error().message);
    return kExitBadInput;
  }
  row.value().name = "plan " + a_.plan;
  // The report names the command line's parallelism over the plan's.
  const auto named = sim::parallelism_of(adopted);
  const Parallelism parallelism = named ? named.value() : Parallelism{};
  print(a_.json ? sim::with_fsdp_json(sim::simulate_json(row.value(), w.model, w.device),
                                      parallelism, w.device)
                : sim::simulate_text(row.value(), w.model, w.device) +
                      fsdp_line(parallelism, w.device));
  return row.value().hazards == 0 && !row.value().failure ? 0 : kExitFailed;
}

int SimulateCommand::run_pipeline(const sim::Workload& w, const sim::TrainingOptions& base) const {
  // What draws or replays one device's run is refused rather than silently missing.
  const auto refuse = [&](std::string_view what) {
    fmt::print(stderr, "ferry simulate: error: {} (--devices {})\n", what, a_.devices);
    return kExitBadInput;
  };
  if (base.side.any()) {
    return refuse(
        "--side-streams applies to a single-device run; a pipeline runs one compute stream per "
        "device");
  }
  if (base.sim.allocator != sim::AllocatorMode::Default) {
    return refuse(
        "--allocator expandable applies to a single-device or FSDP run; a pipeline "
        "runs the default allocator");
  }
  if (!a_.trace.empty())
    return refuse("--trace draws a single-device run; a pipeline has no trace yet");
  if (!a_.memory_snapshot.empty()) {
    return refuse(
        "--memory-snapshot records a single-device run; a pipeline has no memory snapshot yet");
  }
  auto mode = sim::parse_checkpoint_mode(a_.pipeline_checkpoint);
  if (!mode) {
    fmt::print(stderr, "ferry simulate: error: --pipeline-checkpoint: {}\n", mode.error().message);
    return kExitBadInput;
  }
  sim::PipelineOptions o;
  o.devices = a_.devices;
  o.micro_batches = a_.micro_batches;
  o.checkpoint = mode.value();
  o.sim = base.sim;
  o.offload = base.offload;
  const auto policy = parse_policy(a_.run.policy);
  if (!policy) {
    fmt::print(stderr, "ferry simulate: error: unknown policy \"{}\" ({})\n", a_.run.policy,
               sim::kPolicyNames);
    return kExitBadInput;
  }
  o.offload.policy = *policy;
  const auto row = sim::run_pipeline_row(w.model, w.device, sim::pipeline_row_name(o), o);
  if (row.failure && row.step_time.ns() == 0) {
    fmt::print(stderr, "ferry simulate: error: {}\n", row.failure->message);
    return kExitBadInput;
  }
  print(a_.json ? sim::pipeline_document({row}) : sim::pipeline_text({row}));
  return row.hazards == 0 && !row.failure ? 0 : kExitFailed;
}

int SimulateCommand::run_one_device(const sim::Workload& w, const sim::RunSpec& spec) const {
  if (const std::string why = a_.memory_snapshot.empty() ? "" : unwritable(a_.memory_snapshot);
      !why.empty()) {
    fmt::print(stderr, "ferry simulate: error: --memory-snapshot: {}\n", why);
    return kExitBadInput;
  }
  std::optional<sim::TrainingRun> run;
  const bool keep = !a_.trace.empty() || !a_.memory_snapshot.empty();
  const auto result =
      sim::simulate_one(w, spec, keep ? &run : nullptr, !a_.memory_snapshot.empty());
  if (!result) {
    fmt::print(stderr, "ferry simulate: error: {}\n", result.error().message);
    return kExitBadInput;
  }
  // simulate_one ran it: the parallelism is one.
  const Parallelism parallelism = sim::parallelism_of(spec.fsdp).value();
  const std::string out =
      a_.json ? sim::with_fsdp_json(sim::simulate_json(result.value(), w.model, w.device),
                                    parallelism, w.device)
              : sim::simulate_text(result.value(), w.model, w.device) +
                    fsdp_line(parallelism, w.device);
  if (const int rc = write_files(run)) return rc;
  print(out);
  return result.value().hazards == 0 && !result.value().failure ? 0 : kExitFailed;
}

int SimulateCommand::write_files(const std::optional<sim::TrainingRun>& run) const {
  if (!a_.trace.empty()) {
    if (!run) {
      fmt::print(stderr, "ferry simulate: no trace written to {}: the run did not complete\n",
                 a_.trace);
    } else if (!write_output(a_.trace, sim::chrome_trace(run->sim))) {
      fmt::print(stderr, "ferry simulate: error: cannot write trace to {}\n", a_.trace);
      return kExitBadInput;
    }
  }
  if (!a_.memory_snapshot.empty()) {
    if (!run) {
      fmt::print(stderr,
                 "ferry simulate: no memory snapshot written to {}: the run did not start\n",
                 a_.memory_snapshot);
    } else if (const int rc =
                   write_memory_snapshot(run->sim, a_.memory_snapshot, "simulate", a_.json)) {
      return rc;
    }
  }
  return 0;
}

}  // namespace

std::unique_ptr<Command> add_simulate_command(CLI::App& app) {
  return std::make_unique<SimulateCommand>(app.add_subcommand(
      "simulate", "Simulate training steps of a model under one offload policy"));
}

}  // namespace ferry::cli
