// The ctxtrain program end to end on the CPU backend: bad weights, data and checkpoints give one
// clear line and exit code 2; a diverging run stops with exit code 3 naming the step and chunk
// and leaves the checkpoint it was given intact; save and resume continue a run exactly; a trace
// it records replays against the plan.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <random>
#include <regex>

#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/io/checkpoint.h"
#include "ctxplan/runtime/io/safetensors.h"
#include "ctxplan/runtime/io/token_data.h"
#include "ctxplan/runtime/plan/model_weights.h"
#include "ctxplan/traces/op_trace.h"
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

// A long small run saving every step, started in the background: its pid (stdout and stderr to
// files in `dir`).
pid_t StartSavingRun(const ScratchDir& dir, const std::string& checkpoint) {
  std::vector<std::string> argv = {CTXTRAIN_EXE};
  argv.insert(argv.end(), kSmallRun.begin(), kSmallRun.end());
  for (const std::string& a : {std::string("--steps"), std::string("100000"), std::string("--save"),
                               checkpoint, std::string("--save-every"), std::string("1")})
    argv.push_back(a);
  std::vector<char*> c_argv;
  for (std::string& a : argv) c_argv.push_back(a.data());
  c_argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const std::string out = (dir.path() / "run.out").string(),
                    err = (dir.path() / "run.err").string();
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  EXPECT_EQ(posix_spawn(&pid, c_argv[0], &actions, nullptr, c_argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

int WaitExit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool WaitForFile(const std::filesystem::path& path) {
  for (int i = 0; i < 3000 && !std::filesystem::exists(path); ++i) ::usleep(10'000);
  return std::filesystem::exists(path);
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

// Issue 16: SIGTERM ends a run after the step in flight, with its checkpoint and one line saying
// so (exit 128 + 15); the checkpoint resumes.
TEST(CtxtrainCli, SigtermStopsAfterTheStepWithItsCheckpoint) {
  ScratchDir dir;
  const std::string checkpoint = (dir.path() / "run.ckpt").string();
  const pid_t pid = StartSavingRun(dir, checkpoint);
  ASSERT_TRUE(WaitForFile(checkpoint));
  ::kill(pid, SIGTERM);
  EXPECT_EQ(WaitExit(pid), 128 + SIGTERM);
  const std::string err = ReadAll(dir.path() / "run.err");
  EXPECT_NE(err.find("ctxtrain: stopped by SIGTERM after step"), std::string::npos) << err;
  EXPECT_NE(err.find("--resume it"), std::string::npos) << err;
  const TrainingCheckpoint saved = LoadCheckpoint(checkpoint, LoadModel("tiny"));
  EXPECT_GE(saved.step, 1);
  const RunResult resumed = Ctxtrain({"--resume", checkpoint, "--steps", "1"}, dir);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
}

// Issue 16: SIGKILL at random moments of a run that saves every step (so often mid-write): the
// checkpoint on disk is always a whole one, the previous or the new.
TEST(CtxtrainCli, SigkillNeverLeavesAHalfWrittenCheckpoint) {
  ScratchDir dir;
  const std::string checkpoint = (dir.path() / "run.ckpt").string();
  std::mt19937 rng(11);
  int loaded = 0;
  for (int i = 0; i < 12; ++i) {
    const pid_t pid = StartSavingRun(dir, checkpoint);
    if (i == 0) {
      ASSERT_TRUE(WaitForFile(checkpoint));
    }
    ::usleep(20'000 + rng() % 300'000);
    ::kill(pid, SIGKILL);
    EXPECT_EQ(WaitExit(pid), 128 + SIGKILL);
    ASSERT_TRUE(std::filesystem::exists(checkpoint));
    EXPECT_NO_THROW(LoadCheckpoint(checkpoint, LoadModel("tiny"))) << "kill " << i;
    ++loaded;
  }
  EXPECT_EQ(loaded, 12);
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

// Issue 13 end to end on the CPU backend (which runs every pipeline stage in one process): two
// stages train exactly as one (the same checkpoint after two AdamW steps), and the trace of the
// pipelined step names its stages and replays against the pipelined plan, op for op.
TEST(CtxtrainCli, TwoStagesTrainAsOneAndTheirTraceReplays) {
  ScratchDir dir;
  const std::string one = (dir.path() / "one.ckpt").string(),
                    two = (dir.path() / "two.ckpt").string(),
                    trace = (dir.path() / "two.ctxtrace").string();
  ASSERT_EQ(Ctxtrain({"--steps", "2", "--save", one}, dir).exit_code, 0);
  const RunResult piped = Ctxtrain({"--steps", "2", "--gpus", "2", "--save", two}, dir);
  ASSERT_EQ(piped.exit_code, 0) << piped.err;
  const ModelSpec tiny = LoadModel("tiny");
  TrainingCheckpoint a = LoadCheckpoint(one, tiny), b = LoadCheckpoint(two, tiny);
  std::vector<float> x, y;
  a.weights.ForEach(
      [&](const std::string&, std::vector<float>& t) { x.insert(x.end(), t.begin(), t.end()); });
  b.weights.ForEach(
      [&](const std::string&, std::vector<float>& t) { y.insert(y.end(), t.begin(), t.end()); });
  EXPECT_EQ(x, y);
  ASSERT_EQ(Ctxtrain({"--gpus", "2", "--trace", trace}, dir).exit_code, 0);
  const RunResult replay = RunArgv({CTXPLAN_EXE, "replay", trace, "--json"}, dir.path());
  ASSERT_EQ(replay.exit_code, 0) << replay.err;
  const auto number = [&](const std::string& key) {
    const size_t at = replay.out.find("\"" + key + "\":");
    return std::stod(replay.out.substr(at + key.size() + 3));
  };
  EXPECT_EQ(number("plan_ops"), number("traced_ops"));
  // The replayed plan is the pipelined one: its stage boundaries are among the kinds.
  EXPECT_NE(replay.out.find("\"kind\":\"peer_recv\""), std::string::npos) << replay.out;
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

namespace ctxplan {
namespace {

// A JSON string or number field of one flat object, as text ("" when absent).
std::string JsonField(const std::string& json, const std::string& key) {
  std::smatch m;
  if (std::regex_search(json, m, std::regex("\"" + key + "\":\"([^\"]*)\"")) ||
      std::regex_search(json, m, std::regex("\"" + key + "\":([-0-9.eE+]+|null)")))
    return m[1];
  return "";
}

// A trace names the machine its run was planned for, and ctxplan replay predicts for that machine
// unless told otherwise: planned for h100-125g it replays against h100-125g, and against h200-125g
// only with --machine h200-125g.
TEST(CtxtrainCli, TraceNamesItsPlanningMachineAndReplaysAgainstIt) {
  ScratchDir dir;
  const std::string trace = (dir.path() / "h100.ctxtrace").string();
  const RunResult train = Ctxtrain({"--machine", "h100-125g", "--trace", trace, "--json"}, dir);
  ASSERT_EQ(train.exit_code, 0) << train.err;
  const OpTrace recorded = ReadOpTrace(trace);
  const TraceMetadata& m = recorded.metadata;
  EXPECT_EQ(m.at("plan_machine"), "h100-125g");
  EXPECT_EQ(m.count("plan_gpu"), 0u);
  EXPECT_EQ(m.at("plan_host_ram_bytes"), std::to_string(LoadMachine("h100-125g").host_ram_bytes));
  EXPECT_EQ(m.at("plan_machine_name"), "h100-125g");
  // The command line, without the program's name.
  EXPECT_EQ(m.at("ctxtrain_flags"),
            "--model tiny --context 96 --chunk 32 --page 8 --query-tile 8 --machine h100-125g "
            "--trace " +
                trace + " --json");

  RunResult replay = RunArgv({CTXPLAN_EXE, "replay", trace, "--json"}, dir.path());
  ASSERT_EQ(replay.exit_code, 0) << replay.err;
  EXPECT_EQ(JsonField(replay.out, "machine"), "h100-125g") << replay.out;
  EXPECT_EQ(JsonField(replay.out, "machine_from"), "from the trace");
  replay = RunArgv({CTXPLAN_EXE, "replay", trace, "--machine", "h200-125g", "--json"}, dir.path());
  ASSERT_EQ(replay.exit_code, 0) << replay.err;
  EXPECT_EQ(JsonField(replay.out, "machine"), "h200-125g") << replay.out;
  EXPECT_EQ(JsonField(replay.out, "machine_from"), "from --machine");
  replay = RunArgv({CTXPLAN_EXE, "replay", trace}, dir.path());
  ASSERT_EQ(replay.exit_code, 0) << replay.err;
  EXPECT_NE(replay.out.find("against h100-125g (from the trace)\n"), std::string::npos)
      << replay.out;

  // No --machine: planned for the default, and the trace says so.
  const std::string plain = (dir.path() / "plain.ctxtrace").string();
  ASSERT_EQ(Ctxtrain({"--trace", plain}, dir).exit_code, 0);
  EXPECT_EQ(ReadOpTrace(plain).metadata.at("plan_machine"), "h200-125g");
}

// --gpu FILE --host-ram: the trace keeps the file's absolute path and the host RAM; replay from
// another directory rebuilds that machine while the file exists, and falls back to h200-125g,
// naming the file, once it is gone.
TEST(CtxtrainCli, TraceOfAGpuFileReplaysWhileTheFileExists) {
  namespace fs = std::filesystem;
  ScratchDir dir, elsewhere;
  fs::copy_file(fs::path(CTXPLAN_SOURCE_DIR) / "models/gpu/h100-sxm.yaml",
                dir.path() / "mine.yaml");
  // Programs run in the test's working directory: name the file relative to it, as a user would.
  const std::string relative = fs::relative(dir.path() / "mine.yaml").string();
  ASSERT_FALSE(fs::path(relative).is_absolute());
  const std::string yaml = (fs::current_path() / relative).lexically_normal().string();
  const std::string trace = (dir.path() / "gpu.ctxtrace").string();
  const RunResult train =
      Ctxtrain({"--gpu", relative, "--host-ram", "250GiB", "--trace", trace}, dir);
  ASSERT_EQ(train.exit_code, 0) << train.err;
  const TraceMetadata m = ReadOpTrace(trace).metadata;
  EXPECT_EQ(m.at("plan_gpu"), yaml);
  EXPECT_EQ(m.count("plan_machine"), 0u);
  EXPECT_EQ(m.at("plan_host_ram_bytes"), std::to_string(int64_t{250} << 30));
  // Replayed from another directory, where the relative name would not resolve.
  struct InDirectory {
    explicit InDirectory(const fs::path& to) : back(fs::current_path()) { fs::current_path(to); }
    ~InDirectory() { fs::current_path(back); }
    fs::path back;
  };
  // (Deeper than the name climbs with "..", so that it climbs to nowhere.)
  fs::path deep = elsewhere.path();
  for (const fs::path& part : fs::path(relative))
    if (part == "..") deep /= "d";
  fs::create_directories(deep / "d");
  {
    InDirectory moved(deep / "d");
    ASSERT_FALSE(fs::exists(relative));
    const RunResult replay = RunArgv({CTXPLAN_EXE, "replay", trace, "--json"}, elsewhere.path());
    ASSERT_EQ(replay.exit_code, 0) << replay.err;
    EXPECT_EQ(JsonField(replay.out, "machine"), "h100-sxm+250GiB") << replay.out;
    EXPECT_EQ(JsonField(replay.out, "machine_from"), "from the trace");
  }
  fs::remove(yaml);
  const RunResult replay = RunArgv({CTXPLAN_EXE, "replay", trace, "--json"}, dir.path());
  ASSERT_EQ(replay.exit_code, 0) << replay.err;
  EXPECT_EQ(JsonField(replay.out, "machine"), "h200-125g") << replay.out;
  EXPECT_EQ(JsonField(replay.out, "machine_from"),
            "default h200-125g: the trace's GPU '" + yaml + "' is no longer a readable file here");
}

// Start-up is reported apart from the steps: one line by phase (on the CPU backend, weights and
// other), the same figures in the JSON and in the trace, and the steps' own time; the lines that
// scripts grep keep their form.
TEST(CtxtrainCli, ReportsStartUpApartFromTheSteps) {
  ScratchDir dir;
  const RunResult text = Ctxtrain({"--steps", "2"}, dir);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  std::smatch line;
  ASSERT_TRUE(std::regex_search(text.out, line,
                                std::regex("\n  start-up ([0-9.]+) s \\(weights ([0-9.]+), other "
                                           "([0-9.]+)\\); first step after ([0-9.]+) s\n")))
      << text.out;
  EXPECT_EQ(line[1], line[4]);  // start-up ends where the first step starts
  EXPECT_TRUE(std::regex_search(
      text.out, std::regex("\n  steps [0-9.]+ s, start-up excluded: first [0-9.]+ s, then "
                           "[0-9.]+ s a step\n")))
      << text.out;
  EXPECT_TRUE(std::regex_search(text.out, std::regex("[0-9.]+ tokens/s"))) << text.out;
  EXPECT_NE(text.out.find("arena allocated peak"), std::string::npos);
  EXPECT_NE(text.out.find("optimizer state and staging) "), std::string::npos);

  const std::string trace = (dir.path() / "s.ctxtrace").string();
  const RunResult json = Ctxtrain({"--steps", "2", "--json", "--trace", trace}, dir);
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const TraceMetadata m = ReadOpTrace(trace).metadata;
  double phases = 0;
  for (const char* key :
       {"startup_seconds", "startup_context_seconds", "startup_weights_seconds",
        "startup_arena_seconds", "startup_pinning_seconds", "startup_other_seconds"}) {
    SCOPED_TRACE(key);
    const std::string value = JsonField(json.out, key);
    ASSERT_FALSE(value.empty()) << json.out;
    EXPECT_EQ(m.at(key), value);  // the trace carries the figures the run reports
    EXPECT_GE(std::stod(value), 0.0);
    if (std::string(key) != "startup_seconds") phases += std::stod(value);
  }
  const double total = std::stod(m.at("startup_seconds"));
  EXPECT_GT(total, 0.0);
  EXPECT_GT(std::stod(m.at("startup_weights_seconds")), 0.0);  // the weights took some time
  EXPECT_NEAR(phases, total, 1e-5);                            // the phases add up to it
  // The CPU backend creates no context, reserves no device arena and pins nothing.
  EXPECT_EQ(m.at("startup_context_seconds"), "0.000000");
  EXPECT_EQ(m.at("startup_arena_seconds"), "0.000000");
  EXPECT_EQ(m.at("startup_pinning_seconds"), "0.000000");
  // The steps' own time: the first and the later ones, start-up excluded.
  const double steps = std::stod(JsonField(json.out, "steps_seconds"));
  const double first = std::stod(JsonField(json.out, "first_step_seconds"));
  const double later = std::stod(JsonField(json.out, "later_step_seconds"));
  EXPECT_GT(first, 0.0);
  EXPECT_GT(later, 0.0);
  EXPECT_NEAR(steps, first + later, 1e-5);  // two steps
  EXPECT_EQ(JsonField(Ctxtrain({"--json"}, dir).out, "later_step_seconds"), "null");
}

}  // namespace
}  // namespace ctxplan
