#pragma once
/// A writer of Python pickles (protocol 2) holding plain values: dicts, lists, tuples, str,
/// int, float, bool and None. The same calls give the same bytes.

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace ferry::sim {

// Note [Pickle opcodes]
// Only opcodes of protocol 2 that Python's pickle.loads (and any reader of protocol 2) knows:
// PROTO, STOP; NONE, NEWTRUE, NEWFALSE; BININT1, BININT2, BININT, LONG1 for integers (the
// shortest that holds the value, as Python's own pickler chooses); BINFLOAT (an IEEE double,
// big-endian); BINUNICODE (UTF-8); EMPTY_DICT/EMPTY_LIST followed by MARK ... SETITEMS/APPENDS,
// and MARK ... TUPLE; BINPUT/LONG_BINPUT and BINGET/LONG_BINGET for the memo. Every string is
// memoized the first time it is written and fetched from the memo afterwards, so that a key
// repeated in every dict costs two bytes; a container may be memoized too (remember / recall),
// and then the reader gets one shared object. No classes, no code: loading runs nothing.

// Note [Pickle batches]
// A list's items reach the list in batches of kBatch (MARK, items, APPENDS), a dict's in
// batches of kBatch pairs (MARK, key, value, ..., SETITEMS), as Python's own pickler writes
// them: a reader that moves a whole batch at once (a JavaScript spread of the items as
// arguments, in pytorch.org/memory_viz) then never moves more than that.

/// Builds one pickled value depth-first: open a container, write its items (a dict's as key,
/// value, key, value, ...), close it; then finish.
class PickleWriter {
 public:
  /// Starts a pickle (the protocol 2 header).
  PickleWriter();

  void none();
  void boolean(bool value);
  void integer(std::int64_t value);
  /// A Python float; NaN and infinities are written as they are.
  void real(double value);
  /// A Python str. Bytes that are not valid UTF-8 become U+FFFD, so that the pickle loads.
  void str(std::string_view value);

  void begin_list();
  void end_list();
  void begin_dict();
  /// Closes the innermost dict; it must hold an even number of items (keys and values).
  void end_dict();
  void begin_tuple();
  void end_tuple();

  /// Memoizes the value just completed and returns its memo index, for recall.
  [[nodiscard]] std::uint32_t remember();
  /// Writes the value memoized as `memo` again: the reader gets the same object.
  void recall(std::uint32_t memo);

  /// Ends the pickle and returns its bytes. Exactly one value must have been written and every
  /// container closed. The writer is then spent.
  [[nodiscard]] std::string finish();

 private:
  enum class Open : std::uint8_t { List, Dict, Tuple };
  struct Frame {
    Open kind;
    std::uint64_t items = 0;  // in the container
    std::uint64_t batch = 0;  // in its open batch (Note [Pickle batches])
  };
  /// Items in a batch of a list; pairs in a batch of a dict.
  static constexpr std::uint64_t kBatch = 1000;

  void before_value();
  void value_done();
  void begin(Open kind, std::string_view opcodes);
  void end(Open kind, char opcode);
  void put(std::uint32_t memo);

  std::string out_;
  std::vector<Frame> open_;
  std::uint64_t top_values_ = 0;  // values written outside any container (must end as 1)
  bool has_last_ = false;         // a value was just completed (remember may follow)
  bool finished_ = false;
  std::uint32_t next_memo_ = 0;
  std::unordered_map<std::string, std::uint32_t> strings_;  // memo of strings; lookup only
};

}  // namespace ferry::sim
