#pragma once
/// Result<T>: an expected outcome that may instead be an error value with a message.

#include <string>
#include <utility>
#include <variant>

#include "ferry/check.hpp"

namespace ferry {

/// An expected failure (bad input, simulated OOM, infeasible plan): a message that names the
/// place and, where one exists, the fix.
struct Error {
  std::string message;
};

/// Either a value or an Error. Accessing the wrong alternative is an invariant violation.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value)
      : state_(std::in_place_index<0>, std::move(value)) {}  // NOLINT: implicit by design
  Result(Error error) : state_(std::in_place_index<1>, std::move(error)) {}  // NOLINT

  [[nodiscard]] bool ok() const { return state_.index() == 0; }
  explicit operator bool() const { return ok(); }

  [[nodiscard]] T& value() & {
    FERRY_CHECK(ok(), "value() on an error result: {}", std::get<1>(state_).message);
    return std::get<0>(state_);
  }
  [[nodiscard]] const T& value() const& {
    FERRY_CHECK(ok(), "value() on an error result: {}", std::get<1>(state_).message);
    return std::get<0>(state_);
  }
  [[nodiscard]] T&& value() && {
    FERRY_CHECK(ok(), "value() on an error result: {}", std::get<1>(state_).message);
    return std::get<0>(std::move(state_));
  }
  [[nodiscard]] const Error& error() const {
    FERRY_CHECK(!ok(), "error() on a successful result");
    return std::get<1>(state_);
  }

 private:
  std::variant<T, Error> state_;
};

/// A Result with no value: success or an Error.
struct Ok {};
using Status = Result<Ok>;

}  // namespace ferry
