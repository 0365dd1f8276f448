#pragma once
/// Metrics of a simulated timeline, collected by an observer (Note [Observers]): attached to a
/// running Simulator, or fed a finished run with `Simulator::replay`.

#include <cstdint>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/observer.hpp"
#include "ferry/sim/engine/simulator.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// Listens for kernels, copies and the waits of one compute stream; answers stall, overlap and
/// bytes moved. Order-independent: ops may arrive in completion order (live) or op order
/// (replay).
class TimelineMetrics final : public SimObserver {
 public:
  /// `compute`: the stream whose waits count as stall.
  explicit TimelineMetrics(StreamId compute) : compute_(compute) {}

  void op_finished(OpId op, const OpRecord& record) override;

  /// Time the compute stream spent blocked in waits issued in [from, to) (stall).
  [[nodiscard]] SimTime stall(SimTime from, SimTime to) const;
  /// When the last compute-stream kernel issued in [from, to) finished on the device; `from`
  /// when there is none. The host issues ahead of the device, so this is when work the host
  /// issued in the span is done, not when the host got past it.
  [[nodiscard]] SimTime kernels_done(SimTime from, SimTime to) const;
  /// Thousandths of copy time that overlapped kernel time, of every copy or of the copies
  /// issued in [from, to].
  [[nodiscard]] std::int64_t copy_overlap_permille() const;
  [[nodiscard]] std::int64_t copy_overlap_permille(SimTime from, SimTime to) const;
  /// Bytes copied in `direction` by copies issued in [from, to].
  [[nodiscard]] Bytes copied(CopyDirection direction, SimTime from, SimTime to) const;

 private:
  struct Interval {
    SimTime start;
    SimTime end;
    SimTime issued;
  };
  struct ComputeOp {  // a kernel or wait of the compute stream
    OpId op;
    OpKind kind = OpKind::Kernel;
    SimTime issued;
    SimTime end;
  };
  struct Copy {
    SimTime issued;
    CopyDirection direction = CopyDirection::HostToDevice;
    Bytes bytes;
  };

  StreamId compute_;
  std::vector<ComputeOp> compute_ops_;
  std::vector<Interval> kernels_;
  std::vector<Interval> copy_intervals_;
  std::vector<Copy> copies_;
};

/// Time the compute stream spent blocked in waits between `from` and `to` (stall).
[[nodiscard]] SimTime compute_stall(const Simulator& sim, StreamId compute, SimTime from,
                                    SimTime to);
/// Thousandths of copy time that overlapped kernel time.
[[nodiscard]] std::int64_t copy_overlap_permille(const Simulator& sim);

/// What the planner reads of a step in [from, to): the stall (TimelineMetrics::stall) and the
/// bytes copied device to host (TimelineMetrics::copied), in one pass over the records.
struct StepFigures {
  SimTime stall;
  Bytes d2h;
};
[[nodiscard]] StepFigures step_figures(const Simulator& sim, StreamId compute, SimTime from,
                                       SimTime to);

}  // namespace ferry::sim
