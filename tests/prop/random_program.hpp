#pragma once
// Random stream programs for property tests and benchmarks. A program is built from a list of
// small random choices that are interpreted against the program's state, so every list gives
// a well-formed program (no use before alloc, no double free) and shrinking a list shrinks
// the program.

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "ferry/sim/engine/program.hpp"

namespace ferry::sim::testing {

/// One raw random decision; its fields are reduced modulo whatever they select.
struct OpChoice {
  std::uint32_t kind = 0;
  std::uint32_t a = 0;
  std::uint32_t b = 0;
  std::uint32_t c = 0;
  std::uint32_t x = 0;
  std::uint32_t y = 0;
};

struct SlotShape {
  MemoryKind kind = MemoryKind::Device;
  std::uint32_t device = 0;
  std::int64_t bytes = 512;
};

struct ProgramShape {
  std::uint32_t devices = 1;
  std::uint32_t streams = 2;
  std::uint32_t events = 1;
  std::vector<SlotShape> slots;
  DeviceProfile profile;
};

struct RandomProgramOptions {
  bool record_stream = false;  ///< allocator deferral edges are timing dependent
  bool query = false;          ///< query answers are timing dependent
  bool empty_cache = true;
  bool free_all_at_end = false;
};

/// Interprets `choices` as a program over `shape`.
Program build_random_program(const ProgramShape& shape, std::span<const OpChoice> choices,
                             const RandomProgramOptions& options);

/// A plain device profile with the given speeds (bytes per ns) and overheads.
DeviceProfile random_profile(std::mt19937_64& rng);

/// `p` with random collective links: 8 GPUs a node, 1 to 400 GB/s inside it, 1 to 50 GB/s
/// between nodes.
DeviceProfile with_random_links(DeviceProfile p, std::mt19937_64& rng);

/// Choices and a shape from a seeded generator (for benchmarks, which need no shrinking).
std::vector<OpChoice> random_choices(std::mt19937_64& rng, std::size_t count);
ProgramShape random_shape(std::mt19937_64& rng, std::uint32_t slots);

}  // namespace ferry::sim::testing
