// memory_svg: live device memory over one simulated step as a self-contained
// SVG (no scripts, no external references): time in ms across, GiB up, the
// memory categories stacked in a fixed order and colour (writer_support.h),
// the peak marked, a dashed line where backward starts, the title on top.
//
// Note [Memory picture samples]
// Each timeline point holds from its node's start until the next point's
// start (the last one until the end of the step), so the areas are step
// functions of time. Nodes that take no time (views, waits, reloads) become
// vertical edges, which the outline stroke keeps visible. A timeline longer
// than kMaxSamples is thinned bucket by bucket, keeping each bucket's highest
// point (so the outline is the upper envelope) plus the first and last points
// and, always, the peak's own point: the picture's peak is the result's peak.

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "sim/memory_svg.h"
#include "sim/writer_support.h"
#include "spillway/sim.h"

namespace spillway {
namespace {

constexpr double kBytesPerGib = 1024.0 * 1024.0 * 1024.0;

// Page layout, in SVG user units (pixels).
constexpr double kWidth = 1100;
constexpr double kHeight = 600;
constexpr double kPlotLeft = 84;
constexpr double kPlotRight = 860;
constexpr double kPlotTop = 84;
constexpr double kPlotBottom = 536;
constexpr double kLegendLeft = 884;
constexpr double kBoldCharWidth = 7.6;  // of the 12 px bold peak label, at most, for placement

struct Sample {
  double ms = 0;
  std::array<std::int64_t, kMemoryCategoryCount> bytes{};
  std::int64_t total = 0;
};

// `value` with `decimals` digits after the point, independent of the locale.
std::string fixed(double value, int decimals) {
  char buffer[64];
  const auto [end, error] =
      std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::fixed, decimals);
  if (error != std::errc()) return "0";
  std::string text(buffer, end);
  if (text == "-0" || text.find_first_not_of("-0.") == std::string::npos) {
    text.erase(0, text[0] == '-' ? 1 : 0);  // no "-0.0"
  }
  return text;
}

std::string px(double value) { return fixed(value, 1); }

// "812.3 ms", "45.6 ms", "4.56 ms", "0.672 ms".
std::string ms_text(double ms) {
  const int decimals = ms >= 10 ? 1 : ms >= 1 ? 2 : 3;
  return fixed(ms, decimals) + " ms";
}

// Text for element content and attribute values. Characters XML 1.0 forbids
// (C0 controls other than tab, newline, return) become '?'.
std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default: {
        const auto byte = static_cast<unsigned char>(c);
        out += byte < 0x20 && c != '\t' && c != '\n' && c != '\r' ? '?' : c;
      }
    }
  }
  return out;
}

// "21.4 GiB", "24.0 MiB", "512 B".
std::string short_bytes(std::int64_t bytes) {
  const double value = static_cast<double>(bytes);
  if (value >= kBytesPerGib) return fixed(value / kBytesPerGib, 1) + " GiB";
  if (value >= 1024.0 * 1024.0) return fixed(value / (1024.0 * 1024.0), 1) + " MiB";
  if (value >= 1024.0) return fixed(value / 1024.0, 1) + " KiB";
  return std::to_string(bytes) + " B";
}

// A tick spacing of 1, 2 or 5 times a power of ten giving about `count` ticks.
double nice_step(double range, int count) {
  if (!(range > 0)) return 1;
  const double raw = range / count;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double normalised = raw / magnitude;
  const double factor = normalised < 1.5 ? 1 : normalised < 3 ? 2 : normalised < 7 ? 5 : 10;
  return factor * magnitude;
}

// Digits after the point that multiples of `step` need.
int decimals_for(double step) {
  for (int decimals = 0; decimals < 9; ++decimals) {
    const double scaled = step * std::pow(10.0, decimals);
    if (std::abs(scaled - std::round(scaled)) < 1e-6 * scaled) return decimals;
  }
  return 9;
}

