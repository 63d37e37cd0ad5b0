// Device profiles: the link curves, the JSON format (docs/device-profile.md)
// and the caching allocator's rounding.

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <string_view>

#include "ir/json_dom.h"
#include "sim/embedded_profiles.h"
#include "spillway/error.h"
#include "spillway/sim.h"

namespace spillway {
namespace {

using ir::Json;

constexpr std::string_view kFormatName = "spillway.device_profile";
constexpr int kFormatVersion = 1;

[[noreturn]] void fail(const std::string& field, std::string_view detail) {
  throw InvalidArgument("sim", "device profile: field '" + field + "'" + std::string(detail));
}

std::string describe(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
    case Json::value_t::number_float:
      return "the number " + j.dump();
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    default:
      return "an unsupported JSON value";
  }
}

std::string string_of(const Json& j, const std::string& field) {
  if (!j.is_string()) fail(field, ": expected a string, got " + describe(j));
  return j.get<std::string>();
}

// A finite number > 0 (or >= 0 when `allow_zero`).
double positive_number(const Json& j, const std::string& field, bool allow_zero = false) {
  if (!j.is_number()) fail(field, ": expected a number, got " + describe(j));
  const double value = j.get<double>();
  if (!std::isfinite(value) || value < 0 || (value == 0 && !allow_zero)) {
    fail(field, std::string(": expected a ") + (allow_zero ? "non-negative" : "positive") +
                    " number, got " + describe(j));
  }
  return value;
}

// An integer in [1, INT64_MAX] (or [0, ...] when `allow_zero`).
std::int64_t positive_int(const Json& j, const std::string& field, bool allow_zero = false) {
  std::int64_t value = 0;
  if (j.is_number_unsigned()) {
    const auto u = j.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      fail(field, ": " + j.dump() + " is out of the int64 range");
    }
    value = static_cast<std::int64_t>(u);
  } else if (j.is_number_integer()) {
    value = j.get<std::int64_t>();
  } else {
    fail(field, ": expected an integer, got " + describe(j));
  }
  if (value < 0 || (value == 0 && !allow_zero)) {
    fail(field, std::string(": expected a ") + (allow_zero ? "non-negative" : "positive") +
                    " integer, got " + j.dump());
  }
  return value;
}

LinkCurve curve_of(const Json& j, const std::string& field) {
  if (!j.is_array()) fail(field, ": expected an array of {bytes, gbs}, got " + describe(j));
  if (j.empty()) fail(field, ": needs at least one point");
  LinkCurve curve;
  curve.points.reserve(j.size());
  for (std::size_t i = 0; i < j.size(); ++i) {
    const std::string point = field + "[" + std::to_string(i) + "]";
    const Json& p = j[i];
    if (!p.is_object()) fail(point, ": expected an object {bytes, gbs}, got " + describe(p));
    std::int64_t bytes = 0;
    double gbs = 0;
    bool has_bytes = false;
    bool has_gbs = false;
    for (const auto& [key, value] : p.items()) {
      if (key == "bytes") {
        bytes = positive_int(value, point + ".bytes");
        has_bytes = true;
      } else if (key == "gbs") {
        gbs = positive_number(value, point + ".gbs");
        has_gbs = true;
      } else {
        fail(point + "." + key, " is not a field of a link point");
      }
    }
    if (!has_bytes) fail(point + ".bytes", " is missing");
    if (!has_gbs) fail(point + ".gbs", " is missing");
    if (!curve.points.empty() && bytes <= curve.points.back().first) {
      fail(point + ".bytes", ": points must be sorted by strictly increasing bytes, got " +
                                 std::to_string(bytes) + " after " +
                                 std::to_string(curve.points.back().first));
    }
    curve.points.emplace_back(bytes, gbs);
  }
  return curve;
}

Json curve_json(const LinkCurve& curve) {
  Json out = Json::array();
  for (const auto& [bytes, gbs] : curve.points) {
    Json point = Json::object();
    point["bytes"] = bytes;
    point["gbs"] = gbs;
    out.push_back(std::move(point));
  }
  return out;
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

std::string read_text_file(const std::string& path) {
  std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "rb"));
  if (!file) throw Error("sim", "cannot read '" + path + "': " + std::strerror(errno));
  std::string data;
  char buffer[1 << 14];
  for (;;) {
    const std::size_t n = std::fread(buffer, 1, sizeof buffer, file.get());
    data.append(buffer, n);
    if (n < sizeof buffer) break;
  }
  if (std::ferror(file.get())) {
    throw Error("sim", "cannot read '" + path + "': " + std::strerror(errno));
  }
  return data;
}

}  // namespace

double LinkCurve::gbs(std::int64_t bytes) const {
  if (points.empty()) throw InvalidArgument("sim", "link curve has no points");
  if (bytes <= points.front().first) return points.front().second;
  if (bytes >= points.back().first) return points.back().second;
  std::size_t hi = 1;
  while (points[hi].first < bytes) ++hi;  // few points: a linear walk is fastest
  const auto& [x0, y0] = points[hi - 1];
  const auto& [x1, y1] = points[hi];
  const double t = std::log(static_cast<double>(bytes) / static_cast<double>(x0)) /
                   std::log(static_cast<double>(x1) / static_cast<double>(x0));
  return y0 + t * (y1 - y0);
}

