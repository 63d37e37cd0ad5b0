// Device profiles: the shipped H200 profile, the JSON format's round trip and
// its errors, link-curve interpolation and allocator rounding.

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "spillway/error.h"
#include "spillway/sim.h"

namespace spillway {
namespace {

constexpr std::int64_t kMiB = 1 << 20;

// The shipped profile with one top-level field replaced (or removed when
// `value` is empty): a valid document to break one field at a time.
std::string h200_with(const std::string& field, const std::string& value) {
  std::string text = write_device_profile(h200_profile());
  const std::string key = "\"" + field + "\": ";
  const std::size_t at = text.find(key);
  EXPECT_NE(at, std::string::npos) << field;
  // Top-level fields are written one per line or as an indented array.
  std::size_t end = text.find('\n', at);
  if (text[end - 1] == '[') end = text.find("\n  ]", at) + 4;
  if (value.empty()) {
    const std::size_t line = text.rfind('\n', at);
    text.erase(line, end - line);
    if (text[line - 1] == ',' && text[line + 1] == '}') text.erase(line - 1, 1);
  } else {
    const bool comma = text[end - 1] == ',';
    text.replace(at, end - at, key + value + (comma ? "," : ""));
  }
  return text;
}

std::string parse_error(const std::string& text) {
  try {
    parse_device_profile(text);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(DeviceProfile, H200ShipsTheCalibratedProfile) {
  // src/sim/profiles/nvidia-h200.json: `python -m spillway.calibrate` on the
  // project's H200, 2026-12-01 (scripts/device-check, SPILLWAY_DEVICE_CHECK_ONLY=profile).
  const DeviceProfile& h200 = h200_profile();
  EXPECT_EQ(h200.name, "NVIDIA H200");
  EXPECT_NE(h200.source.find("spillway.calibrate on 2026-12-01"), std::string::npos);
  EXPECT_DOUBLE_EQ(h200.matmul_tflops_bf16, 691.3);
  EXPECT_DOUBLE_EQ(h200.matmul_tflops_fp32, 50.99);
  EXPECT_DOUBLE_EQ(h200.attention_tflops_bf16, 331.5);
  EXPECT_DOUBLE_EQ(h200.attention_backward_tflops_bf16, 294.6);
  EXPECT_DOUBLE_EQ(h200.memory_gbs, 4224.9);
  EXPECT_DOUBLE_EQ(h200.launch_us, 1.796);
  EXPECT_EQ(h200.allocation_granularity, 512);
  EXPECT_DOUBLE_EQ(h200.d2h.gbs(kMiB), 50.464);
  EXPECT_DOUBLE_EQ(h200.h2d.gbs(256 * kMiB), 55.432);
  EXPECT_DOUBLE_EQ(h200.d2h_duplex.gbs(64 * kMiB), 50.351);
  EXPECT_DOUBLE_EQ(h200.h2d_duplex.gbs(4 * kMiB), 49.498);
  // Beyond the last point the curve stays flat.
  EXPECT_DOUBLE_EQ(h200.d2h.gbs(1024 * kMiB), 55.314);
}

TEST(DeviceProfile, WriteThenParseGivesTheSameProfile) {
  const DeviceProfile& h200 = h200_profile();
  EXPECT_EQ(parse_device_profile(write_device_profile(h200)), h200);
  DeviceProfile custom = h200;
  custom.name = "test \"device\"";
  custom.allocation_granularity = 4096;
  custom.d2h.points = {{1, 0.5}, {3, 1.0 / 3}};
  EXPECT_EQ(parse_device_profile(write_device_profile(custom)), custom);
  custom.attention_tflops_bf16 = 180.5;
  custom.attention_backward_tflops_bf16 = 140.25;
  EXPECT_EQ(parse_device_profile(write_device_profile(custom)), custom);
}

TEST(DeviceProfile, AttentionRatesAreOptionalAndPositive) {
  DeviceProfile without = h200_profile();
  without.attention_tflops_bf16 = 0;
  without.attention_backward_tflops_bf16 = 0;
  const std::string text = write_device_profile(without);
  EXPECT_EQ(text.find("\"attention_tflops_bf16\""), std::string::npos);
  EXPECT_EQ(text.find("\"attention_backward_tflops_bf16\""), std::string::npos);
  EXPECT_EQ(parse_device_profile(text).attention_tflops_bf16, 0);
  std::string negative = text;
  negative.insert(negative.find("\"memory_gbs\""), "\"attention_tflops_bf16\": -3,\n  ");
  EXPECT_NE(parse_error(negative).find("field 'attention_tflops_bf16'"), std::string::npos);
}

TEST(DeviceProfile, ParseErrorsNameTheField) {
  EXPECT_NE(parse_error(h200_with("memory_gbs", "\"fast\"")).find("field 'memory_gbs'"),
            std::string::npos);
  EXPECT_NE(parse_error(h200_with("launch_us", "-1")).find("field 'launch_us'"),
            std::string::npos);
  EXPECT_NE(parse_error(h200_with("matmul_tflops_bf16", ""))
                .find("'matmul_tflops_bf16' is missing"),
            std::string::npos);
  EXPECT_NE(parse_error(h200_with("h2d", "[]")).find("field 'h2d'"), std::string::npos);
  const std::string unsorted =
      parse_error(h200_with("d2h", R"([{"bytes": 4096, "gbs": 10}, {"bytes": 1024, "gbs": 20}])"));
  EXPECT_NE(unsorted.find("field 'd2h[1].bytes'"), std::string::npos) << unsorted;
  const std::string zero_rate = parse_error(h200_with("d2h_duplex", R"([{"bytes": 1, "gbs": 0}])"));
  EXPECT_NE(zero_rate.find("field 'd2h_duplex[0].gbs'"), std::string::npos) << zero_rate;
  const std::string extra =
      parse_error(h200_with("h2d_duplex", R"([{"bytes": 1, "gbs": 1, "x": 2}])"));
  EXPECT_NE(extra.find("field 'h2d_duplex[0].x' is not a field"), std::string::npos) << extra;
  EXPECT_NE(parse_error(h200_with("name", "\"x\", \"colour\": 3")).find("field 'colour'"),
            std::string::npos);
  EXPECT_NE(parse_error(h200_with("version", "2")).find("field 'version'"), std::string::npos);
  const std::string syntax = parse_error("{\"format\": ");
  EXPECT_EQ(syntax.rfind("[sim] device profile: ", 0), 0u) << syntax;
}

TEST(DeviceProfile, LoadNamesAnUnreadableFile) {
  try {
    load_device_profile("/nonexistent/profile.json");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.component(), "sim");
    EXPECT_NE(std::string(e.what()).find("/nonexistent/profile.json"), std::string::npos);
  }
}

TEST(LinkCurve, InterpolatesInLogBytesAndHoldsBeyondTheEnds) {
  LinkCurve curve;
  curve.points = {{1 << 10, 10.0}, {1 << 20, 40.0}};
  EXPECT_DOUBLE_EQ(curve.gbs(1), 10.0);
  EXPECT_DOUBLE_EQ(curve.gbs(1 << 10), 10.0);
  EXPECT_DOUBLE_EQ(curve.gbs(1 << 15), 25.0);  // halfway in log(bytes)
  EXPECT_DOUBLE_EQ(curve.gbs(1 << 20), 40.0);
  EXPECT_DOUBLE_EQ(curve.gbs(std::int64_t{1} << 40), 40.0);
  EXPECT_THROW(LinkCurve{}.gbs(1), InvalidArgument);
}

TEST(RoundAllocation, RoundsUpToTheGranule) {
  const DeviceProfile& h200 = h200_profile();
  EXPECT_EQ(round_allocation(0, h200), 0);
  EXPECT_EQ(round_allocation(1, h200), 512);
  EXPECT_EQ(round_allocation(512, h200), 512);
  EXPECT_EQ(round_allocation(513, h200), 1024);
  EXPECT_EQ(round_allocation(3 * kMiB + 1, h200), 3 * kMiB + 512);
}

}  // namespace
}  // namespace spillway
