#pragma once
/// The mesh's rules that need no device, for a writer that records a mesh before any device is
/// named (the tracer's parallelism section): Mesh::make checks them too, among the device's.

#include "ferry/parallelism.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/mesh/axes.hpp"

namespace ferry::sim {

/// `p` against kMeshFields' bounds and needs, and its HSDP replica groups dividing its ranks,
/// each with the words and in the order Mesh::make uses; the error names the field as `names`
/// spells it.
Status check_mesh_rules(const Parallelism& p, MeshNames names = &MeshFieldRule::name);

}  // namespace ferry::sim
