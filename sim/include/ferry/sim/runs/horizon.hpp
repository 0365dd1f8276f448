#pragma once
/// The ferry policy's offload horizon derived from a model and a device.

#include <optional>

#include "ferry/sim/autograd/autograd.hpp"

namespace ferry::sim {

/// The ferry policy's offload horizon (OffloadOptions::horizon_bytes) for `options` on
/// `device`: the bytes of the saved storages whose copies, queued on the device-to-host link in
/// pack order, end before backward needs them again (Note [Deriving the offload horizon] in
/// horizon.cpp). Unset when every copy is hidden, and for other policies. `model` must have
/// durations assigned.
[[nodiscard]] std::optional<Bytes> offload_horizon(const Model& model, const DeviceProfile& device,
                                                   const TrainingOptions& options);

}  // namespace ferry::sim
