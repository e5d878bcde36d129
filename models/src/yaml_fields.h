// Typed, checked reading of the keys of one YAML / JSON mapping, and the one-line error every bad
// value becomes. Private to ctxplan_models (catalog.cpp and kernel_profile_reader.cpp).
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ctxplan::detail {

// --- small string helpers -----------------------------------------------------------------------

std::string Lower(std::string_view s);

std::string Join(const std::vector<std::string>& items, std::string_view separator);

// A user's text inside a one-line message: quoted, newlines escaped, long values cut.
std::string Quote(std::string_view text);

// 10000000 -> "10,000,000"; 0.1 -> "0.1"; 1e12 -> "1e+12".
std::string FormatLimit(double value);

// --- errors: "<file>:<line>: key '<key>': <problem>; <what is accepted>" ------------------------

[[noreturn]] void Fail(std::string_view source, const YAML::Mark& mark, std::string_view key,
                       std::string_view problem, std::string_view accepted);

std::string Describe(const YAML::Node& node);

// Parses a whole file and insists on a mapping at the top. yaml-cpp reads JSON too.
YAML::Node ParseDocument(std::string_view text, std::string_view source, std::string_view expected);

// --- typed access to the keys of one mapping ----------------------------------------------------

struct IntLimit {
  int64_t max;
};
struct NumberLimit {
  double max;            // values must be finite, > 0 and <= max
  bool zero_ok = false;  // ... or >= 0 (a fixed cost a calibration may find absent)
};

std::string Accepted(IntLimit limit);
std::string Accepted(NumberLimit limit);

// The keys of one mapping, read with their types checked. Keys are case-sensitive, as in
// config.json. Every error names the key and its line; `prefix` qualifies keys of a nested
// mapping ("memory_gib." + "value").
class Fields {
 public:
  Fields(const YAML::Node& map, std::string_view source, std::string prefix);

  std::string_view source() const { return source_; }

  // Our own files admit only the keys we read: a typo must not silently become a default.
  void RejectUnknown(std::initializer_list<std::string_view> allowed) const;

  // Present with a value; a null value (`head_dim: null` in config.json) counts as absent.
  bool Has(std::string_view key) const;

  // The line of the key, or of the mapping when the key is absent.
  YAML::Mark MarkOf(std::string_view key) const;

  [[noreturn]] void FailKey(std::string_view key, std::string_view problem,
                            std::string_view accepted) const;

  std::string String(std::string_view key) const;
  std::optional<std::string> OptionalString(std::string_view key) const;

  // One of `choices` (lower case), compared case-insensitively; returns the lower-case choice.
  std::string Choice(std::string_view key, const std::vector<std::string>& choices) const;

  bool Bool(std::string_view key) const;
  std::optional<bool> OptionalBool(std::string_view key) const;

  int64_t Int(std::string_view key, IntLimit limit) const;
  std::optional<int64_t> OptionalInt(std::string_view key, IntLimit limit) const;

  double Number(std::string_view key, NumberLimit limit) const;
  std::optional<double> OptionalNumber(std::string_view key, NumberLimit limit) const;

  // The keys present, in file order.
  std::vector<std::string> Keys() const;

  // A nested mapping, to be read with its own Fields.
  Fields Map(std::string_view key, std::string_view accepted) const;

 private:
  struct Entry {
    std::string key;
    YAML::Mark mark;
    YAML::Node value;
  };

  std::string Shown(std::string_view key) const { return prefix_ + std::string(key); }

  const Entry* Find(std::string_view key) const;

  const YAML::Node& Require(std::string_view key, std::string_view accepted) const;

  // The text of an unquoted scalar: a quoted "3584" is a string, not a number, in YAML and JSON.
  std::string PlainScalar(std::string_view key, const YAML::Node& v, std::string_view type,
                          std::string_view accepted) const;

  double Number(std::string_view key, double max, const std::string& accepted,
                bool zero_ok = false) const;

  YAML::Node map_;
  std::string source_;
  std::string prefix_;
  std::vector<Entry> entries_;
};

}  // namespace ctxplan::detail
