// The offloader against a simple model of what autograd may ask of it: random sequences of
// pack, region enter/exit, release, backward begin, node runs (unpack + node_done) and
// backward end, for both policies, over a backend that checks every access and free for all
// timings (Note [Checked backend]). A failure shrinks to the shortest such sequence. Each
// planted fault of the offloader is caught by the same property.

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>
#include <rapidcheck/state.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checked_backend.hpp"
#include "ferry/offload/offloader.hpp"
#include "prop/planted.hpp"

namespace ferry {

void showValue(const OffloadOptions& o, std::ostream& os) {
  os << "policy " << policy_name(o.policy) << ", min_bytes " << o.min_bytes.count() << ", stash "
     << o.trl_stash_count << ", window " << o.window_bytes.count() << ", prefetch "
     << o.prefetch_bytes.count() << (o.prefetch ? "" : " (off)") << ", host_cap "
     << o.host_cap.count() << (o.dedup ? ", dedup" : "")
     << (o.use_streams ? "" : ", on the compute stream");
  if (o.horizon_bytes) os << ", horizon " << o.horizon_bytes->count();
}

namespace {

using testing::CheckedBackend;
using Buffer = CheckedBackend::Buffer;

// --- the model ------------------------------------------------------------------------------

// A saved tensor of the current graph.
struct Saved {
  std::uint32_t node = 0;
  bool released = false;  // its part of the graph was freed: never unpacked again
  bool ever_unpacked = false;
};

struct Model {
  Policy policy = Policy::Ferry;
  bool backward = false;
  int depth = 0;                     // no-offload regions open
  std::vector<Saved> saved;          // by pack order
  std::uint32_t next_node = 0;       // forward ops so far in this graph
  std::vector<std::uint32_t> order;  // backward: nodes still to run, in order
  bool retain = false;               // this backward keeps the graph
  std::int64_t stale = 0;            // trl: ids of freed graphs never unpacked
  bool trl_new_forward = true;       // trl-seed: the next pack starts a forward
  bool poisoned = false;             // trl-seed: a forward was refused (tracker not empty)
  bool open = false;                 // inside the offload context (packs happen only there)

  [[nodiscard]] std::int64_t tracked() const {
    std::int64_t n = stale;
    for (const Saved& s : saved) n += is_trl(policy) ? !s.ever_unpacked : !s.released;
    return n;
  }
};

// --- the system under test ------------------------------------------------------------------

struct Sut {
  Sut(const OffloadOptions& options, const OffloadFaults& faults) : off(backend, options, faults) {}

  CheckedBackend backend;
  Offloader<CheckedBackend> off;
  std::vector<TensorId> ids;          // by pack order
  std::vector<std::uint64_t> values;  // what each saved tensor holds at its offset
  std::map<int, Bytes> sizes;         // storage bytes of produced storages
  std::vector<Buffer> chain;          // the previous op's storages, alive for one more op
  std::vector<Buffer> params;         // parameters live for the whole run
  std::vector<Buffer> escaped;        // views kept past their node
  std::uint64_t next_value = 1;

  void expect(const Model& m) const {
    if (!backend.hazards.empty()) RC_FAIL(backend.hazards.front());
    RC_ASSERT(static_cast<std::int64_t>(off.tracked()) == m.tracked());
  }
  // Escaped views are read once more by compute, then dropped.
  void drop_escaped() {
    for (const Buffer b : escaped) {
      backend.compute_reads(b);
      backend.drop(b);
    }
    escaped.clear();
  }
};

using Command = rc::state::Command<Model, Sut>;

// Runs `command` on a copy of the model, for the state a command's run() must leave.
template <class C>
Model after(const C& command, const Model& m) {
  Model next = m;
  command.apply(next);
  return next;
}

// One forward op: saves one to three tensors (fresh storages, or views of its first storage),
// the first possibly a view of the previous op's storage (one storage saved by two nodes).
struct Pack final : Command {
  struct Tensor {
    std::int64_t bytes;
    bool view_of_first;
    bool is_param;
    bool on_device;
    bool no_offload;
  };
  std::vector<Tensor> tensors;
  bool share_previous = false;

