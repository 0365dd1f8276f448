// The core's basic types: strong ids, quantities, Result and FERRY_CHECK.

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "ferry/check.hpp"
#include "ferry/ids.hpp"
#include "ferry/result.hpp"
#include "ferry/units.hpp"

namespace ferry {
namespace {

TEST(StrongId, DefaultIsInvalidAndIdsCompareByValue) {
  EXPECT_FALSE(TensorId().valid());
  EXPECT_TRUE(TensorId(0).valid());
  EXPECT_LT(StreamId(1), StreamId(2));
  EXPECT_EQ(EventId(7), EventId(7));
  static_assert(!std::is_convertible_v<std::uint32_t, TensorId>, "explicit construction only");
  static_assert(!std::is_same_v<TensorId, StreamId>, "ids of different things do not mix");
}

TEST(TransferTime, RoundsUpToTheNextNanosecond) {
  EXPECT_EQ(transfer_time(Bytes(1000), Bandwidth(1'000'000'000)).ns(), 1000);
  EXPECT_EQ(transfer_time(Bytes(1000), Bandwidth(3'000'000'000)).ns(), 334);
  EXPECT_EQ(transfer_time(Bytes(0), Bandwidth(1)).ns(), 0);
  // 80 GB at 55.2 GB/s: needs more than 64 bits in the intermediate product.
  EXPECT_EQ(transfer_time(Bytes(80'000'000'000), Bandwidth(55'200'000'000)).ns(), 1'449'275'363);
}

TEST(FormatBytes, UsesBinaryUnitsWithTwoDecimals) {
  EXPECT_EQ(format_bytes(Bytes(0)), "0 B");
  EXPECT_EQ(format_bytes(Bytes(1023)), "1023 B");
  EXPECT_EQ(format_bytes(Bytes(1024)), "1.00 KiB");
  EXPECT_EQ(format_bytes(Bytes(1536)), "1.50 KiB");
  EXPECT_EQ(format_bytes(20 * kMiB), "20.0 MiB");
  EXPECT_EQ(format_bytes(80 * kGiB), "80.0 GiB");
  EXPECT_EQ(format_bytes(Bytes(37'473'918'976)), "34.9 GiB");
  EXPECT_EQ(format_bytes(512 * kMiB), "512 MiB");
  EXPECT_EQ(format_bytes(1000 * kKiB), "1000 KiB");  // four digits below the next unit
  EXPECT_EQ(format_bytes(1023 * kKiB), "1023 KiB");
  EXPECT_EQ(format_bytes(Bytes(1023 * 1024 + 511)), "1023 KiB");
  EXPECT_EQ(format_bytes(Bytes(1023 * 1024 + 512)), "1.00 MiB");  // rounding carries
  EXPECT_EQ(format_bytes(Bytes(10 * 1024 - 6)), "9.99 KiB");
  EXPECT_EQ(format_bytes(Bytes(10 * 1024 - 5)), "10.0 KiB");  // 9.995 rounds half up
  EXPECT_EQ(format_bytes(2 * 1024 * kGiB), "2.00 TiB");
  EXPECT_EQ(format_bytes(Bytes(INT64_MAX)), "8192 PiB");
}

TEST(Units, FormatTimeKeepsThreeSignificantDigits) {
  EXPECT_EQ(format_time(SimTime(0)), "0 ns");
  EXPECT_EQ(format_time(SimTime(999)), "999 ns");
  EXPECT_EQ(format_time(SimTime(1000)), "1.00 us");
  EXPECT_EQ(format_time(SimTime(8'100)), "8.10 us");
  EXPECT_EQ(format_time(SimTime(161'601)), "162 us");
  EXPECT_EQ(format_time(SimTime(904'224'737)), "904 ms");
  EXPECT_EQ(format_time(SimTime(273'730'208)), "274 ms");
  EXPECT_EQ(format_time(SimTime(2'024'497'225)), "2.02 s");
  EXPECT_EQ(format_time(SimTime(999'499'999)), "999 ms");
  EXPECT_EQ(format_time(SimTime(999'500'000)), "1.00 s");  // rounding carries
  EXPECT_EQ(format_time(SimTime(999'999)), "1.00 ms");
  EXPECT_EQ(format_time(SimTime(12'345'678'901'234)), "12346 s");
}

TEST(Result, HoldsAValueOrAnError) {
  Result<int> good = 5;
  Result<int> bad = Error{"no"};
  EXPECT_TRUE(good.ok());
  EXPECT_EQ(good.value(), 5);
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().message, "no");
  EXPECT_THROW((void)bad.value(), InvariantError);
  EXPECT_THROW((void)good.error(), InvariantError);
}

TEST(Check, NamesTheConditionAndTheMessage) {
  try {
    FERRY_CHECK(1 + 1 == 3, "arithmetic is {}", "broken");
    FAIL();
  } catch (const InvariantError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("1 + 1 == 3"), std::string::npos);
    EXPECT_NE(what.find("arithmetic is broken"), std::string::npos);
    EXPECT_NE(what.find("core_test.cpp"), std::string::npos);
  }
}

}  // namespace
}  // namespace ferry
