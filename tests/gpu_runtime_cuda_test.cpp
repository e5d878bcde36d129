// The CUDA runtime components: the GPU arena, the pinned page store and offload engine, the CUPTI
// tracer. Every test skips itself without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/cuda/cupti_check.h"
#include "ctxplan/runtime/cuda/cupti_tracer.h"
#include "ctxplan/runtime/cuda/device_arena.h"
#include "ctxplan/runtime/cuda/pinned_page_store.h"
#include "ctxplan/runtime/cuda/probe_kernel.h"
#include "ctxplan/traces/chrome_trace_writer.h"
#include "ctxplan/traces/op_trace.h"
#include "support/cupti.h"

namespace ctxplan::gpu {
namespace {

DeviceArena::Reservations Reserve(std::initializer_list<std::pair<MemCategory, uint64_t>> list) {
  DeviceArena::Reservations r{};
  for (const auto& [category, bytes] : list) r[static_cast<size_t>(category)] = bytes;
  return r;
}

std::filesystem::path TempPath(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("ctxplan_gpu_runtime_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir / name;
}

struct RecordingListener : MemoryEventListener {
  struct Event {
    MemSpace space;
    MemCategory category;
    int64_t total;
  };
  std::vector<Event> events;
  void OnMemoryEvent(MemSpace space, MemCategory category, int64_t total) override {
    events.push_back({space, category, total});
  }
};

// --- DeviceArena ----------------------------------------------------------------------------

TEST(DeviceArena, ReservesOnceAndAlignsEveryBuffer) {
  SKIP_WITHOUT_GPU();
  std::ostringstream log;
  DeviceArena arena(Reserve({{MemCategory::kWeights, 1000},
                             {MemCategory::kActivations, 1 << 20},
                             {MemCategory::kDkvPages, 4096}}),
                    &log);
  EXPECT_EQ(arena.reserved_bytes(), 1024u + (1u << 20) + 4096u);
  EXPECT_NE(log.str().find("GPU arena"), std::string::npos);
  EXPECT_NE(log.str().find("weights"), std::string::npos);
  EXPECT_NE(log.str().find("dkv_pages"), std::string::npos);
  EXPECT_EQ(log.str().find("optimizer"), std::string::npos);  // empty categories not printed
  EXPECT_EQ(arena.category_stats(MemCategory::kWeights).reserved_bytes, 1024u);

  const DeviceBuffer a = arena.Allocate(MemCategory::kWeights, 1, "a");
  const DeviceBuffer b = arena.Allocate(MemCategory::kWeights, 300, "b");
  const DeviceBuffer c = arena.AllocateNamed(MemCategory::kActivations, "acts", 5000);
  for (const DeviceBuffer& buf : {a, b, c}) {
    EXPECT_EQ(buf.offset % kArenaAlignment, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.ptr) % kArenaAlignment, 0u);
    EXPECT_EQ(buf.bytes % kArenaAlignment, 0u);
    EXPECT_EQ(buf.ptr, arena.base() + buf.offset);
  }
  EXPECT_EQ(a.bytes, 256u);
  EXPECT_EQ(b.bytes, 512u);
  EXPECT_EQ(b.offset, a.offset + 256);  // first fit, packed
  EXPECT_EQ(c.bytes, 5120u);
  EXPECT_EQ(c.offset, 1024u);  // the activations region follows the weights region
  EXPECT_EQ(arena.allocated_bytes(), 256u + 512u + 5120u);
  EXPECT_EQ(arena.Named("acts").offset, c.offset);
  EXPECT_TRUE(arena.HasNamed("acts"));
  EXPECT_THROW(arena.AllocateNamed(MemCategory::kActivations, "acts", 16), InternalError);
  EXPECT_THROW(arena.Named("nope"), InternalError);
  EXPECT_TRUE(arena.Allocate(MemCategory::kWeights, 0, "empty").empty());

  // The memory is real device memory.
  CTXPLAN_CUDA_CHECK(cudaMemset(c.ptr, 0x5a, c.bytes));
  std::vector<unsigned char> host(c.bytes);
  CTXPLAN_CUDA_CHECK(cudaMemcpy(host.data(), c.ptr, c.bytes, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::all_of(host.begin(), host.end(), [](unsigned char x) { return x == 0x5a; }));

  arena.FreeNamed("acts");
  EXPECT_FALSE(arena.HasNamed("acts"));
  EXPECT_EQ(arena.category_stats(MemCategory::kActivations).allocated_bytes, 0u);
}

TEST(DeviceArena, FirstFitFreeListCoalesces) {
  SKIP_WITHOUT_GPU();
  DeviceArena arena(Reserve({{MemCategory::kDkvPages, 4 * 256}}));
  const uint64_t begin = 0;  // the only region
  DeviceBuffer p[4];
  for (int i = 0; i < 4; ++i) p[i] = arena.Allocate(MemCategory::kDkvPages, 256, "page");
  for (int i = 0; i < 4; ++i) EXPECT_EQ(p[i].offset, begin + 256u * i);
  EXPECT_EQ(arena.category_stats(MemCategory::kDkvPages).largest_free_block, 0u);

  // Free two non-adjacent blocks: first fit takes the lower one.
  arena.Free(p[0]);
  arena.Free(p[2]);
  EXPECT_EQ(arena.category_stats(MemCategory::kDkvPages).largest_free_block, 256u);
  EXPECT_EQ(arena.category_stats(MemCategory::kDkvPages).free_bytes, 512u);
  const DeviceBuffer again = arena.Allocate(MemCategory::kDkvPages, 200, "again");
  EXPECT_EQ(again.offset, p[0].offset);

  // Free 1 next to the free 2: they coalesce into one 512-byte block, which a 512 request takes.
  arena.Free(p[1]);
  EXPECT_EQ(arena.category_stats(MemCategory::kDkvPages).largest_free_block, 512u);
  const DeviceBuffer wide = arena.Allocate(MemCategory::kDkvPages, 512, "wide");
  EXPECT_EQ(wide.offset, p[1].offset);

  // Free everything in a scrambled order: one block again.
  arena.Free(p[3]);
  arena.Free(again);
  arena.Free(wide);
  const ArenaCategoryStats s = arena.category_stats(MemCategory::kDkvPages);
  EXPECT_EQ(s.largest_free_block, 1024u);
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.live_allocations, 0u);
  EXPECT_EQ(arena.Allocate(MemCategory::kDkvPages, 1024, "all").offset, begin);

  // Freeing twice is a bug.
  EXPECT_THROW(arena.Free(p[3]), InternalError);
}

TEST(DeviceArena, ExhaustionNamesRequestCategoryAndFreeBytes) {
  SKIP_WITHOUT_GPU();
  DeviceArena arena(Reserve({{MemCategory::kWeights, 1 << 16}, {MemCategory::kDkvPages, 1024}}));
  const DeviceBuffer a = arena.Allocate(MemCategory::kDkvPages, 256, "a");
  const DeviceBuffer b = arena.Allocate(MemCategory::kDkvPages, 256, "b");
  const DeviceBuffer c = arena.Allocate(MemCategory::kDkvPages, 256, "c");
  (void)b;
  arena.Free(a);
  arena.Free(c);  // 768 free, but at most 512 contiguous (c + the tail)
  try {
    arena.Allocate(MemCategory::kDkvPages, 700, "dKV page L3 P17");
    FAIL() << "expected ArenaExhaustedError";
  } catch (const ArenaExhaustedError& e) {
    EXPECT_EQ(e.category(), MemCategory::kDkvPages);
    EXPECT_EQ(e.requested_bytes(), 700u);
    EXPECT_EQ(e.free_bytes(), 768u);
    EXPECT_EQ(e.largest_free_block(), 512u);
    const std::string what = e.what();
    EXPECT_NE(what.find("dKV page L3 P17"), std::string::npos) << what;
    EXPECT_NE(what.find("dkv_pages"), std::string::npos) << what;
    EXPECT_NE(what.find("768 bytes free"), std::string::npos) << what;
  }
  // Other categories' room is not borrowed.
  EXPECT_THROW(arena.Allocate(MemCategory::kDkvPages, 4096, "x"), ArenaExhaustedError);
  EXPECT_THROW(arena.Allocate(MemCategory::kOptimizer, 1, "y"), ArenaExhaustedError);
  EXPECT_NO_THROW(arena.Allocate(MemCategory::kWeights, 4096, "z"));
}

TEST(DeviceArena, TracksPeakAndDeviceLevelUsage) {
  SKIP_WITHOUT_GPU();
  const DeviceMemoryInfo before = QueryDeviceMemory();
  DeviceArena arena(Reserve({{MemCategory::kActivations, 64 << 20}}));
  RecordingListener listener;
  arena.SetListener(&listener);
  EXPECT_GE(arena.SampleDeviceUsed(), arena.reserved_bytes());
  EXPECT_GE(arena.SampleDeviceUsed(), before.used_bytes());
  EXPECT_GE(arena.peak_device_used_bytes(), arena.reserved_bytes());

  const DeviceBuffer a = arena.Allocate(MemCategory::kActivations, 10 << 20, "a");
  const DeviceBuffer b = arena.Allocate(MemCategory::kActivations, 20 << 20, "b");
  arena.Free(a);
  const DeviceBuffer c = arena.Allocate(MemCategory::kActivations, 5 << 20, "c");
  EXPECT_EQ(arena.allocated_bytes(), 25u << 20);
  EXPECT_EQ(arena.peak_allocated_bytes(), 30u << 20);
  EXPECT_EQ(arena.category_stats(MemCategory::kActivations).peak_allocated_bytes, 30u << 20);
  arena.ResetPeak();
  EXPECT_EQ(arena.peak_allocated_bytes(), 25u << 20);
  arena.Free(b);
  arena.Free(c);
  EXPECT_EQ(arena.allocated_bytes(), 0u);
  EXPECT_EQ(arena.peak_allocated_bytes(), 25u << 20);

  ASSERT_EQ(listener.events.size(), 6u);
  EXPECT_EQ(listener.events[0].space, MemSpace::kGpu);
  EXPECT_EQ(listener.events[0].category, MemCategory::kActivations);
  const int64_t expected[] = {10 << 20, 30 << 20, 20 << 20, 25 << 20, 5 << 20, 0};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(listener.events[i].total, expected[i]) << "event " << i;
}

// --- PinnedPageStore ------------------------------------------------------------------------

TEST(PinnedPageStore, HandsOutPagesWithReferenceCounts) {
  SKIP_WITHOUT_GPU();
  PinnedPageStoreOptions o;
  o.page_bytes = 4096;
  o.capacity_pages = 10;
  o.block_bytes = 4 * 4096;  // blocks of 4, 4 and 2 pages
  o.category = MemCategory::kDkvPages;
  PinnedPageStore store(o);
  RecordingListener listener;
  store.SetListener(&listener);
  EXPECT_EQ(store.blocks(), 3u);
  EXPECT_EQ(store.capacity_pages(), 10u);
  EXPECT_EQ(store.pinned_bytes(), 10u * 4096);
  EXPECT_EQ(store.peak_pinned_bytes(), 10u * 4096);
  EXPECT_EQ(store.free_pages(), 10u);

  std::vector<PageId> pages;
  for (int i = 0; i < 10; ++i) pages.push_back(store.Allocate());
  // A fresh store hands pages out in ascending order, contiguous within a block.
  for (size_t i = 1; i < pages.size(); ++i) EXPECT_GT(pages[i], pages[i - 1]);
  EXPECT_TRUE(store.Adjacent(pages[0], pages[1]));
  EXPECT_EQ(store.HostPtr(pages[1]), store.HostPtr(pages[0]) + 4096);
  EXPECT_FALSE(store.Adjacent(pages[3], pages[4]));  // different blocks
  EXPECT_THROW(store.Allocate(), PageStoreExhaustedError);
  EXPECT_EQ(store.pages_in_use(), 10u);
  EXPECT_EQ(store.peak_in_use_bytes(), 10u * 4096);

  // The memory is pinned: cudaPointerGetAttributes says host memory.
  cudaPointerAttributes attributes{};
  CTXPLAN_CUDA_CHECK(cudaPointerGetAttributes(&attributes, store.HostPtr(pages[9])));
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);

