#include "ctxplan/models/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "ctxplan/models/errors.h"

namespace ctxplan {
namespace {

constexpr std::string_view kBytesAccepted =
    "accepted: a positive number with an optional unit B, KB, MB, GB, TB (powers of 1000) or "
    "KiB, MiB, GiB, TiB (powers of 1024), e.g. 125GiB, 512 GiB, 1.5TB";
constexpr std::string_view kTokensAccepted =
    "accepted: a positive integer with an optional suffix K, M or G (1K = 1024, 1M = 1048576), "
    "e.g. 1048576, 32K, 1M, 1.5M";

struct Unit {
  std::string_view name;  // lower case
  int64_t multiplier;
};

constexpr Unit kByteUnits[] = {
    {"", 1},
    {"b", 1},
    {"kb", 1'000},
    {"mb", 1'000'000},
    {"gb", 1'000'000'000},
    {"tb", 1'000'000'000'000},
    {"kib", kKiB},
    {"mib", kMiB},
    {"gib", kGiB},
    {"tib", int64_t{1} << 40},
};

constexpr Unit kTokenUnits[] = {{"", 1}, {"k", kKiB}, {"m", kMiB}, {"g", kGiB}};

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool IsDigit(char c) {
  return c >= '0' && c <= '9';
}

bool EqualsIgnoreCase(std::string_view a, std::string_view lower) {
  if (a.size() != lower.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != lower[i]) return false;
  }
  return true;
}

// A quantity as the user wrote it: "1.5 GiB" -> {"1", "5", "GiB"}. Integer and fraction digits stay
// apart so that integers are converted exactly, without a trip through floating point.
struct Quantity {
  std::string_view integer_digits;
  std::string_view fraction_digits;  // empty for an integer
  std::string_view unit;             // may be empty
};

std::optional<Quantity> Split(std::string_view text) {
  Quantity q;
  size_t i = 0;
  while (i < text.size() && IsDigit(text[i])) ++i;
  q.integer_digits = text.substr(0, i);
  if (q.integer_digits.empty()) return std::nullopt;
  if (i < text.size() && text[i] == '.') {
    const size_t start = ++i;
    while (i < text.size() && IsDigit(text[i])) ++i;
    q.fraction_digits = text.substr(start, i - start);
    if (q.fraction_digits.empty()) return std::nullopt;  // "5." is a typo, not a number
  }
  while (i < text.size() && text[i] == ' ') ++i;
  q.unit = text.substr(i);
  for (char c : q.unit) {
    if (!std::isalpha(static_cast<unsigned char>(c))) return std::nullopt;
  }
  return q;
}

// integer.fraction * multiplier, rounded to the nearest integer; nullopt on overflow.
std::optional<int64_t> Scale(const Quantity& q, int64_t multiplier) {
  int64_t integer = 0;
  const char* end = q.integer_digits.data() + q.integer_digits.size();
  auto [ptr, ec] = std::from_chars(q.integer_digits.data(), end, integer);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  int64_t result = 0;
  if (__builtin_mul_overflow(integer, multiplier, &result)) return std::nullopt;
  if (!q.fraction_digits.empty()) {
    const std::string fraction = "0." + std::string(q.fraction_digits);
    const long double part = std::strtold(fraction.c_str(), nullptr) * multiplier;
    if (__builtin_add_overflow(result, static_cast<int64_t>(std::llroundl(part)), &result)) {
      return std::nullopt;
    }
  }
  return result;
}

[[noreturn]] void Reject(std::string_view what, std::string_view text, std::string_view problem,
                         std::string_view accepted) {
  throw InputError(std::string(what) + ": '" + std::string(text) + "' " + std::string(problem) +
                   "; " + std::string(accepted));
}

template <size_t N>
int64_t ParseQuantity(std::string_view raw, std::string_view what, const Unit (&units)[N],
                      std::string_view noun, std::string_view accepted) {
  const std::string_view text = Trim(raw);
  if (text.empty()) Reject(what, raw, "is empty", accepted);
  if (text.front() == '-') Reject(what, raw, "is negative", accepted);
  const std::optional<Quantity> q = Split(text);
  if (!q) Reject(what, raw, "is not a number with an optional unit", accepted);
  const Unit* unit = nullptr;
  for (const Unit& u : units) {
    if (EqualsIgnoreCase(q->unit, u.name)) unit = &u;
  }
  if (unit == nullptr) {
    Reject(what, raw, "has an unknown unit '" + std::string(q->unit) + "'", accepted);
  }
  if (unit->multiplier == 1 && !q->fraction_digits.empty()) {
    Reject(what, raw, "is not a whole number of " + std::string(noun), accepted);
  }
  const std::optional<int64_t> value = Scale(*q, unit->multiplier);
  if (!value) Reject(what, raw, "is too large", accepted);
  if (*value <= 0) Reject(what, raw, "is not positive", accepted);
  return *value;
}

std::string Printf(const char* format, double a, double b) {
  char buffer[96];
  std::snprintf(buffer, sizeof(buffer), format, a, b);
  return buffer;
}

}  // namespace

int64_t ParseBytes(std::string_view text, std::string_view what) {
  return ParseQuantity(text, what, kByteUnits, "bytes", kBytesAccepted);
}

int64_t ParseTokens(std::string_view text, std::string_view what) {
  return ParseQuantity(text, what, kTokenUnits, "tokens", kTokensAccepted);
}

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  const double magnitude = std::fabs(b);
  if (magnitude < 1e3) return std::to_string(bytes) + " B";
  if (magnitude < 1e6) return Printf("%.2f KB (%.2f KiB)", b / 1e3, b / kKiB);
  if (magnitude < 1e9) return Printf("%.2f MB (%.2f MiB)", b / 1e6, b / kMiB);
  return Printf("%.2f GB (%.2f GiB)", b / 1e9, b / kGiB);
}

std::string FormatGiB(int64_t bytes) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.2f GiB", static_cast<double>(bytes) / kGiB);
  return buffer;
}

std::string FormatTokens(int64_t tokens) {
  std::string text = FormatCount(tokens);
  if (tokens <= 0) return text;
  // The suffix only where it is exact, so that "(1M)" never hides a rounding.
  if (tokens % kGiB == 0) return text + " (" + std::to_string(tokens / kGiB) + "G)";
  if (tokens % kMiB == 0) return text + " (" + std::to_string(tokens / kMiB) + "M)";
  if (tokens % kKiB == 0) return text + " (" + std::to_string(tokens / kKiB) + "K)";
  return text;
}

std::string FormatCount(int64_t value) {
  // Unsigned magnitude, so that INT64_MIN formats too.
  const uint64_t magnitude =
      value < 0 ? uint64_t{0} - static_cast<uint64_t>(value) : static_cast<uint64_t>(value);
  const std::string digits = std::to_string(magnitude);
  std::string text = value < 0 ? "-" : "";
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) text += ',';
    text += digits[i];
  }
  return text;
}

}  // namespace ctxplan
