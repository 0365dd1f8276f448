// libFuzzer harness for the model format (ferry.model/1): parse and validate as
// `ferry simulate --model FILE` does, check that a valid model round-trips, then simulate it
// under every policy and checkpoint plan of `ferry compare` on a bundled device.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/program_json.hpp"
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
  fuzz::simulate_model(std::move(model).value(), device());
  return 0;
}
