// ctxplan-measure: the GPU half of `ctxplan calibrate`. Times the CUDA kernels of kernels/ (the
// entry points the runtime's CUDA backend calls, with its arguments) over a designed grid of
// shapes, and the PCIe, device and host copies, pinning and allocation the runtime does; writes
// the raw samples as CSV. The fitter in sim/ turns them into a GPU profile.
//
//   ctxplan-measure --output FILE [--quick] [--only GROUP[,GROUP]] [--reps N] [--device I]
//
// Groups: launch, gemm, lora, loss, attention, select, readback, memory, copy, links, host, power
// (the grid: the group's file, measure_kernels.cpp, measure_attention.cpp, measure_read_back.cpp,
// measure_transfers.cpp, measure_power.cpp; links only with several GPUs: the copies of every GPU
// at once). Measured on an H200: the whole grid 41 s (574 samples), --quick 8 s (130 samples);
// pinning 4 GiB five times is 8 s of it.
//
// Output (published atomically when the run completes): header comments `# key: value`
//   gpu_name, sm_count, memory_bytes, clock_mhz, memory_clock_mhz, memory_bus_bits, l2_bytes,
//   driver, cuda_driver, cuda_runtime, commit, date (UTC), host_cpus, host_cpu, gpu_uuid, quick
//   (0/1), and from NVML (0 without it) max_sm_clock_mhz, power_limit_w
// then the header line and one row per sample:
//   op,m,n,k,heads,kv_heads,head_dim,page_tokens,pages,pages_per_tile,grad_bytes,bytes,flops,
//   copies,seconds,sm_clock_mhz,watts
// Unused fields are 0. seconds: the median over --reps batches of the time of ONE call (copy
// rows: of one batch of `copies` cudaMemcpyAsync calls; memory-bound rows: each call behind a
// 20 us kernel, as in a step, less that kernel); bytes and flops: the op's cost
// descriptor (kernels/cost.h) for kernels, the bytes of one copy for copies. Attention rows: one
// launch over the chunk's own positions and its earlier pages, whose bytes and flops are the sum
// of the planner's two descriptors for it (own + paged, as plan_geometry.cpp splits it).
// page_topk's pages_per_tile: what PageTopK returned, min(pages, 1 sink + budget).
//
// Timing: CUDA events on one stream around batches of back-to-back calls (a batch lasts >= 2 ms),
// after a warm-up call; inputs random (never zeros) and, for memory-bound kernels, rotated over
// copies so that consecutive calls miss the L2 cache. Host-side costs (memcpy, pinning, the
// arena's cudaMalloc) on the steady clock. sm_clock_mhz and watts: NVML's SM clock and board
// power averaged over the timed batches (gpu_clock_sampler.h), 0 where not known.
//
// Exit codes: 0 done; 2 a bad flag or value, an unwritable --output, no CUDA GPU (one line on
// stderr, before any GPU work); 1 a CUDA error during the measurements (no file written).
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/cuda/machine_identity.h"
#include "ctxplan/traces/atomic_file.h"
#include "measure_common.h"
#include "measure_groups.h"

#if __has_include("ctxplan_git_commit.h")
#include "ctxplan_git_commit.h"  // generated at build time: CTXPLAN_GIT_COMMIT
#endif
#ifndef CTXPLAN_GIT_COMMIT
#define CTXPLAN_GIT_COMMIT "unknown"
#endif