std::vector<Sample> all_samples(const SimResult& result) {
  std::vector<Sample> samples;
  samples.reserve(result.timeline.size());
  for (const TimelinePoint& point : result.timeline) {
    Sample sample;
    sample.ms = point.start_ms;
    sample.bytes = sim::drawn_bytes(point);
    for (std::int64_t bytes : sample.bytes) sample.total += bytes;
    samples.push_back(sample);
  }
  return samples;
}

// The timeline point the picture marks as the peak: the result's peak node
// (first occurrence), or the highest point when the timeline lacks it.
std::size_t peak_index(const SimResult& result, const std::vector<Sample>& samples) {
  for (std::size_t i = 0; i < result.timeline.size(); ++i) {
    if (result.timeline[i].node == result.peak_node) return i;
  }
  std::size_t best = 0;
  for (std::size_t i = 1; i < samples.size(); ++i) {
    if (samples[i].total > samples[best].total) best = i;
  }
  return best;
}

// Note [Memory picture samples]: indices of the points drawn, ascending.
std::vector<std::size_t> kept_indices(const std::vector<Sample>& samples, std::size_t peak,
                                      std::size_t max_samples) {
  const std::size_t n = samples.size();
  std::vector<std::size_t> kept;
  if (n <= max_samples || max_samples < 3) {
    kept.resize(n);
    for (std::size_t i = 0; i < n; ++i) kept[i] = i;
    return kept;
  }
  const std::size_t inner = n - 2;  // points between the first and the last
  const std::size_t buckets = max_samples - 2;
  kept.push_back(0);
  for (std::size_t b = 0; b < buckets; ++b) {
    const std::size_t lo = 1 + b * inner / buckets;
    const std::size_t hi = 1 + (b + 1) * inner / buckets;
    if (lo >= hi) continue;
    std::size_t best = lo;
    if (peak >= lo && peak < hi) {
      best = peak;
    } else {
      for (std::size_t i = lo + 1; i < hi; ++i) {
        if (samples[i].total > samples[best].total) best = i;
      }
    }
    kept.push_back(best);
  }
  kept.push_back(n - 1);
  return kept;
}

// The unit of the vertical axis: GiB, or MiB when the peak is under 1 GiB
// (a small graph's GiB ticks would read 0.005, 0.010, ...).
struct ByteUnit {
  double bytes;
  std::string_view name;
};

ByteUnit unit_for(std::int64_t highest) {
  if (static_cast<double>(highest) >= kBytesPerGib) return {kBytesPerGib, "GiB"};
  return {1024.0 * 1024.0, "MiB"};
}

// Maps (ms, bytes) to the plot area, whose top is `top` units.
class Scale {
 public:
  Scale(double end_ms, ByteUnit unit, double top) : end_ms_(end_ms), unit_(unit), top_(top) {}
  double x(double ms) const { return kPlotLeft + ms / end_ms_ * (kPlotRight - kPlotLeft); }
  double y_units(double value) const {
    return kPlotBottom - value / top_ * (kPlotBottom - kPlotTop);
  }
  double y(std::int64_t bytes) const { return y_units(static_cast<double>(bytes) / unit_.bytes); }
  const ByteUnit& unit() const { return unit_; }
  double top() const { return top_; }

 private:
  double end_ms_;
  ByteUnit unit_;
  double top_;
};

// One category's band between the categories stacked below it and itself,
// as a closed step-function path (Note [Memory picture samples]).
std::string band_path(const std::vector<Sample>& samples, double end_ms, int category,
                      const Scale& scale) {
  const std::size_t n = samples.size();
  std::vector<std::int64_t> lower(n, 0);
  std::vector<std::int64_t> upper(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    for (int below = 0; below < category; ++below) lower[i] += samples[i].bytes[below];
    upper[i] = lower[i] + samples[i].bytes[category];
  }
  std::string d = "M" + px(scale.x(samples[0].ms)) + "," + px(scale.y(upper[0]));
  for (std::size_t i = 1; i < n; ++i) {
    d += "H" + px(scale.x(samples[i].ms)) + "V" + px(scale.y(upper[i]));
  }
  d += "H" + px(scale.x(end_ms)) + "V" + px(scale.y(lower[n - 1]));
  for (std::size_t i = n - 1; i > 0; --i) {
    d += "H" + px(scale.x(samples[i].ms)) + "V" + px(scale.y(lower[i - 1]));
  }
  d += "H" + px(scale.x(samples[0].ms)) + "Z";
  return d;
}