  explicit Pack(const Model&) {
    const auto n = *rc::gen::inRange(1, 4);
    for (int i = 0; i < n; ++i) {
      tensors.push_back(Tensor{*rc::gen::element<std::int64_t>(512, 1024, 4096, 65536),
                               i > 0 && *rc::gen::weightedElement<bool>({{1, true}, {2, false}}),
                               *rc::gen::weightedElement<bool>({{1, true}, {12, false}}),
                               *rc::gen::weightedElement<bool>({{12, true}, {1, false}}),
                               *rc::gen::weightedElement<bool>({{1, true}, {8, false}})});
    }
    share_previous = *rc::gen::weightedElement<bool>({{1, true}, {3, false}});
  }

  void checkPreconditions(const Model& m) const override {
    RC_PRE(!m.backward);
    RC_PRE(!m.poisoned);
    RC_PRE(m.open);
  }

  // Only the seed refuses: today's reference starts a new forward once the tracker is empty.
  [[nodiscard]] static bool refused(const Model& m) {
    return m.policy == Policy::TrlSeed && m.trl_new_forward && m.tracked() > 0;
  }

  void apply(Model& m) const override {
    if (refused(m)) {
      m.poisoned = true;
      return;
    }
    m.trl_new_forward = false;
    const std::uint32_t node = m.next_node++;
    for (std::size_t i = 0; i < tensors.size(); ++i) m.saved.push_back(Saved{node});
  }

  void run(const Model& m, Sut& sut) const override {
    if (refused(m)) {
      RC_ASSERT_THROWS_AS(sut.off.pack(TensorFacts{}, Buffer{}), OffloadError);
      return;
    }
    std::vector<Buffer> made;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      TensorFacts facts;
      facts.bytes = Bytes(t.bytes);
      facts.node = NodeId(m.next_node);
      facts.on_device = t.on_device;
      facts.is_param = t.is_param;
      facts.no_offload = t.no_offload;
      Buffer storage;
      if (i == 0 && share_previous && !sut.chain.empty()) {
        storage = sut.chain.front();
        facts.bytes = Bytes(sut.sizes.at(storage.id).count() / 2);
      } else if (t.view_of_first && !made.empty()) {
        storage = made.front();
        facts.bytes = Bytes(sut.sizes.at(storage.id).count() / 2);
        facts.view_offset = facts.bytes;
      } else {
        // Two slots per storage, each with its own value: a view may start at the second.
        const std::uint64_t v = sut.next_value;
        sut.next_value += 2;
        storage = sut.backend.produce({{0, v}, {t.bytes, v + 1}});
        sut.sizes[storage.id] = Bytes(2 * t.bytes);
        made.push_back(storage);
        if (t.is_param) sut.params.push_back(storage);
      }
      facts.storage_bytes = sut.sizes.at(storage.id);
      facts.storage = static_cast<std::uint64_t>(storage.id);
      facts.address = static_cast<std::uint64_t>(storage.id);  // the backend reuses no address
      sut.values.push_back(*sut.backend.value(storage, facts.view_offset));
      sut.ids.push_back(sut.off.pack(facts, storage));
    }
    // The previous op's storages die now; this op's live until the next op ran.
    for (const Buffer b : sut.chain) sut.backend.drop(b);
    sut.chain.clear();
    for (const Buffer b : made) {
      if (std::find(sut.params.begin(), sut.params.end(), b) == sut.params.end()) {
        sut.chain.push_back(b);
      }
    }
    sut.expect(after(*this, m));
  }

