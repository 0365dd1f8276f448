#pragma once
/// The tables of `ferry simulate` and `ferry compare`, as text and as JSON documents: one
/// run's summary, the comparison of the rows, and the pipeline rows.

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/parallelism.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/runs/compare_runs.hpp"
#include "ferry/sim/runs/measure.hpp"

namespace ferry::sim {

// Note [Reports under FSDP]
// A report of runs under FSDP (`parallelism` on) says so itself: its JSON document ends with an
// "fsdp" member (parallelism_report_json: the ranks, nodes, HSDP groups, resharding, and that
// figures are one rank's), its text with the line parallelism_text writes. Without FSDP neither
// is there.

/// A report document as the commands print it and write it: indented by 2, one final newline.
[[nodiscard]] std::string document_text(const nlohmann::ordered_json& document);

/// The document `j` with its parallelism's members (with_parallelism_report), the experts'
/// routing as expert_routing says `model`'s is priced.
[[nodiscard]] nlohmann::ordered_json with_parallelism(nlohmann::ordered_json j,
                                                      const Parallelism& p,
                                                      const DeviceProfile& device,
                                                      const Model& model);

/// The line a text report ends with under FSDP: the parallelism `p`, and that figures are one
/// rank's. Empty without FSDP.
[[nodiscard]] std::string parallelism_text(const Parallelism& p, const DeviceProfile& device,
                                           const Model& model);

/// Summary of one run as text / JSON (`ferry simulate`; "ferry.simulate/1"), of one rank under
/// `parallelism` (Note [Reports under FSDP]).
[[nodiscard]] std::string simulate_text(const RowResult& row, const Model& model,
                                        const DeviceProfile& device,
                                        const Parallelism& parallelism = {});
[[nodiscard]] nlohmann::ordered_json simulate_json(const RowResult& row, const Model& model,
                                                   const DeviceProfile& device,
                                                   const Parallelism& parallelism = {});

/// The comparison table as text (`ferry compare`); ratios are to the "none" row. The `pipeline`
/// rows (`ferry compare --pp N`), when there are any, follow as pipeline_text's table.
[[nodiscard]] std::string compare_text(const std::vector<RowResult>& rows, const Model& model,
                                       const DeviceProfile& device,
                                       const std::vector<PipelineRow>& pipeline = {},
                                       const Parallelism& parallelism = {});

/// The comparison as one JSON document ("ferry.compare/1"); ratios are to the "none" row. The
/// `pipeline` rows, when there are any, are its "pipeline" array.
[[nodiscard]] nlohmann::ordered_json compare_json(const std::vector<RowResult>& rows,
                                                  const Model& model, const DeviceProfile& device,
                                                  const std::vector<PipelineRow>& pipeline = {},
                                                  const Parallelism& parallelism = {});

/// The pipeline table as text, and the rows as a JSON array.
[[nodiscard]] std::string pipeline_text(const std::vector<PipelineRow>& rows);
[[nodiscard]] std::string pipeline_json(const std::vector<PipelineRow>& rows);
/// The document of `ferry simulate --pp N --json` ("ferry.pipeline/1"): the rows.
[[nodiscard]] nlohmann::ordered_json pipeline_document(const std::vector<PipelineRow>& rows);

}  // namespace ferry::sim
