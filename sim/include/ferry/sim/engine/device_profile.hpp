#pragma once
/// Device profiles are part of the core's program model (ferry/program/device_profile.hpp).

#include "ferry/program/device_profile.hpp"

namespace ferry::sim {

using ferry::CopyPath;
using ferry::DeviceProfile;
using ferry::LaunchOverheads;

}  // namespace ferry::sim
