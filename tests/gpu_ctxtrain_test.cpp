// The ctxtrain program end to end on the CUDA backend: the memory it reports three ways, and its
// faults — pinning or the arena's reservation failing at start-up, a CUDA error, a copy-engine
// error mid-offload, the host page store running out mid-step, a killed process — each end the
// run with one line (or, killed, none) and a non-zero exit, leaving the checkpoint it would have
// replaced intact. On two GPUs (skipped with fewer): the pipelined run's per-rank traces with the
// NCCL kernels attributed to their ops, a checkpoint saved and resumed, and a fault on one rank
// (CUDA, NCCL, copy engine, killed) ending every rank with one line naming that rank, soon. The
// faults are real errors raised the real way, triggered by CTXPLAN_INJECT_FAULT
// (runtime/include/ctxplan/runtime/cuda/injected_fault.h).
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "ctxplan/kernels/op_kind.h"
#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/io/checkpoint.h"
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

// Qwen2.5-0.5B (head_dim 64) over 2K tokens: small, and a shape the CUDA kernels take. `fault`
// (CTXPLAN_INJECT_FAULT) strikes rank `fault_rank` only when that is given.
RunResult Ctxtrain(const std::vector<std::string>& extra, const ScratchDir& dir,
                   const char* fault = nullptr, const char* fault_rank = nullptr) {
  std::vector<std::string> argv = {CtxtrainExe(), "--backend", "cuda"};
  if (std::find(extra.begin(), extra.end(), "--model") == extra.end()) {
    argv.push_back("--model");
    argv.push_back("qwen2.5-0.5b");
  }
  for (const char* a :
       {"--context", "2048", "--chunk", "512", "--page", "64", "--budget", "4", "--query-tile",
        "128", "--json", "--offload", "on", "--keep-layer-inputs", "off"})
    argv.push_back(a);
  if (std::find(extra.begin(), extra.end(), "--steps") == extra.end()) {
    argv.push_back("--steps");
    argv.push_back("2");
  }
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
  if (fault_rank != nullptr)
    setenv("CTXPLAN_INJECT_FAULT_RANK", fault_rank, 1);
  else
    unsetenv("CTXPLAN_INJECT_FAULT_RANK");
  RunResult r = RunArgv(argv, dir.path());
  unsetenv("CTXPLAN_INJECT_FAULT");
  unsetenv("CTXPLAN_INJECT_FAULT_RANK");
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
    // Page-sparse (budget 4 of up to 23 earlier pages): the tiles' unions as the union rule's
    // draw scale, what `ctxplan plan --selection disjoint:S` takes.
    const double selection = Number(v, "selection_draw_scale");
    EXPECT_GT(selection, 0.05);
    EXPECT_LT(selection, 50.0);
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
        "  %s: arena %.0f MiB of %.0f reserved (plan %.0f), device %.0f MiB, pinned %.0f MiB, "
        "selection draw scale %.3f\n",
        grads, allocated / 1048576, reserved / 1048576, plan / 1048576, device / 1048576,
        pinned / 1048576, selection);
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

