#include "ferry/sim/autograd/autograd.hpp"

#include "trainer.hpp"

namespace ferry::sim {

Result<TrainingRun> simulate_training(const CheckedModel& model, const DeviceProfile& device,
                                      const TrainingOptions& options,
                                      const TrainingFaults& faults) {
  training::Trainer trainer(*model, device, options, faults);
  return trainer.run();
}

Result<TrainingRun> simulate_training(const Model& model, const DeviceProfile& device,
                                      const TrainingOptions& options,
                                      const TrainingFaults& faults) {
  // The check alone: the run reads `model` where it is, as the overload above reads a checked
  // one; a CheckedModel would copy every op and tensor only to drop them when the run ends.
  if (auto valid = validate_model(model); !valid) return valid.error();
  training::Trainer trainer(model, device, options, faults);
  return trainer.run();
}

}  // namespace ferry::sim
