#include "ferry/portal.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "ferry/check.hpp"

namespace ferry {

std::int32_t portal_tensor_life(bool portal_exists, bool checkpointing) {
  if (portal_exists) return 1;
  return checkpointing ? 3 : 2;
}

PortalTable::PortalTable(PortalFaults faults) : faults_(faults) {}

PortalTable::Portal& PortalTable::existing(PortalKey key, const char* what) {
  const auto it = portals_.find(key);
  if (it == portals_.end()) {
    throw PortalError(fmt::format("skip {} of micro-batch {} has not been stashed ({})", key.skip,
                                  key.micro_batch, what));
  }
  return it->second;
}

void PortalTable::set_live(std::int64_t delta) {
  stats_.live += delta;
  stats_.max_live = std::max(stats_.max_live, stats_.live);
}

PortalStash PortalTable::stash(PortalKey key, TensorId tensor, bool checkpointing) {
  const std::int32_t life =
      faults_.fixed_life ? 2 : portal_tensor_life(contains(key), checkpointing);
  return PortalStash{life, put_tensor(key, tensor, life)};
}

std::optional<TensorId> PortalTable::put_tensor(PortalKey key, TensorId tensor, std::int32_t life) {
  FERRY_CHECK(life > 0, "portal life {} for skip {} of micro-batch {}", life, key.skip,
              key.micro_batch);
  Portal& portal = portals_[key];
  std::optional<TensorId> dropped = portal.tensor;
  if (dropped) {
    ++stats_.releases;
  } else {
    set_live(1);
  }
  portal.tensor = tensor;
  portal.life = life;
  ++stats_.puts;
  return dropped;
}

PortalUse PortalTable::use_tensor(PortalKey key) {
  Portal& portal = existing(key, "use");
  if (portal.life <= 0 || !portal.tensor) {
    throw PortalError(fmt::format("tensor in portal has been removed (skip {} of micro-batch {})",
                                  key.skip, key.micro_batch));
  }
  ++stats_.uses;
  PortalUse use{*portal.tensor, false};
  if (--portal.life == 0) {
    portal.tensor.reset();
    use.released = true;
    ++stats_.releases;
    set_live(-1);
  }
  return use;
}

TensorId PortalTable::copy_tensor(PortalKey key, TensorId copy) {
  Portal& portal = existing(key, "copy");
  if (portal.life <= 0 || !portal.tensor) {
    throw PortalError(
        fmt::format("tensor in portal has been removed (skip {} of micro-batch {}, at its copy)",
                    key.skip, key.micro_batch));
  }
  ++stats_.copies;
  const TensorId before = *portal.tensor;
  portal.tensor = copy;
  return before;
}

std::optional<TensorId> PortalTable::put_grad(PortalKey key, TensorId grad) {
  Portal& portal = existing(key, "put_grad");
  std::optional<TensorId> dropped = portal.grad;
  portal.grad = grad;
  ++stats_.grad_puts;
  return dropped;
}

TensorId PortalTable::use_grad(PortalKey key) {
  const auto it = portals_.find(key);
  if (it == portals_.end() || !it->second.grad) {
    throw PortalError(
        fmt::format("grad in portal has been removed or never set (skip {} of micro-batch {})",
                    key.skip, key.micro_batch));
  }
  ++stats_.grad_uses;
  const TensorId grad = *it->second.grad;
  it->second.grad.reset();
  return grad;
}

bool PortalTable::contains(PortalKey key) const { return portals_.contains(key); }

std::int32_t PortalTable::tensor_life(PortalKey key) const {
  const auto it = portals_.find(key);
  return it == portals_.end() || !it->second.tensor ? 0 : it->second.life;
}

std::vector<PortalKey> PortalTable::holding_tensors() const {
  std::vector<PortalKey> keys;
  for (const auto& [key, portal] : portals_) {
    if (portal.tensor) keys.push_back(key);
  }
  return keys;
}

std::vector<PortalKey> PortalTable::holding_grads() const {
  std::vector<PortalKey> keys;
  for (const auto& [key, portal] : portals_) {
    if (portal.grad) keys.push_back(key);
  }
  return keys;
}

std::vector<TensorId> PortalTable::clear() {
  std::vector<TensorId> held;
  for (const auto& [key, portal] : portals_) {
    if (portal.tensor) {
      held.push_back(*portal.tensor);
      ++stats_.releases;
    }
    if (portal.grad) held.push_back(*portal.grad);
  }
  portals_.clear();
  stats_.live = 0;
  return held;
}

}  // namespace ferry
