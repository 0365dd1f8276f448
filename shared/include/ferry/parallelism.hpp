#pragma once
/// How a step trains across GPUs: FSDP2 (`fully_shard` on every layer and the root), as a model
/// file's or a plan file's "parallelism" section records it (docs/fsdp.md).

#include <cstdint>

namespace ferry {

struct Parallelism {
  std::int32_t fsdp = 0;                    ///< ranks; 0: one GPU
  std::int32_t nodes = 0;                   ///< 0: as few as the device's gpus_per_node allow
  std::int32_t hsdp = 1;                    ///< replica groups
  std::int32_t reshard_after_forward = -1;  ///< -1 true, 0 false, K: keep a 1/K shard

  friend bool operator==(const Parallelism&, const Parallelism&) = default;
};

}  // namespace ferry
