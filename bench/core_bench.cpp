// Scheduler core overhead: a forward of N saved tensors and the backward that unpacks them,
// against a backend that does nothing, reported per pack+unpack pair.

#include <benchmark/benchmark.h>

#include <optional>
#include <string_view>
#include <vector>

#include "ferry/offload/offloader.hpp"

namespace {

// Counts nothing, allocates nothing: only the core's own work is timed.
class NoopBackend {
 public:
  struct Stream {
    int id = 0;
    friend bool operator==(Stream, Stream) = default;
  };
  struct Event {
    int id = 0;
    friend bool operator==(Event, Event) = default;
  };
  struct Buffer {
    int id = 0;
    friend bool operator==(Buffer, Buffer) = default;
  };
  Stream compute_stream() const { return {}; }
  Stream make_stream(std::string_view) { return Stream{++streams_}; }
  Event make_event() { return {}; }
  std::optional<Buffer> allocate(ferry::Place, ferry::Bytes, Stream, std::string_view) {
    return Buffer{1};
  }
  void copy(Stream, Buffer, ferry::Bytes, Buffer, ferry::Bytes, ferry::Bytes, std::string_view) {}
  void record(Event, Stream) {}
  void wait(Stream, Event) {}
  void hold(Buffer) {}
  void drop(Buffer) {}
  long use_count(Buffer) const { return 1; }
  void record_stream(Buffer, Stream) {}
  void synchronize(Stream) {}

 private:
  int streams_ = 0;
};
static_assert(ferry::Backend<NoopBackend>);

void BM_PackUnpack(benchmark::State& state, ferry::Policy policy) {
  const int tensors = static_cast<int>(state.range(0));
  NoopBackend backend;
  ferry::OffloadOptions options;
  options.policy = policy;
  options.window_bytes = ferry::Bytes(64LL << 20);
  options.prefetch_bytes = ferry::Bytes(64LL << 20);
  std::vector<ferry::TensorId> ids(static_cast<std::size_t>(tensors));
  std::vector<ferry::NodeId> order;
  for (int i = tensors; i-- > 0;) order.push_back(ferry::NodeId(static_cast<std::uint32_t>(i)));
  std::int64_t pairs = 0;
  for (auto _ : state) {
    ferry::Offloader<NoopBackend> off(backend, options);
    for (int step = 0; step < 4; ++step) {
      for (int i = 0; i < tensors; ++i) {
        ferry::TensorFacts f;
        f.bytes = f.storage_bytes = ferry::Bytes(16LL << 20);
        f.storage = static_cast<std::uint64_t>(step * tensors + i);
        f.node = ferry::NodeId(static_cast<std::uint32_t>(i));
        ids[static_cast<std::size_t>(i)] = off.pack(f, NoopBackend::Buffer{1});
      }
      off.backward_begin(order);
      for (int i = tensors; i-- > 0;) {
        const ferry::NodeId node(static_cast<std::uint32_t>(i));
        benchmark::DoNotOptimize(off.unpack(ids[static_cast<std::size_t>(i)], node));
        off.node_done(node);
        off.release(ids[static_cast<std::size_t>(i)]);
      }
      off.backward_end();
      pairs += tensors;
    }
  }
  state.counters["ns_per_pair"] = benchmark::Counter(
      static_cast<double>(pairs), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.SetItemsProcessed(pairs);
}
BENCHMARK_CAPTURE(BM_PackUnpack, trl, ferry::Policy::Trl)->ArgName("tensors")->Arg(256);
BENCHMARK_CAPTURE(BM_PackUnpack, trl_seed, ferry::Policy::TrlSeed)->ArgName("tensors")->Arg(256);
BENCHMARK_CAPTURE(BM_PackUnpack, ferry, ferry::Policy::Ferry)
    ->ArgName("tensors")
    ->Arg(256)
    ->Arg(4096);

}  // namespace

BENCHMARK_MAIN();
