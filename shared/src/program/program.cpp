#include "ferry/program/program.hpp"

namespace ferry {

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::Alloc:
      return "alloc";
    case OpKind::Free:
      return "free";
    case OpKind::RecordStream:
      return "record_stream";
    case OpKind::Kernel:
      return "kernel";
    case OpKind::Copy:
      return "copy";
    case OpKind::Record:
      return "record";
    case OpKind::Wait:
      return "wait";
    case OpKind::SyncStream:
      return "sync_stream";
    case OpKind::SyncEvent:
      return "sync_event";
    case OpKind::SyncDevice:
      return "sync_device";
    case OpKind::Query:
      return "query";
    case OpKind::HostRead:
      return "host_read";
    case OpKind::HostWrite:
      return "host_write";
    case OpKind::EmptyCache:
      return "empty_cache";
  }
  return "?";
}

const char* memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::Device:
      return "device";
    case MemoryKind::Pinned:
      return "pinned";
    case MemoryKind::Pageable:
      return "pageable";
  }
  return "?";
}

}  // namespace ferry
