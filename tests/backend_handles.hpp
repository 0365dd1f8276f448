#pragma once
// The handle types of the test backends: a number each, -1 when unset.

namespace ferry::testing {

struct StreamHandle {
  int id = -1;
  friend bool operator==(StreamHandle, StreamHandle) = default;
};
struct EventHandle {
  int id = -1;
  friend bool operator==(EventHandle, EventHandle) = default;
};
struct BufferHandle {
  int id = -1;
  friend bool operator==(BufferHandle, BufferHandle) = default;
};

}  // namespace ferry::testing
