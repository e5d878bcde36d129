// The ctxtrain program end to end on the CPU backend: bad weights, data and checkpoints give one
// clear line and exit code 2; a diverging run stops with exit code 3 naming the step and chunk
// and leaves the checkpoint it was given intact; save and resume continue a run exactly; a trace
// it records replays against the plan.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/checkpoint.h"
#include "ctxplan/runtime/model_weights.h"
#include "ctxplan/runtime/safetensors.h"
#include "ctxplan/runtime/token_data.h"
#include "support/process.h"

namespace ctxplan {
namespace {

using test::ReadAll;
using test::RunArgv;
using test::RunResult;
using test::ScratchDir;

const std::vector<std::string> kSmallRun = {
    "--model", "tiny", "--context", "96", "--chunk", "32", "--page", "8", "--query-tile", "8"};

RunResult Ctxtrain(std::vector<std::string> args, const ScratchDir& dir) {
  std::vector<std::string> argv = {CTXTRAIN_EXE};
  argv.insert(argv.end(), kSmallRun.begin(), kSmallRun.end());
  argv.insert(argv.end(), args.begin(), args.end());
  return RunArgv(argv, dir.path());
}

void ExpectOneLine(const RunResult& r, int code, const std::vector<std::string>& needles) {
  test::ExpectOneLineError(r, "ctxtrain", code, needles);
}

TEST(CtxtrainCli, BadWeightsDataAndCheckpointsAreOneLineErrors) {
  ScratchDir dir;
  ExpectOneLine(Ctxtrain({"--weights", (dir.path() / "none.safetensors").string()}, dir), 2,
                {"none.safetensors"});
  const std::string garbage = dir.Write("garbage.safetensors", "this is not a safetensors file");
  ExpectOneLine(Ctxtrain({"--weights", garbage}, dir), 2, {"garbage.safetensors"});
  // Weights of another shape: the vocabulary differs.
  ModelSpec other = LoadModel("tiny");
  other.vocab_size = 32;
  const std::string wrong = (dir.path() / "wrong.safetensors").string();
  WriteSafetensorsWeights(wrong, other, RandomWeights(other, 1), SafetensorsDtype::kF32);
  ExpectOneLine(Ctxtrain({"--weights", wrong}, dir), 2, {"wrong.safetensors", "embed_tokens"});
  // A data file shorter than the context.
  const std::string data = (dir.path() / "short.bin").string();
  WriteTokenFile(data, std::vector<int32_t>(50, 7));
  ExpectOneLine(Ctxtrain({"--data", data}, dir), 2, {"short.bin"});
  ExpectOneLine(Ctxtrain({"--resume", garbage}, dir), 2, {"garbage.safetensors"});
  ExpectOneLine(Ctxtrain({"--chunk", "30"}, dir), 2, {"--chunk"});
  ExpectOneLine(Ctxtrain({"--backend", "tpu"}, dir), 2, {"--backend", "cpu"});
  ExpectOneLine(Ctxtrain({"--task", "poetry"}, dir), 2, {"--task", "retrieval"});
}

TEST(CtxtrainCli, DivergingRunStopsAndLeavesTheCheckpointIntact) {
  ScratchDir dir;
  const ModelSpec tiny = LoadModel("tiny");
  ModelWeights weights = RandomWeights(tiny, 2);
  weights.final_norm[0] = NAN;
  const std::string bad = (dir.path() / "nan.safetensors").string();
  WriteSafetensorsWeights(bad, tiny, weights, SafetensorsDtype::kF32);
  const std::string checkpoint = dir.Write("run.ckpt", "the previous checkpoint");
  const RunResult r = Ctxtrain({"--weights", bad, "--save", checkpoint, "--task", "random"}, dir);
  ExpectOneLine(r, 3, {"step 0", "chunk 2"});
  EXPECT_EQ(ReadAll(checkpoint), "the previous checkpoint");
}

// A LoRA run saves its adapters (and their moments) with the frozen base, and resumes exactly:
// 2 steps + 2 resumed steps equal 4 straight steps, adapters and base alike. A resume with another
// rank is one line, exit 2.
TEST(CtxtrainCli, LoraRunResumesExactly) {
  ScratchDir dir;
  const std::string a = (dir.path() / "a.ckpt").string(), b = (dir.path() / "b.ckpt").string(),
                    c = (dir.path() / "c.ckpt").string();
  const std::vector<std::string> lora = {"--lora-rank", "4",    "--optimizer",
                                         "adamw-gpu",   "--lr", "1e-2"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), lora.begin(), lora.end());
    return extra;
  };
  ASSERT_EQ(Ctxtrain(with({"--steps", "2", "--save", a}), dir).exit_code, 0);
  const RunResult resumed = Ctxtrain(with({"--steps", "2", "--resume", a, "--save", b}), dir);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  ASSERT_EQ(Ctxtrain(with({"--steps", "4", "--save", c}), dir).exit_code, 0);
  const ModelSpec tiny = LoadModel("tiny");
  TrainingCheckpoint x = LoadCheckpoint(b, tiny), y = LoadCheckpoint(c, tiny);
  EXPECT_EQ(x.step, 4);
  ASSERT_EQ(x.lora.rank, 4);
  ASSERT_EQ(x.lora_m.rank, 4);
  std::vector<float> xs, ys, start;
  x.lora.ForEach(
      [&](const std::string&, std::vector<float>& t) { xs.insert(xs.end(), t.begin(), t.end()); });
  y.lora.ForEach(
      [&](const std::string&, std::vector<float>& t) { ys.insert(ys.end(), t.begin(), t.end()); });
  EXPECT_EQ(xs, ys);
  TrainingCheckpoint first = LoadCheckpoint(a, tiny);
  first.lora.ForEach([&](const std::string&, std::vector<float>& t) {
    start.insert(start.end(), t.begin(), t.end());
  });
  EXPECT_NE(xs, start);               // the adapters trained
  std::vector<float> base_x, base_a;  // the base stayed frozen
  x.weights.ForEach([&](const std::string&, std::vector<float>& t) {
    base_x.insert(base_x.end(), t.begin(), t.end());
  });
  first.weights.ForEach([&](const std::string&, std::vector<float>& t) {
    base_a.insert(base_a.end(), t.begin(), t.end());
  });
  EXPECT_EQ(base_x, base_a);
  ExpectOneLine(Ctxtrain({"--lora-rank", "8", "--resume", a}, dir), 2, {"a.ckpt", "LoRA rank"});
}