  store.Retain(pages[2]);
  EXPECT_EQ(store.RefCount(pages[2]), 2u);
  store.Release(pages[2]);
  EXPECT_EQ(store.RefCount(pages[2]), 1u);
  EXPECT_EQ(store.free_pages(), 0u);
  store.Release(pages[2]);
  EXPECT_EQ(store.RefCount(pages[2]), 0u);
  EXPECT_EQ(store.free_pages(), 1u);
  EXPECT_THROW(store.Release(pages[2]), InternalError);
  EXPECT_THROW(store.Retain(pages[2]), InternalError);
  EXPECT_EQ(store.Allocate(), pages[2]);  // the freed page comes back first

  for (PageId p : pages) store.Release(p);
  EXPECT_EQ(store.pages_in_use(), 0u);
  EXPECT_EQ(store.peak_pages_in_use(), 10u);
  ASSERT_FALSE(listener.events.empty());
  EXPECT_EQ(listener.events.back().space, MemSpace::kHost);
  EXPECT_EQ(listener.events.back().category, MemCategory::kDkvPages);
  EXPECT_EQ(listener.events.back().total, 0);
}

TEST(PinnedPageStore, GrowsByWholeBlocksWhenAllowed) {
  SKIP_WITHOUT_GPU();
  PinnedPageStoreOptions o;
  o.page_bytes = 1024;
  o.capacity_pages = 2;
  o.block_bytes = 4 * 1024;
  o.growable = true;
  PinnedPageStore store(o);
  EXPECT_EQ(store.blocks(), 1u);
  std::vector<PageId> pages;
  for (int i = 0; i < 5; ++i) pages.push_back(store.Allocate());
  EXPECT_EQ(store.blocks(), 2u);
  EXPECT_EQ(store.capacity_pages(), 6u);
  EXPECT_EQ(store.peak_pinned_bytes(), 6u * 1024);
  std::vector<PageId> sorted = pages;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::unique(sorted.begin(), sorted.end()), sorted.end());
  for (PageId p : pages) EXPECT_NE(store.HostPtr(p), nullptr);
}

