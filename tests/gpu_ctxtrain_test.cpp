// The ctxtrain program end to end on the CUDA backend: the memory it reports three ways, and its
// faults — a pinned-memory allocation that fails and a CUDA error in the middle of a step — each
// end the run with one line and exit code 3, leaving the checkpoint it would have replaced intact.
// The faults are real (a PiB pin request; a kernel writing to an invalid address), triggered by
// CTXPLAN_INJECT_FAULT (runtime/include/ctxplan/runtime/cuda/cuda_backend.h).
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "ctxplan/traces/json_reader.h"
#include "ctxplan/traces/op_trace.h"
#include "support/gpu.h"
#include "support/process.h"

namespace ctxplan {
namespace {

using test::ReadAll;
using test::RunArgv;
using test::RunResult;
using test::ScratchDir;

// The binary: CTXTRAIN_EXE from the environment (binaries carried to a GPU machine), else the one
// this build made.
std::string CtxtrainExe() {
  const char* env = std::getenv("CTXTRAIN_EXE");
  return env != nullptr && *env != '\0' ? env : CTXTRAIN_EXE;
}

// Qwen2.5-0.5B (head_dim 64) over 2K tokens: small, and a shape the CUDA kernels take.
RunResult Ctxtrain(const std::vector<std::string>& extra, const ScratchDir& dir,
                   const char* fault = nullptr) {
  std::vector<std::string> argv = {CtxtrainExe(),
                                   "--backend",
                                   "cuda",
                                   "--model",
                                   "qwen2.5-0.5b",
                                   "--context",
                                   "2048",
                                   "--chunk",
                                   "512",
                                   "--page",
                                   "64",
                                   "--budget",
                                   "4",
                                   "--query-tile",
                                   "128",
                                   "--steps",
                                   "2",
                                   "--json",
                                   "--offload",
                                   "on",
                                   "--keep-layer-inputs",
                                   "off"};
  // Fixed, so that ctxtrain's CUDA defaults (the planner's recommendation) do not choose them.
  for (const auto& [flag, value] : {std::pair<std::string, std::string>{"--grad-dtype", "fp32"},
                                    {"--optimizer", "adamw-gpu"},
                                    {"--gpu-tier", "off"}})
    if (std::find(extra.begin(), extra.end(), flag) == extra.end()) {
      argv.push_back(flag);
      argv.push_back(value);
    }
  argv.insert(argv.end(), extra.begin(), extra.end());
  if (fault != nullptr)
    setenv("CTXPLAN_INJECT_FAULT", fault, 1);
  else
    unsetenv("CTXPLAN_INJECT_FAULT");
  RunResult r = RunArgv(argv, dir.path());
  unsetenv("CTXPLAN_INJECT_FAULT");
  return r;
}

// A number member of ctxtrain's --json object.
double Number(const JsonValue& object, const std::string& key) {
  for (const auto& [name, value] : object.members)
    if (name == key && value.kind == JsonValue::Kind::kNumber) return std::stod(value.text);
  ADD_FAILURE() << "no number '" << key << "' in ctxtrain's JSON";
  return 0.0;
}

void ExpectOneLine(const RunResult& r, int code, const std::vector<std::string>& needles) {
  test::ExpectOneLineError(r, "ctxtrain", code, needles);
}

TEST(CtxtrainCuda, ReportsMemoryThreeWays) {
  SKIP_WITHOUT_GPU();
  ScratchDir dir;
  for (const char* grads : {"fp32", "bf16"}) {
    const std::string trace = (dir.path() / (std::string(grads) + ".ctxtrace")).string();
    const RunResult r = Ctxtrain({"--grad-dtype", grads, "--trace", trace}, dir);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const JsonValue v = JsonParser(r.out, "ctxtrain --json", 0).ParseDocument();
    const double allocated = Number(v, "arena_allocated_peak_bytes");
    const double reserved = Number(v, "arena_reserved_bytes");
    const double device = Number(v, "device_bytes");
    const double pinned = Number(v, "pinned_host_peak_bytes");
    EXPECT_GT(allocated, 0.0);
    EXPECT_LE(allocated, reserved);
    EXPECT_GE(device, reserved);
    // KV (bf16) + dKV (grad dtype) of the context's pages, all layers, pinned.
    EXPECT_GT(pinned, 0.0);
    EXPECT_NEAR(Number(v, "loss"), std::log(151936.0), 1.0);  // random weights: about ln V
    // The plan's memory ops account the arena's buffers: the planner predicts from them. (The
    // cuBLAS workspace the plan counts lives outside the arena: 32 MiB of the difference.)
    const double plan = Number(v, "plan_gpu_peak_bytes");
    EXPECT_NEAR(plan / allocated, 1.0, 0.02) << "plan " << plan << " arena " << allocated;
    // The trace carries what the allocators held, for replay to print beside the plan's figures.
    const OpTrace recorded = ReadOpTrace(trace);
    EXPECT_EQ(std::stod(recorded.metadata.at("gpu_arena_allocated_bytes")), allocated);
    EXPECT_EQ(std::stod(recorded.metadata.at("host_runtime_bytes")), pinned);
    EXPECT_GE(std::stod(recorded.metadata.at("gpu_device_used_bytes")), reserved);
    std::printf(
        "  %s: arena %.0f MiB of %.0f reserved (plan %.0f), device %.0f MiB, pinned %.0f MiB\n",
        grads, allocated / 1048576, reserved / 1048576, plan / 1048576, device / 1048576,
        pinned / 1048576);
  }
}

// A LoRA run on the CUDA backend: the base frozen on the GPU, the adapters trained by AdamW.
TEST(CtxtrainCuda, LoraRunCompletes) {
  SKIP_WITHOUT_GPU();
  ScratchDir dir;
  const RunResult r = Ctxtrain({"--lora-rank", "8", "--optimizer", "adamw-gpu"}, dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const JsonValue v = JsonParser(r.out, "ctxtrain --json", 0).ParseDocument();
  EXPECT_NEAR(Number(v, "loss"), std::log(151936.0), 1.0);
}

TEST(CtxtrainCuda, FaultsEndTheRunWithOneLineAndKeepTheCheckpoint) {
  SKIP_WITHOUT_GPU();
  ScratchDir dir;
  const std::string checkpoint = dir.Write("run.ckpt", "an earlier checkpoint");
  ExpectOneLine(Ctxtrain({"--save", checkpoint}, dir, "pinned-alloc"), 3, {"pin", "host"});
  EXPECT_EQ(ReadAll(checkpoint), "an earlier checkpoint");
  ExpectOneLine(Ctxtrain({"--save", checkpoint}, dir, "cuda-error"), 3, {"CUDA error"});
  EXPECT_EQ(ReadAll(checkpoint), "an earlier checkpoint");
  ExpectOneLine(Ctxtrain({"--save", checkpoint}, dir, "gremlins"), 2,
                {"CTXPLAN_INJECT_FAULT", "pinned-alloc"});
  EXPECT_EQ(ReadAll(checkpoint), "an earlier checkpoint");
}

}  // namespace
}  // namespace ctxplan
