// The model format (docs/model-format.md): presets, scenario models and the documented examples
// read back and written to the same bytes, and each optional section read, written back and
// named where it is wrong.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "model_test_support.hpp"

namespace ferry::sim {
namespace {

using model_test::index_of;
using model_test::kScenarioDir;
using model_test::kValidModel;
using model_test::read_file;
using model_test::round_device;
using model_test::valid_with;

void expect_round_trip(const Model& model) {
  const std::string written = model_to_json(model);
  const auto again = parse_model(written, "written.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_TRUE(again.value() == model);
  EXPECT_EQ(model_to_json(again.value()), written);
}

TEST(ModelJson, PresetsRoundTrip) {
  for (const std::string_view name :
       {"tiny-gpt", "tiny-llama", "gpt2-small-s1024", "llama3.2-3b-traced-s4096-b2"}) {
    SCOPED_TRACE(name);
    auto model = model_preset(name);
    ASSERT_TRUE(model.ok());
    expect_round_trip(model.value());
    assign_roofline_durations(model.value(),
                              round_device(1'000'000'000'000'000, 1'000'000'000'000));
    expect_round_trip(model.value());
  }
}

TEST(ModelJson, WritesKeysInAFixedOrder) {
  auto model = model_preset("tiny-gpt");
  ASSERT_TRUE(model.ok());
  const std::string written = model_to_json(model.value());
  EXPECT_EQ(written.rfind("{\n  \"format\": \"ferry.model/1\",\n  \"name\": \"tiny-gpt\",\n"
                          "  \"tensors\": [\n    {\n      \"name\": \"tokens\",\n"
                          "      \"bytes\": 2048,\n      \"dtype\": \"i64\",\n"
                          "      \"role\": \"input\"\n    },",
                          0),
            0U)
      << written.substr(0, 300);
  EXPECT_NE(written.find("\"view_of\": \"layers.0.qkv.out\",\n      \"view_offset\": 32768"),
            std::string::npos);
  EXPECT_EQ(written.substr(written.size() - 19), "  \"loss\": \"loss\"\n}\n");
}

TEST(ModelJson, ScenarioModelsParseAndRoundTrip) {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(kScenarioDir / "models")) {
    if (entry.path().extension() == ".json") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 2U);
  for (const auto& file : files) {
    SCOPED_TRACE(file.string());
    const auto model = parse_model(read_file(file), file.string());
    ASSERT_TRUE(model.ok()) << model.error().message;
    expect_round_trip(model.value());
  }
}

TEST(ModelJson, TheMlpScenarioHasViewsParamsAndAnOffloadOptOut) {
  const auto path = kScenarioDir / "models" / "mlp.json";
  const auto result = parse_model(read_file(path), path.string());
  ASSERT_TRUE(result.ok()) << result.error().message;
  const Model& model = result.value();
  ASSERT_EQ(model.ops.size(), 4U);
  const auto up = index_of(model.tensors, "up");
  EXPECT_EQ(model.tensors[up].view_of,
            static_cast<std::int32_t>(index_of(model.tensors, "fc1.out")));
  EXPECT_EQ(model.tensors[up].view_offset, Bytes(2048));
  EXPECT_EQ(model.tensors[index_of(model.tensors, "fc1.weight")].role, TensorRole::Param);
  EXPECT_TRUE(model.ops.back().no_offload);
  EXPECT_EQ(model.tensors[model.loss].name, "loss");
}

TEST(ModelJson, AnUnusedBranchIsAllowed) {
  const auto path = kScenarioDir / "models" / "unused_branch.json";
  const auto result = parse_model(read_file(path), path.string());
  ASSERT_TRUE(result.ok()) << result.error().message;
  const Model& model = result.value();
  const auto probe = static_cast<std::uint32_t>(index_of(model.tensors, "probe.out"));
  for (const ModelOp& op : model.ops) {
    EXPECT_EQ(std::count(op.inputs.begin(), op.inputs.end(), probe), 0) << op.name;
  }
  EXPECT_TRUE(model.tensors[index_of(model.tensors, "norm.out")].no_offload);
  EXPECT_EQ(model.tensors[index_of(model.tensors, "norm.running_mean")].role, TensorRole::Buffer);
  EXPECT_TRUE(model.ops[index_of(model.ops, "dropout")].draws_rng);
  EXPECT_EQ(saved_activation_bytes(model, 0), Bytes(16384 + 8192));  // fc.out and the mask
}

TEST(ModelJson, TheDocumentedExamplesParse) {
  const std::string text = read_file(FERRY_TESTS_DIR "/../docs/model-format.md");
  const std::string fence = "```json\n";
  std::size_t examples = 0;
  for (auto at = text.find(fence); at != std::string::npos; at = text.find(fence, at)) {
    at += fence.size();
    const auto end = text.find("```", at);
    ASSERT_NE(end, std::string::npos);
    const auto model = parse_model(text.substr(at, end - at), "model-format.md");
    EXPECT_TRUE(model.ok()) << model.error().message;
    ++examples;
  }
  EXPECT_GE(examples, 1U);
}

TEST(ModelJson, AnOpsKindIsReadAndWrittenBack) {
  const std::string text =
      valid_with(R"("name": "fc",)", R"("name": "fc", "kind": "aten.mm.default",)");
  auto model = parse_model(text, "toy.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  EXPECT_EQ(model.value().ops[0].kind, "aten.mm.default");
  EXPECT_EQ(model.value().ops[1].kind, "");
  const std::string written = model_to_json(model.value());
  EXPECT_NE(written.find(R"("name": "fc",
      "kind": "aten.mm.default",
      "layer": 0,)"),
            std::string::npos)
      << written;
  auto again = parse_model(written, "again.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value(), model.value());
  // Other namespaces and higher-order operators are operators too.
  for (const char* kind : {"_c10d_functional.reduce_scatter_tensor.default",
                           "higher_order.flex_attention", "ferry.rotary.default"}) {
    Model other = model.value();
    other.ops[0].kind = kind;
    EXPECT_TRUE(validate_model(other).ok()) << kind;
  }
}

TEST(ModelJson, TheParallelismSectionIsReadAndWrittenBack) {
  const std::string text = valid_with(
      R"("loss": "y")",
      R"("loss": "y", "parallelism": {"fsdp": 16, "nodes": 2, "hsdp": 2, "reshard_after_forward": 4})");
  auto model = parse_model(text, "toy.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  EXPECT_EQ(model.value().parallelism,
            (Parallelism{
                .ranks = 16, .nodes = 2, .replicas = 2, .reshard_after_forward = Reshard::K(4)}));
  auto again = parse_model(model_to_json(model.value()), "again.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value(), model.value());
  auto kept = parse_model(
      valid_with(R"("loss": "y")",
                 R"("loss": "y", "parallelism": {"fsdp": 8, "reshard_after_forward": false})"),
      "toy.json");
  ASSERT_TRUE(kept.ok()) << kept.error().message;
  EXPECT_EQ(kept.value().parallelism.reshard_after_forward, Reshard::False());
  EXPECT_EQ(kept.value().parallelism.nodes, 0);
  // Tensor parallelism, with FSDP or alone (no "fsdp" then).
  // Context and expert parallelism, with FSDP.
  for (const auto& [section, expected] : std::vector<std::pair<std::string, Parallelism>>{
           {R"({"fsdp": 2, "cp": 4})", Parallelism{.ranks = 2, .cp = 4}},
           {R"({"fsdp": 8, "ep": 4})", Parallelism{.ranks = 8, .ep = 4}},
       }) {
    SCOPED_TRACE(section);
    auto mesh = parse_model(
        valid_with(R"("loss": "y")", R"("loss": "y", "parallelism": )" + section), "toy.json");
    ASSERT_TRUE(mesh.ok()) << mesh.error().message;
    EXPECT_EQ(mesh.value().parallelism, expected);
    auto back = parse_model(model_to_json(mesh.value()), "again.json");
    ASSERT_TRUE(back.ok()) << back.error().message;
    EXPECT_EQ(back.value(), mesh.value());
  }
  for (const std::string section : {R"({"fsdp": 4, "tp": 2})", R"({"tp": 2})"}) {
    SCOPED_TRACE(section);
    auto sharded = parse_model(
        valid_with(R"("loss": "y")", R"("loss": "y", "parallelism": )" + section), "toy.json");
    ASSERT_TRUE(sharded.ok()) << sharded.error().message;
    EXPECT_EQ(sharded.value().parallelism.tp, 2);
    EXPECT_EQ(sharded.value().parallelism.ranks, section.find("fsdp") == std::string::npos ? 0 : 4);
    const std::string written = model_to_json(sharded.value());
    EXPECT_NE(written.find(R"("tp": 2)"), std::string::npos) << written;
    auto back = parse_model(written, "again.json");
    ASSERT_TRUE(back.ok()) << back.error().message;
    EXPECT_EQ(back.value(), sharded.value());
  }
  // Without the section: one GPU, and none is written.
  auto plain = parse_model(std::string(kValidModel), "toy.json");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain.value().parallelism.on());
  EXPECT_EQ(model_to_json(plain.value()).find("parallelism"), std::string::npos);
}

// The file's "allocator" member is read once, as the mode it names, and written back; a model
// without one has none (the commands' default then).
TEST(ModelJson, TheAllocatorMemberIsReadAsItsModeAndWrittenBack) {
  for (const auto& [name, mode] : {std::pair{"default", AllocatorMode::Default},
                                   std::pair{"expandable", AllocatorMode::Expandable}}) {
    SCOPED_TRACE(name);
    auto model = parse_model(
        valid_with(R"("loss": "y")", fmt::format(R"("loss": "y", "allocator": "{}")", name)),
        "toy.json");
    ASSERT_TRUE(model.ok()) << model.error().message;
    EXPECT_EQ(model.value().allocator, mode);
    const std::string written = model_to_json(model.value());
    EXPECT_NE(written.find(fmt::format(R"("allocator": "{}")", name)), std::string::npos);
    auto back = parse_model(written, "again.json");
    ASSERT_TRUE(back.ok()) << back.error().message;
    EXPECT_EQ(back.value(), model.value());
  }
  auto plain = parse_model(std::string(kValidModel), "toy.json");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain.value().allocator, std::nullopt);
  EXPECT_EQ(model_to_json(plain.value()).find("allocator"), std::string::npos);
}

// The valid model with the top-level member `member` set to `value` (JSON text), parsed.
Result<Model> with_member(std::string_view member, std::string_view value) {
  return parse_model(
      valid_with(R"("loss": "y")", fmt::format(R"("loss": "y", "{}": {})", member, value)),
      "toy.json");
}

// Each of `values` for `member` is refused, the error naming the member.
void expect_refused(std::string_view member, std::initializer_list<std::string_view> values) {
  for (const std::string_view value : values) {
    auto refused = with_member(member, value);
    ASSERT_FALSE(refused.ok()) << value;
    EXPECT_NE(refused.error().message.find(member), std::string::npos) << refused.error().message;
  }
}

// The valid model with `member` set to `value`, parsed: the text written back names the member
// when `written`, and reads back as the model either way.
Model read_member(std::string_view member, std::string_view value, bool written) {
  auto model = with_member(member, value);
  EXPECT_TRUE(model.ok()) << model.error().message;
  if (!model.ok()) return Model{};
  const std::string text = model_to_json(model.value());
  EXPECT_EQ(text.find(fmt::format(R"("{}": {})", member, value)) != std::string::npos, written)
      << text;
  expect_round_trip(model.value());
  return model.value();
}

// The file's "matmul_fp32_precision" member (torch.backends.cuda.matmul.fp32_precision at trace
// time): "tf32" is read and written back, "ieee" is torch's default and written as no member,
// anything else is refused naming the member and what it accepts.
TEST(ModelJson, TheMatmulPrecisionIsReadAndWrittenBackAndABadOneRefused) {
  EXPECT_TRUE(read_member("matmul_fp32_precision", R"("tf32")", true).matmul_tf32);
  EXPECT_FALSE(read_member("matmul_fp32_precision", R"("ieee")", false).matmul_tf32);
  expect_refused("matmul_fp32_precision", {R"("high")", R"("TF32")", "true", "1"});
}

// The file's "conv_fp32_precision" member (torch.backends.cudnn.conv.fp32_precision at trace
// time): absent or "tf32" is torch's default and written as no member, "ieee" is read and
// written back, anything else is refused naming the member and what it accepts.
TEST(ModelJson, TheConvolutionPrecisionIsReadAndWrittenBackAndABadOneRefused) {
  auto plain = parse_model(std::string(kValidModel), "toy.json");
  ASSERT_TRUE(plain.ok()) << plain.error().message;
  EXPECT_TRUE(plain.value().conv_tf32);
  EXPECT_EQ(read_member("conv_fp32_precision", R"("tf32")", false), plain.value());
  EXPECT_FALSE(read_member("conv_fp32_precision", R"("ieee")", true).conv_tf32);
  expect_refused("conv_fp32_precision", {R"("none")", R"("highest")", "false", "0"});
}

// A trace's measured optimizer step (Note [The optimizer step] in model.cpp): read, written back
// and read again unchanged; a file without one has none.
TEST(ModelJson, TheOptimizerStepIsReadAndWrittenBack) {
  auto model = parse_model(
      valid_with(R"("loss": "y")",
                 R"("loss": "y", "optimizer_step": {"bytes": 320, "temporaries": [16, 8]})"),
      "toy.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  ASSERT_TRUE(model.value().optimizer_step);
  EXPECT_EQ(model.value().optimizer_step->bytes, Bytes(320));
  EXPECT_EQ(model.value().optimizer_step->temporaries, (std::vector<Bytes>{Bytes(16), Bytes(8)}));
  auto back = parse_model(model_to_json(model.value()), "again.json");
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_EQ(back.value(), model.value());
  auto plain = parse_model(std::string(kValidModel), "toy.json");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain.value().optimizer_step, std::nullopt);
  EXPECT_EQ(model_to_json(plain.value()).find("optimizer_step"), std::string::npos);
}

// Note [Optimizer state in earlier traces] in model_json.cpp.
TEST(ModelJson, AnEarlierTracesOptimizerStateIsReadByItsNameUntilTheRoleIsUsed) {
  const std::string param = R"({"name": "w", "bytes": 128, "dtype": "bf16", "role": "param"},)";
  const auto with = [&](std::string_view tensors) {
    return valid_with(param, param + "\n    " + std::string(tensors));
  };
  const auto role_of = [](const Model& m, std::string_view name) {
    for (const ModelTensor& t : m.tensors) {
      if (t.name == name) return t.role;
    }
    ADD_FAILURE() << "no tensor " << name;
    return TensorRole::Input;
  };
  // A trace from before the role: its state, named by the trace, is optimizer state.
  auto earlier = parse_model(
      with(R"({"name": "optimizer.w.exp_avg", "bytes": 128, "dtype": "bf16", "role": "buffer"},
    {"name": "rope.cos", "bytes": 64, "dtype": "bf16", "role": "buffer"},)"),
      "earlier.json");
  ASSERT_TRUE(earlier.ok()) << earlier.error().message;
  EXPECT_EQ(role_of(earlier.value(), "optimizer.w.exp_avg"), TensorRole::OptimizerState);
  EXPECT_EQ(role_of(earlier.value(), "rope.cos"), TensorRole::Buffer);
  // A file that uses the role is read by it alone: a buffer keeps its role, whatever its name.
  auto current = parse_model(
      with(R"({"name": "optimizer.w.exp_avg", "bytes": 128, "dtype": "bf16", "role": "buffer"},
    {"name": "w.moment", "bytes": 128, "dtype": "bf16", "role": "optimizer_state"},)"),
      "current.json");
  ASSERT_TRUE(current.ok()) << current.error().message;
  EXPECT_EQ(role_of(current.value(), "optimizer.w.exp_avg"), TensorRole::Buffer);
  EXPECT_EQ(role_of(current.value(), "w.moment"), TensorRole::OptimizerState);
}

TEST(ModelJson, ABadParallelismSectionIsNamed) {
  for (const auto& [section, where] : std::vector<std::pair<std::string, std::string>>{
           {R"({"fsdp": 0})", "parallelism.fsdp"},
           {R"({"nodes": 2})", "fsdp"},
           {R"({"fsdp": 8, "hsdp": 0})", "parallelism.hsdp"},
           {R"({"fsdp": 8, "reshard_after_forward": 1})", "parallelism.reshard_after_forward"},
           {R"({"fsdp": 8, "reshard_after_forward": "yes"})", "parallelism.reshard_after_forward"},
           {R"({"fsdp": 8, "tp": 0})", "parallelism.tp"},
           {R"({"tp": 2048})", "parallelism.tp"},
           {R"({"fsdp": 8, "cp": 0})", "parallelism.cp"},
           {R"({"cp": 2})", "fsdp"},
           {R"({"fsdp": 8, "ep": 0})", "parallelism.ep"},
           {R"({"fsdp": 8, "pp": 0})", "parallelism.pp"},
           {R"({"pp": 65})", "parallelism.pp"},
           {R"({"fsdp": 8, "dp": 2})", "dp"},
       }) {
    auto model = parse_model(
        valid_with(R"("loss": "y")", R"("loss": "y", "parallelism": )" + section), "toy.json");
    ASSERT_FALSE(model.ok()) << section;
    EXPECT_NE(model.error().message.find(where), std::string::npos)
        << section << ": " << model.error().message;
  }
}

// A static-capacity buffer (docs/model-format.md, Tensors): a base activation allocated for
// more than its bytes, with its rows of data; read, written back, and refused where it is not
// that, naming the member.
TEST(ModelJson, AStaticCapacityIsReadWrittenBackAndChecked) {
  const std::string h = R"({"name": "h", "bytes": 64, "dtype": "bf16", "role": "activation")";
  auto padded = parse_model(valid_with(h, h + R"(, "capacity": 256, "rows": 4)"), "toy.json");
  ASSERT_TRUE(padded.ok()) << padded.error().message;
  EXPECT_EQ(padded.value().tensors[2].capacity, Bytes(256));
  EXPECT_EQ(padded.value().tensors[2].rows, 4);
  EXPECT_EQ(allocated_bytes(padded.value().tensors[2]), Bytes(256));
  EXPECT_TRUE(has_static_capacity(padded.value()));
  auto back = parse_model(model_to_json(padded.value()), "again.json");
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_EQ(back.value(), padded.value());
  auto plain = parse_model(std::string(kValidModel), "toy.json");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(has_static_capacity(plain.value()));
  EXPECT_EQ(model_to_json(plain.value()).find("capacity"), std::string::npos);

  const std::string lo = R"("view_offset": 0})";
  for (const auto& [from, to, where] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {h, h + R"(, "capacity": 32, "rows": 4)", "tensors[2].capacity"},   // below its bytes
           {h, h + R"(, "capacity": 257, "rows": 4)", "tensors[2].capacity"},  // half an element
           {h, h + R"(, "capacity": 256)", "tensors[2].capacity"},             // the member given
           {h, h + R"(, "rows": 4)", "tensors[2].rows"},
           {h, h + R"(, "capacity": 256, "rows": 5)", "tensors[2].rows"},
           {lo, R"("view_offset": 0, "capacity": 64, "rows": 2})", "tensors[3].capacity"},
       }) {
    auto bad = parse_model(valid_with(from, to), "toy.json");
    ASSERT_FALSE(bad.ok()) << to;
    EXPECT_NE(bad.error().message.find(where), std::string::npos)
        << to << ": " << bad.error().message;
  }
}

// A held activation (docs/model-format.md, Tensors): read, written back, and refused on a
// view, a parameter and the loss, naming the member.
TEST(ModelJson, AHeldActivationIsReadWrittenBackAndChecked) {
  const std::string h = R"({"name": "h", "bytes": 64, "dtype": "bf16", "role": "activation")";
  auto held = parse_model(valid_with(h, h + R"(, "held": true)"), "toy.json");
  ASSERT_TRUE(held.ok()) << held.error().message;
  EXPECT_TRUE(held.value().tensors[2].held);
  expect_round_trip(held.value());
  auto plain = parse_model(std::string(kValidModel), "toy.json");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain.value().tensors[2].held);
  EXPECT_EQ(model_to_json(plain.value()).find("held"), std::string::npos);

  for (const auto& [from, to, where] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {R"("view_offset": 0})", R"("view_offset": 0, "held": true})", "tensors[3].held"},
           {R"("role": "param")", R"("role": "param", "held": true)", "tensors[1].held"},
           {R"("dtype": "f32", "role": "activation")",
            R"("dtype": "f32", "role": "activation", "held": true)", "tensors[4].held"},
       }) {
    auto bad = parse_model(valid_with(from, to), "toy.json");
    ASSERT_FALSE(bad.ok()) << to;
    EXPECT_NE(bad.error().message.find(where), std::string::npos)
        << to << ": " << bad.error().message;
  }
}

TEST(ModelJson, TheRoutingAssumptionIsReadAndWrittenBack) {
  for (const auto& [section, want] : std::vector<std::pair<std::string, RoutingAssumption>>{
           {R"({"assumption": "balanced"})", {.assumption = "balanced"}},
           {R"({"assumption": "loads", "loads": [4, 2, 0, 1.5]})",
            {.assumption = "loads", .loads = {4, 2, 0, 1.5}}},
           {R"({"assumption": "random", "seed": 7})", {.assumption = "random", .seed = 7}},
           {R"({"assumption": "random", "seed": 0, "capacity_factor": 1.25})",
            {.assumption = "random", .capacity_factor = 1.25}},
       }) {
    SCOPED_TRACE(section);
    auto model = parse_model(valid_with(R"("loss": "y")", R"("loss": "y", "routing": )" + section),
                             "toy.json");
    ASSERT_TRUE(model.ok()) << model.error().message;
    EXPECT_EQ(model.value().routing, want);
    const std::string text = model_to_json(model.value());
    auto again = parse_model(text, "again.json");
    ASSERT_TRUE(again.ok()) << again.error().message;
    EXPECT_EQ(again.value(), model.value());
    // Whole loads are written as integers, as the trace writes them.
    if (want.assumption == "loads") {
      EXPECT_NE(text.find("4,\n      2,\n      0,\n      1.5"), std::string::npos) << text;
    }
  }
  // Without the member: none assumed, and none is written.
  auto plain = parse_model(std::string(kValidModel), "toy.json");
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain.value().routing.assumption.empty());
  EXPECT_EQ(model_to_json(plain.value()).find("routing"), std::string::npos);
}

TEST(ModelJson, ABadRoutingAssumptionIsNamed) {
  for (const auto& [section, message] : std::vector<std::pair<std::string, std::string>>{
           {R"("balanced")", R"(toy.json: routing: expected an object, got a string "balanced")"},
           {R"({"assumption": "uniform"})",
            R"(toy.json: routing.assumption: expected "balanced", "loads" or "random", got )"
            R"("uniform")"},
           {R"({"loads": [1]})", R"(toy.json: routing: missing required key "assumption")"},
           {R"({"assumption": "loads"})", R"(toy.json: routing: missing required key "loads")"},
           {R"({"assumption": "loads", "loads": [0, 0]})",
            R"(toy.json: routing: "loads": expected at least one load above 0)"},
           {R"({"assumption": "loads", "loads": [1, -1]})",
            "toy.json: routing.loads[1]: expected a number >= 0"},
           {R"({"assumption": "loads", "loads": [1, "2"]})",
            "toy.json: routing.loads[1]: expected a number >= 0"},
           {R"({"assumption": "balanced", "seed": 1})",
            R"(toy.json: routing.seed: "seed" applies to the assumption "random" only)"},
           {R"({"assumption": "random", "seed": 1, "loads": [1]})",
            R"(toy.json: routing.loads: "loads" applies to the assumption "loads" only)"},
           {R"({"assumption": "random"})", R"(toy.json: routing: missing required key "seed")"},
           {R"({"assumption": "random", "seed": -1})",
            "toy.json: routing.seed: expected a non-negative integer, got -1"},
           {R"({"assumption": "random", "seed": 1, "capacity_factor": 0.5})",
            "toy.json: routing.capacity_factor: expected a number >= 1"},
           {R"({"assumption": "random", "seed": 1, "top_k": 2})",
            R"(toy.json: routing: unknown key "top_k" (allowed: assumption, loads, seed, )"
            "capacity_factor)"},
       }) {
    SCOPED_TRACE(section);
    auto model = parse_model(valid_with(R"("loss": "y")", R"("loss": "y", "routing": )" + section),
                             "toy.json");
    ASSERT_FALSE(model.ok());
    EXPECT_EQ(model.error().message, message);
  }
}

}  // namespace
}  // namespace ferry::sim
