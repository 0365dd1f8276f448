#include <algorithm>
#include <utility>

#include "trainer.hpp"

namespace ferry::sim::training {

// Checkpoint regions in forward: which begin at an op, what each packs as its inputs, and the
// frame (or, reentrant, the no-grad context) each opens and closes.

std::vector<std::uint32_t> Trainer::region_inputs(std::uint32_t first, std::uint32_t end) {
  // seen_[t] == mark: t was produced or listed in this call.
  if (seen_.size() != model_.tensors.size()) seen_.assign(model_.tensors.size(), 0);
  const std::uint32_t mark = ++seen_mark_;
  std::vector<std::uint32_t> inputs;
  for (std::uint32_t i = first; i < end; ++i) {
    for (const std::uint32_t t : model_.ops[i].inputs) {
      if (is_resident(model_.tensors[base(t)].role) || seen_[t] == mark) continue;
      seen_[t] = mark;
      inputs.push_back(t);
    }
    for (const std::uint32_t t : model_.ops[i].outputs) seen_[t] = mark;
  }
  return inputs;
}

OpPolicy Trainer::policy(std::uint32_t op) const {
  const auto& p = options_.checkpoint.op_policy;
  return op < p.size() ? p[op] : OpPolicy::PreferRecompute;
}

std::vector<std::uint32_t> Trainer::regions_starting(std::uint32_t i, std::uint32_t within_first,
                                                     std::uint32_t within_end,
                                                     std::int32_t except) const {
  std::vector<std::uint32_t> out;
  const auto& regions = options_.checkpoint.regions;
  // Inside a replay of region `except`, only regions listed after it (nested in it) begin.
  // starting_ lists them outermost first, and a stable order filtered keeps its order.
  for (const std::uint32_t r : starting_[i]) {
    if (static_cast<std::int64_t>(r) > except && regions[r].first_op >= within_first &&
        regions[r].end_op <= within_end) {
      out.push_back(r);
    }
  }
  return out;
}

void Trainer::begin_region(std::uint32_t r) {
  const CheckpointRegion& reg = options_.checkpoint.regions[r];
  FrameInfo info;
  info.region = r;
  info.generators = generators_;
  const auto& chosen = options_.offload_selection.region_inputs;
  const bool keep_inputs = r < chosen.size() && !chosen[r];
  if (keep_inputs) offloader_.push_no_offload();
  if (!region_inputs_[r]) region_inputs_[r] = region_inputs(reg.first_op, reg.end_op);
  for (const std::uint32_t t : *region_inputs_[r]) info.inputs.push_back(pack(reg.end_op - 1, t));
  if (keep_inputs) offloader_.pop_no_offload();
  if (reg.reentrant) {
    contexts_.push_back(Context{Context::Kind::NoGrad, FrameId()});
    open_.push_back(OpenRegion{r, FrameId(), device_rng_initialized_});
    reentrant_inputs_[r] = std::move(info);
    return;
  }
  FrameOptions fo;
  fo.early_stop = reg.early_stop.value_or(true);
  fo.determinism_check = options_.checkpoint.determinism_check;
  fo.content_check = options_.checkpoint.content_check;
  const FrameId frame = checkpointer_.begin(fo);
  if (frames_.size() <= frame.value()) frames_.resize(frame.value() + 1);
  frames_[frame.value()] = std::move(info);
  contexts_.push_back(Context{Context::Kind::Frame, frame});
  open_.push_back(OpenRegion{r, frame, device_rng_initialized_});
}

void Trainer::end_region() {
  const OpenRegion open = open_.back();
  open_.pop_back();
  contexts_.pop_back();
  if (open.frame.valid()) {
    checkpointer_.end(open.frame);
    // A region that saved nothing is referenced by no holder: its inputs go now.
    if (checkpointer_.saved_count(open.frame) == 0) release_frame(frames_[open.frame.value()]);
  }
  if (options_.checkpoint.preserve_rng && !open.had_device_rng && device_rng_initialized_ &&
      !replaying()) {
    throw CheckpointError(
        "PyTorch's device state was initialized in the forward pass of a Checkpoint, which is "
        "not allowed. Please open an issue if you need this feature.");
  }
}

bool Trainer::replaying() const {
  return std::any_of(contexts_.begin(), contexts_.end(),
                     [](const Context& c) { return c.kind == Context::Kind::Recompute; });
}

}  // namespace ferry::sim::training
