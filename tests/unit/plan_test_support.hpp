#pragma once
// What the planner's tests share (plan_test.cpp, plan_format_test.cpp, plan_horizon_test.cpp,
// plan_cache_test.cpp): the bundled devices, presets and a small traced Llama timed on them, and
// the measured run of a fixed row.

#include <gtest/gtest.h>

#include <string>

#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/runs/configurations.hpp"
#include "ferry/sim/runs/measure.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::plan_test {

/// The bundled device profile `name`.
inline DeviceProfile profile(const std::string& name) {
  auto p = load_device_profile(std::string(FERRY_SCENARIOS_DIR) + "/devices", name);
  EXPECT_TRUE(p.ok()) << (p.ok() ? "" : p.error().message);
  return p.value();
}

/// The preset `name` with its roofline durations on `device`.
inline Model preset(const std::string& name, const DeviceProfile& device) {
  auto m = model_preset(name);
  EXPECT_TRUE(m.ok());
  Model model = m.value();
  assign_roofline_durations(model, device);
  return model;
}

/// A Llama as a trace lists a Hugging Face one (Note [A Llama as a trace lists it]), small.
inline Model traced_llama(const DeviceProfile& device) {
  TransformerShape shape;
  shape.kind = TransformerShape::Kind::LlamaTraced;
  shape.layers = 4;
  shape.hidden = 256;
  shape.heads = 8;
  shape.kv_heads = 2;
  shape.ffn = 704;
  shape.vocab = 4096;
  shape.sequence = 512;
  shape.micro_batch = 2;
  Model model = make_transformer(shape, "traced-llama");
  assign_roofline_durations(model, device);
  return model;
}

/// The measured run of `row`, without the hazard checker and the content tracking.
inline RowResult fixed_row(const Model& model, const DeviceProfile& device, const PolicyRow& row) {
  PolicyRow unchecked = row;
  unchecked.options.sim.check_hazards = false;
  unchecked.options.sim.track_content = false;
  return run_row(model, device, unchecked);
}

/// The measured no-offload row of `model` on `device`.
inline RowResult no_offload_row(const Model& model, const DeviceProfile& device) {
  return fixed_row(model, device, default_rows(TrainingOptions{}, model, device).front());
}

}  // namespace ferry::sim::plan_test