namespace ctxplan::calibrate {
namespace {

constexpr const char* kProgram = "ctxplan-measure";

struct Group {
  const char* name;
  void (*measure)(Session&);
};
// In the order they run: the arena's large reservations last, when nothing else holds memory.
const std::vector<Group> kGroups = {
    {"launch", MeasureLaunch},     {"gemm", MeasureGemm},           {"lora", MeasureLora},
    {"loss", MeasureLoss},         {"attention", MeasureAttention}, {"select", MeasureSelect},
    {"readback", MeasureReadBack}, {"memory", MeasureMemory},       {"copy", MeasureCopy},
    {"links", MeasureLinks},       {"host", MeasureHost},           {"power", MeasurePower}};

struct Flags {
  std::string output;
  bool quick = false;
  std::vector<std::string> only;  // empty: every group
  int reps = 0;                   // 0: 5, or 3 with --quick
  int device = 0;
};

// "12.8" from cudaDriverGetVersion's / cudaRuntimeGetVersion's 12080.
std::string CudaVersion(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

// To the minute: kernel changes are dated so (sim/kernel_changes.h), and a GPU may be calibrated
// on the day a kernel changed, before or after the change.
std::string UtcDate() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[24];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%MZ", &utc);
  return text;
}

// The page-sparse backward's blocks these samples time (kernels/src/cuda/attention_bwd.cu):
// gathered, unless CTXPLAN_ATTN_BWD_SPARSE keeps key blocks.
std::string SparseBackwardBlocks() {
  const char* mode = std::getenv("CTXPLAN_ATTN_BWD_SPARSE");
  const bool keys =
      mode != nullptr && (std::strcmp(mode, "union") == 0 || std::strcmp(mode, "positions") == 0);
  return keys ? "key blocks" : "gathered";
}

// The backward's own key blocks these samples time: split one a query head where
// AttentionBackwardSplitsOwnHeads says, unless CTXPLAN_ATTN_BWD_SPLIT=off keeps one a KV head.
std::string OwnBackwardBlocks() {
  const char* mode = std::getenv("CTXPLAN_ATTN_BWD_SPLIT");
  return mode != nullptr && std::strcmp(mode, "off") == 0 ? "kv head" : "split";
}

// The page-sparse forward's blocks at head dim 64 these samples time: query-head slices as
// AttentionForwardSlices says, unless CTXPLAN_ATTN_FWD_SLICES takes them (=on, every launch: not
// a kernel a profile can describe) or leaves them (=off: one head's 128 queries a block).
std::string ForwardSparseD64() {
  const char* mode = std::getenv("CTXPLAN_ATTN_FWD_SLICES");
  if (mode != nullptr && std::strcmp(mode, "on") == 0) return "slices everywhere";
  return mode != nullptr && std::strcmp(mode, "off") == 0 ? "heads" : "by waves";
}

// The forward's query rows a block at head dim 64 these samples time: as AttentionForwardQueryRows
// says, unless CTXPLAN_ATTN_FWD_CONSUMERS fixes them.
std::string ForwardRowsD64() {
  const char* mode = std::getenv("CTXPLAN_ATTN_FWD_CONSUMERS");
  if (mode != nullptr && std::strcmp(mode, "2") == 0) return "128";
  if (mode != nullptr && std::strcmp(mode, "3") == 0) return "192";
  return "by waves";
}

void WriteHeader(std::ostream& out, int device, bool quick, const GpuClockSampler& clocks) {
  cudaDeviceProp prop{};
  CTXPLAN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int clock_khz = 0, memory_clock_khz = 0, bus_bits = 0, driver = 0, runtime = 0, l2_bytes = 0;
  CTXPLAN_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  CTXPLAN_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  CTXPLAN_CUDA_CHECK(cudaDeviceGetAttribute(&memory_clock_khz, cudaDevAttrMemoryClockRate, device));
  CTXPLAN_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  CTXPLAN_CUDA_CHECK(cudaDriverGetVersion(&driver));
  CTXPLAN_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  std::string nvidia = ctxplan::gpu::NvidiaDriverVersion();
  if (nvidia.empty()) nvidia = CudaVersion(driver);
  out << "# gpu_name: " << prop.name << "\n"
      << "# sm_count: " << prop.multiProcessorCount << "\n"
      << "# memory_bytes: " << prop.totalGlobalMem << "\n"
      << "# clock_mhz: " << clock_khz / 1000 << "\n"
      << "# memory_clock_mhz: " << memory_clock_khz / 1000 << "\n"
      << "# memory_bus_bits: " << bus_bits << "\n"
      << "# l2_bytes: " << l2_bytes << "\n"
      << "# driver: " << nvidia << "\n"
      << "# cuda_driver: " << CudaVersion(driver) << "\n"
      << "# cuda_runtime: " << CudaVersion(runtime) << "\n"
      << "# commit: " << CTXPLAN_GIT_COMMIT << "\n"
      << "# date: " << UtcDate() << "\n"
      << "# host_cpus: " << std::thread::hardware_concurrency() << "\n"
      << "# host_cpu: " << ctxplan::gpu::HostCpuModel() << "\n"
      << "# gpu_uuid: " << ctxplan::gpu::GpuUuid(device) << "\n"
      << "# quick: " << (quick ? 1 : 0) << "\n"
      << "# max_sm_clock_mhz: " << clocks.max_sm_clock_mhz() << "\n"
      << "# power_limit_w: " << clocks.power_limit_watts() << "\n"
      << "# sparse_bwd: " << SparseBackwardBlocks() << "\n"
      << "# own_bwd: " << OwnBackwardBlocks() << "\n"
      << "# fwd_rows_d64: " << ForwardRowsD64() << "\n"
      << "# fwd_sparse_d64: " << ForwardSparseD64() << "\n";
}

void WriteSamples(std::ostream& out, const std::vector<Sample>& samples) {
  out << "op,m,n,k,heads,kv_heads,head_dim,page_tokens,pages,pages_per_tile,grad_bytes,bytes,"
         "flops,copies,seconds,sm_clock_mhz,watts\n";
  for (const Sample& s : samples) {
    char line[512];
    std::snprintf(line, sizeof(line),
                  "%s,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%.0f,%.0f,%lld,%.6e,%.0f,"
                  "%.1f\n",
                  s.op.c_str(), static_cast<long long>(s.m), static_cast<long long>(s.n),
                  static_cast<long long>(s.k), static_cast<long long>(s.heads),
                  static_cast<long long>(s.kv_heads), static_cast<long long>(s.head_dim),
                  static_cast<long long>(s.page_tokens), static_cast<long long>(s.pages),
                  static_cast<long long>(s.pages_per_tile), static_cast<long long>(s.grad_bytes),
                  s.bytes, s.flops, static_cast<long long>(s.copies), s.seconds,
                  s.clock.sm_clock_mhz, s.clock.watts);
    out << line;
  }
}

// Exit code 2 with one line.
int BadInput(const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", kProgram, message.c_str());
  return 2;
}

int Main(int argc, char** argv) {
  CLI::App app{
      "ctxplan-measure: microbenchmarks ctxplan's CUDA kernels, PCIe and host copies, pinning "
      "and allocation over a designed grid of shapes, and writes the raw samples as CSV for "
      "`ctxplan calibrate` to fit"};
  Flags flags;
  std::vector<std::string> group_names;
  for (const Group& g : kGroups) group_names.push_back(g.name);
  app.add_option("--output,-o", flags.output, "the CSV file (written atomically at the end)")
      ->required();
  app.add_flag("--quick", flags.quick, "a reduced grid and 3 repetitions (under a minute)");
  app.add_option("--only", flags.only, "only these groups, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember(group_names));
  app.add_option("--reps", flags.reps,
                 "timed batches per sample, the median reported "
                 "(default 5; 3 with --quick)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--device", flags.device, "the CUDA device to measure")
      ->capture_default_str()
      ->check(CLI::Range(0, 1023));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return BadInput(std::string(e.what()) + "; see " + kProgram + " --help");
  }

  // The output's folder must exist and be writable before minutes of measurement.
  std::optional<AtomicFileWriter> output;
  try {
    output.emplace(flags.output);
  } catch (const InputError& e) {
    return BadInput(std::string("--output: ") + e.what() +
                    "; accepted: a file in an existing, writable directory");
  }

  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    return BadInput(std::string("no CUDA GPU to measure (") +
                    (status != cudaSuccess
                         ? std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status)
                         : std::string("no devices")) +
                    "); run it on the GPU machine the profile is for");
  }
  if (flags.device >= devices)
    return BadInput("--device " + std::to_string(flags.device) + ": this machine has " +
                    std::to_string(devices) + " CUDA GPU(s); accepted: 0 to " +
                    std::to_string(devices - 1));