  void show(std::ostream& os) const override {
    os << "Pack(";
    for (const Tensor& t : tensors) {
      os << " " << t.bytes << (t.view_of_first ? "/view" : "") << (t.is_param ? "/param" : "")
         << (t.on_device ? "" : "/cpu") << (t.no_offload ? "/no_offload" : "");
    }
    os << (share_previous ? " ; first views the previous op's storage)" : " )");
  }
};

struct EnterRegion final : Command {
  void checkPreconditions(const Model& m) const override { RC_PRE(!m.backward && !m.poisoned); }
  void apply(Model& m) const override { ++m.depth; }
  void run(const Model& m, Sut& sut) const override {
    sut.off.push_no_offload();
    sut.expect(after(*this, m));
  }
  void show(std::ostream& os) const override { os << "EnterNoOffloadRegion"; }
};

struct ExitRegion final : Command {
  void checkPreconditions(const Model& m) const override { RC_PRE(m.depth > 0); }
  void apply(Model& m) const override { --m.depth; }
  void run(const Model& m, Sut& sut) const override {
    sut.off.pop_no_offload();
    sut.expect(after(*this, m));
  }
  void show(std::ostream& os) const override { os << "ExitNoOffloadRegion"; }
};

// Autograd frees part of the graph: that saved tensor is never unpacked again.
struct Release final : Command {
  std::size_t index;
  explicit Release(const Model& m) {
    RC_PRE(!m.saved.empty());
    index = *rc::gen::inRange<std::size_t>(0, m.saved.size());
  }
  void checkPreconditions(const Model& m) const override {
    // One condition each: RC_PRE captures its operands, so && would not short-circuit.
    RC_PRE(index < m.saved.size());
    RC_PRE(!m.saved[index].released);
    RC_PRE(!m.poisoned);
    // A node running now or later in this backward still needs its tensors.
    RC_PRE(!m.backward);
  }
  void apply(Model& m) const override { m.saved[index].released = true; }
  void run(const Model& m, Sut& sut) const override {
    sut.off.release(sut.ids[index]);
    sut.expect(after(*this, m));
  }
  void show(std::ostream& os) const override { os << "Release(" << index << ")"; }
};

// Backward starts over every node with a tensor still saved: in decreasing node order (the
// engine's), or shuffled; the order is announced, or not (then the scheduler assumes LIFO).
struct BeginBackward final : Command {
  bool shuffle;
  bool announce;
  bool retain;
  std::uint64_t seed;
  explicit BeginBackward(const Model& m)
      : shuffle(*rc::gen::arbitrary<bool>()),
        announce(*rc::gen::arbitrary<bool>()),
        retain(m.policy == Policy::Ferry &&
               *rc::gen::weightedElement<bool>({{1, true}, {3, false}})),
        seed(*rc::gen::arbitrary<std::uint64_t>()) {}

  void checkPreconditions(const Model& m) const override {
    RC_PRE(!m.backward && m.depth == 0 && !m.poisoned);
    RC_PRE(!retain || m.policy == Policy::Ferry);
  }
  void apply(Model& m) const override {
    m.backward = true;
    m.retain = retain;
    m.order.clear();
    for (const Saved& s : m.saved) {
      if (!s.released && (m.order.empty() || m.order.back() != s.node)) m.order.push_back(s.node);
    }
    std::reverse(m.order.begin(), m.order.end());
    if (shuffle) {
      std::uint64_t x = seed;
      for (std::size_t i = m.order.size(); i > 1; --i) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        std::swap(m.order[i - 1], m.order[(x >> 33) % i]);
      }
    }
  }
  void run(const Model& m, Sut& sut) const override {
    const Model next = after(*this, m);
    std::vector<NodeId> order;
    if (announce) {
      for (const std::uint32_t n : next.order) order.push_back(NodeId(n));
    }
    sut.off.backward_begin(order);
    sut.expect(next);
  }
  void show(std::ostream& os) const override {
    os << "BeginBackward(" << (shuffle ? "shuffled" : "LIFO") << (announce ? ", announced" : "")
       << (retain ? ", retain_graph" : "") << ")";
  }
};

// The next node runs: its saved tensors are unpacked and read by compute (one view may escape
// it), views that escaped earlier are read and dropped, its post-hook runs, and without
// retain_graph its saved tensors are released.
struct RunNode final : Command {
  bool escape;
  explicit RunNode(const Model&)
      : escape(*rc::gen::weightedElement<bool>({{1, true}, {3, false}})) {}

