#include "name_table.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <utility>

#include "ferry/ids.hpp"

namespace ferry::sim::io_detail {
namespace {

/// At most this many declared names are listed after an unknown one.
constexpr std::size_t kListedNames = 8;

}  // namespace

Result<std::uint32_t> NameTable::declare(const JsonValue& at) {
  FERRY_JSON_TRY(auto name, at.name());
  if (const auto it = index_.find(name); it != index_.end()) {
    return at.error("duplicate {} name {} (first declared at {})", what_, json_quote(name),
                    paths_[it->second]);
  }
  if (names_.size() >= static_cast<std::size_t>(StreamId::kInvalid)) {
    return at.error("too many {}s", what_);
  }
  const auto index = static_cast<std::uint32_t>(names_.size());
  index_.emplace(name, index);
  names_.push_back(std::move(name));
  paths_.push_back(at.path());
  return index;
}

Result<std::uint32_t> NameTable::resolve(const JsonValue& at) const {
  FERRY_JSON_TRY(const auto name, at.name());
  if (const auto it = index_.find(name); it != index_.end()) return it->second;
  if (names_.empty()) return at.error("unknown {} {} (none declared)", what_, json_quote(name));
  std::vector<std::string> shown;
  for (std::size_t i = 0; i < names_.size() && i < kListedNames; ++i) {
    shown.push_back(json_quote(names_[i]));
  }
  if (names_.size() > kListedNames) shown.emplace_back("...");
  return at.error("unknown {} {} (declared: {})", what_, json_quote(name), fmt::join(shown, ", "));
}

}  // namespace ferry::sim::io_detail