  try {
    const auto start = std::chrono::steady_clock::now();
    Session session;
    session.quick = flags.quick;
    session.reps = flags.reps > 0 ? flags.reps : (flags.quick ? 3 : 5);
    CTXPLAN_CUDA_CHECK(cudaSetDevice(flags.device));
    GpuClockSampler clocks(flags.device);
    session.clocks = &clocks;
    // A blocking stream: ordered after the legacy stream, where the buffers are filled.
    CTXPLAN_CUDA_CHECK(cudaStreamCreate(&session.stream));
    for (const Group& g : kGroups) {
      const bool wanted = flags.only.empty() || std::find(flags.only.begin(), flags.only.end(),
                                                          g.name) != flags.only.end();
      if (wanted) g.measure(session);
    }
    CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(session.stream));
    CTXPLAN_CUDA_CHECK(cudaStreamDestroy(session.stream));
    WriteHeader(output->stream(), flags.device, flags.quick, clocks);
    WriteSamples(output->stream(), session.samples);
    output->Commit();
    std::fprintf(stderr, "%s: %zu samples in %.0f s written to %s\n", kProgram,
                 session.samples.size(), SecondsSince(start), flags.output.c_str());
    return 0;
  } catch (const InputError& e) {  // the output could not be written (a full disk)
    return BadInput(std::string("--output: ") + e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kProgram, e.what());
    return 1;
  }
}

}  // namespace
}  // namespace ctxplan::calibrate

int main(int argc, char** argv) {
  return ctxplan::calibrate::Main(argc, argv);
}
