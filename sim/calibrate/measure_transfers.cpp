// Groups copy, links and host: PCIe copies between pinned host memory and the GPU (one large
// copy, many page-sized copies from scattered host pages, both directions at once), the same
// copies on several GPUs of the host at once, the device-to-device copy, host memory bandwidth,
// pinning as the pinned page store pins, and the GPU arena's reservation.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/cpu/host_adamw.h"
#include "ctxplan/runtime/cuda/device_arena.h"
#include "ctxplan/runtime/cuda/memcpy_batch.h"
#include "ctxplan/runtime/cuda/pinned_page_store.h"
#include "ctxplan/runtime/cuda/weights_upload.h"
#include "ctxplan/runtime/plan/model_weights.h"
#include "measure_common.h"
#include "measure_groups.h"

namespace ctxplan::calibrate {

namespace {

// --- copy ---
const std::vector<int64_t> kCopyBytes = {16 * kKiB, 64 * kKiB, 256 * kKiB, 1 * kMiB,
                                         4 * kMiB,  16 * kMiB, 64 * kMiB,  256 * kMiB};
// Page copies: Qwen2.5-7B KV pages (2 KiB a position) of 16, 64 and 256 positions.
const std::vector<int64_t> kPageCopyBytes = {32 * kKiB, 128 * kKiB, 512 * kKiB};
constexpr int64_t kPageCopies = 256;
constexpr int64_t kHostPagesPerCopy = 4;  // the scattered pages are drawn from 4x as many
const std::vector<int64_t> kDuplexBytes = {64 * kMiB, 256 * kMiB};
const std::vector<int64_t> kDeviceCopyBytes = {64 * kMiB, 1 * kGiB};

// --- links ---
constexpr int64_t kLinkCopyBytes = 256 * kMiB;  // one copy a GPU and direction
constexpr int64_t kLinkCopies = 8;              // back to back on each GPU, a round
// --- host ---
constexpr int64_t kHostMemcpyBytes = 1 * kGiB;
// AdamW on the host over this many parameters (3 GiB of weights, gradients and moments).
constexpr int64_t kHostAdamWParams = int64_t{256} << 20;
const std::vector<int64_t> kPinBytes = {1 * kGiB, 4 * kGiB};
const std::vector<int64_t> kPinBytesQuick = {1 * kGiB};
// The store's page: K and V of 128 positions of Qwen2.5-7B (4 KV heads of 128), bf16.
constexpr uint64_t kPinPageBytes = 128 * 2 * 4 * 128 * 2;
const std::vector<int64_t> kArenaBytes = {4 * kGiB, 32 * kGiB};

Sample CopyRow(const char* op, int64_t bytes, int64_t copies) {
  Sample s;
  s.op = op;
  s.bytes = static_cast<double>(bytes);  // per copy
  s.copies = copies;
  return s;
}

// Copies both ways at once on two streams: `stream` forks to a second stream and joins it
// again, so events on `stream` time until both copies are done.
class DuplexCopier {
 public:
  explicit DuplexCopier(cudaStream_t stream) : stream_(stream) {
    CTXPLAN_CUDA_CHECK(cudaStreamCreate(&other_));
    CTXPLAN_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    CTXPLAN_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  }
  ~DuplexCopier() {
    (void)cudaEventDestroy(fork_);
    (void)cudaEventDestroy(join_);
    (void)cudaStreamDestroy(other_);
  }
  DuplexCopier(const DuplexCopier&) = delete;
  DuplexCopier& operator=(const DuplexCopier&) = delete;
  // `bytes` from host_src to device_dst on the stream, and as many from device_src to host_dst
  // beside it.
  void Issue(void* device_dst, const void* host_src, void* host_dst, const void* device_src,
             int64_t bytes) {
    CTXPLAN_CUDA_CHECK(cudaEventRecord(fork_, stream_));
    CTXPLAN_CUDA_CHECK(cudaStreamWaitEvent(other_, fork_, 0));
    CTXPLAN_CUDA_CHECK(
        cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
    CTXPLAN_CUDA_CHECK(
        cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, other_));
    CTXPLAN_CUDA_CHECK(cudaEventRecord(join_, other_));
    CTXPLAN_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_, 0));
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaStream_t other_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
};

}  // namespace

