// ctxplan-measure's flags: a wrong flag or value, an unwritable --output or a missing GPU gets one
// clear line naming what is wrong and what is accepted, exit code 2, before any GPU work and
// without leaving a CSV behind. Runs without a GPU; ctxplan-measure is built with CUDA only, and
// elsewhere this test skips.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "support/process.h"

namespace ctxplan {
namespace {

using test::ExpectOneLineError;
using test::ScratchDir;

#if defined(MEASURE_EXE)
test::RunResult RunMeasure(std::vector<std::string> args, const ScratchDir& dir) {
  args.insert(args.begin(), MEASURE_EXE);
  return test::RunArgv(args, dir.path());
}

// Files named samples.csv* in the scratch folder: the output or its temporary file.
int LeftBehind(const ScratchDir& dir) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    files += entry.path().filename().string().rfind("samples.csv", 0) == 0;
  return files;
}
#endif

TEST(MeasureCli, BadFlagsAreOneLineErrors) {
#if !defined(MEASURE_EXE)
  GTEST_SKIP() << "ctxplan-measure is built with CUDA only";
#else
  ScratchDir dir;
  const std::string csv = (dir.path() / "samples.csv").string();
  ExpectOneLineError(
      RunMeasure({"--output", csv, "--only", "gemm,attn"}, dir), "ctxplan-measure", 2,
      {"--only", "attn", "launch,gemm,lora,loss,attention,select,readback,memory,copy,links,host"});
  ExpectOneLineError(RunMeasure({"--output", csv, "--reps", "0"}, dir), "ctxplan-measure", 2,
                     {"--reps", "1 to 1000"});
  ExpectOneLineError(RunMeasure({"--output", csv, "--device", "-1"}, dir), "ctxplan-measure", 2,
                     {"--device"});
  ExpectOneLineError(RunMeasure({"--output", csv, "--samples", "3"}, dir), "ctxplan-measure", 2,
                     {"--samples"});
  ExpectOneLineError(RunMeasure({"--quick"}, dir), "ctxplan-measure", 2, {"--output"});
  const std::filesystem::path missing = dir.path() / "missing" / "samples.csv";
  ExpectOneLineError(RunMeasure({"--output", missing.string()}, dir), "ctxplan-measure", 2,
                     {"--output", missing.string()});
  EXPECT_FALSE(std::filesystem::exists(missing.parent_path()));
  EXPECT_EQ(LeftBehind(dir), 0);
#endif
}

// Device 1023 exists nowhere: without a GPU the program says there is none, with one it names
// --device and the devices there are. Either way one line, exit 2, no file, no measurement.
TEST(MeasureCli, NoSuchGpuIsOneLineError) {
#if !defined(MEASURE_EXE)
  GTEST_SKIP() << "ctxplan-measure is built with CUDA only";
#else
  ScratchDir dir;
  const std::filesystem::path csv = dir.path() / "samples.csv";
  const test::RunResult r = RunMeasure({"--output", csv.string(), "--device", "1023"}, dir);
  ExpectOneLineError(r, "ctxplan-measure", 2, {});
  EXPECT_TRUE(r.err.find("no CUDA GPU") != std::string::npos ||
              r.err.find("--device 1023") != std::string::npos)
      << r.err;
  EXPECT_EQ(LeftBehind(dir), 0);
#endif
}

TEST(MeasureCli, HelpListsTheGroups) {
#if !defined(MEASURE_EXE)
  GTEST_SKIP() << "ctxplan-measure is built with CUDA only";
#else
  ScratchDir dir;
  const test::RunResult r = RunMeasure({"--help"}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("--output"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("launch,gemm,lora,loss,attention,select,readback,memory,copy,links,host"),
            std::string::npos)
      << r.out;
#endif
}

}  // namespace
}  // namespace ctxplan
