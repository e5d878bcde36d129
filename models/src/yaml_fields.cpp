// The typed-field reader of yaml_fields.h: string helpers, the one-line errors, and Fields.
#include "yaml_fields.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <utility>

#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"

namespace ctxplan::detail {
namespace {

constexpr std::string_view kBoolAccepted = "expected true or false";
constexpr std::string_view kStringAccepted = "expected a non-empty string";

int LineOf(const YAML::Mark& mark) {
  return mark.line >= 0 ? mark.line + 1 : 1;
}

}  // namespace

// --- small string helpers -----------------------------------------------------------------------

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string Join(const std::vector<std::string>& items, std::string_view separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += separator;
    out += items[i];
  }
  return out;
}

std::string Quote(std::string_view text) {
  std::string out = "'";
  for (char c : text.substr(0, 60)) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r' || c == '\t') {
      out += ' ';
    } else {
      out += c;
    }
  }
  if (text.size() > 60) out += "...";
  return out + "'";
}

std::string FormatLimit(double value) {
  if (value >= 1 && value < 1e13 && value == std::floor(value)) {
    return FormatCount(static_cast<int64_t>(value));
  }
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}

// --- errors: "<file>:<line>: key '<key>': <problem>; <what is accepted>" ------------------------

[[noreturn]] void Fail(std::string_view source, const YAML::Mark& mark, std::string_view key,
                       std::string_view problem, std::string_view accepted) {
  std::string message = std::string(source) + ":" + std::to_string(LineOf(mark)) + ": ";
  if (!key.empty()) message += "key '" + std::string(key) + "': ";
  message += problem;
  if (!accepted.empty()) message += "; " + std::string(accepted);
  throw InputError(message);
}

std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return "empty";
    case YAML::NodeType::Scalar:
      return "the scalar " + Quote(node.Scalar());
    case YAML::NodeType::Sequence:
      return "a sequence";
    case YAML::NodeType::Map:
      return "a mapping";
  }
  return "unknown";
}

YAML::Node ParseDocument(std::string_view text, std::string_view source,
                         std::string_view expected) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    Fail(source, e.mark, "", "malformed YAML: " + e.msg, expected);
  }
  if (root.IsNull()) Fail(source, root.Mark(), "", "the file is empty", expected);
  if (!root.IsMap()) {
    Fail(source, root.Mark(), "", "the top level is " + Describe(root) + ", not a mapping",
         expected);
  }
  return root;
}

// --- typed access to the keys of one mapping ----------------------------------------------------

std::string Accepted(IntLimit limit) {
  return "expected an integer from 1 to " + FormatLimit(static_cast<double>(limit.max));
}
std::string Accepted(NumberLimit limit) {
  if (limit.zero_ok) return "expected a number from 0 to " + FormatLimit(limit.max);
  return "expected a positive number up to " + FormatLimit(limit.max);
}

Fields::Fields(const YAML::Node& map, std::string_view source, std::string prefix)
    : map_(map), source_(source), prefix_(std::move(prefix)) {
  // By value: yaml-cpp's iterator yields a temporary pair, so a reference into it would dangle.
  for (const auto& pair : map) {
    const YAML::Node key = pair.first;
    if (!key.IsScalar()) {
      Fail(source_, key.Mark(), "", "a key is " + Describe(key), "expected a plain string key");
    }
    if (Find(key.Scalar()) != nullptr) {
      Fail(source_, key.Mark(), Shown(key.Scalar()), "duplicate key", "expected each key once");
    }
    entries_.push_back({key.Scalar(), key.Mark(), pair.second});
  }
}

void Fields::RejectUnknown(std::initializer_list<std::string_view> allowed) const {
  for (const Entry& e : entries_) {
    if (std::find(allowed.begin(), allowed.end(), e.key) != allowed.end()) continue;
    std::vector<std::string> names(allowed.begin(), allowed.end());
    Fail(source_, e.mark, Shown(e.key), "unknown key", "accepted keys: " + Join(names, ", "));
  }
}

bool Fields::Has(std::string_view key) const {
  const Entry* e = Find(key);
  return e != nullptr && !e->value.IsNull();
}

YAML::Mark Fields::MarkOf(std::string_view key) const {
  const Entry* e = Find(key);
  return e != nullptr ? e->mark : map_.Mark();
}

void Fields::FailKey(std::string_view key, std::string_view problem,
                     std::string_view accepted) const {
  Fail(source_, MarkOf(key), Shown(key), problem, accepted);
}

std::string Fields::String(std::string_view key) const {
  const YAML::Node& v = Require(key, kStringAccepted);
  if (!v.IsScalar()) FailKey(key, "the value is " + Describe(v), kStringAccepted);
  if (v.Scalar().empty()) FailKey(key, "the value is an empty string", kStringAccepted);
  return v.Scalar();
}
std::optional<std::string> Fields::OptionalString(std::string_view key) const {
  if (!Has(key)) return std::nullopt;
  return String(key);
}

