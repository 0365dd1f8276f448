// Bad models refused with the place and the fix in the message, as documents and as models
// built in code, and the unusual models the rules of docs/model-format.md allow.

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "model_test_support.hpp"

namespace ferry::sim {
namespace {

using model_test::BadCase;
using model_test::kValidModel;
using model_test::small_valid_model;
using model_test::valid_with;

std::vector<BadCase> bad_cases() {
  const std::string more_tensors =
      R"({"name": "y", "bytes": 4, "dtype": "f32", "role": "activation"})";
  return {
      {"kind not an operator", valid_with(R"("name": "fc",)", R"("name": "fc", "kind": "mm",)"),
       R"(toy.json: ops[0].kind: expected an operator as namespace.name.overload ("aten.mm.default"), )"
       R"(got "mm")"},
      {"kind with a space", valid_with(R"("name": "fc",)", R"("name": "fc", "kind": "aten.mm x",)"),
       R"(toy.json: ops[0].kind: expected an operator as namespace.name.overload ("aten.mm.default"), )"
       R"(got "aten.mm x")"},
      {"empty kind", valid_with(R"("name": "fc",)", R"("name": "fc", "kind": "",)"),
       R"(toy.json: ops[0].kind: expected a non-empty name, got an empty string)"},
      {"unknown tensor in saved", valid_with(R"("saved": ["x", "w"])", R"("saved": ["x", "z"])"),
       R"(toy.json: ops[0].saved[1]: unknown tensor "z")"},
      {"unknown tensor in inputs", valid_with(R"("inputs": ["h_lo"])", R"("inputs": ["hi"])"),
       R"(toy.json: ops[1].inputs[0]: unknown tensor "hi")"},
      {"unknown loss", valid_with(R"("loss": "y")", R"("loss": "l")"),
       R"(toy.json: loss: unknown tensor "l")"},
      {"unknown base", valid_with(R"("view_of": "h")", R"("view_of": "hh")"),
       R"(toy.json: tensors[3].view_of: unknown tensor "hh")"},
      {"view out of its base", valid_with(R"("view_offset": 0)", R"("view_offset": 48)"),
       R"(toy.json: tensors[3].view_offset: 32 bytes at offset 48 lie outside its base "h" )"
       "(64 bytes)"},
      {"view of a view", valid_with(more_tensors, more_tensors + R"(,
    {"name": "h_lo2", "bytes": 2, "dtype": "bf16", "role": "activation", "view_of": "h_lo"})"),
       R"(toy.json: tensors[5].view_of: base "h_lo" is itself a view (of "h"); take the view of )"
       R"("h" instead)"},
      {"view with another role",
       valid_with(R"("name": "h_lo", "bytes": 32, "dtype": "bf16", "role": "activation")",
                  R"("name": "h_lo", "bytes": 32, "dtype": "bf16", "role": "param")"),
       R"(toy.json: tensors[3].view_of: a view has its base's role: "h_lo" is param, base "h" )"
       "is activation"},
      {"offset without a base",
       valid_with(R"("dtype": "bf16", "role": "input"})",
                  R"("dtype": "bf16", "role": "input", "view_offset": 0})"),
       R"(toy.json: tensors[0].view_offset: "view_offset" applies to views only: add "view_of")"},
      {"activation read before produced",
       valid_with(R"("inputs": ["x", "w"])", R"("inputs": ["x", "w", "y"])"),
       R"(toy.json: ops[0].inputs[2]: activation "y" is read before it is produced)"},
      {"an op reading its own output",
       valid_with(R"("inputs": ["h_lo"])", R"("inputs": ["h_lo", "y"])"),
       R"(toy.json: ops[1].inputs[1]: activation "y" is read before it is produced)"},
      {"produced twice", valid_with(R"("outputs": ["y"])", R"("outputs": ["y", "h"])"),
       R"(toy.json: ops[1].outputs[1]: activation "h" is produced twice (first by ops[0] "fc"))"},
      {"view before its base", valid_with(R"("outputs": ["h", "h_lo"])", R"("outputs": ["h_lo"])"),
       R"(toy.json: ops[0].outputs[0]: view "h_lo" is produced before its base "h")"},
      {"view never produced", valid_with(R"("outputs": ["h", "h_lo"])", R"("outputs": ["h"])"),
       R"(toy.json: ops[1].inputs[0]: activation "h_lo" is read before it is produced)"},
      {"unused activation never produced", valid_with(more_tensors, more_tensors + R"(,
    {"name": "z", "bytes": 2, "dtype": "bf16", "role": "activation"})"),
       R"(toy.json: tensors[5]: activation "z" is never produced by an op)"},
      {"op producing a param", valid_with(R"("outputs": ["y"])", R"("outputs": ["y", "w"])"),
       R"(toy.json: ops[1].outputs[1]: "w" is a param; ops produce activations only)"},
      {"op producing the batch", valid_with(R"("outputs": ["y"])", R"("outputs": ["y", "x"])"),
       R"(toy.json: ops[1].outputs[1]: "x" is an input; ops produce activations only)"},
      {"op producing an optimizer's state",
       model_test::replaced(valid_with(more_tensors, more_tensors + R"(,
    {"name": "w.exp_avg", "bytes": 128, "dtype": "bf16", "role": "optimizer_state"})"),
                            R"("outputs": ["y"])", R"("outputs": ["y", "w.exp_avg"])"),
       R"(toy.json: ops[1].outputs[1]: "w.exp_avg" is an optimizer_state; ops produce )"
       "activations only"},
      {"saved twice", valid_with(R"("saved": ["x", "w"])", R"("saved": ["x", "w", "x"])"),
       R"(toy.json: ops[0].saved[2]: "x" is already saved by this op (saved[0]))"},
      {"saved before produced", valid_with(R"("saved": ["x", "w"])", R"("saved": ["x", "w", "y"])"),
       R"(toy.json: ops[0].saved[2]: "y" is neither an input nor an output of this op; an op )"
       "saves only tensors it reads or produces"},
      {"saved activation the op does not touch",
       valid_with(R"("inputs": ["h_lo"], "outputs": ["y"], "saved": [])",
                  R"("inputs": ["h_lo"], "outputs": ["y"], "saved": ["h"])"),
       R"(toy.json: ops[1].saved[0]: "h" is neither an input nor an output of this op; an op )"
       "saves only tensors it reads or produces"},
      {"saved param the op does not read",
       valid_with(R"("inputs": ["h_lo"], "outputs": ["y"], "saved": [])",
                  R"("inputs": ["h_lo"], "outputs": ["y"], "saved": ["w"])"),
       R"(toy.json: ops[1].saved[0]: "w" is neither an input nor an output of this op; an op )"
       "saves only tensors it reads or produces"},
      {"loss not produced by the last op", valid_with(R"("loss": "y")", R"("loss": "h")"),
       R"(toy.json: loss: "h" is produced by ops[0] "fc", not by the last op (ops[1] "sum"))"},
      {"loss is a param", valid_with(R"("loss": "y")", R"("loss": "w")"),
       R"(toy.json: loss: "w" is a param; the loss is an activation)"},
      {"negative flops", valid_with(R"("flops": 100)", R"("flops": -5)"),
       "toy.json: ops[0].flops: expected a non-negative integer, got -5"},
      {"float flops", valid_with(R"("flops": 100)", R"("flops": 1e2)"),
       "toy.json: ops[0].flops: expected a non-negative integer, got 100.0 (write integers "
       "without a fraction or exponent)"},
      {"huge flops", valid_with(R"("flops": 100)", R"("flops": 1000000000000000001)"),
       "toy.json: ops[0].flops: 1000000000000000001 is above the limit of "
       "1000000000000000000"},
      {"negative duration",
       valid_with(R"("backward_bytes": 72)", R"("backward_bytes": 72, "duration_ns": -1)"),
       "toy.json: ops[1].duration_ns: expected a non-negative integer, got -1"},
      {"layer below -1", valid_with(R"("layer": 0)", R"("layer": -2)"),
       "toy.json: ops[0].layer: expected an integer in [-1, 2147483647], got -2"},
      {"bad dtype",
       valid_with(R"("bytes": 64, "dtype": "bf16", "role": "input")",
                  R"("bytes": 64, "dtype": "fp8", "role": "input")"),
       R"(toy.json: tensors[0].dtype: unknown dtype "fp8" (allowed: f32, bf16, f16, u8, i64))"},
      {"bad role", valid_with(R"("role": "param")", R"("role": "weight")"),
       R"(toy.json: tensors[1].role: unknown role "weight" (allowed: input, param, buffer, )"
       "activation, optimizer_state)"},
      {"bytes not whole elements",
       valid_with(R"("bytes": 4, "dtype": "f32")", R"("bytes": 6, "dtype": "f32")"),
       "toy.json: tensors[4].bytes: 6 bytes is not a whole number of f32 elements (4 bytes "
       "each)"},
      {"zero bytes", valid_with(R"("bytes": 128)", R"("bytes": 0)"),
       "toy.json: tensors[1].bytes: expected a positive integer, got 0"},
      {"unknown key in a tensor", valid_with(R"("bytes": 128)", R"("size": 128)"),
       R"(toy.json: tensors[1]: unknown key "size" (allowed: name, bytes, dtype, role, view_of, )"
       "view_offset, no_offload, capacity, rows, held)"},
      {"unknown key in an op", valid_with(R"("saved": [])", R"("saves": [])"),
       R"(toy.json: ops[1]: unknown key "saves" (allowed: name, kind, layer, flops, bytes, )"
       "backward_flops, backward_bytes, duration_ns, backward_duration_ns, inputs, outputs, "
       "saved, no_offload, draws_rng, draws_cpu_rng, gemm, collective, group_rows)"},
      {"group rows on an op that is not a grouped matmul",
       valid_with(R"("saved": ["x", "w"]})", R"("saved": ["x", "w"], "group_rows": [1, 2]})"),
       "toy.json: ops[0].group_rows: applies to a grouped matmul (aten._grouped_mm, "
       "aten._scaled_grouped_mm) only; the op's kind is not known"},
      {"more group rows than the product's",
       valid_with(R"("saved": ["x", "w"]})",
                  R"("saved": ["x", "w"], "kind": "aten._grouped_mm.default", )"
                  R"("gemm": {"m": 2, "n": 5, "k": 5}, "group_rows": [2, 1]})"),
       "toy.json: ops[0].group_rows: the groups hold 3 rows, more than the product's m of 2"},
      {"negative group rows",
       valid_with(R"("saved": ["x", "w"]})",
                  R"("saved": ["x", "w"], "kind": "aten._grouped_mm.default", )"
                  R"("group_rows": [2, -1]})"),
       "toy.json: ops[0].group_rows[1]: expected a non-negative integer, got -1"},
      {"gemm disagrees with the FLOPs",
       valid_with(R"("saved": ["x", "w"]})",
                  R"("saved": ["x", "w"], "gemm": {"m": 2, "n": 5, "k": 6}})"),
       "toy.json: ops[0].gemm: 2 x 5 x 6 (batch 1) is 2 m n k batch = 120 FLOPs, but flops is "
       "100 (they must agree within 0.1 %)"},
      {"gemm dim zero",
       valid_with(R"("saved": ["x", "w"]})",
                  R"("saved": ["x", "w"], "gemm": {"m": 0, "n": 5, "k": 5}})"),
       "toy.json: ops[0].gemm.m: expected a positive integer, got 0"},
      {"gemm unknown key",
       valid_with(R"("saved": ["x", "w"]})",
                  R"("saved": ["x", "w"], "gemm": {"m": 2, "n": 5, "k": 5, "l": 1}})"),
       R"(toy.json: ops[0].gemm: unknown key "l" (allowed: m, n, k, batch))"},
      {"unknown top-level key", valid_with(R"("loss": "y")", R"("loss": "y", "step": 1)"),
       R"(toy.json: unknown key "step" (allowed: format, name, tensors, ops, loss, parallelism, )"
       "allocator, routing, optimizer_step, "
       "matmul_fp32_precision, conv_fp32_precision)"},
      {"optimizer step of negative bytes",
       valid_with(R"("loss": "y")",
                  R"("loss": "y", "optimizer_step": {"bytes": -1, "temporaries": []})"),
       "toy.json: optimizer_step.bytes: expected a non-negative integer, got -1"},
      {"optimizer step without its temporaries",
       valid_with(R"("loss": "y")", R"("loss": "y", "optimizer_step": {"bytes": 8})"),
       R"(toy.json: optimizer_step: missing required key "temporaries")"},
      {"optimizer step with an empty temporary",
       valid_with(R"("loss": "y")",
                  R"("loss": "y", "optimizer_step": {"bytes": 8, "temporaries": [4, 0]})"),
       "toy.json: optimizer_step.temporaries[1]: expected a positive integer, got 0"},
      {"optimizer step whose temporaries overflow",
       valid_with(R"("loss": "y")", R"("loss": "y", "optimizer_step": {"bytes": 8, "temporaries": )"
                                    R"([1125899906842624, 1]})"),
       "toy.json: optimizer_step.temporaries[1]: the temporaries exceed 1125899906842624 bytes "
       "together"},
      {"optimizer step with an unknown member",
       valid_with(R"("loss": "y")",
                  R"("loss": "y", "optimizer_step": {"bytes": 8, "temporaries": [], )"
                  R"("flops": 1})"),
       R"(toy.json: optimizer_step: unknown key "flops" (allowed: bytes, temporaries))"},
      {"unknown allocator", valid_with(R"("loss": "y")", R"("loss": "y", "allocator": "cuda")"),
       R"(toy.json: allocator: expected "default" or "expandable", got "cuda")"},
      {"missing loss",
       valid_with(R"(,
  "loss": "y")",
                  ""),
       R"(toy.json: missing required key "loss")"},
      {"wrong format", valid_with(R"("ferry.model/1")", R"("ferry.program/1")"),
       R"(toy.json: format: expected "ferry.model/1", got "ferry.program/1")"},
      {"duplicate tensor name", valid_with(R"({"name": "h_lo")", R"({"name": "h")"),
       R"(toy.json: tensors[3].name: duplicate tensor name "h" (first declared at )"
       "tensors[2].name)"},
      {"duplicate op name", valid_with(R"("name": "sum")", R"("name": "fc")"),
       R"(toy.json: ops[1].name: duplicate op name "fc" (first at ops[0]))"},
      {"empty op name", valid_with(R"("name": "sum")", R"("name": "")"),
       "toy.json: ops[1].name: expected a non-empty name, got an empty string"},
      {"flag not a boolean", valid_with(R"("saved": [])", R"("saved": [], "draws_rng": 1)"),
       "toy.json: ops[1].draws_rng: expected true or false, got 1"},
      {"syntax error", valid_with(R"("loss": "y")", R"("loss": "y",)"),
       "toy.json:19:1: syntax "
       "error while parsing object key - unexpected '}'; expected string literal"},
  };
}

TEST(ModelJson, RejectsBadModelsWithThePathInTheMessage) {
  const auto cases = bad_cases();
  EXPECT_GE(cases.size(), 15U);
  const auto valid = parse_model(kValidModel, "toy.json");
  ASSERT_TRUE(valid.ok()) << valid.error().message;
  for (const BadCase& bad : cases) {
    SCOPED_TRACE(bad.name);
    Result<Model> result = Error{"not run"};
    ASSERT_NO_THROW(result = parse_model(bad.text, "toy.json"));
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.error().message, bad.expected);
  }
}

