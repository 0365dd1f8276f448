#include "ferry/sim/api/load.hpp"

#include <fmt/format.h>

#include <utility>

#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/io/text_file.hpp"

namespace ferry::sim {

Result<std::string> read_input(const std::string& path, std::string_view what) {
  auto text = read_text_file(path);
  if (!text) return Error{fmt::format("{} file {}", what, text.error().message)};
  return text;
}

Result<CheckedModel> load_model(const std::string& spec) {
  if (!spec.ends_with(".json")) {
    auto preset = model_preset(spec);
    if (!preset) return preset.error();
    auto checked = check_model(std::move(preset).value());
    if (!checked) return Error{fmt::format("{}: {}", spec, checked.error().message)};
    return checked;
  }
  auto text = read_input(spec, "model");
  if (!text) return text.error();
  return parse_checked_model(text.value(), spec);
}

Result<DeviceProfile> load_device(const std::string& spec, const std::filesystem::path& scenarios) {
  if (!spec.ends_with(".json")) return load_device_profile(scenarios / "devices", spec);
  auto text = read_input(spec, "device");
  if (!text) return text.error();
  return parse_device_profile(text.value(), spec);
}

Result<Workload> load_workload(const std::string& model, const std::string& device,
                               const std::filesystem::path& scenarios) {
  return make_workload(load_model(model), device, scenarios);
}

Result<Workload> make_workload(Result<CheckedModel> model, const std::string& device,
                               const std::filesystem::path& scenarios) {
  if (!model) return model.error();
  auto d = load_device(device, scenarios);
  if (!d) return d.error();
  return Workload{std::move(model).value(), std::move(d).value()};
}

}  // namespace ferry::sim
