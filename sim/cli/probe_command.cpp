// `ferry probe ARGS`: hands the command line to ferry-probe, which measures this device with the
// real backend and writes a device profile.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include <unistd.h>

#include "command.hpp"

namespace ferry::cli {

// Looked for beside this executable (an install), then where the build put it, then on PATH.
int exec_probe(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<std::string> candidates;
  std::error_code error;
  const fs::path self = fs::read_symlink("/proc/self/exe", error);
  if (!error) candidates.push_back((self.parent_path() / "ferry-probe").string());
#ifdef FERRY_PROBE_PATH
  candidates.emplace_back(FERRY_PROBE_PATH);
#endif
  std::vector<char*> args = {const_cast<char*>("ferry-probe")};
  for (int i = 0; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  for (const std::string& path : candidates) {
    if (::access(path.c_str(), X_OK) == 0) {
      ::execv(path.c_str(), args.data());
      fmt::print(stderr, "ferry probe: error: cannot run {}: {}\n", path,
                 std::error_code(errno, std::generic_category()).message());
      return kExitNoProbe;
    }
  }
  ::execvp("ferry-probe", args.data());
  fmt::print(stderr,
             "ferry probe: error: ferry-probe was not found ({}, nor on PATH): the probe needs "
             "the LibTorch backend; build with -DFERRY_REAL=ON (target ferry-probe) or run "
             "python -m ferry probe\n",
             candidates.empty() ? std::string("no build path compiled in")
                                : fmt::format("looked for {}", fmt::join(candidates, ", ")));
  return kExitNoProbe;
}

}  // namespace ferry::cli
