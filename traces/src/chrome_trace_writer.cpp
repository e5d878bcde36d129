#include "ctxplan/traces/chrome_trace_writer.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <system_error>

#include "ctxplan/models/errors.h"

namespace ctxplan {
namespace {

// Timestamps in microseconds with 3 decimals: nanosecond resolution, the finest Perfetto keeps.
// Event times sit on a grid of 2^-10 us (~1 ns) and are printed as their shortest round-trip
// decimal: a viewer then reads back exactly these dyadic values, so its sums and differences (an
// op's end, a thread's time since its first event) are exact and an op that ends when the next
// starts never overlaps it. Rounding ts and dur to 3 decimals apart made them overlap by 1 ns,
// which speedscope took for mis-nested slices (scripts/check-chrome-trace.sh).
constexpr double kTimeGridPerUs = 1024.0;
double OnTimeGrid(double us) {
  return std::round(us * kTimeGridPerUs) / kTimeGridPerUs;
}

// Length of the well-formed UTF-8 sequence at text[i] (RFC 3629: no overlongs, no surrogates,
// nothing above U+10FFFF), or 0 if there is none.
size_t Utf8SequenceLength(std::string_view text, size_t i) {
  const auto lead = static_cast<uint8_t>(text[i]);
  if (lead < 0x80) return 1;
  size_t length = 0;
  uint8_t second_min = 0x80;
  uint8_t second_max = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) second_min = 0xA0;  // Overlong below U+0800.
    if (lead == 0xED) second_max = 0x9F;  // UTF-16 surrogates.
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) second_min = 0x90;  // Overlong below U+10000.
    if (lead == 0xF4) second_max = 0x8F;  // Above U+10FFFF.
  } else {
    return 0;  // Continuation byte, overlong 0xC0/0xC1, or 0xF5..0xFF.
  }
  if (text.size() - i < length) return 0;
  const auto second = static_cast<uint8_t>(text[i + 1]);
  if (second < second_min || second > second_max) return 0;
  for (size_t k = 2; k < length; ++k) {
    if ((static_cast<uint8_t>(text[i + k]) & 0xC0) != 0x80) return 0;
  }
  return length;
}

// Printable ASCII other than the two characters JSON strings must escape.
bool IsPlainAscii(char c) {
  return c >= 0x20 && c < 0x7F && c != '"' && c != '\\';
}

// The two-character escapes JSON defines; other control characters take \u00XX.
const char* ShortEscape(char c) {
  switch (c) {
    case '"':
      return "\\\"";
    case '\\':
      return "\\\\";
    case '\b':
      return "\\b";
    case '\f':
      return "\\f";
    case '\n':
      return "\\n";
    case '\r':
      return "\\r";
    case '\t':
      return "\\t";
    default:
      return nullptr;
  }
}

void AppendChars(std::string& out, const char* first, std::to_chars_result result) {
  CTXPLAN_CHECK(result.ec == std::errc(), "number formatting overflowed its buffer");
  out.append(first, static_cast<size_t>(result.ptr - first));
}

}  // namespace

void AppendJsonString(std::string& out, std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  size_t i = 0;
  while (i < text.size()) {
    // Copy runs of plain ASCII in bulk: names are almost always nothing else.
    size_t run = i;
    while (run < text.size() && IsPlainAscii(text[run])) ++run;
    out.append(text, i, run - i);
    i = run;
    if (i == text.size()) break;

    const char c = text[i];
    if (const char* escape = ShortEscape(c)) {
      out += escape;
      ++i;
      continue;
    }
    const auto byte = static_cast<uint8_t>(c);
    if (byte < 0x20 || byte == 0x7F) {
      // DEL is legal JSON, but some readers treat every iscntrl() byte as an error.
      out += "\\u00";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xF];
      ++i;
      continue;
    }
    const size_t length = Utf8SequenceLength(text, i);
    if (length == 0) {
      out += "\\ufffd";  // One replacement character per offending byte, as decoders do.
      ++i;
    } else {
      out.append(text, i, length);
      i += length;
    }
  }
  out += '"';
}

