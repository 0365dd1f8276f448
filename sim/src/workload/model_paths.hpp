#pragma once
// Private to the model's files (model_check.cpp, kernel_timing.cpp): the JSON paths their
// errors name, built only on the way to an error (Note [Paths on demand] in model_check.cpp),
// and the bytes a list of tensors holds.

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/result.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::workload_detail {

/// An error at `path` ("ops[3].inputs[1]: ..."), without a source: parse_model adds that.
template <class... Args>
Error error_at(std::string_view path, fmt::format_string<Args...> format, Args&&... args) {
  return Error{fmt::format("{}: {}", path, fmt::format(format, std::forward<Args>(args)...))};
}

/// `tensors[5]`.
[[nodiscard]] std::string tensor_path(std::size_t index);
/// `ops[3]`.
[[nodiscard]] std::string op_path(std::size_t index);
/// The path of `key` inside op `index`: `ops[3].flops`.
[[nodiscard]] std::string op_member(std::size_t index, std::string_view key);

/// Bytes of `tensors` summed (each at most kMaxJsonBytes, so the sum of up to 2^13 of them
/// fits; a longer list saturates).
[[nodiscard]] std::int64_t tensor_bytes(const Model& model,
                                        const std::vector<std::uint32_t>& tensors);

}  // namespace ferry::sim::workload_detail