TEST(PinnedPageStore, PinningFailureIsATypedError) {
  SKIP_WITHOUT_GPU();
  const uint64_t pebibyte = uint64_t{1} << 50;
  PinnedPageStoreOptions o;
  o.page_bytes = uint64_t{1} << 20;
  o.capacity_pages = pebibyte / o.page_bytes;
  o.block_bytes = pebibyte;  // one block: the first cudaHostAlloc fails, nothing gets pinned
  try {
    PinnedPageStore store(o);
    FAIL() << "pinning 1 PiB succeeded";
  } catch (const PinnedMemoryError& e) {
    EXPECT_EQ(e.requested_bytes(), pebibyte);
    EXPECT_FALSE(e.cuda_error().empty());
    const std::string what = e.what();
    EXPECT_NE(what.find("cudaHostAlloc"), std::string::npos) << what;
    EXPECT_NE(what.find(std::to_string(pebibyte)), std::string::npos) << what;
    std::printf("PinnedMemoryError: %s\n", what.c_str());
  }
  // The failure is not left behind for the next launch check.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  void* ptr = nullptr;
  EXPECT_EQ(cudaMalloc(&ptr, 1024), cudaSuccess);
  (void)cudaFree(ptr);
}

// --- OffloadEngine ---------------------------------------------------------------------------

