// ctxtrain: chunk-recurrent training — the real runtime the planner predicts. It executes the
// step plan op by op (the same plan `ctxplan` simulates) on a backend, and records what it did.
//
//   ctxtrain --backend cpu --model tiny --context 2K --chunk 256 --page 64 --task retrieval
//            --steps 20 --trace step.ctxtrace --save run.ckpt
//
// Exit codes: 0 success, 2 bad input (one line), 3 the run failed (NaN loss, a CUDA error,
// pinned memory refused), 1 an internal error. A failed run never touches an existing checkpoint.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>

#include <CLI/CLI.hpp>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "ctxplan/runtime/cpu/cpu_backend.h"
#include "ctxplan/runtime/dist/local_launcher.h"
#include "ctxplan/runtime/dist/rank_env.h"
#include "ctxplan/runtime/dist/rendezvous.h"
#include "ctxplan/runtime/io/checkpoint.h"
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
#include <cuda_runtime_api.h>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/cuda/cuda_backend.h"
#ifdef CTXPLAN_HAVE_NCCL
#include "ctxplan/runtime/cuda/nccl_stage_peers.h"
#include "ctxplan/runtime/cuda/peer_links.h"
#endif
#include "ctxplan/runtime/cuda/cupti_tracer.h"
#include "ctxplan/runtime/cuda/gpu_clock_sampler.h"
#include "ctxplan/runtime/cuda/machine_identity.h"
#endif
#include "ctxplan/runtime/cpu/wall_clock_tracer.h"
#include "ctxplan/runtime/io/safetensors.h"
#include "ctxplan/runtime/io/token_data.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/runtime/plan/run_metadata.h"
#include "ctxplan/runtime/plan/step_backend.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/gpu_tier.h"
#include "ctxplan/sim/measured_pass_clocks.h"
#include "ctxplan/sim/plan_report.h"
#include "ctxplan/sim/recommend.h"
#include "ctxplan/traces/atomic_file.h"
#include "ctxplan/traces/chrome_trace_writer.h"
#include "ctxplan/traces/op_trace.h"
#include "ctxplan_git_commit.h"  // generated at build time: CTXPLAN_GIT_COMMIT
#include "data_source.h"
#include "run_flags.h"
#include "run_report.h"
#include "step_observers.h"

namespace ctxplan::train {
namespace {

using cli::AddRunFlags;
using cli::ResolveModel;
using cli::ResolveOptions;
using cli::RunFlags;
using Clock = std::chrono::steady_clock;

// As near the process's start as the program can read the clock: during static initialisation,
// before main. Start-up is measured from here.
const Clock::time_point kProcessStart = Clock::now();

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The command line the run was started with, without the program's name: a trace says how to run
// it again. Joined with spaces, unquoted.
std::string JoinFlags(int argc, char** argv) {
  std::string flags;
  for (int i = 1; i < argc; ++i) flags += (i > 1 ? " " : "") + std::string(argv[i]);
  return flags;
}

struct Flags {
  RunFlags run;  // model, machine and run options, shared with ctxplan
  std::string backend = "cpu";
  int64_t steps = 1;
  std::string data;
  std::string task = "retrieval";
  uint64_t seed = 1;
  std::string weights;
  double lr = 1e-3;
  std::string trace;
  std::string save, resume;
  int64_t save_every = 0;  // steps between checkpoints (0: after the last step only)
  bool json = false;
  bool force = false;
  int peer_timeout = 600;      // seconds
  std::string export_weights;  // a folder: model.safetensors + config.json of the initial weights
  std::string dump_grads;      // the first step's gradients, as safetensors with HF names

