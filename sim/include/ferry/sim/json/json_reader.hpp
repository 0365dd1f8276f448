#pragma once
/// A small reader over nlohmann::json that knows each value's path in its document
/// ("ops[3].reads[0].bytes") and reports every problem as a ferry::Error naming that path.

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/result.hpp"

namespace ferry::sim {

/// Deepest nesting of arrays and objects a document may have; deeper input is refused.
inline constexpr int kMaxJsonDepth = 128;
/// Largest byte count or offset accepted in a document: 2^50 bytes (1 PiB).
inline constexpr std::int64_t kMaxJsonBytes = std::int64_t{1} << 50;
/// Largest duration or latency accepted in a document: 10^15 ns (about 11.6 days).
inline constexpr std::int64_t kMaxJsonNanoseconds = 1'000'000'000'000'000;
/// Smallest rate (bytes or FLOP per second) accepted, so that transfer times fit in 64 bits.
inline constexpr std::int64_t kMinJsonRate = 1'000'000;
/// Largest rate (bytes or FLOP per second) accepted: 10^18.
inline constexpr std::int64_t kMaxJsonRate = 1'000'000'000'000'000'000;

/// Parses JSON text without throwing. Syntax errors read "source:LINE:COL: syntax error ..."
/// (LINE and COL 1-based, COL in bytes); duplicate keys and nesting deeper than kMaxJsonDepth
/// are errors too. `source` names the document (usually its path).
Result<nlohmann::json> parse_json_text(std::string_view text, std::string_view source);

/// A short human description of a value for "got ..." in messages: `-5`, `1.5`,
/// `a string "abc"`, `an array`, `an object`, `null`, `true`.
[[nodiscard]] std::string describe_json(const nlohmann::json& value);

/// `text` as a JSON string literal (quotes and escapes; invalid UTF-8 replaced), for messages.
[[nodiscard]] std::string json_quote(std::string_view text);

/// The path of member `key` of the value at `parent` ("ops[3]" + "stream" -> "ops[3].stream").
[[nodiscard]] std::string json_member_path(std::string_view parent, std::string_view key);
/// The path of element `index` of the array at `parent` ("ops" + 3 -> "ops[3]").
[[nodiscard]] std::string json_element_path(std::string_view parent, std::size_t index);

class JsonObject;

/// A JSON value, the name of its document and its path there (the root's path is ""). Refers to
/// the value and the source name: both must outlive the reader. Cheap to copy.
class JsonValue {
 public:
  /// The root of a document named `source`.
  JsonValue(const nlohmann::json& root, std::string_view source);
  /// A value at `path` inside the document named `source`.
  JsonValue(const nlohmann::json& value, std::string_view source, std::string path);

  /// The underlying value.
  [[nodiscard]] const nlohmann::json& json() const { return *value_; }
  /// The path of the value in its document; empty for the root.
  [[nodiscard]] const std::string& path() const { return path_; }
  /// The name of the document, as given at construction.
  [[nodiscard]] std::string_view source() const { return source_; }

  /// An error about this value: "source: path: message" ("source: message" at the root).
  template <class... Args>
  [[nodiscard]] Error error(fmt::format_string<Args...> format, Args&&... args) const {
    return error_message(fmt::format(format, std::forward<Args>(args)...));
  }
  /// As error(), with a message already formatted.
  [[nodiscard]] Error error_message(std::string_view message) const;

  /// A string (possibly empty).
  [[nodiscard]] Result<std::string> string() const;
  /// A non-empty string, as used for names.
  [[nodiscard]] Result<std::string> name() const;
  /// An integer in [min, max]. Floats (1.0, 1e3), strings and out-of-range values are errors.
  [[nodiscard]] Result<std::int64_t> integer(std::int64_t min, std::int64_t max) const;
  /// true or false.
  [[nodiscard]] Result<bool> boolean() const;
  /// The elements of an array, each with its path.
  [[nodiscard]] Result<std::vector<JsonValue>> array() const;
  /// An object whose keys must all be in `allowed`; an unknown key is an error that names it and
  /// lists the allowed keys in the given order.
  [[nodiscard]] Result<JsonObject> object(std::span<const std::string_view> allowed) const;
  /// As object(span).
  [[nodiscard]] Result<JsonObject> object(std::initializer_list<std::string_view> allowed) const;
  /// An object with any keys; for a first look at a discriminating key (see object()).
  [[nodiscard]] Result<JsonObject> object_with_any_keys() const;

