#pragma once
// Private to the simulated autograd: the single-device driver. It replays a model's forward
// and backward as PyTorch's engine would, with the offloader's hooks and checkpoint frames,
// on the toolkit it shares with the pipeline executor (graph.hpp, values.hpp).

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/checkpoint.hpp"
#include "ferry/offload/offloader.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/device/device.hpp"
#include "ferry/sim/support/by_id.hpp"
#include "graph.hpp"
#include "scratch.hpp"
#include "step_hooks.hpp"
#include "values.hpp"

namespace ferry::sim::training {

// See Note [Content values] in values.hpp.

struct Bound {
  Device::Buffer buffer;
  Bytes offset;
  std::uint64_t value = 0;
};

// How a saved tensor was packed. Param: a parameter the step hooks hold (FSDP's), saved as the
// parameter object whose storage they free and gather again (Note [FSDP2, one rank] in
// fsdp.cpp); unpacked where it lives then. Hook: taken by a saved-tensor hook the step hooks
// pushed (the paged stash's, Note [Step hooks]).
struct Saved {
  enum class Kind : std::uint8_t { Offload, Holder, Param, Hook } kind = Kind::Offload;
  TensorId id;
  HolderId holder;
  std::uint32_t hook = 0;    // Hook: which, by the order pushed
  std::uint32_t packed = 0;  // Hook: its id there
  std::uint32_t tensor = 0;
  Pieces expected;  // what its bytes held in forward
};

// What the checkpointer keeps for a recomputed tensor: a storage reference and the value.
struct Recomputed {
  Device::Buffer buffer;
  Bytes offset;
  std::uint64_t value = 0;
};

// The innermost saved-tensor hook: the offloader (none pushed), a frame, or a recomputation.
struct Context {
  enum class Kind : std::uint8_t { Frame, Recompute, NoGrad } kind;
  FrameId frame;
};

// The random generators: the device's and the CPU's.
constexpr std::size_t kDeviceRng = 0;
constexpr std::size_t kCpuRng = 1;

// A frame's entries by tensor, in tensor order as a std::map keeps them, in one vector: a frame
// holds a layer's few outputs, and a map took a node for each.
template <class V>
class ByTensor {
 public:
  using Items = std::vector<std::pair<std::uint32_t, V>>;
  V& operator[](std::uint32_t t) {
    auto it = std::lower_bound(items_.begin(), items_.end(), t, before);
    if (it == items_.end() || it->first != t) it = items_.emplace(it, t, V{});
    return it->second;
  }
  [[nodiscard]] typename Items::const_iterator find(std::uint32_t t) const {
    const auto it = std::lower_bound(items_.begin(), items_.end(), t, before);
    return it != items_.end() && it->first == t ? it : items_.end();
  }
  [[nodiscard]] typename Items::const_iterator begin() const { return items_.begin(); }
  [[nodiscard]] typename Items::const_iterator end() const { return items_.end(); }

 private:
  static bool before(const std::pair<std::uint32_t, V>& item, std::uint32_t t) {
    return item.first < t;
  }
  Items items_;
};

struct FrameInfo {
  std::uint32_t region = 0;
  std::vector<Saved> inputs;            // the region's inputs, saved by the parent
  Generators generators{2};             // at the region's start
  ByTensor<Bound> cache;                // MustSave outputs (forward references)
  ByTensor<Saved> offloaded;            // Offload-policy outputs
  ByTensor<std::uint64_t> view_values;  // their views' forward content values
  std::uint32_t last_pack_op = 0;       // op during which its last holder was packed
  std::size_t taken = 0;                // holders taken in the current backward
  bool released = false;                // inputs and caches let go
};

// One rank of a node run (Note [Node run] in node_run.cpp): the simulator the ranks share,
// this rank's device there, and the turn it takes before each forward op and backward node.
struct NodeRank {
  Simulator* sim = nullptr;
  DeviceId device{};
  std::function<void()> take_turn;
};

// The Trainer is the autograd engine of one rank: the hooks of the run's parallelism reach it
// as their RankContext (Note [Step hooks]).
class Trainer final : private RankContext {
 public:
  // Trains on a simulator of its own, one device; or, given a node rank, on that rank's device
  // of the shared simulator, which it leaves unfinished.
  Trainer(const Model& model, const DeviceProfile& profile, const TrainingOptions& options,
          const TrainingFaults& faults, NodeRank rank = {});

  Result<TrainingRun> run();

 private:
  // Reserves the simulator's record vectors for the run's calls (an estimate).
  void reserve_calls();
  // --- the rank, as the step hooks see it (RankContext) ----------------------------------