  void checkPreconditions(const Model& m) const override { RC_PRE(m.backward && !m.order.empty()); }
  void apply(Model& m) const override {
    const std::uint32_t node = m.order.front();
    m.order.erase(m.order.begin());
    for (Saved& s : m.saved) {
      if (s.node != node || s.released) continue;
      if (m.policy == Policy::TrlSeed) m.trl_new_forward = true;
      s.ever_unpacked = true;
      if (!m.retain) s.released = true;
    }
  }
  void run(const Model& m, Sut& sut) const override {
    const std::uint32_t node = m.order.front();
    std::vector<Buffer> used;
    for (std::size_t i = 0; i < m.saved.size(); ++i) {
      if (m.saved[i].node != node || m.saved[i].released) continue;
      const auto u = sut.off.unpack(sut.ids[i], NodeId(node));
      sut.backend.compute_reads(u.storage);
      const auto value = sut.backend.value(u.storage, u.offset);
      RC_ASSERT(value.has_value());
      RC_ASSERT(*value == sut.values[i]);
      used.push_back(u.storage);
    }
    sut.drop_escaped();
    if (escape && !used.empty()) {
      sut.backend.hold(used.front());
      sut.escaped.push_back(used.front());
    }
    for (const Buffer b : used) sut.backend.drop(b);
    sut.off.node_done(NodeId(node));
    if (!m.retain) {
      for (std::size_t i = 0; i < m.saved.size(); ++i) {
        if (m.saved[i].node == node && !m.saved[i].released) sut.off.release(sut.ids[i]);
      }
    }
    sut.expect(after(*this, m));
  }
  void show(std::ostream& os) const override {
    os << "RunNode(" << (escape ? "a view escapes" : "") << ")";
  }
};

// The end-of-backward callback; nodes not run were not reachable. Without retain_graph the
// graph is freed: every saved tensor is released, and the next pack starts a new graph.
struct EndBackward final : Command {
  void checkPreconditions(const Model& m) const override { RC_PRE(m.backward); }
  void apply(Model& m) const override {
    m.backward = false;
    m.order.clear();
    if (m.retain) return;
    for (const Saved& s : m.saved) m.stale += is_trl(m.policy) && !s.ever_unpacked;
    m.saved.clear();
    m.next_node = 0;
  }
  void run(const Model& m, Sut& sut) const override {
    sut.drop_escaped();
    sut.off.backward_end();
    if (!m.retain) {
      for (std::size_t i = 0; i < m.saved.size(); ++i) {
        if (!m.saved[i].released) sut.off.release(sut.ids[i]);
      }
      sut.ids.clear();
      sut.values.clear();
    }
    const Model next = after(*this, m);
    sut.expect(next);
    if (!m.retain && next.tracked() == 0) {
      // Nothing is saved any more: the scheduler holds no device memory.
      const int held = static_cast<int>(sut.chain.size() + sut.params.size());
      RC_ASSERT(sut.backend.live(false) == held);
    }
  }
  void show(std::ostream& os) const override { os << "EndBackward"; }
};

// A step begins: the offload context is entered, once the previous graph was freed.
struct Enter final : Command {
  void checkPreconditions(const Model& m) const override {
    RC_PRE(!m.open);
    RC_PRE(!m.backward);
    RC_PRE(m.saved.empty());
    RC_PRE(!m.poisoned);
  }
  void apply(Model& m) const override {
    m.open = true;
    // Today's reference (and TRL 1.7) clear what is left.
    if (m.policy == Policy::Trl || m.policy == Policy::Trl17) m.stale = 0;
  }
  void run(const Model& m, Sut& sut) const override {
    sut.off.enter();
    sut.expect(after(*this, m));
  }
  void show(std::ostream& os) const override { os << "EnterContext"; }
};

// The context is left: after backward, as the reference's trainer does, or before it.
struct Exit final : Command {
  void checkPreconditions(const Model& m) const override {
    RC_PRE(m.open);
    RC_PRE(!m.backward);
    RC_PRE(m.depth == 0);
  }
  void apply(Model& m) const override { m.open = false; }
  void run(const Model& m, Sut& sut) const override {
    sut.off.exit();
    sut.expect(after(*this, m));
  }
  void show(std::ostream& os) const override { os << "ExitContext"; }
};

// Options worth varying: small windows, budgets and caps make every path run.
rc::Gen<OffloadOptions> options_for(Policy policy) {
  return rc::gen::exec([policy] {
    OffloadOptions o;
    o.policy = policy;
    o.min_bytes = Bytes(*rc::gen::element<std::int64_t>(0, 1024, 4096));
    o.trl_stash_count = *rc::gen::inRange(1, 4);
    o.window_bytes = Bytes(*rc::gen::element<std::int64_t>(0, 4096, 65536, 1 << 20));
    o.prefetch_bytes = Bytes(*rc::gen::element<std::int64_t>(0, 4096, 65536, 1 << 20));
    o.host_cap = Bytes(*rc::gen::element<std::int64_t>(8192, 131072, 1LL << 30));
    o.dedup = *rc::gen::arbitrary<bool>();
    o.prefetch = *rc::gen::arbitrary<bool>();
    o.use_streams = *rc::gen::weightedElement<bool>({{6, true}, {1, false}});
    // Note [Offload horizon]: none, or one that stops a forward early or midway.
    const std::int64_t horizon = *rc::gen::element<std::int64_t>(-1, 0, 8192, 65536);
    if (horizon >= 0) o.horizon_bytes = Bytes(horizon);
    return o;
  });
}

