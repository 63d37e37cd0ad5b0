#pragma once
// Where in a graph an error sits, for "[graph] node 12 (mm_3): field
// 'args[0]' ..." messages. Internal to spillway_ir.
//
// A FieldPath is a chain of stack-allocated links to its parent, built while a
// reader or the verifier walks a node and rendered only when an error is
// thrown, so walking a valid graph allocates nothing for paths. A FieldPath
// must not outlive the parent it was made from; field() and index() refuse to
// link to a temporary, so `p.index(0).field("x")` does not compile.

#include <cstddef>
#include <string>
#include <string_view>

#include "spillway/error.h"
#include "spillway/graph.h"

namespace spillway::ir {

// Args lists and sequence values nest at most this deep (invariant 8), so
// recursive readers and writers cannot exhaust the stack.
inline constexpr int kMaxNesting = 64;

class FieldPath {
 public:
  // The root path: the node (or op, or graph) itself, rendered as "".
  FieldPath() = default;
  // A field of the root: "metadata".
  explicit FieldPath(std::string_view top_field) : name_(top_field) {}

  FieldPath field(std::string_view name) const& { return FieldPath(link(), name, kNoIndex); }
  FieldPath index(std::size_t i) const& { return FieldPath(link(), {}, i); }
  FieldPath field(std::string_view name) const&& = delete;
  FieldPath index(std::size_t i) const&& = delete;

  // "args[0]", "value.sizes[1].sym", "" for the root.
  std::string str() const;

 private:
  static constexpr std::size_t kNoIndex = static_cast<std::size_t>(-1);
  FieldPath(const FieldPath* parent, std::string_view name, std::size_t index)
      : parent_(parent), name_(name), index_(index) {}
  void append_to(std::string& out) const;
  const FieldPath* link() const {
    return parent_ == nullptr && name_.empty() && index_ == kNoIndex ? nullptr : this;
  }

  const FieldPath* parent_ = nullptr;
  std::string_view name_;
  std::size_t index_ = kNoIndex;
};

// "node 12 (mm_3)", or "node 12" when the name is empty.
std::string node_label(NodeId id, std::string_view name);

// Throws InvalidGraph("[graph] <where>: field '<path>'<detail>"). `where` is a
// node or op label, or empty for a top-level field; `detail` starts with ": "
// or " " as the sentence needs ("refers to unknown node 99").
[[noreturn]] void fail_at(std::string_view where, const FieldPath& path, std::string_view detail);

// Throws InvalidGraph("[graph] <where>: <detail>") for errors about a whole
// node or op rather than one of its fields.
[[noreturn]] void fail_whole(std::string_view where, std::string_view detail);

// True when `text` is well-formed UTF-8 (no overlongs, surrogates or values past
// U+10FFFF), as the JSON writer requires.
bool is_valid_utf8(std::string_view text);

}  // namespace spillway::ir
