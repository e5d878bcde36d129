// ctxplan-measure's shared pieces: the sample rows it writes, device buffers filled with random
// values, the event timer, and the progress line. Host code only (g++): the kernels it times are
// the CUDA backend's entry points in kernels/include/ctxplan/kernels/cuda/.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/cuda/gpu_clock_sampler.h"

namespace ctxplan::calibrate {

using gpu::ClockReading;
using gpu::GpuClockSampler;
using bf16 = __nv_bfloat16;

inline constexpr int64_t kKiB = int64_t{1} << 10;
inline constexpr int64_t kMiB = int64_t{1} << 20;
inline constexpr int64_t kGiB = int64_t{1} << 30;

// One CSV row (the format is documented in measure_main.cpp). Fields an op does not use stay 0.
struct Sample {
  std::string op;
  int64_t m = 0, n = 0, k = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t page_tokens = 0, pages = 0, pages_per_tile = 0;
  int64_t grad_bytes = 0;
  double bytes = 0.0, flops = 0.0;
  int64_t copies = 0;
  double seconds = 0.0;  // median seconds of one call (copy rows: of one batch of `copies`)
  ClockReading clock;    // the SM clock and board power while it was timed (0: not known)

  // Takes bytes and FLOPs from an op's cost descriptor (kernels/cost.h).
  Sample& Cost(const OpCost& cost) {
    bytes = cost.bytes;
    flops = cost.flops;
    return *this;
  }
};

// What every group needs: the options, the stream everything is timed on, and the rows so far.
struct Session {
  bool quick = false;
  int reps = 5;                       // timed batches per sample; the median is reported
  cudaStream_t stream = nullptr;      // blocking w.r.t. the legacy stream, so fills order before it
  GpuClockSampler* clocks = nullptr;  // null: clock and power not recorded
  // > 0 (the power group): MedianSecondsPerCall first runs the calls back to back for half this
  // long, so that clock and power settle where a training step holds them, then times batches
  // over the other half.
  double sustain_seconds = 0;
  ClockReading last_window;  // of the last MedianSecondsPerCall
  std::vector<Sample> samples;

  // Appends `s` with the clock of the window timed last (a sample timed on the host gets none).
  void Add(Sample s) {
    s.clock = std::exchange(last_window, ClockReading{});
    samples.push_back(std::move(s));
  }
};

// --- device memory -----------------------------------------------------------------------------
// One cudaMalloc'ed array of `count` T (256-byte aligned, as cudaMalloc's are). Move-only.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t count) : count_(count) {
    if (count > 0) CTXPLAN_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), bytes()));
  }
  ~DeviceArray() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);  // never throws from a destructor
  }
  DeviceArray(DeviceArray&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(count_, other.count_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// Fills n elements with uniform random values in [lo, hi) (int32: integers in [lo, hi)): a host
// pattern of up to 1M values from `seed`, replicated on the device. Random, never zeros: zeros
// run faster than real data through the tensor cores and the memory system. Uses the legacy
// stream; Session::stream is ordered after it.
void Fill(bf16* dst, size_t n, double lo, double hi, uint32_t seed);
void Fill(float* dst, size_t n, double lo, double hi, uint32_t seed);
void Fill(int32_t* dst, size_t n, double lo, double hi, uint32_t seed);

// A DeviceArray of `count` elements filled by Fill().
template <typename T>
DeviceArray<T> RandomArray(size_t count, double lo, double hi, uint32_t seed) {
  DeviceArray<T> a(count);
  Fill(a.get(), count, lo, hi, seed);
  return a;
}

// Copies of one buffer, enough that a round over them exceeds kRotateBytes: call i uses copy
// i % copies(), so back-to-back calls of a memory-bound kernel read and write HBM, not the L2
// cache (50 MiB on an H100 / H200), as the planner's bytes-over-bandwidth model assumes. A buffer
// of kRotateBytes or more has one copy. Filled by Fill().
inline constexpr size_t kRotateBytes = size_t{256} << 20;
inline constexpr int64_t kMaxCopies = 64;

template <typename T>
class Rotating {
 public:
  Rotating(size_t count, double lo, double hi, uint32_t seed)
      : stride_((count * sizeof(T) + 255) / 256 * 256 / sizeof(T)),
        copies_(std::clamp<int64_t>(static_cast<int64_t>((kRotateBytes + stride_ * sizeof(T) - 1) /
                                                         std::max<size_t>(stride_ * sizeof(T), 1)),
                                    1, kMaxCopies)),
        data_(RandomArray<T>(stride_ * static_cast<size_t>(copies_), lo, hi, seed)) {}

  T* operator[](int64_t call) const {
    return data_.get() + static_cast<size_t>(call % copies_) * stride_;
  }
  int64_t copies() const { return copies_; }

 private:
  size_t stride_;  // elements from one copy to the next (copies start 256-byte aligned)
  int64_t copies_;
  DeviceArray<T> data_;
};

// Pinned host memory (cudaHostAlloc), for the copy engine measurements. Move-only.
class PinnedHost {
 public:
  explicit PinnedHost(size_t bytes);
  ~PinnedHost();
  PinnedHost(const PinnedHost&) = delete;
  PinnedHost& operator=(const PinnedHost&) = delete;
  std::byte* get() const { return ptr_; }

 private:
  std::byte* ptr_ = nullptr;
};

// --- timing --------------------------------------------------------------------------------------
// A batch lasts at least this long, so that event resolution and the launch gaps around a batch
// are noise (the brief: >= 1 ms).
inline constexpr double kMinBatchSeconds = 2e-3;
inline constexpr int64_t kMaxBatch = 20000;

// The median seconds of ONE call. `call(i)` enqueues call number i (i picks a Rotating copy) on
// session.stream. One warm-up call (cuBLASLt chooses and caches its algorithm, clocks ramp up),
// one timed probe call that sizes the batch (calls per batch: `batch` if > 0, else enough for
// kMinBatchSeconds), then session.reps batches, each between two events on the stream; the
// median batch time divided by the batch's calls.
// The SM clock and power over the timed batches are left in session.last_window.
double MedianSecondsPerCall(Session& session, const std::function<void(int64_t)>& call,
                            int64_t batch = 0);

// Host-side costs (pinning, allocation, memcpy): `once()` does the thing once and returns the
// seconds it measured around the part that counts. One warm-up, then the median of `reps`.
double MedianWallSeconds(int reps, const std::function<double()>& once);

// Seconds since `start` on the steady clock.
double SecondsSince(const std::chrono::steady_clock::time_point& start);

// --- progress ------------------------------------------------------------------------------------
// "[group] i/n what" on stderr: one line redrawn with \r on a terminal, a line per step otherwise.
class Progress {
 public:
  Progress(std::string group, size_t total);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  // Starts step i + 1 of total, described by `what`.
  void Step(const std::string& what);
  // A note on its own line (a skipped shape).
  void Note(const std::string& line);

 private:
  void EndLine();
  std::string group_;
  size_t total_;
  size_t done_ = 0;
  bool terminal_;
  bool open_line_ = false;  // a \r line is on screen
};

// "name=value" pairs for progress lines and notes: Describe({{"m", 4096}, {"n", 512}}).
std::string Describe(const std::string& op,
                     std::initializer_list<std::pair<const char*, int64_t>> fields);

}  // namespace ctxplan::calibrate
