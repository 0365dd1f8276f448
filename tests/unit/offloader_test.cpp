// The scheduler core on its own, against a backend that writes down each command.

#include "ferry/offload/offloader.hpp"

#include <gtest/gtest.h>

#include "fake_backend.hpp"

namespace ferry {
namespace {

using testing::FakeBackend;
using Off = Offloader<FakeBackend>;

TensorFacts facts(std::int64_t bytes, std::uint32_t node, std::uint64_t storage) {
  TensorFacts f;
  f.bytes = Bytes(bytes);
  f.storage_bytes = Bytes(bytes);
  f.storage = storage;
  f.node = NodeId(node);
  return f;
}

OffloadOptions trl(int stash = 5) {
  OffloadOptions o;
  o.policy = Policy::Trl;
  o.trl_stash_count = stash;
  return o;
}

// The byte bounds alone (one tensor in flight at least): the tests below count bytes; the
// floor of tensors in flight has tests of its own.
OffloadOptions ferry_policy() {
  OffloadOptions o;
  o.policy = Policy::Ferry;
  o.min_in_flight = 1;
  return o;
}

// Packs `n` tensors of `bytes` (nodes 0..n-1) the way autograd does: the producer drops its
// own reference after packing. Returns the ids.
std::vector<TensorId> forward(Off& off, FakeBackend& b, int n, std::int64_t bytes = 4096) {
  std::vector<TensorId> ids;
  for (int i = 0; i < n; ++i) {
    const auto t = b.tensor();
    ids.push_back(
        off.pack(facts(bytes, static_cast<std::uint32_t>(i), static_cast<std::uint64_t>(t.id)), t));
    b.drop(t);
  }
  return ids;
}

// --- trl: the reference offloader's behaviours ----------------------------------------------

TEST(TrlPolicy, OffloadsOnOneSideStreamAfterItWaitsForCompute) {
  FakeBackend b;
  Off off(b, trl());
  const auto t = b.tensor();
  off.pack(facts(4096, 0, 0), t);
  const int wait = b.find("wait s1 e0");
  ASSERT_GE(b.find("record e0 s0"), 0) << b.dump();
  ASSERT_GT(wait, b.find("record e0 s0"));
  EXPECT_GT(b.find("copy s1 b0+0 -> b1+0 4096"), wait) << b.dump();
  EXPECT_EQ(b.streams, 1);  // one side stream for both directions
}

TEST(TrlPolicy, KeepsSmallTensorsParamsAndRegionOptOutOnTheDevice) {
  FakeBackend b;
  Off off(b, trl());
  auto small = facts(1000, 0, 0);
  auto param = facts(1 << 20, 0, 1);
  param.is_param = true;
  const auto t0 = b.tensor();
  const auto t1 = b.tensor();
  const auto t2 = b.tensor();
  off.pack(small, t0);
  off.pack(param, t1);
  off.push_no_offload();
  off.pack(facts(1 << 20, 0, 2), t2);
  off.pop_no_offload();
  EXPECT_EQ(off.telemetry().kept, 3);
  EXPECT_EQ(off.telemetry().offloaded, 0);
  EXPECT_EQ(b.find("copy s1 b0+0 -> b3+0 1000"), -1);
}

TEST(TrlPolicy, ForwardStashIsBoundedByATensorCount) {
  FakeBackend b;
  Off off(b, trl(2));
  forward(off, b, 2);
  EXPECT_EQ(b.find("free b0"), -1);  // still stashed
  forward(off, b, 1);
  // id 0 leaves the stash when id 2 arrives: compute waits for its copy, then it is freed.
  const int wait = b.find("wait s0 e1");
  ASSERT_GE(wait, 0) << b.dump();
  EXPECT_GT(b.find("free b0"), wait);
}

TEST(TrlPolicy, ReloadsOnDemandAndFreesThePreviousNodesReloadAfterAnEvent) {
  FakeBackend b;
  Off off(b, trl(1));
  const auto ids = forward(off, b, 3);
  const std::size_t before = b.log.size();
  auto u0 = off.unpack(ids[0], NodeId(10));  // not stashed: reloaded on demand
  const int r = u0.storage.id;
  const int alloc = b.find(fmt::format("alloc device 4096 s1 -> b{}", r), static_cast<int>(before));
  ASSERT_GE(alloc, 0) << b.dump();
  const int copy = b.find(fmt::format("copy s1 b1+0 -> b{}+0 4096", r), alloc);
  ASSERT_GE(copy, 0) << b.dump();
  EXPECT_GE(b.find("wait s0 e6", copy), 0) << "compute waits for the side stream";
  EXPECT_EQ(off.telemetry().on_demand, 1);
  b.drop(u0.storage);
  off.node_done(NodeId(10));
  EXPECT_EQ(b.find(fmt::format("free b{}", r)), -1) << "kept until the next node's post-hook";
  auto u1 = off.unpack(ids[1], NodeId(11));
  b.drop(u1.storage);
  off.node_done(NodeId(11));
  const int freed = b.find(fmt::format("free b{}", r));
  ASSERT_GE(freed, 0) << b.dump();
  EXPECT_EQ(b.log[static_cast<std::size_t>(freed - 1)].rfind("wait s1 ", 0), 0U) << b.dump();
}

TEST(TrlPolicy, LastOffloadedTensorsComeStraightFromTheForwardStash) {
  FakeBackend b;
  Off off(b, trl(5));
  const auto ids = forward(off, b, 2);
  auto u = off.unpack(ids[1], NodeId(1));
  EXPECT_EQ(u.storage.id, 2);  // the original tensor (b2), not a reload
  EXPECT_EQ(off.telemetry().stash_hits, 1);
  EXPECT_EQ(off.telemetry().on_demand, 0);
  b.drop(u.storage);
  off.node_done(NodeId(1));
}

TEST(TrlPolicy, FallsBackToRecordStreamWhenAViewOfTheReloadEscapes) {
  FakeBackend b;
  Off off(b, trl(1));
  const auto ids = forward(off, b, 2);
  auto u = off.unpack(ids[0], NodeId(5));
  b.hold(u.storage);  // an output of the node is a view of it: one more reference
  b.drop(u.storage);  // the autograd's own reference
  off.node_done(NodeId(5));
  EXPECT_GE(b.find(fmt::format("record_stream b{} s0", u.storage.id)), 0) << b.dump();
  EXPECT_EQ(off.telemetry().record_stream_fallbacks, 1);
}

TEST(TrlPolicy, EndOfBackwardDrainsWhatIsStillStashed) {
  FakeBackend b;
  Off off(b, trl(1));
  const auto ids = forward(off, b, 2);
  auto u = off.unpack(ids[0], NodeId(0));
  b.drop(u.storage);
  off.node_done(NodeId(0));
  EXPECT_EQ(b.find(fmt::format("free b{}", u.storage.id)), -1);
  off.backward_end();
  EXPECT_GE(b.find(fmt::format("free b{}", u.storage.id)), 0) << b.dump();
}

TEST(TrlPolicy, UnpackingAnUntrackedOrConsumedIdIsAnError) {
  FakeBackend b;
  Off off(b, trl());
  const auto ids = forward(off, b, 1);
  b.drop(off.unpack(ids[0], NodeId(0)).storage);
  try {
    (void)off.unpack(ids[0], NodeId(0));  // retain_graph's second backward
    FAIL() << "expected an error";
  } catch (const OffloadError& e) {
    EXPECT_STREQ(e.what(), "untracked tensor with id 0");
  }
  EXPECT_THROW((void)off.unpack(TensorId(99), NodeId(0)), OffloadError);
}

TEST(TrlSeedPolicy, ANonEmptyTrackerAtTheNextForwardIsAnError) {
  FakeBackend b;
  OffloadOptions o = trl();
  o.policy = Policy::TrlSeed;
  Off off(b, o);
  const auto ids = forward(off, b, 2);
  b.drop(off.unpack(ids[1], NodeId(1)).storage);  // ids[0]'s node never ran (unused branch)
  off.node_done(NodeId(1));
  off.backward_end();
  off.release(ids[0]);  // the reference offloader does not hear of it
  EXPECT_THROW(forward(off, b, 1), OffloadError);
}

// Today's reference starts a new forward only once the tracker is empty, and entering the
// context clears what an unused branch left behind.
TEST(TrlPolicy, AStaleEntryIsClearedOnEnteringTheContextNotRefused) {
  FakeBackend b;
  Off off(b, trl(1));
  off.enter();
  const auto ids = forward(off, b, 2);
  b.drop(off.unpack(ids[1], NodeId(1)).storage);  // ids[0]'s node never ran (unused branch)
  off.node_done(NodeId(1));
  off.backward_end();
  off.exit();
  EXPECT_EQ(off.tracked(), 1U);
  off.enter();
  EXPECT_EQ(off.tracked(), 0U);
  EXPECT_GE(b.find("free b1"), 0) << "the stale host copy goes\n" << b.dump();
  EXPECT_NO_THROW(forward(off, b, 1));
}

// A recompute during backward packs before the tracker is empty: not a new forward.
TEST(TrlPolicy, PacksDuringBackwardAreNotTakenForANewForward) {
  FakeBackend b;
  Off off(b, trl());
  const auto ids = forward(off, b, 2);
  b.drop(off.unpack(ids[1], NodeId(1)).storage);
  EXPECT_NO_THROW(forward(off, b, 1));  // a checkpointed region replays
  OffloadOptions seed = trl();
  seed.policy = Policy::TrlSeed;
  FakeBackend sb;
  Off seeded(sb, seed);
  const auto sids = forward(seeded, sb, 2);
  sb.drop(seeded.unpack(sids[1], NodeId(1)).storage);
  EXPECT_THROW(forward(seeded, sb, 1), OffloadError);
}

// The same view of a storage still in the forward stash is not copied again: it stays, and
// takes the key over, so that later packs of the storage stay too, after the original left the
// stash; the key goes when the pack that holds it is unpacked.
TEST(TrlPolicy, DeduplicatesAViewWhoseOriginalIsStillStashed) {
  FakeBackend b;
  Off off(b, trl(2));
  const auto t = b.tensor();
  const TensorId first = off.pack(facts(4096, 0, 1000), t);
  const TensorId kept = off.pack(facts(4096, 1, 1000), t);
  EXPECT_EQ(off.telemetry().offloaded, 1);
  EXPECT_EQ(off.telemetry().deduplicated, 1);
  const auto others = forward(off, b, 2);  // the stash moves on: storage 1000's original leaves
  const TensorId later = off.pack(facts(4096, 5, 1000), t);
  EXPECT_EQ(off.telemetry().offloaded, 3);
  EXPECT_EQ(off.telemetry().deduplicated, 2);
  // Unpacked, the last pack that took the key lets it go: storage 1000 is copied again.
  b.drop(off.unpack(later, NodeId(5)).storage);
  const TensorId again = off.pack(facts(4096, 6, 1000), t);
  EXPECT_EQ(off.telemetry().offloaded, 4);
  b.drop(t);
  for (const TensorId id : {again, others[1], others[0], kept, first}) {
    b.drop(off.unpack(id, NodeId(id.value())).storage);
  }
}

// Without a dedup hit, the key leaves with the stash entry: the storage is copied again.
TEST(TrlPolicy, AStorageWhoseOriginalLeftTheStashIsCopiedAgain) {
  FakeBackend b;
  Off off(b, trl(2));
  const auto t = b.tensor();
  off.pack(facts(4096, 0, 1000), t);
  forward(off, b, 2);
  off.pack(facts(4096, 3, 1000), t);
  b.drop(t);
  EXPECT_EQ(off.telemetry().offloaded, 4);
  EXPECT_EQ(off.telemetry().deduplicated, 0);
  OffloadOptions seed = trl(2);
  seed.policy = Policy::TrlSeed;
  FakeBackend sb;
  Off seeded(sb, seed);
  const auto st = sb.tensor();
  seeded.pack(facts(4096, 0, 7), st);
  seeded.pack(facts(4096, 1, 7), st);
  EXPECT_EQ(seeded.telemetry().offloaded, 2);
}

// TRL 1.7 keys dedup by device address and dtype and keeps every key to the next forward: a
// tensor of that dtype at a freed original's address stays on the device (Note [TRL 1.7's dedup
// key]); today's lets the key go with the stash entry and copies it.
TEST(Trl17Policy, ATensorAtAFreedOriginalsAddressStaysOnTheDevice) {
  for (const Policy policy : {Policy::Trl17, Policy::Trl}) {
    FakeBackend b;
    OffloadOptions o = trl(1);
    o.policy = policy;
    Off off(b, o);
    const auto at = [&](std::uint64_t address, std::uint32_t dtype) {
      const auto t = b.tensor();
      TensorFacts f = facts(4096, 0, static_cast<std::uint64_t>(t.id));
      f.address = address;
      f.dtype = dtype;
      off.pack(f, t);
      b.drop(t);
    };
    at(0x1000, 15);
    at(0x2000, 15);  // the stash of one lets the first go: its address is free again
    at(0x1000, 6);   // another dtype there: a different key
    at(0x1000, 15);
    const bool address_keys = policy == Policy::Trl17;
    EXPECT_EQ(off.telemetry().deduplicated, address_keys ? 1 : 0) << policy_name(policy);
    EXPECT_EQ(off.telemetry().offloaded, address_keys ? 3 : 4) << policy_name(policy);
  }
}

// Leaving the context, the host waits for both streams; the stashes let go without waiting.
TEST(TrlPolicy, LeavingTheContextSynchronizesAndEmptiesTheStashes) {
  FakeBackend b;
  Off off(b, trl(5));
  off.enter();
  const auto ids = forward(off, b, 2);
  off.exit();
  EXPECT_GE(b.find("sync s0"), 0) << b.dump();
  EXPECT_GT(b.find("sync s1"), b.find("sync s0")) << b.dump();
  EXPECT_GT(b.find("free b0"), b.find("sync s1")) << b.dump();
  // Backward after the context closed reloads from the host copies.
  auto u = off.unpack(ids[1], NodeId(1));
  EXPECT_EQ(off.telemetry().stash_hits, 0);
  EXPECT_EQ(off.telemetry().on_demand, 1);
  b.drop(u.storage);
}

TEST(TrlPolicy, RejectsAStashSizeBelowOne) {
  FakeBackend b;
  EXPECT_THROW(Off(b, trl(0)), OffloadError);
}

// The reference checks the stash size only when copies have their own stream.
TEST(TrlPolicy, AcceptsAnyStashSizeWithoutStreams) {
  FakeBackend b;
  OffloadOptions o = trl(0);
  o.use_streams = false;
  EXPECT_NO_THROW(Off(b, o));
}

// use_streams = false: no stream is made; the copies both ways run on the compute stream s0.
TEST(Offloader, WithoutStreamsCopiesRunOnTheComputeStream) {
  for (OffloadOptions o : {trl(1), ferry_policy()}) {
    o.use_streams = false;
    o.window_bytes = Bytes(0);
    FakeBackend b;
    Off off(b, o);
    EXPECT_EQ(b.streams, 0) << policy_name(o.policy);
    const auto ids = forward(off, b, 3);
    (void)off.unpack(ids[0], NodeId(10));
    int copies = 0;
    for (const std::string& line : b.log) {
      if (!line.starts_with("copy ")) continue;
      ++copies;
      EXPECT_TRUE(line.starts_with("copy s0 ")) << line;
    }
    EXPECT_EQ(copies, 4) << b.dump();  // three offloads, one reload
  }
}

// --- ferry ----------------------------------------------------------------------------------

TEST(FerryPolicy, UsesSeparateOffloadAndReloadStreams) {
  FakeBackend b;
  Off off(b, ferry_policy());
  EXPECT_EQ(b.streams, 2);
  const auto ids = forward(off, b, 1);
  EXPECT_GE(b.find("copy s1 b0+0 -> b1+0 4096"), 0) << b.dump();
  off.release(ids[0]);
}

TEST(FerryPolicy, ForwardWindowIsBoundedInBytes) {
  FakeBackend b;
  OffloadOptions o = ferry_policy();
  o.window_bytes = Bytes(10000);
  Off off(b, o);
  forward(off, b, 2);
  EXPECT_EQ(b.find("free b0"), -1);
  forward(off, b, 1);  // 3 x 4096 > 10000: the oldest leaves once its copy is done
  const int free0 = b.find("free b0");
  ASSERT_GE(free0, 0) << b.dump();
  EXPECT_EQ(b.log[static_cast<std::size_t>(free0 - 1)], "wait s0 e1");
}

TEST(FerryPolicy, PrefetchesInTheAnnouncedNodeOrderWithinItsBudget) {
  FakeBackend b;
  OffloadOptions o = ferry_policy();
  o.window_bytes = Bytes(4096);
  o.prefetch_bytes = Bytes(8192);
  Off off(b, o);
  const auto ids = forward(off, b, 4);  // only node 3's original is still resident
  const std::vector<NodeId> order{NodeId(3), NodeId(0), NodeId(2), NodeId(1)};  // not LIFO
  const std::size_t before = b.log.size();
  off.backward_begin(order);
  EXPECT_EQ(off.telemetry().prefetched, 2);
  // Node 0's storage (host b1) comes back first, then node 2's (host b5).
  const int first = b.find("copy s2 b1+0 -> b8+0 4096", static_cast<int>(before));
  const int second = b.find("copy s2 b5+0 -> b9+0 4096", static_cast<int>(before));
  ASSERT_GE(first, 0) << b.dump();
  EXPECT_GT(second, first);
  for (const NodeId n : order) {
    auto u = off.unpack(ids[n.value()], n);
    b.drop(u.storage);
    off.node_done(n);
  }
  EXPECT_EQ(off.telemetry().on_demand, 0);
  EXPECT_EQ(off.telemetry().prefetched, 3);
  EXPECT_EQ(off.telemetry().stash_hits, 1);
  off.backward_end();
}

// Note [Tensors in flight]: a window smaller than one tensor still lets three be in flight
// before the oldest original must go, and a prefetch budget smaller than one tensor still
// reloads three ahead; budgets of zero bytes still mean none.
TEST(FerryPolicy, WindowAndPrefetchAdmitThreeTensorsWhateverTheirBytes) {
  FakeBackend b;
  OffloadOptions o;
  o.policy = Policy::Ferry;
  o.window_bytes = Bytes(1024);
  o.prefetch_bytes = Bytes(1024);
  ASSERT_EQ(o.min_in_flight, 3);
  Off off(b, o);
  forward(off, b, 3);
  EXPECT_EQ(b.find("free b0"), -1) << b.dump();
  forward(off, b, 1);  // a fourth: the oldest of the three leaves
  EXPECT_GE(b.find("free b0"), 0) << b.dump();
  EXPECT_EQ(b.find("free b2"), -1) << b.dump();
  forward(off, b, 3);  // three more: six offloads, three of them now on the host alone
  off.backward_begin({});
  EXPECT_EQ(off.telemetry().prefetched, 3);
  off.backward_end();
}

TEST(FerryPolicy, ZeroByteWindowAndPrefetchStillHoldNothing) {
  FakeBackend b;
  OffloadOptions o;
  o.policy = Policy::Ferry;
  o.window_bytes = Bytes(0);
  o.prefetch_bytes = Bytes(0);
  Off off(b, o);
  forward(off, b, 2);
  EXPECT_GE(b.find("free b0"), 0) << b.dump();  // the second pack waited for the first copy
  off.backward_begin({});
  EXPECT_EQ(off.telemetry().prefetched, 0);
  off.backward_end();
}

TEST(FerryPolicy, RefusesFewerThanOneTensorInFlight) {
  FakeBackend b;
  OffloadOptions o;
  o.policy = Policy::Ferry;
  o.min_in_flight = 0;
  try {
    Off off(b, o);
    FAIL() << "min_in_flight 0 accepted";
  } catch (const OffloadError& e) {
    EXPECT_NE(std::string(e.what()).find("min_in_flight should be at least 1 (got 0)"),
              std::string::npos)
        << e.what();
  }
}

TEST(FerryPolicy, ReloadedStorageIsFreedAfterComputeFinishesWithIt) {
  FakeBackend b;
  OffloadOptions o = ferry_policy();
  o.window_bytes = Bytes(4096);
  Off off(b, o);
  const auto ids = forward(off, b, 2);
  off.backward_begin({});
  auto u = off.unpack(ids[0], NodeId(0));
  b.drop(u.storage);
  off.node_done(NodeId(0));
  const int freed = b.find(fmt::format("free b{}", u.storage.id));
  ASSERT_GE(freed, 2) << b.dump();
  EXPECT_EQ(b.log[static_cast<std::size_t>(freed - 1)].rfind("wait s2 ", 0), 0U) << b.dump();
  EXPECT_EQ(b.log[static_cast<std::size_t>(freed - 2)].rfind("record ", 0), 0U) << b.dump();
}

TEST(FerryPolicy, KeepsTensorsOnTheDeviceWhenTheHostCapIsReached) {
  FakeBackend b;
  OffloadOptions o = ferry_policy();
  o.host_cap = Bytes(8192);
  Off off(b, o);
  forward(off, b, 3);
  EXPECT_EQ(off.telemetry().offloaded, 2);
  EXPECT_EQ(off.telemetry().host_fallbacks, 1);
  EXPECT_EQ(off.telemetry().pinned_peak, Bytes(8192));
}

TEST(FerryPolicy, ViewsSharingAStorageAreCopiedOnce) {
  FakeBackend b;
  Off off(b, ferry_policy());
  const auto t = b.tensor();
  TensorFacts first = facts(4096, 0, 7);
  first.storage_bytes = Bytes(8192);
  TensorFacts second = first;
  second.view_offset = Bytes(4096);
  second.node = NodeId(1);
  const TensorId a = off.pack(first, t);
  const TensorId c = off.pack(second, t);
  b.drop(t);
  EXPECT_EQ(off.telemetry().offloaded, 1);
  EXPECT_EQ(off.telemetry().deduplicated, 1);
  EXPECT_EQ(off.telemetry().bytes_d2h, Bytes(8192));
  auto ua = off.unpack(a, NodeId(0));
  auto uc = off.unpack(c, NodeId(1));
  EXPECT_EQ(ua.storage, uc.storage);
  EXPECT_EQ(uc.offset, Bytes(4096));
  b.drop(ua.storage);
  b.drop(uc.storage);
}

TEST(FerryPolicy, PerTensorOptOutStaysOnTheDevice) {
  FakeBackend b;
  Off off(b, ferry_policy());
  auto f = facts(1 << 20, 0, 0);
  f.no_offload = true;
  const auto t = b.tensor();
  off.pack(f, t);
  EXPECT_EQ(off.telemetry().kept, 1);
  EXPECT_EQ(off.telemetry().offloaded, 0);
}

TEST(FerryPolicy, PacksPastTheOffloadHorizonStayOnTheDevice) {
  // Note [Offload horizon]: 2 x 4096 fit in 10000 bytes; the third pack would copy past it,
  // so it and every later pack of the forward stay, a small one that would still fit included.
  FakeBackend b;
  OffloadOptions o = ferry_policy();
  o.horizon_bytes = Bytes(10000);
  Off off(b, o);
  forward(off, b, 3);
  const auto small = b.tensor();
  off.pack(facts(1024, 3, static_cast<std::uint64_t>(small.id)), small);
  EXPECT_EQ(off.telemetry().offloaded, 2);
  EXPECT_EQ(off.telemetry().kept, 2);
  EXPECT_EQ(off.telemetry().past_horizon, 2);
  EXPECT_EQ(off.telemetry().bytes_d2h, Bytes(8192));
}

TEST(FerryPolicy, TheHorizonCountsEachForwardAfreshAndNotRecomputation) {
  FakeBackend b;
  OffloadOptions o = ferry_policy();
  o.horizon_bytes = Bytes(4096);
  o.window_bytes = Bytes(4096);
  Off off(b, o);
  const auto first = forward(off, b, 2);
  EXPECT_EQ(off.telemetry().offloaded, 1);
  off.backward_begin({});
  // A pack during backward (a checkpoint's recomputation) neither counts nor stops.
  const auto t = b.tensor();
  const TensorId recomputed = off.pack(facts(4096, 5, static_cast<std::uint64_t>(t.id)), t);
  b.drop(t);
  EXPECT_EQ(off.telemetry().offloaded, 2);
  off.release(recomputed);
  for (const TensorId id : first) off.release(id);
  off.backward_end();
  // The next forward copies up to the horizon again.
  const auto second = forward(off, b, 2);
  EXPECT_EQ(off.telemetry().offloaded, 3);
  EXPECT_EQ(off.telemetry().past_horizon, 2);
  for (const TensorId id : second) off.release(id);
}

TEST(FerryPolicy, AViewOfAStorageCopiedBeforeTheHorizonStillSharesItsCopy) {
  // A dedup hit copies nothing, so it does not trip the horizon; once tripped, it stays.
  FakeBackend b;
  OffloadOptions o = ferry_policy();
  o.horizon_bytes = Bytes(8192);
  Off off(b, o);
  const auto t = b.tensor();
  TensorFacts whole = facts(8192, 0, 7);
  TensorFacts view = whole;
  view.node = NodeId(1);
  off.pack(whole, t);
  off.pack(view, t);
  EXPECT_EQ(off.telemetry().deduplicated, 1);
  const auto other = b.tensor();
  off.pack(facts(4096, 2, static_cast<std::uint64_t>(other.id)), other);  // past: trips
  view.node = NodeId(3);
  off.pack(view, t);
  EXPECT_EQ(off.telemetry().offloaded, 1);
  EXPECT_EQ(off.telemetry().deduplicated, 1);
  EXPECT_EQ(off.telemetry().past_horizon, 2);
  b.drop(t);
  b.drop(other);
}

TEST(FerryPolicy, RetainGraphReloadsAgainFromTheKeptHostCopy) {
  FakeBackend b;
  OffloadOptions o = ferry_policy();
  o.window_bytes = Bytes(4096);
  o.prefetch = false;
  Off off(b, o);
  const auto ids = forward(off, b, 2);
  for (int pass = 0; pass < 2; ++pass) {
    off.backward_begin({});
    auto u = off.unpack(ids[0], NodeId(0));
    b.drop(u.storage);
    off.node_done(NodeId(0));
    off.backward_end();
  }
  EXPECT_EQ(off.telemetry().on_demand, 2);
  off.release(ids[0]);
  EXPECT_THROW((void)off.unpack(ids[0], NodeId(0)), OffloadError);
}

TEST(FerryPolicy, ReusesAPooledHostBufferOnlyAfterItsReloadFinished) {
  FakeBackend b;
  OffloadOptions o = ferry_policy();
  o.window_bytes = Bytes(4096);
  o.prefetch = false;
  Off off(b, o);
  const auto ids = forward(off, b, 2);
  off.backward_begin({});
  auto u = off.unpack(ids[0], NodeId(0));
  b.drop(u.storage);
  off.node_done(NodeId(0));
  off.backward_end();
  off.release(ids[0]);  // its host buffer b1, read by the reload, goes back to the pool
  const std::size_t before = b.log.size();
  forward(off, b, 1);
  // No new host allocation; the offload stream waits for the reload that read the buffer.
  for (std::size_t i = before; i < b.log.size(); ++i) {
    EXPECT_EQ(b.log[i].rfind("alloc host", 0), std::string::npos) << b.dump();
  }
  // The reload of ids[0] read host buffer b1 and recorded an event right after its copy.
  int reload = -1;
  for (std::size_t i = 0; i < before; ++i) {
    if (b.log[i].rfind("copy s2 b1+0 ->", 0) == 0) reload = static_cast<int>(i);
  }
  ASSERT_GE(reload, 0) << b.dump();
  const std::string& record = b.log[static_cast<std::size_t>(reload + 1)];
  ASSERT_EQ(record.rfind("record e", 0), 0U);
  const std::string event = record.substr(7, record.find(' ', 7) - 7);
  const int wait = b.find("wait s1 " + event, static_cast<int>(before));
  int copy = -1;
  for (std::size_t i = before; i < b.log.size(); ++i) {
    if (b.log[i].rfind("copy s1 ", 0) == 0 && b.log[i].find("-> b1+0") != std::string::npos) {
      copy = static_cast<int>(i);
    }
  }
  ASSERT_GE(copy, 0) << "the pooled host buffer b1 is reused\n" << b.dump();
  ASSERT_GE(wait, 0) << b.dump();
  EXPECT_LT(wait, copy);
  EXPECT_EQ(off.telemetry().pinned_peak, Bytes(8192));
}

// --- the record lifecycle -------------------------------------------------------------------

TEST(RecordLifecycle, FollowsTheNoteAndRefusesAnyOtherTransition) {
  Record<int, int> rec;
  for (const RecordState next :
       {RecordState::Offloading, RecordState::OnHost, RecordState::Reloading, RecordState::Reloaded,
        RecordState::OnHost, RecordState::Dropped, RecordState::Free}) {
    rec.move_to(next);
  }
  EXPECT_THROW(rec.move_to(RecordState::Reloaded), InvariantError);
  rec.move_to(RecordState::Kept);
  EXPECT_THROW(rec.move_to(RecordState::OnHost), InvariantError);
  EXPECT_FALSE(record_transition_allowed(RecordState::Offloading, RecordState::Reloading));
  EXPECT_FALSE(record_transition_allowed(RecordState::Returned, RecordState::OnHost));
}

TEST(RecordTable, ReusesASlotOnlyOnceNoQueueNamesIt) {
  RecordTable<int, int> table;
  Record<int, int> rec;
  rec.state = RecordState::Kept;
  const RecordId a = table.add(rec);
  table[a].move_to(RecordState::Dropped);
  table.retire(a);
  table.reclaim([&](RecordId r) { return r == a; });  // still in a queue
  EXPECT_NE(table.add(rec), a);
  table.reclaim([](RecordId) { return false; });
  EXPECT_EQ(table.add(rec), a);
}

}  // namespace
}  // namespace ferry
