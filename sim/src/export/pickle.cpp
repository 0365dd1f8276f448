#include "ferry/sim/export/pickle.hpp"

#include <bit>
#include <utility>

#include "ferry/check.hpp"

namespace ferry::sim {

namespace {

// Opcodes, see Note [Pickle opcodes].
constexpr char kProto = '\x80';
constexpr char kStop = '.';
constexpr char kNone = 'N';
constexpr char kNewTrue = '\x88';
constexpr char kNewFalse = '\x89';
constexpr char kBinInt1 = 'K';
constexpr char kBinInt2 = 'M';
constexpr char kBinInt = 'J';
constexpr char kLong1 = '\x8a';
constexpr char kBinFloat = 'G';
constexpr char kBinUnicode = 'X';
constexpr char kEmptyList = ']';
constexpr char kEmptyDict = '}';
constexpr char kMark = '(';
constexpr char kAppends = 'e';
constexpr char kSetItems = 'u';
constexpr char kTuple = 't';
constexpr char kBinPut = 'q';
constexpr char kLongBinPut = 'r';
constexpr char kBinGet = 'h';
constexpr char kLongBinGet = 'j';

void little_endian(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((value >> (8 * i)) & 0xff);
}

// Length of the UTF-8 sequence starting at s[i], or 0 when it is not a valid one (overlong
// forms, surrogates and code points past U+10FFFF are invalid).
std::size_t utf8_sequence(std::string_view s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return 1;
  std::size_t n = 0;
  std::uint32_t cp = 0;
  if ((b0 & 0xe0) == 0xc0) {
    n = 2;
    cp = b0 & 0x1fU;
  } else if ((b0 & 0xf0) == 0xe0) {
    n = 3;
    cp = b0 & 0x0fU;
  } else if ((b0 & 0xf8) == 0xf0) {
    n = 4;
    cp = b0 & 0x07U;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3fU);
  }
  constexpr std::uint32_t kShortest[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kShortest[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

// `s` with each byte that starts no valid UTF-8 sequence replaced by U+FFFD.
std::string valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence(s, i);
    if (n == 0) {
      out += "\xef\xbf\xbd";
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace

PickleWriter::PickleWriter() {
  out_ += kProto;
  out_ += '\x02';
}

void PickleWriter::before_value() {
  FERRY_CHECK(!finished_, "pickle written to after finish");
  has_last_ = false;
  if (open_.empty()) return;
  // See Note [Pickle batches]: a full batch is closed before the next item, never right after
  // the last one, so that remember() still finds that item on top of the stack.
  Frame& f = open_.back();
  const std::uint64_t full = f.kind == Open::List ? kBatch : 2 * kBatch;
  if (f.kind == Open::Tuple || f.batch < full) return;
  out_ += f.kind == Open::List ? kAppends : kSetItems;
  out_ += kMark;
  f.batch = 0;
}

void PickleWriter::value_done() {
  if (open_.empty()) {
    ++top_values_;
  } else {
    ++open_.back().items;
    ++open_.back().batch;
  }
  has_last_ = true;
}

void PickleWriter::none() {
  before_value();
  out_ += kNone;
  value_done();
}

void PickleWriter::boolean(bool value) {
  before_value();
  out_ += value ? kNewTrue : kNewFalse;
  value_done();
}

void PickleWriter::integer(std::int64_t value) {
  before_value();
  if (value >= 0 && value <= 0xff) {
    out_ += kBinInt1;
    little_endian(out_, static_cast<std::uint64_t>(value), 1);
  } else if (value >= 0 && value <= 0xffff) {
    out_ += kBinInt2;
    little_endian(out_, static_cast<std::uint64_t>(value), 2);
  } else if (value >= INT32_MIN && value <= INT32_MAX) {
    out_ += kBinInt;
    little_endian(out_, static_cast<std::uint64_t>(value), 4);
  } else {
    // Two's complement, little-endian, in the fewest bytes that keep the sign.
    const auto bits = static_cast<std::uint64_t>(value);
    int bytes = 8;
    while (bytes > 1) {
      const unsigned top = (bits >> (8 * (bytes - 1))) & 0xff;
      const unsigned next_sign = (bits >> (8 * (bytes - 1) - 1)) & 1;
      if (!((top == 0x00 && next_sign == 0) || (top == 0xff && next_sign == 1))) break;
      --bytes;
    }
    out_ += kLong1;
    out_ += static_cast<char>(bytes);
    little_endian(out_, bits, bytes);
  }
  value_done();
}

void PickleWriter::real(double value) {
  before_value();
  out_ += kBinFloat;
  const auto bits = std::bit_cast<std::uint64_t>(value);
  for (int i = 7; i >= 0; --i) out_ += static_cast<char>((bits >> (8 * i)) & 0xff);
  value_done();
}

void PickleWriter::str(std::string_view value) {
  std::string text = valid_utf8(value);
  if (const auto it = strings_.find(text); it != strings_.end()) {
    recall(it->second);
    return;
  }
  FERRY_CHECK(text.size() <= UINT32_MAX, "string of {} bytes is too long to pickle", text.size());
  before_value();
  out_ += kBinUnicode;
  little_endian(out_, text.size(), 4);
  out_ += text;
  value_done();
  const std::uint32_t memo = remember();
  strings_.emplace(std::move(text), memo);
}

void PickleWriter::begin(Open kind, std::string_view opcodes) {
  before_value();
  out_ += opcodes;
  open_.push_back(Frame{kind});
}

void PickleWriter::end(Open kind, char opcode) {
  FERRY_CHECK(!finished_, "pickle written to after finish");
  FERRY_CHECK(!open_.empty() && open_.back().kind == kind, "pickle container closed out of order");
  FERRY_CHECK(kind != Open::Dict || open_.back().items % 2 == 0,
              "pickle dict closed with a key and no value");
  out_ += opcode;
  open_.pop_back();
  value_done();
}

void PickleWriter::begin_list() { begin(Open::List, std::string{kEmptyList, kMark}); }
void PickleWriter::end_list() { end(Open::List, kAppends); }
void PickleWriter::begin_dict() { begin(Open::Dict, std::string{kEmptyDict, kMark}); }
void PickleWriter::end_dict() { end(Open::Dict, kSetItems); }
void PickleWriter::begin_tuple() { begin(Open::Tuple, std::string{kMark}); }
void PickleWriter::end_tuple() { end(Open::Tuple, kTuple); }

void PickleWriter::put(std::uint32_t memo) {
  if (memo <= 0xff) {
    out_ += kBinPut;
    little_endian(out_, memo, 1);
  } else {
    out_ += kLongBinPut;
    little_endian(out_, memo, 4);
  }
}

std::uint32_t PickleWriter::remember() {
  FERRY_CHECK(has_last_ && !finished_, "pickle remember() with no value just written");
  FERRY_CHECK(next_memo_ < UINT32_MAX, "pickle memo is full");
  const std::uint32_t memo = next_memo_++;
  put(memo);
  return memo;
}

void PickleWriter::recall(std::uint32_t memo) {
  FERRY_CHECK(memo < next_memo_, "pickle recall of memo {}, which was never remembered", memo);
  before_value();
  if (memo <= 0xff) {
    out_ += kBinGet;
    little_endian(out_, memo, 1);
  } else {
    out_ += kLongBinGet;
    little_endian(out_, memo, 4);
  }
  value_done();
}

std::string PickleWriter::finish() {
  FERRY_CHECK(!finished_, "pickle finished twice");
  FERRY_CHECK(open_.empty(), "pickle finished with {} containers open", open_.size());
  FERRY_CHECK(top_values_ == 1, "a pickle holds one value, not {}", top_values_);
  out_ += kStop;
  finished_ = true;
  return std::move(out_);
}

}  // namespace ferry::sim