DeviceProfile parse_device_profile(std::string_view json_text) {
  Json root;
  try {
    root = ir::parse_json(json_text);
  } catch (const InvalidGraph& e) {
    // parse_json speaks for graphs ("[graph] not valid JSON: ..."); keep its detail.
    std::string_view detail = e.what();
    if (detail.starts_with("[graph] ")) detail.remove_prefix(8);
    throw InvalidArgument("sim", "device profile: " + std::string(detail));
  }
  if (!root.is_object()) {
    throw InvalidArgument("sim", "device profile: expected a JSON object at the top level, got " +
                                     describe(root));
  }
  auto format = root.find("format");
  if (format == root.end()) fail("format", " is missing");
  if (string_of(*format, "format") != kFormatName) {
    fail("format", ": expected '" + std::string(kFormatName) + "', got '" +
                       format->get<std::string>() + "'");
  }
  auto version = root.find("version");
  if (version == root.end()) fail("version", " is missing");
  if (positive_int(*version, "version") != kFormatVersion) {
    fail("version", ": expected " + std::to_string(kFormatVersion) + ", got " + version->dump());
  }

  DeviceProfile profile;
  // Every field but allocation_granularity is required.
  enum Field { kName, kSource, kMemory, kBf16, kFp32, kMemoryGbs, kLaunch, kD2H, kH2D,
               kD2HDuplex, kH2DDuplex, kFieldCount };
  static constexpr std::string_view kNames[kFieldCount] = {
      "name", "source", "memory_bytes", "matmul_tflops_bf16", "matmul_tflops_fp32",
      "memory_gbs", "launch_us", "d2h", "h2d", "d2h_duplex", "h2d_duplex"};
  bool seen[kFieldCount] = {};
  for (const auto& [key, value] : root.items()) {
    int field = kFieldCount;
    for (int f = 0; f < kFieldCount; ++f) {
      if (key == kNames[f]) field = f;
    }
    if (field < kFieldCount) seen[field] = true;
    switch (field) {
      case kName: profile.name = string_of(value, key); break;
      case kSource: profile.source = string_of(value, key); break;
      case kMemory: profile.memory_bytes = positive_int(value, key, /*allow_zero=*/true); break;
      case kBf16: profile.matmul_tflops_bf16 = positive_number(value, key); break;
      case kFp32: profile.matmul_tflops_fp32 = positive_number(value, key); break;
      case kMemoryGbs: profile.memory_gbs = positive_number(value, key); break;
      case kLaunch: profile.launch_us = positive_number(value, key, /*allow_zero=*/true); break;
      case kD2H: profile.d2h = curve_of(value, key); break;
      case kH2D: profile.h2d = curve_of(value, key); break;
      case kD2HDuplex: profile.d2h_duplex = curve_of(value, key); break;
      case kH2DDuplex: profile.h2d_duplex = curve_of(value, key); break;
      default:
        if (key == "format" || key == "version") break;
        if (key == "allocation_granularity") {
          profile.allocation_granularity = positive_int(value, key);
          break;
        }
        if (key == "attention_tflops_bf16") {
          profile.attention_tflops_bf16 = positive_number(value, key);
          break;
        }
        if (key == "attention_backward_tflops_bf16") {
          profile.attention_backward_tflops_bf16 = positive_number(value, key);
          break;
        }
        fail(key, " is not a field of a device profile");
    }
  }
  for (int f = 0; f < kFieldCount; ++f) {
    if (!seen[f]) fail(std::string(kNames[f]), " is missing");
  }
  return profile;
}

DeviceProfile load_device_profile(const std::string& path) {
  const std::string text = read_text_file(path);
  try {
    return parse_device_profile(text);
  } catch (const InvalidArgument& e) {
    std::string_view detail = e.what();
    if (detail.starts_with("[sim] ")) detail.remove_prefix(6);
    throw InvalidArgument("sim", "'" + path + "': " + std::string(detail));
  }
}

std::string write_device_profile(const DeviceProfile& profile) {
  Json out = Json::object();
  out["format"] = kFormatName;
  out["version"] = kFormatVersion;
  out["name"] = profile.name;
  out["source"] = profile.source;
  out["memory_bytes"] = profile.memory_bytes;
  out["matmul_tflops_bf16"] = profile.matmul_tflops_bf16;
  out["matmul_tflops_fp32"] = profile.matmul_tflops_fp32;
  if (profile.attention_tflops_bf16 > 0) {
    out["attention_tflops_bf16"] = profile.attention_tflops_bf16;
  }
  if (profile.attention_backward_tflops_bf16 > 0) {
    out["attention_backward_tflops_bf16"] = profile.attention_backward_tflops_bf16;
  }
  out["memory_gbs"] = profile.memory_gbs;
  out["launch_us"] = profile.launch_us;
  out["allocation_granularity"] = profile.allocation_granularity;
  out["d2h"] = curve_json(profile.d2h);
  out["h2d"] = curve_json(profile.h2d);
  out["d2h_duplex"] = curve_json(profile.d2h_duplex);
  out["h2d_duplex"] = curve_json(profile.h2d_duplex);
  return out.dump(2) + "\n";
}

const DeviceProfile& h200_profile() {
  static const DeviceProfile profile = parse_device_profile(sim::nvidia_h200_profile_json());
  return profile;
}

std::int64_t round_allocation(std::int64_t bytes, const DeviceProfile& profile) {
  if (bytes <= 0) return 0;
  const std::int64_t granule =
      profile.allocation_granularity > 0 ? profile.allocation_granularity : 1;
  return (bytes + granule - 1) / granule * granule;
}

}  // namespace spillway