  Simulator& sim() override { return sim_; }
  DeviceId device_id() const override { return dev_; }
  Device& device() override { return device_; }
  StreamId current_stream() const override { return current_; }
  Device::Buffer allocate_on(StreamId stream, Bytes bytes, std::string_view name) override;
  void bind_param(std::uint32_t p, Device::Buffer buffer, Bytes offset) override;
  std::optional<Device::Buffer> take_param_grad(std::uint32_t p) override;
  std::pair<Device::Buffer, std::uint64_t> param_grad(std::uint32_t p) const override;
  void note_write(Device::Buffer buf, Bytes offset, Bytes bytes, std::uint64_t value) override;
  void push_saved_tensor_hook(SavedTensorHook& hook) override { saved_hooks_.push_back(&hook); }

  // --- set-up and validation --------------------------------------------------------------

  Status validate_plan() const;

  std::uint32_t base(std::uint32_t t) const { return graph_.base[t]; }

  // Device bytes allocated, less blocks whose free waits behind record_stream markers: those
  // return at the next allocation (as in PyTorch), so they are not held by the step.
  Bytes allocated() const;

  // Tensor t's name and ".grad", in label_ until the next label is made there.
  // Empty when the simulator keeps no labels (SimOptions::timeline off).
  std::string_view grad_label(std::uint32_t t) {
    if (!labels_) return {};
    return label_.assign(model_.tensors[t].name).append(".grad");
  }
  // Allocates on the current stream, as the caching allocator does.
  Device::Buffer must_allocate(Bytes bytes, std::string_view name) {
    return allocate_on(current_, bytes, name);
  }
  // The cuBLAS workspaces a step holds (Note [Library workspaces]).
  void allocate_blas_workspaces();

  // --- streams (Note [Side streams] in trainer.cpp) -----------------------------------------

  // The stream forward op i (or its backward node) runs on; a replay's ops run on the side
  // stream when recomputes do.
  StreamId op_stream(std::uint32_t i, bool replay) const;

  // Makes `to` current after it waits for the current stream. Returns the stream that was.
  StreamId switch_to(StreamId to);

  // A kernel on the current stream touches these regions: a buffer the trainer allocated on
  // another stream is record_stream'ed on this one (once).
  void used_on_current(const std::vector<Region>& regions);

  void setup();

  // In a node run, waits for this rank's turn (Note [Node run]).
  void take_turn() const {
    if (take_turn_) take_turn_();
  }

  // --- tensors, scopes and content ----------------------------------------------------------

  // Where tensor t lives now: the innermost scope binding it (views through their base).
  Bound lookup(std::uint32_t t) const;

  Region region(std::uint32_t t) const;

  // A tensor came back (reloaded, or served from forward) at `where`: it holds what it held
  // when it was saved.
  void note_arrival(const Bound& where, const Pieces& saved);

  // What tensor t, bound at `b` (its lookup), holds now.
  Pieces expected_of(std::uint32_t t, const Bound& b) const;

  // Where each tensor bound in a scope lives, by tensor index: a look-up is an index, and
  // clearing resets only what was bound (scopes are kept and reused, Note [Scratch]). Sized for
  // the model's tensors when made, so a reference into it stays valid while others are bound.
  class BoundTable {
   public:
    explicit BoundTable(std::size_t tensors) : bound_(tensors), has_(tensors, 0) {}
    [[nodiscard]] const Bound* find(std::uint32_t t) const {
      return t < has_.size() && has_[t] != 0 ? &bound_[t] : nullptr;
    }
    [[nodiscard]] const Bound& at(std::uint32_t t) const {
      const Bound* b = find(t);
      FERRY_CHECK(b != nullptr, "tensor {} is not bound in this scope", t);
      return *b;
    }
    Bound& operator[](std::uint32_t t) {
      FERRY_CHECK(t < has_.size(), "tensor {} is outside the model", t);
      if (has_[t] == 0) {
        has_[t] = 1;
        bound_[t] = Bound{};
        set_.push_back(t);
      }
      return bound_[t];
    }
    void clear() {
      for (const std::uint32_t t : set_) has_[t] = 0;
      set_.clear();
    }

   private:
    std::vector<Bound> bound_;
    std::vector<std::uint8_t> has_;
    std::vector<std::uint32_t> set_;  // the tensors bound, to clear
  };

  struct Scope {
    BoundTable bound;                   // tensor -> where it lives in this scope
    std::vector<Device::Buffer> owned;  // references this scope drops at its end
  };

  // Opens a scope (the step's, or a replay's), reusing one a closed replay left.
  Scope& open_scope();

  // --- forward ops ----------------------------------------------------------------------------

  // After replaying op i: drops the replay's references to what op i read last (Note [A replay
  // frees as the forward does]).
  void drop_dead_in_replay(std::uint32_t i);

