#pragma once
// Running a property that a planted fault must break.

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/detail/TestListener.h>

#include <cstdint>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>

namespace ferry::testing {

/// Listens to nothing: a planted fault's expected failure must not be reported as a failure.
class QuietListener final : public rc::detail::TestListener {
 public:
  void onTestCaseFinished(const rc::detail::CaseDescription&) override {}
  void onShrinkTried(const rc::detail::CaseDescription&, bool) override {}
  void onTestFinished(const rc::detail::TestMetadata&, const rc::detail::TestResult&) override {}
};

/// Checks `property` with a fixed seed and up to `tests` cases. Returns the shrunk
/// counterexample as RapidCheck prints it, or "" when the property held every time (the
/// planted fault went unnoticed).
template <class Property>
std::string counterexample(Property&& property, std::uint64_t seed = 20261121, int tests = 3000) {
  rc::detail::TestParams params;
  params.seed = seed;
  params.maxSuccess = tests;
  rc::detail::TestMetadata metadata;
  metadata.id = "planted-fault";
  metadata.description = "property under a planted fault";
  QuietListener listener;
  const rc::detail::TestResult result =
      rc::detail::checkTestable(std::forward<Property>(property), metadata, params, listener);
  rc::detail::FailureResult failure;
  if (!result.match(failure)) return {};
  std::ostringstream out;
  rc::detail::printResultMessage(result, out);
  return out.str();
}

/// Expects `property` to fail under the planted fault `name` and prints the shrunk
/// counterexample.
template <class Property>
void expect_planted_fault_caught(Property&& property, const char* name, std::uint64_t seed,
                                 int tests) {
  const std::string found = counterexample(std::forward<Property>(property), seed, tests);
  ASSERT_FALSE(found.empty()) << "planted fault \"" << name << "\" went unnoticed";
  std::cout << "planted fault \"" << name << "\", shrunk counterexample:\n" << found << "\n";
}

}  // namespace ferry::testing
