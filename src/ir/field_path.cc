#include "ir/field_path.h"

namespace spillway::ir {

void FieldPath::append_to(std::string& out) const {
  if (parent_ != nullptr) parent_->append_to(out);
  if (index_ != kNoIndex) {
    out += '[';
    out += std::to_string(index_);
    out += ']';
  } else if (!name_.empty()) {
    if (!out.empty()) out += '.';
    out += name_;
  }
}

std::string FieldPath::str() const {
  std::string out;
  append_to(out);
  return out;
}

std::string node_label(NodeId id, std::string_view name) {
  std::string out = "node " + std::to_string(id);
  if (!name.empty()) {
    out += " (";
    out += name;
    out += ')';
  }
  return out;
}

void fail_at(std::string_view where, const FieldPath& path, std::string_view detail) {
  std::string message(where);
  if (!message.empty()) message += ": ";
  message += "field '";
  message += path.str();
  message += '\'';
  message += detail;
  throw InvalidGraph("graph", message);
}

void fail_whole(std::string_view where, std::string_view detail) {
  std::string message(where);
  if (!message.empty()) message += ": ";
  message += detail;
  throw InvalidGraph("graph", message);
}

bool is_valid_utf8(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const auto* end = p + text.size();
  while (p < end) {
    unsigned char c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    int extra;
    std::uint32_t code;
    if (c >= 0xC2 && c <= 0xDF) {
      extra = 1;
      code = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      extra = 2;
      code = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      extra = 3;
      code = c & 0x07;
    } else {
      return false;  // a continuation byte, an overlong lead (C0, C1) or F5..FF
    }
    if (end - p <= extra) return false;
    for (int k = 1; k <= extra; ++k) {
      if ((p[k] & 0xC0) != 0x80) return false;
      code = (code << 6) | (p[k] & 0x3F);
    }
    if ((extra == 2 && code < 0x800) || (extra == 3 && code < 0x10000)) return false;  // overlong
    if (code >= 0xD800 && code <= 0xDFFF) return false;  // surrogate
    if (code > 0x10FFFF) return false;
    p += extra + 1;
  }
  return true;
}

}  // namespace spillway::ir
