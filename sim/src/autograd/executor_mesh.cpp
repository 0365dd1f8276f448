#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <vector>

#include "executor.hpp"
#include "ferry/sim/engine/collective_cost.hpp"
#include "mesh_collectives.hpp"
#include "step_failure.hpp"

namespace ferry::sim::pipelining {

// Note [A pipeline on the mesh]
// Each pipeline stage is run by a sub-mesh of its own (torchtitan's order pp x dp_replicate x
// dp_shard x cp x tp, the pipeline outermost), whose groups are laid out as one mesh's are; one
// GPU of each stage is simulated. Its model is the rank's model the cuts make (rank_workload),
// split into stages: the activations sent stage to stage are the cut ones (a 1/tp slice of the
// tokens under sequence parallelism, 1/cp of the sequence).
//
// A stage's collective op runs as MeshCollectives runs it on one rank (Note [Mesh collectives]):
// on the device's "mesh comm" stream, on the lane of its axis, after that stream waits for the
// compute stream (W1), and the compute stream waits for it at once (W2), so what it reads and
// writes is freed in compute-stream order. PipelineFaults::skip_collective_launch_wait and
// skip_collective_output_wait drop them.
//
// Under FSDP each stage keeps its gathered parameters for the step, as torchtitan shards a
// pipeline's stages (its default reshard_after_forward is `not pp_enabled`, so that the
// micro-batches do not all-gather again each forward) and as torch's pipeline stage runs
// FSDP's backward (no reshard and no gradient sync before the last micro-batch): on the
// device's "fsdp comm" stream, once a step, the stage's parameters are all-gathered from its
// shard after their initialization (W3) and before its first forward (W4), and its summed
// gradients reduce-scattered into a shard after its last backward (W5, all-reduced over HSDP's
// replicas after) and before the optimizer reads that shard (W6). The faults skip_gather_* and
// skip_reduce_* drop W3..W6. The stage holds AdamW's moments of its shard from set-up, as Fsdp2
// does (the rank model's optimizer state is FSDP's, Fsdp2::holds). Not modelled: the units'
// separate all-gathers overlapping the first forward.

// Note [Sends between nodes]
// A stage sends its activations forward, and its input gradients back (a skip connection's
// portal, further), over the profile's peer link (NVLink) to a device on its node. Stages lie
// one after another (the pipeline outermost: Mesh::node_of_stage); a send to a device on another
// node crosses the network. NCCL's point-to-point transfer between nodes goes through the sending
// GPU's own NIC, and the profile's inter-node figure is the node's NICs together (docs/fsdp.md,
// "The link model"), so such a send runs at that figure over the node's GPUs (45 GB/s of the H100
// profile's 360), at the inter-node latency; every GPU of a stage sending at once has a NIC of
// its own.
std::vector<ProgramLink> stage_links(const DeviceProfile& profile, const Mesh& mesh,
                                     std::uint32_t devices) {
  const CollectiveLinks& network = profile.collectives;
  std::vector<ProgramLink> links;
  if (mesh.group(Mesh::Axis::Pipeline).nodes <= 1 || !network.inter_node.known()) return links;
  const Bandwidth rate(std::max<std::int64_t>(
      1, network.inter_node.bandwidth.bytes_per_s() / std::max(1, network.gpus_per_node)));
  for (std::uint32_t a = 0; a < devices; ++a) {
    for (std::uint32_t b = 0; b < devices; ++b) {
      if (mesh.node_of_stage(static_cast<std::int32_t>(a)) !=
          mesh.node_of_stage(static_cast<std::int32_t>(b))) {
        links.push_back(ProgramLink{DeviceId(a), DeviceId(b), rate, network.inter_node.latency});
      }
    }
  }
  return links;
}

std::optional<CollectiveLane> Executor::collective_lane(std::uint32_t k, bool backward) const {
  const OpCollective& c = model_.ops[k].collective;
  if (!c.any() || !(backward ? c.backward : c.forward)) return std::nullopt;
  return training::lane_of(c.axis);
}

void Executor::add_mesh_streams() {
  if (mesh_.parallelism().ep > 1) {
    for (const ModelOp& op : model_.ops) {
      if (!is_grouped_matmul_kind(op.kind)) continue;
      for (const std::uint32_t t : op.inputs) {
        const std::uint32_t b = plan_.base[t];  // a weight may be read through a view
        if (model_.tensors[b].role == TensorRole::Param) expert_params_.insert(b);
      }
    }
  }
  const bool collectives =
      std::ranges::any_of(model_.ops, [](const ModelOp& op) { return op.collective.any(); });
  for (std::uint32_t d = 0; d < ndev_; ++d) {
    if (collectives) mesh_comm_.push_back(sim_.add_stream(DeviceId(d), "mesh comm"));
    if (mesh_.on()) fsdp_comm_.push_back(sim_.add_stream(DeviceId(d), "fsdp comm"));
  }
}

void Executor::stream_wait(std::uint32_t d, StreamId waiter, StreamId on, bool drop) {
  if (drop) return;
  Device& device = *devices_[d];
  const Device::Event e = device.make_event();
  device.record(e, Device::Stream{on});
  device.wait(Device::Stream{waiter}, e);
}

std::vector<Executor::ShardGroup> Executor::shard_groups(
    const std::map<std::uint32_t, TensorId>& held) const {
  // Under expert parallelism the experts' weights (a grouped matmul's) are a unit of their own,
  // sharded over the expert shard group, as Fsdp2 shards them.
  std::vector<ShardGroup> groups = {ShardGroup{Mesh::Axis::Shard, {}, Bytes(0)},
                                    ShardGroup{Mesh::Axis::ExpertShard, {}, Bytes(0)}};
  for (const auto& [b, h] : held) {
    ShardGroup& g = groups[expert_params_.contains(b) ? 1 : 0];
    g.held.push_back(h);
    g.bytes += bufs_[h.value()].bytes;
  }
  std::erase_if(groups, [](const ShardGroup& g) { return g.held.empty(); });
  return groups;
}

Bytes Executor::shard_of(const ShardGroup& g) const {
  const std::int64_t size = std::max(1, mesh_.group(g.axis).size);
  return Bytes((g.bytes.count() + size - 1) / size);
}

void Executor::gather_parameters() {
  for (std::uint32_t d = 0; d < ndev_; ++d) {
    const StreamId compute = devices_[d]->compute_stream().id;
    param_shards_.emplace_back();
    moment_shards_.emplace_back();
    for (const ShardGroup& g : shard_groups(resident_[d])) {
      const TensorId shard = allocate(d, streams_->compute(d), shard_of(g), Kind::Static, 1,
                                      "parameters (FSDP shard)");
      param_shards_.back().push_back(shard);
      // AdamW's two moments of the shard, held from set-up as Fsdp2 holds them from its first
      // optimizer step on.
      const TensorId moments = allocate(d, streams_->compute(d), 2 * shard_of(g), Kind::Static, 1,
                                        "AdamW moments (FSDP shard)");
      moment_shards_.back().push_back(moments);
      launch(d, SimTime(1), {},
             {Write{shard, mix_content(tag::kParam, shard.value()), 0},
              Write{moments, mix_content(tag::kParam, moments.value()), 0}},
             "init parameter shard");
      stream_wait(d, fsdp_comm_[d], compute, faults_.skip_gather_launch_wait);
      // In chunks of at most kMaxWrites parameters, as their initialization runs.
      for (std::size_t at = 0; at < g.held.size(); at += kMaxWrites) {
        std::vector<Region> writes;
        std::vector<std::uint64_t> values;
        Bytes bytes(0);
        for (std::size_t p = at; p < std::min(g.held.size(), at + kMaxWrites); ++p) {
          writes.push_back(whole(g.held[p]));
          values.push_back(content(g.held[p]));
          bytes += buf(g.held[p]).bytes;
        }
        const Region from = whole(shard);
        const SimTime time = collective_time(CollectiveKind::AllGather, bytes,
                                             mesh_.group(g.axis).placement(), profile_.collectives);
        const OpId op = sim_.collective(fsdp_comm_[d], time, std::span(&from, 1), writes,
                                        "all-gather parameters", values, CollectiveLane::Fsdp);
        buf(shard).last_use = op;
        for (std::size_t p = at; p < std::min(g.held.size(), at + kMaxWrites); ++p) {
          buf(g.held[p]).last_use = op;
        }
      }
    }
    stream_wait(d, compute, fsdp_comm_[d], faults_.skip_gather_arrival_wait);
  }
}

std::vector<Executor::Read> Executor::reduce_gradients(std::uint32_t d) {
  const CollectiveLinks& links = profile_.collectives;
  const StreamId compute = devices_[d]->compute_stream().id;
  stream_wait(d, fsdp_comm_[d], compute, faults_.skip_reduce_launch_wait);
  std::vector<Read> optimizer;
  for (const ShardGroup& g : shard_groups(param_grads_[d])) {
    std::vector<Region> reads;
    std::uint64_t value = grad_content(g.held.front().value());
    for (const TensorId h : g.held) {
      reads.push_back(whole(h));
      value = mix_content(value, content(h));
    }
    const TensorId shard =
        allocate(d, streams_->compute(d), shard_of(g), Kind::Static, 1, "gradients (FSDP shard)");
    const Region to = whole(shard);
    sim_.collective(fsdp_comm_[d],
                    collective_time(CollectiveKind::ReduceScatter, g.bytes,
                                    mesh_.group(g.axis).placement(), links),
                    reads, std::span(&to, 1), "reduce-scatter gradients", std::span(&value, 1),
                    CollectiveLane::Fsdp);
    const MeshGroup replicas = mesh_.group(Mesh::Axis::Replicate);
    if (replicas.size > 1) {
      sim_.collective(
          fsdp_comm_[d],
          collective_time(CollectiveKind::AllReduce, shard_of(g), replicas.placement(), links),
          std::span(&to, 1), std::span(&to, 1), "all-reduce gradient shard", std::span(&value, 1),
          CollectiveLane::Fsdp);
    }
    set_content(shard, value);
    optimizer.push_back(Read{shard, whole(shard), value});
  }
  stream_wait(d, compute, fsdp_comm_[d], faults_.skip_reduce_arrival_wait);
  for (const TensorId params : param_shards_[d]) {
    optimizer.push_back(Read{params, whole(params), content(params)});
  }
  return optimizer;
}

}  // namespace ferry::sim::pipelining
