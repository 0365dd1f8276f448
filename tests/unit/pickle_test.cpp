#include "ferry/sim/export/pickle.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "ferry/check.hpp"

namespace ferry::sim {
namespace {

std::string hex(const std::string& bytes) {
  std::string out;
  for (const char c : bytes) out += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return out;
}

// The pickle of one integer, without the protocol header and STOP.
std::string int_body(std::int64_t value) {
  PickleWriter p;
  p.integer(value);
  const std::string bytes = p.finish();
  return hex(bytes.substr(2, bytes.size() - 3));
}

TEST(PickleWriter, StartsWithProtocolTwoAndEndsWithStop) {
  PickleWriter p;
  p.begin_dict();
  p.end_dict();
  EXPECT_EQ(hex(p.finish()),
            "8002"
            "7d"
            "28"
            "75"
            "2e");  // PROTO 2, }, (, u, .
}

TEST(PickleWriter, IntegersUseTheShortestOpcodeAsPythonDoes) {
  // Expected bodies are what Python's pickle.dumps(value, protocol=2) writes.
  EXPECT_EQ(int_body(0), "4b00");
  EXPECT_EQ(int_body(255), "4bff");
  EXPECT_EQ(int_body(256), "4d0001");
  EXPECT_EQ(int_body(65535), "4dffff");
  EXPECT_EQ(int_body(65536), "4a00000100");
  EXPECT_EQ(int_body(-1), "4affffffff");
  EXPECT_EQ(int_body(-256), "4a00ffffff");
  EXPECT_EQ(int_body(std::int64_t{1} << 31), "8a050000008000");
  EXPECT_EQ(int_body(-(std::int64_t{1} << 31) - 1), "8a05ffffff7fff");
  EXPECT_EQ(int_body(std::int64_t{1} << 32), "8a050000000001");
  EXPECT_EQ(int_body(std::numeric_limits<std::int64_t>::min()), "8a080000000000000080");
  EXPECT_EQ(int_body(std::numeric_limits<std::int64_t>::max()), "8a08ffffffffffffff7f");
}

TEST(PickleWriter, FloatsAreBigEndianDoubles) {
  PickleWriter p;
  p.real(1.5);
  EXPECT_EQ(hex(p.finish()),
            "8002"
            "47"
            "3ff8000000000000"
            "2e");
}

TEST(PickleWriter, ARepeatedStringIsFetchedFromTheMemo) {
  PickleWriter p;
  p.begin_list();
  p.str("ab");
  p.str("ab");
  p.end_list();
  // ], (, X len "ab", BINPUT 0, BINGET 0, APPENDS, STOP
  EXPECT_EQ(hex(p.finish()),
            "8002"
            "5d"
            "28"
            "58"
            "02000000"
            "6162"
            "7100"
            "6800"
            "65"
            "2e");
}

TEST(PickleWriter, MemoIndicesPast255UseTheLongOpcodes) {
  PickleWriter p;
  p.begin_list();
  for (int i = 0; i < 257; ++i) p.str(std::to_string(i));
  p.str("256");
  p.end_list();
  const std::string h = hex(p.finish());
  // The 257th string is memo 256: LONG_BINPUT 256; its repeat is LONG_BINGET 256.
  EXPECT_NE(h.find("58030000003235367200010000"
                   "6a00010000"),
            std::string::npos)
      << h;
}

TEST(PickleWriter, ListItemsGoInBatchesOfAThousandClosedBeforeTheNextItem) {
  PickleWriter p;
  p.begin_list();
  for (int i = 0; i < 999; ++i) p.integer(0);
  p.begin_list();
  p.end_list();
  p.recall(p.remember());  // the 1000th item is memoized before its batch is closed
  p.end_list();
  std::string expected =
      "8002"
      "5d28";
  for (int i = 0; i < 999; ++i) expected += "4b00";
  expected +=
      "5d2865"
      "7100"
      "6528"
      "6800"
      "65"
      "2e";
  EXPECT_EQ(hex(p.finish()), expected);
}

TEST(PickleWriter, DictItemsGoInBatchesOfAThousandPairs) {
  PickleWriter p;
  p.begin_dict();
  for (int i = 0; i < 2001; ++i) {
    p.integer(i);
    p.none();
  }
  p.end_dict();
  const std::string h = hex(p.finish());
  // SETITEMS then MARK after the 1000th and the 2000th pair; the last SETITEMS closes the dict.
  std::size_t batches = 0;
  for (auto at = h.find("4e7528"); at != std::string::npos; at = h.find("4e7528", at + 1)) {
    ++batches;
  }
  EXPECT_EQ(batches, 2U);
  EXPECT_EQ(h.substr(h.size() - 6), "4e752e");
}

TEST(PickleWriter, BytesThatAreNotUtf8BecomeTheReplacementCharacter) {
  PickleWriter p;
  p.str(
      "a\xff"
      "b\xc3");
  EXPECT_EQ(hex(p.finish()),
            "8002"
            "58"
            "08000000"
            "61"
            "efbfbd"
            "62"
            "efbfbd"
            "7100"
            "2e");
}

TEST(PickleWriter, ValidUtf8IsKeptAsItIs) {
  PickleWriter p;
  p.str("caf\xc3\xa9 \xf0\x9f\x9a\xa2");
  EXPECT_EQ(hex(p.finish()),
            "8002"
            "58"
            "0a000000"
            "636166c3a920f09f9aa2"
            "7100"
            "2e");
}

TEST(PickleWriter, RejectsMalformedStructures) {
  {
    PickleWriter p;
    p.begin_dict();
    p.str("key");
    EXPECT_THROW(p.end_dict(), InvariantError);
  }
  {
    PickleWriter p;
    p.begin_list();
    EXPECT_THROW((void)p.finish(), InvariantError);
  }
  {
    PickleWriter p;
    p.none();
    p.none();
    EXPECT_THROW((void)p.finish(), InvariantError);
  }
  {
    PickleWriter p;
    p.begin_list();
    EXPECT_THROW(p.end_dict(), InvariantError);
  }
  {
    PickleWriter p;
    EXPECT_THROW(p.recall(0), InvariantError);
  }
  {
    PickleWriter p;
    p.begin_list();
    EXPECT_THROW((void)p.remember(), InvariantError);
  }
}

// The value tests/python/test_memory_snapshot.py loads from the same golden bytes: one use of
// every kind of value and opcode the writer has.
std::string golden_value() {
  PickleWriter p;
  p.begin_dict();
  p.str("ints");
  p.begin_list();
  for (const std::int64_t v :
       {std::int64_t{0}, std::int64_t{255}, std::int64_t{256}, std::int64_t{65535},
        std::int64_t{65536}, std::int64_t{-1}, std::int64_t{1} << 31, -(std::int64_t{1} << 31) - 1,
        std::int64_t{1} << 32, std::numeric_limits<std::int64_t>::min(),
        std::numeric_limits<std::int64_t>::max()}) {
    p.integer(v);
  }
  p.end_list();
  p.str("float");
  p.real(-0.25);
  p.str("flags");
  p.begin_tuple();
  p.boolean(true);
  p.boolean(false);
  p.none();
  p.end_tuple();
  p.str("text");
  p.str("caf\xc3\xa9");
  p.str("bad");
  p.str(
      "a\xff"
      "b");
  p.str("shared");
  p.begin_list();
  p.begin_list();
  p.integer(1);
  p.integer(2);
  p.end_list();
  p.recall(p.remember());
  p.end_list();
  p.str("empty");
  p.begin_dict();
  p.end_dict();
  p.end_dict();
  return p.finish();
}

TEST(PickleWriter, MatchesTheGoldenBytesPythonLoads) {
  const std::string path = FERRY_TESTS_DIR "/golden/pickle/values.hex";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot read " << path;
  std::stringstream text;
  text << in.rdbuf();
  std::string expected = text.str();
  while (!expected.empty() && (expected.back() == '\n' || expected.back() == '\r')) {
    expected.pop_back();
  }
  EXPECT_EQ(hex(golden_value()), expected) << "golden file: " << path;
}

TEST(PickleWriter, SameCallsGiveSameBytes) { EXPECT_EQ(golden_value(), golden_value()); }

}  // namespace
}  // namespace ferry::sim