// Saved after two steps, resumed for a third, against three straight steps: how far apart the
// resumed and the straight third steps leave the tensors `flat` reads from a checkpoint, as a
// fraction of how far the straight third step moved them; and, for scale, how far a second
// straight run lands from the first (the runs' own noise). A resume that lost the optimizer's
// state (moments, step count) moves them elsewhere. The third step's losses are printed: equal
// when the resumed run starts the step from the same state.
struct ResumeDistance {
  double resumed = 1.0;        // resumed third step from the straight one, in straight steps
  double straight = 1.0;       // a second straight run from the first, the same unit
  double without_state = 0.0;  // resumed from the checkpoint `strip` emptied (0: no strip)
};
ResumeDistance ResumedThirdStepApart(
    const std::vector<std::string>& flags, const ModelSpec& model, const ScratchDir& dir,
    const std::function<std::vector<float>(TrainingCheckpoint&)>& flat,
    const std::function<void(TrainingCheckpoint&)>& strip = nullptr) {
  const std::string two = (dir.path() / "two.ckpt").string();
  const std::string resumed = (dir.path() / "resumed.ckpt").string();
  const std::string straight = (dir.path() / "straight.ckpt").string();
  const std::string again_straight = (dir.path() / "straight-again.ckpt").string();
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), flags.begin(), flags.end());
    return more;
  };
  const RunResult first = Ctxtrain(with({"--steps", "2", "--save", two}), dir);
  EXPECT_EQ(first.exit_code, 0) << first.err;
  const RunResult again = Ctxtrain(with({"--steps", "1", "--resume", two, "--save", resumed}), dir);
  EXPECT_EQ(again.exit_code, 0) << again.err;
  const RunResult three = Ctxtrain(with({"--steps", "3", "--save", straight}), dir);
  EXPECT_EQ(three.exit_code, 0) << three.err;
  const RunResult three_again = Ctxtrain(with({"--steps", "3", "--save", again_straight}), dir);
  EXPECT_EQ(three_again.exit_code, 0) << three_again.err;
  if (first.exit_code != 0 || again.exit_code != 0 || three.exit_code != 0 ||
      three_again.exit_code != 0)
    return {};
  auto loss = [](const RunResult& r) {
    return Number(JsonParser(r.out, "ctxtrain --json", 0).ParseDocument(), "loss");
  };
  std::printf("  third step's loss: resumed %.9g, straight %.9g, straight again %.9g\n",
              loss(again), loss(three), loss(three_again));
  TrainingCheckpoint c2 = LoadCheckpoint(two, model), cr = LoadCheckpoint(resumed, model),
                     cs = LoadCheckpoint(straight, model),
                     ca = LoadCheckpoint(again_straight, model);
  const std::vector<float> before = flat(c2), after_resumed = flat(cr), after_straight = flat(cs),
                           after_again = flat(ca);
  double step = 0, resumed_apart = 0, straight_apart = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    step += std::abs(after_straight[i] - before[i]);
    resumed_apart += std::abs(after_resumed[i] - after_straight[i]);
    straight_apart += std::abs(after_again[i] - after_straight[i]);
  }
  EXPECT_GT(step, 0.0);
  if (step <= 0) return {};
  ResumeDistance d{resumed_apart / step, straight_apart / step, 0.0};
  if (strip) {  // the control: the same resume from a checkpoint without the optimizer's state
    const std::string stripped = (dir.path() / "two-stripped.ckpt").string();
    const std::string from_stripped = (dir.path() / "from-stripped.ckpt").string();
    TrainingCheckpoint c = LoadCheckpoint(two, model);
    strip(c);
    SaveCheckpoint(stripped, model, c);
    const RunResult r =
        Ctxtrain(with({"--steps", "1", "--resume", stripped, "--save", from_stripped}), dir);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    if (r.exit_code != 0) return d;
    TrainingCheckpoint cf = LoadCheckpoint(from_stripped, model);
    const std::vector<float> after = flat(cf);
    double apart = 0;
    for (size_t i = 0; i < before.size(); ++i) apart += std::abs(after[i] - after_straight[i]);
    d.without_state = apart / step;
  }
  return d;
}

// A LoRA run on the CUDA backend saves its adapters' AdamW moments and step count and resumes
// from them. (Before, the checkpoint had no LoRA moments: the resumed update restarted Adam.)
TEST(CtxtrainCuda, LoraResumesItsAdamWState) {
  SKIP_WITHOUT_GPU();
  ScratchDir dir;
  const ModelSpec model = LoadModel("qwen2.5-0.5b");
  const ResumeDistance apart = ResumedThirdStepApart(
      {"--lora-rank", "8", "--lr", "1e-2"}, model, dir,
      [](TrainingCheckpoint& c) {
        EXPECT_EQ(c.lora_m.rank, 8) << "the checkpoint carries the adapters' moments";
        std::vector<float> all;
        c.lora.ForEach([&](const std::string&, std::vector<float>& t) {
          all.insert(all.end(), t.begin(), t.end());
        });
        return all;
      },
      [](TrainingCheckpoint& c) { c.lora_m = c.lora_v = LoraWeights{}; });
  // A LoRA step is not bit-reproducible: the attention backward sums dQ with fp32 atomics, and
  // Adam turns that noise in the adapters' small gradients into whole-size updates (a second
  // straight run lands 0.13-0.18 of a step away on an H100 and an H200). So the resume is judged
  // against that noise, and against the same resume without the moments (~1.25), which must land
  // further out. The resumed and the second straight run are two draws of the same noise: one
  // landed 0.26 against 0.133 (H200, 2026-11-27), past the 1.5x this test asked before; 3x of
  // one draw, and half the stateless resume's distance, still fail a resume that restarts Adam.
  std::printf(
      "  LoRA: resumed step 3 apart from straight by %.3g of the step (straight again %.3g, "
      "resumed without the moments %.3g)\n",
      apart.resumed, apart.straight, apart.without_state);
  const double noise = std::max(apart.straight, 0.05);
  EXPECT_LT(apart.resumed, 3.0 * noise);
  EXPECT_LT(apart.resumed, 0.5 * apart.without_state);
  EXPECT_GT(apart.without_state, 2.0 * noise);
}

