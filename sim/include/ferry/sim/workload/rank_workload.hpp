#pragma once
/// What a rank runs: a model and the device it runs on, and the model one GPU of a mesh runs,
/// cut by the mesh's axes, checked and timed once (rank_workload).

#include "ferry/result.hpp"
#include "ferry/sim/engine/device_profile.hpp"
#include "ferry/sim/mesh/mesh.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {

/// A model and the device it runs on. As read (api/load.hpp) the model is checked but not
/// timed; rank_workload's is timed on the device's roofline, what simulate, compare and plan
/// run.
struct Workload {
  CheckedModel model;
  DeviceProfile device;
};

/// The axes of a mesh that cut a rank's model (each only where the mesh's degree is 2 or more).
struct CutAxes {
  bool tp = true;
  bool cp = true;
  bool ep = true;
};

/// The workload one GPU of `mesh` runs: `whole`'s model cut by the mesh's tensor-, context- and
/// expert-parallel groups, those `axes` names, in that order (Note [A rank's model], Note [A
/// context-parallel rank], Note [An expert-parallel rank]), validated once and timed on the
/// device once; with nothing to cut, `whole`'s model timed. The whole model is never timed
/// before it is cut. The error names the op or tensor that does not split, with the flag.
Result<Workload> rank_workload(const Workload& whole, const Mesh& mesh, CutAxes axes = {});

}  // namespace ferry::sim
