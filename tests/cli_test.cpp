// The ctxplan program end to end: the real binary, run as a user runs it. Bad input of every kind
// must give one clear line on stderr naming what is wrong and what is accepted, exit code 2, and
// no output at all (no stdout, no output file, no temp file left behind); good input must give
// complete, parseable results.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "support/process.h"

namespace ctxplan {
namespace {

namespace fs = std::filesystem;
using test::ReadAll;
using test::RunArgv;
using test::RunResult;
using test::ScratchDir;

#ifndef CTXPLAN_EXE
#error "tests/CMakeLists.txt must define CTXPLAN_EXE, the path of the ctxplan binary"
#endif

RunResult RunCtxplan(std::vector<std::string> args, const fs::path& scratch,
                     const std::string& stdout_path = "") {
  args.insert(args.begin(), CTXPLAN_EXE);
  return RunArgv(args, scratch, stdout_path);
}

std::string Describe(const std::vector<std::string>& args, const RunResult& r) {
  std::string s = "ctxplan";
  for (const std::string& a : args) s += " '" + a + "'";
  return s + "\n  exit " + std::to_string(r.exit_code) + "\n  stderr: " + r.err + "\n  stdout (" +
         std::to_string(r.out.size()) + " bytes): " + r.out.substr(0, 300);
}

// The contract for bad input: exit 2, one line "ctxplan: ..." containing every `expected`
// substring (what is wrong and what is accepted), nothing on stdout.
void ExpectBadInput(const std::vector<std::string>& args, const RunResult& r,
                    const std::vector<std::string>& expected) {
  SCOPED_TRACE(Describe(args, r));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "stderr must be exactly one line";
  EXPECT_TRUE(r.err.ends_with("\n"));
  EXPECT_TRUE(r.err.starts_with("ctxplan: ")) << r.err;
  for (const std::string& e : expected) EXPECT_NE(r.err.find(e), std::string::npos) << e;
  EXPECT_EQ(r.out, "") << "bad input must print nothing on stdout";
}

// No temporary sibling of `file` ("<name>.tmp.<pid>") may be left behind.
void ExpectNoTempFile(const fs::path& file) {
  std::error_code ec;
  if (!fs::is_directory(file.parent_path(), ec)) return;
  const std::string prefix = file.filename().string() + ".tmp";
  for (const auto& entry : fs::directory_iterator(file.parent_path())) {
    EXPECT_FALSE(entry.path().filename().string().starts_with(prefix))
        << "temp file left behind: " << entry.path();
  }
}

// Neither the file nor a temporary sibling of it may be left behind.
void ExpectNoOutputFile(const fs::path& file) {
  EXPECT_FALSE(fs::exists(file)) << file;
  ExpectNoTempFile(file);
}

// --- fixture files: one valid model, and copies broken in exactly one way each ----------------

constexpr const char* kGoodModel =
    "name: test-model\n"
    "model_type: qwen2\n"
    "hidden_size: 3584\n"
    "intermediate_size: 18944\n"
    "num_hidden_layers: 28\n"
    "num_attention_heads: 28\n"
    "num_key_value_heads: 4\n"
    "vocab_size: 152064\n"
    "max_position_embeddings: 131072\n"
    "tie_word_embeddings: false\n"
    "attention_bias: true\n"
    "rope_theta: 1000000.0\n"
    "rms_norm_eps: 1.0e-6\n";

std::string Replace(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

void WriteFixtures(const ScratchDir& dir) {
  dir.Write("good.yaml", kGoodModel);
  dir.Write("broken.yaml", "name: test-model\nhidden_size: [3584,\nintermediate_size: 18944\n");
  dir.Write("unknown_key.yaml", Replace(kGoodModel, "hidden_size:", "hidden_sise:"));
  dir.Write("string_number.yaml",
            Replace(kGoodModel, "num_hidden_layers: 28", "num_hidden_layers: many"));
  dir.Write("heads.yaml", Replace(kGoodModel, "num_key_value_heads: 4", "num_key_value_heads: 5"));
  dir.Write("config.json", "{\"model_type\": \"qwen2\", \"hidden_size\": \"wide\"}\n");
  dir.Write("machine.yaml",
            "name: m\ngpu: h200\nhost_ram_gib: 125\nhost_reserved_gib: 8\nhost_memory_gbs: 200\n"
            "fans: 4\n");
}

// --- bad input: one table, one test per row ---------------------------------------------------

struct BadInputCase {
  std::string name;
  std::vector<std::string> args;      // "@DIR@" is replaced by the test's scratch directory
  std::vector<std::string> expected;  // substrings of the error line
  // Add "--output @DIR@/out.json" and check that neither it nor a temp file appears.
  bool add_output = true;
};

// gtest prints parameters on failure; the name and arguments say more than the raw bytes.
void PrintTo(const BadInputCase& c, std::ostream* os) {
  *os << c.name << ":";
  for (const std::string& a : c.args) *os << " " << a;
}

// A step ctxtrain recorded on an H200 (traces/recorded/README.md).
const std::string kRecordedTrace =
    std::string(CTXPLAN_SOURCE_DIR) + "/traces/recorded/qwen2.5-7b-32k-k64-h200.ctxtrace";

const std::vector<BadInputCase>& BadInputCases() {
  static const std::vector<BadInputCase> cases = {
      // Model files and names.
      {"MalformedModelYaml",
       {"plan", "--model", "@DIR@/broken.yaml"},
       {"broken.yaml", "malformed YAML", "expected a model"}},
      {"ModelYamlUnknownKey",
       {"plan", "--model", "@DIR@/unknown_key.yaml"},
       {"unknown_key.yaml", "'hidden_sise'", "unknown key", "accepted keys:", "hidden_size,"}},
      {"ModelYamlStringForNumber",
       {"plan", "--model", "@DIR@/string_number.yaml"},
       {"string_number.yaml", "'num_hidden_layers'", "'many' is not a number",
        "expected an integer"}},
      {"ModelYamlHeadsNotDivisible",
       {"plan", "--model", "@DIR@/heads.yaml"},
       {"heads.yaml", "num_key_value_heads", "not divisible", "expected a divisor"}},
      {"HfConfigJsonStringForNumber",
       {"plan", "--model", "@DIR@/config.json"},
       {"config.json", "'hidden_size'", "'wide', not a number", "expected an integer"}},
      {"MissingModelFile",
       {"max-context", "--model", "@DIR@/missing.yaml"},
       {"--model", "missing.yaml", "No such file", "accepted: a catalogue model"}},
      {"ModelPathIsDirectory",
       {"plan", "--model", "@DIR@/"},
       {"--model", "it is a directory", "accepted: a catalogue model"}},
      {"UnknownModelName",
       {"plan", "--model", "gpt-9000"},
       {"unknown model 'gpt-9000'", "qwen2.5-7b", "config.json"}},
      // GPUs and machines.
      {"UnknownGpu", {"plan", "--gpu", "tpu-v9"}, {"unknown GPU 'tpu-v9'", "h200"}},
      {"MissingGpuFile",
       {"plan", "--gpu", "@DIR@/gpu.yaml"},
       {"--gpu", "gpu.yaml", "accepted: a catalogue GPU"}},
      {"UnknownMachine",
       {"max-context", "--machine", "h900-1t"},
       {"unknown machine 'h900-1t'", "h200-125g", "h200-512g"}},
      {"MachineYamlUnknownKey",
       {"max-context", "--machine", "@DIR@/machine.yaml"},
       {"machine.yaml", "'fans'", "unknown key", "host_ram_gib"}},
      // The GPU tier of the page store.
      {"GpuTierNotASetting",
       {"plan", "--gpu-tier", "most"},
       {"--gpu-tier", "'most' is not a setting", "accepted: off, auto, all or a size"}},
      {"GpuTierMarginNotASize",
       {"max-context", "--gpu-tier", "auto", "--gpu-tier-margin", "lots"},
       {"--gpu-tier-margin"}},
      {"MachineAndGpuTogether",
       {"plan", "--machine", "h200-125g", "--gpu", "h200"},
       {"--machine and --gpu", "accepted: --machine PRESET, or --gpu GPU"}},
      {"HostRamUnknownUnit",
       {"plan", "--host-ram", "12 parsecs"},
       {"--host-ram", "'12 parsecs'", "unknown unit 'parsecs'", "GiB"}},
      {"HostRamBelowOsReserve",
       {"plan", "--host-ram", "4GiB"},
       {"--host-ram", "4.00 GiB", "8.00 GiB"}},
      {"HostRamBelowOsReserveWithGpu",
       {"plan", "--gpu", "h200", "--host-ram", "4GiB"},
       {"--host-ram", "4.00 GiB", "8.00 GiB"}},
      {"HostRamAbsurd",
       {"max-context", "--host-ram", "100TiB"},
       {"--host-ram", "absurdly large", "at most"}},
      // Sizes.
      {"ChunkNotMultipleOfPage",
       {"plan", "--chunk", "1000", "--page", "128"},
       {"--chunk", "1000", "not a multiple of the page size 128", "accepted"}},
      {"ChunkZero", {"plan", "--chunk", "0"}, {"--chunk: '0'", "accepted: a positive integer"}},
      {"PageNegative",
       {"max-context", "--page", "-5"},
       {"--page: '-5'", "negative", "accepted: a positive integer"}},
      {"ContextZero",
       {"plan", "--context", "0"},
       {"--context: '0'", "accepted: a positive integer"}},
      {"ContextNegative",
       {"plan", "--context", "-1"},
       {"--context: '-1'", "accepted: a positive integer"}},
      {"ContextScientific",
       {"plan", "--context", "1e15"},
       {"--context: '1e15'", "accepted: a positive integer"}},
      {"ContextAbsurd",
       {"plan", "--context", "99999999999999"},
       {"--context", "out of range", "accepted: 1 to 2147483648"}},
      {"ContextOverflowsInt64",
       {"plan", "--context", "99999999999999999999999"},
       {"--context", "too large", "accepted"}},
      {"ContextGarbage",
       {"plan", "--context", "garbage"},
       {"--context: 'garbage'", "accepted: a positive integer"}},
      {"ContextWithNewlineStaysOneLine",
       {"plan", "--context", "12\nabc"},
       {"--context: '12\\nabc'", "accepted"}},
      {"BudgetZero",
       {"plan", "--budget", "0"},
       {"--budget: '0'", "accepted: a positive number of pages, or 'all'"}},
      {"BudgetNotANumber",
       {"max-context", "--budget", "x"},
       {"--budget: 'x'", "accepted: a positive number of pages, or 'all'"}},
      // Choices.
      {"OffloadMaybe", {"plan", "--offload", "maybe"}, {"--offload: 'maybe'", "accepted: on, off"}},
      {"SelectionOverlapOutOfRange",
       {"plan", "--selection", "overlap:2"},
       {"--selection: 'overlap:2'", "overlap:F with F in [0, 1]"}},
      {"SelectionDisjointScaleZero",
       {"plan", "--selection", "disjoint:0"},
       {"--selection: 'disjoint:0'", "disjoint:S with S in (0, 100]"}},
      {"SelectionNoTrace", {"selection", "@DIR@/missing.ctxtrace"}, {"missing.ctxtrace"}},
      {"SelectionDenseTrace",
       {"selection", kRecordedTrace},
       {"no chunk whose page union", "accepted: a page-sparse run"}},
      {"GradDtypeFp8",
       {"plan", "--grad-dtype", "fp8"},
       {"--grad-dtype: 'fp8'", "accepted: bf16, fp32"}},
      {"OptimizerUnknown",
       {"plan", "--optimizer", "sgd"},
       {"--optimizer: 'sgd'", "accepted: adamw-gpu, adamw-host, none"}},
      {"PathUnknown",
       {"plan", "--path", "exact"},
       {"--path: 'exact'", "accepted: event, analytic"}},
      {"PriceOutOfRange",
       {"plan", "--train-tokens", "1G", "--price-per-gpu-hour", "-3"},
       {"--price-per-gpu-hour", "accepted"}},
      // The command line itself (CLI11's parse errors).
      {"UnknownFlag", {"plan", "--frobnicate", "3"}, {"--frobnicate", "ctxplan --help"}},
      {"MissingFlagValue",
       {"plan", "--context"},
       {"--context", "ctxplan --help"},
       /*add_output=*/false},
      {"NoSubcommand", {}, {"subcommand", "ctxplan --help"}, /*add_output=*/false},
      // Sweeps: one bad value anywhere in a list fails the whole sweep before any output.
      {"SweepOneBadChunk",
       {"sweep", "--context", "32K", "--chunk", "4096,1000"},
       {"--chunk", "1000", "not a multiple of the page size 128"}},
      {"SweepEmptyListItem",
       {"sweep", "--context", "32K,,64K"},
       {"--context: ''", "accepted: a positive integer"}},
      {"SweepBadOffloadLast",
       {"sweep", "--context", "32K", "--offload", "on,off,maybe"},
       {"--offload: 'maybe'", "accepted: on, off"}},
      {"SweepFormatXml",
       {"sweep", "--context", "32K", "--format", "xml"},
       {"--format: 'xml'", "accepted: csv, json"}},
      // Outputs that cannot be written.
      {"TimelineUnwritableProcPath",
       {"timeline", "--context", "16K", "-o", "/proc/forbidden/x.json"},
       {"--output", "/proc/forbidden/x.json", "accepted: a file in an existing, writable"},
       /*add_output=*/false},
      {"TimelineMissingDirectory",
       {"timeline", "--context", "16K", "-o", "@DIR@/no/such/dir/x.json"},
       {"--output", "no/such/dir/x.json", "accepted: a file in an existing, writable"},
       /*add_output=*/false},
      {"PlanOutputIsDirectory",
       {"plan", "--context", "16K", "--output", "@DIR@"},
       {"--output", "accepted: a file in an existing, writable"},
       /*add_output=*/false},
      // Several GPUs: a count, at most one stage a layer.
      {"PlanGpusZero", {"plan", "--gpus", "0"}, {"--gpus", "'0'", "accepted: 1 to 4096 GPUs"}},
      {"PlanGpusMoreThanLayers",
       {"plan", "--gpus", "29"},
       {"--gpus", "29", "accepted: 1 to the model's 28 layers"}},
      {"PlanTiedModelOverFourGpus",
       {"plan", "--model", "llama-3.2-1b", "--gpus", "4"},
       {"--gpus", "tied to the embedding", "accepted: 1 or 2 GPUs with a tied model"}},
      {"SweepGpusNotACount",
       {"sweep", "--gpus", "1,two"},
       {"--gpus", "'two'", "accepted: an integer >= 0"}},
      // Replay.
      {"ReplayByChunkUnknownKind",
       {"replay", kRecordedTrace, "--by-chunk", "attention_sideways"},
       {"--by-chunk", "'attention_sideways'", "not an op kind of this trace",
        "accepted: attention_bwd.paged,"}},
      // --host-ram alone applies to the trace's machine, with the bounds it has everywhere.
      {"ReplayHostRamTooSmall",
       {"replay", kRecordedTrace, "--host-ram", "1GiB"},
       {"--host-ram", "1.00 GiB", "expected more"}},
      {"ReplayMachineAndGpu",
       {"replay", kRecordedTrace, "--machine", "h100-125g", "--gpu", "h100-sxm"},
       {"--machine and --gpu", "accepted:"}},
  };
  return cases;
}

class BadInputTest : public ::testing::TestWithParam<BadInputCase> {
 protected:
  void SetUp() override { WriteFixtures(dir_); }
  std::string Expand(const std::string& arg) const {
    std::string s = arg;
    for (size_t at; (at = s.find("@DIR@")) != std::string::npos;)
      s.replace(at, 5, dir_.path().string());
    return s;
  }
  ScratchDir dir_;
};

TEST_P(BadInputTest, OneLineExitTwoNoOutput) {
  const BadInputCase& c = GetParam();
  std::vector<std::string> args;
  for (const std::string& a : c.args) args.push_back(Expand(a));
  const fs::path out = dir_.path() / "out.json";
  if (c.add_output) {
    args.push_back("--output");
    args.push_back(out.string());
  }
  const RunResult r = RunCtxplan(args, dir_.path());
  std::vector<std::string> expected;
  for (const std::string& e : c.expected) expected.push_back(Expand(e));
  ExpectBadInput(args, r, expected);
  if (c.add_output) ExpectNoOutputFile(out);
  // Explicit bad paths: nothing may appear there either (a directory named as the output stays).
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (c.add_output || (args[i] != "-o" && args[i] != "--output")) continue;
    const fs::path bad = fs::path(args[i + 1]).lexically_normal();
    if (fs::is_directory(bad)) {
      ExpectNoTempFile(bad);
    } else {
      ExpectNoOutputFile(bad);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cli, BadInputTest, ::testing::ValuesIn(BadInputCases()),
                         [](const ::testing::TestParamInfo<BadInputCase>& info) {
                           return info.param.name;
                         });

// --- bad input around files that exist ----------------------------------------------------------

// The fixtures are broken in one way each: the valid original must load, or the cases above would
// prove nothing.
TEST(CliTest, ValidFixtureModelLoads) {
  ScratchDir dir;
  WriteFixtures(dir);
  const std::vector<std::string> args = {
      "plan",   "--model", (dir.path() / "good.yaml").string(), "--context", "32K",
      "--path", "analytic"};
  const RunResult r = RunCtxplan(args, dir.path());
  EXPECT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("test-model"), std::string::npos);
}

// `ctxplan plan` of the default model at 1M on `machine` (the analytic path) with `extra`
// flags; its standard output, the exit code checked.
std::string PlanAt1M(const ScratchDir& dir, const std::string& machine,
                     const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"plan", "--machine", machine,   "--context",
                                   "1M",   "--path",    "analytic"};
  args.insert(args.end(), extra.begin(), extra.end());
  const RunResult r = RunCtxplan(args, dir.path());
  EXPECT_EQ(r.exit_code, 0) << Describe(args, r);
  return r.out;
}

// A plan over several GPUs of a machine whose host links were never measured says so: each GPU
// is taken at its link's rates alone, which the one host measured did not give them. One GPU,
// or offload off, says nothing; --json carries it.
TEST(CliTest, PlanSaysWhenTheHostLinksAreUnmeasured) {
  ScratchDir dir;
  auto plan = [&](const std::vector<std::string>& extra) {
    return PlanAt1M(dir, "h200-x8", extra);
  };
  const std::string four = plan({"--gpus", "4"});
  EXPECT_NE(four.find("host links: not measured on h200-x8: each of the 4 GPUs copying at once is "
                      "taken at "),
            std::string::npos)
      << four;
  EXPECT_NE(four.find("`ctxplan-measure --only links` there"), std::string::npos) << four;
  EXPECT_EQ(plan({"--gpus", "1"}).find("host links:"), std::string::npos);
  EXPECT_EQ(plan({"--gpus", "4", "--offload", "off"}).find("host links:"), std::string::npos);
  const std::string json = plan({"--gpus", "4", "--json"});
  EXPECT_NE(json.find("\"shared\":false,\"sharing_unmeasured\":true}"), std::string::npos) << json;
  EXPECT_NE(plan({"--gpus", "1", "--json"}).find("\"sharing_unmeasured\":false}"),
            std::string::npos);
}

// On a machine whose host links were measured, a plan over its GPUs says what each copies at
// while the others copy (the step time includes it); one GPU, or offload off, says nothing.
TEST(CliTest, PlanSaysWhenTheGpusShareTheHostLinks) {
  ScratchDir dir;
  auto plan = [&](const std::vector<std::string>& extra) {
    return PlanAt1M(dir, "h100-x4", extra);
  };
  const std::string four = plan({"--gpus", "4"});
  EXPECT_NE(four.find("host links: the 4 GPUs of a machine copy at once and share 160.4 GB/s up "
                      "and 120.1 down (measured); each copies at 40.1 / 30.0 GB/s"),
            std::string::npos)
      << four;
  EXPECT_EQ(plan({"--gpus", "1"}).find("host links:"), std::string::npos);
  EXPECT_EQ(plan({"--gpus", "4", "--offload", "off"}).find("host links:"), std::string::npos);
  const std::string json = plan({"--gpus", "4", "--json"});
  EXPECT_NE(json.find("\"host_link\":{\"h2d_gbs\":40.1,\"d2h_gbs\":30.025,\"shared\":true,"
                      "\"sharing_unmeasured\":false}"),
            std::string::npos)
      << json;
}

// calibrate on ctxplan-measure's links rows alone prints the machine's keys, then says in one
// line why no GPU profile comes of them (exit 2, nothing written).
TEST(CliTest, CalibrateOnLinksAlonePrintsTheMachineKeys) {
  ScratchDir dir;
  const fs::path out = dir.path() / "profile.yaml";
  const std::vector<std::string> args = {
      "calibrate", "--samples",
      std::string(CTXPLAN_SOURCE_DIR) + "/models/machine/calibration/h100-x4-links.csv", "-o",
      out.string()};
  const RunResult r = RunCtxplan(args, dir.path());
  EXPECT_EQ(r.exit_code, 2) << Describe(args, r);
  EXPECT_NE(r.out.find("host_links_h2d_gbs: 160.4 and host_links_d2h_gbs: 120.1"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.err.find("holds the links and readback groups alone"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_FALSE(fs::exists(out));
}

// calibrate --report writes every sample against the fitted model as CSV: as many rows as the
// printed groups count, each group's largest |predicted / measured - 1| the printed max. A report
// path that cannot be written is refused in one line, before the profile is.
TEST(CliTest, CalibrateReportsEverySample) {
  ScratchDir dir;
  const std::string samples =
      std::string(CTXPLAN_SOURCE_DIR) + "/models/gpu/calibration/h200-samples.csv";
  const fs::path out = dir.path() / "h200.yaml", report = dir.path() / "fit.csv";
  const std::vector<std::string> args = {"calibrate",  "--samples", samples,
                                         "--gpu",      "h200",      "-o",
                                         out.string(), "--report",  report.string()};
  const RunResult r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  std::istringstream printed(r.out);
  std::map<std::string, std::pair<int, double>> groups;  // group -> samples, max error (%)
  for (std::string line; std::getline(printed, line);) {
    std::istringstream words(line);
    std::string group, word;
    int n = 0;
    double median = 0, max = 0;
    if (line.rfind("  ", 0) == 0 && (words >> group >> n >> word) && word == "samples" &&
        (words >> word >> median >> word >> word >> max))
      groups[group] = {n, max};
  }
  ASSERT_GE(groups.size(), 8u) << r.out;
  std::istringstream csv(ReadAll(report));
  std::string line;
  std::getline(csv, line);
  EXPECT_EQ(line.rfind("group,op,m,n,k,", 0), 0u) << line;
  std::map<std::string, std::pair<int, double>> rows;
  while (std::getline(csv, line)) {
    const std::string group = line.substr(0, line.find(','));
    const double ratio = std::stod(line.substr(line.rfind(',') + 1));
    auto& [n, max] = rows[group];
    ++n;
    max = std::max(max, 100.0 * std::abs(ratio - 1.0));
  }
  for (const auto& [group, expect] : groups) {
    SCOPED_TRACE(group);
    EXPECT_EQ(rows[group].first, expect.first);
    EXPECT_NEAR(rows[group].second, expect.second, 0.06);  // printed to 0.1%
  }
  EXPECT_EQ(rows.size(), groups.size());

  const fs::path out2 = dir.path() / "h200-2.yaml";
  const std::vector<std::string> bad = {
      "calibrate",   "--samples", samples,
      "--gpu",       "h200",      "-o",
      out2.string(), "--report",  (dir.path() / "no" / "such" / "fit.csv").string()};
  const RunResult b = RunCtxplan(bad, dir.path());
  EXPECT_EQ(b.exit_code, 2) << Describe(bad, b);
  EXPECT_EQ(std::count(b.err.begin(), b.err.end(), '\n'), 1) << b.err;
  EXPECT_FALSE(fs::exists(out2));
}

// calibrate --history keeps the calibrated profile --output replaces, as NAME-DATE.yaml, so that
// the runs of its kernels stay judged by it (models/gpu/history/). Refused in one line, before
// any fit and with nothing written: an output that is no calibration, or another file of that
// name already kept.
TEST(CliTest, CalibrateKeepsTheProfileItReplaces) {
  ScratchDir dir;
  const std::string committed = test::CommittedProfile("h200");
  const std::string out = dir.Write("h200.yaml", committed);
  const fs::path history = dir.path() / "history";
  // Kept under the committed calibration's date, its colon dropped: h200-2026-11-27T0945Z.yaml.
  const std::string date = test::ProfileDate("h200");
  ASSERT_FALSE(date.empty());
  std::string stamp = date;
  stamp.erase(std::remove(stamp.begin(), stamp.end(), ':'), stamp.end());
  const fs::path kept = history / ("h200-" + stamp + ".yaml");
  const std::string samples =
      std::string(CTXPLAN_SOURCE_DIR) + "/models/gpu/calibration/h200-samples.csv";
  auto calibrate = [&](const std::string& output) {
    const std::vector<std::string> args = {"calibrate", "--samples", samples,
                                           "--gpu",     "h200",      "-o",
                                           output,      "--history", history.string()};
    return std::pair{args, RunCtxplan(args, dir.path())};
  };
  // Another file of the kept name: refused.
  fs::create_directories(history);
  std::ofstream(kept) << "another profile\n";
  {
    const auto [args, r] = calibrate(out);
    EXPECT_EQ(r.exit_code, 2) << Describe(args, r);
    EXPECT_NE(r.err.find("exists and differs"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(ReadAll(out), committed);
  }
  fs::remove(kept);
  {
    const auto [args, r] = calibrate(out);
    ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
    EXPECT_NE(r.out.find("kept the replaced profile (calibrated " + date + ")"), std::string::npos)
        << r.out;
    EXPECT_EQ(ReadAll(kept), committed);
  }
  // A profile scaled from the H200's holds no calibration of its own to keep.
  const std::string spec =
      dir.Write("l40s.yaml", ReadAll(std::string(CTXPLAN_SOURCE_DIR) + "/models/gpu/l40s.yaml"));
  {
    const auto [args, r] = calibrate(spec);
    EXPECT_EQ(r.exit_code, 2) << Describe(args, r);
    EXPECT_NE(r.err.find("holds no calibration of its own"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// A failed run never touches an existing output file: the reader keeps the previous result.
TEST(CliTest, BadInputKeepsExistingOutputFile) {
  ScratchDir dir;
  const std::string out = dir.Write("previous.txt", "previous result\n");
  const std::vector<std::string> args = {"sweep",     "--context", "32K,64K", "--chunk",
                                         "4096,1000", "--output",  out};
  const RunResult r = RunCtxplan(args, dir.path());
  ExpectBadInput(args, r, {"--chunk", "1000"});
  EXPECT_EQ(ReadAll(out), "previous result\n");
}

// A write error on stdout (full disk, closed pipe) must not pass for success.
TEST(CliTest, StdoutWriteFailureIsAnError) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  ScratchDir dir;
  const std::vector<std::string> args = {"plan", "--context", "32K", "--path", "analytic"};
  const RunResult r = RunCtxplan(args, dir.path(), "/dev/full");
  EXPECT_EQ(r.exit_code, 2) << Describe(args, r);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find("standard output"), std::string::npos) << r.err;
}

// --- good input ----------------------------------------------------------------------------------

// Runs python3 on a script with arguments; skips the test when python3 is not installed.
#define RUN_PYTHON_OR_SKIP(result, scratch, ...)                                 \
  do {                                                                           \
    int spawn_errno = 0;                                                         \
    result = RunArgv({"python3", "-c", __VA_ARGS__}, scratch, "", &spawn_errno); \
    if (spawn_errno == ENOENT) GTEST_SKIP() << "python3 not found";              \
  } while (false)

// Validates `text` as JSON with Python's json module (an independent parser).
#define EXPECT_VALID_JSON_OR_SKIP(text, dir)                                              \
  do {                                                                                    \
    const std::string json_file = (dir).Write("check.json", text);                        \
    RunResult py;                                                                         \
    RUN_PYTHON_OR_SKIP(py, (dir).path(), "import json,sys; json.load(open(sys.argv[1]))", \
                       json_file);                                                        \
    EXPECT_EQ(py.exit_code, 0) << "not valid JSON: " << py.err;                           \
  } while (false)

int64_t JsonInt(const std::string& json, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(json, m, std::regex("\"" + key + "\":(-?[0-9]+)"))) return -1;
  return std::stoll(m[1]);
}

std::string JsonString(const std::string& json, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(json, m, std::regex("\"" + key + "\":\"([^\"]*)\""))) return "";
  return m[1];
}

// DESIGN.md: on the H200 test machine (125 GiB host RAM) pinned host memory, not the GPU, caps
// Qwen2.5-7B near 1M tokens.
TEST(CliTest, MaxContextJsonDefaults) {
  ScratchDir dir;
  const std::vector<std::string> args = {"max-context", "--json"};
  const RunResult r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_EQ(r.err, "");
  const int64_t tokens = JsonInt(r.out, "max_context_tokens");
  EXPECT_GE(tokens, 900'000) << r.out.substr(0, 300);
  EXPECT_LE(tokens, 1'300'000);
  EXPECT_EQ(JsonString(r.out, "limit"), "host-memory");
  EXPECT_VALID_JSON_OR_SKIP(r.out, dir);
}

// The forward and backward rates of a JSON object `key` in ctxplan's --json output.
std::pair<double, double> JsonRates(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\"");
  EXPECT_NE(at, std::string::npos) << key;
  if (at == std::string::npos) return {0.0, 0.0};
  return {std::stod(json.substr(json.find("\"forward\":", at) + 10)),
          std::stod(json.substr(json.find("\"backward\":", at) + 11))};
}

// `args` run as given and again with --json: the text output, then the JSON.
std::pair<RunResult, RunResult> RunTextAndJson(std::vector<std::string> args,
                                               const fs::path& scratch) {
  RunResult text = RunCtxplan(args, scratch);
  args.push_back("--json");
  RunResult json = RunCtxplan(args, scratch);
  return {std::move(text), std::move(json)};
}

// A page size off the kernels' fast path: plan says how slow, from the GPU's measured profile
// (the H100's of 2026-11-26T23:25Z, kept in models/gpu/history: the page-sparse backward over pages
// of 96 at ~0.6 of page 128's rate per FLOP, before the gathered blocks; the forward at page 128's
// rate since its groups of 16 rows), and names page sizes that run at full rate; at 128 it says
// nothing. With the H100's profile of 2026-11-27 (gathered blocks) page 96 runs at full rate.
TEST(CliTest, PlanSaysWhenThePageSizeIsOffTheFastPath) {
  ScratchDir dir;
  const std::string before_gathered =
      std::string(CTXPLAN_SOURCE_DIR) + "/models/gpu/history/h100-sxm-2026-11-26T2325Z.yaml";
  const std::vector<std::string> slow = {
      "plan",       "--model",  "llama-3.1-8b", "--gpu",     before_gathered,
      "--host-ram", "125GiB",   "--chunk",      "3072",      "--page",
      "96",         "--budget", "48",           "--context", "32K"};
  const auto [r, j] = RunTextAndJson(slow, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(slow, r);
  ASSERT_EQ(j.exit_code, 0) << Describe(slow, j) << " (with --json)";
  EXPECT_NE(r.out.find("attention over pages of 96: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("at full rate with --page 128"), std::string::npos) << r.out;
  const auto [forward, backward] = JsonRates(j.out, "attention_page_rate_vs_128");
  EXPECT_GT(forward, 0.9);
  EXPECT_LT(forward, 1.1);
  EXPECT_LT(backward, 0.9);
  EXPECT_GT(backward, 0.1);
  std::vector<std::string> fast = slow;
  fast[10] = "128";
  const RunResult f = RunCtxplan(fast, dir.path());
  ASSERT_EQ(f.exit_code, 0) << Describe(fast, f);
  EXPECT_EQ(f.out.find("attention over pages of"), std::string::npos) << f.out;
  const std::vector<std::string> today = {
      "plan",   "--model", "llama-3.1-8b", "--machine", "h100-125g", "--chunk", "3072",
      "--page", "96",      "--budget",     "48",        "--context", "32K"};
  const auto [t, tj] = RunTextAndJson(today, dir.path());
  ASSERT_EQ(tj.exit_code, 0) << Describe(today, tj);
  EXPECT_EQ(t.out.find("attention over pages of"), std::string::npos) << t.out;
  const auto [today_forward, today_backward] = JsonRates(tj.out, "attention_page_rate_vs_128");
  EXPECT_GT(today_backward, 0.9);
  EXPECT_GT(today_forward, 0.9);
}

// A page size no table of the GPU's profile holds (40: the forward's row cursor, not in the
// calibration grid) takes the nearest measured size's rate: plan says it was not measured, in
// text and JSON, even where that rate is full; a measured size (96) is not flagged.
TEST(CliTest, PlanSaysWhenThePageSizeWasNotMeasured) {
  ScratchDir dir;
  std::vector<std::string> args = {"plan",   "--model",   "qwen2.5-7b", "--chunk", "3840",
                                   "--page", "40",        "--budget",   "all",     "--context",
                                   "64K",    "--machine", "h200-125g"};
  const auto [t, j] = RunTextAndJson(args, dir.path());
  ASSERT_EQ(t.exit_code, 0) << Describe(args, t);
  ASSERT_EQ(j.exit_code, 0) << Describe(args, j);
  EXPECT_NE(t.out.find("attention over pages of 40: not measured on this GPU; taken as the "
                       "nearest measured size's rate"),
            std::string::npos)
      << t.out;
  EXPECT_NE(t.out.find("at full rate with --page 64, 128, 256"), std::string::npos) << t.out;
  EXPECT_NE(j.out.find("\"measured\":false"), std::string::npos) << j.out;
  args[6] = "96";
  args[2] = "llama-3.1-8b";
  args[4] = "3072";
  const auto [t96, j96] = RunTextAndJson(args, dir.path());
  ASSERT_EQ(j96.exit_code, 0) << Describe(args, j96);
  EXPECT_EQ(t96.out.find("not measured on this GPU"), std::string::npos) << t96.out;
  EXPECT_NE(j96.out.find("\"measured\":true"), std::string::npos) << j96.out;
}

// A GPU profile calibrated before a kernel changed for the options planned: plan says so, in
// text and JSON (sim/kernel_changes.h). The H200's profile dated 2026-11-24 predates, at pages of
// 96, the page cursor of 2026-11-26 and the groups of 16 rows of T18:30Z, the backward's bulk
// reduces of 2026-11-27T06:15Z, the morning's flushed exponentials, gathered blocks (off page 128)
// and own blocks first; at 128, the bulk reduces, the exponentials, the own blocks first and the
// gathered blocks at every page (T09:12Z). Dated between the gathered blocks and the own blocks
// first, it predates only the latter at 96.
TEST(CliTest, PlanSaysWhenTheProfilePredatesAKernelChange) {
  ScratchDir dir;
  const fs::path old_h200 = dir.path() / "h200-2026-11-24.yaml";
  {
    const std::string yaml = test::ProfileRedated("h200", "2026-11-24");
    ASSERT_FALSE(yaml.empty());
    std::ofstream(old_h200) << yaml;
  }
  auto plan = [&](const std::vector<std::string>& machine, const std::string& page) {
    std::vector<std::string> args = {"plan", "--model",   "llama-3.1-8b", "--chunk",
                                     "3072", "--page",    page,           "--budget",
                                     "48",   "--context", "32K"};
    args.insert(args.end(), machine.begin(), machine.end());
    const auto [t, r] = RunTextAndJson(args, dir.path());
    EXPECT_EQ(r.exit_code, 0) << Describe(args, r) << " (with --json)";
    EXPECT_EQ(t.exit_code, 0) << Describe(args, t);
    return std::pair{r.out, t.out};
  };
  const std::vector<std::string> old = {"--gpu", old_h200.string(), "--host-ram", "125GiB"};
  const auto [old_json, old_text] = plan(old, "96");
  EXPECT_NE(old_json.find(
                "\"profile_predates_kernel_changes\":[\"2026-11-26\",\"2026-11-26T18:30Z\","
                "\"2026-11-27T06:15Z\",\"2026-11-27T08:36Z\",\"2026-11-27T08:37Z\","
                "\"2026-11-27T08:52Z\",\"2026-11-27T14:10Z\",\"2026-11-27T16:20Z\",\"2026-11-"
                "27T19:15Z\",\"2026-11-28T02:25Z\",\"2026-11-28T04:45Z\",\"2026-11-28T07:30Z\"]"),
            std::string::npos)
      << old_json;
  EXPECT_NE(old_text.find("note: this GPU's kernel times were calibrated on 2026-11-24, before "
                          "2026-11-26"),
            std::string::npos)
      << old_text;
  EXPECT_NE(old_text.find("re-run `ctxplan calibrate`"), std::string::npos);
  const auto [old_128, old_128_text] = plan(old, "128");
  EXPECT_NE(old_128.find("\"profile_predates_kernel_changes\":[\"2026-11-27T06:15Z\","
                         "\"2026-11-27T08:36Z\",\"2026-11-27T08:52Z\",\"2026-11-27T09:12Z\","
                         "\"2026-11-27T14:10Z\",\"2026-11-27T16:20Z\",\"2026-11-27T19:15Z\","
                         "\"2026-11-28T02:25Z\",\"2026-11-28T04:45Z\",\"2026-11-28T07:30Z\"]"),
            std::string::npos)
      << old_128;
  // A calibration between changes predates only the later ones.
  const fs::path mid_h200 = dir.path() / "h200-2026-11-27T0840Z.yaml";
  std::ofstream(mid_h200) << test::ProfileRedated("h200", "2026-11-27T08:40Z");
  const auto [mid_json, mid_text] =
      plan({"--gpu", mid_h200.string(), "--host-ram", "125GiB"}, "96");
  EXPECT_NE(mid_json.find("\"profile_predates_kernel_changes\":[\"2026-11-27T08:52Z\","
                          "\"2026-11-27T14:10Z\",\"2026-11-27T16:20Z\",\"2026-11-27T19:15Z\","
                          "\"2026-11-28T02:25Z\",\"2026-11-28T04:45Z\",\"2026-11-28T07:30Z\"]"),
            std::string::npos)
      << mid_json;
  EXPECT_NE(mid_text.find("note: this GPU's kernel times were calibrated on 2026-11-27T08:40Z"),
            std::string::npos)
      << mid_text;
}

// A trace recorded with kernels its GPU's profile does not describe: replay says which change lies
// between the run's date and the calibration's, in text and JSON. The recorded H200 trace
// (2026-11-22) against the H200's profile dated 2026-11-23: none; dated 2026-11-28: at pages of
// 128, head dim 128, the backward's bulk reduces, the flushed exponentials, the own blocks first,
// the gathered blocks at every page and the TMA loads of 2026-11-27.
TEST(CliTest, ReplaySaysWhenTheRunAndTheProfileStraddleAKernelChange) {
  ScratchDir dir;
  const std::string yaml = test::ProfileRedated("h200", "2026-11-28");
  ASSERT_FALSE(yaml.empty());
  const std::string later = dir.Write("h200-later.yaml", yaml);
  const std::string same = dir.Write("h200-same.yaml", test::ProfileRedated("h200", "2026-11-23"));
  const auto [same_text, same_json] = [&] {
    const std::vector<std::string> args = {"replay", kRecordedTrace, "--gpu",
                                           same,     "--host-ram",   "125GiB"};
    return RunTextAndJson(args, dir.path());
  }();
  ASSERT_EQ(same_text.exit_code, 0) << same_text.err;
  EXPECT_EQ(same_text.out.find("note: this run was recorded on"), std::string::npos);
  EXPECT_NE(same_json.out.find("\"kernel_changes_between_run_and_profile\":[]"), std::string::npos)
      << same_json.out;
  const std::vector<std::string> args = {"replay", kRecordedTrace, "--gpu",
                                         later,    "--host-ram",   "125GiB"};
  const auto [text, json] = RunTextAndJson(args, dir.path());
  ASSERT_EQ(text.exit_code, 0) << Describe(args, text);
  EXPECT_NE(text.out.find("note: this run was recorded on 2026-11-22"), std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("calibrated on 2026-11-28; between the two, on 2026-11-27T06:15Z"),
            std::string::npos)
      << text.out;
  EXPECT_NE(json.out.find("\"kernel_changes_between_run_and_profile\":[\"2026-11-27T06:15Z\","
                          "\"2026-11-27T08:36Z\",\"2026-11-27T08:52Z\",\"2026-11-27T09:12Z\","
                          "\"2026-11-27T14:10Z\",\"2026-11-27T16:20Z\",\"2026-11-27T19:15Z\"]"),
            std::string::npos)
      << json.out;
}

// Head dim 64 runs attention slower per FLOP than 128 (issue 14: where a shape cannot be made
// fast, the planner knows its rate and says so): Llama-3.2-1B gets the note, Qwen2.5-7B not.
TEST(CliTest, PlanSaysTheHeadDimRate) {
  ScratchDir dir;
  const std::vector<std::string> small = {"plan", "--model", "llama-3.2-1b", "--context", "64K"};
  const auto [r, j] = RunTextAndJson(small, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(small, r);
  ASSERT_EQ(j.exit_code, 0) << Describe(small, j) << " (with --json)";
  EXPECT_NE(r.out.find("attention at head dim 64: "), std::string::npos) << r.out;
  const auto [forward, backward] = JsonRates(j.out, "attention_head_dim_rate_vs_128");
  EXPECT_GT(forward, 0.3);
  EXPECT_LT(forward, 0.9);
  EXPECT_GT(backward, 0.3);
  EXPECT_LT(backward, 0.9);
  const std::vector<std::string> large = {"plan", "--context", "64K"};
  const RunResult q = RunCtxplan(large, dir.path());
  ASSERT_EQ(q.exit_code, 0) << Describe(large, q);
  EXPECT_EQ(q.out.find("attention at head dim"), std::string::npos) << q.out;
}

// Page-sparse attention's backward at a small GQA group runs slower per FLOP (a gathered key
// block serves 2 x group query items for its fixed cost; the key blocks over the union that
// ctxtrain takes at groups 1-2 less so): a model of one KV head a query head gets the note and its
// rate in --json where the profile times gathered blocks; Qwen2.5-7B (group 7) no note, a dense run
// rate 1.
TEST(CliTest, PlanSaysTheSmallGroupSparseBackwardRate) {
  ScratchDir dir;
  dir.Write("mha.yaml", Replace(kGoodModel, "num_key_value_heads: 4", "num_key_value_heads: 28"));
  auto rate = [](const std::string& json) {
    const std::string key = "\"attention_sparse_backward_rate_vs_group_8\":";
    const size_t at = json.find(key);
    EXPECT_NE(at, std::string::npos) << json;
    return at == std::string::npos ? -1.0 : std::stod(json.substr(at + key.size()));
  };
  // The H100's profile has not timed the union's key blocks that group 1 takes: gathered blocks'
  // time, the rate note and the untimed note.
  const std::vector<std::string> h100 = {"plan",      "--model", (dir.path() / "mha.yaml").string(),
                                         "--context", "64K",     "--gpu",
                                         "h100-sxm"};
  const auto [r, j] = RunTextAndJson(h100, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(h100, r);
  EXPECT_NE(r.out.find("page-sparse attention backward at GQA group 1 (28 / 28 heads): "),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("a gathered key block serves 2 query items"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("has not timed the page-sparse attention backward's key blocks over the "
                       "union"),
            std::string::npos)
      << r.out;
  EXPECT_NE(j.out.find("\"attention_union_blocks_untimed\":true"), std::string::npos) << j.out;
  EXPECT_GT(rate(j.out), 0.1);
  EXPECT_LT(rate(j.out), 0.5);
  // The H200's has (2026-11-28): above half of group 8's rate, no note.
  const std::vector<std::string> h200 = {"plan", "--model", (dir.path() / "mha.yaml").string(),
                                         "--context", "64K"};
  const auto [u, uj] = RunTextAndJson(h200, dir.path());
  ASSERT_EQ(u.exit_code, 0) << Describe(h200, u);
  EXPECT_EQ(u.out.find("GQA group"), std::string::npos) << u.out;
  EXPECT_EQ(u.out.find("has not timed"), std::string::npos) << u.out;
  EXPECT_NE(uj.out.find("\"attention_union_blocks_untimed\":false"), std::string::npos) << uj.out;
  EXPECT_GT(rate(uj.out), 0.5);
  EXPECT_LT(rate(uj.out), 1.0);
  const auto [q, qj] = RunTextAndJson({"plan", "--context", "64K"}, dir.path());
  ASSERT_EQ(q.exit_code, 0) << q.err;
  EXPECT_EQ(q.out.find("GQA group"), std::string::npos) << q.out;
  EXPECT_GT(rate(qj.out), 0.5);
  EXPECT_LT(rate(qj.out), 1.0);
  const auto [d, dj] = RunTextAndJson({"plan", "--model", (dir.path() / "mha.yaml").string(),
                                       "--context", "64K", "--budget", "all"},
                                      dir.path());
  ASSERT_EQ(d.exit_code, 0) << d.err;
  EXPECT_EQ(d.out.find("GQA group"), std::string::npos) << d.out;
  EXPECT_EQ(rate(dj.out), 1.0);
  // Pages of 64 at group 1 take the union's 64-key blocks (UnionKeyBlocksOf), whose cost the
  // page tables do not hold: the plan's rate against pages of 128 is the time model's (0.66-0.75
  // measured at head dim 128 on the H200), under the GQA model's, whose is the tables'.
  auto page_rate = [](const std::string& json) {
    const std::string key = "\"attention_page_rate_vs_128\":{\"forward\":";
    const size_t at = json.find(key);
    EXPECT_NE(at, std::string::npos) << json;
    const size_t bwd = json.find("\"backward\":", at);
    return at == std::string::npos ? -1.0 : std::stod(json.substr(bwd + 11));
  };
  const auto [m64, m64j] = RunTextAndJson(
      {"plan", "--model", (dir.path() / "mha.yaml").string(), "--context", "64K", "--page", "64"},
      dir.path());
  ASSERT_EQ(m64.exit_code, 0) << m64.err;
  const auto [g64, g64j] = RunTextAndJson({"plan", "--context", "64K", "--page", "64"}, dir.path());
  ASSERT_EQ(g64.exit_code, 0) << g64.err;
  EXPECT_GT(page_rate(m64j.out), 0.6);
  EXPECT_LT(page_rate(m64j.out), 0.85);
  EXPECT_LT(page_rate(m64j.out), page_rate(g64j.out) - 0.1);
  EXPECT_NE(m64.out.find("attention over pages of 64: "), std::string::npos) << m64.out;
  // The rule goes by the dKV pool's type: at chunks of 2048 group 1 at head dim 128 takes the
  // union on a bf16 pool (the default; the H100's profile has not timed it), gathered blocks on
  // an fp32 one.
  std::vector<std::string> chunk2k = h100;
  chunk2k.insert(chunk2k.end(), {"--chunk", "2048"});
  const RunResult bf16_pool = RunCtxplan(chunk2k, dir.path());
  ASSERT_EQ(bf16_pool.exit_code, 0) << Describe(chunk2k, bf16_pool);
  EXPECT_NE(bf16_pool.out.find("has not timed"), std::string::npos) << bf16_pool.out;
  chunk2k.insert(chunk2k.end(), {"--grad-dtype", "fp32"});
  const RunResult fp32_pool = RunCtxplan(chunk2k, dir.path());
  ASSERT_EQ(fp32_pool.exit_code, 0) << Describe(chunk2k, fp32_pool);
  EXPECT_EQ(fp32_pool.out.find("has not timed"), std::string::npos) << fp32_pool.out;
}

// recommend names a fitting configuration and the ctxtrain command that runs it; with the GPU
// tier, max-context reaches further than without (issue 12: Qwen2.5-7B, H200, 125 GiB).
TEST(CliTest, RecommendAndTheGpuTier) {
  ScratchDir dir;
  std::vector<std::string> args = {"recommend", "--context", "32K", "--json"};
  RunResult r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_NE(JsonString(r.out, "ctxtrain").find("ctxtrain --backend cuda --model qwen2.5-7b"),
            std::string::npos)
      << r.out.substr(0, 300);
  EXPECT_GT(JsonInt(r.out, "fitting"), 0);
  EXPECT_VALID_JSON_OR_SKIP(r.out, dir);
  // At 1M the pages outgrow the GPU: with no --gpu-tier given the tier is searched, and the
  // fastest keeps one (the first "ctxtrain" is the fastest's).
  args = {"recommend", "--context", "1M", "--json"};
  r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_NE(JsonString(r.out, "ctxtrain").find("--offload on"), std::string::npos);
  EXPECT_NE(JsonString(r.out, "ctxtrain").find("--gpu-tier auto"), std::string::npos)
      << JsonString(r.out, "ctxtrain");
  args = {"recommend", "--context", "1M", "--gpu-tier", "off", "--json"};
  r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_EQ(JsonString(r.out, "ctxtrain").find("--gpu-tier"), std::string::npos);
  args = {"max-context", "--gpu-tier", "auto", "--json"};
  r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_GE(JsonInt(r.out, "max_context_tokens"), 1'450'000) << r.out.substr(0, 300);
  EXPECT_VALID_JSON_OR_SKIP(r.out, dir);
  // Issue 12: with no optimizer state the tier holds more, and beyond the full tiered store the
  // GPU grows by the page summaries alone (2.8 MB per 10K tokens; the acceptance allows 10).
  args = {"max-context", "--gpu-tier", "auto", "--optimizer", "none", "--json"};
  r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_GE(JsonInt(r.out, "max_context_tokens"), 1'800'000) << r.out.substr(0, 300);
  std::smatch slope;
  ASSERT_TRUE(std::regex_search(r.out, slope,
                                std::regex("\"gpu_memory_slope_mb_per_10k_tokens\":([0-9.eE+-]+)")))
      << r.out.substr(0, 300);
  EXPECT_GT(std::stod(slope[1]), 0.5);
  EXPECT_LT(std::stod(slope[1]), 10.0);
}

// The four-GPU host's 512 GiB hold about four times the pages.
TEST(CliTest, MaxContextJsonLargeHost) {
  ScratchDir dir;
  const std::vector<std::string> args = {"max-context", "--machine", "h200-512g", "--json"};
  const RunResult r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  const int64_t tokens = JsonInt(r.out, "max_context_tokens");
  EXPECT_GE(tokens, 3'500'000) << r.out.substr(0, 300);
  EXPECT_LE(tokens, 5'500'000);
  EXPECT_VALID_JSON_OR_SKIP(r.out, dir);
}

// --output writes exactly what stdout would show, through a temp file renamed into place (an
// existing file is replaced whole, and no temp file stays).
TEST(CliTest, PlanOutputEqualsStdout) {
  ScratchDir dir;
  for (const bool json : {false, true}) {
    SCOPED_TRACE(json ? "json" : "text");
    std::vector<std::string> args = {"plan", "--context", "128K"};
    if (json) args.push_back("--json");
    const RunResult to_stdout = RunCtxplan(args, dir.path());
    ASSERT_EQ(to_stdout.exit_code, 0) << Describe(args, to_stdout);
    ASSERT_FALSE(to_stdout.out.empty());

    const std::string file = dir.Write("plan.out", "an older, longer result that must vanish\n");
    args.insert(args.end(), {"--output", file});
    const RunResult to_file = RunCtxplan(args, dir.path());
    ASSERT_EQ(to_file.exit_code, 0) << Describe(args, to_file);
    EXPECT_EQ(to_file.out, "");
    EXPECT_EQ(to_file.err, "");
    EXPECT_EQ(ReadAll(file), to_stdout.out);
    for (const auto& entry : fs::directory_iterator(dir.path())) {
      EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
    }
    if (json) EXPECT_VALID_JSON_OR_SKIP(to_stdout.out, dir);
  }
}

// A dense 7B step holds the H200 at its 700 W power limit: plan says at which SM clock, and a
// light step (Llama-3.2-1B on an L40S, estimated from the H200) runs at its maximum.
TEST(CliTest, PlanNamesTheClockUnderThePowerLimit) {
  ScratchDir dir;
  const std::vector<std::string> heavy = {"plan", "--context", "128K"};
  const RunResult h = RunCtxplan(heavy, dir.path());
  ASSERT_EQ(h.exit_code, 0) << Describe(heavy, h);
  EXPECT_TRUE(std::regex_search(
      h.out,
      std::regex("SM clock [0-9]+% of its maximum \\(1[5-9][0-9][0-9] MHz by the kernels' "
                 "speed\\): held at "
                 "the 700 W power limit \\(fill [0-9]+%, recompute [0-9]+%, backward [0-9]+%\\)")))
      << h.out;
  // Each pass at its own clock (clock_model.h): the dense backward no faster than the fill.
  const std::vector<std::string> heavy_json = {"plan", "--context", "128K", "--json"};
  const RunResult hj = RunCtxplan(heavy_json, dir.path());
  ASSERT_EQ(hj.exit_code, 0) << Describe(heavy_json, hj);
  std::smatch fill, backward;
  ASSERT_TRUE(std::regex_search(hj.out, fill, std::regex("\"sm_clock_fraction_fill\":([0-9.]+)")))
      << hj.out;
  ASSERT_TRUE(
      std::regex_search(hj.out, backward, std::regex("\"sm_clock_fraction_backward\":([0-9.]+)")))
      << hj.out;
  EXPECT_LE(std::stod(backward[1]), std::stod(fill[1]));
  EXPECT_LT(std::stod(backward[1]), 1.0);
  // A step that waits on PCIe (chunks of 1024 over offloaded pages) draws under the limit in
  // every pass (at 32K its backward reaches 99%).
  const std::vector<std::string> light = {"plan",   "--gpu",   "l40s",         "--host-ram",
                                          "256GiB", "--model", "llama-3.2-1b", "--context",
                                          "64K",    "--chunk", "1024"};
  const RunResult l = RunCtxplan(light, dir.path());
  ASSERT_EQ(l.exit_code, 0) << Describe(light, l);
  EXPECT_NE(l.out.find("SM clock 100% of its maximum: under the 350 W power limit"),
            std::string::npos)
      << l.out;
}

TEST(CliTest, SweepCsvHeaderAndOneRowPerConfiguration) {
  ScratchDir dir;
  const std::vector<std::string> args = {"sweep",  "--context", "32K,64K", "--budget",
                                         "64,all", "--format",  "csv"};
  const RunResult r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  std::vector<std::string> lines;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 5u) << r.out;
  EXPECT_TRUE(lines[0].starts_with("model,machine,context_tokens,")) << lines[0];
  const auto columns = std::count(lines[0].begin(), lines[0].end(), ',');
  for (size_t i = 1; i < lines.size(); ++i) {
    EXPECT_EQ(std::count(lines[i].begin(), lines[i].end(), ','), columns) << lines[i];
    EXPECT_TRUE(lines[i].starts_with("qwen2.5-7b,h200-125g,")) << lines[i];
  }
  // Every (context, budget) pair once.
  for (const char* pair : {",32768,4096,128,64,", ",65536,4096,128,64,", ",32768,4096,128,all,",
                           ",65536,4096,128,all,"}) {
    EXPECT_EQ(
        std::count_if(lines.begin() + 1, lines.end(),
                      [&](const std::string& l) { return l.find(pair) != std::string::npos; }),
        1)
        << pair;
  }
}

// A combination of values that each run in another combination (chunk 1024 with page 96) is
// skipped and said once on stderr; the others are swept. A value no combination takes is an
// error (SweepOneBadChunk above).
TEST(CliTest, SweepSkipsCombinationsThatCannotRun) {
  ScratchDir dir;
  const std::vector<std::string> args = {"sweep",     "--context", "32K",  "--chunk",
                                         "1024,3072", "--page",    "64,96"};
  const RunResult r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 4) << r.out;  // header + 3 rows
  EXPECT_EQ(r.out.find(",1024,96,"), std::string::npos) << r.out;
  for (const char* row : {",1024,64,", ",3072,64,", ",3072,96,"})
    EXPECT_NE(r.out.find(row), std::string::npos) << row << "\n" << r.out;
  EXPECT_NE(r.err.find("ctxplan: sweep: skipped 1 of 4 combinations that cannot run, e.g. "),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("1024 is not a multiple of the page size 96"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// The timeline is a Chrome trace: complete events (ph X) on several streams (tids) and memory
// counters (ph C), loadable by any JSON parser.
TEST(CliTest, TimelineWritesChromeTrace) {
  ScratchDir dir;
  const std::string file = (dir.path() / "step.json").string();
  const std::vector<std::string> args = {"timeline", "--context", "16K", "-o", file};
  const RunResult r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;  // the summary line
  EXPECT_NE(r.err.find(file), std::string::npos) << r.err;
  ASSERT_TRUE(fs::exists(file));
  RunResult py;
  RUN_PYTHON_OR_SKIP(py, dir.path(),
                     "import json,sys\n"
                     "d = json.load(open(sys.argv[1]))\n"
                     "ev = d['traceEvents']\n"
                     "x = {(e.get('pid'), e.get('tid')) for e in ev if e.get('ph') == 'X'}\n"
                     "c = [e for e in ev if e.get('ph') == 'C']\n"
                     "print(len(x), len(c))\n",
                     file);
  ASSERT_EQ(py.exit_code, 0) << py.err;
  std::istringstream counts(py.out);
  int tids = 0, counters = 0;
  counts >> tids >> counters;
  EXPECT_GE(tids, 3) << py.out;
  EXPECT_GT(counters, 0) << py.out;
}

// replay --by-chunk: one op kind chunk by chunk, as text and as JSON (one row per chunk with ops,
// each op counted once).
TEST(CliTest, ReplayByChunk) {
  ScratchDir dir;
  std::vector<std::string> args = {"replay", kRecordedTrace, "--by-chunk", "attention_bwd.paged"};
  RunResult r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_NE(r.out.find("by chunk, attention_bwd.paged (per op)"), std::string::npos) << r.out;
  args.push_back("--json");
  r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  RunResult py;
  RUN_PYTHON_OR_SKIP(
      py, dir.path(),
      "import json,sys\n"
      "j = json.load(open(sys.argv[1]))\n"
      "rows = j['by_chunk']\n"
      "kind = [k for k in j['by_kind'] if k['kind'] == 'attention_bwd' and "
      "k['part'] == 'paged'][0]\n"
      "assert all(r['kind'] == 'attention_bwd' and r['part'] == 'paged' for r in rows)\n"
      "assert sum(r['count'] for r in rows) == kind['count']\n"
      "assert abs(sum(r['measured_seconds'] for r in rows) - "
      "kind['measured_seconds']) < 1e-9 * kind['count']\n"
      "print(len(rows), sorted(r['chunk'] for r in rows)[0])\n",
      dir.Write("replay.json", r.out));
  ASSERT_EQ(py.exit_code, 0) << py.err;
  EXPECT_EQ(py.out, "7 1\n");  // 8 chunks of 4096 at 32K: chunk 0 has no earlier pages
}

// The selection fit of the matrix's Llama-3.1-8B 128K trace (k 64): its tiles draw more
// independently than the default rule's, and planning at the fitted scale predicts its unions.
TEST(CliTest, SelectionFitsTheDrawScale) {
  ScratchDir dir;
  const std::string trace =
      std::string(CTXPLAN_SOURCE_DIR) + "/traces/recorded/matrix/l8-128k-k64-h200.ctxtrace";
  std::vector<std::string> args = {"selection", trace, "--json"};
  RunResult r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  RunResult py;
  RUN_PYTHON_OR_SKIP(py, dir.path(),
                     "import json,sys\n"
                     "j = json.load(open(sys.argv[1]))\n"
                     "t = j['traces'][0]\n"
                     "assert j['model'] == 'llama-3.1-8b'\n"
                     "assert 0.85 < j['draw_scale'] < 1.1, j\n"
                     "assert abs(t['union_ratio_fitted'] - 1) < 0.02, t\n"
                     "assert t['union_ratio_default'] < 0.9, t\n"
                     "print(j['flag'].split(':')[0], t['sparse_chunks'])\n",
                     dir.Write("selection.json", r.out));
  ASSERT_EQ(py.exit_code, 0) << py.err;
  EXPECT_EQ(py.out, "--selection disjoint 28\n");
  args = {"selection", trace, "--csv"};
  r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_TRUE(r.out.starts_with("trace,chunk,k,tiles,candidates,layers,mean_union_pages\n"));
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 29);
}

// A trace recorded before traces named their planning machine replays against h200-125g, saying
// so; --machine and --gpu still choose another, and the report says where it came from.
TEST(CliTest, ReplayOfAnOldTraceUsesTheDefaultMachine) {
  ScratchDir dir;
  std::vector<std::string> args = {"replay", kRecordedTrace, "--json"};
  RunResult r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_EQ(JsonString(r.out, "machine"), "h200-125g");
  EXPECT_EQ(JsonString(r.out, "machine_from"), "default h200-125g: the trace names no machine");
  const double on_h200 = std::stod(r.out.substr(r.out.find("\"predicted_step_seconds\":") + 25));
  args = {"replay", kRecordedTrace, "--machine", "h100-125g", "--json"};
  r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_EQ(JsonString(r.out, "machine"), "h100-125g");
  EXPECT_EQ(JsonString(r.out, "machine_from"), "from --machine");
  // The same 7B step predicted for an H100 is slower: the machine really changed.
  const double on_h100 = std::stod(r.out.substr(r.out.find("\"predicted_step_seconds\":") + 25));
  EXPECT_GT(on_h100, on_h200);
  args = {"replay", kRecordedTrace, "--gpu", "h100-sxm", "--host-ram", "250GiB"};
  r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_NE(r.out.find("against h100-sxm+250GiB (from --gpu)\n"), std::string::npos) << r.out;
  args = {"replay", kRecordedTrace};
  r = RunCtxplan(args, dir.path());
  ASSERT_EQ(r.exit_code, 0) << Describe(args, r);
  EXPECT_NE(r.out.find("against h200-125g (default h200-125g: the trace names no machine)\n"),
            std::string::npos)
      << r.out;
}

TEST(CliTest, ListNamesTheCatalogue) {
  ScratchDir dir;
  const RunResult r = RunCtxplan({"list"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("qwen2.5-7b"), std::string::npos);
  EXPECT_NE(r.out.find("h200-512g"), std::string::npos);
}

}  // namespace
}  // namespace ctxplan
