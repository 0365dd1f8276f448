#pragma once
// Private to the simulated autograd: what runs where in a pipeline, derived once from the
// model, the partition starts and the skip connections.

#include <cstdint>
#include <map>
#include <vector>

#include "ferry/result.hpp"
#include "ferry/sim/autograd/pipeline.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::pipelining {

/// How an op reaches a tensor it reads or saves.
enum class Route : std::uint8_t {
  Resident,  ///< a parameter or module buffer: a replica on every device that uses it
  Input,     ///< the batch: loaded on every device that uses it, per micro-batch
  Local,     ///< produced in the same partition
  Chain,     ///< produced in an earlier partition, copied along the partition chain
  Portal,    ///< a skip connection's tensor, taken from its portal
};

struct Access {
  std::uint32_t tensor = 0;  ///< the model tensor (a view or a base)
  std::uint32_t base = 0;    ///< the tensor owning the storage
  Route route = Route::Local;
  std::uint32_t skip = 0;  ///< Portal only

  [[nodiscard]] bool same_source(const Access& other) const {
    return route == other.route && base == other.base &&
           (route != Route::Portal || skip == other.skip);
  }
  [[nodiscard]] bool held() const {
    return route == Route::Local || route == Route::Chain || route == Route::Portal;
  }
};

struct SkipPlan {
  std::uint32_t tensor = 0;
  std::uint32_t consumer = 0;
  std::uint32_t producer = 0;
  std::uint32_t from = 0;  ///< partition of the producer
  std::uint32_t to = 0;    ///< partition of the consumer
  bool cross = false;      ///< from != to: through a portal (else a plain local tensor)
  bool grad = false;       ///< the consumer's backward runs, so a gradient comes back
};

struct Counts {
  std::int32_t reads = 0;  ///< ops reading it
  std::int32_t saves = 0;  ///< saved-tensor entries naming it
};

// What runs where, derived once from the model, the partition starts and the skips.
struct Plan {
  std::vector<std::uint32_t> starts;
  std::vector<std::uint32_t> partition_of;  ///< per op
  std::vector<std::uint32_t> generator_of;  ///< per op: the random generator it draws from
  std::uint32_t generators = 1;
  std::vector<std::uint32_t> base;     ///< per tensor
  std::vector<std::int32_t> producer;  ///< per tensor: the op producing it, or -1
  std::vector<bool> needed;            ///< per op: its backward runs
  std::vector<bool> grad_flows;        ///< per base: a gradient reaches it
  std::vector<SkipPlan> skips;
  std::vector<std::vector<Access>> reads;              ///< per op, per input slot
  std::vector<std::vector<Access>> saves;              ///< per op, per saved entry
  std::vector<std::vector<Access>> uses;               ///< per op: distinct held sources it reads
  std::vector<std::vector<std::uint32_t>> pops;        ///< per op: cross skips it consumes
  std::vector<std::vector<std::uint32_t>> stashes;     ///< per op: cross skips of its outputs
  std::vector<std::vector<std::uint32_t>> skips_into;  ///< per partition: cross skips, by source
  std::vector<std::vector<std::uint32_t>> skips_from;  ///< per partition: cross skips with grads
  std::vector<std::vector<std::uint32_t>> chain_in;    ///< per partition: bases copied in
  std::vector<std::vector<std::uint32_t>> grad_back;   ///< per partition: gradients sent back
  std::vector<std::map<std::uint32_t, Counts>> chain_counts;  ///< per partition, per base
  std::vector<Counts> local_counts;                           ///< per base
  std::vector<std::int32_t> portal_saves;                     ///< per skip
  std::vector<std::vector<std::uint32_t>> inputs_of;          ///< per partition: batch inputs used
  std::vector<std::vector<std::uint32_t>> params_of;  ///< per partition: resident tensors used
  std::vector<std::vector<std::uint32_t>> grads_of;   ///< per partition: params read (grads)
  /// Per partition: the optimizer state it holds (Note [A stage's optimizer state]).
  std::vector<std::vector<std::uint32_t>> state_of;

  [[nodiscard]] std::uint32_t partitions() const {
    return static_cast<std::uint32_t>(starts.size() - 1);
  }
};

/// The skips are in range, stash activations with storage, and name ops that read them.
Status check_skips(const Model& model, const std::vector<SkipConnection>& skips);
/// Every view an op of the (valid) model outputs is produced with its base.
Status check_views(const Model& model);
/// The plan of `model` split at `starts`; op k draws from generator `generator_of[k]`.
Plan make_plan(const Model& model, std::vector<std::uint32_t> starts,
               std::vector<std::uint32_t> generator_of, const std::vector<SkipConnection>& skips);

}  // namespace ferry::sim::pipelining
