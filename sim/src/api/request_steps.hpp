#pragma once
// Private to the request layer: the steps the run requests (requests.cpp) and the plan request
// (plan_request.cpp) share, and the bounds check of every request's numbers
// (request_values.cpp).

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "ferry/result.hpp"
#include "ferry/sim/api/requests.hpp"
#include "ferry/sim/workload/rank_workload.hpp"

namespace ferry::sim::api {

// `option`'s `value` within lo..hi, or the error that says it is not (Note [One check for both
// edges]).
Status in_bounds(std::string_view option, std::int64_t value, std::int64_t lo, std::int64_t hi);

// The first error of `checks`, or Ok.
Status first_error(std::initializer_list<Status> checks);

// The model of `target` on its device, read and checked.
Result<Workload> load(const Target& target);

// The allocator `asked`, else the model file's, else default.
AllocatorMode allocator_of(const std::optional<AllocatorMode>& asked, const Model& model);

// The workload one GPU of `mesh` runs (rank_workload: cut by `axes`, checked and timed once);
// with nothing cut, the whole model's timing errors name the model as `spec`, as its reading
// errors do.
Result<Workload> rank_of(const Workload& whole, const Mesh& mesh, std::string_view spec,
                         CutAxes axes = {});

// The training options a request asks for, with its parallelism apart: that is checked
// against the device once, where the run that uses it is chosen (Mesh::make), and the runs
// take it as checked.
struct AskedRun {
  TrainingOptions base;  // its parallelism off
  Parallelism parallelism;
  std::optional<Mesh> checked{};            // the rank's cut was made under, if any
  std::optional<TrainerSetting> trainer{};  // `--for T`: the setting its flags ask for
};

// The training options `k` asks for on `model` (the model file's parallelism and allocator
// where `k` leaves them), checked; with `simulate`, its checkpoint plan, side streams and
// horizon too.
Result<AskedRun> training_options(RunKnobs k, const Model& model, const SimulateRequest* simulate);

// `p` checked against the device, its errors naming the flags, as `fsdp`'s parallelism; taken
// as it is where the rank's cut was made under it (`cut_under`, checked then).
Status choose_parallelism(ParallelOptions& fsdp, const Parallelism& p, const DeviceProfile& device,
                          const std::optional<Mesh>& cut_under = std::nullopt);

// What a pipeline of `p.pp` stages refuses of the mesh each stage runs on (Note [A pipeline on
// the mesh]): resharding to K ranks, and SimpleFSDP.
Status pipeline_mesh_allowed(const Parallelism& p);

// `what` refused of a pipeline of `p.pp` stages, naming --pp.
std::string pipeline_refusal(std::string_view what, const Parallelism& p);

// The mesh a pipeline's stage runs: `p`, its gathered parameters kept for the step.
Parallelism stage_parallelism(Parallelism p);

// The line after a pipeline's report on a mesh of `p.pp` stages: its GPUs in all (empty without
// a mesh).
std::string stages_text(const Parallelism& p);

// A trainer setting's row, as `ferry simulate --for T` and `ferry plan --for T` name it.
std::string trainer_row_name(const TrainerSetting& setting);

}  // namespace ferry::sim::api
