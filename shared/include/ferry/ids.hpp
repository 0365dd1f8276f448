#pragma once
/// Strong ids: explicit construction, no implicit conversions, default value invalid.

#include <compare>
#include <cstdint>
#include <functional>
#include <limits>

namespace ferry {

/// An opaque index tagged by what it names. Ordered by value, never by address.
template <class Tag, class Rep = std::uint32_t>
class StrongId {
 public:
  using rep_type = Rep;
  static constexpr Rep kInvalid = std::numeric_limits<Rep>::max();

  constexpr StrongId() = default;
  constexpr explicit StrongId(Rep value) : value_(value) {}

  /// The raw index; only meaningful when valid().
  [[nodiscard]] constexpr Rep value() const { return value_; }
  [[nodiscard]] constexpr bool valid() const { return value_ != kInvalid; }

  friend constexpr auto operator<=>(StrongId, StrongId) = default;

 private:
  Rep value_ = kInvalid;
};

using TensorId = StrongId<struct TensorTag>;
using StreamId = StrongId<struct StreamTag>;
using EventId = StrongId<struct EventTag>;
using BufferId = StrongId<struct BufferTag>;
using NodeId = StrongId<struct NodeTag>;
using DeviceId = StrongId<struct DeviceTag>;
using OpId = StrongId<struct OpTag>;

}  // namespace ferry

template <class Tag, class Rep>
struct std::hash<ferry::StrongId<Tag, Rep>> {
  std::size_t operator()(ferry::StrongId<Tag, Rep> id) const noexcept {
    return std::hash<Rep>{}(id.value());
  }
};
