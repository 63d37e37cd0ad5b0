// The result writers on hand-built results (no simulate()): the Chrome trace
// parses as JSON with the tracks, slices and counters a user opens it for,
// and the SVG is well formed and marks the peak the result reports.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ir/json_dom.h"
#include "sim/memory_svg.h"
#include "spillway/error.h"
#include "spillway/graph.h"
#include "spillway/sim.h"

namespace spillway {
namespace {

using ir::Json;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr std::int64_t kMiB = 1024 * 1024;
constexpr std::int64_t kGiB = 1024 * kMiB;

Node make_node(NodeId id, std::string name, Phase phase, std::string target = "aten.mm.default") {
  Node node;
  node.id = id;
  node.name = std::move(name);
  node.phase = phase;
  node.target = std::move(target);
  return node;
}

// A forward mm whose output moves to the host and back for its backward
// reader. Node 2's name needs escaping in both formats.
Graph small_graph() {
  Graph graph;
  graph.name = "writers test graph";
  graph.nodes = {
      make_node(0, "x", Phase::kForward, "x"),
      make_node(1, "mm_1", Phase::kForward),
      make_node(2, "spillway_offload \"mm_1\" <&>\\\n\x01", Phase::kForward,
                "spillway.offload.default"),
      make_node(3, "relu_2", Phase::kForward, "aten.relu.default"),
      make_node(4, "grad_relu", Phase::kBackward, "aten.threshold_backward.default"),
      make_node(5, "spillway_reload_mm_1", Phase::kBackward, "spillway.reload.default"),
      make_node(6, "grad_mm", Phase::kBackward),
  };
  graph.nodes[0].kind = NodeKind::kPlaceholder;
  return graph;
}

TimelinePoint point(NodeId node, double start, double end,
                    std::array<std::int64_t, kMemoryCategoryCount> by_category) {
  TimelinePoint p;
  p.node = node;
  p.start_ms = start;
  p.end_ms = end;
  p.by_category = by_category;
  for (std::int64_t bytes : by_category) p.live_bytes += bytes;
  return p;
}

// Consistent with small_graph(): the peak is grad_mm's, 1.75 GiB, in backward.
SimResult small_result() {
  SimResult result;
  const std::int64_t half = kGiB / 2;
  const std::int64_t quarter = kGiB / 4;
  result.timeline = {
      point(0, 0.0, 0.0, {kGiB, 0, 0, 0, 0, 0}),
      point(1, 0.0, 2.0, {kGiB, half, 0, 0, 0, 0}),
      point(2, 2.0, 2.0, {kGiB, 0, 0, half, 0, 0}),
      point(3, 2.0, 3.25, {kGiB, 0, quarter, half, 0, 0}),
      point(4, 3.25, 5.0, {kGiB, 0, quarter, 0, 0, 0}),
      point(5, 5.0, 5.0, {kGiB, 0, quarter, 0, half, 0}),
      point(6, 5.0, 8.5, {kGiB, 0, quarter, 0, half, 0}),
  };
  result.intervals = {
      {Stream::kCompute, 1, 0.0, 2.0, 0},
      {Stream::kD2H, 2, 2.0, 4.125, half},
      {Stream::kCompute, 3, 2.0, 3.25, 0},
      {Stream::kCompute, 4, 3.25, 5.0, 0},
      {Stream::kH2D, 5, 4.5, 6.0, half},
      {Stream::kCompute, 6, 6.0, 8.5, 0},
  };
  result.step_ms = 8.5;
  result.peak_bytes = kGiB + quarter + half;
  result.peak_node = 5;
  result.peak_phase = Phase::kBackward;
  result.peak_time_ms = 5.0;
  result.peak_by_category = result.timeline[5].by_category;
  result.bytes_d2h = half;
  result.bytes_h2d = half;
  return result;
}

std::vector<Json> events_with_phase(const Json& trace, const std::string& ph) {
  std::vector<Json> events;
  for (const Json& event : trace.at("traceEvents")) {
    if (event.at("ph") == ph) events.push_back(event);
  }
  return events;
}

// tid of each stream's track, by its thread_name.
std::map<std::string, std::int64_t> thread_ids(const Json& trace) {
  std::map<std::string, std::int64_t> ids;
  for (const Json& event : events_with_phase(trace, "M")) {
    if (event.at("name") == "thread_name") {
      ids[event.at("args").at("name").get<std::string>()] = event.at("tid").get<std::int64_t>();
    }
  }
  return ids;
}

TEST(ChromeTrace, ParsesAsJsonWithOneProcessAndAThreadPerStream) {
  const Json trace = ir::parse_json(chrome_trace(small_graph(), small_result()));
  EXPECT_EQ(trace.at("displayTimeUnit"), "ms");
  ASSERT_TRUE(trace.at("traceEvents").is_array());
  std::set<std::int64_t> pids;
  for (const Json& event : trace.at("traceEvents")) pids.insert(event.at("pid").get<std::int64_t>());
  EXPECT_EQ(pids.size(), 1u);

  std::vector<std::string> process_names;
  for (const Json& event : events_with_phase(trace, "M")) {
    if (event.at("name") == "process_name") {
      process_names.push_back(event.at("args").at("name").get<std::string>());
    }
  }
  EXPECT_THAT(process_names, ::testing::ElementsAre("spillway simulation"));
  const std::map<std::string, std::int64_t> ids = thread_ids(trace);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_TRUE(ids.count("compute") && ids.count("D2H") && ids.count("H2D"));
  EXPECT_EQ(std::set<std::int64_t>({ids.at("compute"), ids.at("D2H"), ids.at("H2D")}).size(), 3u);
}

TEST(ChromeTrace, OneCompleteEventPerIntervalInMicroseconds) {
  const Graph graph = small_graph();
  const SimResult result = small_result();
  const Json trace = ir::parse_json(chrome_trace(graph, result));
  const std::map<std::string, std::int64_t> ids = thread_ids(trace);
  const std::map<Stream, std::int64_t> tid_of = {
      {Stream::kCompute, ids.at("compute")},
      {Stream::kD2H, ids.at("D2H")},
      {Stream::kH2D, ids.at("H2D")}};

  const std::vector<Json> slices = events_with_phase(trace, "X");
  ASSERT_EQ(slices.size(), result.intervals.size());
  for (std::size_t i = 0; i < slices.size(); ++i) {
    const StreamInterval& interval = result.intervals[i];
    const Json& slice = slices[i];
    SCOPED_TRACE(slice.dump());
    EXPECT_EQ(slice.at("name"), graph.nodes[static_cast<std::size_t>(interval.node)].name);
    EXPECT_EQ(slice.at("tid").get<std::int64_t>(), tid_of.at(interval.stream));
    EXPECT_NEAR(slice.at("ts").get<double>(), interval.start_ms * 1000.0, 1e-6);
    EXPECT_NEAR(slice.at("dur").get<double>(), (interval.end_ms - interval.start_ms) * 1000.0,
                1e-6);
    EXPECT_EQ(slice.at("args").at("node").get<NodeId>(), interval.node);
    if (interval.stream == Stream::kCompute) {
      EXPECT_FALSE(slice.at("args").contains("bytes"));
    } else {
      EXPECT_EQ(slice.at("args").at("bytes").get<std::int64_t>(), interval.bytes);
    }
  }
  // The D2H slice: 0.5 GiB in 2.125 ms, starting at 2 ms.
  EXPECT_EQ(slices[1].at("ts").get<double>(), 2000.0);
  EXPECT_EQ(slices[1].at("dur").get<double>(), 2125.0);
}

// Execution model (12): where the simulation modelled the host, its issuing
// intervals get a track of their own, without bytes; without, no such track.
TEST(ChromeTrace, TheHostGetsATrackWhereTheSimulationModelledIt) {
  const Graph graph = small_graph();
  SimResult result = small_result();
  result.intervals.push_back({Stream::kHost, 1, 0.0, 0.5, 0});
  result.intervals.push_back({Stream::kHost, 3, 0.5, 2.5, 0});
  const Json trace = ir::parse_json(chrome_trace(graph, result));
  const std::map<std::string, std::int64_t> ids = thread_ids(trace);
  ASSERT_EQ(ids.size(), 4u);
  ASSERT_TRUE(ids.count("host (issuing)"));
  int host_slices = 0;
  for (const Json& slice : events_with_phase(trace, "X")) {
    if (slice.at("tid").get<std::int64_t>() != ids.at("host (issuing)")) continue;
    ++host_slices;
    EXPECT_EQ(slice.at("cat"), "host");
    EXPECT_FALSE(slice.at("args").contains("bytes"));
  }
  EXPECT_EQ(host_slices, 2);
  EXPECT_EQ(thread_ids(ir::parse_json(chrome_trace(graph, small_result()))).size(), 3u);
}

TEST(ChromeTrace, CounterSamplesEveryCategoryAtEachNodeStartAndAtTheEnd) {
  const SimResult result = small_result();
  const Json trace = ir::parse_json(chrome_trace(small_graph(), result));
  std::vector<Json> by_category;
  std::vector<Json> totals;
  for (const Json& counter : events_with_phase(trace, "C")) {
    (counter.at("name") == "live device bytes" ? totals : by_category).push_back(counter);
  }
  ASSERT_EQ(by_category.size(), result.timeline.size() + 1);
  ASSERT_EQ(totals.size(), result.timeline.size() + 1);
  const std::vector<std::string> keys = {"inputs",    "activations", "temporaries",
                                         "in_flight", "reloads",     "recomputed"};
  for (std::size_t i = 0; i < by_category.size(); ++i) {
    const TimelinePoint& point = result.timeline[std::min(i, result.timeline.size() - 1)];
    const double expected_us = i < result.timeline.size() ? point.start_ms * 1000.0 : 8500.0;
    EXPECT_NEAR(by_category[i].at("ts").get<double>(), expected_us, 1e-6) << i;
    EXPECT_NEAR(totals[i].at("ts").get<double>(), expected_us, 1e-6) << i;
    const Json& args = by_category[i].at("args");
    ASSERT_EQ(args.size(), keys.size());
    for (std::size_t c = 0; c < keys.size(); ++c) {
      EXPECT_EQ(args.at(keys[c]).get<std::int64_t>(), point.by_category[c]) << keys[c] << " " << i;
    }
    EXPECT_EQ(totals[i].at("args").at("bytes").get<std::int64_t>(), point.live_bytes);
  }
  // The peak sample is grad_mm's reload point.
  EXPECT_EQ(by_category[5].at("args").at("reloads").get<std::int64_t>(), kGiB / 2);
}

TEST(ChromeTrace, NodeNamesAreEscapedAndRoundTrip) {
  const Graph graph = small_graph();
  const std::string text = chrome_trace(graph, small_result());
  const Json trace = ir::parse_json(text);
  bool found = false;
  for (const Json& slice : events_with_phase(trace, "X")) {
    found = found || slice.at("name") == graph.nodes[2].name;
  }
  EXPECT_TRUE(found);
  EXPECT_EQ(text.find('\n'), std::string::npos);  // the newline in the name is escaped
}

TEST(ChromeTrace, ANodeTheGraphLacksIsNamedById) {
  SimResult result = small_result();
  result.intervals[0].node = 42;
  const Json trace = ir::parse_json(chrome_trace(small_graph(), result));
  EXPECT_EQ(events_with_phase(trace, "X").at(0).at("name"), "#42");
}

// Checks that every element the SVG opens is closed in order, and that
// markup characters in text and attributes are escaped.
::testing::AssertionResult well_formed(const std::string& svg) {
  std::vector<std::string> open;
  std::size_t at = 0;
  while (true) {
    const std::size_t lt = svg.find('<', at);
    const std::string text = svg.substr(at, lt == std::string::npos ? std::string::npos : lt - at);
    for (std::size_t amp = text.find('&'); amp != std::string::npos;
         amp = text.find('&', amp + 1)) {
      bool entity = false;
      for (const char* name : {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"}) {
        entity = entity || text.compare(amp, std::string(name).size(), name) == 0;
      }
      if (!entity) return ::testing::AssertionFailure() << "raw '&' in text: " << text;
    }
    if (lt == std::string::npos) break;
    const std::size_t gt = svg.find('>', lt);
    if (gt == std::string::npos) return ::testing::AssertionFailure() << "unclosed '<' at " << lt;
    const std::string tag = svg.substr(lt + 1, gt - lt - 1);
    if (tag.find('<') != std::string::npos) {
      return ::testing::AssertionFailure() << "'<' inside a tag: " << tag;
    }
    if (std::count(tag.begin(), tag.end(), '"') % 2 != 0) {
      return ::testing::AssertionFailure() << "unbalanced quotes: " << tag;
    }
    if (tag.starts_with("/")) {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name) {
        return ::testing::AssertionFailure()
               << "</" << name << "> closes " << (open.empty() ? "nothing" : open.back());
      }
      open.pop_back();
    } else if (!tag.ends_with("/")) {
      open.push_back(tag.substr(0, tag.find_first_of(" \n")));
    }
    at = gt + 1;
  }
  if (!open.empty()) return ::testing::AssertionFailure() << "<" << open.back() << "> not closed";
  return ::testing::AssertionSuccess();
}

// The numbers of every coordinate pair and H/V command of the path whose
// class is `name`, as (command, value).
std::vector<std::pair<char, double>> path_commands(const std::string& svg, const std::string& name) {
  const std::string marker = "class=\"" + name + "\"";
  const std::size_t element = svg.find(marker);
  if (element == std::string::npos) return {};
  const std::size_t d = svg.find(" d=\"", element) + 4;
  const std::string path = svg.substr(d, svg.find('"', d) - d);
  std::vector<std::pair<char, double>> commands;
  char command = 'M';
  std::size_t i = 0;
  while (i < path.size()) {
    if (std::isalpha(static_cast<unsigned char>(path[i]))) {
      command = path[i++];
      continue;
    }
    if (path[i] == ',') {
      command = 'y';  // the y of an M
      ++i;
      continue;
    }
    std::size_t used = 0;
    commands.emplace_back(command, std::stod(path.substr(i), &used));
    i += used;
  }
  return commands;
}

double attribute(const std::string& element, const std::string& name) {
  const std::size_t at = element.find(" " + name + "=\"") + name.size() + 3;
  return std::stod(element.substr(at));
}

TEST(MemorySvg, IsWellFormedWithTitlePeakLabelAndPhaseBoundary) {
  const std::string svg = memory_svg(small_graph(), small_result(), "Small graph: a < b & c");
  EXPECT_THAT(svg, StartsWith("<svg "));
  EXPECT_THAT(svg, HasSubstr("xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_TRUE(well_formed(svg));
  EXPECT_THAT(svg, HasSubstr(">Small graph: a &lt; b &amp; c</text>"));
  EXPECT_THAT(svg, HasSubstr(">peak 1.8 GiB at node spillway_reload_mm_1, backward</text>"));
  EXPECT_THAT(svg, HasSubstr("stroke-dasharray"));
  EXPECT_THAT(svg, HasSubstr(">backward \u2192</text>"));
  EXPECT_EQ(svg.find("<script"), std::string::npos);
  EXPECT_EQ(svg.find("href"), std::string::npos);
  // Every category the result uses has its band; the legend lists all six.
  for (const char* key : {"inputs", "activations", "temporaries", "in_flight", "reloads"}) {
    EXPECT_THAT(svg, HasSubstr("<path class=\"" + std::string(key) + "\"")) << key;
  }
  EXPECT_EQ(svg.find("<path class=\"recomputed\""), std::string::npos);
  for (const char* label : {"inputs and weights", "kept activations", "temporaries",
                            "in-flight copies", "reloads", "recomputed"}) {
    EXPECT_THAT(svg, HasSubstr(">" + std::string(label) + "</text>")) << label;
  }
  EXPECT_THAT(svg, HasSubstr(">time (ms)</text>"));
  EXPECT_THAT(svg, HasSubstr(">live device memory (GiB)</text>"));
}

TEST(MemorySvg, ThePeakDotSitsOnTheHighestPointOfTheOutline) {
  const std::string svg = memory_svg(small_graph(), small_result(), "t");
  double top = std::numeric_limits<double>::infinity();
  for (const auto& [command, value] : path_commands(svg, "outline")) {
    if (command == 'V' || command == 'y') top = std::min(top, value);
  }
  const std::size_t peak = svg.find("<g class=\"peak\">");
  ASSERT_NE(peak, std::string::npos);
  const std::string circle = svg.substr(svg.find("<circle", peak), 200);
  EXPECT_DOUBLE_EQ(attribute(circle, "cy"), top);
}

// A long timeline: a sawtooth with one spike, thinned to at most kMaxSamples
// points; the spike is drawn at its exact height and labelled.
TEST(MemorySvg, DownsamplingALongTimelineKeepsThePeak) {
  constexpr int kPoints = 20011;
  constexpr int kSpike = 12345;
  Graph graph;
  graph.name = "long";
  SimResult result;
  for (int i = 0; i < kPoints; ++i) {
    graph.nodes.push_back(make_node(i, "n" + std::to_string(i),
                                    i < kPoints / 2 ? Phase::kForward : Phase::kBackward));
    const std::int64_t saw = (i % 97) * 16 * kMiB;
    const std::int64_t spike = i == kSpike ? 3 * kGiB + 123 * kMiB : 0;
    result.timeline.push_back(point(i, i * 0.1, i * 0.1 + 0.1, {2 * kGiB, saw, 0, 0, 0, spike}));
  }
  result.step_ms = kPoints * 0.1;
  result.peak_node = kSpike;
  result.peak_phase = Phase::kBackward;
  result.peak_time_ms = kSpike * 0.1;
  result.peak_bytes = result.timeline[kSpike].live_bytes;

  EXPECT_LE(sim::memory_svg_sample_count(result), sim::kMaxSamples);
  EXPECT_GE(sim::memory_svg_sample_count(result), sim::kMaxSamples - 1);
  const std::string svg = memory_svg(graph, result, "long timeline");
  EXPECT_TRUE(well_formed(svg));
  const std::size_t outline_steps = path_commands(svg, "outline").size();
  EXPECT_LE(outline_steps, 2 * sim::kMaxSamples + 2);
  // 2 GiB + 416 MiB of sawtooth (26 * 16 MiB: 12345 % 97 == 26) + 3 GiB + 123 MiB.
  EXPECT_THAT(svg, HasSubstr(">peak 5.5 GiB at node n12345, backward</text>"));

  double top = std::numeric_limits<double>::infinity();
  for (const auto& [command, value] : path_commands(svg, "outline")) {
    if (command == 'V' || command == 'y') top = std::min(top, value);
  }
  const std::string circle = svg.substr(svg.find("<circle", svg.find("<g class=\"peak\">")), 200);
  EXPECT_DOUBLE_EQ(attribute(circle, "cy"), top);
  // At x = 84 + 1234.5 / 2001.1 * 776 (the plot's left edge and width).
  EXPECT_NEAR(attribute(circle, "cx"), 84 + 1234.5 / 2001.1 * 776, 0.06);
}

// Exported graphs list the tangents among the first placeholders, in phase
// backward: backward starts at the first backward node that computes.
TEST(Writers, BackwardStartsAtTheFirstBackwardNodeThatComputes) {
  Graph graph = small_graph();
  graph.nodes[0].phase = Phase::kBackward;  // x plays tangents_1
  const SimResult result = small_result();
  const Json trace = ir::parse_json(chrome_trace(graph, result));
  std::vector<Json> starts;
  for (const Json& event : events_with_phase(trace, "i")) {
    if (event.at("name") == "backward starts") starts.push_back(event);
  }
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0].at("ts").get<double>(), 3250.0);
  EXPECT_EQ(starts[0].at("args").at("node"), "grad_relu");

  const std::string svg = memory_svg(graph, result, "t");
  const std::size_t group = svg.find("<g class=\"phase-boundary\"");
  ASSERT_NE(group, std::string::npos);
  const std::string line = svg.substr(svg.find("<line", group), 200);
  // grad_relu starts at 3.25 ms of 8.5: x = 84 + 3.25 / 8.5 * 776.
  EXPECT_NEAR(attribute(line, "x1"), 84 + 3.25 / 8.5 * 776, 0.06);
}

TEST(MemorySvg, AShortTimelineIsDrawnWhole) {
  EXPECT_EQ(sim::memory_svg_sample_count(small_result()), small_result().timeline.size());
}

TEST(Writers, AResultWithoutTimelineIsRefusedClearly) {
  SimResult totals_only = small_result();
  totals_only.timeline.clear();
  totals_only.intervals.clear();
  for (const std::string writer : {"chrome_trace", "memory_svg"}) {
    try {
      if (writer == "chrome_trace") {
        chrome_trace(small_graph(), totals_only);
      } else {
        memory_svg(small_graph(), totals_only, "t");
      }
      ADD_FAILURE() << writer << " accepted a result without timeline";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), StartsWith("[sim] " + writer +
                                       " needs a result simulated with record_timeline"));
    }
  }
}

}  // namespace
}  // namespace spillway