std::string Fields::Choice(std::string_view key, const std::vector<std::string>& choices) const {
  const std::string accepted = "expected one of: " + Join(choices, ", ");
  const YAML::Node& v = Require(key, accepted);
  if (!v.IsScalar()) FailKey(key, "the value is " + Describe(v), accepted);
  const std::string value = Lower(v.Scalar());
  if (std::find(choices.begin(), choices.end(), value) == choices.end()) {
    FailKey(key, Quote(v.Scalar()) + " is not accepted", accepted);
  }
  return value;
}

bool Fields::Bool(std::string_view key) const {
  const YAML::Node& v = Require(key, kBoolAccepted);
  const std::string text = PlainScalar(key, v, "true or false", kBoolAccepted);
  const std::string lower = Lower(text);
  if (lower == "true") return true;
  if (lower == "false") return false;
  FailKey(key, Quote(text) + " is not true or false", kBoolAccepted);
}
std::optional<bool> Fields::OptionalBool(std::string_view key) const {
  if (!Has(key)) return std::nullopt;
  return Bool(key);
}

int64_t Fields::Int(std::string_view key, IntLimit limit) const {
  const std::string accepted = Accepted(limit);
  const double value = Number(key, static_cast<double>(limit.max), accepted);
  if (value != std::floor(value)) {
    FailKey(key, Quote(Require(key, accepted).Scalar()) + " is not an integer", accepted);
  }
  return static_cast<int64_t>(value);  // exact: limit.max is far below 2^53
}
std::optional<int64_t> Fields::OptionalInt(std::string_view key, IntLimit limit) const {
  if (!Has(key)) return std::nullopt;
  return Int(key, limit);
}

double Fields::Number(std::string_view key, NumberLimit limit) const {
  return Number(key, limit.max, Accepted(limit), limit.zero_ok);
}
std::optional<double> Fields::OptionalNumber(std::string_view key, NumberLimit limit) const {
  if (!Has(key)) return std::nullopt;
  return Number(key, limit);
}

std::vector<std::string> Fields::Keys() const {
  std::vector<std::string> keys;
  for (const Entry& e : entries_) keys.push_back(e.key);
  return keys;
}

Fields Fields::Map(std::string_view key, std::string_view accepted) const {
  const YAML::Node& v = Require(key, accepted);
  if (!v.IsMap()) FailKey(key, "the value is " + Describe(v) + ", not a mapping", accepted);
  return Fields(v, source_, Shown(key) + ".");
}

const Fields::Entry* Fields::Find(std::string_view key) const {
  for (const Entry& e : entries_) {
    if (e.key == key) return &e;
  }
  return nullptr;
}

const YAML::Node& Fields::Require(std::string_view key, std::string_view accepted) const {
  const Entry* e = Find(key);
  if (e == nullptr) Fail(source_, map_.Mark(), Shown(key), "missing", accepted);
  if (e->value.IsNull()) FailKey(key, "no value", accepted);
  return e->value;
}

std::string Fields::PlainScalar(std::string_view key, const YAML::Node& v, std::string_view type,
                                std::string_view accepted) const {
  if (!v.IsScalar()) {
    FailKey(key, "the value is " + Describe(v) + ", not " + std::string(type), accepted);
  }
  if (v.Tag() == "!") {
    FailKey(key,
            "the value is the quoted string " + Quote(v.Scalar()) + ", not " + std::string(type),
            accepted);
  }
  return v.Scalar();
}

double Fields::Number(std::string_view key, double max, const std::string& accepted,
                      bool zero_ok) const {
  const YAML::Node& v = Require(key, accepted);
  const std::string text = PlainScalar(key, v, "a number", accepted);
  const std::string lower = Lower(text);
  if (lower == ".inf" || lower == "+.inf" || lower == "-.inf" || lower == ".nan") {
    FailKey(key, Quote(text) + " is not finite", accepted);
  }
  double value = 0.0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec == std::errc::result_out_of_range)
    FailKey(key, Quote(text) + " is out of range", accepted);
  if (ec != std::errc() || ptr != end) FailKey(key, Quote(text) + " is not a number", accepted);
  if (!std::isfinite(value)) FailKey(key, Quote(text) + " is not finite", accepted);
  if (value < 0 || (value == 0 && !zero_ok))
    FailKey(key, Quote(text) + (zero_ok ? " is negative" : " is not positive"), accepted);
  if (value > max) FailKey(key, Quote(text) + " is absurdly large", accepted);
  return value;
}

}  // namespace ctxplan::detail