  // Runs forward op i in the innermost scope. In a replay, outputs are owned by the scope.
  void run_op(std::uint32_t i, bool replay);

  // Saves tensor t of op `node` through the innermost hook.
  Saved pack(std::uint32_t node, std::uint32_t t);

  SavedMeta meta_of(std::uint32_t t, std::uint64_t value) const;

  // Inputs of ops [first, end) produced before `first` (activations and the batch).
  std::vector<std::uint32_t> region_inputs(std::uint32_t first, std::uint32_t end);

  OpPolicy policy(std::uint32_t op) const;

  // Regions that start at op i, outermost first / end at op i + 1, innermost first.
  std::vector<std::uint32_t> regions_starting(std::uint32_t i, std::uint32_t within_first,
                                              std::uint32_t within_end, std::int32_t except) const;

  void begin_region(std::uint32_t r);

  void end_region();

  bool replaying() const;

  // Saves the op's tensors, honouring the selective policy inside a frame.
  void save_op(std::uint32_t i);

  void forward();
  // Note [Held activations]: the loop's reference to op i's held outputs replaces the previous
  // step's; release_held drops them all when the run ends.
  void hold_outputs(std::uint32_t i);
  void release_held();

  // --- backward ---------------------------------------------------------------------------

  // Gets a saved tensor back for node `node`: from the offloader, or from its frame (which is
  // recomputed first if this graph task has not done so). The caller owns one reference.
  Bound unpack(const Saved& s, std::uint32_t node);

  // Autograd lets go of a saved tensor the offloader or a saved-tensor hook holds.
  void release_saved(const Saved& s);

  void release_frame(FrameInfo& info);

  // Opens a replay of a region: its saved inputs come back (which may first recompute a parent,
  // Note [Nestable checkpoint]) into a new scope that owns those references, and the
  // generators go back to where they stood when the region began. Returns the live states.
  Generators open_replay(const FrameInfo& info, std::uint32_t node);

  // Ends the innermost scope, dropping the references it owns.
  void close_scope();

  void recompute(FrameId frame, std::uint32_t node);

  void replay_op(std::uint32_t i, FrameInfo& info);

  std::vector<std::uint32_t> backward_order();

  Device::Buffer& grad(std::uint32_t t);

  std::int32_t reentrant_region_of(std::uint32_t op) const;

  // Backward node n: unpack, one kernel reading what it needs and writing gradients, drop,
  // post-hook, release.
  void run_node(std::uint32_t n, bool last_pass, std::size_t k);

  // Node n's saved tensors, unpacked (into `unpacked`) and read by its kernel; their values
  // fold into `g`. The caller owns one reference to each storage unpacked.
  void unpack_node(std::uint32_t n, std::vector<Region>& reads, std::uint64_t& g,
                   std::vector<Device::Buffer>& unpacked);

  // The gradients node n writes for its inputs (each base once, summed over consumers), with
  // the earlier sums they read; the bases written go into `written`, the storages its kernel
  // leaves behind into `spent`.
  void write_input_grads(std::uint32_t n, std::uint64_t g, std::vector<Region>& reads,
                         std::vector<Region>& writes, std::vector<std::uint64_t>& values,
                         std::vector<std::uint32_t>& written, std::vector<Device::Buffer>& spent);

  // One backward node's gradient of parameter p, `through_view` when it comes back through a
  // whole view of p (Note [A parameter's gradients]).
  void receive_param_grad(std::uint32_t p, bool through_view, std::uint64_t v,
                          std::vector<Region>& reads, std::vector<Region>& writes,
                          std::vector<std::uint64_t>& values, std::vector<Device::Buffer>& spent);

  // After node n's kernel: the unpacked storages go (one may escape into the next node), so do
  // its outputs' gradients; the post-hook runs, and the last pass releases what it saved.
  void let_go_after_node(std::uint32_t n, bool last_pass, std::size_t k,
                         const std::vector<Device::Buffer>& unpacked);

  // A backward through node k in a graph task of its own, in the middle of forward: its saved
  // tensors come back (a frame still running is recomputed from its inputs), its kernel runs
  // into a scratch result, and nothing is released: the real backward needs them again.
  void backward_inside(std::uint32_t k);

  // The reentrant variant: at the region's last node, re-run its forward (with the ambient
  // hooks), then its nodes in reverse, as a nested backward would.
  void run_reentrant(std::uint32_t r, bool last_pass, std::size_t k);

  void backward(bool last_pass);

  // The optimizer's step over the parameters this rank holds whole (Note [The optimizer step]
  // in model.cpp); FSDP's shards step in Fsdp2::optimizer_step.
  void optimizer_step();

  void step();

