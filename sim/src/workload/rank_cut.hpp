#pragma once
// Private to the rank cuts (tensor_parallel_cut.cpp, context_parallel_cut.cpp,
// expert_parallel_cut.cpp): what they share, the base RankCut and the collectives' operators.

#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/result.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::rank_cut_detail {

constexpr std::string_view kAllGatherKind = "_c10d_functional.all_gather_into_tensor.default";
constexpr std::string_view kReduceScatterKind = "_c10d_functional.reduce_scatter_tensor.default";
constexpr std::string_view kAllToAllKind = "_c10d_functional.all_to_all_single.default";

// What the cuts share: the whole model, and the flag and degree their errors name.
class RankCut {
 public:
  // The cut model is returned as built, for a caller that validates it once after the last cut
  // (rank_workload).
  void skip_validation() { validate_ = false; }

 protected:
  RankCut(const Model& whole, std::string_view flag, std::int32_t degree)
      : whole_(whole), flag_(flag), degree_(degree) {}

  // The tensor `t` of `model` is a view of, or `t`.
  static std::uint32_t base_in(const Model& model, std::uint32_t t) {
    const ModelTensor& tensor = model.tensors[t];
    return tensor.view_of >= 0 ? static_cast<std::uint32_t>(tensor.view_of) : t;
  }
  // The same in the whole model.
  std::uint32_t base(std::uint32_t t) const { return base_in(whole_, t); }
  template <class... Args>
  Error refuse(fmt::format_string<Args...> format, Args&&... args) const {
    return Error{
        fmt::format("{} {}: {}", flag_, degree_, fmt::format(format, std::forward<Args>(args)...))};
  }

  // A tensor added to `out` with `like`'s size, type and role, a storage of its own.
  static std::uint32_t add_tensor(Model& out, std::uint32_t like, std::string name);
  // A collective op over `axis` that moves `inputs` into `outputs`, in `near`'s layer and
  // no-offload region (Note [Collective ops] in model_check.cpp).
  struct Exchange {
    std::string_view kind;  // the functional collective's operator
    CollectiveKind forward;
    CollectiveKind backward;
    MeshAxis axis;
    std::int32_t nodes;
    std::int32_t sharing = 1;
  };
  ModelOp collective_op(std::string name, const Exchange& x, std::vector<std::uint32_t> inputs,
                        std::vector<std::uint32_t> outputs, const ModelOp& near) const;
  // `out`, or the refusal that says why the cut is not a valid model.
  Result<Model> checked(Model out) const;

  const Model& whole_;

 private:
  std::string_view flag_;
  std::int32_t degree_;
  bool validate_ = true;
};

// The cuts as the public functions of rank_model.hpp make them, past their arguments' checks
// (the degree 2 or more); with `validate` false the cut model is returned unvalidated, as
// rank_workload validates the last of its cuts once. A tensor-parallel refusal names the degrees
// that cut the model among those from 2 to `node_gpus` that `fits` accepts (the mesh's rules at
// that degree: a node holds whole groups, and the other axes' rules hold).
Result<Model> tensor_parallel_cut(const Model& whole, std::int32_t tp, std::int32_t node_gpus,
                                  const std::function<bool(std::int32_t)>& fits, bool validate);
Result<Model> context_parallel_cut(const Model& whole, std::int32_t cp, GroupPlacement group,
                                   bool validate);
Result<Model> expert_parallel_cut(const Model& whole, std::int32_t ep, std::int32_t nodes,
                                  double capacity, bool validate);

}  // namespace ferry::sim::rank_cut_detail