TEST(CtxtrainCli, ResumeContinuesTheRunExactly) {
  ScratchDir dir;
  const std::string a = (dir.path() / "a.ckpt").string(), b = (dir.path() / "b.ckpt").string(),
                    c = (dir.path() / "c.ckpt").string();
  ASSERT_EQ(Ctxtrain({"--steps", "2", "--save", a}, dir).exit_code, 0);
  ASSERT_EQ(Ctxtrain({"--steps", "2", "--resume", a, "--save", b}, dir).exit_code, 0);
  ASSERT_EQ(Ctxtrain({"--steps", "4", "--save", c}, dir).exit_code, 0);
  const ModelSpec tiny = LoadModel("tiny");
  TrainingCheckpoint resumed = LoadCheckpoint(b, tiny), straight = LoadCheckpoint(c, tiny);
  EXPECT_EQ(resumed.step, 4);
  EXPECT_EQ(straight.step, 4);
  std::vector<float> x, y;
  resumed.weights.ForEach(
      [&](const std::string&, std::vector<float>& t) { x.insert(x.end(), t.begin(), t.end()); });
  straight.weights.ForEach(
      [&](const std::string&, std::vector<float>& t) { y.insert(y.end(), t.begin(), t.end()); });
  EXPECT_EQ(x, y);
}

TEST(CtxtrainCli, TraceReplaysAgainstThePlan) {
  ScratchDir dir;
  const std::string trace = (dir.path() / "step.ctxtrace").string();
  const RunResult train = Ctxtrain({"--trace", trace, "--json"}, dir);
  ASSERT_EQ(train.exit_code, 0) << train.err;
  EXPECT_NE(train.out.find("\"tokens_per_second\""), std::string::npos);
  const RunResult replay = RunArgv({CTXPLAN_EXE, "replay", trace, "--json"}, dir.path());
  ASSERT_EQ(replay.exit_code, 0) << replay.err;
  EXPECT_NE(replay.out.find("\"source\":\"ctxtrain\""), std::string::npos) << replay.out;
  // Every kernel and copy of the plan was traced, and the arena the plan predicts is the one the
  // runtime accounted.
  const auto number = [&](const std::string& key) {
    const size_t at = replay.out.find("\"" + key + "\":");
    return std::stod(replay.out.substr(at + key.size() + 3));
  };
  EXPECT_EQ(number("plan_ops"), number("traced_ops"));
  EXPECT_EQ(number("measured_gpu_peak_bytes"), number("predicted_gpu_peak_bytes"));
}

}  // namespace
}  // namespace ctxplan

namespace ctxplan {
namespace {

// The Hugging Face export and the gradient dump that the transformers check reads.
TEST(CtxtrainCli, ExportsWeightsAndDumpsGradients) {
  ScratchDir dir;
  const std::string folder = (dir.path() / "hf").string();
  const std::string grads = (dir.path() / "grads.safetensors").string();
  const RunResult r = Ctxtrain({"--export-weights", folder, "--dump-grads", grads, "--optimizer",
                                "none", "--task", "random", "--seed", "4"},
                               dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const ModelSpec tiny = LoadModel("tiny");
  // The exported weights are the run's initial weights, exactly (fp32).
  ModelWeights exported = LoadSafetensorsWeights(folder + "/model.safetensors", tiny);
  ModelWeights expected = RandomWeights(tiny, 4);
  EXPECT_EQ(exported.embedding, expected.embedding);
  EXPECT_EQ(exported.layers[1].qkv, expected.layers[1].qkv);
  // config.json describes the same shape: it loads as the tiny model's.
  const ModelSpec config = LoadModel(folder + "/config.json");
  EXPECT_EQ(config.hidden_size, tiny.hidden_size);
  EXPECT_EQ(config.num_key_value_heads, tiny.num_key_value_heads);
  EXPECT_EQ(config.attention_bias, tiny.attention_bias);
  // The gradients have the weights' shapes and are not all zero.
  ModelWeights g = LoadSafetensorsWeights(grads, tiny);
  double norm = 0;
  g.ForEach([&](const std::string&, std::vector<float>& t) {
    for (float x : t) norm += double(x) * x;
  });
  EXPECT_GT(norm, 0.0);
  EXPECT_TRUE(std::isfinite(norm));
}

}  // namespace
}  // namespace ctxplan
