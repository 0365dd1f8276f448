#pragma once
// What the model's tests share (model_presets_test.cpp, model_timing_test.cpp,
// model_json_test.cpp, model_validation_test.cpp, model_collective_test.cpp): transformer shapes,
// lookups by name, a round device and a small valid model as JSON text.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::model_test {

inline const std::filesystem::path kScenarioDir = FERRY_SCENARIOS_DIR;

inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

inline TransformerShape gpt_shape(std::int64_t s, std::int64_t b, std::int64_t h, std::int64_t a) {
  TransformerShape shape;
  shape.kind = TransformerShape::Kind::Gpt;
  shape.layers = 2;
  shape.hidden = h;
  shape.heads = a;
  shape.kv_heads = a;
  shape.ffn = 4 * h;
  shape.vocab = 1000;
  shape.sequence = s;
  shape.micro_batch = b;
  return shape;
}

inline TransformerShape llama_shape(std::int64_t s, bool flash) {
  TransformerShape shape;
  shape.kind = TransformerShape::Kind::Llama;
  shape.layers = 2;
  shape.hidden = 256;
  shape.heads = 8;
  shape.kv_heads = 2;
  shape.ffn = 704;
  shape.vocab = 1000;
  shape.sequence = s;
  shape.micro_batch = 2;
  shape.flash_attention = flash;
  return shape;
}

/// The index of the tensor or op called `name`; fails the test when there is none.
template <class Item>
std::size_t index_of(const std::vector<Item>& items, std::string_view name) {
  const auto it =
      std::find_if(items.begin(), items.end(), [&](const Item& item) { return item.name == name; });
  EXPECT_NE(it, items.end()) << name;
  return static_cast<std::size_t>(it - items.begin());
}

/// Name -> bytes of the distinct activations the ops of `layer` save.
inline std::map<std::string, std::int64_t> saved_activations(const Model& model,
                                                             std::int32_t layer) {
  std::map<std::string, std::int64_t> saved;
  for (const ModelOp& op : model.ops) {
    if (op.layer != layer) continue;
    for (const std::uint32_t t : op.saved) {
      const ModelTensor& tensor = model.tensors[t];
      if (tensor.role == TensorRole::Activation) saved[tensor.name] = tensor.bytes.count();
    }
  }
  return saved;
}

/// A device of `flops_per_s` and `bytes_per_s` and nothing else.
inline DeviceProfile round_device(std::int64_t flops_per_s, std::int64_t bytes_per_s) {
  DeviceProfile device;
  device.name = "round";
  device.flops_per_s = flops_per_s;
  device.memory_bandwidth = Bandwidth(bytes_per_s);
  return device;
}

/// A device of 4 SMs with 128 x 128 tiles, a peak of 1.024 PFLOP/s and 1 TB/s, whose GEMMs
/// reach half the peak, flash attention a quarter forward and an eighth backward, and streaming
/// kernels 90 % of the bandwidth.
inline DeviceProfile kernel_device() {
  DeviceProfile device = round_device(1'024'000'000'000'000, 1'000'000'000'000);
  device.kernels = KernelFigures{.sm_count = 4,
                                 .matmul_tile_m = 128,
                                 .matmul_tile_n = 128,
                                 .matmul_permille = 500,
                                 .flash_forward_permille = 250,
                                 .flash_backward_permille = 125,
                                 .memory_permille = 900};
  return device;
}

/// `text` with its one occurrence of `from` replaced by `to`; fails the test when `from` is
/// not there or there more than once.
inline std::string replaced(std::string_view text, std::string_view from, std::string_view to) {
  std::string out(text);
  const auto at = out.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(out.find(from, at + 1), std::string::npos) << "ambiguous: " << from;
  if (at != std::string::npos) out.replace(at, from.size(), to);
  return out;
}

inline constexpr std::string_view kValidModel = R"({
  "format": "ferry.model/1",
  "name": "toy",
  "tensors": [
    {"name": "x", "bytes": 64, "dtype": "bf16", "role": "input"},
    {"name": "w", "bytes": 128, "dtype": "bf16", "role": "param"},
    {"name": "h", "bytes": 64, "dtype": "bf16", "role": "activation"},
    {"name": "h_lo", "bytes": 32, "dtype": "bf16", "role": "activation", "view_of": "h",
     "view_offset": 0},
    {"name": "y", "bytes": 4, "dtype": "f32", "role": "activation"}
  ],
  "ops": [
    {"name": "fc", "layer": 0, "flops": 100, "bytes": 256, "backward_flops": 200,
     "backward_bytes": 512, "inputs": ["x", "w"], "outputs": ["h", "h_lo"], "saved": ["x", "w"]},
    {"name": "sum", "flops": 16, "bytes": 36, "backward_flops": 32, "backward_bytes": 72,
     "inputs": ["h_lo"], "outputs": ["y"], "saved": []}
  ],
  "loss": "y"
})";

/// The valid model with the one occurrence of `from` replaced by `to`.
inline std::string valid_with(std::string_view from, std::string_view to) {
  return replaced(kValidModel, from, to);
}

/// The valid model, parsed.
inline Model small_valid_model() {
  const auto parsed = parse_model(kValidModel, "toy.json");
  EXPECT_TRUE(parsed.ok());
  return parsed.value();
}

/// A document the reader refuses, and its whole message.
struct BadCase {
  std::string name;
  std::string text;
  std::string expected;
};

}  // namespace ferry::sim::model_test