// AdamW on the host and on the GPU (CUDA backend): the moments and step count are saved and
// resumed. (Before, the host's were not saved: a resumed run restarted them.)
TEST(CtxtrainCuda, AdamWResumesItsStateOnTheHostAndTheGpu) {
  SKIP_WITHOUT_GPU();
  ScratchDir dir;
  const std::string yaml =
      dir.Write("small-untied.yaml",
                "name: small-untied\nmodel_type: qwen2\nhidden_size: 512\n"
                "intermediate_size: 1024\nnum_hidden_layers: 4\nnum_attention_heads: 8\n"
                "num_key_value_heads: 2\nhead_dim: 64\nvocab_size: 4096\n"
                "max_position_embeddings: 65536\ntie_word_embeddings: false\n"
                "attention_bias: true\nrope_theta: 10000.0\nrms_norm_eps: 1.0e-6\n");
  const ModelSpec model = LoadModel(yaml);
  for (const std::string placement : {"adamw-host", "adamw-gpu"}) {
    SCOPED_TRACE(placement);
    const ResumeDistance apart = ResumedThirdStepApart(
        {"--model", yaml, "--optimizer", placement, "--lr", "1e-3"}, model, dir,
        [](TrainingCheckpoint& c) {
          EXPECT_TRUE(c.has_optimizer_state()) << "the checkpoint carries the moments";
          std::vector<float> all;
          c.weights.ForEach([&](const std::string&, std::vector<float>& t) {
            all.insert(all.end(), t.begin(), t.end());
          });
          return all;
        });
    std::printf(
        "  %s: resumed step 3 apart from straight by %.3g of the step (straight again %.3g)\n",
        placement.c_str(), apart.resumed, apart.straight);
    EXPECT_LT(apart.resumed, 0.05);
    EXPECT_LT(apart.straight, 0.05);
  }
}

TEST(CtxtrainCuda, FaultsEndTheRunWithOneLineAndKeepTheCheckpoint) {
  SKIP_WITHOUT_GPU();
  ScratchDir dir;
  const std::string checkpoint = dir.Write("run.ckpt", "an earlier checkpoint");
  ExpectOneLine(Ctxtrain({"--save", checkpoint}, dir, "pinned-alloc"), 3, {"pin", "host"});
  EXPECT_EQ(ReadAll(checkpoint), "an earlier checkpoint");
  ExpectOneLine(Ctxtrain({"--save", checkpoint}, dir, "cuda-error"), 3, {"CUDA error"});
  EXPECT_EQ(ReadAll(checkpoint), "an earlier checkpoint");
  ExpectOneLine(Ctxtrain({"--save", checkpoint}, dir, "arena-oom"), 3,
                {"CUDA error", "cannot reserve the GPU arena", "free of"});
  EXPECT_EQ(ReadAll(checkpoint), "an earlier checkpoint");
  ExpectOneLine(Ctxtrain({"--save", checkpoint}, dir, "copy-error"), 3, {"CUDA error"});
  EXPECT_EQ(ReadAll(checkpoint), "an earlier checkpoint");
  ExpectOneLine(Ctxtrain({"--save", checkpoint}, dir, "host-store"), 3,
                {"host page store ran out mid-step", "dkv_pages store exhausted"});
  EXPECT_EQ(ReadAll(checkpoint), "an earlier checkpoint");
  const RunResult killed = Ctxtrain({"--save", checkpoint}, dir, "kill");
  EXPECT_EQ(killed.exit_code, 128 + 9) << killed.err;
  EXPECT_EQ(ReadAll(checkpoint), "an earlier checkpoint");
  ExpectOneLine(Ctxtrain({"--save", checkpoint}, dir, "gremlins"), 2,
                {"CTXPLAN_INJECT_FAULT", "pinned-alloc", "nccl-error"});
  EXPECT_EQ(ReadAll(checkpoint), "an earlier checkpoint");
}

// --- two GPUs ------------------------------------------------------------------------------------

int GpuCount() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

#define SKIP_WITHOUT_TWO_GPUS()                                                     \
  do {                                                                              \
    if (GpuCount() < 2) GTEST_SKIP() << "fewer than two CUDA GPUs on this machine"; \
  } while (false)

// Untied (the pipeline does not share a tied LM head yet), head_dim 64, four layers: two a GPU.
std::string SmallUntiedModel(const ScratchDir& dir) {
  return dir.Write("small-untied.yaml",
                   "name: small-untied\nmodel_type: qwen2\nhidden_size: 512\n"
                   "intermediate_size: 1024\nnum_hidden_layers: 4\nnum_attention_heads: 8\n"
                   "num_key_value_heads: 2\nhead_dim: 64\nvocab_size: 4096\n"
                   "max_position_embeddings: 65536\ntie_word_embeddings: false\n"
                   "attention_bias: true\nrope_theta: 10000.0\nrms_norm_eps: 1.0e-6\n");
}

