#pragma once
// Private to the simulated autograd: content values and random generators, shared by the
// single-device Trainer and the pipeline Executor.

#include <cstdint>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/simulator.hpp"
#include "ferry/sim/support/small_vector.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

// Note [Content values]
// Every tensor has a content value, a function of what computed it, never of when or where:
// a forward op's outputs mix the op, the output index, the values of every input it read and,
// for ops that draw random numbers, the draw (the generator and how many numbers it gave out
// before); a parameter's value is its index, a batch input's its index and step or
// micro-batch. Backward nodes derive gradient values from everything they read. Kernels write
// these values as the simulator's content ids, so a recomputed tensor holds the same content
// as the original exactly when its inputs and random draws were the same, and a gradient
// differs exactly when something it was computed from did. Gradients that accumulate do so by
// a sum modulo 2^64, associative and commutative like exact arithmetic: the order of backward
// nodes, of micro-batches or of devices cannot change a result, so any difference from a
// reference run means a contribution was lost, doubled or computed from wrong data.
//
// A ContentMap follows what each storage holds, piece by piece (a storage may hold views
// written by different ops, and a tensor may come back into another storage), as the
// simulator's content shadow does; a kernel that reads a tensor asks the simulator to verify
// that the bytes it reads are the pieces recorded here. A run that reads no value (the
// planner's unchecked runs: TrainingOptions::content_values off) keeps no map, and its times and
// memory are those of a run that keeps one.

/// The tags content values start from (Note [Content values]), one per kind of origin, for the
/// Trainer and the pipeline Executor alike. Each is its name's ASCII bytes.
namespace tag {
inline constexpr std::uint64_t kParam = 0x706172616d;   // "param": a parameter, by index
inline constexpr std::uint64_t kBatch = 0x6261746368;   // "batch": a step's input
inline constexpr std::uint64_t kInput = 0x696e707574;   // "input": a micro-batch's input
inline constexpr std::uint64_t kForward = 0x66776400;   // "fwd": a forward op's output
inline constexpr std::uint64_t kBackward = 0x62776400;  // "bwd": a backward node's output
inline constexpr std::uint64_t kGrad = 0x67726164;      // "grad": a gradient
inline constexpr std::uint64_t kLoss = 0x6c6f7373;      // "loss": a loss's seed gradient
inline constexpr std::uint64_t kRng = 0x726e67;         // "rng": a device generator's draw
inline constexpr std::uint64_t kCpuRng = 0x637075;      // "cpu": the CPU generator's draw
inline constexpr std::uint64_t kShard = 0x7368617264;   // "shard": an FSDP2 shard
inline constexpr std::uint64_t kPieces = 0x7069656365;  // "piece": a value made of pieces
}  // namespace tag

/// A tensor's or a storage's content pieces: one, unless views of it were written apart.
using Pieces = SmallVector<ContentPiece, 1>;

/// What each storage holds, by buffer id: pieces of content values.
class ContentMap {
 public:
  /// `kept` false: writes and arrivals are dropped, a slice has no piece and a value is 0.
  explicit ContentMap(bool kept = true) : kept_(kept) {}

  /// Bytes [offset, offset + bytes) of `buffer` now hold value `value` (from its start).
  void write(BufferId buffer, Bytes offset, Bytes bytes, std::uint64_t value);
  /// A tensor came back into `buffer` at `offset`: it holds the pieces it held when saved.
  void arrive(BufferId buffer, Bytes offset, const Pieces& saved);
  /// The pieces of [offset, offset + bytes), relative to offset; never-written gaps are id 0.
  [[nodiscard]] Pieces slice(BufferId buffer, Bytes offset, Bytes bytes) const;
  /// The value those bytes amount to (see value_of()).
  [[nodiscard]] std::uint64_t value(BufferId buffer, Bytes offset, Bytes bytes) const;

 private:
  // Bytes [lo, hi) of a storage's pieces now hold bytes [base, base + hi - lo) of value `id`
  // (Note [Content pieces]).
  void overwrite(Pieces& pieces, std::int64_t lo, std::int64_t hi, std::uint64_t id,
                 std::int64_t base);
  Pieces& pieces_of(BufferId buffer);
  [[nodiscard]] const Pieces* find(BufferId buffer) const;

  std::vector<Pieces> pieces_;  // by buffer id
  Pieces scratch_;              // overwrite's, kept for its capacity
  bool kept_ = true;
};

/// What a tensor's bytes amount to, from their pieces: one whole value is that value, else a
/// mix of the pieces. The same whether it comes back from the host or from a recomputation.
[[nodiscard]] std::uint64_t value_of(const Pieces& pieces);

/// Random generators and how many numbers each gave out (Note [Content values]).
class Generators {
 public:
  explicit Generators(std::size_t count = 0) : drawn_(count, 0) {}
  /// The draw number of the next number from generator `g`, which advances.
  std::uint64_t draw(std::size_t g) { return drawn_[g]++; }

 private:
  std::vector<std::uint64_t> drawn_;
};

/// Starts recomputing a region or partition: the live generators go back to `start`, where
/// they stood when its forward began, so the replay draws the same numbers (unless `restore`
/// is false: a planted fault). Returns the live states, to put back when the replay ends.
[[nodiscard]] Generators begin_replay(Generators& live, const Generators& start, bool restore);

}  // namespace ferry::sim
