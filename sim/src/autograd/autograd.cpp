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
  auto checked = check_model(model);
  if (!checked) return checked.error();
  return simulate_training(checked.value(), device, options, faults);
}

}  // namespace ferry::sim