// The top edge of the stack (live bytes), drawn over the bands.
std::string outline_path(const std::vector<Sample>& samples, double end_ms, const Scale& scale) {
  std::string d = "M" + px(scale.x(samples[0].ms)) + "," + px(scale.y(samples[0].total));
  for (std::size_t i = 1; i < samples.size(); ++i) {
    d += "H" + px(scale.x(samples[i].ms)) + "V" + px(scale.y(samples[i].total));
  }
  return d + "H" + px(scale.x(end_ms));
}

void append_text(std::string& svg, double x, double y, std::string_view text,
                 std::string_view attributes = {}) {
  svg += "<text x=\"" + px(x) + "\" y=\"" + px(y) + "\"";
  if (!attributes.empty()) svg += " " + std::string(attributes);
  svg += ">" + xml_escape(text) + "</text>\n";
}

void append_line(std::string& svg, double x1, double y1, double x2, double y2,
                 std::string_view attributes) {
  svg += "<line x1=\"" + px(x1) + "\" y1=\"" + px(y1) + "\" x2=\"" + px(x2) + "\" y2=\"" +
         px(y2) + "\" " + std::string(attributes) + "/>\n";
}

// Horizontal grid lines at the GiB ticks, drawn under the bands.
void append_grid(std::string& svg, const Scale& scale) {
  svg += "<g class=\"grid\" stroke=\"#e4e4e4\">\n";
  const double step = nice_step(scale.top(), 6);
  for (int i = 1; i * step <= scale.top() * (1 + 1e-9); ++i) {
    const double y = scale.y_units(i * step);
    append_line(svg, kPlotLeft, y, kPlotRight, y, "stroke-width=\"1\"");
  }
  svg += "</g>\n";
}

void append_axes(std::string& svg, double end_ms, const Scale& scale) {
  svg += "<g class=\"axes\" font-size=\"12\" fill=\"#333\">\n";
  const double step = nice_step(scale.top(), 6);
  const int decimals = decimals_for(step);
  for (int i = 0;; ++i) {
    const double value = i * step;
    if (value > scale.top() * (1 + 1e-9)) break;
    const double y = scale.y_units(value);
    append_line(svg, kPlotLeft - 5, y, kPlotLeft, y, "stroke=\"#333\"");
    append_text(svg, kPlotLeft - 8, y + 4, fixed(value, decimals), "text-anchor=\"end\"");
  }
  const double ms_step = nice_step(end_ms, 8);
  const int ms_decimals = decimals_for(ms_step);
  for (int i = 0;; ++i) {
    const double ms = i * ms_step;
    if (ms > end_ms * (1 + 1e-9)) break;
    const double x = scale.x(ms);
    append_line(svg, x, kPlotBottom, x, kPlotBottom + 5, "stroke=\"#333\"");
    append_text(svg, x, kPlotBottom + 19, fixed(ms, ms_decimals), "text-anchor=\"middle\"");
  }
  append_line(svg, kPlotLeft, kPlotTop, kPlotLeft, kPlotBottom, "stroke=\"#333\"");
  append_line(svg, kPlotLeft, kPlotBottom, kPlotRight, kPlotBottom, "stroke=\"#333\"");
  append_text(svg, (kPlotLeft + kPlotRight) / 2, kPlotBottom + 42, "time (ms)",
              "text-anchor=\"middle\" font-size=\"13\"");
  const double mid_y = (kPlotTop + kPlotBottom) / 2;
  append_text(svg, 24, mid_y, "live device memory (" + std::string(scale.unit().name) + ")",
              "text-anchor=\"middle\" font-size=\"13\" transform=\"rotate(-90 24 " + px(mid_y) +
                  ")\"");
  svg += "</g>\n";
}

