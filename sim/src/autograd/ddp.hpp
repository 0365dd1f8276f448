#pragma once
// Private to the simulated autograd: DDP's gradient all-reduce on a comm stream, as a unit of
// the step's hooks (Note [Step hooks]; Note [Side streams] in trainer.cpp).

#include <cstdint>

#include "ferry/sim/autograd/autograd.hpp"
#include "step_hooks.hpp"

namespace ferry::sim::training {

/// DistributedDataParallel's reducer on one rank (SideStreamOptions::all_reduce): each
/// parameter's final gradient is all-reduced on a comm stream once the stream that wrote it is
/// awaited, and backward's end waits for the last all-reduce.
class Ddp final : public StepHooks {
 public:
  /// Keeps references to every argument; adds its comm stream.
  Ddp(const Model& model, const TrainingOptions& options, const TrainingFaults& faults,
      RankContext& rank);

  /// All-reduces parameter `p`'s gradient on the comm stream.
  void grad_ready(std::uint32_t p) override;
  /// DDP's finalize: the caller's stream waits for the last all-reduces.
  void backward_end() override;

 private:
  const Model& model_;
  const TrainingOptions& options_;
  const TrainingFaults& faults_;
  RankContext& rank_;
  StreamId comm_;
};

}  // namespace ferry::sim::training
