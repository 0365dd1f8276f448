#pragma once
/// Declared names of one kind in a program file, resolved to indices in declaration order.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/result.hpp"
#include "ferry/sim/json/json_reader.hpp"

namespace ferry::sim::io_detail {

/// Declared names of one kind (devices, streams, buffers, events) and their indices.
class NameTable {
 public:
  /// `what` names the kind in messages ("stream"); it must outlive the table.
  explicit NameTable(std::string_view what) : what_(what) {}

  /// Declares the name held by `at`; a second declaration of a name is an error.
  Result<std::uint32_t> declare(const JsonValue& at);

  /// The index of the declared name held by `at`; an unknown name's error lists the first few
  /// declared ones.
  [[nodiscard]] Result<std::uint32_t> resolve(const JsonValue& at) const;

  /// The name declared with `index`.
  [[nodiscard]] const std::string& name(std::uint32_t index) const { return names_.at(index); }

 private:
  std::string_view what_;
  std::map<std::string, std::uint32_t, std::less<>> index_;
  std::vector<std::string> names_;
  std::vector<std::string> paths_;
};

}  // namespace ferry::sim::io_detail
