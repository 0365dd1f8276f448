// PlannerCache: planners are kept per model, not per model document text.

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "ferry/sim/api/requests.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {
namespace {

// A plan request for the document `text`, named "traced" whatever model it holds, as Python
// gives a traced model.
PlanRequest traced_request(const std::string& text, PlannerCache* planners) {
  PlanRequest r;
  r.target.model = ModelSource{"traced", text};
  r.target.device = "h100-sxm-pcie5";
  r.target.scenarios = FERRY_SCENARIOS_DIR;
  r.budget = Bytes(std::int64_t{1} << 30);
  r.margin_permille = 0;
  r.planners = planners;
  return r;
}

TEST(PlannerCache, TwoModelsOfOneNameEachGetAPlannerOfTheirOwn) {
  const std::string gpt = model_to_json(model_preset("tiny-gpt").value());
  const std::string llama = model_to_json(model_preset("tiny-llama").value());
  ASSERT_NE(gpt, llama);
  PlannerCache planners;
  const auto first = respond(traced_request(gpt, &planners));
  ASSERT_TRUE(first.ok()) << first.error().message;
  const auto other = respond(traced_request(llama, &planners));
  ASSERT_TRUE(other.ok()) << other.error().message;
  EXPECT_EQ(planners.size(), 2U);
  // Each plan is its own model's: the one a fresh planner makes for it.
  const auto fresh = respond(traced_request(llama, nullptr));
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(other.value().document.at("plan").dump(), fresh.value().document.at("plan").dump());
  EXPECT_NE(other.value().document.at("plan").dump(), first.value().document.at("plan").dump());
}

TEST(PlannerCache, ADocumentThatReadsToTheSameModelPlansWithItsKeptPlanner) {
  const std::string gpt = model_to_json(model_preset("tiny-gpt").value());
  PlannerCache planners;
  ASSERT_TRUE(respond(traced_request(gpt, &planners)).ok());
  const std::int64_t ran = planners.simulations();
  // The same document written another way (a trailing newline): the same model.
  const auto again = respond(traced_request(gpt + "\n", &planners));
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(planners.size(), 1U);
  EXPECT_EQ(planners.simulations(), ran);
  EXPECT_EQ(again.value().document.at("simulations"), 0);
}

}  // namespace
}  // namespace ferry::sim
