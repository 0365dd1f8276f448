#include "ferry/real/loopback_config.hpp"

#include <charconv>
#include <stdexcept>

namespace ferry::real {

namespace {

std::uint64_t parse_number(std::string_view text, std::string_view what, std::string_view where,
                           std::string_view whole) {
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
    throw std::invalid_argument(std::string(where) + ": " + std::string(what) + " \"" +
                                std::string(text) + "\" in \"" + std::string(whole) +
                                "\" is not a non-negative integer (expected sync, async, "
                                "async:SEED or async:SEED:MAX_DELAY_US)");
  }
  return value;
}

}  // namespace

LoopbackConfig parse_loopback_streams(std::string_view text, std::string_view where) {
  LoopbackConfig out;
  if (text.empty() || text == "sync") return out;
  const std::string_view whole = text;
  const auto next = [&text]() {
    const std::size_t colon = text.find(':');
    const std::string_view part = text.substr(0, colon);
    text = colon == std::string_view::npos ? std::string_view() : text.substr(colon + 1);
    return part;
  };
  if (next() != "async") {
    throw std::invalid_argument(std::string(where) + ": \"" + std::string(whole) +
                                "\" is not a loopback stream mode (expected sync, async, "
                                "async:SEED or async:SEED:MAX_DELAY_US)");
  }
  out.async = true;
  if (!text.empty() || whole.find(':') != std::string_view::npos) {
    out.seed = parse_number(next(), "seed", where, whole);
  }
  if (!text.empty() || whole.find(':') != whole.rfind(':')) {
    const std::uint64_t us = parse_number(next(), "delay", where, whole);
    if (us > static_cast<std::uint64_t>(kMaxLoopbackDelay.count())) {
      throw std::invalid_argument(std::string(where) + ": a delay of " + std::to_string(us) +
                                  " us in \"" + std::string(whole) + "\" is over the 1 s allowed");
    }
    out.max_delay = std::chrono::microseconds(us);
  }
  if (!text.empty()) {
    throw std::invalid_argument(std::string(where) + ": \"" + std::string(whole) +
                                "\" has more than three parts (expected async:SEED:MAX_DELAY_US)");
  }
  return out;
}

std::string to_string(const LoopbackConfig& config) {
  if (!config.async) return "sync";
  return "async:" + std::to_string(config.seed) + ":" + std::to_string(config.max_delay.count());
}

}  // namespace ferry::real
