#include "io.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <fstream>

#include "command.hpp"
#include "ferry/sim/export/memory_snapshot.hpp"

namespace ferry::cli {

std::string default_scenarios() {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path self = fs::read_symlink("/proc/self/exe", error);
  if (!error) {
    const fs::path prefix = self.parent_path().parent_path();
    for (const fs::path& installed :
         {prefix / "share" / "ferry" / "scenarios", prefix / "scenarios"}) {
      if (fs::is_directory(installed / "devices", error)) return installed.string();
    }
  }
  return FERRY_DEFAULT_SCENARIOS_DIR;
}

void print(std::string_view text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

bool write_output(const std::string& path, std::string_view bytes) {
  std::ofstream file(path, std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  file.close();
  return !file.fail();
}

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
  auto pickle = sim::memory_snapshot(sim);
  if (!pickle) {
    fmt::print(stderr, "ferry {}: error: --memory-snapshot: {}\n", command, pickle.error().message);
    return kExitBadInput;
  }
  if (!write_output(path, pickle.value())) {
    fmt::print(stderr, "ferry {}: error: --memory-snapshot: cannot write {}\n", command, path);
    return kExitBadInput;
  }
  if (!quiet) fmt::print(stderr, "memory snapshot written to {} (pytorch.org/memory_viz)\n", path);
  return 0;
}

}  // namespace ferry::cli
