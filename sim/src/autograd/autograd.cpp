#include "ferry/sim/autograd/autograd.hpp"

#include "trainer.hpp"

namespace ferry::sim {

Result<TrainingRun> simulate_training(const Model& model, const DeviceProfile& device,
                                      const TrainingOptions& options,
                                      const TrainingFaults& faults) {
  if (auto valid = validate_model(model); !valid) return valid.error();
  training::Trainer trainer(model, device, options, faults);
  return trainer.run();
}

}  // namespace ferry::sim
