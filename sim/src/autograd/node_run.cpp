#include "ferry/sim/autograd/autograd.hpp"

#include <fmt/format.h>

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "trainer.hpp"

namespace ferry::sim {

namespace {

// Note [Node run]
// A one-rank simulation cannot see what the ranks of a node share: their host, and with it the
// pinned memory the offloaders copy into. A node run trains `ranks` ranks on one simulator with
// a process per device (Note [Processes] in simulator.cpp), each rank a Trainer on a thread of
// its own. The threads never run together: a baton passes from rank to rank, in rank order,
// before every forward op and backward node, so the interleaving, and everything the run
// reports, is the same on every run. A rank that finishes (or fails) leaves the rotation.
// Collectives do not order one rank's streams after another's here; only bytes the ranks
// share could race, and with pools at their own addresses they share none.
class Baton {
 public:
  Baton(Simulator& sim, std::size_t ranks) : sim_(sim), done_(ranks, false) {}

  // Waits until it is `rank`'s turn, then makes its process the one calling.
  void take(std::size_t rank) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return turn_ == rank; });
    sim_.set_host(DeviceId(static_cast<std::uint32_t>(rank)));
  }

  // `rank` hands the turn to the next rank still running, then takes it back when it comes.
  void pass(std::size_t rank) {
    {
      std::lock_guard lock(mutex_);
      turn_ = next_after(rank);
    }
    changed_.notify_all();
    take(rank);
  }

  void finish(std::size_t rank) {
    {
      std::lock_guard lock(mutex_);
      done_[rank] = true;
      turn_ = next_after(rank);
    }
    changed_.notify_all();
  }

 private:
  // The next rank after `rank` (cyclically) that has not finished; `rank` when it is the last.
  std::size_t next_after(std::size_t rank) const {
    for (std::size_t k = 1; k <= done_.size(); ++k) {
      const std::size_t r = (rank + k) % done_.size();
      if (!done_[r]) return r;
    }
    return rank;
  }

  Simulator& sim_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::size_t turn_ = 0;
  std::vector<bool> done_;
};

}  // namespace

Result<NodeRun> simulate_node(const Model& model, const DeviceProfile& device,
                              const TrainingOptions& options, std::int32_t ranks,
                              const TrainingFaults& faults) {
  auto checked = check_model(model);
  if (!checked) return checked.error();
  return simulate_node(checked.value(), device, options, ranks, faults);
}

Result<NodeRun> simulate_node(const CheckedModel& checked, const DeviceProfile& device,
                              const TrainingOptions& options, std::int32_t ranks,
                              const TrainingFaults& faults) {
  const Model& model = *checked;
  const Mesh& mesh = options.parallel.mesh;  // checked where it was chosen
  const Parallelism& p = mesh;
  if (!p.on())
    return Error{"a node run trains FSDP ranks: set the mesh's fsdp ranks (parallel.mesh)"};
  const std::int32_t per_node = p.ranks_per_node(device.collectives.gpus_per_node);
  if (ranks < 2 || ranks > per_node) {
    return Error{fmt::format("a node run needs 2 to {} ranks (the ranks per node), not {}",
                             per_node, ranks)};
  }
  SimOptions sim_options = options.sim;
  sim_options.process_per_device = true;
  std::vector<DeviceSpec> specs;
  for (std::int32_t r = 0; r < ranks; ++r) {
    specs.push_back(DeviceSpec{fmt::format("rank{}", r), mesh.rank_profile(device)});
  }
  SimFaults sim_faults;
  sim_faults.shared_pinned_pool = faults.shared_pinned_pool;
  NodeRun node{.sim = Simulator(std::move(specs), {}, sim_options, sim_faults),
               .failures = std::vector<std::optional<Failure>>(static_cast<std::size_t>(ranks)),
               .gradient_values = {}};
  node.gradient_values.resize(static_cast<std::size_t>(ranks));
  Baton baton(node.sim, static_cast<std::size_t>(ranks));
  std::vector<std::unique_ptr<training::Trainer>> trainers;
  for (std::int32_t r = 0; r < ranks; ++r) {
    const auto rank = static_cast<std::size_t>(r);
    trainers.push_back(std::make_unique<training::Trainer>(
        model, device, options, faults,
        training::NodeRank{.sim = &node.sim,
                           .device = DeviceId(static_cast<std::uint32_t>(r)),
                           .take_turn = [&baton, rank] { baton.pass(rank); }}));
  }
  std::vector<std::optional<Result<TrainingRun>>> results(static_cast<std::size_t>(ranks));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  {
    std::vector<std::jthread> threads;
    for (std::size_t r = 0; r < trainers.size(); ++r) {
      threads.emplace_back([&, r] {
        baton.take(r);
        try {
          results[r] = trainers[r]->run();
        } catch (...) {
          errors[r] = std::current_exception();
        }
        baton.finish(r);
      });
    }
  }
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  trainers.clear();
  node.sim.finish();
  for (std::size_t r = 0; r < results.size(); ++r) {
    Result<TrainingRun>& result = *results[r];
    if (!result.ok()) return result.error();
    node.failures[r] = result.value().failure;
    node.gradient_values[r] = std::move(result.value().gradient_values);
  }
  return node;
}

}  // namespace ferry::sim
