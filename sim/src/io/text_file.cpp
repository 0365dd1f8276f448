#include "ferry/sim/io/text_file.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <fstream>
#include <sstream>
#include <system_error>
#include <utility>

namespace ferry::sim {

Result<std::string> read_text_file(const std::filesystem::path& path) {
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (error) return Error{fmt::format("{}: cannot read: {}", path.string(), error.message())};
  if (!std::filesystem::is_regular_file(status)) {
    return Error{fmt::format("{}: cannot read: not a regular file", path.string())};
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Error{fmt::format("{}: cannot open: {}", path.string(),
                             std::error_code(errno, std::generic_category()).message())};
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Error{fmt::format("{}: read error", path.string())};
  return std::move(text).str();
}

}  // namespace ferry::sim
