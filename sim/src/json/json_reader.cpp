#include "ferry/sim/json/json_reader.hpp"

#include <fmt/ranges.h>

#include <cmath>
#include <new>

namespace ferry::sim {
namespace {

using nlohmann::json;

/// Longest string shown verbatim in a message before it is cut.
constexpr std::size_t kShownStringChars = 40;

bool is_identifier(std::string_view key) {
  if (key.empty()) return false;
  for (std::size_t i = 0; i < key.size(); ++i) {
    const char c = key[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (!letter && !(digit && i > 0)) return false;
  }
  return true;
}

/// 1-based line and byte column of the character at 0-based `offset` in `text`.
std::pair<std::size_t, std::size_t> line_and_column(std::string_view text, std::size_t offset) {
  if (offset > text.size()) offset = text.size();
  std::size_t line = 1;
  std::size_t line_start = 0;
  for (std::size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return {line, offset - line_start + 1};
}

/// nlohmann's message without its "[json.exception...] parse error at line L, column C: " prefix
/// (we print our own position), always starting with "syntax error".
std::string syntax_message(std::string_view what) {
  std::string_view rest = what;
  if (const auto at = rest.find("parse error"); at != std::string_view::npos) {
    rest.remove_prefix(at);
    if (const auto colon = rest.find(": "); colon != std::string_view::npos) {
      rest.remove_prefix(colon + 2);
    }
  }
  // The message quotes the bytes last read, which may be invalid UTF-8: show those as \xNN.
  std::string printable;
  for (const char c : rest) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x80U) {
      printable += fmt::format("\\x{:02x}", byte);
    } else {
      printable += c;
    }
  }
  constexpr std::string_view kSyntax = "syntax error";
  if (printable.starts_with(kSyntax)) return printable;
  return fmt::format("syntax error: {}", printable);
}

// Builds the document from SAX events, like nlohmann's DOM parser, and also refuses duplicate
// keys and deep nesting. nlohmann's callback parser rescans the parent container at every
// object end (quadratic on long arrays), hence a handler of our own.
class DocumentBuilder {
 public:
  explicit DocumentBuilder(std::string_view source) : source_(source) {}

  bool null() { return add(json(nullptr)); }
  bool boolean(bool value) { return add(json(value)); }
  bool number_integer(json::number_integer_t value) { return add(json(value)); }
  bool number_unsigned(json::number_unsigned_t value) { return add(json(value)); }
  bool number_float(json::number_float_t value, const json::string_t& text) {
    if (!std::isfinite(value)) {
      return fail(fmt::format("{}: number {} is out of range", where(), text));
    }
    return add(json(value));
  }
  bool string(json::string_t& value) { return add(json(std::move(value))); }
  bool binary(json::binary_t& /*value*/) { return fail("binary values are not JSON"); }

  bool start_object(std::size_t /*elements*/) { return open(json::object()); }
  bool start_array(std::size_t /*elements*/) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(json::string_t& key) {
    Frame& top = stack_.back();
    if (top.value->contains(key)) {
      return fail(fmt::format("{}duplicate key {}", prefix(), json_quote(key)));
    }
    top.key = std::move(key);
    return true;
  }

  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const json::exception& error) {
    syntax_error_position_ = position;
    syntax_error_ = syntax_message(error.what());
    return false;
  }

  [[nodiscard]] bool has_syntax_error() const { return syntax_error_position_.has_value(); }
  [[nodiscard]] std::size_t syntax_error_position() const { return *syntax_error_position_; }
  [[nodiscard]] const std::string& syntax_error() const { return syntax_error_; }
  [[nodiscard]] const std::string& error() const { return error_; }
  json& root() { return root_; }

 private:
  struct Frame {
    json* value;
    std::string key;  // of the member being read, when value is an object
  };

  /// The path of the innermost open container.
  [[nodiscard]] std::string path() const {
    std::string result;
    for (std::size_t i = 0; i + 1 < stack_.size(); ++i) {
      const json& container = *stack_[i].value;
      result = container.is_array() ? json_element_path(result, container.size() - 1)
                                    : json_member_path(result, stack_[i].key);
    }
    return result;
  }
  [[nodiscard]] std::string prefix() const {
    const std::string at = path();
    return at.empty() ? std::string() : at + ": ";
  }
  [[nodiscard]] std::string where() const {
    const std::string at = path();
    return at.empty() ? std::string("document") : at;
  }

  bool fail(std::string message) {
    error_ = fmt::format("{}: {}", source_, message);
    return false;
  }

