#include "snapshot_file.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "ferry/sim/analysis/memory_snapshot.hpp"

namespace ferry::cli {

std::string unwritable(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return fmt::format("cannot write {}: no folder {}", path, dir.string());
  if (fs::is_directory(p, ec)) return fmt::format("cannot write {}: it is a folder", path);
  return {};
}

int write_memory_snapshot(const sim::Simulator& sim, const std::string& path,
                          std::string_view command, bool quiet) {
  constexpr int kExitBadInput = 2;
  auto pickle = sim::memory_snapshot(sim);
  if (!pickle) {
    fmt::print(stderr, "ferry {}: error: --memory-snapshot: {}\n", command, pickle.error().message);
    return kExitBadInput;
  }
  std::ofstream file(path, std::ios::binary);
  file.write(pickle.value().data(), static_cast<std::streamsize>(pickle.value().size()));
  if (!file) {
    fmt::print(stderr, "ferry {}: error: --memory-snapshot: cannot write {}\n", command, path);
    return kExitBadInput;
  }
  if (!quiet) fmt::print(stderr, "memory snapshot written to {} (pytorch.org/memory_viz)\n", path);
  return 0;
}

}  // namespace ferry::cli
