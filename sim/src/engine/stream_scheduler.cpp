#include "ferry/sim/engine/stream_scheduler.hpp"

namespace ferry::sim {

StreamId StreamScheduler::add(std::string name, DeviceId device, ThreadIndex thread) {
  Stream s;
  s.name = std::move(name);
  s.device = device;
  s.thread = thread;
  streams_.push_back(std::move(s));
  return StreamId(static_cast<std::uint32_t>(streams_.size() - 1));
}

}  // namespace ferry::sim
