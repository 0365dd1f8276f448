// The durations a device gives a model's ops: the roofline at the assumed efficiencies, the
// measured kernels' figures, and the longest duration the format allows.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "model_test_support.hpp"

namespace ferry::sim {
namespace {

using model_test::index_of;
using model_test::kernel_device;
using model_test::kScenarioDir;
using model_test::kValidModel;
using model_test::round_device;
using model_test::small_valid_model;

// ---------------------------------------------------------------------------------------------
// Roofline timing

TEST(Roofline, DurationIsTheSlowerOfComputeAndMemoryAtTheAssumedEfficiencies) {
  Model model;
  model.name = "m";
  model.tensors.push_back(
      {"y", Bytes(4), DType::F32, TensorRole::Activation, -1, Bytes(0), false, Bytes(0), 0});
  ModelOp compute_bound;
  compute_bound.name = "matmul";
  compute_bound.flops = 600'000'000'000;   // 1 ms at 60% of 1 PFLOP/s
  compute_bound.bytes = Bytes(8'000'000);  // 10 us at 80% of 1 TB/s
  compute_bound.backward_flops = 1'200'000'000'000;
  compute_bound.backward_bytes = Bytes(16'000'000);
  ModelOp memory_bound;
  memory_bound.name = "add";
  memory_bound.flops = 1000;
  memory_bound.bytes = Bytes(800'000'001);  // 1 ms + a fraction of a ns
  memory_bound.backward_flops = 0;
  memory_bound.backward_bytes = Bytes(0);
  memory_bound.outputs = {0};
  model.ops = {compute_bound, memory_bound};
  ASSERT_TRUE(validate_model(model).ok()) << validate_model(model).error().message;

  assign_roofline_durations(model, round_device(1'000'000'000'000'000, 1'000'000'000'000));
  EXPECT_EQ(model.ops[0].duration, SimTime(1'000'000));
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(2'000'000));
  EXPECT_EQ(model.ops[1].duration, SimTime(1'000'001));   // rounded up
  EXPECT_EQ(model.ops[1].backward_duration, SimTime(1));  // at least 1 ns
}

ModelOp gemm_op(std::int64_t m, std::int64_t n, std::int64_t k) {
  ModelOp op;
  op.name = "mm";
  op.kind = "aten.mm.default";
  op.flops = 2 * m * n * k;
  op.backward_flops = 4 * m * n * k;
  op.gemm = GemmShape{.m = m, .n = n, .k = k, .batch = 1};
  return op;
}

TEST(KernelTiming, AMatmulPaysForWholeWavesOfTiles) {
  // One SM's share of the GEMM rate: 1.024e15 x 0.5 / 4 = 1.28e14 FLOP/s, so one wave of
  // 128 x 128 tiles over k = 1000 (32.768 MFLOP) takes 256 ns.
  Model model;
  model.ops = {gemm_op(512, 128, 1000), gemm_op(513, 128, 1000), gemm_op(1, 1, 1000)};
  assign_roofline_durations(model, kernel_device());
  EXPECT_EQ(model.ops[0].duration, SimTime(256));  // 4 tiles: one full wave
  EXPECT_EQ(model.ops[1].duration, SimTime(512));  // 5 tiles: a second wave for one tile
  EXPECT_EQ(model.ops[2].duration, SimTime(256));  // smaller than a tile: a whole one
  // Backward: dX (512 x 1000 over 128: 4 x 8 = 32 tiles, 8 waves of 32.768 ns) and dW
  // (1000 x 128 over 512: 8 tiles, 2 waves of 131.072 ns), 524.288 ns rounded up.
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(525));
  // A frozen weight: backward has half the FLOPs, and half the two products' time.
  model.ops[0].backward_flops /= 2;
  assign_roofline_durations(model, kernel_device());
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(263));
  // Without kernel figures the same op takes the flat roofline's 60 %.
  assign_roofline_durations(model, round_device(1'024'000'000'000'000, 1'000'000'000'000));
  EXPECT_EQ(model.ops[0].duration, SimTime(214));  // 131,072,000 FLOP at 614.4 TFLOP/s
}

TEST(KernelTiming, AttentionRunsAtItsKernelsFigureAndBytesAtTheMeasuredBandwidth) {
  Model model;
  ModelOp flash;
  flash.name = "attn";
  flash.kind = "aten._scaled_dot_product_flash_attention.default";
  flash.flops = 256'000'000;  // 1 us at a quarter of 1.024 PFLOP/s
  flash.backward_flops = 640'000'000;
  ModelOp efficient = flash;
  efficient.name = "attn2";
  efficient.kind = "aten._scaled_dot_product_efficient_attention.default";  // no figure: 60 %
  ModelOp add;
  add.name = "add";
  add.kind = "aten.add.Tensor";
  add.flops = 1000;
  add.bytes = Bytes(900'000);  // 1 us at 90 % of 1 TB/s
  ModelOp mm_without_shape;
  mm_without_shape.name = "mm";
  mm_without_shape.kind = "aten.mm.default";
  mm_without_shape.flops = 512'000'000;  // 1 us at half the peak
  model.ops = {flash, efficient, add, mm_without_shape};
  assign_roofline_durations(model, kernel_device());
  EXPECT_EQ(model.ops[0].duration, SimTime(1000));
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(5000));  // at an eighth
  EXPECT_EQ(model.ops[1].duration, SimTime(417));            // 256 MFLOP at 614.4 TFLOP/s
  EXPECT_EQ(model.ops[2].duration, SimTime(1000));
  EXPECT_EQ(model.ops[3].duration, SimTime(1000));
  // With figures of its own the memory-efficient kernel runs at them, flash at its own still.
  DeviceProfile device = kernel_device();
  device.kernels.efficient_forward_permille = 500;
  device.kernels.efficient_backward_permille = 250;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[1].duration, SimTime(500));            // 256 MFLOP at 512 TFLOP/s
  EXPECT_EQ(model.ops[1].backward_duration, SimTime(2500));  // 640 MFLOP at 256 TFLOP/s
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(5000));
}

TEST(KernelTiming, AnSdpaCallRunsTheKernelTheProfileSaysTorchPicks) {
  Model model;
  ModelOp sdpa;
  sdpa.name = "attn";
  sdpa.kind = "aten._scaled_dot_product_flash_attention.default";  // a traced SDPA call
  sdpa.flops = 256'000'000;
  sdpa.backward_flops = 640'000'000;
  ModelOp flash = sdpa;  // flash's kernel called as such (varlen attention calls it)
  flash.name = "attn2";
  flash.kind = "aten._flash_attention_forward.default";
  model.ops = {sdpa, flash};
  DeviceProfile device = kernel_device();
  device.kernels.cudnn_forward_permille = 500;
  device.kernels.cudnn_backward_permille = 250;
  assign_roofline_durations(model, device);         // flash, the default
  EXPECT_EQ(model.ops[0].duration, SimTime(1000));  // 256 MFLOP at 256 TFLOP/s
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(5000));
  device.kernels.sdpa_backend = SdpaBackend::Cudnn;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(500));            // 256 MFLOP at 512 TFLOP/s
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(2500));  // 640 MFLOP at 256 TFLOP/s
  EXPECT_EQ(model.ops[1].duration, SimTime(1000));           // flash's still
  // cuDNN without a figure: the flat 60 %.
  device.kernels.cudnn_forward_permille = 0;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(417));
}

