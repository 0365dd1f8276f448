#pragma once
/// Reading an input file whole: every reader of a file the user names goes through here, so a
/// missing file, a folder or an unreadable one gets the same message everywhere.

#include <filesystem>
#include <string>

#include "ferry/result.hpp"

namespace ferry::sim {

/// The whole of a regular file; the error names the path and why it cannot be read.
Result<std::string> read_text_file(const std::filesystem::path& path);

}  // namespace ferry::sim
