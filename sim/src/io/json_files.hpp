#pragma once
/// Pieces of the JSON readers shared by the device-profile and program files of this folder.

#include <filesystem>
#include <string>
#include <string_view>

#include "ferry/result.hpp"
#include "ferry/sim/engine/device_profile.hpp"
#include "ferry/sim/json/json_reader.hpp"

namespace ferry::sim::io_detail {

/// A rate in bytes or FLOP per second, in [kMinJsonRate, kMaxJsonRate].
Result<std::int64_t> read_rate(const JsonObject& object, std::string_view key);
/// A duration in [0, kMaxJsonNanoseconds].
Result<std::int64_t> read_nanoseconds(const JsonObject& object, std::string_view key);
/// A device profile object (the document of scenarios/devices/*.json, or one inline).
Result<DeviceProfile> read_profile(const JsonValue& value);

}  // namespace ferry::sim::io_detail