// The dashed line at the first backward node's start, with "forward" and
// "backward" written either side of it above the plot where they fit.
void append_phase_boundary(std::string& svg, const sim::NodeNames& names,
                           const SimResult& result, const Scale& scale) {
  const TimelinePoint* backward = sim::first_backward_point(names, result);
  if (backward == nullptr) return;
  constexpr double kWordWidth = 80;  // "<- forward", "backward ->" and a gap
  const double x = scale.x(backward->start_ms);
  svg += "<g class=\"phase-boundary\" font-size=\"12\" fill=\"#444\">\n";
  append_line(svg, x, kPlotTop - 12, x, kPlotBottom,
              "stroke=\"#444\" stroke-width=\"1.2\" stroke-dasharray=\"6 4\"");
  if (x - kWordWidth >= kPlotLeft - 20) {
    append_text(svg, x - 6, kPlotTop - 4, "\u2190 forward", "text-anchor=\"end\"");
  }
  if (x + kWordWidth <= kPlotRight + 20) append_text(svg, x + 6, kPlotTop - 4, "backward \u2192");
  svg += "</g>\n";
}

void append_peak(std::string& svg, const sim::NodeNames& names, const SimResult& result,
                 const Sample& peak, const Scale& scale) {
  const std::string label = "peak " + short_bytes(result.peak_bytes) + " at node " +
                            names.name(result.peak_node) + ", " +
                            std::string(to_string(result.peak_phase));
  const double x = scale.x(peak.ms);
  const double y = scale.y(peak.total);
  // Beside the dot, inside the plot: right of it when there is room, else
  // left of it, else against the plot's right edge.
  const double width = kBoldCharWidth * static_cast<double>(label.size());
  const bool fits_right = x + 9 + width <= kPlotRight;
  const double label_x = fits_right ? x + 9 : x - 9 - width >= kPlotLeft ? x - 9 : kPlotRight;
  svg += "<g class=\"peak\">\n";
  svg += "<circle cx=\"" + px(x) + "\" cy=\"" + px(y) +
         "\" r=\"4\" fill=\"#d62728\" stroke=\"white\" stroke-width=\"1\"/>\n";
  append_text(svg, label_x, y - 9, label,
              std::string("font-size=\"12\" font-weight=\"bold\" fill=\"#b01e1e\" ") +
                  "stroke=\"white\" stroke-width=\"3\" paint-order=\"stroke\" text-anchor=\"" +
                  (fits_right ? "start" : "end") + "\"");
  svg += "</g>\n";
}

void append_legend(std::string& svg) {
  svg += "<g class=\"legend\" font-size=\"12\" fill=\"#333\">\n";
  double y = kPlotTop + 4;
  for (auto it = sim::kCategoryStyles.rbegin(); it != sim::kCategoryStyles.rend(); ++it) {
    // Listed top to bottom as the bands stack, so the legend reads like the picture.
    svg += "<rect x=\"" + px(kLegendLeft) + "\" y=\"" + px(y) +
           "\" width=\"14\" height=\"14\" fill=\"" + std::string(it->colour) +
           "\" stroke=\"#555\" stroke-width=\"0.5\"/>\n";
    append_text(svg, kLegendLeft + 21, y + 11.5, it->label);
    y += 22;
  }
  y += 8;
  append_line(svg, kLegendLeft, y + 7, kLegendLeft + 14, y + 7,
              "stroke=\"#444\" stroke-width=\"1.2\" stroke-dasharray=\"4 3\"");
  append_text(svg, kLegendLeft + 21, y + 11.5, "first backward node");
  y += 22;
  svg += "<circle cx=\"" + px(kLegendLeft + 7) + "\" cy=\"" + px(y + 7) +
         "\" r=\"4.5\" fill=\"#d62728\"/>\n";
  append_text(svg, kLegendLeft + 21, y + 11.5, "peak");
  svg += "</g>\n";
}

}  // namespace

