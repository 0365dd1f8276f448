// GPipe on random small models, 1-4 devices, 1-4 micro-batches, every checkpoint mode and
// random skip connections, without offload and with trl or ferry offloading in every stage.
// For every run: every buffer a portal held is freed right after its last use; no hazard;
// every kernel reads what it should; parameter gradients equal the single-device run's. Each
// planted fault (RNG restore dropped, a portal copy wait dropped, a wrong tensor life, and
// under offload each dropped offload synchronization) must be caught with a small shrunk
// counterexample.

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/sim/autograd/pipeline.hpp"
#include "prop/planted.hpp"
#include "sim_fixtures.hpp"

namespace ferry::sim {
namespace {

// One op of a random model. Op k reads the previous op's main output (the batch for op 0).
struct OpChoice {
  std::uint32_t older = 0;  ///< 0: nothing more; n: also read the main output n + 1 ops back
  std::uint32_t size = 0;   ///< main output size class
  std::uint32_t flags = 0;  ///< bits: draws rng (and outputs a mask), reads a weight, saves its
                            ///< inputs, saves its output, the next op reads a view of the output
  std::uint32_t time = 0;   ///< duration class
};

void showValue(const OpChoice& c, std::ostream& os) {
  os << "{older " << c.older << ", size " << c.size << ", flags " << c.flags << ", time " << c.time
     << "}";
}

struct Case {
  std::vector<OpChoice> ops;
  std::vector<std::uint32_t> skips;  ///< picks among the (tensor, reader) pairs, modulo their count
  std::int32_t devices = 1;
  std::int32_t micro_batches = 1;
  CheckpointMode mode = CheckpointMode::Never;
  std::int64_t launch_ns = 0;    ///< host cost of every API call: shifts device timing
  Policy policy = Policy::None;  ///< every stage's offload policy
  std::int64_t min_bytes = 0;    ///< smaller saved tensors stay
  std::int64_t window = 0;       ///< ferry: forward window and prefetch bytes
  Schedule schedule = Schedule::GPipe;
  std::int32_t virtual_stages = 1;  ///< interleaved 1F1B: stages a device
};

void showValue(const Case& c, std::ostream& os) {
  os << "ops [";
  for (std::size_t k = 0; k < c.ops.size(); ++k) {
    os << (k ? ", " : "");
    showValue(c.ops[k], os);
  }
  os << "], skip picks [";
  for (std::size_t s = 0; s < c.skips.size(); ++s) os << (s ? ", " : "") << c.skips[s];
  os << "], " << c.devices << " device(s), " << c.micro_batches << " micro-batch(es), checkpoint "
     << checkpoint_mode_name(c.mode) << ", launch " << c.launch_ns << " ns";
  if (c.schedule != Schedule::GPipe) {
    os << ", " << schedule_name(c.schedule) << " with " << c.virtual_stages << " stage(s) a device";
  }
  if (c.policy != Policy::None) {
    os << ", offload " << policy_name(c.policy) << " min " << c.min_bytes << " window " << c.window;
  }
}

constexpr std::uint32_t kRng = 1;
constexpr std::uint32_t kWeight = 2;
constexpr std::uint32_t kSaveInputs = 4;
constexpr std::uint32_t kSaveOutput = 8;
constexpr std::uint32_t kView = 16;

Model build_model(const std::vector<OpChoice>& choices) {
  Model m;
  m.name = "random";
  auto tensor = [&](std::string name, std::int64_t bytes, TensorRole role) {
    m.tensors.push_back(ModelTensor{std::move(name), Bytes(bytes), DType::BF16, role, -1, Bytes(0),
                                    false, Bytes(0), 0});
    return static_cast<std::uint32_t>(m.tensors.size() - 1);
  };
  std::vector<std::uint32_t> mains;  // main output of each op so far
  std::uint32_t next_read = tensor("x", 1024, TensorRole::Input);
  for (std::uint32_t k = 0; k < choices.size(); ++k) {
    const OpChoice& c = choices[k];
    ModelOp op;
    op.name = "op" + std::to_string(k);
    op.duration = SimTime(1000 * (1 + c.time));
    op.backward_duration = SimTime(2000 * (1 + c.time));
    op.inputs.push_back(next_read);
    if (c.older > 0 && mains.size() > c.older) {
      op.inputs.push_back(mains[mains.size() - 1 - c.older]);
    }
    if ((c.flags & kWeight) != 0) {
      op.inputs.push_back(tensor("w" + std::to_string(k), 512, TensorRole::Param));
    }
    const std::uint32_t out =
        tensor("h" + std::to_string(k), 512 * (1 + c.size), TensorRole::Activation);
    op.outputs.push_back(out);
    if ((c.flags & kRng) != 0) {
      op.draws_rng = true;
      const std::uint32_t mask = tensor("mask" + std::to_string(k), 256, TensorRole::Activation);
      op.outputs.push_back(mask);
      op.saved.push_back(mask);
    }
    if ((c.flags & kSaveInputs) != 0) {
      for (const std::uint32_t t : op.inputs) op.saved.push_back(t);
    }
    if ((c.flags & kSaveOutput) != 0) op.saved.push_back(out);
    next_read = out;
    if ((c.flags & kView) != 0) {
      const std::uint32_t view =
          tensor("h" + std::to_string(k) + ".half", 256 * (1 + c.size), TensorRole::Activation);
      m.tensors[view].view_of = static_cast<std::int32_t>(out);
      m.tensors[view].view_offset = Bytes(256 * (1 + c.size));
      op.outputs.push_back(view);
      next_read = view;
    }
    m.ops.push_back(std::move(op));
    mains.push_back(out);
  }
  const std::uint32_t labels = tensor("labels", 64, TensorRole::Input);
  const std::uint32_t loss = tensor("loss", 4, TensorRole::Activation);
  ModelOp head;
  head.name = "loss";
  head.duration = SimTime(500);
  head.backward_duration = SimTime(500);
  head.inputs = {next_read, labels};
  head.outputs = {loss};
  head.saved = {next_read, labels};
  m.ops.push_back(std::move(head));
  m.loss = loss;
  return m;
}

// The skips a case picks: each pick names one (activation, reader) pair of the model.
std::vector<SkipConnection> pick_skips(const Model& m, const std::vector<std::uint32_t>& picks) {
  std::vector<SkipConnection> pairs;
  for (std::uint32_t k = 0; k < m.ops.size(); ++k) {
    for (const std::uint32_t t : m.ops[k].inputs) {
      const ModelTensor& tensor = m.tensors[t];
      if (tensor.role != TensorRole::Activation || tensor.view_of >= 0) continue;
      const SkipConnection pair{t, k};
      if (std::find(pairs.begin(), pairs.end(), pair) == pairs.end()) pairs.push_back(pair);
    }
  }
  std::vector<SkipConnection> skips;
  if (pairs.empty()) return skips;
  for (const std::uint32_t pick : picks) {
    const SkipConnection s = pairs[pick % pairs.size()];
    if (std::find(skips.begin(), skips.end(), s) == skips.end()) skips.push_back(s);
  }
  return skips;
}

std::string describe(const Model& m, const std::vector<SkipConnection>& skips,
                     const std::vector<std::uint32_t>& starts) {
  std::ostringstream out;
  for (std::uint32_t k = 0; k < m.ops.size(); ++k) {
    const ModelOp& op = m.ops[k];
    const auto part = std::upper_bound(starts.begin(), starts.end(), k) - starts.begin() - 1;
    out << "  gpu" << part << " " << op.name << (op.draws_rng ? " [rng]" : "") << ": in";
    for (const auto t : op.inputs) out << " " << m.tensors[t].name;
    out << " -> out";
    for (const auto t : op.outputs) out << " " << m.tensors[t].name;
    out << "; saves";
    for (const auto t : op.saved) out << " " << m.tensors[t].name;
    out << "\n";
  }
  for (const SkipConnection& s : skips) {
    out << "  skip " << m.tensors[s.tensor].name << " -> " << m.ops[s.consumer].name << "\n";
  }
  return out.str();
}

rc::Gen<OpChoice> gen_op() {
  return rc::gen::apply(
      [](std::uint32_t older, std::uint32_t size, std::uint32_t flags, std::uint32_t time) {
        return OpChoice{older, size, flags, time};
      },
      rc::gen::inRange<std::uint32_t>(0, 4), rc::gen::inRange<std::uint32_t>(0, 4),
      rc::gen::inRange<std::uint32_t>(0, 32), rc::gen::inRange<std::uint32_t>(0, 4));
}

rc::Gen<Case> gen_case() {
  return rc::gen::apply(
      [](std::vector<OpChoice> ops, std::vector<std::uint32_t> skips, std::int32_t devices,
         std::int32_t micro_batches, std::uint32_t mode, std::int64_t launch) {
        Case c;
        c.ops = std::move(ops);
        c.skips = std::move(skips);
        // Every partition needs an op: the model has the choices plus the loss.
        c.devices = std::min<std::int32_t>(devices, static_cast<std::int32_t>(c.ops.size()) + 1);
        c.micro_batches = micro_batches;
        c.mode = mode == 0   ? CheckpointMode::Never
                 : mode == 1 ? CheckpointMode::ExceptLast
                             : CheckpointMode::Always;
        c.launch_ns = launch;
        return c;
      },
      rc::gen::resize(12, rc::gen::container<std::vector<OpChoice>>(gen_op())),
      rc::gen::resize(6, rc::gen::container<std::vector<std::uint32_t>>(
                             rc::gen::inRange<std::uint32_t>(0, 64))),
      rc::gen::inRange<std::int32_t>(1, 5), rc::gen::inRange<std::int32_t>(1, 5),
      rc::gen::inRange<std::uint32_t>(0, 3), rc::gen::element<std::int64_t>(0, 500, 3000));
}

// A case under torch's 1F1B, interleaved 1F1B, interleaved zero bubble or ZBV: no skips (portals
// are GPipe's), and counts the schedule takes (1F1B: at least as many micro-batches as devices;
// interleaved: 2 devices or more, 2 or 3 stages each, 1 to 3 under zero bubble, micro-batches a
// multiple of the rounds; ZBV: 2 stages a device, any micro-batches), the offload policy none,
// trl or ferry (none under the zero-bubble schedules).
rc::Gen<Case> gen_schedule_case() {
  return rc::gen::apply(
      [](Case c, std::uint32_t kind, std::int32_t v, std::uint32_t policy) {
        c.skips.clear();
        const auto parts = static_cast<std::int32_t>(c.ops.size()) + 1;
        const bool zero_bubble = kind == 2;
        if (kind == 3 && parts >= 2) {
          c.schedule = Schedule::ZeroBubbleV;
          c.virtual_stages = 2;
          c.devices = std::max(1, std::min(c.devices, parts / 2));
        } else if (kind > 0 && parts >= 4) {
          c.schedule = zero_bubble ? Schedule::InterleavedZeroBubble : Schedule::Interleaved1F1B;
          c.virtual_stages = std::min(zero_bubble ? v - 1 : v, parts / 2);
          c.devices = std::max(2, std::min(c.devices, parts / c.virtual_stages));
          // Below the devices one round; from them on, a multiple of the devices.
          if (c.micro_batches >= c.devices) c.micro_batches = c.devices;
        } else {
          c.schedule = Schedule::OneFOneB;
          c.micro_batches = std::max(c.micro_batches, c.devices);
        }
        c.policy = policy == 0 || pipeline::splits_backward(c.schedule) ? Policy::None
                   : policy == 1                                        ? Policy::Trl
                                                                        : Policy::Ferry;
        c.min_bytes = 600;
        c.window = 4096;
        return c;
      },
      gen_case(), rc::gen::inRange<std::uint32_t>(0, 4), rc::gen::inRange<std::int32_t>(2, 4),
      rc::gen::inRange<std::uint32_t>(0, 3));
}

// A case whose stages offload: trl or ferry, with small thresholds and windows so that
// tensors are offloaded, guarded and reloaded while later ones are packed.
rc::Gen<Case> gen_offload_case() {
  return rc::gen::apply(
      [](Case c, bool trl, std::int64_t min_bytes, std::int64_t window) {
        c.policy = trl ? Policy::Trl : Policy::Ferry;
        c.min_bytes = min_bytes;
        c.window = window;
        return c;
      },
      gen_case(), rc::gen::arbitrary<bool>(), rc::gen::element<std::int64_t>(0, 600, 1024),
      rc::gen::element<std::int64_t>(512, 4096, 1 << 20));
}

DeviceProfile profile(const Case& c) {
  DeviceProfile p = testing::simple_profile();
  const SimTime launch(c.launch_ns);
  p.overheads = LaunchOverheads{launch, launch, launch, launch, launch,
                                launch, launch, launch, launch, launch};
  return p;
}

struct Runs {
  Model model;
  std::vector<SkipConnection> skips;
  PipelineRun pipeline;
  PipelineRun reference;
};

Runs run_case(const Case& c, const PipelineFaults& faults) {
  Model model = build_model(c.ops);
  std::vector<SkipConnection> skips = pick_skips(model, c.skips);
  PipelineOptions o;
  o.devices = c.devices;
  o.micro_batches = c.micro_batches;
  o.schedule = c.schedule;
  o.virtual_stages = c.virtual_stages;
  o.checkpoint = c.mode;
  o.skips = skips;
  o.offload.policy = c.policy;
  o.offload.min_bytes = Bytes(c.min_bytes);
  o.offload.window_bytes = Bytes(c.window);
  o.offload.prefetch_bytes = Bytes(c.window);
  auto pipeline = simulate_pipeline(model, profile(c), o, faults);
  auto reference = simulate_reference(model, profile(c), o);
  RC_ASSERT(pipeline.ok());
  RC_ASSERT(reference.ok());
  RC_LOG() << describe(model, skips, pipeline.value().partition_starts);
  RC_ASSERT(!reference.value().failure);
  return Runs{std::move(model), std::move(skips), std::move(pipeline).value(),
              std::move(reference).value()};
}

void step_completed(const PipelineRun& run) {
  if (run.failure) RC_FAIL("the step failed: " + run.failure->message);
}

// Every buffer a portal held is freed by the step, and only frees and record_stream calls lie
// between its last kernel or copy and its free.
void portals_freed_after_last_use(const PipelineRun& run) {
  step_completed(run);
  for (const PortalLifetime& l : run.portal_lifetimes) {
    const std::string name = "skip " + std::to_string(l.key.skip) + " of micro-batch " +
                             std::to_string(l.key.micro_batch) + (l.gradient ? " (grad)" : "");
    if (!l.freed.valid() || l.freed_at_step_end) RC_FAIL(name + " was held past its last use");
    RC_ASSERT(l.last_use.valid());
    RC_ASSERT(l.last_use < l.freed);
    for (std::uint32_t op = l.last_use.value() + 1; op < l.freed.value(); ++op) {
      const OpKind kind = run.sim.ops()[op].kind;
      if (kind != OpKind::Free && kind != OpKind::RecordStream) {
        RC_FAIL(name + ": " + std::string(run.sim.label(run.sim.ops()[op].label)) +
                " ran between its last use and its free");
      }
    }
  }
  RC_ASSERT(run.portal_stats.live == 0);
  RC_ASSERT(run.portal_frees == static_cast<std::int64_t>(run.portal_lifetimes.size()));
  RC_ASSERT(run.buffers_left == 0);
}

void no_hazard(const PipelineRun& run) {
  step_completed(run);
  if (run.hazards().empty()) return;
  const Hazard& h = run.hazards().front();
  RC_FAIL("hazard (kind " + std::to_string(static_cast<int>(h.kind)) + ") between " +
          std::string(run.sim.label(run.sim.ops()[h.first.value()].label)) + " and " +
          std::string(run.sim.label(run.sim.ops()[h.second.value()].label)));
}

void no_content_mismatch(const PipelineRun& run) {
  step_completed(run);
  if (run.content_mismatches().empty()) return;
  const ContentMismatch& m = run.content_mismatches().front();
  RC_FAIL("kernel " + std::string(run.sim.label(run.sim.ops()[m.kernel.value()].label)) +
          " read other bytes than expected");
}

void gradients_equal_reference(const Runs& runs) {
  step_completed(runs.pipeline);
  RC_ASSERT(!runs.pipeline.param_grads.empty() || runs.reference.param_grads.empty());
  RC_ASSERT(runs.pipeline.param_grads == runs.reference.param_grads);
}

RC_GTEST_PROP(PipelineProperty, PortalTensorsAreFreedRightAfterTheirLastUse, ()) {
  portals_freed_after_last_use(run_case(*gen_case(), {}).pipeline);
}

RC_GTEST_PROP(PipelineProperty, NoCrossDeviceHazard, ()) {
  no_hazard(run_case(*gen_case(), {}).pipeline);
}

RC_GTEST_PROP(PipelineProperty, EveryKernelReadsWhatWasComputed, ()) {
  const Runs runs = run_case(*gen_case(), {});
  no_content_mismatch(runs.pipeline);
  RC_ASSERT(runs.reference.content_mismatches().empty());
}

RC_GTEST_PROP(PipelineProperty, ParameterGradientsEqualTheSingleDeviceRun, ()) {
  gradients_equal_reference(run_case(*gen_case(), {}));
}

// Under offload in every stage, with or without checkpoint: all of the above at once.
void offload_is_safe(const Runs& runs) {
  no_hazard(runs.pipeline);
  no_content_mismatch(runs.pipeline);
  gradients_equal_reference(runs);
  portals_freed_after_last_use(runs.pipeline);
}

RC_GTEST_PROP(PipelineOffloadProperty, StagesOffloadWithoutHazardAndTrainAsOneDevice, ()) {
  offload_is_safe(run_case(*gen_offload_case(), {}));
}

RC_GTEST_PROP(PipelineOffloadProperty, StagesOffloadWhatTheirForwardSaves, ()) {
  const Case c = *gen_offload_case();
  const Runs runs = run_case(c, {});
  step_completed(runs.pipeline);
  RC_ASSERT(runs.pipeline.telemetry.size() == runs.pipeline.partition_starts.size() - 1);
  std::int64_t packed = 0;
  for (const OffloadTelemetry& t : runs.pipeline.telemetry) packed += t.packed;
  // Each saved entry naming a tensor its own partition produced, once per micro-batch whose
  // forward runs in grad mode; nothing that crossed devices, no parameter, no batch input.
  const Model& m = runs.model;
  const std::vector<std::uint32_t>& starts = runs.pipeline.partition_starts;
  const auto partition = [&](std::uint32_t op) {
    return std::upper_bound(starts.begin(), starts.end(), op) - starts.begin() - 1;
  };
  std::int64_t local_saves = 0;
  for (std::uint32_t k = 0; k < m.ops.size(); ++k) {
    for (const std::uint32_t t : m.ops[k].saved) {
      const std::int32_t view_of = m.tensors[t].view_of;
      const std::uint32_t base = view_of >= 0 ? static_cast<std::uint32_t>(view_of) : t;
      for (std::uint32_t p = 0; p < m.ops.size(); ++p) {
        const auto& outs = m.ops[p].outputs;
        if (std::find(outs.begin(), outs.end(), base) == outs.end()) continue;
        if (partition(p) == partition(k)) ++local_saves;
      }
    }
  }
  const std::int64_t grad_mode = c.mode == CheckpointMode::Never        ? c.micro_batches
                                 : c.mode == CheckpointMode::ExceptLast ? 1
                                                                        : 0;
  RC_ASSERT(packed == local_saves * grad_mode);
}

// Under 1F1B, interleaved 1F1B and zero bubble, with or without offload and checkpoint: no hazard,
// every kernel reads what was computed, the gradients equal the reference's, nothing left over.
RC_GTEST_PROP(PipelineScheduleProperty, TorchSchedulesAreSafeAndTrainAsOneDevice, ()) {
  const Runs runs = run_case(*gen_schedule_case(), {});
  no_hazard(runs.pipeline);
  no_content_mismatch(runs.pipeline);
  gradients_equal_reference(runs);
  RC_ASSERT(runs.pipeline.buffers_left == 0);
}

// Counts the op lines of a counterexample's model description.
std::size_t ops_in(const std::string& counterexample) {
  std::size_t ops = 0;
  for (std::size_t at = counterexample.find("\n  gpu"); at != std::string::npos;
       at = counterexample.find("\n  gpu", at + 1)) {
    ++ops;
  }
  return ops;
}

void expect_small(const std::string& fault, const std::string& found) {
  ASSERT_FALSE(found.empty()) << fault << " went unnoticed";
  EXPECT_LE(ops_in(found), 6U) << found;
  std::cout << "planted fault \"" << fault << "\", shrunk counterexample (" << ops_in(found)
            << " ops):\n"
            << found << "\n";
}

TEST(PlantedPipelineFault, DroppedRngRestoreChangesTheGradients) {
  PipelineFaults faults;
  faults.skip_rng_restore = true;
  expect_small("recompute without the RNG restore", ferry::testing::counterexample([&] {
                 gradients_equal_reference(run_case(*gen_case(), faults));
               }));
}

TEST(PlantedPipelineFault, DroppedRngRestoreIsAContentMismatch) {
  PipelineFaults faults;
  faults.skip_rng_restore = true;
  expect_small("recompute without the RNG restore (content)", ferry::testing::counterexample([&] {
                 no_content_mismatch(run_case(*gen_case(), faults).pipeline);
               }));
}

TEST(PlantedPipelineFault, DroppedPortalCopyWaitIsAHazard) {
  PipelineFaults faults;
  faults.skip_portal_copy_wait = true;
  expect_small("PortalCopy does not wait for the stash", ferry::testing::counterexample([&] {
                 no_hazard(run_case(*gen_case(), faults).pipeline);
               }));
}

TEST(PlantedPipelineFault, DroppedPortalArrivalWaitIsAHazard) {
  PipelineFaults faults;
  faults.skip_portal_arrival_wait = true;
  expect_small("the pop does not wait for PortalCopy", ferry::testing::counterexample([&] {
                 no_hazard(run_case(*gen_case(), faults).pipeline);
               }));
}

TEST(PlantedPipelineFault, DroppedReceiveWaitIsAHazard) {
  PipelineFaults faults;
  faults.skip_receive_wait = true;
  expect_small("a receive does not wait for the receiving compute stream",
               ferry::testing::counterexample(
                   [&] { no_hazard(run_case(*gen_schedule_case(), faults).pipeline); }));
}

TEST(PlantedPipelineFault, DroppedReceiveArrivalWaitIsAHazard) {
  PipelineFaults faults;
  faults.skip_receive_arrival_wait = true;
  expect_small("the receiving compute does not wait for the receive",
               ferry::testing::counterexample(
                   [&] { no_hazard(run_case(*gen_schedule_case(), faults).pipeline); }));
}

TEST(PlantedPipelineFault, WrongTensorLifeBreaksThePortalFrees) {
  PipelineFaults faults;
  faults.portal.fixed_life = true;
  expect_small("every stash gets life 2", ferry::testing::counterexample([&] {
                 portals_freed_after_last_use(run_case(*gen_case(), faults).pipeline);
               }));
}

void expect_offload_fault_caught(const std::string& fault, const PipelineFaults& faults) {
  expect_small(fault, ferry::testing::counterexample(
                          [&] { offload_is_safe(run_case(*gen_offload_case(), faults)); }));
}

TEST(PlantedPipelineOffloadFault, DroppedOffloadWaitIsCaught) {
  PipelineFaults faults;
  faults.offload.skip_offload_wait = true;
  expect_offload_fault_caught("the offload copy does not wait for the producer", faults);
}

TEST(PlantedPipelineOffloadFault, DroppedReloadWaitIsCaught) {
  PipelineFaults faults;
  faults.offload.skip_reload_wait = true;
  expect_offload_fault_caught("compute does not wait for the reload", faults);
}

TEST(PlantedPipelineOffloadFault, DroppedForwardGuardIsCaught) {
  PipelineFaults faults;
  faults.offload.skip_forward_guard = true;
  expect_offload_fault_caught("the original is freed before its offload copy ends", faults);
}

TEST(PlantedPipelineOffloadFault, DroppedBackwardGuardIsCaught) {
  PipelineFaults faults;
  faults.offload.skip_backward_guard = true;
  expect_offload_fault_caught("a reloaded buffer is freed before compute read it", faults);
}

TEST(PlantedPipelineOffloadFault, DroppedRngRestoreUnderOffloadIsCaught) {
  PipelineFaults faults;
  faults.skip_rng_restore = true;
  expect_offload_fault_caught("recompute without the RNG restore, stages offloading", faults);
}

}  // namespace
}  // namespace ferry::sim
