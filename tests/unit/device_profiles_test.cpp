// The bundled device profiles (docs/devices.md): each loads and names its file, their figures
// match the documented sources, and the names that cannot be loaded are refused.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/sim/io/program_json.hpp"
#include "program_json_test_support.hpp"

namespace ferry::sim {
namespace {

using program_json_test::kProfileDir;

/// `text` with `from`, which must be there, replaced by `to` once.
std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

TEST(DeviceProfiles, EveryBundledProfileLoadsAndNamesItsFile) {
  const std::vector<std::string> expected = {
      "a100-pcie4",    "a100-sxm4-40gb", "b200", "gh200", "gh200-quad", "h100-pcie-80gb",
      "h100-sxm-96gb", "h100-sxm-pcie5", "h200", "l4",    "l40s",       "rtx-4090"};
  const auto names = list_device_profiles(kProfileDir);
  for (const auto& name : expected) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
  for (const auto& name : names) {
    const auto profile = load_device_profile(kProfileDir, name);
    ASSERT_TRUE(profile.ok()) << profile.error().message;
    EXPECT_EQ(profile.value().name, name);
    EXPECT_FALSE(profile.value().description.empty()) << name;
    EXPECT_GT(profile.value().h2d.bandwidth.bytes_per_s(), 0);
    // Writing and reading back gives the same profile.
    const std::string written = device_profile_to_json(profile.value());
    const auto again = parse_device_profile(written, name);
    ASSERT_TRUE(again.ok()) << again.error().message;
    EXPECT_EQ(device_profile_to_json(again.value()), written);
  }
}

TEST(DeviceProfiles, BundledFiguresMatchTheDocumentedSources) {
  const auto h100 = load_device_profile(kProfileDir, "h100-sxm-pcie5");
  ASSERT_TRUE(h100.ok()) << h100.error().message;
  EXPECT_EQ(h100.value().h2d.bandwidth, Bandwidth(55'370'000'000));
  EXPECT_EQ(h100.value().d2h.bandwidth, Bandwidth(55'200'000'000));
  EXPECT_EQ(h100.value().flops_per_s, 989'000'000'000'000);
  // torch's cuBLAS workspace on compute capability 9.0 (:4096:8), and elsewhere (:4096:2:16:8).
  EXPECT_EQ(h100.value().blas_workspace, Bytes(32 * kMiB));

  const auto a100 = load_device_profile(kProfileDir, "a100-pcie4");
  ASSERT_TRUE(a100.ok()) << a100.error().message;
  // Gen4: H2D loses about half its rate under bidirectional load, D2H hardly any.
  EXPECT_LT(a100.value().h2d.bidirectional_permille, 500);
  EXPECT_GT(a100.value().d2h.bidirectional_permille, 900);
  EXPECT_EQ(a100.value().blas_workspace, 8 * kMiB + Bytes(128 * 1024));

  const auto gh200 = load_device_profile(kProfileDir, "gh200");
  ASSERT_TRUE(gh200.ok()) << gh200.error().message;
  EXPECT_GT(gh200.value().h2d.bandwidth, gh200.value().d2h.bandwidth);
  EXPECT_GT(gh200.value().pageable_h2d.bytes_per_s() * 10,
            gh200.value().h2d.bandwidth.bytes_per_s() * 9);

  // pytorch/pytorch PR #186161: about 3 ms a cudaHostAlloc, on every bundled GPU.
  for (const std::string& name : list_device_profiles(kProfileDir)) {
    const auto profile = load_device_profile(kProfileDir, name);
    ASSERT_TRUE(profile.ok()) << profile.error().message;
    EXPECT_EQ(profile.value().overheads.host_alloc, SimTime(3'000'000)) << name;
  }
}

// `host_alloc` is optional: absent, pinning costs nothing; present, it is written back; out of
// range, refused naming its path.
TEST(DeviceProfiles, TheHostAllocationCostIsOptionalAndBounded) {
  const auto h100 = load_device_profile(kProfileDir, "h100-sxm-pcie5");
  ASSERT_TRUE(h100.ok()) << h100.error().message;
  const std::string written = device_profile_to_json(h100.value());
  EXPECT_NE(written.find("\"host_alloc\": 3000000"), std::string::npos) << written;
  const auto parsed =
      parse_device_profile(replaced(written, ", \"host_alloc\": 3000000", ""), "p.json");
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  EXPECT_EQ(parsed.value().overheads.host_alloc, SimTime(0));
  EXPECT_EQ(parsed.value().overheads.malloc, h100.value().overheads.malloc);
  for (const std::string bad : {"-1", "1000000000000001", "\"3ms\""}) {
    const auto refused = parse_device_profile(
        replaced(written, "\"host_alloc\": 3000000", "\"host_alloc\": " + bad), "p.json");
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_EQ(refused.error().message.rfind("p.json: overheads_ns.host_alloc: ", 0), 0U)
        << refused.error().message;
  }
}

TEST(DeviceProfiles, TrainingGpuFiguresMatchTheDocumentedSources) {
  const auto figures = [](const char* name) {
    auto profile = load_device_profile(kProfileDir, name);
    EXPECT_TRUE(profile.ok()) << profile.error().message;
    return profile.value();
  };
  // Dense BF16 tensor peaks of the datasheets (half of the printed sparse figures).
  EXPECT_EQ(figures("h100-pcie-80gb").flops_per_s, 756'000'000'000'000);
  EXPECT_EQ(figures("h200").flops_per_s, 989'000'000'000'000);
  EXPECT_EQ(figures("b200").flops_per_s, 2'250'000'000'000'000);
  EXPECT_EQ(figures("l4").flops_per_s, 121'000'000'000'000);
  EXPECT_EQ(figures("l40s").flops_per_s, 362'050'000'000'000);
  EXPECT_EQ(figures("rtx-4090").flops_per_s, 165'200'000'000'000);
  EXPECT_EQ(figures("h200").memory_bandwidth, Bandwidth(4'800'000'000'000));
  EXPECT_EQ(figures("a100-sxm4-40gb").memory_bandwidth, Bandwidth(1'555'000'000'000));
  // torchtitan's hosts: 95.0396 GiB as torch reports it, HBM2e at 2.4 TB/s.
  EXPECT_EQ(figures("h100-sxm-96gb").memory, Bytes(102'047'993'456));
  EXPECT_EQ(figures("h100-sxm-96gb").memory_bandwidth, Bandwidth(2'400'000'000'000));
  // Megatron-LM #6491, four GH200s: CE CPU->GPU 411.57-421.14 GB/s, GPU->CPU 169.90-170.09 GB/s.
  EXPECT_EQ(figures("gh200-quad").h2d.bandwidth, Bandwidth(416'000'000'000));
  EXPECT_EQ(figures("gh200-quad").d2h.bandwidth, Bandwidth(170'000'000'000));
  // nvbandwidth #15, eight RTX 4090s: medians of the CE rates.
  EXPECT_EQ(figures("rtx-4090").h2d.bandwidth, Bandwidth(26'200'000'000));
  EXPECT_EQ(figures("rtx-4090").d2h.bandwidth, Bandwidth(26'800'000'000));
  // No NVLink on the Ada cards: no collectives, and FSDP over ranks is refused.
  EXPECT_FALSE(figures("l40s").collectives.intra_node.known());
  // torch 2.11's cuBLAS workspace: 32 MiB on compute capability 9.0 only, :4096:2:16:8 on
  // Blackwell (10.0), Ampere and Ada.
  EXPECT_EQ(figures("b200").blas_workspace, 8 * kMiB + Bytes(128 * 1024));
  EXPECT_EQ(figures("l4").blas_workspace, 8 * kMiB + Bytes(128 * 1024));
}

TEST(DeviceProfiles, KernelFiguresRoundTripAndAnOutOfBoundsOneIsRefusedNamingItsPath) {
  const auto h100 = load_device_profile(kProfileDir, "h100-sxm-96gb");
  ASSERT_TRUE(h100.ok()) << h100.error().message;
  DeviceProfile efficient = h100.value();
  efficient.kernels = KernelFigures{.sm_count = 132,
                                    .matmul_tile_m = 256,
                                    .matmul_tile_n = 128,
                                    .matmul_permille = 800,
                                    .efficient_forward_permille = 300,
                                    .efficient_backward_permille = 250,
                                    .collective_overlap_permille = 769};
  const std::string written = device_profile_to_json(efficient);
  const auto again = parse_device_profile(written, "p.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value().kernels, efficient.kernels);
  for (const std::string field : {"efficient_backward_permille", "collective_overlap_permille"}) {
    for (const std::string bad : {"0", "1001", "-5", "\"fast\""}) {
      std::string text = written;
      const std::size_t at = text.find("\"" + field + "\": ");
      ASSERT_NE(at, std::string::npos) << text;
      const std::size_t end = text.find_first_of(",}\n", at + field.size() + 4);
      text.replace(at, end - at, "\"" + field + "\": " + bad);
      const auto refused = parse_device_profile(text, "p.json");
      ASSERT_FALSE(refused.ok()) << field << " " << bad;
      EXPECT_NE(refused.error().message.find("kernels." + field), std::string::npos)
          << refused.error().message;
    }
  }
}

// `profile` written as JSON, which reads back with the same kernel figures.
std::string written_again(const DeviceProfile& profile) {
  const std::string written = device_profile_to_json(profile);
  const auto again = parse_device_profile(written, "p.json");
  EXPECT_TRUE(again.ok()) << again.error().message;
  if (again.ok()) {
    EXPECT_EQ(again.value().kernels, profile.kernels);
  }
  return written;
}

// `written` with `from` replaced by `to` is refused with `message`, under "kernels".
void expect_refused(const std::string& written, const std::string& from, const std::string& to,
                    std::string_view message) {
  const auto refused = parse_device_profile(replaced(written, from, to), "p.json");
  ASSERT_FALSE(refused.ok()) << to;
  EXPECT_NE(refused.error().message.find(message), std::string::npos) << refused.error().message;
  EXPECT_NE(refused.error().message.find("kernels"), std::string::npos) << refused.error().message;
}

TEST(DeviceProfiles, TheGroupedMatmulsKernelFollowsTheComputeCapability) {
  // torch's grouped kernel runs on compute capability 9.x and 10.x, its fallback elsewhere; the
  // bundled profiles give the compute capability and leave `grouped_mm` to it.
  for (const auto& [name, kernel] :
       {std::pair{"h100-sxm-pcie5", GroupedMmKernel::Cutlass},
        std::pair{"b200", GroupedMmKernel::Cutlass},
        std::pair{"a100-sxm4-40gb", GroupedMmKernel::Loop}, std::pair{"l4", GroupedMmKernel::Loop},
        std::pair{"rtx-4090", GroupedMmKernel::Loop}}) {
    const auto profile = load_device_profile(kProfileDir, name);
    ASSERT_TRUE(profile.ok()) << profile.error().message;
    EXPECT_EQ(profile.value().kernels.grouped_mm, kernel) << name;
  }
  const auto a100 = load_device_profile(kProfileDir, "a100-pcie4");
  ASSERT_TRUE(a100.ok()) << a100.error().message;
  const std::string written = written_again(a100.value());
  EXPECT_EQ(written.find("grouped_mm"), std::string::npos) << written;
  // A profile may name the other kernel (another torch's choice): written back, and read.
  DeviceProfile cutlass = a100.value();
  cutlass.kernels.grouped_mm = GroupedMmKernel::Cutlass;
  EXPECT_NE(written_again(cutlass).find(R"("grouped_mm": "cutlass")"), std::string::npos);
  expect_refused(written, "\"flash_forward_permille\"",
                 "\"grouped_mm\": \"triton\", \"flash_forward_permille\"",
                 "\"grouped_mm\" is \"cutlass\" or \"loop\", not \"triton\"");
}

TEST(DeviceProfiles, TorchsOwnChoicesFollowTheComputeCapability) {
  // torch 2.11's CublasHandlePool.cpp, sdp_utils.cpp and GroupedBlas.cpp (docs/devices.md).
  constexpr Bytes k32MiB(std::int64_t{32} << 20);
  constexpr Bytes kSmall((std::int64_t{8} << 20) + (std::int64_t{128} << 10));
  struct Row {
    ComputeCapability cc;
    Bytes workspace;
    SdpaBackend sdpa;
    GroupedMmKernel grouped;
  };
  for (const Row& row : {
           Row{{7, 0}, kSmall, SdpaBackend::Flash, GroupedMmKernel::Loop},      // V100
           Row{{8, 0}, kSmall, SdpaBackend::Flash, GroupedMmKernel::Loop},      // A100
           Row{{8, 9}, kSmall, SdpaBackend::Flash, GroupedMmKernel::Loop},      // L4, RTX 4090
           Row{{9, 0}, k32MiB, SdpaBackend::Cudnn, GroupedMmKernel::Cutlass},   // H100, GH200
           Row{{10, 0}, kSmall, SdpaBackend::Cudnn, GroupedMmKernel::Cutlass},  // B200
           Row{{10, 3}, kSmall, SdpaBackend::Cudnn, GroupedMmKernel::Cutlass},  // B300
           Row{{12, 0}, kSmall, SdpaBackend::Flash, GroupedMmKernel::Loop},     // RTX 5090
           Row{{}, Bytes(0), SdpaBackend::Flash, GroupedMmKernel::Cutlass},     // not given
       }) {
    SCOPED_TRACE(fmt::format("{}.{}", row.cc.major, row.cc.minor));
    const TorchDefaults d = torch_defaults_on(row.cc);
    EXPECT_EQ(d.blas_workspace, row.workspace);
    EXPECT_EQ(d.sdpa_backend, row.sdpa);
    EXPECT_EQ(d.grouped_mm, row.grouped);
  }
  // A profile reads them from its compute capability, and writes back what differs.
  auto profile = load_device_profile(kProfileDir, "l4");
  ASSERT_TRUE(profile.ok()) << profile.error().message;
  const std::string l4 = device_profile_to_json(profile.value());
  const auto as_b200 = parse_device_profile(
      replaced(l4, R"("compute_capability": "8.9")", R"("compute_capability": "10.0")"), "p.json");
  ASSERT_TRUE(as_b200.ok()) << as_b200.error().message;
  EXPECT_EQ(as_b200.value().compute_capability, (ComputeCapability{10, 0}));
  EXPECT_EQ(as_b200.value().kernels.sdpa_backend, SdpaBackend::Cudnn);
  EXPECT_EQ(as_b200.value().kernels.grouped_mm, GroupedMmKernel::Cutlass);
  const auto unknown =
      parse_device_profile(replaced(l4, R"("compute_capability": "8.9", )", ""), "p.json");
  ASSERT_TRUE(unknown.ok()) << unknown.error().message;
  EXPECT_FALSE(unknown.value().compute_capability.known());
  EXPECT_EQ(unknown.value().blas_workspace, Bytes(0));
  EXPECT_EQ(unknown.value().kernels.grouped_mm, GroupedMmKernel::Cutlass);
  // Choices other than torch's on the GPU are written back.
  DeviceProfile overridden = profile.value();
  overridden.kernels.sdpa_backend = SdpaBackend::Cudnn;
  overridden.blas_workspace = k32MiB;
  const auto again = parse_device_profile(device_profile_to_json(overridden), "p.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value().kernels.sdpa_backend, SdpaBackend::Cudnn);
  EXPECT_EQ(again.value().blas_workspace, k32MiB);
  for (const std::string bad :
       {R"("9")", R"("09.0")", R"("9.10")", R"("sm_90")", R"(".0")", R"("100.0")", "9.0", "null"}) {
    const auto refused = parse_device_profile(
        replaced(l4, R"("compute_capability": "8.9")", R"("compute_capability": )" + bad),
        "p.json");
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.error().message.find("compute_capability"), std::string::npos)
        << refused.error().message;
  }
}

TEST(DeviceProfiles, AttentionFiguresAndTheSdpaBackendStandWithoutTheTileModel) {
  const auto h100 = load_device_profile(kProfileDir, "h100-sxm-pcie5");
  ASSERT_TRUE(h100.ok()) << h100.error().message;
  // The bundled Hopper profiles: attention figures, SDPA on cuDNN's kernel, no tile model.
  EXPECT_FALSE(h100.value().kernels.tiled());
  EXPECT_EQ(h100.value().kernels.sdpa_backend, SdpaBackend::Cudnn);
  EXPECT_EQ(h100.value().kernels.flash_forward_permille, 339);
  const std::string written = written_again(h100.value());
  EXPECT_EQ(written.find("sm_count"), std::string::npos) << written;
  expect_refused(written, "\"flash_forward_permille\"",
                 "\"sdpa_backend\": \"math\", \"flash_forward_permille\"",
                 "\"sdpa_backend\" is \"flash\" or \"cudnn\", not \"math\"");
  // Half a tile model is refused, naming the four figures that go together.
  const auto half = parse_device_profile(replaced(written, "\"flash_forward_permille\"",
                                                  "\"sm_count\": 132, \"flash_forward_permille\""),
                                         "p.json");
  ASSERT_FALSE(half.ok());
  EXPECT_NE(half.error().message.find("give all four"), std::string::npos) << half.error().message;
  EXPECT_NE(half.error().message.find("kernels"), std::string::npos) << half.error().message;
}

TEST(DeviceProfiles, TheFloat32RateIsOptionalAndBounded) {
  const auto h200 = load_device_profile(kProfileDir, "h200");
  ASSERT_TRUE(h200.ok()) << h200.error().message;
  EXPECT_EQ(h200.value().fp32_flops_per_s, 67'000'000'000'000);  // the datasheet's
  const std::string written = device_profile_to_json(h200.value());
  const auto again = parse_device_profile(written, "p.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value().fp32_flops_per_s, h200.value().fp32_flops_per_s);
  DeviceProfile none = h200.value();
  none.fp32_flops_per_s = 0;
  const std::string without = device_profile_to_json(none);
  EXPECT_EQ(without.find("fp32_flops_per_s"), std::string::npos);  // left out when 0
  const auto read = parse_device_profile(without, "p.json");
  ASSERT_TRUE(read.ok()) << read.error().message;
  EXPECT_EQ(read.value().fp32_flops_per_s, 0);
  for (const std::string bad : {"0", "-1", "\"67T\""}) {
    const auto refused = parse_device_profile(
        replaced(written, "\"fp32_flops_per_s\": 67000000000000", "\"fp32_flops_per_s\": " + bad),
        "p.json");
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.error().message.find("fp32_flops_per_s"), std::string::npos)
        << refused.error().message;
  }
}

// Every bundled profile gives a dense TF32 rate, at least its CUDA cores' float32 and below its
// 16-bit peak (each datasheet's; docs/devices.md); written back, and left out when 0.
TEST(DeviceProfiles, EveryBundledProfileGivesATF32RateBetweenItsFloat32AndItsPeak) {
  for (const std::string& name : list_device_profiles(kProfileDir)) {
    SCOPED_TRACE(name);
    const auto profile = load_device_profile(kProfileDir, name);
    ASSERT_TRUE(profile.ok()) << profile.error().message;
    EXPECT_GE(profile.value().tf32_flops_per_s, profile.value().fp32_flops_per_s);
    EXPECT_LT(profile.value().tf32_flops_per_s, profile.value().flops_per_s);
    const auto again = parse_device_profile(device_profile_to_json(profile.value()), "p.json");
    ASSERT_TRUE(again.ok()) << again.error().message;
    EXPECT_EQ(again.value().tf32_flops_per_s, profile.value().tf32_flops_per_s);
  }
  auto none = load_device_profile(kProfileDir, "h200");
  ASSERT_TRUE(none.ok());
  none.value().tf32_flops_per_s = 0;
  const std::string without = device_profile_to_json(none.value());
  EXPECT_EQ(without.find("tf32_flops_per_s"), std::string::npos);
  const auto refused = parse_device_profile(
      replaced(without, "\"fp32_flops_per_s\"", "\"tf32_flops_per_s\": 0, \"fp32_flops_per_s\""),
      "p.json");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("tf32_flops_per_s"), std::string::npos)
      << refused.error().message;
}

TEST(DeviceProfiles, TheBlasWorkspaceIsOptionalAndBounded) {
  const auto h100 = load_device_profile(kProfileDir, "h100-sxm-pcie5");
  ASSERT_TRUE(h100.ok());
  const std::string text = device_profile_to_json(h100.value());
  EXPECT_EQ(text.find("blas_workspace_bytes"), std::string::npos);  // left out: torch's default
  DeviceProfile none = h100.value();
  none.blas_workspace = Bytes(0);
  const std::string written = device_profile_to_json(none);
  EXPECT_NE(written.find("\"blas_workspace_bytes\": 0"), std::string::npos) << written;
  const auto again = parse_device_profile(written, "p.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value().blas_workspace, Bytes(0));
  for (const std::string bad : {"-1", "1073741825", "\"32MiB\"", "1.5"}) {
    const auto refused =
        parse_device_profile(replaced(text, "\"overheads_ns\"",
                                      "\"blas_workspace_bytes\": " + bad + ", \"overheads_ns\""),
                             "p.json");
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.error().message.find("blas_workspace_bytes"), std::string::npos)
        << refused.error().message;
  }
}

TEST(DeviceProfiles, UnknownNameListsTheBundledProfiles) {
  const auto profile = load_device_profile(kProfileDir, "h100");
  ASSERT_FALSE(profile.ok());
  EXPECT_NE(profile.error().message.find("unknown device profile \"h100\""), std::string::npos)
      << profile.error().message;
  EXPECT_NE(
      profile.error().message.find(
          "a100-pcie4, a100-sxm4-40gb, b200, gh200, gh200-quad, h100-pcie-80gb, h100-sxm-96gb, "
          "h100-sxm-pcie5, h200, l4, l40s, rtx-4090"),
      std::string::npos)
      << profile.error().message;
}

TEST(DeviceProfiles, NamesThatCouldEscapeTheDirectoryAreRefused) {
  for (const char* name : {"../devices/gh200", "/etc/passwd", ".hidden", "GH200", ""}) {
    const auto profile = load_device_profile(kProfileDir, name);
    ASSERT_FALSE(profile.ok()) << name;
    EXPECT_NE(profile.error().message.find("invalid device profile name"), std::string::npos)
        << profile.error().message;
  }
}

}  // namespace
}  // namespace ferry::sim
