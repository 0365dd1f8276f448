// Planted faults in the synchronizations that protect a free, caught for every timing. Each
// offload policy relies on a few waits (or record_stream calls) so that memory it frees is not
// handed out while a copy or kernel may still use it. Dropping one must be reported whatever
// the kernel durations: the tests train a small transformer with every kernel lasting from a
// microsecond to a second, so that with long kernels every copy is long done when the memory
// comes back, and a verdict taken from the simulated timing would see nothing. The checker
// decides at the free (Note [Latent reuse]), so the fault is reported at each duration, as a
// latent reuse naming the free. The fault-free runs stay clean at each duration.

#include <gtest/gtest.h>

#include <iostream>
#include <string>
#include <vector>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {
namespace {

// 1 us .. 1 s per kernel.
const std::vector<std::int64_t>& kernel_durations() {
  static const std::vector<std::int64_t> all{1'000, 1'000'000, 1'000'000'000};
  return all;
}

Model model_with_kernels_of(std::int64_t ns) {
  Model model = model_preset("tiny-gpt").value();
  for (ModelOp& op : model.ops) {
    op.duration = SimTime(ns);
    op.backward_duration = SimTime(ns);
  }
  return model;
}

DeviceProfile device() {
  return load_device_profile(FERRY_SCENARIOS_DIR "/devices", "h100-sxm-pcie5").value();
}

struct Fault {
  const char* name;
  Policy policy;
  OffloadFaults faults;
  std::int32_t escape_period;  // views escaping their node: the record_stream fallback
  /// ferry's host pool keeps its pinned buffers allocated and hands them to the next offload
  /// itself: dropping its guard is a race on one buffer, reported as such.
  HazardKind kind = HazardKind::LatentReuse;
};

std::vector<Fault> faults() {
  std::vector<Fault> all;
  auto add = [&](const char* name, Policy policy, std::int32_t escape, auto set,
                 HazardKind kind = HazardKind::LatentReuse) {
    OffloadFaults f;
    set(f);
    all.push_back(Fault{name, policy, f, escape, kind});
  };
  add("ferry: original freed without the forward window's wait", Policy::Ferry, 0,
      [](OffloadFaults& f) { f.skip_forward_guard = true; });
  add("ferry: reload block freed without the reload stream's wait (backward guard)", Policy::Ferry,
      0, [](OffloadFaults& f) { f.skip_backward_guard = true; });
  add("ferry: escaped reload freed without the record_stream fallback", Policy::Ferry, 1,
      [](OffloadFaults& f) { f.skip_record_stream = true; });
  add(
      "ferry: host pool slot refilled without waiting for its reload (host-pool guard)",
      Policy::Ferry, 0, [](OffloadFaults& f) { f.skip_host_guard = true; }, HazardKind::Race);
  add("trl: original let go without the stash's wait", Policy::Trl, 0,
      [](OffloadFaults& f) { f.skip_forward_guard = true; });
  add("trl: reload freed without the side stream's wait (backward guard)", Policy::Trl, 0,
      [](OffloadFaults& f) { f.skip_backward_guard = true; });
  add("trl: escaped reload freed without the record_stream fallback", Policy::Trl, 1,
      [](OffloadFaults& f) { f.skip_record_stream = true; });
  add("trl: host copy freed without record_stream (host guard)", Policy::Trl, 0,
      [](OffloadFaults& f) { f.skip_host_guard = true; });
  return all;
}

TrainingOptions training(Policy policy, std::int32_t escape_period) {
  TrainingOptions o;
  o.offload.policy = policy;
  o.offload.window_bytes = Bytes(1LL << 20);  // a small window: originals retire in forward
  o.offload.prefetch_bytes = Bytes(1LL << 20);
  o.steps = 2;
  o.escape_period = escape_period;
  return o;
}

std::string describe(const Simulator& sim, const Hazard& h) {
  auto label = [&](OpId id) { return std::string(sim.label(sim.ops()[id.value()].label)); };
  return "op " + std::to_string(h.first.value()) + " (" + label(h.first) + ") and op " +
         std::to_string(h.second.value()) + " (" + label(h.second) + ")";
}

class PlantedFreeFault : public ::testing::TestWithParam<std::size_t> {};

TEST_P(PlantedFreeFault, IsReportedAtEveryKernelDuration) {
  const Fault fault = faults()[GetParam()];
  for (const std::int64_t ns : kernel_durations()) {
    const Model model = model_with_kernels_of(ns);
    auto clean = simulate_training(model, device(), training(fault.policy, fault.escape_period));
    ASSERT_TRUE(clean.ok() && !clean.value().failure);
    EXPECT_TRUE(clean.value().sim.hazards().empty())
        << fault.name << ": the fault-free run, kernels of " << ns << " ns";
    if (fault.escape_period > 0) {
      ASSERT_GT(clean.value().telemetry.record_stream_fallbacks, 0) << "no view escaped";
    }

    auto run = simulate_training(model, device(), training(fault.policy, fault.escape_period),
                                 TrainingFaults{.offload = fault.faults});
    ASSERT_TRUE(run.ok() && !run.value().failure) << fault.name;
    const Simulator& sim = run.value().sim;
    std::size_t found = 0;
    std::size_t never_reused = 0;
    for (const Hazard& h : sim.hazards()) {
      if (h.kind != fault.kind) continue;
      ++found;
      never_reused += h.kind == HazardKind::LatentReuse && !h.reused_by.valid() ? 1 : 0;
    }
    ASSERT_GT(found, 0U) << fault.name << " went unnoticed with kernels of " << ns << " ns";
    if (fault.kind == HazardKind::LatentReuse) {
      // Some instance was never handed out again in the simulated run: a verdict taken from
      // the run's own reuse would have missed it there.
      EXPECT_GT(never_reused, 0U) << fault.name;
    }
    std::cout << fault.name << ", kernels of " << ns << " ns: " << sim.hazards().size()
              << " hazard(s), " << found << " of the expected kind (" << never_reused
              << " latent reuse never reused in the simulated run); first: "
              << describe(sim, sim.hazards()[0]) << "\n";
  }
}

INSTANTIATE_TEST_SUITE_P(Faults, PlantedFreeFault,
                         ::testing::Range<std::size_t>(0, faults().size()));

}  // namespace
}  // namespace ferry::sim