namespace sim {

std::size_t memory_svg_sample_count(const SimResult& result) {
  const std::vector<Sample> samples = all_samples(result);
  if (samples.empty()) return 0;
  return kept_indices(samples, peak_index(result, samples), kMaxSamples).size();
}

}  // namespace sim

std::string memory_svg(const Graph& graph, const SimResult& result, std::string_view title) {
  sim::require_timeline(result, "memory_svg");
  const std::vector<Sample> all = all_samples(result);
  const std::size_t peak_at = peak_index(result, all);
  std::vector<Sample> samples;
  std::size_t peak_sample = 0;
  for (std::size_t index : kept_indices(all, peak_at, sim::kMaxSamples)) {
    if (index == peak_at) peak_sample = samples.size();
    samples.push_back(all[index]);
  }

  const double end_ms = std::max(sim::drawn_end_ms(result), 1e-3);
  std::int64_t highest = result.peak_bytes;
  for (const Sample& sample : samples) highest = std::max(highest, sample.total);
  const ByteUnit unit = unit_for(highest);
  // Headroom above the peak for its label, then up to a whole tick.
  double top = highest > 0 ? static_cast<double>(highest) / unit.bytes * 1.12 : 1.0;
  const double step = nice_step(top, 6);
  top = std::ceil(top / step - 1e-9) * step;
  const Scale scale(end_ms, unit, top);

  std::string svg;
  svg += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + px(kWidth) + "\" height=\"" +
         px(kHeight) + "\" viewBox=\"0 0 " + px(kWidth) + " " + px(kHeight) +
         "\" font-family=\"Helvetica, Arial, sans-serif\">\n";
  svg += "<title>" + xml_escape(title) + "</title>\n";
  svg += "<rect x=\"0\" y=\"0\" width=\"" + px(kWidth) + "\" height=\"" + px(kHeight) +
         "\" fill=\"white\"/>\n";
  append_text(svg, kWidth / 2, 30, title,
              "text-anchor=\"middle\" font-size=\"18\" font-weight=\"bold\" fill=\"#111\"");
  append_text(svg, kWidth / 2, 52,
              "predicted step " + ms_text(result.step_ms) + ", peak " +
                  short_bytes(result.peak_bytes) + ", " + std::to_string(result.timeline.size()) +
                  " nodes",
              "text-anchor=\"middle\" font-size=\"12\" fill=\"#666\"");

  append_grid(svg, scale);
  svg += "<g class=\"bands\" stroke=\"none\">\n";
  for (const sim::CategoryStyle& style : sim::kCategoryStyles) {
    const int category = static_cast<int>(style.category);
    const bool present = std::any_of(samples.begin(), samples.end(), [&](const Sample& s) {
      return s.bytes[category] != 0;
    });
    if (!present) continue;
    svg += "<path class=\"" + std::string(to_string(style.category)) + "\" fill=\"" +
           std::string(style.colour) + "\" d=\"" + band_path(samples, end_ms, category, scale) +
           "\"/>\n";
  }
  svg += "</g>\n";
  svg += "<path class=\"outline\" fill=\"none\" stroke=\"#222\" stroke-width=\"0.7\" "
         "stroke-opacity=\"0.6\" d=\"" +
         outline_path(samples, end_ms, scale) + "\"/>\n";

  append_axes(svg, end_ms, scale);
  const sim::NodeNames names(graph);
  append_phase_boundary(svg, names, result, scale);
  append_peak(svg, names, result, samples[peak_sample], scale);
  append_legend(svg);
  svg += "</svg>\n";
  return svg;
}

}  // namespace spillway