TEST(OffloadEngine, RoundTripThroughSlotsWithEventsAndCoalescing) {
  SKIP_WITHOUT_GPU();
  constexpr uint64_t kPageBytes = 64 << 10;
  constexpr int64_t kFloats = kPageBytes / sizeof(float);
  PinnedPageStoreOptions o;
  o.page_bytes = kPageBytes;
  o.capacity_pages = 32;
  PinnedPageStore store(o);
  DeviceArena arena(Reserve({{MemCategory::kPageSlots, 16 * kPageBytes}}));
  const DeviceBuffer slot_buffer =
      arena.AllocateNamed(MemCategory::kPageSlots, "slots", 16 * kPageBytes);
  OffloadEngine engine(store, {slot_buffer.ptr, kPageBytes, 16});
  // The probe below transforms all 16 slots: the 7 no copy fills start at zero (initcheck).
  CTXPLAN_CUDA_CHECK(cudaMemset(slot_buffer.ptr, 0, 16 * kPageBytes));

  std::vector<PageId> in;
  for (int i = 0; i < 12; ++i) in.push_back(store.Allocate());
  for (size_t p = 0; p < in.size(); ++p) {
    float* host = reinterpret_cast<float*>(store.HostPtr(in[p]));
    for (int64_t i = 0; i < kFloats; ++i) host[i] = static_cast<float>(p * 100000 + i % 1000);
  }
  // Runs (after sorting by page): pages 0-3 -> slots 4-7, pages 5-6 -> slots 0-1, page 9 ->
  // slot 12, page 10 -> slot 9 (host-adjacent to 9 but not in slots), page 11 -> slot 10 (joins
  // page 10's run). Given scrambled: 8 pages in 4 cudaMemcpyAsync calls.
  const std::vector<PageCopy> copies = {{in[6], 1}, {in[2], 6},  {in[10], 9},
                                        {in[0], 4}, {in[9], 12}, {in[3], 7},
                                        {in[5], 0}, {in[1], 5},  {in[11], 10}};
  cudaEvent_t copied = engine.CopyIn(copies);
  EXPECT_EQ(engine.h2d_stats().calls, 1u);
  EXPECT_EQ(engine.h2d_stats().pages, 9u);
  EXPECT_EQ(engine.h2d_stats().memcpy_calls, 4u);
  EXPECT_EQ(engine.h2d_stats().bytes, 9 * kPageBytes);

  // Compute waits for the copy-in, transforms the slots; copy-out waits for the compute.
  cudaStream_t compute;
  CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  CTXPLAN_CUDA_CHECK(cudaStreamWaitEvent(compute, copied, 0));
  LaunchProbeKernel(slot_buffer.as<float>(), 16 * kFloats, 2.0f, 1.0f, compute);
  cudaEvent_t computed;
  CTXPLAN_CUDA_CHECK(cudaEventCreateWithFlags(&computed, cudaEventDisableTiming));
  CTXPLAN_CUDA_CHECK(cudaEventRecord(computed, compute));

  std::vector<PageId> out;
  for (int i = 0; i < 9; ++i) out.push_back(store.Allocate());  // ids 12..20, contiguous
  std::vector<PageCopy> back;
  for (size_t i = 0; i < copies.size(); ++i) back.push_back({out[i], copies[i].slot});
  cudaEvent_t home = engine.CopyOut(back, computed);
  CTXPLAN_CUDA_CHECK(cudaEventSynchronize(home));
  EXPECT_EQ(engine.d2h_stats().pages, 9u);
  EXPECT_GE(engine.d2h_stats().memcpy_calls, 1u);

  for (size_t i = 0; i < copies.size(); ++i) {
    const size_t p =
        static_cast<size_t>(std::find(in.begin(), in.end(), copies[i].page) - in.begin());
    const float* host = reinterpret_cast<const float*>(store.HostPtr(out[i]));
    int bad = 0;
    for (int64_t k = 0; k < kFloats; ++k) {
      const float expected = static_cast<float>(p * 100000 + k % 1000) * 2.0f + 1.0f;
      bad += host[k] != expected;
    }
    EXPECT_EQ(bad, 0) << "page " << p << " via slot " << copies[i].slot;
  }

  // A free page or a slot out of range is a bug.
  store.Release(in[11]);
  EXPECT_THROW(engine.CopyIn(std::vector<PageCopy>{{in[11], 0}}), InternalError);
  EXPECT_THROW(engine.CopyIn(std::vector<PageCopy>{{in[0], 16}}), InternalError);
  // An empty list still orders and returns an event.
  CTXPLAN_CUDA_CHECK(cudaEventSynchronize(engine.CopyOut({}, home)));
  engine.Synchronize();
  CTXPLAN_CUDA_CHECK(cudaEventDestroy(computed));
  CTXPLAN_CUDA_CHECK(cudaStreamDestroy(compute));
}