  Flags() {  // small defaults: the CPU backend trains the tiny model in seconds
    run.model = "tiny";
    run.context = "1024";
    run.chunk = "256";
    run.page = "64";
    run.budget = "all";
    run.query_tile = "64";
    run.grad_dtype = "fp32";
  }
};

// "rank R: " before every error line of a rank of several GPUs (their lines share one log).
std::string rank_prefix;

std::string UtcNow() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

// A Hugging Face model folder of `weights`: what transformers' from_pretrained reads.
void ExportHuggingFace(const std::string& folder, const ModelSpec& m, const ModelWeights& weights) {
  std::filesystem::create_directories(folder);
  WriteSafetensorsWeights(std::filesystem::path(folder) / "model.safetensors", m, weights,
                          SafetensorsDtype::kF32);
  const bool llama = m.model_type == "llama" || m.model_type == "mistral";
  char json[2048];
  std::snprintf(
      json, sizeof json,
      "{\"architectures\": [\"%s\"], \"model_type\": \"%s\", \"hidden_size\": %lld, "
      "\"intermediate_size\": %lld, \"num_hidden_layers\": %lld, \"num_attention_heads\": %lld, "
      "\"num_key_value_heads\": %lld, \"head_dim\": %lld, \"vocab_size\": %lld, "
      "\"max_position_embeddings\": %lld, \"rope_theta\": %.17g, \"rms_norm_eps\": %.17g, "
      "\"tie_word_embeddings\": %s, \"attention_bias\": %s, \"hidden_act\": \"silu\", "
      "\"torch_dtype\": \"float32\"}\n",
      llama ? "LlamaForCausalLM" : "Qwen2ForCausalLM", llama ? "llama" : "qwen2",
      static_cast<long long>(m.hidden_size), static_cast<long long>(m.intermediate_size),
      static_cast<long long>(m.num_hidden_layers), static_cast<long long>(m.num_attention_heads),
      static_cast<long long>(m.num_key_value_heads), static_cast<long long>(m.head_dim),
      static_cast<long long>(m.vocab_size), static_cast<long long>(m.max_position_embeddings),
      m.rope_theta, m.rms_norm_eps, m.tie_word_embeddings ? "true" : "false",
      m.attention_bias ? "true" : "false");
  AtomicFileWriter file(std::filesystem::path(folder) / "config.json");
  file.stream() << json;
  file.Commit();
}

int64_t HostPhysicalBytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) *
         static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

// On CUDA, the options the user did not give are the planner's (ctxplan's defaults, not the
// CPU reference's small ones): page-sparse k 64 in pages of 128, query tile 128, bf16 gradients.
void CudaDefaults(const CLI::App& app, RunFlags& run) {
  const RunFlags planner;
  for (const auto& [flag, field] :
       {std::pair{"--budget", &RunFlags::budget}, std::pair{"--sinks", &RunFlags::sinks},
        std::pair{"--query-tile", &RunFlags::query_tile},
        std::pair{"--grad-dtype", &RunFlags::grad_dtype},
        std::pair{"--selection", &RunFlags::selection}})
    if (app.count(flag) == 0) run.*field = planner.*field;
}

// On CUDA, chunk, page, offload, keeping layer inputs and the optimizer's placement, where the
// user gave none, are the fastest that fits as `ctxplan recommend` finds it; printed.
RunOptions Recommended(const CLI::App& app, const ModelSpec& model, const MachineSpec& machine,
                       const RunOptions& given, const sim::GpuTierSetting& tier,
                       std::string_view margin, bool print) {
  sim::RecommendSpace space;
  const bool chunk = app.count("--chunk") > 0, page = app.count("--page") > 0;
  const bool offload = app.count("--offload") > 0, keep = app.count("--keep-layer-inputs") > 0;
  const bool optimizer = app.count("--optimizer") > 0;
  const bool gpu_tier = app.count("--gpu-tier") > 0;
  if (chunk && page && offload && keep && optimizer && gpu_tier) return given;
  if (!gpu_tier) space.gpu_tiers = sim::SearchedGpuTiers(margin);
  if (chunk) space.chunks = {given.chunk_tokens};
  if (page) space.pages = {given.page_tokens};
  if (offload) space.offload = {given.offload};
  if (keep) space.keep_layer_inputs = {given.keep_layer_inputs};
  space.search_optimizer_placement = !optimizer;
  const sim::Recommendation r = sim::Recommend(model, machine, given, tier, space);
  if (!r.fastest) return given;  // nothing fits: the planner's check below says so
  const RunOptions& o = r.fastest->options;
  if (print)
    std::fprintf(
        stderr,
        "ctxtrain: the planner's fastest settings for %s on %s at %lld tokens (ctxplan recommend, "
        "%.0f tokens/s predicted): chunk %lld, page %lld, offload %s%s, layer inputs %s, "
        "optimizer %s\n",
        model.name.c_str(), machine.name.c_str(), static_cast<long long>(o.context_tokens),
        r.fastest->report.tokens_per_second, static_cast<long long>(o.chunk_tokens),
        static_cast<long long>(o.page_tokens), o.offload ? "on" : "off",
        o.offload && o.gpu_tier_pages > 0
            ? (" (GPU tier " + sim::GpuTierFlag(r.fastest->gpu_tier) + ", " +
               std::to_string(o.gpu_tier_pages) + " pages a layer)")
                  .c_str()
            : "",
        o.keep_layer_inputs ? "kept" : "recomputed",
        std::string(OptimizerName(o.optimizer)).c_str());
  return o;
}

// SIGINT and SIGTERM while installed: noted, so the step in flight ends and the run stops with
// its checkpoint rather than dying mid-step. The previous handlers come back on destruction.
class StopSignals {
 public:
  StopSignals() {
    struct sigaction action {};
    action.sa_handler = [](int signal) { received_.store(signal); };
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGINT, &action, &previous_int_);
    ::sigaction(SIGTERM, &action, &previous_term_);
  }
  ~StopSignals() {
    ::sigaction(SIGINT, &previous_int_, nullptr);
    ::sigaction(SIGTERM, &previous_term_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  static int received() { return received_.load(); }

 private:
  static inline std::atomic<int> received_{0};
  struct sigaction previous_int_ {};
  struct sigaction previous_term_ {};
};
static_assert(std::atomic<int>::is_always_lock_free, "a signal handler stores into it");

int Main(int argc, char** argv) {
  CLI::App app{"ctxtrain: chunk-recurrent long-context training on the step plan"};
  Flags f;
  const std::string flags = JoinFlags(argc, argv);
  app.add_option("--backend", f.backend,
                 "cpu (reference kernels; small defaults) or cuda (the options not given are the "
                 "planner's: its defaults, and chunk, page, offload, kept inputs and optimizer "
                 "placement from `ctxplan recommend`, printed at start)")
      ->capture_default_str();
  AddRunFlags(app, f.run, /*with_context=*/true);
  app.add_option("--steps", f.steps, "training steps")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--data", f.data, "binary file of uint32 token ids (instead of --task)");
  app.add_option("--task", f.task, "synthetic task: retrieval or random")->capture_default_str();
  app.add_option("--seed", f.seed, "seed of weights and synthetic data")->capture_default_str();
  app.add_option("--weights", f.weights, "initial weights: a safetensors file or sharded index");
  app.add_option("--lr", f.lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--trace", f.trace,
                 "trace the last step: FILE.ctxtrace (compact) or FILE.json (Perfetto)");
  app.add_option("--save", f.save, "write a checkpoint after the last step (atomically)");
  app.add_option("--save-every", f.save_every,
                 "with --save, also write it every N steps (each write replaces the last "
                 "atomically); SIGINT / SIGTERM end the run after the step in flight, saved")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--resume", f.resume, "resume from a checkpoint");
  app.add_flag("--json", f.json, "print the result as JSON");
  app.add_flag("--force", f.force, "run even if the planner predicts it will not fit");
  app.add_option("--peer-timeout", f.peer_timeout,
                 "several GPUs: seconds a rank waits on its peers before it calls one dead and "
                 "stops every rank")
      ->capture_default_str()
      ->check(CLI::Range(1, 86400));
  app.add_option("--export-weights", f.export_weights,
                 "write the initial weights as a Hugging Face folder (model.safetensors + "
                 "config.json), e.g. to check gradients against transformers");
  app.add_option("--dump-grads", f.dump_grads,
                 "write the first step's parameter gradients (fp32 safetensors, HF names)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "ctxtrain: " << e.what() << "; see ctxtrain --help\n";
    return 2;
  }

#ifndef CTXPLAN_HAVE_CUDA_BACKEND
  if (f.backend == "cuda")
    throw InputError(
        "--backend cuda: this ctxtrain was built without CUDA (configure with "
        "-DCTXPLAN_CUDA=ON); accepted: cpu");
#endif
  if (f.backend != "cpu" && f.backend != "cuda")
    throw InputError("--backend: '" + f.backend + "' is not a backend; accepted: cpu, cuda");
  const bool cuda = f.backend == "cuda";
  // Several GPUs on CUDA: one process per GPU. Started by a launcher (torchrun, mpirun, srun:
  // RANK and WORLD_SIZE set), this process is one rank; else --gpus N starts N ranks here.
  std::optional<dist::RankEnv> ranks = cuda ? dist::RankEnvFromEnvironment() : std::nullopt;
  if (ranks && ranks->world_size == 1) ranks.reset();
  if (cuda && !ranks && cli::ParseNonNegative(f.run.gpus, "--gpus") > 1) {
#ifndef CTXPLAN_HAVE_NCCL
    throw InputError("--gpus " + f.run.gpus +
                     ": this ctxtrain was built without NCCL; accepted: --gpus 1");
#else
    const std::vector<std::string> args(argv + 1, argv + argc);
    return dist::LaunchLocalRanks(dist::ExecutablePath(), args,
                                  static_cast<int>(cli::ParseNonNegative(f.run.gpus, "--gpus")),
                                  std::cerr);
#endif
  }
  if (ranks) {
    if (app.count("--gpus") > 0 && f.run.gpus != std::to_string(ranks->world_size))
      throw InputError("--gpus " + f.run.gpus + " in a launch of " +
                       std::to_string(ranks->world_size) +
                       " ranks (WORLD_SIZE); accepted: --gpus " +
                       std::to_string(ranks->world_size) + " or none");
    f.run.gpus = std::to_string(ranks->world_size);
    // Each rank holds its stage's gradients only; one file of them all is not gathered yet.
    // --export-weights needs no gathering where every rank starts from the whole model (random,
    // made whole for it, or --weights): the first rank writes it. A resumed rank holds its
    // stage's tensors only.
    if (!f.dump_grads.empty())
      throw InputError(
          "--dump-grads with several GPUs: not yet; accepted: --dump-grads on one GPU");
    if (!f.export_weights.empty() && !f.resume.empty())
      throw InputError(
          "--export-weights with --resume on several GPUs: each rank resumes its own stage's "
          "tensors; accepted: --export-weights without --resume, or on one GPU");
    rank_prefix = "rank " + std::to_string(ranks->rank) + ": ";
    // One checkpoint file a rank, of its stage's tensors: run.ckpt -> run.ckpt.rank0, ...
    const std::string shard = ".rank" + std::to_string(ranks->rank);
    if (!f.save.empty()) f.save += shard;
    if (!f.resume.empty()) f.resume += shard;
    // One trace a rank, of its own ops: run.ctxtrace -> run.rank1.ctxtrace (rank 0 keeps the
    // name); `ctxplan replay` compares each with the plan's ops of that rank.
    if (!f.trace.empty() && ranks->rank > 0) {
      const size_t dot = f.trace.find_last_of('.');
      const size_t slash = f.trace.find_last_of('/');
      const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
      const std::string tag = ".rank" + std::to_string(ranks->rank);
      f.trace = has_ext ? f.trace.substr(0, dot) + tag + f.trace.substr(dot) : f.trace + tag;
    }
  }
  const bool lead = !ranks || ranks->rank == 0;  // the rank that reports
#ifdef CTXPLAN_HAVE_NCCL
  std::unique_ptr<gpu::PeerLinks> links;
  std::unique_ptr<gpu::NcclStagePeers> peers;
  if (ranks) {
    links = gpu::PeerLinks::Connect(*ranks, std::chrono::seconds(f.peer_timeout));
    peers = std::make_unique<gpu::NcclStagePeers>(*links, std::chrono::seconds(f.peer_timeout));
  }
#endif
  const ModelSpec model = ResolveModel(f.run);
  // The machine the run is planned for (default h200-125g): the CUDA check below asks the
  // planner about it, the GPU tier is sized for it, and traces name it so that replay predicts
  // for the same machine.
  const MachineSpec machine = cli::ResolveMachine(f.run);
  const sim::GpuTierSetting tier =
      sim::ParseGpuTierSetting(f.run.gpu_tier, f.run.gpu_tier_margin, "--gpu-tier");
  if (cuda) CudaDefaults(app, f.run);
  RunOptions options =
      sim::WithGpuTier(model, machine, ResolveOptions(f.run, model, /*with_context=*/true), tier);
  if (cuda) options = Recommended(app, model, machine, options, tier, f.run.gpu_tier_margin, lead);
  if (!(f.lr > 0.0 && f.lr < 1.0)) throw InputError("--lr: must lie in (0, 1)");
  const StepPlan plan(model, options);
  PlanMachine plan_machine;
  plan_machine.gpu = f.run.gpu;
  if (f.run.gpu.empty()) plan_machine.machine = f.run.machine.empty() ? "h200-125g" : f.run.machine;
  plan_machine.host_ram_bytes = machine.host_ram_bytes;
  plan_machine.name = machine.name;
  Startup startup;

  // Ask the planner first: a run that cannot fit is refused before it allocates anything.
  // The ranks this launch started share this host's memory.
  const sim::MemoryPrediction predicted = sim::AnalyticModel::PredictMemory(
      plan.geometry(), std::max(machine.gpus, plan.geometry().stages()));
  const int64_t host_have = HostPhysicalBytes();
  if (cuda) {
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
    // The first runtime call creates the CUDA context: one call of its own, so that start-up can
    // say what the context cost.
    const Clock::time_point context_start = Clock::now();
    const cudaError_t context = cudaFree(nullptr);
    if (context != cudaSuccess)
      throw TrainingError(std::string("no usable GPU: ") + cudaGetErrorString(context));
    startup.context = SecondsSince(context_start);
    sim::StepPrediction memory;
    memory.gpu = predicted.gpu;
    memory.host = predicted.host;
    const sim::PlanReport report = sim::MakeReport(plan.geometry(), machine, memory);
    size_t free_bytes = 0, total_bytes = 0;
    const cudaError_t status = cudaMemGetInfo(&free_bytes, &total_bytes);
    if (status != cudaSuccess)
      throw TrainingError(std::string("no usable GPU: ") + cudaGetErrorString(status));
    const int64_t gpu_have = static_cast<int64_t>(total_bytes);
    if ((report.gpu_memory.device > gpu_have || report.host_peak > host_have) && !f.force)
      throw InputError("the planner predicts " + FormatGiB(report.gpu_memory.device) +
                       " of GPU memory (this GPU has " + FormatGiB(gpu_have) + ") and " +
                       FormatGiB(report.host_peak) + " of pinned host memory (this machine has " +
                       FormatGiB(host_have) + "); accepted: a smaller run, or --force");
#endif
  } else {
    // The CPU backend holds the "GPU" arena in host memory too.
    const int64_t needed = predicted.gpu.peak_bytes + predicted.host.peak_bytes;
    if (needed > host_have && !f.force)
      throw InputError("the planner predicts " + FormatGiB(needed) + " (arena " +
                       FormatGiB(predicted.gpu.peak_bytes) + " + pinned " +
                       FormatGiB(predicted.host.peak_bytes) + ") but this machine has " +
                       FormatGiB(host_have) + "; accepted: a smaller run, or --force");
  }

  // Weights, optimizer state, first step.
  Clock::time_point weights_start = Clock::now();
  // A rank of several GPUs makes only its stage's random weights (the backend keeps no others),
  // unless the first rank is to export the whole model's.
  const bool stage_weights = ranks && f.export_weights.empty();
  ModelWeights weights = f.weights.empty()
                             ? RandomWeights(model, f.seed, stage_weights ? ranks->rank : 0,
                                             stage_weights ? ranks->world_size : 1)
                             : LoadSafetensorsWeights(f.weights, model);
  startup.weights = SecondsSince(weights_start);
  // The CPU backend's AdamW moments live on the host; the CUDA backend keeps its own on the GPU
  // (at 7B the host copies alone would take 61 GB of the RAM that pinned pages need).
  OptimizerState optimizer;
  if (!cuda) optimizer = {ZeroWeights(model), ZeroWeights(model), {}};
  optimizer.params.lr = static_cast<float>(f.lr);
  int64_t first_step = 0;
  LoraWeights resumed_lora, resumed_lora_m, resumed_lora_v;  // rank 0: none
  bool resumed_lora_moments = false;
  if (!f.resume.empty()) {
    weights_start = Clock::now();
    TrainingCheckpoint checkpoint = LoadCheckpoint(f.resume, model);
    startup.weights += SecondsSince(weights_start);  // the checkpoint's weights replace them
    const int32_t stages = ranks ? ranks->world_size : 1, stage = ranks ? ranks->rank : 0;
    if (checkpoint.pipeline_stages != stages || checkpoint.pipeline_stage != stage)
      throw InputError(f.resume + ": a checkpoint of pipeline stage " +
                       std::to_string(checkpoint.pipeline_stage) + " of " +
                       std::to_string(checkpoint.pipeline_stages) + ", resumed as stage " +
                       std::to_string(stage) + " of " + std::to_string(stages) +
                       "; accepted: the run's own stage (--gpus " +
                       std::to_string(checkpoint.pipeline_stages) + ")");
#ifdef CTXPLAN_HAVE_NCCL
    // Every rank's file must be of the same step: a save killed between two ranks' writes
    // leaves them apart.
    if (links && links->AllReduceSum(static_cast<double>(checkpoint.step)) !=
                     static_cast<double>(checkpoint.step) * stages)
      throw InputError(f.resume + ": the ranks' checkpoints are of different steps (this one " +
                       std::to_string(checkpoint.step) +
                       "); accepted: the files of one save, all ranks");
#endif
    if (checkpoint.lora.rank != options.lora_rank)
      throw InputError(f.resume + ": the checkpoint's LoRA rank is " +
                       std::to_string(checkpoint.lora.rank) + " but the run asks for " +
                       std::to_string(options.lora_rank) + "; accepted: --lora-rank " +
                       std::to_string(checkpoint.lora.rank));
    resumed_lora = std::move(checkpoint.lora);
    resumed_lora_moments = checkpoint.lora_m.rank > 0;
    resumed_lora_m = std::move(checkpoint.lora_m);
    resumed_lora_v = std::move(checkpoint.lora_v);
    weights = std::move(checkpoint.weights);
    // The moments go to the host optimizer (CPU) or, after it is built, to the CUDA backend's.
    if (checkpoint.has_optimizer_state()) {
      optimizer.m = std::move(checkpoint.adam_m);
      optimizer.v = std::move(checkpoint.adam_v);
    }
    first_step = checkpoint.step;
    optimizer.params.step = first_step + 1;
  }
  const DataSource data(f.data, f.task, f.seed, model, options.context_tokens);
  if (!f.export_weights.empty() && lead) ExportHuggingFace(f.export_weights, model, weights);

  ModelWeights grads = cuda ? ModelWeights{} : ZeroWeights(model);
  std::unique_ptr<StepBackend> owned;
  CpuBackend* cpu_backend = nullptr;
  // LoRA: adapters from the seed (B at zero: the run starts from the base model), trained alone.
  std::optional<LoraState> lora;
  if (options.lora_rank > 0) {
    lora.emplace(LoraState{
        resumed_lora.rank > 0 ? std::move(resumed_lora)
                              : RandomLora(model, options.lora_rank, f.seed + 1),
        ZeroLora(model, options.lora_rank),
        resumed_lora_m.rank > 0 ? std::move(resumed_lora_m) : ZeroLora(model, options.lora_rank),
        resumed_lora_v.rank > 0 ? std::move(resumed_lora_v) : ZeroLora(model, options.lora_rank)});
  }
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
  CudaBackend* cuda_backend = nullptr;
  if (cuda) {
    CudaAdamW adamw;
    adamw.lr = static_cast<float>(f.lr);
    // The weights move in: freed once on the GPU, before the host pages are pinned.
    StagePeers* stage_peers = nullptr;
#ifdef CTXPLAN_HAVE_NCCL
    stage_peers = peers.get();
#endif
    auto b = std::make_unique<CudaBackend>(plan, std::move(weights), adamw,
                                           f.json || !lead ? nullptr : &std::cerr,
                                           lora ? &lora->weights : nullptr, stage_peers);
    cuda_backend = b.get();
    owned = std::move(b);
    // A resumed AdamW (on the GPU or the host) continues from its checkpoint's moments and step
    // count, the base's or (LoRA) the adapters'.
    if (options.optimizer != OptimizerKind::kNone) {
      if (!lora && !optimizer.m.layers.empty())
        cuda_backend->UploadOptimizer(
            {std::move(optimizer.m), std::move(optimizer.v), {}, {}, first_step});
      else if (lora && resumed_lora_moments)
        cuda_backend->UploadOptimizer({{}, {}, lora->m, lora->v, first_step});
    }
    optimizer.m = optimizer.v = ModelWeights{};
    // The upload, the arena and the pinning happen while the backend is built.
    const CudaStartupTimes built = cuda_backend->StartupTimes();
    startup.weights += built.weights_upload_seconds;
    startup.arena = built.arena_seconds;
    startup.pinning = built.pinning_seconds;
  }
#endif
  if (!cuda) {
    auto b = std::make_unique<CpuBackend>(
        model, weights, grads, options.optimizer == OptimizerKind::kNone ? nullptr : &optimizer,
        lora ? &*lora : nullptr);
    cpu_backend = b.get();
    owned = std::move(b);
  }
  (void)cpu_backend;
  StepBackend& backend = *owned;
  Progress progress(f.steps, plan.geometry().num_chunks(), options.context_tokens, lead);

  // The first step pays one-time costs (cuBLASLt plans, first touches): tokens/s counts the
  // steps after it when there are any.
  double last_loss = 0.0, total_seconds = 0.0, steady_seconds = 0.0, first_seconds = 0.0;
  StepOutputs last;
  // What the run reports at its end (run_report.h). Filled as the run goes: the SM clock and
  // board power over the steps tokens/s counts and the traced step's clock pass by pass (NVML; a
  // step held at the power limit runs below the maximum clock: sim/clock_model.h); the rest after
  // the last step.
  RunReport report;
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
  std::unique_ptr<gpu::GpuClockSampler> sampler;
  if (cuda) {
    int device = 0;
    CTXPLAN_CUDA_CHECK(cudaGetDevice(&device));
    sampler = std::make_unique<gpu::GpuClockSampler>(device);
    sampler->Begin();
  }
#endif
  // The checkpoint after `steps_done` optimizer steps, written atomically to --save.
  auto save = [&](int64_t steps_done) {
    TrainingCheckpoint checkpoint;
    checkpoint.step = steps_done;
    checkpoint.seed = f.seed;
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
    if (cuda_backend) {
      checkpoint.weights = cuda_backend->DownloadWeights();
      CudaOptimizerState state = cuda_backend->DownloadOptimizer();  // empty without AdamW
      checkpoint.adam_m = std::move(state.m);
      checkpoint.adam_v = std::move(state.v);
      checkpoint.lora_m = std::move(state.lora_m);  // LoRA: the adapters' moments
      checkpoint.lora_v = std::move(state.lora_v);
    }
#endif
    if (!cuda) checkpoint.weights = weights;
    if (lora) {
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
      if (cuda_backend) checkpoint.lora = cuda_backend->DownloadLora();
#endif
      if (!cuda) {
        checkpoint.lora = lora->weights;
        if (options.optimizer != OptimizerKind::kNone) {
          checkpoint.lora_m = lora->m;
          checkpoint.lora_v = lora->v;
        }
      }
    } else if (!cuda && options.optimizer != OptimizerKind::kNone) {
      checkpoint.adam_m = optimizer.m;
      checkpoint.adam_v = optimizer.v;
    }
    RunMetadata metadata;
    AddRunOptions(options, metadata);
    checkpoint.options = metadata;
    if (ranks) {  // this rank's stage: DownloadWeights gave its tensors only
      checkpoint.pipeline_stage = ranks->rank;
      checkpoint.pipeline_stages = ranks->world_size;
    }
    SaveCheckpoint(f.save, model, checkpoint);
  };
  bool saved_after_last = false;
  StopSignals stop_signals;
  for (int64_t s = first_step; s < first_step + f.steps; ++s) {
    const TokenSequence inputs = data.Step(s);
    if (!cuda) {  // the CUDA backend zeroes its own (below)
      const auto zero = [](const std::string&, std::vector<float>& t) {
        std::fill(t.begin(), t.end(), 0.0f);
      };
      grads.ForEach(zero);
      if (lora) lora->grads.ForEach(zero);
    }
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
    if (cuda_backend) cuda_backend->ZeroGrads();
#endif
    progress.StartStep(s - first_step);
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
    if (sampler && s == first_step + 1) sampler->Begin();  // the steps after the first
#endif
    const auto start = Clock::now();
    if (s == first_step)
      startup.total = std::chrono::duration<double>(start - kProcessStart).count();
    // A traced step is timed around its RunStep alone: the tracer's setup, its records' mapping
    // to plan ops and the trace file's writing (30-70 ms a step) are not the step's.
    double traced_seconds = -1;
    auto traced_run = [&](StepObserver* observer) {
      const auto run_start = Clock::now();
      last = RunStep(plan, {inputs.tokens, inputs.labels}, backend, observer);
      traced_seconds = std::chrono::duration<double>(Clock::now() - run_start).count();
    };
    try {
      if (s == first_step + f.steps - 1 && !f.trace.empty()) {
        RunMetadata metadata{{"source", "ctxtrain"},         {"backend", f.backend},
                             {"model", model.name},          {"step", std::to_string(s)},
                             {"commit", CTXPLAN_GIT_COMMIT}, {"date", UtcNow()}};
        AddRunOptions(options, metadata);
        AddPlanMachine(plan_machine, metadata);
        metadata["ctxtrain_flags"] = flags;
        if (ranks) {
          metadata["rank"] = std::to_string(ranks->rank);
          metadata["world_size"] = std::to_string(ranks->world_size);
        }
        metadata["startup_seconds"] = SecondsText(startup.total);
        metadata["startup_context_seconds"] = SecondsText(startup.context);
        metadata["startup_weights_seconds"] = SecondsText(startup.weights);
        metadata["startup_arena_seconds"] = SecondsText(startup.arena);
        metadata["startup_pinning_seconds"] = SecondsText(startup.pinning);
        metadata["startup_other_seconds"] = SecondsText(startup.other());
        const bool compact =
            f.trace.size() >= 9 && f.trace.substr(f.trace.size() - 9) == ".ctxtrace";
        // CPU ops run synchronously: the wall clock times them. CUDA ops run asynchronously:
        // CUPTI times them on the GPU, each activity mapped to its plan op.
        auto traced_step = [&](OpTraceWriter* writer, ChromeTraceWriter* chrome) {
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
          if (cuda) {
            gpu::CuptiTracerOptions tracer_options;
            tracer_options.enabled = true;
            gpu::CuptiTracer tracer(tracer_options);
            tracer.SetOutputs(writer, chrome);
            CuptiStepObserver observer(tracer, ranks ? ranks->rank : 0);
            BothObservers both(&observer, &progress);
            tracer.BeginStep();
            // The trace's clock against the host's, to put NVML's readings on the ops' times.
            const int64_t trace_at_begin = tracer.NowNs();
            const auto host_at_begin = std::chrono::steady_clock::now();
            if (sampler) sampler->StartRecording();
            traced_run(&both);
            const gpu::TraceStepSummary summary = tracer.EndStep();
            if (sampler) {
              std::vector<sim::ClockSampleAt> samples;
              for (const gpu::TimedClockReading& r : sampler->StopRecording())
                samples.push_back(
                    {trace_at_begin +
                         std::chrono::duration_cast<std::chrono::nanoseconds>(r.at - host_at_begin)
                             .count(),
                     r.reading.sm_clock_mhz, r.reading.watts});
              report.traced_pass_clocks = sim::MeasurePassClocks(summary.ops, samples);
            }
            if (!f.json) PrintTracedCopies(summary);
            // GPU work no plan op claims would be missing from the trace's op times: say so.
            // (The step's input uploads before its first op are copies of no op: not counted.)
            if (!summary.unattributed_kernels.empty() || summary.dropped_records > 0) {
              std::string names;
              for (const std::string& name : summary.unattributed_kernels)
                names += (names.empty() ? "" : ", ") + name;
              std::fprintf(stderr,
                           "ctxtrain: warning: the trace has GPU kernels no plan op claims "
                           "(%s) and %llu dropped records\n",
                           names.empty() ? "none" : names.c_str(),
                           static_cast<unsigned long long>(summary.dropped_records));
            }
            return;
          }
#endif
          WallClockTracer tracer(writer, chrome);
          BothObservers both(&tracer, &progress);
          traced_run(&both);
        };
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
        if (cuda) {
          // The GPU's name, memory and CUDA versions; then what DeviceMetadata lacks: the SM
          // count (a GPU of the same name may be cut down) and the kernel driver's version.
          for (const auto& [key, value] : gpu::CuptiTracer::DeviceMetadata()) metadata[key] = value;
          int device = 0, sms = 0;
          CTXPLAN_CUDA_CHECK(cudaGetDevice(&device));
          CTXPLAN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
          metadata["gpu_sm_count"] = std::to_string(sms);
          if (const std::string driver = gpu::NvidiaDriverVersion(); !driver.empty())
            metadata["nvidia_driver_version"] = driver;
          if (const std::string uuid = gpu::GpuUuid(device); !uuid.empty())
            metadata["gpu_uuid"] = uuid;
          if (const std::string cpu = gpu::HostCpuModel(); !cpu.empty()) metadata["host_cpu"] = cpu;
          // What the allocators hold: all reserved before the first step, so known here.
          const CudaMemoryReport memory = cuda_backend->Memory();
          metadata["gpu_arena_allocated_bytes"] = std::to_string(memory.arena_allocated_peak_bytes);
          metadata["gpu_device_used_bytes"] = std::to_string(memory.device_used_peak_bytes);
          metadata["host_runtime_bytes"] = std::to_string(memory.host_bytes);
        }
#endif
        if (compact) {
          OpTraceWriter writer(f.trace, metadata);
          traced_step(&writer, nullptr);
          for (const StepOutputs::PageUnion& u : last.page_unions)
            writer.Union(
                {static_cast<uint8_t>(u.phase), u.chunk, u.layer, static_cast<int32_t>(u.pages)});
          writer.Finish();
        } else {
          AtomicFileWriter file(f.trace);
          {
            ChromeTraceWriter chrome(file.stream());
            for (const auto& [key, value] : metadata) chrome.Metadata(key, value);
            traced_step(nullptr, &chrome);
            chrome.Finish();
          }
          file.Commit();
        }
      } else {
        last = RunStep(plan, {inputs.tokens, inputs.labels}, backend, &progress);
      }
#ifdef CTXPLAN_HAVE_NCCL
      // The loss is the last stage's; every rank ends the step together, so the lead rank's
      // time is the step's.
      if (links) last.loss_sum = links->AllReduceSum(last.loss_sum);
#endif
    } catch (const TrainingError& e) {
      // "rank 1: step 0: ..." where the error names its rank already, not "step 0: rank 1: ...".
      std::string what = e.what();
      const bool named = !rank_prefix.empty() && what.rfind(rank_prefix, 0) == 0;
      if (named) what.erase(0, rank_prefix.size());
      throw TrainingError((named ? rank_prefix : "") + "step " + std::to_string(s) + ": " + what);
    }
    const double seconds =
        traced_seconds >= 0
            ? traced_seconds
            : std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    total_seconds += seconds;
    if (s > first_step) steady_seconds += seconds;
    if (s == first_step) first_seconds = seconds;
    last_loss = last.mean_loss();
    progress.EndStep(last_loss, seconds);
    if (s == first_step && !f.dump_grads.empty()) {
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
      if (cuda_backend) grads = cuda_backend->DownloadGrads();
#endif
      WriteSafetensorsWeights(f.dump_grads, model, grads, SafetensorsDtype::kF32);
    }
    if (!f.json && lead && isatty(STDERR_FILENO) != 1)
      std::fprintf(stderr, "step %lld: loss %.6f, %.3f s\n", static_cast<long long>(s), last_loss,
                   seconds);
    const int64_t done = s + 1 - first_step;  // this run's steps so far
    const bool last_step = done == f.steps;
    const bool due = !f.save.empty() && f.save_every > 0 && done % f.save_every == 0;
    if (due) {
      save(s + 1);
      saved_after_last = last_step;
    }
    if (const int signal = stop_signals.received(); signal != 0 && !last_step) {
      if (!f.save.empty() && !due) save(s + 1);
      std::fprintf(stderr, "ctxtrain: stopped by %s after step %lld of %lld: %s\n",
                   signal == SIGINT ? "SIGINT" : "SIGTERM", static_cast<long long>(done),
                   static_cast<long long>(f.steps),
                   f.save.empty() ? "nothing saved (no --save)"
                                  : ("checkpoint of step " + std::to_string(s + 1) + " in " +
                                     f.save + " (--resume it)")
                                        .c_str());
      return 128 + signal;
    }
  }

  if (!f.save.empty() && !saved_after_last) save(first_step + f.steps);

#ifdef CTXPLAN_HAVE_CUDA_BACKEND
  if (sampler) {
    const gpu::ClockReading clocks = sampler->End();
    report.sm_clock_mhz = clocks.sm_clock_mhz;
    report.board_watts = clocks.watts;
  }
#endif
  report.backend = f.backend;
  report.model = model.name;
  report.cuda = cuda;
  report.context_tokens = options.context_tokens;
  report.steps = f.steps;
  report.loss = last_loss;
  report.tokens_per_second =
      f.steps > 1 ? static_cast<double>(options.context_tokens * (f.steps - 1)) / steady_seconds
                  : static_cast<double>(options.context_tokens) / total_seconds;
  report.startup = startup;
  report.steps_seconds = total_seconds;
  report.first_step_seconds = first_seconds;
  report.later_step_seconds = f.steps > 1 ? steady_seconds / static_cast<double>(f.steps - 1) : 0.0;
  // Memory: CUDA's as its allocators hold it; the CPU backend's as the plan accounts it (its "GPU
  // arena" is host memory).
  report.arena_allocated = last.peak_arena_bytes;
  report.arena_reserved = (last.peak_arena_bytes + sim::kArenaGranularity - 1) /
                          sim::kArenaGranularity * sim::kArenaGranularity;
  report.pinned_host = last.peak_host_bytes;
  report.plan_arena_peak = last.peak_arena_bytes;
  report.plan_host_peak = last.peak_host_bytes;
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
  if (cuda_backend) {
    const CudaMemoryReport memory = cuda_backend->Memory();
    report.arena_allocated = memory.arena_allocated_peak_bytes;
    report.arena_reserved = memory.arena_reserved_bytes;
    report.device_used = memory.device_used_peak_bytes;
    report.pinned_host = memory.host_bytes;
  }
#endif
  report.gpu_tier_pages = plan.geometry().gpu_tier_pages();
  report.pages_per_layer = plan.geometry().total_pages();
  if (last.page_reads.total() > 0)
    for (const double fraction : kTierFractions)
      report.read_shares.push_back(ShareOfReads(last.page_reads, fraction));
  if (!lead) {  // one line each for the lead rank's log; the report is the lead's
    std::fprintf(stderr,
                 "ctxtrain: %sstage of layers %d-%d: arena allocated peak %s, device-level peak "
                 "%s, host %s; the plan's ops account %s\n",
                 rank_prefix.c_str(), plan.geometry().stage_first_layer(ranks->rank),
                 plan.geometry().stage_first_layer(ranks->rank + 1) - 1,
                 FormatGiB(report.arena_allocated).c_str(), FormatGiB(report.device_used).c_str(),
                 FormatGiB(report.pinned_host).c_str(), FormatGiB(last.peak_arena_bytes).c_str());
    return 0;
  }
  // Page-sparse: how this model's tiles overlapped in their selections, as the planner's union
  // rule's draw scale (plan_geometry.h), for `ctxplan plan --selection disjoint:S`; 0 where the
  // run says nothing of it (dense, or the CPU backend, which does not record its unions).
  {
    std::vector<DrawnUnion> drawn;
    for (const StepOutputs::PageUnion& u : last.page_unions)
      if (u.phase == Phase::kFill) drawn.push_back({u.chunk, u.pages});
    try {
      report.selection_draw_scale = FitUnionDrawScale(UnionSamplesOf(plan.geometry(), drawn));
    } catch (const InputError&) {  // no chunk whose union says anything
    }
  }
  if (f.json) {
    PrintRunReportJson(report);
  } else {
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
    if (cuda) {  // the text names the very GPU and host CPU: lent machines of one kind differ
      int device = 0;
      CTXPLAN_CUDA_CHECK(cudaGetDevice(&device));
      report.machine = gpu::GpuUuid(device) + ", host CPU " + gpu::HostCpuModel();
    }
#endif
    PrintRunReportText(report);
  }
  return 0;
}

}  // namespace
}  // namespace ctxplan::train