void AppendJsonNumber(std::string& out, double value) {
  CTXPLAN_CHECK(std::isfinite(value), "non-finite number in JSON output");
  char buffer[32];  // Shortest round-trip doubles need at most 24 characters.
  AppendChars(out, buffer, std::to_chars(buffer, buffer + sizeof(buffer), value));
}

void AppendJsonInt(std::string& out, int64_t value) {
  char buffer[24];
  AppendChars(out, buffer, std::to_chars(buffer, buffer + sizeof(buffer), value));
}

void AppendJsonFixed(std::string& out, double value, int decimals) {
  CTXPLAN_CHECK(std::isfinite(value), "non-finite number in JSON output");
  CTXPLAN_CHECK(decimals >= 0 && decimals <= 17, "bad decimals " + std::to_string(decimals));
  char buffer[340];  // DBL_MAX has 309 integer digits.
  AppendChars(
      out, buffer,
      std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::fixed, decimals));
}

void AppendJsonValue(std::string& out, const TraceValue& value) {
  if (const auto* integer = std::get_if<int64_t>(&value)) {
    AppendJsonInt(out, *integer);
  } else if (const auto* real = std::get_if<double>(&value)) {
    AppendJsonNumber(out, *real);
  } else {
    AppendJsonString(out, std::get<std::string_view>(value));
  }
}

ChromeTraceWriter::ChromeTraceWriter(std::ostream& out) : out_(out) {}

ChromeTraceWriter::~ChromeTraceWriter() {
  try {
    Finish();
  } catch (...) {  // NOLINT(bugprone-empty-catch): only a stream with exceptions() enabled.
  }
}

void ChromeTraceWriter::WriteMetadata(const TraceArg& entry) {
  CTXPLAN_CHECK(state_ == State::kEmpty || state_ == State::kMetadata,
                "trace metadata '" + std::string(entry.key) +
                    "' written after the first event or after Finish()");
  buffer_.clear();
  AppendJsonString(buffer_, entry.key);
  buffer_ += ':';
  AppendJsonValue(buffer_, entry.value);
  out_ << (state_ == State::kEmpty ? "{\"otherData\":{" : ",");
  out_.write(buffer_.data(), static_cast<std::streamsize>(buffer_.size()));
  state_ = State::kMetadata;
}

void ChromeTraceWriter::SetProcessName(int64_t pid, std::string_view name) {
  WriteMetadataEvent(pid, 0, "process_name", "name", name);
}

void ChromeTraceWriter::SetProcessSortIndex(int64_t pid, int64_t sort_index) {
  WriteMetadataEvent(pid, 0, "process_sort_index", "sort_index", sort_index);
}

void ChromeTraceWriter::SetThreadName(int64_t pid, int64_t tid, std::string_view name,
                                      int64_t sort_index) {
  WriteMetadataEvent(pid, tid, "thread_name", "name", name);
  WriteMetadataEvent(pid, tid, "thread_sort_index", "sort_index", sort_index);
}

void ChromeTraceWriter::WriteMetadataEvent(int64_t pid, int64_t tid, std::string_view name,
                                           std::string_view key, TraceValue value) {
  BeginEvent('M', 0.0, pid, tid);
  buffer_ += ",\"name\":";
  AppendJsonString(buffer_, name);
  AppendArgs({TraceArg(key, value)});
  EndEvent();
}

void ChromeTraceWriter::Complete(int64_t pid, int64_t tid, std::string_view name,
                                 std::string_view category, double ts_us, double dur_us,
                                 TraceArgs args) {
  // Also rejects NaN.
  CTXPLAN_CHECK(dur_us >= 0.0, "trace event '" + std::string(name) + "' has duration " +
                                   std::to_string(dur_us) + " us");
  const double start = OnTimeGrid(ts_us), end = std::max(start, OnTimeGrid(ts_us + dur_us));
  BeginEvent('X', start, pid, tid);
  buffer_ += ",\"dur\":";
  AppendJsonNumber(buffer_, end - start);
  buffer_ += ",\"name\":";
  AppendJsonString(buffer_, name);
  if (!category.empty()) {
    buffer_ += ",\"cat\":";
    AppendJsonString(buffer_, category);
  }
  AppendArgs(args);
  EndEvent();
}