  /// Stores `value` in the innermost container (or as the root); returns where it went.
  json* place(json value) {
    if (stack_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Frame& top = stack_.back();
    if (top.value->is_array()) {
      top.value->push_back(std::move(value));
      return &top.value->back();
    }
    json& slot = (*top.value)[top.key];
    slot = std::move(value);
    return &slot;
  }

  bool add(json value) {
    place(std::move(value));
    return true;
  }

  bool open(json container) {
    if (stack_.size() >= static_cast<std::size_t>(kMaxJsonDepth)) {
      return fail(fmt::format("nesting deeper than {} levels", kMaxJsonDepth));
    }
    json* placed = place(std::move(container));
    stack_.push_back(Frame{placed, {}});
    return true;
  }

  bool close() {
    stack_.pop_back();
    return true;
  }

  std::string_view source_;
  json root_;
  std::vector<Frame> stack_;
  std::optional<std::size_t> syntax_error_position_;
  std::string syntax_error_;
  std::string error_;
};

std::string integer_expectation(std::int64_t min, std::int64_t max) {
  // A small upper bound is part of what the reader must know; a huge one is a sanity limit.
  constexpr std::int64_t kSmallBound = std::int64_t{1} << 31;
  if (min == 0 && max >= kSmallBound) return "a non-negative integer";
  if (min == 1 && max >= kSmallBound) return "a positive integer";
  return fmt::format("an integer in [{}, {}]", min, max);
}

}  // namespace

Result<nlohmann::json> parse_json_text(std::string_view text, std::string_view source) {
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    return Error{fmt::format("{}: empty document (expected a JSON object)", source)};
  }
  DocumentBuilder builder(source);
  try {
    const bool ok = json::sax_parse(text.begin(), text.end(), &builder);
    if (ok) return std::move(builder.root());
  } catch (const json::exception& e) {
    return Error{fmt::format("{}: cannot parse: {}", source, e.what())};
  } catch (const std::bad_alloc&) {
    return Error{fmt::format("{}: out of memory while parsing", source)};
  }
  if (builder.has_syntax_error()) {
    // nlohmann reports the count of bytes read; the offending byte is the last one read.
    const std::size_t read = builder.syntax_error_position();
    const auto [line, column] = line_and_column(text, read == 0 ? 0 : read - 1);
    return Error{fmt::format("{}:{}:{}: {}", source, line, column, builder.syntax_error())};
  }
  return Error{builder.error()};
}

std::string describe_json(const nlohmann::json& value) {
  switch (value.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return value.get<bool>() ? "true" : "false";
    case json::value_t::string: {
      const auto& text = value.get_ref<const std::string&>();
      if (text.size() <= kShownStringChars) return "a string " + json_quote(text);
      std::size_t cut = kShownStringChars;
      // Do not cut inside a UTF-8 sequence.
      while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0U) == 0x80U) --cut;
      return "a string " + json_quote(text.substr(0, cut)) + "...";
    }
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float:
      return value.dump();
    case json::value_t::binary:
    case json::value_t::discarded:
      break;
  }
  return "an unsupported value";
}