  /// The member `key` of an object value, or nullopt when absent or this is not an object.
  [[nodiscard]] std::optional<JsonValue> member(std::string_view key) const;

 private:
  const nlohmann::json* value_;
  std::string_view source_;
  std::string path_;
};

/// A JSON object whose keys were checked, with required and optional typed members.
class JsonObject {
 public:
  /// The object itself, as a value.
  [[nodiscard]] const JsonValue& value() const { return value_; }
  /// An error about the object (see JsonValue::error).
  template <class... Args>
  [[nodiscard]] Error error(fmt::format_string<Args...> format, Args&&... args) const {
    return value_.error(format, std::forward<Args>(args)...);
  }

  /// Whether `key` is present.
  [[nodiscard]] bool has(std::string_view key) const;
  /// Member `key`; its absence is an error naming the key at the object's path.
  [[nodiscard]] Result<JsonValue> required(std::string_view key) const;
  /// Member `key`, or nullopt.
  [[nodiscard]] std::optional<JsonValue> optional(std::string_view key) const;

  /// Required non-empty string.
  [[nodiscard]] Result<std::string> required_name(std::string_view key) const;
  /// Required string (possibly empty).
  [[nodiscard]] Result<std::string> required_string(std::string_view key) const;
  /// Optional string, `fallback` when absent.
  [[nodiscard]] Result<std::string> optional_string(std::string_view key,
                                                    std::string fallback) const;
  /// Required integer in [min, max].
  [[nodiscard]] Result<std::int64_t> required_integer(std::string_view key, std::int64_t min,
                                                      std::int64_t max) const;
  /// Optional integer in [min, max], `fallback` when absent.
  [[nodiscard]] Result<std::int64_t> optional_integer(std::string_view key, std::int64_t fallback,
                                                      std::int64_t min, std::int64_t max) const;
  /// Optional boolean, `fallback` when absent.
  [[nodiscard]] Result<bool> optional_boolean(std::string_view key, bool fallback) const;
  /// Required array.
  [[nodiscard]] Result<std::vector<JsonValue>> required_array(std::string_view key) const;
  /// Optional array, empty when absent.
  [[nodiscard]] Result<std::vector<JsonValue>> optional_array(std::string_view key) const;
  /// Required object with keys among `allowed`.
  [[nodiscard]] Result<JsonObject> required_object(
      std::string_view key, std::initializer_list<std::string_view> allowed) const;

 private:
  friend class JsonValue;
  explicit JsonObject(JsonValue value) : value_(std::move(value)) {}

  JsonValue value_;
};

}  // namespace ferry::sim

#define FERRY_JSON_CONCAT_INNER(a, b) a##b
#define FERRY_JSON_CONCAT(a, b) FERRY_JSON_CONCAT_INNER(a, b)
#define FERRY_JSON_TRY_IMPL(lhs, expr, tmp) \
  auto tmp = (expr);                        \
  if (!tmp.ok()) return tmp.error();        \
  lhs = std::move(tmp).value()

/// Evaluates `expr` (a Result); on error returns that error from the enclosing function (which
/// returns a Result), otherwise assigns the value to `lhs` (`auto x` declares it). One per line.
#define FERRY_JSON_TRY(lhs, expr) \
  FERRY_JSON_TRY_IMPL(lhs, expr, FERRY_JSON_CONCAT(ferry_json_try_, __LINE__))

/// Evaluates `expr` (a Result); on error returns that error from the enclosing function.
#define FERRY_JSON_RETURN_IF_ERROR(expr)                              \
  do {                                                                \
    if (auto ferry_json_status_ = (expr); !ferry_json_status_.ok()) { \
      return ferry_json_status_.error();                              \
    }                                                                 \
  } while (false)