TEST(CheckedModel, AParsedModelIsCheckedByItsReader) {
  std::string text(kValidModel);
  const auto at = text.find("\"loss\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 6, "\"lost\"");
  const auto parsed = parse_checked_model(text, "toy.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.error().message, parse_model(text, "toy.json").error().message);
}

// The models the rules of docs/model-format.md allow, one test each.

TEST(ModelRules, LayersNeedNotStartAtZeroBeContiguousOrInOrder) {
  Model model = small_valid_model();
  model.ops[0].layer = 7;
  model.ops[1].layer = 3;
  EXPECT_TRUE(validate_model(model).ok());
  EXPECT_EQ(saved_activation_bytes(model, 7), Bytes(0));  // fc saves the batch and a param
}

TEST(ModelRules, AViewMayBeProducedByALaterOpThanItsBase) {
  Model model = small_valid_model();
  model.ops[0].outputs = {2};  // fc: h
  ModelOp slice;
  slice.name = "slice";
  slice.inputs = {2};
  slice.outputs = {3};  // h_lo, a view of h
  model.ops.insert(model.ops.begin() + 1, slice);
  const Status status = validate_model(model);
  EXPECT_TRUE(status.ok()) << status.error().message;
}

TEST(ModelRules, AnOpSavesItsInputsAndOutputsOfAnyRole) {
  Model model = small_valid_model();
  model.ops[0].saved = {0, 1, 2, 3};  // the batch, a param, its output and a view of it
  model.ops[1].saved = {3, 4};        // its input and its output (the loss)
  const Status status = validate_model(model);
  EXPECT_TRUE(status.ok()) << status.error().message;
}

TEST(ModelRules, TwoOpsMaySaveTheSameTensorAndItCountsOnce) {
  Model model = small_valid_model();
  model.ops[0].saved = {3};
  model.ops[1].saved = {3};
  model.ops[1].layer = 0;
  ASSERT_TRUE(validate_model(model).ok());
  EXPECT_EQ(saved_activation_bytes(model, 0), Bytes(32));
}

TEST(ValidateModel, RejectsIndicesOutOfRange) {
  Model model = small_valid_model();
  model.ops[1].inputs.push_back(9);
  EXPECT_EQ(validate_model(model).error().message,
            "ops[1].inputs[1]: tensor index 9 out of range (5 tensors)");

  model = small_valid_model();
  model.tensors[3].view_of = 7;
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[3].view_of: base index 7 out of range (5 tensors)");

  model = small_valid_model();
  model.tensors[3].view_of = 3;
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[3].view_of: a tensor cannot be a view of itself");

  model = small_valid_model();
  model.loss = 5;
  EXPECT_EQ(validate_model(model).error().message, "loss: tensor index 5 out of range (5 tensors)");
}

TEST(ValidateModel, NamesTheFirstRepeatedNameInOrder) {
  // tensors: x w h h_lo y. "w" again at 4 and "x" at 2 and 3: the first repeat, by index, is 2.
  Model model = small_valid_model();
  model.tensors[4].name = "w";
  model.tensors[2].name = "x";
  model.tensors[3].name = "x";
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[2].name: duplicate tensor name \"x\" (first at tensors[0])");

  // An empty name before the repeat is reported first; one after it, not.
  model.tensors[1].name.clear();
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[1].name: a tensor needs a non-empty name");
  model.tensors[1].name = "w";
  model.tensors[4].name.clear();
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[2].name: duplicate tensor name \"x\" (first at tensors[0])");

  model = small_valid_model();
  model.ops[1].name = "fc";
  EXPECT_EQ(validate_model(model).error().message,
            "ops[1].name: duplicate op name \"fc\" (first at ops[0])");
}