void ChromeTraceWriter::Instant(int64_t pid, int64_t tid, std::string_view name,
                                std::string_view category, double ts_us, InstantScope scope,
                                TraceArgs args) {
  BeginEvent('i', ts_us, pid, tid);
  buffer_ += ",\"name\":";
  AppendJsonString(buffer_, name);
  if (!category.empty()) {
    buffer_ += ",\"cat\":";
    AppendJsonString(buffer_, category);
  }
  buffer_ += ",\"s\":\"";
  buffer_ += static_cast<char>(scope);
  buffer_ += '"';
  AppendArgs(args);
  EndEvent();
}

void ChromeTraceWriter::Counter(int64_t pid, std::string_view name, double ts_us,
                                ListRef<CounterSeries> series) {
  CTXPLAN_CHECK(!series.empty(), "counter '" + std::string(name) + "' without series");
  BeginEvent('C', ts_us, pid, 0);
  buffer_ += ",\"name\":";
  AppendJsonString(buffer_, name);
  buffer_ += ",\"args\":{";
  bool first = true;
  for (const CounterSeries& s : series) {
    if (!first) buffer_ += ',';
    first = false;
    AppendJsonString(buffer_, s.name);
    buffer_ += ':';
    AppendJsonNumber(buffer_, s.value);
  }
  buffer_ += '}';
  EndEvent();
}

void ChromeTraceWriter::BeginEvent(char phase, double ts_us, int64_t pid, int64_t tid) {
  CTXPLAN_CHECK(state_ != State::kFinished, "trace event after Finish()");
  buffer_.clear();
  buffer_ += "{\"ph\":\"";
  buffer_ += phase;
  buffer_ += "\",\"ts\":";
  AppendJsonNumber(buffer_, OnTimeGrid(ts_us));
  buffer_ += ",\"pid\":";
  AppendJsonInt(buffer_, pid);
  buffer_ += ",\"tid\":";
  AppendJsonInt(buffer_, tid);
}

void ChromeTraceWriter::AppendArgs(TraceArgs args) {
  if (args.empty()) return;
  buffer_ += ",\"args\":{";
  bool first = true;
  for (auto it = args.begin(); it != args.end(); ++it) {
    // Lists are a handful of entries, so the quadratic check is cheaper than any set.
    for (auto earlier = args.begin(); earlier != it; ++earlier) {
      CTXPLAN_CHECK(earlier->key != it->key, "duplicate trace arg '" + std::string(it->key) + "'");
    }
    if (!first) buffer_ += ',';
    first = false;
    AppendJsonString(buffer_, it->key);
    buffer_ += ':';
    AppendJsonValue(buffer_, it->value);
  }
  buffer_ += '}';
}

void ChromeTraceWriter::EndEvent() {
  buffer_ += '}';
  switch (state_) {
    case State::kEmpty:
      out_ << "{\"traceEvents\":[\n";
      break;
    case State::kMetadata:
      out_ << "},\n\"traceEvents\":[\n";
      break;
    case State::kEvents:
      out_ << ",\n";
      break;
    case State::kFinished:
      break;  // Unreachable: BeginEvent checked.
  }
  state_ = State::kEvents;
  out_.write(buffer_.data(), static_cast<std::streamsize>(buffer_.size()));
  ++events_written_;
}

void ChromeTraceWriter::Finish() {
  switch (state_) {
    case State::kEmpty:
      out_ << "{\"traceEvents\":[\n]}\n";
      break;
    case State::kMetadata:
      out_ << "},\n\"traceEvents\":[\n]}\n";
      break;
    case State::kEvents:
      out_ << "\n]}\n";
      break;
    case State::kFinished:
      return;
  }
  state_ = State::kFinished;
  out_.flush();
}

}  // namespace ctxplan