  struct OpenRegion {
    std::uint32_t region;
    FrameId frame;
    bool had_device_rng;
  };

  const Model& model_;
  const TrainingOptions& options_;
  Graph graph_;
  TrainingRun run_;
  Simulator& sim_;  // run_.sim, or a node run's
  DeviceId dev_;    // this rank's device in sim_
  std::function<void()> take_turn_;
  StreamId compute_;
  StreamId side_;                              // invalid unless options_.side asks for work there
  StreamId current_;                           // the stream current now: compute_ or side_
  TensorSlots<std::uint32_t> last_grad_node_;  // parameter -> node writing it last
  // A parameter's gradients in one backward pass (Note [A parameter's gradients]).
  struct GradSum {
    std::uint32_t producers = 0;           // the pass's nodes writing a gradient of it
    std::uint32_t arrived = 0;             // of which have run
    std::optional<Device::Buffer> buffer;  // the engine's input buffer: their sum so far
    std::uint64_t value = 0;               // its content
    bool in_place = false;                 // a later gradient is added into it in place
  };
  TensorSlots<GradSum> grad_sums_;
  Device device_;
  Offloader<Device> offloader_;
  TrainingFaults faults_;
  Bytes blas_workspace_;                       // one cuBLAS workspace (the profile's); 0: none
  std::unique_ptr<StepHooks> hooks_;           // the run's units, or no-ops (Note [Step hooks])
  std::vector<SavedTensorHook*> saved_hooks_;  // pushed by hooks_'s units, innermost last
  Checkpointer<Recomputed> checkpointer_;
  std::vector<Scope> scopes_;
  std::vector<Scope> spare_scopes_;  // closed, cleared, kept for their tables' capacity
  TensorSlots<Bound> params_;
  TensorSlots<Device::Buffer> param_grads_;
  TensorSlots<std::uint64_t> param_grad_values_;
  ContentMap content_;
  std::vector<StreamId> alloc_stream_;  // by BufferId, for must_allocate's buffers
  std::set<std::pair<std::uint32_t, std::uint32_t>> recorded_;  // (buffer, stream) record_stream'ed
  std::vector<std::optional<Device::Buffer>> grads_;
  std::vector<std::uint64_t> grad_values_;
  std::vector<std::int32_t> last_use_;
  // The activations whose forward reference ends after op i: drop_list_[drop_start_[i],
  // drop_start_[i + 1]) (dropped_after).
  std::vector<std::uint32_t> drop_start_;
  std::vector<std::uint32_t> drop_list_;
  [[nodiscard]] std::span<const std::uint32_t> dropped_after(std::uint32_t i) const {
    return std::span<const std::uint32_t>(drop_list_)
        .subspan(drop_start_[i], drop_start_[i + 1] - drop_start_[i]);
  }
  TensorSlots<Device::Buffer> held_;  // Note [Held activations]: the loop's references, by tensor
  std::vector<std::vector<Saved>> saved_;
  std::vector<std::int32_t> region_of_op_;
  std::vector<Context> contexts_;
  std::vector<OpenRegion> open_;
  // Vectors and a label for each op's and node's kernel, kept for their capacity: the planner
  // simulates the same step thousands of times.
  ScratchPool<Region> region_scratch_;
  ScratchPool<std::uint64_t> value_scratch_;
  ScratchPool<Device::Buffer> buffer_scratch_;
  ScratchPool<std::uint32_t> index_scratch_;
  std::string label_;
  bool labels_ = true;  // the simulator keeps call labels (SimOptions::timeline)
  // By op: the checkpoint regions that begin there, outermost first (regions_starting).
  std::vector<std::vector<std::uint32_t>> starting_;
  // By region: its inputs (region_inputs), made at its first begin.
  std::vector<std::optional<std::vector<std::uint32_t>>> region_inputs_;
  std::vector<std::uint32_t> seen_;  // region_inputs' marks, by tensor
  std::uint32_t seen_mark_ = 0;
  // By FrameId. A deque: replays begin new frames while references to older ones are held.
  std::deque<FrameInfo> frames_;
  std::map<std::uint32_t, FrameInfo> reentrant_inputs_;
  std::optional<Device::Buffer> escaped_;
  Generators generators_{2};
  bool device_rng_initialized_ = true;
  std::uint64_t gid_ = 0;
  std::int32_t step_ = 0;
  bool in_last_step_ = false;
  OffloadTelemetry step_start_telemetry_;  // the offloader's counters when this step began
  bool stop_replay_ = false;
  int dropped_in_replay_ = 0;
  std::uint32_t current_op_ = 0;  // the forward op being run or replayed
  bool last_pass_ = true;         // the current backward frees the graph
};

}  // namespace ferry::sim::training