namespace {
// A rank that `ctxtrain --gpus N` stopped (SIGTERM) after another rank failed: that rank's line,
// or the launcher's, has said why; whatever this one fails on next is the stop's echo.
bool StoppedByLauncher() {
  return ctxplan::dist::LaunchedByLocalLauncher() &&
         ctxplan::train::StopSignals::received() == SIGTERM;
}

// The run's one error line, written whole (ranks share the terminal), and its exit code. A rank
// of `ctxtrain --gpus N` says it only if no other rank (nor the launcher) has said the run's:
// the same bad input on every rank is one line, not N.
// From here the process only ends: SIGINT and SIGTERM stay blocked, so the launcher stopping the
// other ranks cannot end this one between its claim and its line (which would leave none).
int ErrorLine(const std::string& line, int code) {
  sigset_t stops;
  sigemptyset(&stops);
  sigaddset(&stops, SIGINT);
  sigaddset(&stops, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &stops, nullptr);
  if (StoppedByLauncher()) return 128 + SIGTERM;
  if (!ctxplan::dist::ClaimTheErrorLine()) return code;
  std::cerr << ("ctxtrain: " + line + "\n") << std::flush;
  return code;
}

// "rank R: " before an error line of a rank, unless the message names its rank already.
std::string RankPrefix(const char* message) {
  const std::string& prefix = ctxplan::train::rank_prefix;
  return std::string(message).rfind(prefix, 0) == 0 ? "" : prefix;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    return ctxplan::train::Main(argc, argv);
  } catch (const ctxplan::InputError& e) {
    return ErrorLine(RankPrefix(e.what()) + e.what(), 2);
  } catch (const ctxplan::TrainingError& e) {
    return ErrorLine(RankPrefix(e.what()) + e.what(), 3);
  } catch (const ctxplan::dist::DistError& e) {
    return ErrorLine(RankPrefix(e.what()) + e.what(), 3);
  }
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
  catch (const ctxplan::kernels::CudaError& e) {  // the device failed: the run did, not our code
    return ErrorLine(RankPrefix(e.what()) + "CUDA error: " + e.what(), 3);
  }
#endif
  catch (const std::exception& e) {
    return ErrorLine(RankPrefix(e.what()) + "internal error: " + e.what(), 1);
  }
}
