#pragma once
// Running a property that a planted fault must break.

#include <rapidcheck.h>
#include <rapidcheck/detail/TestListener.h>

#include <cstdint>
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

}  // namespace ferry::testing