TEST(ValidateModel, RejectsNegativeCountsAndEmptyModels) {
  Model model = small_valid_model();
  model.ops[0].backward_flops = -1;
  EXPECT_EQ(validate_model(model).error().message,
            "ops[0].backward_flops: expected a non-negative count, got -1");

  model = small_valid_model();
  model.ops[1].backward_duration = SimTime(-3);
  EXPECT_EQ(validate_model(model).error().message,
            "ops[1].backward_duration_ns: expected a non-negative count, got -3");

  model = small_valid_model();
  model.tensors[0].view_offset = Bytes(2);
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[0].view_offset: only a view has an offset; \"x\" has its own storage");

  model = small_valid_model();
  model.ops[0].flops = kMaxModelFlops + 1;
  EXPECT_EQ(validate_model(model).error().message,
            "ops[0].flops: 1000000000000000001 is above the limit of 1000000000000000000");

  model = small_valid_model();
  model.tensors[1].bytes = Bytes((std::int64_t{1} << 50) + 2);
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[1].bytes: 1125899906842626 is above the limit of 1125899906842624");

  model = small_valid_model();
  model.ops.clear();
  EXPECT_EQ(validate_model(model).error().message, "ops: a model needs at least one op");

  model = small_valid_model();
  model.name.clear();
  EXPECT_EQ(validate_model(model).error().message, "name: a model needs a non-empty name");
}

}  // namespace
}  // namespace ferry::sim