// A model with a float32 output (tensor 0) and a bf16 one (tensor 1), and a float32 matmul of
// 60 GFLOP forward and 120 backward: 1 ms forward at 60 % of 100 TFLOP/s.
std::pair<Model, ModelOp> float32_matmul() {
  Model model;
  model.tensors.push_back(
      {"f32", Bytes(4), DType::F32, TensorRole::Activation, -1, Bytes(0), false, Bytes(0), 0});
  model.tensors.push_back(
      {"bf16", Bytes(2), DType::BF16, TensorRole::Activation, -1, Bytes(0), false, Bytes(0), 0});
  ModelOp mm;
  mm.name = "mm";
  mm.kind = "aten.mm.default";
  mm.flops = 60'000'000'000;
  mm.backward_flops = 120'000'000'000;
  mm.outputs = {0};
  return {model, mm};
}

// A copy of `op` named `name`, of operator `kind`.
ModelOp as_kind(ModelOp op, std::string name, std::string_view kind) {
  op.name = std::move(name);
  op.kind = kind;
  return op;
}

// A copy of `op` named `name`, writing float32_matmul()'s bf16 tensor.
ModelOp in_bf16(ModelOp op, std::string name) {
  op.name = std::move(name);
  op.outputs = {1};
  return op;
}

TEST(KernelTiming, AFloat32ProductRunsOnTheCudaCores) {
  auto [model, mm] = float32_matmul();
  model.ops = {
      mm, in_bf16(mm, "mm16"),  // the same product in bf16: the tensor cores' rate
      // float32 SDPA: the memory-efficient kernel, on the CUDA cores of a GPU without TF32
      as_kind(mm, "attn", "aten._scaled_dot_product_flash_attention.default"),
      as_kind(mm, "add", "aten.add.Tensor"),  // a float32 elementwise op: not a product
  };
  DeviceProfile device = round_device(1'000'000'000'000'000, 1'000'000'000'000'000);
  device.kernels.flash_forward_permille = 500;
  device.fp32_flops_per_s = 100'000'000'000'000;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(1'000'000));
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(2'000'000));
  EXPECT_EQ(model.ops[1].duration, SimTime(100'000));  // 60 GFLOP at 600 TFLOP/s
  EXPECT_EQ(model.ops[2].duration, SimTime(1'000'000));
  EXPECT_EQ(model.ops[3].duration, SimTime(100'000));
  // A profile without the figure times every product at flops_per_s, as before.
  device.fp32_flops_per_s = 0;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(100'000));
  EXPECT_EQ(model.ops[2].duration, SimTime(120'000));  // flash's 500 per mille
}

// A model traced with TF32 allowed runs its float32 matmuls on the tensor cores at the profile's
// TF32 rate; a profile without the rate keeps the CUDA cores'.
TEST(KernelTiming, TF32RunsFloat32MatmulsAtTheTensorCoresTF32Rate) {
  auto [model, mm] = float32_matmul();
  // A batched product follows the same cuBLAS setting.
  model.ops = {mm, as_kind(mm, "bmm", "aten.bmm.default"), in_bf16(mm, "mm16")};
  DeviceProfile device = round_device(1'000'000'000'000'000, 1'000'000'000'000'000);
  device.fp32_flops_per_s = 100'000'000'000'000;
  device.tf32_flops_per_s = 500'000'000'000'000;
  model.matmul_tf32 = true;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(200'000));  // 60 GFLOP at 60 % of 500 TFLOP/s
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(400'000));
  EXPECT_EQ(model.ops[1].duration, SimTime(200'000));
  EXPECT_EQ(model.ops[2].duration, SimTime(100'000));  // bf16: the 16-bit peak
  // A profile without a TF32 rate (no TF32 tensor cores): the CUDA cores.
  device.tf32_flops_per_s = 0;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(1'000'000));
  // torch's default precision: the CUDA cores, whatever the profile gives.
  device.tf32_flops_per_s = 500'000'000'000'000;
  model.matmul_tf32 = false;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(1'000'000));
  EXPECT_EQ(model.ops[1].duration, SimTime(1'000'000));
}

// A float32 SDPA call runs the memory-efficient kernel, whose float32 products are three TF32
// products each on a GPU with TF32 tensor cores, whatever torch's precision settings: a third of
// the TF32 rate, forward and backward; the CUDA cores' without TF32. Flex attention follows the
// matmul setting, and a bf16 call runs at its kernel's figure.
TEST(KernelTiming, Float32SdpaRunsTheEfficientKernelAtAThirdOfTheTF32Rate) {
  auto [model, mm] = float32_matmul();
  const ModelOp sdpa = as_kind(mm, "sdpa", "aten._scaled_dot_product_flash_attention.default");
  model.ops = {
      sdpa,
      as_kind(mm, "efficient", "aten._scaled_dot_product_efficient_attention.default"),
      as_kind(mm, "flex", "higher_order.flex_attention"),
      in_bf16(sdpa, "sdpa16"),
  };
  DeviceProfile device = round_device(1'000'000'000'000'000, 1'000'000'000'000'000);
  device.kernels.flash_forward_permille = 500;
  device.fp32_flops_per_s = 100'000'000'000'000;
  device.tf32_flops_per_s = 600'000'000'000'000;
  for (const bool tf32 : {false, true}) {
    model.matmul_tf32 = tf32;
    assign_roofline_durations(model, device);
    EXPECT_EQ(model.ops[0].duration, SimTime(500'000));  // 60 GFLOP at 60 % of 200 TFLOP/s
    EXPECT_EQ(model.ops[0].backward_duration, SimTime(1'000'000));
    EXPECT_EQ(model.ops[1].duration, SimTime(500'000));
    EXPECT_EQ(model.ops[1].backward_duration, SimTime(1'000'000));
    // flex: the CUDA cores, or 60 GFLOP at 60 % of 600 TFLOP/s under TF32
    EXPECT_EQ(model.ops[2].duration, SimTime(tf32 ? 166'667 : 1'000'000));
    EXPECT_EQ(model.ops[3].duration, SimTime(120'000));  // bf16: flash's 500 per mille
  }
  device.tf32_flops_per_s = 0;  // no TF32 tensor cores (Volta): the CUDA cores
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(1'000'000));
  EXPECT_EQ(model.ops[1].duration, SimTime(1'000'000));
}

// A float32 convolution is cuDNN's, which torch lets use TF32 by default
// (torch.backends.cudnn.conv.fp32_precision "tf32"): the TF32 rate whatever the matmul setting,
// the CUDA cores' at "ieee" or on a profile without TF32, and a bf16 one the 16-bit peak.
TEST(KernelTiming, AFloat32ConvolutionRunsAtTF32UnlessTracedWithIeee) {
  auto [model, mm] = float32_matmul();
  const ModelOp conv = as_kind(mm, "conv", "aten.convolution.default");
  model.ops = {conv, in_bf16(conv, "conv16")};
  DeviceProfile device = round_device(1'000'000'000'000'000, 1'000'000'000'000'000);
  device.fp32_flops_per_s = 100'000'000'000'000;
  device.tf32_flops_per_s = 500'000'000'000'000;
  ASSERT_TRUE(model.conv_tf32);  // torch's default
  ASSERT_FALSE(model.matmul_tf32);
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(200'000));  // 60 GFLOP at 60 % of 500 TFLOP/s
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(400'000));
  EXPECT_EQ(model.ops[1].duration, SimTime(100'000));  // bf16: the 16-bit peak
  device.tf32_flops_per_s = 0;                         // no TF32 tensor cores: the CUDA cores
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(1'000'000));
  device.tf32_flops_per_s = 500'000'000'000'000;
  model.conv_tf32 = false;
  model.matmul_tf32 = true;  // cuBLAS's setting is not cuDNN's
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(1'000'000));
  EXPECT_EQ(model.ops[1].duration, SimTime(100'000));
}

TEST(KernelTiming, AttentionFiguresAloneLeaveMatmulsToTheFlatRoofline) {
  Model model;
  ModelOp mm;
  mm.name = "mm";
  mm.kind = "aten.mm.default";
  mm.flops = 2 * 1024 * 1024 * 1024LL;
  mm.gemm = GemmShape{.m = 1024, .n = 1024, .k = 1024, .batch = 1};
  ModelOp sdpa;
  sdpa.name = "attn";
  sdpa.kind = "aten._scaled_dot_product_flash_attention.default";
  sdpa.flops = 256'000'000;
  model.ops = {mm, sdpa};
  DeviceProfile device = round_device(1'024'000'000'000'000, 1'000'000'000'000);
  device.kernels.flash_forward_permille = 250;
  ASSERT_FALSE(device.kernels.tiled());
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(3496));  // 2^31 FLOP at 614.4 TFLOP/s
  EXPECT_EQ(model.ops[1].duration, SimTime(1000));
  // A matmul figure without the tile model times every matmul at it.
  device.kernels.matmul_permille = 500;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(4195));  // 2^31 FLOP at 512 TFLOP/s
}

TEST(KernelTiming, PresetsGiveTheirMatmulsShapes) {
  const auto model = model_preset("llama3-8b-s8192");
  ASSERT_TRUE(model.ok());
  const ModelOp& gate = model.value().ops[index_of(model.value().ops, "layers.0.gate")];
  EXPECT_EQ(gate.gemm, (GemmShape{.m = 8192, .n = 14336, .k = 4096, .batch = 1}));
  const auto again = parse_model(model_to_json(model.value()), "written.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value(), model.value());
}

TEST(Roofline, DurationsArePositiveAndScaleWithTheDevice) {
  const auto h100 = load_device_profile(kScenarioDir / "devices", "h100-sxm-pcie5");
  const auto a100 = load_device_profile(kScenarioDir / "devices", "a100-pcie4");
  ASSERT_TRUE(h100.ok() && a100.ok());
  auto fast = model_preset("gpt2-small-s1024");
  ASSERT_TRUE(fast.ok());
  Model slow = fast.value();
  assign_roofline_durations(fast.value(), h100.value());
  assign_roofline_durations(slow, a100.value());
  SimTime fast_total;
  SimTime slow_total;
  for (std::size_t i = 0; i < slow.ops.size(); ++i) {
    const ModelOp& f = fast.value().ops[i];
    const ModelOp& s = slow.ops[i];
    EXPECT_GE(f.duration, SimTime(1)) << f.name;
    EXPECT_GE(f.backward_duration, SimTime(1)) << f.name;
    EXPECT_GT(s.duration, f.duration) << s.name;  // the A100 is slower at both FLOPs and bytes
    fast_total += f.duration + f.backward_duration;
    slow_total += s.duration + s.backward_duration;
  }
  EXPECT_GT(slow_total, fast_total);

  // Twice the peak and twice the bandwidth: every duration halves, to within rounding.
  DeviceProfile doubled = h100.value();
  doubled.flops_per_s *= 2;
  doubled.memory_bandwidth = Bandwidth(2 * doubled.memory_bandwidth.bytes_per_s());
  Model faster = fast.value();
  assign_roofline_durations(faster, doubled);
  for (std::size_t i = 0; i < faster.ops.size(); ++i) {
    const std::int64_t before = fast.value().ops[i].duration.ns();
    const std::int64_t after = faster.ops[i].duration.ns();
    EXPECT_LE(std::abs(2 * after - before), 2) << faster.ops[i].name;
  }
}

TEST(Roofline, AnOpLongerThanTheFormatAllowsOnTheDeviceIsAnError) {
  Model model = small_valid_model();
  model.ops[1].backward_flops = kMaxModelFlops;
  const DeviceProfile fast = round_device(1'000'000'000'000'000, 1'000'000'000'000);
  EXPECT_TRUE(check_roofline(model, fast).ok());  // 10^18 FLOP at 0.6 PFLOP/s: 1.7e12 ns
  DeviceProfile slow = round_device(1'000'000, 1'000'000'000'000);  // the slowest rate allowed
  slow.name = "slow";
  EXPECT_EQ(check_roofline(model, slow).error().message,
            "ops[1].backward_flops: 1000000000000000000 FLOP at 1000000 FLOP/s x 600/1000 on "
            "device \"slow\" take over 1000000000000000 ns, the longest duration a model op may "
            "have; a profile of 1666666666667 FLOP/s or more times it");
  // And at that rate it is timed; a FLOP/s less is refused.
  DeviceProfile least = round_device(1'666'666'666'667, 1'000'000'000'000);
  EXPECT_TRUE(check_roofline(model, least).ok());
  least.flops_per_s -= 1;
  EXPECT_FALSE(check_roofline(model, least).ok());
  model.ops[1].backward_flops = 0;
  model.ops[0].bytes = Bytes(std::int64_t{1} << 50);
  EXPECT_EQ(check_roofline(model, round_device(1'000'000'000'000'000, 1'000'000))
                .error()
                .message.substr(0, 45),
            "ops[0].bytes: 1125899906842624 bytes at 10000");
}

// A model is checked once on its way in: a parsed one by its reader, and its durations, the only
// thing assigned after, by check_roofline.
TEST(CheckedModel, DurationsAreAssignedToTheCheckedModelWithoutAnotherCheck) {
  auto parsed = parse_checked_model(kValidModel, "toy.json");
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  const Model* before = &parsed.value().model();
  const DeviceProfile device = round_device(1'000'000'000'000'000, 1'000'000'000'000);
  auto timed = with_roofline_durations(std::move(parsed).value(), device);
  ASSERT_TRUE(timed.ok()) << timed.error().message;
  EXPECT_EQ(&timed.value().model(), before);  // no copy shared it: changed in place
  Model expected = small_valid_model();
  assign_roofline_durations(expected, device);
  for (std::size_t i = 0; i < expected.ops.size(); ++i) {
    EXPECT_EQ(timed.value()->ops[i].duration, expected.ops[i].duration);
    EXPECT_EQ(timed.value()->ops[i].backward_duration, expected.ops[i].backward_duration);
  }
  EXPECT_TRUE(validate_model(*timed.value()).ok());
}

// ---------------------------------------------------------------------------------------------
// Grouped matmuls: one kernel, or torch's fallback of a matmul a group

// A model of one grouped matmul of `m` rows in `dtype` against `experts` weight matrices of
// k x n (tensor 1, a parameter), its gemm m x n over k, backward dX and dW.
Model grouped_matmul(DType dtype, std::int64_t m, std::int64_t n, std::int64_t k,
                     std::int64_t experts) {
  Model model;
  const std::int64_t size = dtype_size(dtype);
  model.tensors.push_back(
      {"x", Bytes(m * k * size), dtype, TensorRole::Activation, -1, Bytes(0), false, Bytes(0), 0});
  model.tensors.push_back({"w", Bytes(experts * k * n * size), dtype, TensorRole::Param, -1,
                           Bytes(0), false, Bytes(0), 0});
  model.tensors.push_back(
      {"y", Bytes(m * n * size), dtype, TensorRole::Activation, -1, Bytes(0), false, Bytes(0), 0});
  ModelOp op = gemm_op(m, n, k);
  op.name = "experts";
  op.kind = "aten._grouped_mm.default";
  op.inputs = {0, 1};
  op.outputs = {2};
  model.ops = {op};
  return model;
}

// `device` with host costs for the fallback's wait: a launch of 100 ns, a copy's submission of
// 5 us, its device-to-host latency 2 us, a synchronize 2 us: 9.1 us before the first group.
DeviceProfile with_host_costs(DeviceProfile device) {
  device.overheads.kernel = SimTime(100);
  device.overheads.copy = SimTime(5'000);
  device.overheads.synchronize = SimTime(2'000);
  device.d2h.latency = SimTime(2'000);
  return device;
}

TEST(KernelTiming, ABfloat16GroupedMatmulIsOneKernelWhereTorchHasOne) {
  Model model = grouped_matmul(DType::BF16, 1024, 128, 1000, 2);
  model.ops[0].group_rows = {513, 511};
  DeviceProfile device = with_host_costs(kernel_device());
  ASSERT_EQ(device.kernels.grouped_mm, GroupedMmKernel::Cutlass);
  assign_roofline_durations(model, device);
  // 1024 x 128 in 128 x 128 tiles: 8 tiles, two waves of 256 ns (AMatmulPaysForWholeWavesOfTiles).
  EXPECT_EQ(model.ops[0].duration, SimTime(512));
}

TEST(KernelTiming, TorchsFallbackWaitsForTheOffsetsThenRunsAMatmulAGroup) {
  Model model = grouped_matmul(DType::BF16, 1024, 128, 1000, 2);
  model.ops[0].group_rows = {513, 511};
  DeviceProfile device = with_host_costs(kernel_device());
  device.kernels.grouped_mm = GroupedMmKernel::Loop;
  assign_roofline_durations(model, device);
  // The wait, 9.1 us; then 513 rows (5 tiles: two waves, 512 ns) and 511 (4: one, 256 ns).
  EXPECT_EQ(model.ops[0].duration, SimTime(9'100 + 512 + 256));
  // Backward: two loops, each its own wait. dX, rows x 1000 over 128: 40 tiles (10 waves of
  // 32.768 ns, 328 rounded up) and 32 (8 waves, 263); dW, 1000 x 128 over the group's rows: two
  // waves of 128 x 128 x 513 x 2 FLOP (263) and of 511 (262).
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(2 * 9'100 + 328 + 263 + 263 + 262));
  // Frozen experts (the backward's FLOPs one product's): dX only.
  model.ops[0].backward_flops /= 2;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(9'100 + 328 + 263));
  // A group no longer than its launch takes the launch: an empty one, 100 ns.
  model.ops[0].group_rows = {1024, 0};
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(9'100 + 512 + 100));
}

TEST(KernelTiming, AFloat32GroupedMatmulFallsBackOnEveryGpu) {
  // Four experts of 1000 x 1000, 4000 rows spread evenly (no rows per group given): each group
  // 2 GFLOP at 60 % of the CUDA cores' 100 TFLOP/s, 33,334 ns.
  Model model = grouped_matmul(DType::F32, 4000, 1000, 1000, 4);
  DeviceProfile device =
      with_host_costs(round_device(1'000'000'000'000'000, 1'000'000'000'000'000));
  device.fp32_flops_per_s = 100'000'000'000'000;
  ASSERT_EQ(device.kernels.grouped_mm, GroupedMmKernel::Cutlass);
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(9'100 + 4 * 33'334));
  // bfloat16 on the same profile: one kernel, 8 GFLOP at 600 TFLOP/s.
  model = grouped_matmul(DType::BF16, 4000, 1000, 1000, 4);
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(13'334));
}

TEST(KernelTiming, TheFallbacksGroupsAreTheWeightsMatricesWhereTheRowsGivenAreNotOneEach) {
  // Rows for four groups, but the weights hold two matrices (an expert-parallel rank's half):
  // two groups of 2000 rows, 4 GFLOP each at 600 TFLOP/s, 6,667 ns.
  Model model = grouped_matmul(DType::BF16, 4000, 1000, 1000, 2);
  model.ops[0].group_rows = {1000, 1000, 1000, 1000};
  DeviceProfile device =
      with_host_costs(round_device(1'000'000'000'000'000, 1'000'000'000'000'000));
  device.kernels.grouped_mm = GroupedMmKernel::Loop;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(9'100 + 2 * 6'667));
  // Uneven rows spread evenly: 4001 over 2, 2001 and 2000.
  model = grouped_matmul(DType::BF16, 4001, 1000, 1000, 2);
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(9'100 + 6'670 + 6'667));
  // A float8 grouped matmul (operands recorded as bytes, a bfloat16 output): the scaled kernel.
  model = grouped_matmul(DType::BF16, 4000, 1000, 1000, 2);
  model.ops[0].kind = "aten._scaled_grouped_mm.default";
  model.tensors[0].dtype = DType::U8;
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(13'334));
  // A grouped product of batched operands (3-D by 3-D, a gemm of batch 2): one bmm, no wait.
  model = grouped_matmul(DType::BF16, 2000, 1000, 1000, 2);
  model.ops[0].gemm = GemmShape{.m = 1000, .n = 1000, .k = 1000, .batch = 2};
  assign_roofline_durations(model, device);
  EXPECT_EQ(model.ops[0].duration, SimTime(6'667));
}

TEST(CheckedModel, ASharedModelIsCopiedAndADurationPastTheFormatIsRefused) {
  Model model = small_valid_model();
  model.ops[1].backward_flops = kMaxModelFlops;
  const CheckedModel checked = check_model(model).value();
  const DeviceProfile device = round_device(1'000'000'000'000'000, 1'000'000'000'000);
  auto timed = with_roofline_durations(checked, device);
  ASSERT_TRUE(timed.ok()) << timed.error().message;
  EXPECT_NE(&timed.value().model(), &checked.model());  // the copy it shares is left alone
  EXPECT_EQ(checked->ops[1].backward_duration, SimTime(0));
  EXPECT_GT(timed.value()->ops[1].backward_duration, SimTime(0));
  DeviceProfile slow = round_device(1'000'000, 1'000'000'000'000);
  slow.name = "slow";
  const auto refused = with_roofline_durations(checked, slow);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().message, check_roofline(model, slow).error().message);
}

}  // namespace
}  // namespace ferry::sim