void MeasureCopy(Session& session) {
  const int64_t largest = std::max(kCopyBytes.back(), kDuplexBytes.back());
  const int64_t largest_page = kPageCopyBytes.back();
  const size_t progress_steps = 2 * kCopyBytes.size() + 4 * kPageCopyBytes.size() +
                                kDuplexBytes.size() + kDeviceCopyBytes.size();
  Progress progress("copy", progress_steps);
  cudaStream_t stream = session.stream;

  PinnedHost host_a(largest);                             // pinned [largest bytes]: H2D source
  PinnedHost host_b(largest);                             // pinned [largest bytes]: D2H destination
  DeviceArray<std::byte> dev_a(largest), dev_b(largest);  // [largest bytes] each
  // One large copy, back to back.
  for (const bool h2d : {true, false}) {
    for (const int64_t bytes : kCopyBytes) {
      const char* op = h2d ? "copy_h2d" : "copy_d2h";
      progress.Step(Describe(op, {{"bytes", bytes}}));
      Sample s = CopyRow(op, bytes, 1);
      s.seconds = MedianSecondsPerCall(session, [&](int64_t) {
        if (h2d) {
          CTXPLAN_CUDA_CHECK(
              cudaMemcpyAsync(dev_a.get(), host_a.get(), bytes, cudaMemcpyHostToDevice, stream));
        } else {
          CTXPLAN_CUDA_CHECK(
              cudaMemcpyAsync(host_b.get(), dev_a.get(), bytes, cudaMemcpyDeviceToHost, stream));
        }
      });
      session.Add(s);
    }
  }

  // Page copies: kPageCopies separate cudaMemcpyAsync calls between host pages scattered over a
  // pinned region (random order, never adjacent runs the runtime would coalesce) and contiguous
  // device slots, timed as one batch.
  PinnedHost host_pages(kPageCopies * kHostPagesPerCopy * largest_page);
  DeviceArray<std::byte> slots(kPageCopies * largest_page);  // [copies][page bytes]
  std::vector<int64_t> order(kPageCopies * kHostPagesPerCopy);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  order.resize(kPageCopies);  // host page index of copy j
  for (const bool h2d : {true, false}) {
    for (const int64_t bytes : kPageCopyBytes) {
      const char* op = h2d ? "copy_h2d" : "copy_d2h";
      progress.Step(Describe(op, {{"bytes", bytes}, {"copies", kPageCopies}}));
      Sample s = CopyRow(op, bytes, kPageCopies);
      s.seconds = MedianSecondsPerCall(session, [&](int64_t) {
        for (int64_t j = 0; j < kPageCopies; ++j) {
          std::byte* host = host_pages.get() + order[j] * bytes;
          std::byte* slot = slots.get() + j * bytes;
          if (h2d) {
            CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(slot, host, bytes, cudaMemcpyHostToDevice, stream));
          } else {
            CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(host, slot, bytes, cudaMemcpyDeviceToHost, stream));
          }
        }
      });
      session.Add(s);
    }
  }
  // The same page copies handed to the driver as one batch, as the runtime's offload issues them
  // (gpu::IssueCopyBatch).
  gpu::CopyBatch batch;
  for (const bool h2d : {true, false}) {
    for (const int64_t bytes : kPageCopyBytes) {
      const char* op = h2d ? "copy_batch_h2d" : "copy_batch_d2h";
      progress.Step(Describe(op, {{"bytes", bytes}, {"copies", kPageCopies}}));
      Sample s = CopyRow(op, bytes, kPageCopies);
      batch.Clear();
      for (int64_t j = 0; j < kPageCopies; ++j) {
        std::byte* host = host_pages.get() + order[j] * bytes;
        std::byte* slot = slots.get() + j * bytes;
        if (h2d)
          batch.Add(slot, host, static_cast<size_t>(bytes));
        else
          batch.Add(host, slot, static_cast<size_t>(bytes));
      }
      s.seconds =
          MedianSecondsPerCall(session, [&](int64_t) { gpu::IssueCopyBatch(batch, stream); });
      session.Add(s);
    }
  }

  // Both directions at once.
  DuplexCopier duplex(stream);
  for (const int64_t bytes : kDuplexBytes) {
    progress.Step(Describe("copy_duplex", {{"bytes", bytes}}));
    Sample s = CopyRow("copy_duplex", bytes, 1);
    s.seconds = MedianSecondsPerCall(session, [&](int64_t) {
      duplex.Issue(dev_a.get(), host_a.get(), host_b.get(), dev_b.get(), bytes);
    });
    session.Add(s);
  }

  // Device to device: bytes = the size copied (HBM traffic is twice that: read + write).
  const int64_t largest_d2d = kDeviceCopyBytes.back();
  DeviceArray<std::byte> d2d_src(largest_d2d), d2d_dst(largest_d2d);  // [bytes] each
  for (const int64_t bytes : kDeviceCopyBytes) {
    progress.Step(Describe("copy_d2d", {{"bytes", bytes}}));
    Sample s = CopyRow("copy_d2d", bytes, 1);
    s.seconds = MedianSecondsPerCall(session, [&](int64_t) {
      CTXPLAN_CUDA_CHECK(
          cudaMemcpyAsync(d2d_dst.get(), d2d_src.get(), bytes, cudaMemcpyDeviceToDevice, stream));
    });
    session.Add(s);
  }
}

