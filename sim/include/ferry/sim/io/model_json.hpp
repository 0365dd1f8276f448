#pragma once
/// The model file ("ferry.model/1"): read and written.

#include <string>
#include <string_view>

#include "ferry/result.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {

/// JSON form ("ferry.model/1"); errors name the source and the JSON path.
Result<Model> parse_model(std::string_view text, std::string_view source);
/// parse_model's model as a CheckedModel: the reader has checked it (validate_model, with the
/// document's paths in its errors), so it is not checked again.
Result<CheckedModel> parse_checked_model(std::string_view text, std::string_view source);
/// A model as a document parse_model reads back equal; fixed key order, so the bytes are stable.
[[nodiscard]] std::string model_to_json(const Model& model);

}  // namespace ferry::sim
