#pragma once
/// The tables of `ferry simulate` and `ferry compare`, as text and as JSON documents: one
/// run's summary, the comparison of the rows, and the pipeline rows.

#include <string>
#include <vector>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/runs/compare_runs.hpp"
#include "ferry/sim/runs/measure.hpp"

namespace ferry::sim {

/// Summary of one run as text / JSON (`ferry simulate`).
[[nodiscard]] std::string simulate_text(const RowResult& row, const Model& model,
                                        const DeviceProfile& device);
[[nodiscard]] std::string simulate_json(const RowResult& row, const Model& model,
                                        const DeviceProfile& device);

/// The comparison table as text (`ferry compare`); ratios are to the "none" row.
[[nodiscard]] std::string compare_text(const std::vector<RowResult>& rows, const Model& model,
                                       const DeviceProfile& device);

/// The comparison as one JSON document ("ferry.compare/1"); ratios are to the "none" row. The
/// `pipeline` rows (`ferry compare --devices N`), when there are any, are its "pipeline" array.
[[nodiscard]] std::string compare_json(const std::vector<RowResult>& rows, const Model& model,
                                       const DeviceProfile& device,
                                       const std::vector<PipelineRow>& pipeline = {});

/// The pipeline table as text, and the rows as a JSON array.
[[nodiscard]] std::string pipeline_text(const std::vector<PipelineRow>& rows);
[[nodiscard]] std::string pipeline_json(const std::vector<PipelineRow>& rows);
/// The document of `ferry simulate --devices N --json` ("ferry.pipeline/1"): the rows.
[[nodiscard]] std::string pipeline_document(const std::vector<PipelineRow>& rows);

}  // namespace ferry::sim
