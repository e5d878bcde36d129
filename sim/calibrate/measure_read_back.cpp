// ctxplan-measure's readback group: a page-sparse layer's selection read-back, done as the CUDA
// backend does it after each page_topk (runtime/src/cuda/cuda_backend_attention.cpp, PageTopK,
// then CopyIn's page table): the selections copied into pinned memory by the SMs, the stream
// synchronised, the selections read, their union sorted (AttendedPages), the layer's table of
// earlier pages written and copied, then the next kernel. The compute stream has nothing queued
// meanwhile, so it idles: each row's seconds are that idle time on the GPU, from an event after
// the selections' copy to an event before the next kernel (the median of the round trips).
//
// Rows (op selection_read_back): m = query tiles, pages = the layer's earlier pages,
// pages_per_tile = the selection's entries a tile. The host waits behind a short kernel first, as
// it waits behind a layer's kernels in a step. Fitted by `ctxplan calibrate` into a machine's
// selection_read_back_us, _ns_per_entry and _ns_per_page
// (models/include/ctxplan/models/gpu_spec.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/cuda/sm_copy.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "measure_common.h"
#include "measure_groups.h"

namespace ctxplan::calibrate {
namespace {

constexpr double kWaitBehindSeconds = 200e-6;  // the kernel the host waits behind
constexpr int kWarmUps = 5;

// Timing events, destroyed with the case.
class TimingEvents {
 public:
  explicit TimingEvents(int count) : events_(static_cast<size_t>(count), nullptr) {
    for (cudaEvent_t& e : events_) CTXPLAN_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~TimingEvents() {
    for (cudaEvent_t e : events_)
      if (e != nullptr) (void)cudaEventDestroy(e);  // never throws from a destructor
  }
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;
  cudaEvent_t operator[](int i) const { return events_[static_cast<size_t>(i)]; }

 private:
  std::vector<cudaEvent_t> events_;
};

struct ReadBackCase {
  int64_t tiles, per_tile, pages;
};

Sample ReadBackRow(Session& session, const ReadBackCase& c, int round_trips) {
  const int64_t entries = c.tiles * c.per_tile;
  // [tiles][per_tile] page numbers: each tile's first entry the sink page, the rest drawn.
  std::vector<int32_t> drawn(static_cast<size_t>(entries));
  std::mt19937 rng(static_cast<uint32_t>(7 + c.tiles * 31 + c.per_tile * 7 + c.pages));
  std::uniform_int_distribution<int32_t> page(1, static_cast<int32_t>(c.pages - 1));
  for (int64_t i = 0; i < entries; ++i)
    drawn[static_cast<size_t>(i)] = i % c.per_tile == 0 ? 0 : page(rng);
  DeviceArray<int32_t> selected(static_cast<size_t>(entries));
  CTXPLAN_CUDA_CHECK(
      cudaMemcpy(selected.get(), drawn.data(), selected.bytes(), cudaMemcpyHostToDevice));
  const PinnedHost selection_pinned(static_cast<size_t>(entries) * sizeof(int32_t));
  const PinnedHost table_pinned(static_cast<size_t>(c.pages) * sizeof(int32_t));
  auto* selection_host = reinterpret_cast<int32_t*>(selection_pinned.get());  // [tiles][per_tile]
  auto* table_host = reinterpret_cast<int32_t*>(table_pinned.get());          // [earlier pages]
  DeviceArray<int32_t> table(static_cast<size_t>(c.pages));

  cudaStream_t h2d = nullptr;
  CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&h2d, cudaStreamNonBlocking));
  const std::unique_ptr<CUstream_st, cudaError_t (*)(cudaStream_t)> h2d_owner(h2d,
                                                                              cudaStreamDestroy);
  const int total = kWarmUps + round_trips;
  // [2 r]: after round trip r's selections reached the host, [2 r + 1]: before the next kernel.
  TimingEvents events(2 * total);
  cudaEvent_t copied = nullptr;  // the table's copy, waited for by the compute stream
  CTXPLAN_CUDA_CHECK(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming));
  const std::unique_ptr<CUevent_st, cudaError_t (*)(cudaEvent_t)> copied_owner(copied,
                                                                               cudaEventDestroy);

  ChunkGeometry chunk;
  chunk.sparse = true;
  chunk.earlier_pages = c.pages;
  const cudaStream_t stream = session.stream;
  for (int r = 0; r < total; ++r) {
    LaunchIdleKernel(kWaitBehindSeconds, stream);
    gpu::CopyBySms(selected.get(), selection_host, entries, stream);
    CTXPLAN_CUDA_CHECK(cudaEventRecord(events[2 * r], stream));
    CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<int32_t> selection(selection_host, selection_host + entries);
    const std::vector<int32_t> pages = AttendedPages(chunk, selection);
    std::fill(table_host, table_host + c.pages, -1);
    for (size_t j = 0; j < pages.size(); ++j) table_host[pages[j]] = static_cast<int32_t>(j);
    CTXPLAN_CUDA_CHECK(
        cudaMemcpyAsync(table.get(), table_host, table.bytes(), cudaMemcpyHostToDevice, h2d));
    CTXPLAN_CUDA_CHECK(cudaEventRecord(copied, h2d));
    CTXPLAN_CUDA_CHECK(cudaStreamWaitEvent(stream, copied, 0));
    CTXPLAN_CUDA_CHECK(cudaEventRecord(events[2 * r + 1], stream));
    LaunchEmptyKernel(stream);
  }
  CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> gaps;
  for (int r = kWarmUps; r < total; ++r) {
    float ms = 0;
    CTXPLAN_CUDA_CHECK(cudaEventElapsedTime(&ms, events[2 * r], events[2 * r + 1]));
    gaps.push_back(static_cast<double>(ms) * 1e-3);
  }
  std::nth_element(gaps.begin(), gaps.begin() + static_cast<ptrdiff_t>(gaps.size() / 2),
                   gaps.end());
  Sample s;
  s.op = "selection_read_back";
  s.m = c.tiles;
  s.pages = c.pages;
  s.pages_per_tile = c.per_tile;
  s.seconds = gaps[gaps.size() / 2];
  return s;
}

}  // namespace

void MeasureReadBack(Session& session) {
  std::vector<ReadBackCase> cases;
  if (session.quick) {
    cases = {{32, 65, 1024}, {32, 65, 32768}, {128, 257, 8192}};
  } else {
    for (const int64_t tiles : {8, 32, 128})
      for (const int64_t per_tile : {17, 65, 257})
        for (const int64_t pages : {1024, 8192, 32768}) cases.push_back({tiles, per_tile, pages});
  }
  const int round_trips = session.quick ? 20 : 20 * session.reps;
  Progress progress("readback", cases.size());
  for (const ReadBackCase& c : cases) {
    progress.Step(Describe("selection_read_back",
                           {{"m", c.tiles}, {"pages_per_tile", c.per_tile}, {"pages", c.pages}}));
    session.Add(ReadBackRow(session, c, round_trips));
  }
}

}  // namespace ctxplan::calibrate
