#include "ctxplan/traces/chrome_trace_writer.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <locale>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "ctxplan/models/errors.h"
#include "ctxplan/traces/atomic_file.h"
#include "ctxplan/traces/json_reader.h"

namespace ctxplan {
namespace {

// ---- the project's strict RFC 8259 reader, so the tests check real JSON, not substrings --------
//
// json_reader.h rejects trailing commas, leading zeros, raw control characters, invalid UTF-8,
// unpaired surrogates and duplicate object keys. Its values are copied into a tree with lookup by
// key and numbers as doubles, which is what these tests read.

struct JsonMember;

struct Json {
  using Kind = JsonValue::Kind;
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0;
  std::string text;  // A string's decoded value, or a number's literal text.
  std::vector<Json> items;
  std::vector<JsonMember> members;  // In file order.

  bool Has(std::string_view key) const;
  const Json& operator[](std::string_view key) const;
};

// Not std::pair<std::string, Json>: instantiating that inside Json trips clang with libstdc++.
struct JsonMember {
  std::string first;
  Json second;
};

bool Json::Has(std::string_view key) const {
  for (const JsonMember& member : members) {
    if (member.first == key) return true;
  }
  return false;
}

const Json& Json::operator[](std::string_view key) const {
  for (const JsonMember& member : members) {
    if (member.first == key) return member.second;
  }
  throw std::runtime_error("no key '" + std::string(key) + "'");
}

Json ToTree(const JsonValue& value) {
  Json json;
  json.kind = value.kind;
  json.boolean = value.boolean;
  json.text = value.text;
  if (value.kind == Json::Kind::kNumber) json.number = std::strtod(value.text.c_str(), nullptr);
  for (const JsonValue& item : value.items) json.items.push_back(ToTree(item));
  for (const auto& [key, member] : value.members) json.members.push_back({key, ToTree(member)});
  return json;
}

// Throws InputError (a std::runtime_error) on anything RFC 8259 rejects.
Json ParseJson(std::string_view text) {
  return ToTree(JsonParser(text, "test JSON", 0).ParseDocument());
}

TEST(JsonReaderTest, RejectsWhatRfc8259Rejects) {
  for (const char* bad : {"", "{", "{\"a\":1,}", "[1,]", "01", "1.", ".5", "+1", "NaN", "\"\t\"",
                          "\"\\x\"", "\"\xff\"", "\"\xc0\xaf\"", "\"\\ud800\"", "{\"a\":1,\"a\":2}",
                          "[1] [2]", "tru", "{'a':1}"}) {
    EXPECT_THROW(ParseJson(bad), std::runtime_error) << bad;
  }
  const Json ok =
      ParseJson(" {\"a\":[1,-0.5e+3,true,false,null],\"b\":\"\\u00e9\\ud83d\\ude00\\/\"} ");
  EXPECT_EQ(ok["a"].items.size(), 5u);
  EXPECT_EQ(ok["a"].items[1].number, -500.0);
  EXPECT_EQ(ok["b"].text, "\u00e9\U0001F600/");
}

// ---- helpers ----------------------------------------------------------------------------------

Json ParseTrace(const std::string& text) {
  Json trace = ParseJson(text);
  if (trace.kind != Json::Kind::kObject || !trace.Has("traceEvents") ||
      trace["traceEvents"].kind != Json::Kind::kArray) {
    throw std::runtime_error("not a JSON Object Format trace");
  }
  return trace;
}

const std::vector<Json>& Events(const Json& trace) {
  return trace["traceEvents"].items;
}

// The first event with this phase and name.
const Json& FindEvent(const Json& trace, std::string_view phase, std::string_view name) {
  for (const Json& event : Events(trace)) {
    if (event["ph"].text == phase && event["name"].text == name) return event;
  }
  throw std::runtime_error("no event " + std::string(phase) + " " + std::string(name));
}

// ---- ChromeTraceWriter ------------------------------------------------------------------------

TEST(ChromeTraceWriterTest, EmptyTraceIsValid) {
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  EXPECT_TRUE(out.str().empty()) << "nothing is written before the first call";
  writer.Finish();
  const Json trace = ParseTrace(out.str());
  EXPECT_TRUE(Events(trace).empty());
  EXPECT_TRUE(writer.finished());
}

TEST(ChromeTraceWriterTest, CompleteEventHasAllFields) {
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  writer.Complete(1, 2, "gemm", "compute", 12.0, 3.5,
                  {{"flops", int64_t{1} << 40}, {"efficiency", 0.75}, {"shape", "4096x4096"}});
  writer.Complete(1, 3, "copy", "", 20.25, 0.0);
  writer.Finish();

  const std::string text = out.str();
  const Json trace = ParseTrace(text);
  ASSERT_EQ(Events(trace).size(), 2u);
  const Json& gemm = Events(trace)[0];
  EXPECT_EQ(gemm.members[0].first, "ph") << "ph and ts lead, for Perfetto's tokenizer";
  EXPECT_EQ(gemm.members[1].first, "ts");
  EXPECT_EQ(gemm["ph"].text, "X");
  EXPECT_EQ(gemm["ts"].text, "12");
  EXPECT_EQ(gemm["dur"].text, "3.5");
  EXPECT_EQ(gemm["pid"].number, 1);
  EXPECT_EQ(gemm["tid"].number, 2);
  EXPECT_EQ(gemm["name"].text, "gemm");
  EXPECT_EQ(gemm["cat"].text, "compute");
  EXPECT_EQ(gemm["args"]["flops"].text, "1099511627776");
  EXPECT_EQ(gemm["args"]["efficiency"].number, 0.75);
  EXPECT_EQ(gemm["args"]["shape"].text, "4096x4096");

  const Json& copy = Events(trace)[1];
  EXPECT_FALSE(copy.Has("cat")) << "an empty category is omitted";
  EXPECT_FALSE(copy.Has("args")) << "empty args are omitted";
  EXPECT_EQ(copy["dur"].text, "0");
  EXPECT_EQ(writer.events_written(), 2);
}

TEST(ChromeTraceWriterTest, CounterHasOneArgPerSeries) {
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  writer.Counter(7, "HBM", 5.0, {{"allocated", 15'032'385'536.0}, {"reserved", 2e10}});
  writer.Counter(7, "HBM", 6.5, {{"allocated", 0.1}});
  writer.Finish();
  const Json trace = ParseTrace(out.str());
  ASSERT_EQ(Events(trace).size(), 2u);
  const Json& counter = Events(trace)[0];
  EXPECT_EQ(counter["ph"].text, "C");
  EXPECT_EQ(counter["name"].text, "HBM");
  EXPECT_EQ(counter["pid"].number, 7);
  EXPECT_EQ(counter["ts"].number, 5.0);
  EXPECT_EQ(counter["args"]["allocated"].text, "15032385536") << "integral values stay exact";
  EXPECT_EQ(counter["args"]["reserved"].number, 2e10);
  EXPECT_EQ(Events(trace)[1]["args"]["allocated"].text, "0.1") << "shortest round-trip form";

  std::ostringstream unused;
  ChromeTraceWriter empty(unused);
  EXPECT_THROW(empty.Counter(1, "HBM", 0.0, {}), InternalError);
}

TEST(ChromeTraceWriterTest, MetadataEventsNameAndOrderTracks) {
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  writer.SetProcessName(1, "GPU 0 (H200)");
  writer.SetProcessSortIndex(1, -1);
  writer.SetThreadName(1, 2, "compute stream", 0);
  writer.Finish();
  const Json trace = ParseTrace(out.str());
  ASSERT_EQ(Events(trace).size(), 4u);
  EXPECT_EQ(writer.events_written(), 4);
  const Json& process = FindEvent(trace, "M", "process_name");
  EXPECT_EQ(process["pid"].number, 1);
  EXPECT_EQ(process["args"]["name"].text, "GPU 0 (H200)");
  EXPECT_EQ(FindEvent(trace, "M", "process_sort_index")["args"]["sort_index"].number, -1);
  const Json& thread = FindEvent(trace, "M", "thread_name");
  EXPECT_EQ(thread["tid"].number, 2);
  EXPECT_EQ(thread["args"]["name"].text, "compute stream");
  const Json& order = FindEvent(trace, "M", "thread_sort_index");
  EXPECT_EQ(order["tid"].number, 2);
  EXPECT_EQ(order["args"]["sort_index"].number, 0);
}

TEST(ChromeTraceWriterTest, InstantEventHasScope) {
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  writer.Instant(1, 2, "OOM", "memory", 99.5, InstantScope::kGlobal, {{"bytes", 123}});
  writer.Instant(1, 2, "mark", "", 100.0);
  writer.Finish();
  const Json trace = ParseTrace(out.str());
  const Json& oom = FindEvent(trace, "i", "OOM");
  EXPECT_EQ(oom["s"].text, "g");
  EXPECT_EQ(oom["cat"].text, "memory");
  EXPECT_EQ(oom["ts"].number, 99.5);
  EXPECT_EQ(oom["args"]["bytes"].number, 123);
  EXPECT_EQ(FindEvent(trace, "i", "mark")["s"].text, "t");
}

TEST(ChromeTraceWriterTest, MetadataGoesToOtherDataBeforeTraceEvents) {
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  writer.Metadata("model", "qwen2.5-7b");
  writer.Metadata("context_tokens", size_t{1} << 20);
  writer.Metadata("ratio", 0.5);
  writer.Metadata("gpu", std::string("H200"));
  writer.Complete(1, 1, "op", "", 0.0, 1.0);
  EXPECT_THROW(writer.Metadata("late", 1), InternalError);
  writer.Finish();

  const std::string text = out.str();
  EXPECT_EQ(text.rfind("{\"otherData\":{", 0), 0u) << text;
  const Json trace = ParseTrace(text);
  ASSERT_EQ(trace.members.size(), 2u);
  EXPECT_EQ(trace.members[0].first, "otherData");
  EXPECT_EQ(trace.members[1].first, "traceEvents");
  const Json& other = trace["otherData"];
  EXPECT_EQ(other["model"].text, "qwen2.5-7b");
  EXPECT_EQ(other["context_tokens"].text, "1048576");
  EXPECT_EQ(other["ratio"].number, 0.5);
  EXPECT_EQ(other["gpu"].text, "H200");
  EXPECT_FALSE(other.Has("late"));
  EXPECT_EQ(Events(trace).size(), 1u);
}

TEST(ChromeTraceWriterTest, MetadataOnlyTraceIsValid) {
  std::ostringstream out;
  {
    ChromeTraceWriter writer(out);
    writer.Metadata("tool", "ctxplan");
  }
  const Json trace = ParseTrace(out.str());
  EXPECT_EQ(trace["otherData"]["tool"].text, "ctxplan");
  EXPECT_TRUE(Events(trace).empty());
}

// Every byte value that JSON treats specially, plus multi-byte UTF-8 and characters that
// JavaScript-embedded JSON trips over.
std::string TrickyString() {
  std::string tricky = "quote\" backslash\\ slash/ tab\t newline\n cr\r bs\b ff\f ";
  for (int c = 0; c < 0x20; ++c) tricky += static_cast<char>(c);  // Includes NUL.
  tricky += "\x7f del, caf\u00e9, \u65e5\u672c, \U0001F680, \u2028\u2029 end \\\"";
  return tricky;
}

TEST(ChromeTraceWriterTest, EscapesTrickyStringsEverywhere) {
  const std::string tricky = TrickyString();
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  writer.Metadata(tricky, tricky);
  writer.SetProcessName(1, tricky);
  writer.SetThreadName(1, 1, tricky, 0);
  writer.Complete(1, 1, tricky, tricky, 1.0, 2.0, {{tricky, tricky}, {"plain", tricky}});
  writer.Counter(1, tricky, 3.0, {{tricky, 1.0}});
  writer.Instant(1, 1, tricky, tricky, 4.0, InstantScope::kProcess, {{tricky, 5}});
  writer.Finish();

  const std::string text = out.str();
  EXPECT_NE(text.find("\\u0000"), std::string::npos);
  EXPECT_NE(text.find("\\u007f"), std::string::npos);
  const Json trace = ParseTrace(text);
  EXPECT_EQ(trace["otherData"][tricky].text, tricky);
  EXPECT_EQ(FindEvent(trace, "M", "process_name")["args"]["name"].text, tricky);
  EXPECT_EQ(FindEvent(trace, "M", "thread_name")["args"]["name"].text, tricky);
  const Json& complete = FindEvent(trace, "X", tricky);
  EXPECT_EQ(complete["cat"].text, tricky);
  EXPECT_EQ(complete["args"][tricky].text, tricky);
  EXPECT_EQ(complete["args"]["plain"].text, tricky);
  EXPECT_EQ(FindEvent(trace, "C", tricky)["args"][tricky].number, 1.0);
  EXPECT_EQ(FindEvent(trace, "i", tricky)["args"][tricky].number, 5);
}

TEST(ChromeTraceWriterTest, ReplacesInvalidUtf8) {
  const std::pair<std::string, std::string> cases[] = {
      {"a\xff"
       "b",
       "a\uFFFD"
       "b"},
      {"\xc0\xaf", "\uFFFD\uFFFD"},                      // Overlong '/'.
      {"\xe0\x80\xaf", "\uFFFD\uFFFD\uFFFD"},            // Overlong, 3 bytes.
      {"\xed\xa0\x80", "\uFFFD\uFFFD\uFFFD"},            // UTF-16 surrogate.
      {"\xf4\x90\x80\x80", "\uFFFD\uFFFD\uFFFD\uFFFD"},  // Above U+10FFFF.
      {"ok\xe6\x97", "ok\uFFFD\uFFFD"},                  // Truncated at the end.
      {"\x80\xbf", "\uFFFD\uFFFD"},                      // Lone continuation bytes.
      {"\xe6\x97\xa5\xe6", "\u65e5\uFFFD"},              // Valid, then truncated.
  };
  for (const auto& [input, expected] : cases) {
    std::string json;
    AppendJsonString(json, input);
    EXPECT_EQ(ParseJson(json).text, expected) << json;
  }
}

TEST(ChromeTraceWriterTest, FormatsNumbersAsJson) {
  auto number = [](double value) {
    std::string out;
    AppendJsonNumber(out, value);
    ParseJson(out);  // Must be a valid JSON number.
    return out;
  };
  EXPECT_EQ(number(0.1), "0.1");
  EXPECT_EQ(number(-0.0), "-0");
  EXPECT_EQ(number(17179869184.0), "17179869184");
  EXPECT_EQ(number(1e300), "1e+300");
  EXPECT_EQ(number(5e-324), "5e-324");
  EXPECT_EQ(ParseJson(number(1.0 / 3.0)).number, 1.0 / 3.0) << "round-trips";

  std::string fixed;
  AppendJsonFixed(fixed, 1e300, 3);
  EXPECT_EQ(ParseJson(fixed).number, 1e300);
  std::string integer;
  AppendJsonInt(integer, std::numeric_limits<int64_t>::min());
  EXPECT_EQ(integer, "-9223372036854775808");
}

// Times keep about a nanosecond (a 2^-10 us grid) over long runs, and adjacent ops stay
// adjacent: each op's start and end are put on the grid, its duration is their difference, and
// the numbers read back exactly, so a viewer's ts + dur equals the next op's ts to the bit.
TEST(ChromeTraceWriterTest, TimestampsKeepNanosecondsOverLongRuns) {
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  const double ten_hours_us = 10 * 3600 * 1e6;
  writer.Complete(1, 1, "late", "", ten_hours_us + 0.001, 0.002);
  writer.Complete(1, 1, "tiny", "", 0.0004, 0.0006);
  // Back to back, at times that round apart: 47.265 + 222.05 = 269.315 = the next start.
  writer.Complete(1, 2, "first", "", 47.265, 222.05);
  writer.Complete(1, 2, "second", "", 269.315, 10.0);
  writer.Finish();
  const Json trace = ParseTrace(out.str());
  const Json& late = FindEvent(trace, "X", "late");
  EXPECT_NEAR(late["ts"].number, ten_hours_us + 0.001, 0.001);
  EXPECT_NEAR(late["dur"].number, 0.002, 0.001);
  EXPECT_NE(late["ts"].number, ten_hours_us) << "a nanosecond survives ten hours";
  EXPECT_EQ(FindEvent(trace, "X", "tiny")["ts"].text, "0");
  EXPECT_NEAR(FindEvent(trace, "X", "tiny")["dur"].number, 0.001, 0.0005);
  const Json &first = FindEvent(trace, "X", "first"), &second = FindEvent(trace, "X", "second");
  EXPECT_EQ(first["ts"].number + first["dur"].number, second["ts"].number);
  EXPECT_EQ(second["ts"].number - first["ts"].number, first["dur"].number);
}

TEST(ChromeTraceWriterTest, RejectsNonFiniteNumbersAndKeepsOutputValid) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  writer.Complete(1, 1, "good", "", 1.0, 1.0);
  EXPECT_THROW(writer.Complete(1, 1, "bad", "", nan, 1.0), InternalError);
  EXPECT_THROW(writer.Complete(1, 1, "bad", "", 1.0, inf), InternalError);
  EXPECT_THROW(writer.Complete(1, 1, "bad", "", 1.0, nan), InternalError);
  EXPECT_THROW(writer.Complete(1, 1, "bad", "", 1.0, -1.0), InternalError);
  EXPECT_THROW(writer.Complete(1, 1, "bad", "", 1.0, 1.0, {{"x", -inf}}), InternalError);
  EXPECT_THROW(writer.Counter(1, "bad", 1.0, {{"a", 1.0}, {"b", nan}}), InternalError);
  EXPECT_THROW(writer.Instant(1, 1, "bad", "", inf), InternalError);
  EXPECT_THROW(writer.Complete(1, 1, "bad", "", 1.0, 1.0, {{"k", 1}, {"k", 2}}), InternalError);
  writer.Finish();
  const Json trace = ParseTrace(out.str());
  ASSERT_EQ(Events(trace).size(), 1u) << "failed calls must write nothing";
  EXPECT_EQ(writer.events_written(), 1);
}

TEST(ChromeTraceWriterTest, FinishIsIdempotentAndFinal) {
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  writer.Complete(1, 1, "op", "", 0.0, 1.0);
  writer.Finish();
  const std::string finished = out.str();
  writer.Finish();
  EXPECT_EQ(out.str(), finished);
  EXPECT_THROW(writer.Complete(1, 1, "op", "", 0.0, 1.0), InternalError);
  EXPECT_THROW(writer.SetProcessName(1, "late"), InternalError);
  EXPECT_THROW(writer.Metadata("late", "x"), InternalError);
  EXPECT_EQ(out.str(), finished);
}

TEST(ChromeTraceWriterTest, DestructorFinishesTheJson) {
  std::ostringstream out;
  {
    ChromeTraceWriter writer(out);
    writer.SetProcessName(1, "sim");
    writer.Complete(1, 1, "op", "", 0.0, 1.0);
  }
  const Json trace = ParseTrace(out.str());
  EXPECT_EQ(Events(trace).size(), 2u);

  std::ostringstream untouched;
  { ChromeTraceWriter writer(untouched); }
  EXPECT_TRUE(Events(ParseTrace(untouched.str())).empty());
}

TEST(ChromeTraceWriterTest, StreamsEachEventThrough) {
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  writer.Complete(1, 1, "first", "", 0.0, 1.0);
  EXPECT_NE(out.str().find("\"first\""), std::string::npos);
  const size_t size = out.str().size();
  writer.Complete(1, 1, "second", "", 1.0, 1.0);
  EXPECT_GT(out.str().size(), size);
  EXPECT_NE(out.str().find("\"second\""), std::string::npos);
}

// A locale with ',' as decimal point and '.' grouping: anything formatted through the stream's
// num_put would produce "1.234,5" and break the JSON.
struct CommaDecimal : std::numpunct<char> {
  char do_decimal_point() const override { return ','; }
  char do_thousands_sep() const override { return '.'; }
  std::string do_grouping() const override { return "\3"; }
};

TEST(ChromeTraceWriterTest, IgnoresTheStreamLocale) {
  std::ostringstream out;
  out.imbue(std::locale(std::locale::classic(), new CommaDecimal));
  ChromeTraceWriter writer(out);
  writer.Metadata("bytes", int64_t{123456789});
  writer.Complete(1234567, 7654321, "op", "", 1234567.25, 0.5, {{"x", 2.5}, {"n", 1000000}});
  writer.Counter(1234567, "c", 1.5, {{"v", 1234.5}});
  writer.Finish();
  const Json trace = ParseTrace(out.str());
  EXPECT_EQ(trace["otherData"]["bytes"].number, 123456789);
  const Json& op = FindEvent(trace, "X", "op");
  EXPECT_EQ(op["pid"].number, 1234567);
  EXPECT_EQ(op["ts"].number, 1234567.25);
  EXPECT_EQ(op["args"]["x"].number, 2.5);
  EXPECT_EQ(op["args"]["n"].number, 1000000);
  EXPECT_EQ(FindEvent(trace, "C", "c")["args"]["v"].number, 1234.5);
}

TEST(ChromeTraceWriterTest, TraceArgAcceptsCommonTypes) {
  const std::string owned = "owned";
  const TraceArg args[] = {
      {"int", 1},      {"size", size_t{2}}, {"u32", uint32_t{3}}, {"float", 1.5f},
      {"double", 2.5}, {"literal", "text"}, {"string", owned},    {"view", std::string_view("v")},
  };
  EXPECT_EQ(std::get<int64_t>(args[1].value), 2);
  EXPECT_EQ(std::get<double>(args[3].value), 1.5);
  EXPECT_EQ(std::get<std::string_view>(args[6].value), "owned");
  static_assert(!std::is_constructible_v<TraceArg, std::string_view, bool>,
                "bool args are rejected at compile time");

  std::ostringstream out;
  ChromeTraceWriter writer(out);
  const std::vector<TraceArg> list(std::begin(args), std::end(args));
  writer.Complete(1, 1, "op", "", 0.0, 1.0, list);  // A vector binds too.
  writer.Finish();
  const Json trace = ParseTrace(out.str());
  EXPECT_EQ(FindEvent(trace, "X", "op")["args"].members.size(), 8u);
}

TEST(ChromeTraceWriterTest, ManyEventsStayValid) {
  std::ostringstream out;
  ChromeTraceWriter writer(out);
  for (int i = 0; i < 20'000; ++i) {
    writer.Complete(1, i % 4, "op " + std::to_string(i), "compute", i * 1.5, 1.25,
                    {{"id", i}, {"bytes", int64_t{i} * 4096}});
    if (i % 100 == 0) writer.Counter(1, "HBM", i * 1.5, {{"allocated", i * 1e6}});
  }
  writer.Finish();
  EXPECT_EQ(Events(ParseTrace(out.str())).size(), 20'200u);
}

// ---- AtomicFileWriter -------------------------------------------------------------------------

class AtomicFileWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("ctxplan_atomic_" + std::to_string(::getpid()) + "_" + info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::permissions(dir_, std::filesystem::perms::owner_all,
                                 std::filesystem::perm_options::add, ignored);
    std::filesystem::remove_all(dir_, ignored);
  }

  static std::string Read(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream content;
    content << in.rdbuf();
    return content.str();
  }
  static void WriteFile(const std::filesystem::path& path, const std::string& content) {
    std::ofstream(path, std::ios::binary) << content;
  }
  // Everything in dir_, to catch leftover temporary files.
  std::vector<std::string> Listing() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }
  static std::string MessageOf(const std::function<void()>& action) {
    try {
      action();
    } catch (const InputError& error) {
      return error.what();
    }
    return "(no InputError)";
  }

  std::filesystem::path dir_;
};

TEST_F(AtomicFileWriterTest, CommitPublishesTheFile) {
  const auto path = dir_ / "report.json";
  AtomicFileWriter file(path);
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(file.temp_path(), dir_ / ("report.json.tmp." + std::to_string(::getpid())));
  file.stream() << "{\"ok\":true}\n";
  EXPECT_FALSE(std::filesystem::exists(path)) << "nothing is visible before Commit()";
  file.Commit();
  EXPECT_TRUE(file.committed());
  EXPECT_EQ(Read(path), "{\"ok\":true}\n");
  EXPECT_EQ(Listing(), std::vector<std::string>{"report.json"});
}

TEST_F(AtomicFileWriterTest, ReplacesAnExistingFileOnlyOnCommit) {
  const auto path = dir_ / "out.txt";
  WriteFile(path, "old");
  AtomicFileWriter file(path);
  file.stream() << "new";
  file.stream().flush();
  EXPECT_EQ(Read(path), "old");
  file.Commit();
  EXPECT_EQ(Read(path), "new");
}

TEST_F(AtomicFileWriterTest, AbandonedWriterLeavesNothing) {
  const auto path = dir_ / "out.txt";
  {
    AtomicFileWriter file(path);
    file.stream() << std::string(200'000, 'x');  // Past the buffer: really on disk.
    EXPECT_TRUE(std::filesystem::exists(file.temp_path()));
  }
  EXPECT_TRUE(Listing().empty());

  WriteFile(path, "old");
  { AtomicFileWriter(path).stream() << "new"; }
  EXPECT_EQ(Read(path), "old");
  EXPECT_EQ(Listing(), std::vector<std::string>{"out.txt"});
}

TEST_F(AtomicFileWriterTest, LargeWritesArriveIntact) {
  const auto path = dir_ / "big.bin";
  std::string content;
  for (int i = 0; i < 300'000; ++i) content += static_cast<char>('a' + i % 26);
  AtomicFileWriter file(path);
  file.stream() << "head";
  file.stream().write(content.data(), static_cast<std::streamsize>(content.size()));
  for (int i = 0; i < 100'000; ++i) file.stream().put(static_cast<char>('0' + i % 10));
  file.Commit();
  const std::string read = Read(path);
  ASSERT_EQ(read.size(), 4 + content.size() + 100'000);
  EXPECT_EQ(read.substr(4, content.size()), content);
  EXPECT_EQ(read.substr(read.size() - 3), "789");
}

TEST_F(AtomicFileWriterTest, UnwritableLocationsThrowInputErrorNamingThePath) {
  const auto missing = dir_ / "no" / "such" / "dir" / "out.json";
  EXPECT_EQ(MessageOf([&] { AtomicFileWriter file(missing); }),
            "cannot write " + missing.string() + ": No such file or directory");

  const auto regular = dir_ / "file";
  WriteFile(regular, "x");
  const auto under_file = regular / "out.json";
  EXPECT_EQ(MessageOf([&] { AtomicFileWriter file(under_file); }),
            "cannot write " + under_file.string() + ": Not a directory");

  if (::geteuid() != 0) {  // Root ignores directory permissions.
    const auto locked = dir_ / "locked";
    std::filesystem::create_directory(locked);
    std::filesystem::permissions(
        locked, std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
    const auto inside = locked / "out.json";
    EXPECT_EQ(MessageOf([&] { AtomicFileWriter file(inside); }),
              "cannot write " + inside.string() + ": Permission denied");
    std::filesystem::permissions(locked, std::filesystem::perms::owner_all);
  }
}

TEST_F(AtomicFileWriterTest, FailedRenameThrowsAndCleansUp) {
  const auto path = dir_ / "taken";
  std::filesystem::create_directories(path / "child");  // A non-empty directory is in the way.
  AtomicFileWriter file(path);
  file.stream() << "data";
  const std::string message = MessageOf([&] { file.Commit(); });
  EXPECT_EQ(message.rfind("cannot write " + path.string() + ": ", 0), 0u) << message;
  EXPECT_FALSE(file.committed());
  EXPECT_EQ(Listing(), std::vector<std::string>{"taken"}) << "the temporary file is removed";
}

TEST_F(AtomicFileWriterTest, FailedWriteIsReportedAtCommit) {
  // A file-size limit makes write() fail with EFBIG, standing in for a full disk.
  const auto path = dir_ / "big.txt";
  AtomicFileWriter file(path);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* previous_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = saved;
  limited.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  file.stream() << std::string(1 << 20, 'x');
  const bool stream_failed = !file.stream();
  std::string message = MessageOf([&] { file.Commit(); });
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous_handler);

  EXPECT_TRUE(stream_failed);
  EXPECT_EQ(message, "cannot write " + path.string() + ": File too large");
  EXPECT_TRUE(Listing().empty());
}

TEST_F(AtomicFileWriterTest, MisuseIsAnInternalError) {
  AtomicFileWriter file(dir_ / "x");
  file.Commit();
  EXPECT_THROW(file.Commit(), InternalError);
  EXPECT_THROW(file.stream(), InternalError);
}

TEST_F(AtomicFileWriterTest, TraceThroughAtomicFileIsValidForPython) {
  const auto path = dir_ / "trace.json";
  {
    AtomicFileWriter file(path);
    ChromeTraceWriter writer(file.stream());
    writer.Metadata("model", TrickyString());
    writer.SetProcessName(1, TrickyString());
    writer.Complete(1, 1, TrickyString(), "cat", 1.0, 2.0, {{"k", "\xff invalid"}});
    writer.Counter(1, "HBM", 2.0, {{"allocated", 1e10}});
    writer.Finish();
    file.Commit();
  }
  const Json trace = ParseTrace(Read(path));
  EXPECT_EQ(Events(trace).size(), 3u);

  // An independent reader as a cross-check of our own parser; skipped where Python is missing.
  if (std::system("python3 -c 'import json' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3 not available";
  }
  const std::string command =
      "python3 -c 'import json,sys; t=json.load(open(sys.argv[1], encoding=\"utf-8\")); "
      "assert len(t[\"traceEvents\"]) == 3' '" +
      path.string() + "'";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

}  // namespace
}  // namespace ctxplan