// =================================================================================================
// The host's side of the PCIe links when several GPUs copy at once: a pipelined run's stages
// move their pages at the same time, and what the host gives them together (its root ports,
// switches, memory) can be less than each link alone. For g = 1 .. every GPU of the host
// (devices 0 .. g - 1), then device 0 with each other one alone (which pairs share a switch),
// each GPU copies kLinkCopies x kLinkCopyBytes between its own pinned buffers and its memory,
// host to device, device to host, or both at once (two streams), all GPUs started together; a
// round is timed on the steady clock from before the first copy is issued until every GPU has
// finished. Rows: links_h2d / links_d2h / links_duplex, m = GPUs at once, n = the second
// device of a pair (0 otherwise), bytes = one copy, copies = a GPU's copies a direction,
// seconds = the round's median. The GPUs' summed rate is m x copies x bytes / seconds (twice
// that for duplex). One GPU: nothing to measure beside the copy group.
void MeasureLinks(Session& session) {
  int count = 0;
  CTXPLAN_CUDA_CHECK(cudaGetDeviceCount(&count));
  int home = 0;
  CTXPLAN_CUDA_CHECK(cudaGetDevice(&home));
  if (count < 2) {
    Progress progress("links", 0);
    progress.Note("one GPU: no links shared by several");
    return;
  }
  struct Gpu {  // one device's buffers and streams
    int device = 0;
    std::unique_ptr<PinnedHost> to_device, from_device;  // pinned [kLinkCopyBytes] each
    std::unique_ptr<DeviceArray<std::byte>> in, out;     // [kLinkCopyBytes] each
    cudaStream_t up = nullptr, down = nullptr;
  };
  std::vector<Gpu> gpus(static_cast<size_t>(count));
  struct Cleanup {
    std::vector<Gpu>& gpus;
    int home;
    ~Cleanup() {
      for (Gpu& g : gpus) {
        if (cudaSetDevice(g.device) != cudaSuccess) continue;
        g.in.reset();
        g.out.reset();
        if (g.up != nullptr) (void)cudaStreamDestroy(g.up);
        if (g.down != nullptr) (void)cudaStreamDestroy(g.down);
      }
      (void)cudaSetDevice(home);
    }
  } cleanup{gpus, home};
  for (int d = 0; d < count; ++d) {
    Gpu& g = gpus[static_cast<size_t>(d)];
    g.device = d;
    CTXPLAN_CUDA_CHECK(cudaSetDevice(d));
    g.to_device = std::make_unique<PinnedHost>(kLinkCopyBytes);
    g.from_device = std::make_unique<PinnedHost>(kLinkCopyBytes);
    g.in = std::make_unique<DeviceArray<std::byte>>(kLinkCopyBytes);
    g.out = std::make_unique<DeviceArray<std::byte>>(kLinkCopyBytes);
    CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&g.up, cudaStreamNonBlocking));
    CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&g.down, cudaStreamNonBlocking));
  }

  // The sets of GPUs copying at once: the first g, then device 0 beside each other one.
  std::vector<std::vector<int>> sets;
  for (int g = 1; g <= count; ++g) {
    std::vector<int> set(static_cast<size_t>(g));
    std::iota(set.begin(), set.end(), 0);
    sets.push_back(set);
  }
  for (int d = 2; d < count; ++d) sets.push_back({0, d});
  enum class Way { kUp, kDown, kBoth };
  Progress progress("links", 3 * sets.size());
  for (const std::vector<int>& set : sets) {
    const bool pair = set.size() == 2 && set[1] != 1;
    for (const Way way : {Way::kUp, Way::kDown, Way::kBoth}) {
      const char* op = way == Way::kUp     ? "links_h2d"
                       : way == Way::kDown ? "links_d2h"
                                           : "links_duplex";
      progress.Step(Describe(
          op, {{"gpus", static_cast<int64_t>(set.size())}, {"second", pair ? set[1] : 0}}));
      auto round = [&] {
        for (const int d : set) {  // nothing in flight before the clock starts
          CTXPLAN_CUDA_CHECK(cudaSetDevice(d));
          CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
        }
        const auto start = std::chrono::steady_clock::now();
        for (int64_t c = 0; c < kLinkCopies; ++c) {  // interleaved: every GPU starts at once
          for (const int d : set) {
            Gpu& g = gpus[static_cast<size_t>(d)];
            CTXPLAN_CUDA_CHECK(cudaSetDevice(d));
            if (way != Way::kDown)
              CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(g.in->get(), g.to_device->get(), kLinkCopyBytes,
                                                 cudaMemcpyHostToDevice, g.up));
            if (way != Way::kUp)
              CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(g.from_device->get(), g.out->get(), kLinkCopyBytes,
                                                 cudaMemcpyDeviceToHost, g.down));
          }
        }
        for (const int d : set) {
          Gpu& g = gpus[static_cast<size_t>(d)];
          CTXPLAN_CUDA_CHECK(cudaSetDevice(d));
          CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(g.up));
          CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(g.down));
        }
        return SecondsSince(start);
      };
      (void)round();  // warm-up: the links' first use
      Sample s = CopyRow(op, kLinkCopyBytes, kLinkCopies);
      s.m = static_cast<int64_t>(set.size());
      s.n = pair ? set[1] : 0;
      s.seconds = MedianWallSeconds(session.reps, round);
      session.Add(s);
      const double gbs = static_cast<double>(s.m * kLinkCopies * kLinkCopyBytes) *
                         (way == Way::kBoth ? 2.0 : 1.0) / s.seconds / 1e9;
      char note[160];
      std::snprintf(note, sizeof note, "%s, GPUs %s: %.1f GB/s summed, %.1f a GPU", op,
                    pair ? ("0 and " + std::to_string(set[1])).c_str()
                         : ("0-" + std::to_string(set.size() - 1)).c_str(),
                    gbs, gbs / static_cast<double>(s.m));
      progress.Note(note);
    }
  }
}