std::string json_quote(std::string_view text) {
  return json(std::string(text)).dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string json_member_path(std::string_view parent, std::string_view key) {
  if (!is_identifier(key)) return fmt::format("{}[{}]", parent, json_quote(key));
  if (parent.empty()) return std::string(key);
  return fmt::format("{}.{}", parent, key);
}

std::string json_element_path(std::string_view parent, std::size_t index) {
  return fmt::format("{}[{}]", parent, index);
}

JsonValue::JsonValue(const nlohmann::json& root, std::string_view source)
    : value_(&root), source_(source) {}

JsonValue::JsonValue(const nlohmann::json& value, std::string_view source, std::string path)
    : value_(&value), source_(source), path_(std::move(path)) {}

Error JsonValue::error_message(std::string_view message) const {
  if (path_.empty()) return Error{fmt::format("{}: {}", source_, message)};
  return Error{fmt::format("{}: {}: {}", source_, path_, message)};
}

Result<std::string> JsonValue::string() const {
  if (!value_->is_string()) return error("expected a string, got {}", describe_json(*value_));
  return value_->get<std::string>();
}

Result<std::string> JsonValue::name() const {
  if (!value_->is_string())
    return error("expected a name (a string), got {}", describe_json(*value_));
  auto text = value_->get<std::string>();
  if (text.empty()) return error("expected a non-empty name, got an empty string");
  return text;
}

Result<std::int64_t> JsonValue::integer(std::int64_t min, std::int64_t max) const {
  FERRY_CHECK(min <= max, "integer bounds [{}, {}] are empty", min, max);
  if (value_->is_number_unsigned()) {
    const auto value = value_->get<std::uint64_t>();
    if (max < 0 || value > static_cast<std::uint64_t>(max)) {
      return error("{} is above the limit of {}", value, max);
    }
    const auto signed_value = static_cast<std::int64_t>(value);
    if (signed_value < min) {
      return error("expected {}, got {}", integer_expectation(min, max), signed_value);
    }
    return signed_value;
  }
  if (value_->is_number_integer()) {
    const auto value = value_->get<std::int64_t>();
    if (value < min) return error("expected {}, got {}", integer_expectation(min, max), value);
    if (value > max) return error("{} is above the limit of {}", value, max);
    return value;
  }
  if (value_->is_number_float()) {
    const double value = value_->get<double>();
    if (value > static_cast<double>(max)) {
      return error("{} is above the limit of {}", describe_json(*value_), max);
    }
    if (value < static_cast<double>(min)) {
      return error("expected {}, got {}", integer_expectation(min, max), describe_json(*value_));
    }
    return error("expected {}, got {} (write integers without a fraction or exponent)",
                 integer_expectation(min, max), describe_json(*value_));
  }
  return error("expected {}, got {}", integer_expectation(min, max), describe_json(*value_));
}

Result<bool> JsonValue::boolean() const {
  if (!value_->is_boolean()) return error("expected true or false, got {}", describe_json(*value_));
  return value_->get<bool>();
}

Result<std::vector<JsonValue>> JsonValue::array() const {
  if (!value_->is_array()) return error("expected an array, got {}", describe_json(*value_));
  std::vector<JsonValue> elements;
  elements.reserve(value_->size());
  std::size_t index = 0;
  for (const auto& element : *value_) {
    elements.emplace_back(element, source_, json_element_path(path_, index));
    ++index;
  }
  return elements;
}

Result<JsonObject> JsonValue::object(std::span<const std::string_view> allowed) const {
  if (!value_->is_object()) return error("expected an object, got {}", describe_json(*value_));
  for (const auto& [key, member] : value_->items()) {
    bool known = false;
    for (const std::string_view candidate : allowed) {
      if (candidate == key) {
        known = true;
        break;
      }
    }
    if (!known) {
      return error("unknown key {} (allowed: {})", json_quote(key), fmt::join(allowed, ", "));
    }
  }
  return JsonObject(*this);
}

Result<JsonObject> JsonValue::object(std::initializer_list<std::string_view> allowed) const {
  return object(std::span<const std::string_view>(allowed.begin(), allowed.size()));
}

Result<JsonObject> JsonValue::object_with_any_keys() const {
  if (!value_->is_object()) return error("expected an object, got {}", describe_json(*value_));
  return JsonObject(*this);
}

std::optional<JsonValue> JsonValue::member(std::string_view key) const {
  if (!value_->is_object()) return std::nullopt;
  const auto it = value_->find(key);
  if (it == value_->end()) return std::nullopt;
  return JsonValue(*it, source_, json_member_path(path_, key));
}

bool JsonObject::has(std::string_view key) const { return value_.member(key).has_value(); }

Result<JsonValue> JsonObject::required(std::string_view key) const {
  auto member = value_.member(key);
  if (!member) return value_.error("missing required key {}", json_quote(key));
  return *std::move(member);
}

std::optional<JsonValue> JsonObject::optional(std::string_view key) const {
  return value_.member(key);
}

Result<std::string> JsonObject::required_name(std::string_view key) const {
  FERRY_JSON_TRY(const auto member, required(key));
  return member.name();
}

Result<std::string> JsonObject::required_string(std::string_view key) const {
  FERRY_JSON_TRY(const auto member, required(key));
  return member.string();
}

Result<std::string> JsonObject::optional_string(std::string_view key, std::string fallback) const {
  const auto member = optional(key);
  if (!member) return fallback;
  return member->string();
}

Result<std::int64_t> JsonObject::required_integer(std::string_view key, std::int64_t min,
                                                  std::int64_t max) const {
  FERRY_JSON_TRY(const auto member, required(key));
  return member.integer(min, max);
}

Result<std::int64_t> JsonObject::optional_integer(std::string_view key, std::int64_t fallback,
                                                  std::int64_t min, std::int64_t max) const {
  const auto member = optional(key);
  if (!member) return fallback;
  return member->integer(min, max);
}

Result<bool> JsonObject::optional_boolean(std::string_view key, bool fallback) const {
  const auto member = optional(key);
  if (!member) return fallback;
  return member->boolean();
}

Result<std::vector<JsonValue>> JsonObject::required_array(std::string_view key) const {
  FERRY_JSON_TRY(const auto member, required(key));
  return member.array();
}

Result<std::vector<JsonValue>> JsonObject::optional_array(std::string_view key) const {
  const auto member = optional(key);
  if (!member) return std::vector<JsonValue>{};
  return member->array();
}

Result<JsonObject> JsonObject::required_object(
    std::string_view key, std::initializer_list<std::string_view> allowed) const {
  FERRY_JSON_TRY(const auto member, required(key));
  return member.object(allowed);
}

}  // namespace ferry::sim
