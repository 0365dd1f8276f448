// libFuzzer harness for the model format (ferry.model/1): parse and validate as
// `ferry simulate --model FILE` does, check that a valid model round-trips, cut it for a rank of
// tensor, context and expert parallelism (and of tensor then expert, and of expert parallelism
// with a static capacity, simulated with the paged stash too), then simulate it under every
// policy and checkpoint plan of `ferry compare` on a bundled device (and with the paged stash
// where it has static-capacity buffers).

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/workload/rank_model.hpp"
#include "fuzz_common.hpp"

namespace {

const ferry::sim::DeviceProfile& device() {
  static const ferry::sim::DeviceProfile profile = [] {
    auto loaded = ferry::sim::load_device_profile(ferry::sim::fuzz::scenarios_dir() / "devices",
                                                  "h100-sxm-pcie5");
    if (!loaded) ferry::sim::fuzz::fail(loaded.error().message);
    return loaded.value();
  }();
  return profile;
}

// A rank's cut of `model` (Note [A rank's model]) is a valid model or an error that names the
// flag: never a crash, an internal error or an invalid model.
void cut_ranks(const ferry::sim::Model& model) {
  namespace fuzz = ferry::sim::fuzz;
  const auto cut_or_refused = [](const ferry::Result<ferry::sim::Model>& cut,
                                 std::string_view flag) {
    if (!cut) {
      if (!cut.error().message.starts_with(flag)) fuzz::fail("a cut's error names no flag");
      return;
    }
    if (!ferry::sim::validate_model(cut.value())) fuzz::fail("a cut model is not valid");
  };
  const auto tp = ferry::sim::tensor_parallel_model(model, 2);
  cut_or_refused(tp, "--tp 2");
  cut_or_refused(ferry::sim::context_parallel_model(model, 2), "--cp 2");
  cut_or_refused(ferry::sim::expert_parallel_model(model, 2), "--ep 2");
  if (tp) cut_or_refused(ferry::sim::expert_parallel_model(tp.value(), 2), "--ep 2");
  // A static capacity pads the routed rows, or names the factor that would hold them.
  const auto padded = ferry::sim::expert_parallel_model(model, 2, 1, 2.0);
  cut_or_refused(padded, "--ep 2");
  if (padded && ferry::sim::has_static_capacity(padded.value())) {
    ferry::sim::fuzz::simulate_model(padded.value(), device());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace fuzz = ferry::sim::fuzz;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto model = ferry::sim::parse_model(text, fuzz::kSource);
  if (!model) {
    fuzz::expect_error_names_source(model.error());
    return 0;
  }
  const auto again = ferry::sim::parse_model(ferry::sim::model_to_json(model.value()), "again");
  if (!again || !(again.value() == model.value())) fuzz::fail("a valid model does not round-trip");
  cut_ranks(model.value());
  fuzz::simulate_model(std::move(model).value(), device());
  return 0;
}
