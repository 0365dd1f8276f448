#pragma once
/// The engine's vocabulary is the program model of the core (ferry/program/program.hpp): the
/// simulator runs programs as the real backend records them.

#include "ferry/program/program.hpp"

namespace ferry::sim {

using ferry::memory_kind_name;
using ferry::MemoryKind;
using ferry::op_kind_name;
using ferry::OpKind;
using ferry::Program;
using ferry::ProgramBuffer;
using ferry::ProgramDevice;
using ferry::ProgramEvent;
using ferry::ProgramLink;
using ferry::ProgramOp;
using ferry::ProgramStream;
using ferry::SlotId;
using ferry::SlotRange;

}  // namespace ferry::sim