// --- CuptiTracer -----------------------------------------------------------------------------

const OpRecord* FindOp(const std::vector<OpRecord>& ops, uint64_t id) {
  for (const OpRecord& r : ops)
    if (r.op_id == id) return &r;
  return nullptr;
}

TEST(CuptiTracer, AttributesKernelsAndCopiesToPlanOps) {
  SKIP_WITHOUT_CUPTI();
  const auto trace_path = TempPath("ops.ctxtrace");
  std::ostringstream chrome_json;
  {
    CuptiTracerOptions options;
    options.enabled = true;
    CuptiTracer tracer(options);
    ASSERT_TRUE(tracer.enabled());
    TraceMetadata metadata = CuptiTracer::DeviceMetadata();
    metadata["test"] = "gpu_runtime_cuda_test";
    OpTraceWriter compact(trace_path, metadata);
    ChromeTraceWriter chrome(chrome_json);
    tracer.SetOutputs(&compact, &chrome);

    constexpr int64_t kN = 1 << 16;
    float* device = nullptr;
    float* pinned = nullptr;
    CTXPLAN_CUDA_CHECK(cudaMalloc(&device, kN * sizeof(float)));
    CTXPLAN_CUDA_CHECK(cudaHostAlloc(&pinned, kN * sizeof(float), cudaHostAllocDefault));
    std::fill(pinned, pinned + kN, 1.0f);
    cudaStream_t stream;
    CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    tracer.BeginStep();
    DeviceArena arena(Reserve({{MemCategory::kWorkspace, 1 << 20}}));
    arena.SetListener(&tracer);

    tracer.PushOp(7);
    CTXPLAN_CUDA_CHECK(
        cudaMemcpyAsync(device, pinned, kN * sizeof(float), cudaMemcpyHostToDevice, stream));
    for (int i = 0; i < 3; ++i) LaunchProbeKernel(device, kN, 1.0f, 1.0f, stream);
    tracer.PopOp();

    Op op8;
    op8.id = 8;
    op8.kind = OpKind::kLinearForward;
    op8.stream = Stream::kCompute;
    op8.phase = Phase::kBackward;
    op8.part = OpPart::kGateUp;
    op8.chunk = 3;
    op8.layer = 5;
    tracer.PushOp(op8);
    const DeviceBuffer ws = arena.Allocate(MemCategory::kWorkspace, 4096, "ws");
    CTXPLAN_CUDA_CHECK(cudaMemsetAsync(ws.ptr, 0, ws.bytes, stream));
    LaunchProbeKernel(device, kN, 2.0f, 0.0f, stream);
    CTXPLAN_CUDA_CHECK(
        cudaMemcpyAsync(pinned, device, kN * sizeof(float), cudaMemcpyDeviceToHost, stream));
    tracer.PopOp();

    tracer.PushOp(9);  // launches nothing: timed on the CPU
    arena.Free(ws);
    tracer.PopOp();

    LaunchProbeKernel(device, kN, 1.0f, 0.0f, stream);  // outside any op

    const TraceStepSummary s = tracer.EndStep();
    std::printf(
        "step: %zu ops, %llu kernels, %llu memcpys, %llu memsets, %llu API calls, "
        "%llu external correlations, %llu driver memory events, %llu unattributed, "
        "%llu dropped, driver memory traced: %d\n",
        s.ops.size(), (unsigned long long)s.kernels, (unsigned long long)s.memcpys,
        (unsigned long long)s.memsets, (unsigned long long)s.api_calls,
        (unsigned long long)s.external_correlations, (unsigned long long)s.driver_memory_events,
        (unsigned long long)s.unattributed, (unsigned long long)s.dropped_records,
        int(s.driver_memory_traced));
    EXPECT_EQ(pinned[0], 8.0f);  // (1 + 3) * 2: the work really ran
    ASSERT_EQ(s.ops.size(), 3u);
    const OpRecord* r7 = FindOp(s.ops, 7);
    const OpRecord* r8 = FindOp(s.ops, 8);
    const OpRecord* r9 = FindOp(s.ops, 9);
    ASSERT_TRUE(r7 && r8 && r9);
    for (const OpRecord* r : {r7, r8, r9}) {
      EXPECT_LE(r->start_ns, r->end_ns) << "op " << r->op_id;
      EXPECT_GE(r->start_ns, s.step_start_ns) << "op " << r->op_id;
      EXPECT_LE(r->end_ns, s.step_end_ns) << "op " << r->op_id;
      EXPECT_LT(r->end_ns - r->start_ns, 1'000'000'000) << "op " << r->op_id;
      std::printf("op %llu: %lld .. %lld ns (%lld ns)\n", (unsigned long long)r->op_id,
                  (long long)r->start_ns, (long long)r->end_ns,
                  (long long)(r->end_ns - r->start_ns));
    }
    EXPECT_GT(r7->end_ns - r7->start_ns, 0);
    EXPECT_GT(r8->end_ns - r8->start_ns, 0);
    EXPECT_LE(r7->end_ns, r8->start_ns);  // one stream: op 7's work precedes op 8's
    EXPECT_EQ(r8->kind, static_cast<uint8_t>(OpKind::kLinearForward));
    EXPECT_EQ(r8->phase, static_cast<uint8_t>(Phase::kBackward));
    EXPECT_EQ(r8->part, static_cast<uint8_t>(OpPart::kGateUp));
    EXPECT_EQ(r8->chunk, 3);
    EXPECT_EQ(r8->layer, 5);
    EXPECT_GE(s.kernels, 5u);
    EXPECT_GE(s.memcpys, 2u);
    EXPECT_GE(s.memsets, 1u);
    EXPECT_GE(s.unattributed, 1u);
    EXPECT_EQ(s.untimed, 0u);
    EXPECT_EQ(s.dropped_records, 0u);
    EXPECT_GE(s.external_correlations, 6u);
    EXPECT_EQ(s.memory_events, 2u);

    // A second step on the same timeline.
    tracer.BeginStep();
    tracer.PushOp(10);
    LaunchProbeKernel(device, kN, 1.0f, 0.0f, stream);
    tracer.PopOp();
    const TraceStepSummary s2 = tracer.EndStep();
    ASSERT_EQ(s2.ops.size(), 1u);
    EXPECT_EQ(s2.ops[0].op_id, 10u);
    EXPECT_GE(s2.ops[0].start_ns, s.step_end_ns);
    EXPECT_GE(s2.step_start_ns, s.step_end_ns);

    compact.Finish();
    chrome.Finish();
    CTXPLAN_CUDA_CHECK(cudaStreamDestroy(stream));
    CTXPLAN_CUDA_CHECK(cudaFreeHost(pinned));
    CTXPLAN_CUDA_CHECK(cudaFree(device));
  }

  const OpTrace trace = ReadOpTrace(trace_path);
  ASSERT_EQ(trace.ops.size(), 4u);
  EXPECT_EQ(trace.metadata.at("test"), "gpu_runtime_cuda_test");
  EXPECT_FALSE(trace.metadata.at("gpu").empty());
  std::printf("trace metadata: gpu=%s driver=%s runtime=%s cupti=%s\n",
              trace.metadata.at("gpu").c_str(), trace.metadata.at("cuda_driver_version").c_str(),
              trace.metadata.at("cuda_runtime_version").c_str(),
              trace.metadata.at("cupti_api_version").c_str());
  std::map<uint64_t, OpRecord> by_id;
  for (const OpRecord& r : trace.ops) by_id[r.op_id] = r;
  ASSERT_TRUE(by_id.contains(7) && by_id.contains(8) && by_id.contains(9) && by_id.contains(10));
  EXPECT_EQ(by_id[8].layer, 5);
  ASSERT_EQ(trace.memory.size(), 2u);
  EXPECT_EQ(trace.memory[0].space, static_cast<uint8_t>(MemSpace::kGpu));
  EXPECT_EQ(trace.memory[0].category, static_cast<uint8_t>(MemCategory::kWorkspace));
  EXPECT_EQ(trace.memory[0].space_total_bytes, 4096);
  EXPECT_EQ(trace.memory[1].space_total_bytes, 0);

  const std::string json = chrome_json.str();
  if (const char* dir = std::getenv("CTXPLAN_TEST_TRACE_DIR")) {  // to open in Perfetto
    std::filesystem::copy_file(trace_path, std::filesystem::path(dir) / "cupti_test.ctxtrace",
                               std::filesystem::copy_options::overwrite_existing);
    std::ofstream(std::filesystem::path(dir) / "cupti_test.json") << json;
  }
  EXPECT_NE(json.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(json.find("ProbeKernel"), std::string::npos);
  EXPECT_NE(json.find("Memcpy HtoD"), std::string::npos);
  EXPECT_NE(json.find("Memset"), std::string::npos);
  EXPECT_NE(json.find("cudaLaunchKernel"), std::string::npos);
  EXPECT_NE(json.find("linear_fwd.gate_up"), std::string::npos);  // op 8, pushed with its Op
  EXPECT_NE(json.find("\"op 7\""), std::string::npos);            // op 7, pushed by id
  EXPECT_NE(json.find("arena (GiB)"), std::string::npos);
  EXPECT_EQ(json.find("cudaGetLastError"), std::string::npos);  // quieted
  std::filesystem::remove_all(trace_path.parent_path());
}

TEST(CuptiTracer, DisabledRecordsNothing) {
  SKIP_WITHOUT_GPU();
  const auto trace_path = TempPath("disabled.ctxtrace");
  CuptiTracer tracer(CuptiTracerOptions{});  // enabled = false
  EXPECT_FALSE(tracer.enabled());
  OpTraceWriter compact(trace_path, {{"test", "disabled"}});
  tracer.SetOutputs(&compact, nullptr);
  float* device = nullptr;
  CTXPLAN_CUDA_CHECK(cudaMalloc(&device, 1024 * sizeof(float)));
  tracer.BeginStep();
  tracer.PushOp(7);
  LaunchProbeKernel(device, 1024, 1.0f, 1.0f, nullptr);
  tracer.OnMemoryEvent(MemSpace::kGpu, MemCategory::kWorkspace, 4096);
  tracer.PopOp();
  tracer.PopOp();  // not even checked: a disabled tracer does nothing at all
  const TraceStepSummary s = tracer.EndStep();
  EXPECT_TRUE(s.ops.empty());
  EXPECT_EQ(s.kernels + s.memcpys + s.memsets + s.api_calls + s.memory_events, 0u);
  EXPECT_EQ(tracer.NowNs(), 0);
  CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
  CTXPLAN_CUDA_CHECK(cudaFree(device));
  compact.Finish();
  const OpTrace trace = ReadOpTrace(trace_path);
  EXPECT_TRUE(trace.ops.empty());
  EXPECT_TRUE(trace.memory.empty());

  // A disabled tracer does not claim CUPTI: an enabled one can coexist with it, but not two.
  if (test::CuptiBusy()) return;  // (a disabled tracer works under compute-sanitizer; these don't)
  CuptiTracerOptions on;
  on.enabled = true;
  CuptiTracer first(on);
  EXPECT_THROW(CuptiTracer second(on), InternalError);
  std::filesystem::remove_all(trace_path.parent_path());
}

TEST(CuptiTracer, MisuseIsCaught) {
  SKIP_WITHOUT_CUPTI();
  CuptiTracerOptions on;
  on.enabled = true;
  CuptiTracer tracer(on);
  EXPECT_THROW(tracer.EndStep(), InternalError);  // no BeginStep
  tracer.BeginStep();
  EXPECT_THROW(tracer.PopOp(), InternalError);
  tracer.PushOp(1);
  EXPECT_THROW(tracer.EndStep(), InternalError);  // op 1 still pushed
}

// Tracing overhead: many small kernels, each its own plan op (the worst case: a real step's
// kernels are far longer), and a loop of larger kernels closer to a real step's.
double TimeLoopMs(int launches, int64_t n, float* device, cudaStream_t stream,
                  CuptiTracer* tracer) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < launches; ++i) {
    if (tracer) tracer->PushOp(static_cast<OpId>(i));
    LaunchProbeKernel(device, n, 1.0f, 0.0f, stream);
    if (tracer) tracer->PopOp();
  }
  CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(stream));
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