void offloader_follows_the_model(Policy policy, const OffloadFaults& faults) {
  const OffloadOptions options = *options_for(policy);
  Model initial;
  initial.policy = policy;
  Sut sut(options, faults);
  rc::state::check(initial, sut,
                   rc::state::gen::execOneOfWithArgs<Enter, Exit, Pack, Pack, Pack, EnterRegion,
                                                     ExitRegion, Release, BeginBackward, RunNode,
                                                     RunNode, RunNode, EndBackward>());
}

RC_GTEST_PROP(OffloaderState, TrlFollowsTheModelAndIsSafeForEveryTiming, ()) {
  offloader_follows_the_model(Policy::Trl, {});
}

RC_GTEST_PROP(OffloaderState, TrlSeedFollowsTheModelAndIsSafeForEveryTiming, ()) {
  offloader_follows_the_model(Policy::TrlSeed, {});
}

RC_GTEST_PROP(OffloaderState, Trl17FollowsTheModelAndIsSafeForEveryTiming, ()) {
  offloader_follows_the_model(Policy::Trl17, {});
}

RC_GTEST_PROP(OffloaderState, FerryFollowsTheModelAndIsSafeForEveryTiming, ()) {
  offloader_follows_the_model(Policy::Ferry, {});
}

// --- planted faults -------------------------------------------------------------------------

struct Planted {
  const char* name;
  bool OffloadFaults::*field;
};

constexpr Planted kPlanted[] = {
    {"skip_offload_wait", &OffloadFaults::skip_offload_wait},
    {"skip_reload_wait", &OffloadFaults::skip_reload_wait},
    {"skip_forward_guard", &OffloadFaults::skip_forward_guard},
    {"skip_backward_guard", &OffloadFaults::skip_backward_guard},
    {"skip_record_stream", &OffloadFaults::skip_record_stream},
    {"skip_host_guard", &OffloadFaults::skip_host_guard},
};

class PlantedOffloaderFault : public ::testing::TestWithParam<std::tuple<Policy, Planted>> {};

TEST_P(PlantedOffloaderFault, IsCaughtAndShrunkToAShortSequence) {
  const auto [policy, planted] = GetParam();
  OffloadFaults faults;
  faults.*planted.field = true;
  const std::string found = testing::counterexample(
      [policy = policy, faults] { offloader_follows_the_model(policy, faults); });
  EXPECT_FALSE(found.empty()) << planted.name << " went unnoticed under " << policy_name(policy);
  RecordProperty("counterexample", found);
}

// Today's reference alone synchronizes on leaving the context, before its stash lets go.
TEST(PlantedOffloaderFault, TrlLeavingTheContextWithoutTheHostSyncIsCaught) {
  OffloadFaults faults;
  faults.skip_exit_sync = true;
  const std::string found =
      testing::counterexample([faults] { offloader_follows_the_model(Policy::Trl, faults); });
  EXPECT_FALSE(found.empty()) << "skip_exit_sync went unnoticed under trl";
  RecordProperty("counterexample", found);
}

INSTANTIATE_TEST_SUITE_P(BothPolicies, PlantedOffloaderFault,
                         ::testing::Combine(::testing::Values(Policy::Trl, Policy::TrlSeed,
                                                              Policy::Trl17, Policy::Ferry),
                                            ::testing::ValuesIn(kPlanted)),
                         [](const auto& test) {
                           std::string name = policy_name(std::get<0>(test.param));
                           std::replace(name.begin(), name.end(), '-', '_');
                           std::replace(name.begin(), name.end(), '.', '_');
                           return name + "_" + std::get<1>(test.param).name;
                         });

}  // namespace
}  // namespace ferry