// The power group's copy row: the largest duplex copy back to back under session.sustain_seconds,
// for what the board draws while its PCIe link moves pages both ways and the SMs idle.
void MeasurePowerCopy(Session& session) {
  const int64_t bytes = kDuplexBytes.back();
  PinnedHost up(bytes), down(bytes);                     // pinned [bytes] each
  DeviceArray<std::byte> dev_in(bytes), dev_out(bytes);  // [bytes] each
  DuplexCopier duplex(session.stream);
  Sample s = CopyRow("copy_duplex", bytes, 1);
  s.seconds = MedianSecondsPerCall(session, [&](int64_t) {
    duplex.Issue(dev_in.get(), up.get(), down.get(), dev_out.get(), bytes);
  });
  session.Add(s);
}

// =================================================================================================
void MeasureHost(Session& session) {
  const auto& pin_bytes = session.quick ? kPinBytesQuick : kPinBytes;
  Progress progress("host", 4 + pin_bytes.size() + kArenaBytes.size());
  {  // ctxtrain's random weights (no --weights file), for Llama-3.2-1B: once (seconds long).
    const ModelSpec model = LoadModel("llama-3.2-1b");
    progress.Step(Describe("weights_init", {{"params", model.total_params()}}));
    Sample s;
    s.op = "weights_init";
    s.m = model.total_params();
    s.bytes = 4.0 * static_cast<double>(s.m);  // fp32 on the host
    const auto start = std::chrono::steady_clock::now();
    ModelWeights weights = RandomWeights(model, 1);
    s.seconds = SecondsSince(start);
    session.Add(s);
    // Then up to the device as ctxtrain's backend sends them: rounded to bf16 on the host's
    // threads, copied from pageable staging, tensor by tensor (into one buffer, reused).
    progress.Step(Describe("weights_upload", {{"params", model.total_params()}}));
    size_t largest = 0;
    weights.ForEach(
        [&](const std::string&, std::vector<float>& t) { largest = std::max(largest, t.size()); });
    DeviceArray<uint16_t> device(largest);  // [largest tensor] bf16
    std::vector<uint16_t> staging;
    Sample up;
    up.op = "weights_upload";
    up.m = model.total_params();
    up.bytes = 2.0 * static_cast<double>(up.m);  // bf16 on the device
    const auto upload_start = std::chrono::steady_clock::now();
    weights.ForEach([&](const std::string&, std::vector<float>& t) {
      gpu::UploadAsBf16(t, device.get(), staging);
    });
    up.seconds = SecondsSince(upload_start);
    session.Add(up);
  }
  {  // The runtime's host AdamW (host_adamw.h) on its threads, over memory as the CUDA backend
     // holds it: bf16 weights and gradients pinned (cudaHostAlloc), fp32 moments pageable. The
     // row host_adamw_pageable, all pageable, is not fitted: it tells whether pinning matters.
    const auto n = static_cast<size_t>(kHostAdamWParams);
    const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    auto measure = [&](const char* op, uint16_t* weights, uint16_t* grads) {  // [n] bf16 each
      progress.Step(Describe(op, {{"params", kHostAdamWParams}}));
      for (size_t i = 0; i < n; ++i) {  // magnitudes near 1 and 0.001, the mantissas varied
        weights[i] = static_cast<uint16_t>(0x3f80 | (i * 2654435761u >> 25));
        grads[i] = static_cast<uint16_t>(0x3a83 ^ (i * 40503u & 0x807f));
      }
      std::vector<float> m(n, 0.0f), v(n, 0.0f);  // [n] fp32 moments
      const HostAdamWTensor all{0, 0, 0, n};
      HostAdamWParams params{1e-5f, 0.9f, 0.999f, 1e-8f, 0.01f, 1};
      Sample s;
      s.op = op;
      s.m = kHostAdamWParams;
      s.bytes = 12.0 * static_cast<double>(n);
      s.seconds = MedianWallSeconds(session.reps, [&] {
        const auto start = std::chrono::steady_clock::now();
        HostAdamWStep<uint16_t>(params, std::span(&all, 1), weights, grads, m.data(), v.data(),
                                threads);
        ++params.step;
        return SecondsSince(start);
      });
      session.Add(s);
    };
    {
      PinnedHost weights(n * sizeof(uint16_t)), grads(n * sizeof(uint16_t));
      measure("host_adamw", reinterpret_cast<uint16_t*>(weights.get()),
              reinterpret_cast<uint16_t*>(grads.get()));
    }
    std::vector<uint16_t> weights(n), grads(n);
    measure("host_adamw_pageable", weights.data(), grads.data());
  }

  {  // One thread's std::memcpy between two touched host buffers.
    progress.Step(Describe("host_memcpy", {{"bytes", kHostMemcpyBytes}}));
    const auto size = static_cast<size_t>(kHostMemcpyBytes);
    std::unique_ptr<std::byte[]> from(new std::byte[size]);  // [1 GiB]
    std::unique_ptr<std::byte[]> to(new std::byte[size]);    // [1 GiB]
    std::memset(from.get(), 0x5a, size);
    std::memset(to.get(), 0xa5, size);
    Sample s;
    s.op = "host_memcpy";
    s.bytes = static_cast<double>(kHostMemcpyBytes);
    s.seconds = MedianWallSeconds(session.reps, [&] {
      const auto start = std::chrono::steady_clock::now();
      std::memcpy(to.get(), from.get(), size);
      return SecondsSince(start);
    });
    session.Add(s);
  }

  // Pinning as the runtime's pinned page store pins (cudaHostAlloc in 1 GiB blocks): the store's
  // construction is timed, its destruction (unpinning) is not.
  for (const int64_t bytes : pin_bytes) {
    progress.Step(Describe("pin", {{"bytes", bytes}}));
    gpu::PinnedPageStoreOptions options;
    options.page_bytes = kPinPageBytes;
    options.capacity_pages = static_cast<uint64_t>(bytes) / kPinPageBytes;
    try {
      Sample s;
      s.op = "pin";
      s.bytes = static_cast<double>(options.capacity_pages * kPinPageBytes);
      s.seconds = MedianWallSeconds(session.reps, [&] {
        const auto start = std::chrono::steady_clock::now();
        const gpu::PinnedPageStore store(options);
        return SecondsSince(start);
      });
      session.Add(s);
    } catch (const gpu::PinnedMemoryError& e) {
      progress.Note(std::string("skipped pin: ") + e.what());
    }
  }

  // The GPU arena's one reservation (cudaMalloc), then its free (not timed).
  for (const int64_t bytes : kArenaBytes) {
    progress.Step(Describe("device_alloc", {{"bytes", bytes}}));
    gpu::DeviceArena::Reservations reservations{};
    reservations[static_cast<size_t>(MemCategory::kPageSlots)] = static_cast<uint64_t>(bytes);
    try {
      Sample s;
      s.op = "device_alloc";
      s.bytes = static_cast<double>(bytes);
      s.seconds = MedianWallSeconds(session.reps, [&] {
        const auto start = std::chrono::steady_clock::now();
        const gpu::DeviceArena arena(reservations);
        return SecondsSince(start);
      });
      session.Add(s);
    } catch (const kernels::CudaError& e) {  // a GPU with too little free memory
      progress.Note(std::string("skipped device_alloc: ") + e.what());
    }
  }
}

}  // namespace ctxplan::calibrate