// The rank's trace: run.ctxtrace for rank 0, run.rank1.ctxtrace for rank 1.
OpTrace RankTrace(const ScratchDir& dir, int rank) {
  return ReadOpTrace(
      dir.path() / (rank == 0 ? "run.ctxtrace" : "run.rank" + std::to_string(rank) + ".ctxtrace"));
}

TEST(CtxtrainCudaTwoGpus, TracesEachRankAndResumesItsCheckpoint) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_TWO_GPUS();
  ScratchDir dir;
  const std::string model = SmallUntiedModel(dir);
  const std::string trace = (dir.path() / "run.ctxtrace").string();
  const std::string checkpoint = (dir.path() / "run.ckpt").string();
  const RunResult first = Ctxtrain({"--model", model, "--gpus", "2", "--lr", "1e-2", "--steps", "2",
                                    "--trace", trace, "--save", checkpoint},
                                   dir);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  for (int rank : {0, 1}) {
    const OpTrace t = RankTrace(dir, rank);
    EXPECT_EQ(t.metadata.at("rank"), std::to_string(rank));
    EXPECT_EQ(t.metadata.at("world_size"), "2");
    // Every NCCL send and receive the rank issued carries its kernel's GPU time: CUPTI saw the
    // NCCL kernels and attributed them to their ops.
    int64_t peer_ops = 0, timed = 0;
    for (const OpRecord& op : t.ops) {
      const auto kind = static_cast<OpKind>(op.kind);
      if (kind != OpKind::kPeerSend && kind != OpKind::kPeerRecv) continue;
      ++peer_ops;
      timed += op.end_ns > op.start_ns ? 1 : 0;
    }
    EXPECT_GT(peer_ops, 0) << "rank " << rank;
    EXPECT_EQ(timed, peer_ops) << "rank " << rank;
    std::printf("  rank %d: %zu ops traced, %lld NCCL sends/receives, all timed\n", rank,
                t.ops.size(), static_cast<long long>(peer_ops));
    EXPECT_TRUE(std::filesystem::exists(checkpoint + ".rank" + std::to_string(rank)));
  }
  const RunResult resumed = Ctxtrain(
      {"--model", model, "--gpus", "2", "--lr", "1e-2", "--steps", "1", "--resume", checkpoint},
      dir);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  const RunResult straight =
      Ctxtrain({"--model", model, "--gpus", "2", "--lr", "1e-2", "--steps", "3"}, dir);
  ASSERT_EQ(straight.exit_code, 0) << straight.err;
  // The resumed third step starts from the second's weights and AdamW moments: its loss is the
  // straight run's third, up to the runs' own noise (the attention backward's fp32 atomics; Adam
  // makes their last bits in near-zero gradients whole updates): far closer to it than to where
  // the weights started (random: about ln V).
  const double resumed_loss =
      Number(JsonParser(resumed.out, "ctxtrain --json", 0).ParseDocument(), "loss");
  const double straight_loss =
      Number(JsonParser(straight.out, "ctxtrain --json", 0).ParseDocument(), "loss");
  EXPECT_NEAR(resumed_loss, straight_loss, 0.25 * std::abs(straight_loss - std::log(4096.0)));
  std::printf("  step 3's loss: resumed %.7f, straight %.7f\n", resumed_loss, straight_loss);
}

TEST(CtxtrainCudaTwoGpus, AFaultOnOneRankEndsEveryRankWithOneLine) {
  SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_TWO_GPUS();
  ScratchDir dir;
  const std::string model = SmallUntiedModel(dir);
  const std::string checkpoint = (dir.path() / "run.ckpt").string();
  dir.Write("run.ckpt.rank0", "rank 0's earlier checkpoint");
  dir.Write("run.ckpt.rank1", "rank 1's earlier checkpoint");
  for (const char* fault : {"cuda-error", "nccl-error", "copy-error", "kill"}) {
    SCOPED_TRACE(fault);
    const auto started = std::chrono::steady_clock::now();
    const RunResult r =
        Ctxtrain({"--model", model, "--gpus", "2", "--peer-timeout", "30", "--save", checkpoint},
                 dir, fault, "1");
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    const bool killed = std::string(fault) == "kill";
    ExpectOneLine(r, killed ? 128 + 9 : 3,
                  {killed ? "rank 1 failed (killed by signal 9: SIGKILL)" : "rank 1: "});
    EXPECT_LT(seconds, 60.0) << "a fault on one rank must not leave the other waiting";
    EXPECT_EQ(ReadAll(checkpoint + ".rank0"), "rank 0's earlier checkpoint");
    EXPECT_EQ(ReadAll(checkpoint + ".rank1"), "rank 1's earlier checkpoint");
    std::printf("  %s on rank 1: exit %d after %.1f s: %s", fault, r.exit_code, seconds,
                r.err.c_str());
  }
}

}  // namespace
}  // namespace ctxplan
