// `ferry compare`: the fixed configurations (no offload, checkpointing, each policy) of a model
// side by side, and with --devices N the pipeline configurations too.

#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

#include "command.hpp"
#include "ferry/sim/report/tables.hpp"
#include "ferry/sim/runs/configurations.hpp"
#include "io.hpp"
#include "run_options.hpp"

namespace ferry::cli {
namespace {

class CompareCommand final : public Command {
 public:
  explicit CompareCommand(CLI::App* cmd) : Command(cmd) { add_run_options(cmd, a_, false); }

  [[nodiscard]] int run() const override;

 private:
  RunArgs a_;
};

int CompareCommand::run() const {
  auto workload = sim::load_workload(a_.model, a_.device, a_.scenarios);
  if (!workload) {
    fmt::print(stderr, "ferry compare: error: {}\n", workload.error().message);
    return kExitBadInput;
  }
  const sim::Model& model = workload.value().model;
  const sim::DeviceProfile& device = workload.value().device;
  sim::RunSpec spec = a_.run;
  sim::adopt_model_parallelism(spec.fsdp, model, a_.devices);
  sim::adopt_model_allocator(spec.allocator, model);
  auto base = sim::run_options(spec, model, false);
  if (base) {
    if (auto valid =
            sim::validate_parallelism(base.value().fsdp.parallelism, device, sim::kFsdpFlags);
        !valid) {
      base = valid.error();
    }
  }
  if (base && a_.devices > 1 && base.value().sim.allocator != sim::AllocatorMode::Default) {
    base = Error{fmt::format(
        "--allocator expandable applies to a single-device or FSDP run; a pipeline runs the "
        "default allocator (--devices {})",
        a_.devices)};
  }
  if (!base) {
    fmt::print(stderr, "ferry compare: error: {}\n", base.error().message);
    return kExitBadInput;
  }
  const Parallelism& parallelism = base.value().fsdp.parallelism;
  bool clean = true;
  std::vector<sim::RowResult> rows;
  for (const auto& row : sim::default_rows(base.value(), model, device)) {
    if (!a_.json) fmt::print(stderr, "simulating {} ...\n", row.name);
    rows.push_back(sim::run_row(model, device, row));
    clean = clean && rows.back().hazards == 0;
  }
  std::vector<sim::PipelineRow> pipeline;
  if (a_.devices > 1) {
    if (!a_.json) fmt::print(stderr, "simulating pipelines ...\n");
    pipeline = sim::pipeline_rows(model, device, a_.devices, a_.micro_batches);
    for (const auto& p : pipeline) clean = clean && p.hazards == 0;
  }
  if (a_.json) {
    print(
        sim::with_fsdp_json(sim::compare_json(rows, model, device, pipeline), parallelism, device));
  } else {
    print(sim::compare_text(rows, model, device) +
          (pipeline.empty() ? "" : "\n" + sim::pipeline_text(pipeline)) +
          fsdp_line(parallelism, device));
  }
  return clean ? 0 : kExitFailed;
}

}  // namespace

std::unique_ptr<Command> add_compare_command(CLI::App& app) {
  return std::make_unique<CompareCommand>(app.add_subcommand(
      "compare", "Compare offload policies on a model: time and memory as ratios to none"));
}

}  // namespace ferry::cli
