// chrome_trace: a SimResult as Chrome trace-event JSON, the format that
// Perfetto (ui.perfetto.dev) and chrome://tracing load:
//
//   {"traceEvents": [...], "displayTimeUnit": "ms"}
//
// One process ("spillway simulation") with one thread per stream (and one for
// the host where the simulation modelled it), a complete ("X") event per
// stream interval, and counter ("C") events of live device
// bytes: one per timeline point at the node's start, and a final one at the
// end of the step. Timestamps and durations are microseconds, as the format
// wants. nlohmann's writer escapes every string (and replaces invalid UTF-8).

#include <algorithm>
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "sim/writer_support.h"
#include "spillway/sim.h"

namespace spillway {
namespace {

using Json = nlohmann::ordered_json;

constexpr int kPid = 1;
constexpr const char* kProcessName = "spillway simulation";
constexpr const char* kByCategoryCounter = "live device bytes by category";
constexpr const char* kTotalCounter = "live device bytes";

// Thread ids: the order the tracks are shown in.
int thread_id(Stream stream) {
  switch (stream) {
    case Stream::kCompute:
      return 1;
    case Stream::kD2H:
      return 2;
    case Stream::kH2D:
      return 3;
    case Stream::kHost:
      return 4;
  }
  return 1;
}

const char* thread_name(Stream stream) {
  switch (stream) {
    case Stream::kCompute:
      return "compute";
    case Stream::kD2H:
      return "D2H";
    case Stream::kH2D:
      return "H2D";
    case Stream::kHost:
      return "host (issuing)";
  }
  return "compute";
}

const char* event_category(Stream stream) {
  switch (stream) {
    case Stream::kCompute:
      return "compute";
    case Stream::kD2H:
      return "copy_d2h";
    case Stream::kH2D:
      return "copy_h2d";
    case Stream::kHost:
      return "host";
  }
  return "compute";
}

// Milliseconds -> microseconds, kept to the nanosecond so the text stays short.
double to_us(double ms) { return std::round(ms * 1e6) / 1e3; }

Json metadata_event(const char* name, int tid, Json args) {
  return Json{{"name", name}, {"ph", "M"}, {"pid", kPid}, {"tid", tid}, {"args", std::move(args)}};
}

Json interval_event(const StreamInterval& interval, const sim::NodeNames& names) {
  Json args = Json::object();
  args["node"] = interval.node;
  if (const Node* node = names.find(interval.node)) {
    args["target"] = node->target;
    args["phase"] = std::string(to_string(node->phase));
    if (!node->module_stack.empty()) args["module"] = node->module_stack.back();
  }
  if (interval.stream == Stream::kD2H || interval.stream == Stream::kH2D) {
    args["bytes"] = interval.bytes;
    const double seconds = (interval.end_ms - interval.start_ms) / 1e3;
    if (seconds > 0) args["GB/s"] = static_cast<double>(interval.bytes) / 1e9 / seconds;
  }
  return Json{{"name", names.name(interval.node)},
              {"cat", event_category(interval.stream)},
              {"ph", "X"},
              {"pid", kPid},
              {"tid", thread_id(interval.stream)},
              {"ts", to_us(interval.start_ms)},
              {"dur", to_us(interval.end_ms) - to_us(interval.start_ms)},
              {"args", std::move(args)}};
}

// Two counter samples at `ms`: the bytes of each category (one stacked track
// in chrome://tracing, one track per category in Perfetto) and their total.
void append_memory_samples(Json& events, double ms, const TimelinePoint& point) {
  Json by_category = Json::object();
  std::int64_t total = 0;
  const auto drawn = sim::drawn_bytes(point);
  for (const sim::CategoryStyle& style : sim::kCategoryStyles) {
    const std::int64_t bytes = drawn[static_cast<int>(style.category)];
    by_category[std::string(to_string(style.category))] = bytes;
    total += bytes;
  }
  events.push_back(Json{{"name", kByCategoryCounter},
                        {"ph", "C"},
                        {"pid", kPid},
                        {"ts", to_us(ms)},
                        {"args", std::move(by_category)}});
  events.push_back(Json{{"name", kTotalCounter},
                        {"ph", "C"},
                        {"pid", kPid},
                        {"ts", to_us(ms)},
                        {"args", Json{{"bytes", total}}}});
}

// A global instant event (a vertical line across every track).
Json instant_event(const std::string& name, double ms, Json args) {
  return Json{{"name", name},      {"ph", "i"},         {"s", "g"},
              {"pid", kPid},       {"tid", thread_id(Stream::kCompute)},
              {"ts", to_us(ms)},   {"args", std::move(args)}};
}

}  // namespace

std::string chrome_trace(const Graph& graph, const SimResult& result) {
  sim::require_timeline(result, "chrome_trace");
  const sim::NodeNames names(graph);

  Json events = Json::array();
  events.push_back(metadata_event("process_name", 0, Json{{"name", kProcessName}}));
  const bool host = std::any_of(result.intervals.begin(), result.intervals.end(),
                                [](const StreamInterval& i) { return i.stream == Stream::kHost; });
  for (Stream stream : {Stream::kCompute, Stream::kD2H, Stream::kH2D, Stream::kHost}) {
    if (stream == Stream::kHost && !host) continue;
    const int tid = thread_id(stream);
    events.push_back(metadata_event("thread_name", tid, Json{{"name", thread_name(stream)}}));
    events.push_back(metadata_event("thread_sort_index", tid, Json{{"sort_index", tid}}));
  }

  for (const StreamInterval& interval : result.intervals) {
    events.push_back(interval_event(interval, names));
  }

  for (const TimelinePoint& point : result.timeline) {
    append_memory_samples(events, point.start_ms, point);
  }
  append_memory_samples(events, sim::drawn_end_ms(result), result.timeline.back());

  if (const TimelinePoint* backward = sim::first_backward_point(names, result)) {
    events.push_back(instant_event("backward starts", backward->start_ms,
                                   Json{{"node", names.name(backward->node)}}));
  }
  events.push_back(instant_event("peak", result.peak_time_ms,
                                 Json{{"bytes", result.peak_bytes},
                                      {"node", names.name(result.peak_node)},
                                      {"phase", std::string(to_string(result.peak_phase))}}));

  Json trace = Json::object();
  trace["traceEvents"] = std::move(events);
  trace["displayTimeUnit"] = "ms";
  Json other = Json::object();
  other["graph"] = graph.name;
  other["step_ms"] = result.step_ms;
  other["peak_bytes"] = result.peak_bytes;
  trace["otherData"] = std::move(other);
  return trace.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace spillway
