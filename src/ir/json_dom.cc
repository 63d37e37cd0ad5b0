#include "ir/json_dom.h"

#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "spillway/error.h"

namespace spillway::ir {
namespace {

// A SAX handler that builds the DOM as nlohmann's sax_dom_parser does, plus a
// duplicate-key check. (nlohmann's callback parser could check keys too, but
// it copies every value and triples the parse time of a large graph.)
class DomBuilder {
 public:
  using number_integer_t = Json::number_integer_t;
  using number_unsigned_t = Json::number_unsigned_t;
  using number_float_t = Json::number_float_t;
  using string_t = Json::string_t;
  using binary_t = Json::binary_t;

  explicit DomBuilder(Json& root) : root_(root) {}

  bool null() { return add(nullptr); }
  bool boolean(bool value) { return add(value); }
  bool number_integer(number_integer_t value) { return add(value); }
  bool number_unsigned(number_unsigned_t value) { return add(value); }
  bool number_float(number_float_t value, const string_t& text) {
    // nlohmann reads an integer literal past uint64 as a double; refuse it
    // rather than silently turning a Python int into a float.
    if (!frames_.empty() && text.find_first_of(".eE") == string_t::npos) {
      throw InvalidGraph("graph", "field '" + path(/*with_next=*/true) + "': integer " + text +
                                      " is out of the int64 range");
    }
    return add(value);
  }
  bool string(string_t& value) { return add(std::move(value)); }
  bool binary(binary_t& /*value*/) { return false; }  // JSON text has no binary values

  bool start_object(std::size_t /*size*/) {
    Json* object = place(Json::object());
    frames_.push_back({object, nullptr});
    return true;
  }

  bool key(string_t& key) {
    Frame& frame = frames_.back();
    auto& members = frame.json->get_ref<Json::object_t&>();
    // Small objects (nodes, args) are scanned; large ones (ops, hostile
    // kwargs) get a hash set, so the check stays linear overall.
    constexpr std::size_t kScanLimit = 16;
    bool duplicate;
    if (frame.keys) {
      duplicate = !frame.keys->insert(key).second;
    } else {
      duplicate = members.find(key) != members.end();
      if (!duplicate && members.size() >= kScanLimit) {
        frame.keys = std::make_unique<std::unordered_set<std::string>>();
        for (const auto& member : members) frame.keys->insert(member.first);
        frame.keys->insert(key);
      }
    }
    if (duplicate) {
      std::string at = path(/*with_next=*/false);
      throw InvalidGraph("graph", (at.empty() ? "the top-level object" : "field '" + at + "'") +
                                      " has the key '" + key + "' twice");
    }
    // Append without ordered_map::emplace's own linear search: the key is new.
    auto& slots = static_cast<Json::object_t::Container&>(members);
    slots.emplace_back(std::move(key), nullptr);
    pending_ = &slots.back().second;
    return true;
  }

  bool end_object() {
    frames_.pop_back();
    return true;
  }

  bool start_array(std::size_t /*size*/) {
    Json* array = place(Json::array());
    frames_.push_back({array, nullptr});
    return true;
  }

  bool end_array() {
    frames_.pop_back();
    return true;
  }

  bool parse_error(std::size_t /*position*/, const std::string& /*token*/,
                   const nlohmann::detail::exception& error) {
    // what() reads "[json.exception.parse_error.101] parse error at line 1, ...".
    std::string what = error.what();
    std::size_t text = what.find("] ");
    throw InvalidGraph("graph", "not valid JSON: " +
                                    (text == std::string::npos ? what : what.substr(text + 2)));
  }

 private:
  struct Frame {
    Json* json;  // the open object or array
    std::unique_ptr<std::unordered_set<std::string>> keys;  // large objects only
  };

  bool add(Json&& value) {
    place(std::move(value));
    return true;
  }

  // Puts a value where the document expects the next one and returns it.
  Json* place(Json&& value) {
    if (frames_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Json& parent = *frames_.back().json;
    if (parent.is_array()) {
      auto& elements = parent.get_ref<Json::array_t&>();
      elements.push_back(std::move(value));
      return &elements.back();
    }
    *pending_ = std::move(value);
    return pending_;
  }

  // "nodes[12].kwargs": how the innermost open container is reached, and with
  // `with_next` the value about to be placed in it ("nodes[12].kwargs.alpha").
  // Each open container's child is its last member, so nothing extra is
  // recorded while parsing.
  std::string path(bool with_next) const {
    std::string out;
    std::size_t depth = with_next ? frames_.size() : frames_.size() - 1;
    for (std::size_t f = 0; f < depth; ++f) {
      const Json& container = *frames_[f].json;
      bool innermost = f + 1 == frames_.size();
      if (container.is_array()) {
        // The innermost array has not received the next value yet.
        out += "[" + std::to_string(container.size() - (innermost ? 0 : 1)) + "]";
      } else {
        if (!out.empty()) out += '.';
        out += container.get_ref<const Json::object_t&>().back().first;
      }
    }
    return out;
  }

  Json& root_;
  std::vector<Frame> frames_;
  Json* pending_ = nullptr;  // the member the last key() created
};

}  // namespace

Json parse_json(std::string_view text) {
  Json root;
  DomBuilder builder(root);
  Json::sax_parse(text.begin(), text.end(), &builder);
  return root;
}

}  // namespace spillway::ir
