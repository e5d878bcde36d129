// The benchmark programs' flags (kernels_bench, attention_bench): a wrong flag or value gets one
// clear line naming the flag and what it accepts, exit code 2, before any GPU work and without
// leaving a CSV behind. The benchmarks are built with CUDA only; elsewhere this test skips.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "support/process.h"

namespace ctxplan {
namespace {

using test::ExpectOneLineError;
using test::ScratchDir;

#if defined(KERNELS_BENCH_EXE) && defined(ATTENTION_BENCH_EXE)
test::RunResult RunBench(const std::string& exe, std::vector<std::string> args,
                         const ScratchDir& dir) {
  args.insert(args.begin(), exe);
  return test::RunArgv(args, dir.path());
}
#endif

TEST(BenchCli, BadFlagsAreOneLineErrors) {
#if !defined(KERNELS_BENCH_EXE) || !defined(ATTENTION_BENCH_EXE)
  GTEST_SKIP() << "the benchmark programs are built with CUDA only";
#else
  ScratchDir dir;
  ExpectOneLineError(RunBench(KERNELS_BENCH_EXE, {"--only", "attention"}, dir), "kernels_bench", 2,
                     {"--only", "memory,gemms,loss"});
  ExpectOneLineError(RunBench(KERNELS_BENCH_EXE, {"--samples", "3"}, dir), "kernels_bench", 2,
                     {"--samples"});
  const std::filesystem::path table = dir.path() / "missing" / "kernels.csv";
  ExpectOneLineError(RunBench(KERNELS_BENCH_EXE, {"--csv", table.string()}, dir), "kernels_bench",
                     2, {"--csv", table.string()});
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--tokens", "5000"}, dir), "attention_bench", 2,
                     {"--tokens", "multiple of 4096"});
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--reps", "0"}, dir), "attention_bench", 2,
                     {"--reps", "1 to 1000"});
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--only", "sparse"}, dir), "attention_bench", 2,
                     {"--only", "full,chunked,last,sweep"});
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--heads", "28x5"}, dir), "attention_bench", 2,
                     {"--heads", "H_kv dividing H_q"});
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--heads", "28"}, dir), "attention_bench", 2,
                     {"--heads", "H_qxH_kv"});
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--head-dim", "96"}, dir), "attention_bench", 2,
                     {"--head-dim", "96"});
  for (const char* family : {"chunked", "last"}) {  // head_dim 128 families: not silently ignored
    ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--only", family, "--head-dim", "64"}, dir),
                       "attention_bench", 2, {"--head-dim", "--only sweep or --only full"});
  }
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--head-dim", "64"}, dir), "attention_bench", 2,
                     {"--head-dim"});
  // The sweep's grid flags: the sweep only, chunks of whole 128-query tiles, a tile's tokens
  // whole pages of every size timed.
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--pages", "64"}, dir), "attention_bench", 2,
                     {"--chunks, --pages, --sparse-tokens and --page-table", "--only sweep"});
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--only", "sweep", "--chunks", "3000"}, dir),
                     "attention_bench", 2, {"--chunks", "multiple of 128"});
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE,
                              {"--only", "sweep", "--pages", "96", "--sparse-tokens", "4096"}, dir),
                     "attention_bench", 2, {"--sparse-tokens 4096", "(96)"});
  const std::filesystem::path csv = dir.path() / "missing" / "ours.csv";
  ExpectOneLineError(RunBench(ATTENTION_BENCH_EXE, {"--csv", csv.string()}, dir), "attention_bench",
                     2, {"--csv", csv.string()});
  EXPECT_FALSE(std::filesystem::exists(csv.parent_path()));
  // --only sweep passes the parser: the run gets as far as opening the CSV (which comes after
  // parsing and before any GPU work), and the error is the CSV's, not --only's.
  const std::filesystem::path sweep_csv = dir.path() / "missing" / "sweep.csv";
  const test::RunResult sweep =
      RunBench(ATTENTION_BENCH_EXE, {"--only", "sweep", "--csv", sweep_csv.string()}, dir);
  ExpectOneLineError(sweep, "attention_bench", 2, {"--csv", sweep_csv.string()});
  EXPECT_EQ(sweep.err.find("--only"), std::string::npos) << sweep.err;
  EXPECT_FALSE(std::filesystem::exists(sweep_csv.parent_path()));
#endif
}

}  // namespace
}  // namespace ctxplan