TEST(CuptiTracer, TracingOverhead) {
  SKIP_WITHOUT_CUPTI();
  constexpr int64_t kHuge = int64_t{1} << 27;  // 512 MiB: ~0.3 ms a kernel on an H200
  float* device = nullptr;
  CTXPLAN_CUDA_CHECK(cudaMalloc(&device, kHuge * sizeof(float)));
  CTXPLAN_CUDA_CHECK(cudaMemset(device, 0, kHuge * sizeof(float)));
  cudaStream_t stream;
  CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  struct Case {
    const char* name;
    int launches;
    int64_t n;
  };
  for (const Case& c : {Case{"10k small kernels (256 floats)", 10000, 256},
                        Case{"1k 64 MiB kernels", 1000, int64_t{1} << 24},
                        Case{"200 512 MiB kernels", 200, kHuge}}) {
    TimeLoopMs(std::min(c.launches, 200), c.n, device, stream, nullptr);  // warm up
    double off = 1e30, disabled = 1e30;
    double on[2] = {1e30, 1e30}, on_total[2] = {1e30, 1e30};  // [driver API correlation off/on]
    TraceStepSummary summary;
    for (int rep = 0; rep < 3; ++rep) {
      off = std::min(off, TimeLoopMs(c.launches, c.n, device, stream, nullptr));
      {
        CuptiTracer tracer(CuptiTracerOptions{});
        tracer.BeginStep();
        disabled = std::min(disabled, TimeLoopMs(c.launches, c.n, device, stream, &tracer));
        tracer.EndStep();
      }
      for (int driver = 0; driver < 2; ++driver) {
        CuptiTracerOptions options;
        options.enabled = true;
        options.correlate_driver_api = driver == 1;
        CuptiTracer tracer(options);
        tracer.BeginStep();
        const auto t0 = std::chrono::steady_clock::now();
        const double loop = TimeLoopMs(c.launches, c.n, device, stream, &tracer);
        summary = tracer.EndStep();
        const double total =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        on[driver] = std::min(on[driver], loop);
        on_total[driver] = std::min(on_total[driver], total);
      }
    }
    std::printf(
        "tracing overhead, %s, one op each: untraced %.2f ms (%.2f us/launch); tracer disabled "
        "%.2f ms (%+.1f%%); tracing on %.2f ms (%+.1f%%, +%.2f us/launch), %.2f ms with the "
        "end-of-step flush and resolve (%+.1f%%); without driver-API correlation %.2f ms "
        "(%+.1f%%), %.2f ms with flush (%+.1f%%)\n",
        c.name, off, off * 1e3 / c.launches, disabled, (disabled / off - 1) * 100, on[1],
        (on[1] / off - 1) * 100, (on[1] - off) * 1e3 / c.launches, on_total[1],
        (on_total[1] / off - 1) * 100, on[0], (on[0] / off - 1) * 100, on_total[0],
        (on_total[0] / off - 1) * 100);
    // The last summary is of the default options (driver-API correlation on).
    ASSERT_EQ(summary.ops.size(), static_cast<size_t>(c.launches));
    EXPECT_EQ(summary.dropped_records, 0u);
    EXPECT_EQ(summary.kernels, static_cast<uint64_t>(c.launches));
    EXPECT_EQ(summary.unattributed, 0u);
    for (const OpRecord& r : summary.ops) {
      ASSERT_LE(r.start_ns, r.end_ns);
      ASSERT_GT(r.end_ns, r.start_ns) << "op " << r.op_id << " has no GPU time";
    }
    // Ops on one stream: measured spans do not overlap, in launch order.
    for (size_t i = 1; i < summary.ops.size(); ++i)
      ASSERT_LE(summary.ops[i - 1].end_ns, summary.ops[i].start_ns) << "op " << i;
  }
  CTXPLAN_CUDA_CHECK(cudaStreamDestroy(stream));
  CTXPLAN_CUDA_CHECK(cudaFree(device));
}

}  // namespace
}  // namespace ctxplan::gpu
