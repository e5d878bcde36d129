// Streaming writer of Chrome trace JSON (the "JSON Object Format"), which Perfetto
// (ui.perfetto.dev) and chrome://tracing open.
//
// Like kineto's writer it never holds events: each call formats one event and writes it through,
// so a simulated step with millions of ops costs constant memory. The output looks like
//
//   {"otherData":{"model":"qwen2.5-7b"},
//   "traceEvents":[
//   {"ph":"M","ts":0.000,"pid":1,"tid":0,"name":"process_name","args":{"name":"GPU 0"}},
//   {"ph":"X","ts":12.000,"pid":1,"tid":2,"dur":3.500,"name":"gemm","cat":"compute"},
//   ...
//   ]}
//
// Only "otherData" precedes "traceEvents": older Perfetto tokenizers stop at any other unknown
// top-level key. Each event starts with "ph" and "ts" because those tokenizers scan an event's
// keys in order up to them with a reader that cannot decode \uXXXX escapes.
//
// Timestamps and durations are microseconds, printed with 3 decimals (nanosecond resolution,
// exact for runs of many hours). Numbers are formatted with std::to_chars, so the output does not
// depend on the global or stream locale. Strings are escaped per RFC 8259; invalid UTF-8 becomes
// U+FFFD so a stray byte cannot make the whole file unreadable.
//
// Misuse (a non-finite number, a negative duration, an event after Finish(), metadata after the
// first event) throws InternalError. I/O errors are the stream's: check its state, or write
// through AtomicFileWriter, whose Commit() does.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace ctxplan {

// A JSON scalar: integer, finite double or string.
using TraceValue = std::variant<int64_t, double, std::string_view>;

template <typename T>
concept TraceInteger = std::is_integral_v<T> && !std::is_same_v<T, bool>;

// A key/value pair of an event's "args" or of the top-level "otherData". Views only: the strings
// must outlive the call they are passed to (a temporary std::string is fine).
struct TraceArg {
  // Any integer type, so size_t and uint32_t byte counts need no cast. (A uint64_t above
  // INT64_MAX would wrap; no byte or token count gets near it.)
  template <TraceInteger Int>
  TraceArg(std::string_view k, Int v) : key(k), value(static_cast<int64_t>(v)) {}
  TraceArg(std::string_view k, double v) : key(k), value(v) {}
  TraceArg(std::string_view k, std::string_view v) : key(k), value(v) {}
  TraceArg(std::string_view k, const char* v) : key(k), value(std::string_view(v)) {}
  TraceArg(std::string_view k, const std::string& v) : key(k), value(std::string_view(v)) {}
  TraceArg(std::string_view k, TraceValue v) : key(k), value(v) {}
  TraceArg(std::string_view k, bool v) = delete;  // Almost always a mistake; say 0 or 1.

  std::string_view key;
  TraceValue value;
};

// One series of a counter event ("C"); Perfetto draws one track per series.
struct CounterSeries {
  std::string_view name;
  double value;
};

// A read-only view of a list passed to one call: binds a braced list, a std::vector or a span.
// (std::span cannot bind a braced list before C++26.)
template <typename T>
class ListRef {
 public:
  ListRef() = default;
  // The braced list's array lives until the end of the full expression: the call.
  ListRef(std::initializer_list<T> list) : items_(list.begin(), list.size()) {}
  ListRef(std::span<const T> items) : items_(items) {}
  ListRef(const std::vector<T>& items) : items_(items) {}

  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }

 private:
  std::span<const T> items_;
};

using TraceArgs = ListRef<TraceArg>;

// "s" of an instant event: how tall the marker is drawn.
enum class InstantScope : char { kThread = 't', kProcess = 'p', kGlobal = 'g' };

class ChromeTraceWriter {
 public:
  // Writes nothing until the first call; `out` must outlive the writer.
  explicit ChromeTraceWriter(std::ostream& out);
  ChromeTraceWriter(const ChromeTraceWriter&) = delete;
  ChromeTraceWriter& operator=(const ChromeTraceWriter&) = delete;
  // Finishes the JSON if Finish() was not called, so an early return or an exception still
  // leaves a loadable trace. Never throws.
  ~ChromeTraceWriter();

  // A top-level "otherData" entry (shown in the trace's info/metadata view). All metadata must
  // come before the first event, because it is written ahead of "traceEvents".
  // The value converts as a TraceArg value does (integers, doubles, strings).
  template <typename Value>
  void Metadata(std::string_view key, Value&& value) {
    WriteMetadata(TraceArg(key, std::forward<Value>(value)));
  }

  // Track names and order ("M" metadata events).
  void SetProcessName(int64_t pid, std::string_view name);
  void SetProcessSortIndex(int64_t pid, int64_t sort_index);
  void SetThreadName(int64_t pid, int64_t tid, std::string_view name, int64_t sort_index);

  // A span ("X"). An empty category is omitted. Precondition: dur_us >= 0.
  void Complete(int64_t pid, int64_t tid, std::string_view name, std::string_view category,
                double ts_us, double dur_us, TraceArgs args = {});
  // A zero-length marker ("i").
  void Instant(int64_t pid, int64_t tid, std::string_view name, std::string_view category,
               double ts_us, InstantScope scope = InstantScope::kThread, TraceArgs args = {});
  // Values of one or more series of the process-level counter `name` from ts_us on ("C").
  void Counter(int64_t pid, std::string_view name, double ts_us, ListRef<CounterSeries> series);

  // Closes the JSON and flushes the stream. Idempotent; nothing may be written afterwards.
  void Finish();
  bool finished() const { return state_ == State::kFinished; }
  // Trace events written so far, "M" events included.
  int64_t events_written() const { return events_written_; }

 private:
  enum class State { kEmpty, kMetadata, kEvents, kFinished };

  // An event is formatted into buffer_ first and reaches the stream only whole, in EndEvent():
  // a call that throws on a bad argument leaves the output untouched and still valid.
  void BeginEvent(char phase, double ts_us, int64_t pid, int64_t tid);
  void AppendArgs(TraceArgs args);
  void EndEvent();
  void WriteMetadata(const TraceArg& entry);
  void WriteMetadataEvent(int64_t pid, int64_t tid, std::string_view name, std::string_view key,
                          TraceValue value);

  std::ostream& out_;
  std::string buffer_;  // One event at a time; reused, so steady state never allocates.
  State state_ = State::kEmpty;
  int64_t events_written_ = 0;
};

// JSON building blocks, shared with other JSON outputs.
// Appends `text` as a quoted JSON string.
void AppendJsonString(std::string& out, std::string_view text);
// Shortest round-trip form. Non-finite values throw InternalError.
void AppendJsonNumber(std::string& out, double value);
void AppendJsonInt(std::string& out, int64_t value);
// Fixed-point with `decimals` digits after the point. Non-finite values throw InternalError.
void AppendJsonFixed(std::string& out, double value, int decimals);
void AppendJsonValue(std::string& out, const TraceValue& value);

}  // namespace ctxplan
