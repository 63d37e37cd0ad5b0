#pragma once
// JSON text -> nlohmann::ordered_json, stricter than nlohmann's own parse: a
// key that appears twice in one object is an error instead of silently
// keeping the last value. Internal to spillway_ir.

#include <string_view>

#include <nlohmann/json.hpp>

namespace spillway::ir {

// Objects keep their members in document order (kwargs depend on it).
using Json = nlohmann::ordered_json;

// Parses RFC 8259 JSON text. Throws InvalidGraph("[graph] not valid JSON: ...")
// on a syntax error, a number outside double's range or invalid UTF-8, and
// InvalidGraph("[graph] field 'nodes[3].kwargs' has the key 'alpha' twice") on
// a duplicate key. Nesting depth is limited only by memory: nothing here
// recurses.
Json parse_json(std::string_view text);

}  // namespace spillway::ir
