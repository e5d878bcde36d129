#include "ctxplan/runtime/cuda/cupti_tracer.h"

#include <cuda_runtime_api.h>
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/op_kind.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/cuda/cupti_check.h"

namespace ctxplan::gpu {

namespace {

constexpr size_t kBufferBytes = size_t{4} << 20;
constexpr size_t kBufferAlignment = ACTIVITY_RECORD_ALIGNMENT;  // 8: what CUPTI requires
constexpr double kGiB = 1073741824.0;
constexpr size_t kMaxUnattributedNames = 16;  // in TraceStepSummary: enough to name the culprits

// Chrome trace processes.
constexpr int64_t kPidStep = 1;  // plan ops by plan stream, memory counters (as WallClockTracer)
constexpr int64_t kPidGpu = 2;   // GPU activities by CUDA stream, driver allocations
constexpr int64_t kPidCpu = 3;   // runtime / driver API calls by CPU thread

// Activity buffers for CUPTI, shared by every tracer of the process and never freed: CUPTI may
// still hold a buffer when a tracer goes away (it hands it back at its next flush), so the pool
// outlives them all. Buffers are reused; `in_flight` counts those CUPTI holds.
class BufferPool {
 public:
  static BufferPool& Get() {
    static BufferPool* pool = new BufferPool;  // intentionally leaked (see above)
    return *pool;
  }
  uint8_t* Take(int max_in_flight) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (in_flight_ >= max_in_flight) return nullptr;  // CUPTI drops records, and counts them
    uint8_t* buffer = nullptr;
    if (!free_.empty()) {
      buffer = free_.back();
      free_.pop_back();
    } else {
      buffer = static_cast<uint8_t*>(std::aligned_alloc(kBufferAlignment, kBufferBytes));
      if (buffer == nullptr) return nullptr;
    }
    ++in_flight_;
    return buffer;
  }
  void Give(uint8_t* buffer) {
    if (buffer == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    --in_flight_;
    free_.push_back(buffer);
  }

 private:
  std::mutex mutex_;
  std::vector<uint8_t*> free_;
  int in_flight_ = 0;
};

enum class GpuKind : uint8_t { kKernel, kMemcpy, kMemset };

struct GpuActivity {
  uint64_t start = 0, end = 0;
  uint64_t bytes = 0;
  uint32_t correlation = 0;
  uint32_t runtime_correlation = 0;  // memcpy only: the runtime call's id, if it differs
  uint32_t stream = 0;
  uint32_t device = 0;
  uint32_t detail = 0;  // kernel: index into Collected::names; memcpy: CUpti_ActivityMemcpyKind
  GpuKind kind = GpuKind::kKernel;
};

enum class ApiKind : uint8_t { kRuntime, kDriver, kInternalLaunch };

struct ApiCall {
  uint64_t start = 0, end = 0;
  uint32_t correlation = 0;
  uint32_t cbid = 0;
  uint32_t thread = 0;
  ApiKind kind = ApiKind::kRuntime;
};

struct DriverMemory {
  uint64_t time = 0;
  uint64_t address = 0;
  uint64_t bytes = 0;
  bool allocation = false;
};

// What the completion callback collects, until EndStep takes it.
struct Collected {
  std::vector<GpuActivity> gpu;
  std::vector<ApiCall> api;
  std::vector<std::pair<uint32_t, uint64_t>> external;  // correlation id -> plan op id
  std::vector<DriverMemory> driver_memory;
  uint64_t api_calls = 0;         // counted even when not kept
  uint64_t driver_api_calls = 0;  // of api_calls: driver API and internal launch records
  uint64_t dropped = 0;
  std::string error;  // the first failure inside a callback (callbacks must not throw)
};

uint64_t Timestamp() {
  uint64_t t = 0;
  CTXPLAN_CUPTI_CHECK(cuptiGetTimestamp(&t));
  return t;
}

std::string Demangle(const char* name) {
  if (name == nullptr) return "(unnamed kernel)";
  int status = 0;
  char* demangled = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status != 0 || demangled == nullptr) return name;
  std::string out(demangled);
  std::free(demangled);
  return out;
}

std::string_view MemcpyKindName(uint32_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "Memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "Memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "Memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "Memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "Memcpy PtoP";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOA:
      return "Memcpy HtoA";
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOH:
      return "Memcpy AtoH";
    default:
      return "Memcpy";
  }
}

std::string VersionString(int version) {  // 13000 -> "13.0"
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

// Driver API entry points whose records we keep: those that start GPU work, so work that
// libraries launch through the driver API is correlated with the op that called them. Every other
// driver call (cuBLASLt makes ~45 per matmul: attribute and context queries) is switched off.
bool IsWorkLaunchingDriverApi(std::string_view name) {
  return name.starts_with("cuLaunch") || name.starts_with("cuMemcpy") ||
         name.starts_with("cuMemset") || name.starts_with("cuGraphLaunch");
}

// Runtime calls made around every launch that would only clutter the trace.
constexpr CUpti_CallbackId kQuietRuntimeApis[] = {
    CUPTI_RUNTIME_TRACE_CBID_cudaGetLastError_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaPeekAtLastError_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDevice_v3020,
    CUPTI_RUNTIME_TRACE_CBID___cudaPushCallConfiguration_v13000,
    CUPTI_RUNTIME_TRACE_CBID___cudaPopCallConfiguration_v13000,
};

constexpr CUpti_ActivityKind kKinds[] = {
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
    CUPTI_ACTIVITY_KIND_MEMCPY,
    CUPTI_ACTIVITY_KIND_MEMSET,
    CUPTI_ACTIVITY_KIND_RUNTIME,
    CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
    CUPTI_ACTIVITY_KIND_MEMORY2,
};

}  // namespace

class CuptiTracer::Impl {
 public:
  explicit Impl(const CuptiTracerOptions& options) : options_(options) {}

  // --- state shared with the CUPTI callbacks (guarded by g_mutex) ---
  Collected collected;
  std::unordered_map<const char*, uint32_t> name_index;  // CUPTI's kernel name pointer -> index
  std::vector<std::string> names;                        // demangled kernel names
  bool keep_api_calls = false;                           // only the Chrome trace shows them

  void Parse(uint8_t* buffer, size_t valid_size);

  // --- the tracer thread's state ---
  CuptiTracerOptions options_;
  std::vector<CUpti_ActivityKind> enabled_kinds;
  std::string driver_memory_unavailable;  // why MEMORY2 could not be enabled, if it could not
  int optional_failures = 0;              // quiet-runtime / driver-API settings CUPTI refused
  OpTraceWriter* compact = nullptr;
  ChromeTraceWriter* chrome = nullptr;
  bool origin_set = false;
  uint64_t origin = 0;
  uint64_t step_start = 0;
  bool in_step = false;

  struct OpSlot {
    OpId id = 0;
    uint64_t cpu_start = 0, cpu_end = 0;
    uint64_t gpu_start = std::numeric_limits<uint64_t>::max(), gpu_end = 0;
    uint64_t activities = 0;
    uint64_t memcpy_ns = 0, memset_ns = 0, memsets = 0;  // its copies' and memsets' busy time
    uint8_t kind = 0, stream = 0, phase = 0, part = 0;
    int32_t chunk = -1, layer = -1;
    bool has_op = false;  // pushed with its Op (else by id alone: no kind, stream, ...)
  };
  std::vector<OpSlot> slots;  // in push order
  std::vector<size_t> open;   // indices of pushed, not yet popped ops

  struct MemoryEvent {
    uint64_t time;
    MemSpace space;
    MemCategory category;
    int64_t total;
  };
  std::vector<MemoryEvent> memory;

  // Chrome trace bookkeeping.
  bool processes_named = false;
  std::set<std::pair<int64_t, int64_t>> named_tracks;
  std::unordered_map<uint32_t, std::string> api_names;  // (kind << 24 | cbid) -> name
  std::unordered_map<uint64_t, uint64_t> driver_live;   // address -> bytes (MEMORY2)
  int64_t driver_allocated = 0;

  double Us(uint64_t t) const {
    return static_cast<double>(static_cast<int64_t>(t - origin)) / 1e3;
  }
  void NameTrack(int64_t pid, int64_t tid, const std::string& name) {
    if (named_tracks.emplace(pid, tid).second) chrome->SetThreadName(pid, tid, name, tid);
  }
  const std::string& ApiName(const ApiCall& call);
  void WriteChrome(const Collected& c, const std::vector<std::string>& kernel_names,
                   const std::unordered_map<uint32_t, uint64_t>& ext,
                   const std::vector<OpSlot>& ops);
};

namespace {

// No CUPTI call is made while g_mutex is held (except cuptiActivityGetNextRecord, which only
// walks a buffer we own), so CUPTI's own locks and ours can never be taken in opposite orders.
std::mutex g_mutex;                     // guards g_active and what the callbacks write into it
CuptiTracer::Impl* g_active = nullptr;  // the enabled tracer, if any
std::atomic<int> g_max_buffers_in_flight{64};  // of the enabled tracer

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = BufferPool::Get().Take(g_max_buffers_in_flight.load(std::memory_order_relaxed));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI BufferCompleted(CUcontext context, uint32_t stream_id, uint8_t* buffer,
                              size_t /*size*/, size_t valid_size) {
  size_t dropped = 0;
  const CUptiResult dropped_status =
      cuptiActivityGetNumDroppedRecords(context, stream_id, &dropped);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_active != nullptr) {
      Collected& c = g_active->collected;
      try {
        g_active->Parse(buffer, valid_size);
        if (dropped_status != CUPTI_SUCCESS)
          ThrowCupti(dropped_status, "cuptiActivityGetNumDroppedRecords", __FILE__, __LINE__);
        c.dropped += dropped;
      } catch (const std::exception& e) {
        if (c.error.empty()) c.error = e.what();
      } catch (...) {
        if (c.error.empty()) c.error = "unknown exception in the CUPTI buffer callback";
      }
    }
  }
  BufferPool::Get().Give(buffer);
}

}  // namespace

// Called with g_mutex held, on CUPTI's thread (or the flushing thread).
void CuptiTracer::Impl::Parse(uint8_t* buffer, size_t valid_size) {
  if (buffer == nullptr || valid_size == 0) return;
  CUpti_Activity* record = nullptr;
  while (true) {
    const CUptiResult status = cuptiActivityGetNextRecord(buffer, valid_size, &record);
    if (status == CUPTI_ERROR_MAX_LIMIT_REACHED) break;  // the end of the buffer
    CTXPLAN_CUPTI_CHECK(status);
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        GpuActivity a;
        a.start = k->start;
        a.end = k->end;
        a.correlation = k->correlationId;
        a.stream = k->streamId;
        a.device = k->deviceId;
        a.kind = GpuKind::kKernel;
        auto [it, inserted] = name_index.try_emplace(k->name, static_cast<uint32_t>(names.size()));
        if (inserted) names.push_back(Demangle(k->name));
        a.detail = it->second;
        collected.gpu.push_back(a);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        GpuActivity a;
        a.start = m->start;
        a.end = m->end;
        a.bytes = m->bytes;
        a.correlation = m->correlationId;
        a.runtime_correlation = m->runtimeCorrelationId;
        a.stream = m->streamId;
        a.device = m->deviceId;
        a.detail = m->copyKind;
        a.kind = GpuKind::kMemcpy;
        collected.gpu.push_back(a);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        GpuActivity a;
        a.start = m->start;
        a.end = m->end;
        a.bytes = m->bytes;
        a.correlation = m->correlationId;
        a.stream = m->streamId;
        a.device = m->deviceId;
        a.kind = GpuKind::kMemset;
        collected.gpu.push_back(a);
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER:
      case CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API: {
        // Counted, and kept only for the Chrome trace: attribution needs nothing from them (the
        // external-correlation record that precedes each one carries the mapping).
        ++collected.api_calls;
        const ApiKind kind = record->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? ApiKind::kRuntime
                             : record->kind == CUPTI_ACTIVITY_KIND_DRIVER
                                 ? ApiKind::kDriver
                                 : ApiKind::kInternalLaunch;
        if (kind != ApiKind::kRuntime) ++collected.driver_api_calls;
        if (!keep_api_calls) break;
        const auto* api = reinterpret_cast<const CUpti_ActivityAPI*>(record);
        collected.api.push_back(
            {api->start, api->end, api->correlationId, api->cbid, api->threadId, kind});
        break;
      }
      case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
        const auto* e = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(record);
        if (e->externalKind == CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0)
          collected.external.emplace_back(e->correlationId, e->externalId);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMORY2: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemory4*>(record);
        collected.driver_memory.push_back(
            {m->timestamp, m->address, m->bytes,
             m->memoryOperationType == CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION});
        break;
      }
      default:
        break;
    }
  }
}

const std::string& CuptiTracer::Impl::ApiName(const ApiCall& call) {
  const uint32_t key = static_cast<uint32_t>(call.kind) << 24 | call.cbid;
  auto it = api_names.find(key);
  if (it != api_names.end()) return it->second;
  if (call.kind == ApiKind::kInternalLaunch)  // no public entry point: cbid is unused
    return api_names.emplace(key, "internal kernel launch").first->second;
  const bool driver = call.kind == ApiKind::kDriver;
  const char* raw = nullptr;
  std::string name;
  if (cuptiGetCallbackName(driver ? CUPTI_CB_DOMAIN_DRIVER_API : CUPTI_CB_DOMAIN_RUNTIME_API,
                           call.cbid, &raw) == CUPTI_SUCCESS &&
      raw != nullptr) {
    name = raw;
    // "cudaLaunchKernel_v7000" -> "cudaLaunchKernel"
    const size_t v = name.rfind("_v");
    if (v != std::string::npos && v + 2 < name.size() &&
        name.find_first_not_of("0123456789", v + 2) == std::string::npos)
      name.resize(v);
  } else {
    name = std::string(driver ? "driver" : "runtime") + " API " + std::to_string(call.cbid);
  }
  return api_names.emplace(key, std::move(name)).first->second;
}

// --- CuptiTracer --------------------------------------------------------------------------------

CuptiTracer::CuptiTracer(const CuptiTracerOptions& options) : enabled_(options.enabled) {
  if (!enabled_) return;  // tracing off: not one CUPTI call
  CTXPLAN_CHECK(options.max_buffers_in_flight > 0, "CUPTI tracer: max_buffers_in_flight <= 0");
  impl_ = std::make_unique<Impl>(options);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    CTXPLAN_CHECK(g_active == nullptr, "CUPTI tracer: another tracer is already enabled");
    g_active = impl_.get();
    g_max_buffers_in_flight.store(options.max_buffers_in_flight);
  }
  try {
    // The callbacks are the same for every tracer: register them once per process.
    static bool registered = false;
    if (!registered) {
      const CUptiResult status = cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted);
      if (status == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)
        throw CuptiError(
            "cannot trace: CUPTI is already in use by another tool in this process "
            "(compute-sanitizer, Nsight Systems, Nsight Compute or another profiler): run "
            "without that tool, or with tracing off (" +
                CuptiResultString(status) + ")",
            status);
      CTXPLAN_CUPTI_CHECK(status);
      registered = true;  // only ever touched here, by one constructing thread at a time
    }
    for (CUpti_ActivityKind kind : kKinds) {
      const CUptiResult status = cuptiActivityEnable(kind);
      if (kind == CUPTI_ACTIVITY_KIND_MEMORY2 &&
          (status == CUPTI_ERROR_NOT_SUPPORTED || status == CUPTI_ERROR_NOT_COMPATIBLE ||
           status == CUPTI_ERROR_INVALID_KIND)) {
        // Driver allocations are context, not timing: trace without them where they are
        // unavailable (some virtualised GPUs), and say so in the summary.
        impl_->driver_memory_unavailable = CuptiResultString(status);
        continue;
      }
      CTXPLAN_CUPTI_CHECK(status);
      impl_->enabled_kinds.push_back(kind);
    }
    // After enabling RUNTIME, which would override these settings otherwise. Optional: a cbid
    // this CUPTI does not know is simply left recorded.
    for (CUpti_CallbackId cbid : kQuietRuntimeApis)
      if (cuptiActivityEnableRuntimeApi(cbid, 0) != CUPTI_SUCCESS) ++impl_->optional_failures;
    if (options.correlate_driver_api) {
      // cuBLASLt launches its GEMM kernels (nvjet_*) with cuLaunchKernelEx: a driver API call,
      // with no runtime API call around it. CUPTI writes the external-correlation record that maps
      // a call to the pushed op only in front of an API activity record it creates for that call
      // (cuptiActivityPushExternalCorrelationId), so without a driver record for the launch the
      // kernel's correlation id maps to no op. cuptiActivityEnableDriverApi(cbid, 1) on its own is
      // documented to record just those calls, but CUPTI 13.0 (130001) accepts it and then records
      // nothing while no driver-domain activity kind is enabled: that is how the GEMMs of the
      // first Qwen2.5-7B trace went unattributed. So: the DRIVER kind (every driver call), then
      // every entry point that starts no GPU work switched off, the documented way to record a
      // subset (in this order: enabling DRIVER overrides per-API settings made before it).
      CTXPLAN_CUPTI_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER));
      impl_->enabled_kinds.push_back(CUPTI_ACTIVITY_KIND_DRIVER);
      for (CUpti_CallbackId cbid = 1; cbid < CUPTI_DRIVER_TRACE_CBID_SIZE; ++cbid) {
        const char* name = nullptr;
        // Unused ids in the range have no name (CUPTI_ERROR_INVALID_PARAMETER): skip them.
        if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, cbid, &name) != CUPTI_SUCCESS ||
            name == nullptr || IsWorkLaunchingDriverApi(name))
          continue;
        // Optional: a call left on only costs its records.
        if (cuptiActivityEnableDriverApi(cbid, 0) != CUPTI_SUCCESS) ++impl_->optional_failures;
      }
      // Kernels the driver launches outside any public API call get a record of their own kind
      // (and so an external-correlation record too). Optional: a CUPTI without it traces the rest.
      if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API) == CUPTI_SUCCESS)
        impl_->enabled_kinds.push_back(CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API);
      else
        ++impl_->optional_failures;
    }
  } catch (...) {
    for (CUpti_ActivityKind kind : impl_->enabled_kinds) (void)cuptiActivityDisable(kind);
    std::lock_guard<std::mutex> lock(g_mutex);
    g_active = nullptr;
    throw;
  }
}

CuptiTracer::~CuptiTracer() {
  if (!enabled_) return;
  // Never throws: results are ignored, there is nobody left to report them to.
  for (size_t i = 0; i < impl_->open.size(); ++i)  // ops left pushed (an exception unwound)
    (void)cuptiActivityPopExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, nullptr);
  // The per-API settings stay behind: the next tracer's cuptiActivityEnable(DRIVER) resets them.
  for (CUpti_ActivityKind kind : impl_->enabled_kinds) (void)cuptiActivityDisable(kind);
  (void)cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_active = nullptr;
}

void CuptiTracer::SetOutputs(OpTraceWriter* compact, ChromeTraceWriter* chrome) {
  if (!enabled_) return;
  impl_->compact = compact;
  impl_->chrome = chrome;
  std::lock_guard<std::mutex> lock(g_mutex);
  impl_->keep_api_calls = chrome != nullptr;
}

int64_t CuptiTracer::NowNs() const {
  if (!enabled_ || !impl_->origin_set) return 0;
  return static_cast<int64_t>(Timestamp() - impl_->origin);
}

void CuptiTracer::BeginStepImpl() {
  Impl& s = *impl_;
  CTXPLAN_CHECK(!s.in_step, "CUPTI tracer: BeginStep twice without EndStep");
  const uint64_t now = Timestamp();
  if (!s.origin_set) {
    s.origin = now;
    s.origin_set = true;
  }
  s.step_start = now;
  s.in_step = true;
}

void CuptiTracer::PushOpImpl(OpId id, const Op* op) {
  Impl& s = *impl_;
  Impl::OpSlot slot;
  slot.id = id;
  if (op) {
    slot.has_op = true;
    slot.kind = static_cast<uint8_t>(op->kind);
    slot.stream = static_cast<uint8_t>(op->stream);
    slot.phase = static_cast<uint8_t>(op->phase);
    slot.part = static_cast<uint8_t>(op->part);
    slot.chunk = op->chunk;
    slot.layer = op->layer;
  }
  CTXPLAN_CUPTI_CHECK(
      cuptiActivityPushExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, id));
  slot.cpu_start = Timestamp();
  s.open.push_back(s.slots.size());
  s.slots.push_back(slot);
}

void CuptiTracer::PopOpImpl() {
  Impl& s = *impl_;
  CTXPLAN_CHECK(!s.open.empty(), "CUPTI tracer: PopOp without PushOp");
  s.slots[s.open.back()].cpu_end = Timestamp();
  s.open.pop_back();
  CTXPLAN_CUPTI_CHECK(
      cuptiActivityPopExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, nullptr));
}

void CuptiTracer::MemoryEventImpl(MemSpace space, MemCategory category, int64_t total) {
  impl_->memory.push_back({Timestamp(), space, category, total});
}

namespace {

using Interval = std::pair<uint64_t, uint64_t>;

// Sorts and merges overlapping intervals in place.
void MergeIntervals(std::vector<Interval>& v) {
  std::sort(v.begin(), v.end());
  size_t n = 0;
  for (const Interval& i : v) {
    if (n > 0 && i.first <= v[n - 1].second)
      v[n - 1].second = std::max(v[n - 1].second, i.second);
    else
      v[n++] = i;
  }
  v.resize(n);
}

int64_t Length(const std::vector<Interval>& merged) {
  int64_t total = 0;
  for (const Interval& i : merged) total += static_cast<int64_t>(i.second - i.first);
  return total;
}

// Time covered by both of two merged interval lists.
int64_t Overlap(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  int64_t total = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const uint64_t lo = std::max(a[i].first, b[j].first);
    const uint64_t hi = std::min(a[i].second, b[j].second);
    if (lo < hi) total += static_cast<int64_t>(hi - lo);
    (a[i].second < b[j].second ? i : j)++;
  }
  return total;
}

void AddCopies(const std::vector<GpuActivity>& gpu, TraceStepSummary& summary) {
  std::vector<Interval> h2d, d2h;
  for (const GpuActivity& a : gpu) {
    if (a.kind != GpuKind::kMemcpy || a.end <= a.start) continue;
    const bool to_device = a.detail == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD;
    if (!to_device && a.detail != CUPTI_ACTIVITY_MEMCPY_KIND_DTOH) continue;
    TracedCopies& stats = to_device ? summary.h2d : summary.d2h;
    size_t b = 0;
    while (a.bytes > TracedCopies::kBucketMaxBytes[b]) ++b;
    const auto ns = static_cast<int64_t>(a.end - a.start);
    for (TracedCopies::Bucket* bucket : {&stats.all, &stats.by_size[b]}) {
      ++bucket->calls;
      bucket->bytes += a.bytes;
      bucket->busy_ns += ns;
    }
    (to_device ? h2d : d2h).push_back({a.start, a.end});
  }
  MergeIntervals(h2d);
  MergeIntervals(d2h);
  summary.h2d.active_ns = Length(h2d);
  summary.d2h.active_ns = Length(d2h);
  summary.duplex_ns = Overlap(h2d, d2h);
}

}  // namespace

TraceStepSummary CuptiTracer::EndStep() {
  TraceStepSummary summary;
  if (!enabled_) return summary;
  Impl& s = *impl_;
  CTXPLAN_CHECK(s.in_step, "CUPTI tracer: EndStep without BeginStep");
  CTXPLAN_CHECK(s.open.empty(), "CUPTI tracer: EndStep with " + std::to_string(s.open.size()) +
                                    " op(s) pushed and not popped");
  s.in_step = false;

  CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
  const uint64_t step_end = Timestamp();
  CTXPLAN_CUPTI_CHECK(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));

  Collected c;
  std::vector<std::string> kernel_names;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    std::swap(c, s.collected);
    kernel_names = s.names;
  }
  if (!c.error.empty()) throw CuptiError("CUPTI activity buffer: " + c.error, CUPTI_ERROR_UNKNOWN);

  // Correlation id -> plan op id.
  std::unordered_map<uint32_t, uint64_t> ext;
  ext.reserve(c.external.size());
  for (const auto& [correlation, op] : c.external) ext[correlation] = op;

  // The step's ops, sorted by id; an op pushed twice is one op spanning both.
  std::vector<Impl::OpSlot> ops = std::move(s.slots);
  s.slots.clear();
  std::stable_sort(ops.begin(), ops.end(),
                   [](const Impl::OpSlot& a, const Impl::OpSlot& b) { return a.id < b.id; });
  size_t unique = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (unique > 0 && ops[unique - 1].id == ops[i].id) {
      ops[unique - 1].cpu_start = std::min(ops[unique - 1].cpu_start, ops[i].cpu_start);
      ops[unique - 1].cpu_end = std::max(ops[unique - 1].cpu_end, ops[i].cpu_end);
      if (!ops[unique - 1].has_op && ops[i].has_op) {
        const uint64_t cpu_start = ops[unique - 1].cpu_start, cpu_end = ops[unique - 1].cpu_end;
        ops[unique - 1] = ops[i];
        ops[unique - 1].cpu_start = cpu_start;
        ops[unique - 1].cpu_end = cpu_end;
      }
    } else {
      ops[unique++] = ops[i];
    }
  }
  ops.resize(unique);
  auto find_op = [&](uint64_t id) -> Impl::OpSlot* {
    auto it = std::lower_bound(ops.begin(), ops.end(), id,
                               [](const Impl::OpSlot& a, uint64_t v) { return a.id < v; });
    return it != ops.end() && it->id == id ? &*it : nullptr;
  };

  std::vector<uint32_t> unattributed_names;  // indices into kernel_names
  for (const GpuActivity& a : c.gpu) {
    switch (a.kind) {
      case GpuKind::kKernel:
        ++summary.kernels;
        break;
      case GpuKind::kMemcpy:
        ++summary.memcpys;
        break;
      case GpuKind::kMemset:
        ++summary.memsets;
        break;
    }
    auto it = ext.find(a.correlation);
    if (it == ext.end() && a.runtime_correlation != 0) it = ext.find(a.runtime_correlation);
    Impl::OpSlot* op = it != ext.end() ? find_op(it->second) : nullptr;
    if (op == nullptr) {
      ++summary.unattributed;
      if (a.kind == GpuKind::kKernel && unattributed_names.size() < kMaxUnattributedNames &&
          std::find(unattributed_names.begin(), unattributed_names.end(), a.detail) ==
              unattributed_names.end())
        unattributed_names.push_back(a.detail);
      continue;
    }
    if (a.start == 0 && a.end == 0) {
      ++summary.untimed;
      continue;
    }
    op->gpu_start = std::min(op->gpu_start, a.start);
    op->gpu_end = std::max(op->gpu_end, a.end);
    ++op->activities;
    if (a.kind == GpuKind::kMemcpy) op->memcpy_ns += a.end - a.start;
    if (a.kind == GpuKind::kMemset) {
      op->memset_ns += a.end - a.start;
      ++op->memsets;
    }
  }
  for (const Impl::OpSlot& op : ops) {
    if (op.activities == 0 || !op.has_op) continue;
    const auto kind = static_cast<OpKind>(op.kind);
    if (kind != OpKind::kCopyH2D && kind != OpKind::kCopyD2H) continue;
    TracedCopyOps& t = summary.copy_ops[kind == OpKind::kCopyH2D ? 0 : 1][op.phase];
    ++t.ops;
    t.span_ns += static_cast<int64_t>(op.gpu_end - op.gpu_start);
    t.memcpy_ns += static_cast<int64_t>(op.memcpy_ns);
    t.memset_ns += static_cast<int64_t>(op.memset_ns);
    t.memsets += op.memsets;
  }

  auto rel = [&](uint64_t t) { return static_cast<int64_t>(t - s.origin); };
  summary.ops.reserve(ops.size());
  for (const Impl::OpSlot& op : ops) {
    OpRecord r;
    r.op_id = op.id;
    if (op.activities > 0) {
      r.start_ns = rel(op.gpu_start);
      r.end_ns = rel(op.gpu_end);
    } else {
      r.start_ns = rel(op.cpu_start);
      r.end_ns = rel(std::max(op.cpu_end, op.cpu_start));
    }
    r.kind = op.kind;
    r.stream = op.stream;
    r.phase = op.phase;
    r.part = op.part;
    r.chunk = op.chunk;
    r.layer = op.layer;
    summary.ops.push_back(r);
  }
  summary.api_calls = c.api_calls;
  summary.driver_api_calls = c.driver_api_calls;
  for (uint32_t name : unattributed_names)
    summary.unattributed_kernels.push_back(kernel_names[name]);
  summary.external_correlations = c.external.size();
  summary.driver_memory_events = c.driver_memory.size();
  summary.memory_events = s.memory.size();
  summary.dropped_records = c.dropped;
  summary.driver_memory_traced = s.driver_memory_unavailable.empty();
  summary.step_start_ns = rel(s.step_start);
  summary.step_end_ns = rel(step_end);
  AddCopies(c.gpu, summary);

  std::stable_sort(
      s.memory.begin(), s.memory.end(),
      [](const Impl::MemoryEvent& a, const Impl::MemoryEvent& b) { return a.time < b.time; });
  if (s.compact) {
    for (const OpRecord& r : summary.ops) s.compact->Op(r);
    for (const Impl::MemoryEvent& m : s.memory)
      s.compact->Memory(
          {rel(m.time), static_cast<uint8_t>(m.space), static_cast<uint8_t>(m.category), m.total});
  }
  if (s.chrome) s.WriteChrome(c, kernel_names, ext, ops);
  s.memory.clear();
  return summary;
}

void CuptiTracer::Impl::WriteChrome(const Collected& c,
                                    const std::vector<std::string>& kernel_names,
                                    const std::unordered_map<uint32_t, uint64_t>& ext,
                                    const std::vector<OpSlot>& ops) {
  ChromeTraceWriter& w = *chrome;
  if (!processes_named) {
    processes_named = true;
    w.SetProcessName(kPidStep, "ctxtrain step");
    w.SetProcessSortIndex(kPidStep, kPidStep);
    for (int st = 0; st < kStreamCount; ++st)
      NameTrack(kPidStep, st, std::string(StreamName(static_cast<Stream>(st))));
    w.SetProcessName(kPidGpu, "GPU (CUPTI)");
    w.SetProcessSortIndex(kPidGpu, kPidGpu);
    w.SetProcessName(kPidCpu, "CPU: CUDA API calls (CUPTI)");
    w.SetProcessSortIndex(kPidCpu, kPidCpu);
  }
  auto op_of = [&](uint32_t correlation) -> int64_t {
    const auto it = ext.find(correlation);
    return it == ext.end() ? -1 : static_cast<int64_t>(it->second);
  };
  auto dur = [&](uint64_t start, uint64_t end) {
    return end > start ? static_cast<double>(end - start) / 1e3 : 0.0;
  };

  // Plan ops, measured.
  std::string name;
  for (const OpSlot& op : ops) {
    const bool gpu = op.activities > 0;
    const uint64_t start = gpu ? op.gpu_start : op.cpu_start;
    const uint64_t end = gpu ? op.gpu_end : std::max(op.cpu_end, op.cpu_start);
    if (op.has_op) {
      name.assign(OpKindName(static_cast<OpKind>(op.kind)));
      if (static_cast<OpPart>(op.part) != OpPart::kNone) {
        name += '.';
        name += OpPartName(static_cast<OpPart>(op.part));
      }
    } else {
      name = "op " + std::to_string(op.id);
    }
    w.Complete(kPidStep, op.stream, name,
               op.has_op ? PhaseName(static_cast<Phase>(op.phase)) : std::string_view(), Us(start),
               dur(start, end),
               {{"op_id", static_cast<int64_t>(op.id)},
                {"chunk", op.chunk},
                {"layer", op.layer},
                {"timed_on", gpu ? "gpu" : "cpu"},
                {"activities", static_cast<int64_t>(op.activities)}});
  }

  // GPU activities, one track per CUDA stream.
  for (const GpuActivity& a : c.gpu) {
    if (a.start == 0 && a.end == 0) continue;
    NameTrack(kPidGpu, a.stream, "stream " + std::to_string(a.stream));
    int64_t op = op_of(a.correlation);
    if (op < 0 && a.runtime_correlation != 0) op = op_of(a.runtime_correlation);
    switch (a.kind) {
      case GpuKind::kKernel:
        w.Complete(kPidGpu, a.stream, kernel_names.at(a.detail), "kernel", Us(a.start),
                   dur(a.start, a.end),
                   {{"op_id", op}, {"correlation", a.correlation}, {"device", a.device}});
        break;
      case GpuKind::kMemcpy:
        w.Complete(kPidGpu, a.stream, MemcpyKindName(a.detail), "memcpy", Us(a.start),
                   dur(a.start, a.end),
                   {{"op_id", op},
                    {"correlation", a.correlation},
                    {"bytes", a.bytes},
                    {"device", a.device}});
        break;
      case GpuKind::kMemset:
        w.Complete(kPidGpu, a.stream, "Memset", "memset", Us(a.start), dur(a.start, a.end),
                   {{"op_id", op},
                    {"correlation", a.correlation},
                    {"bytes", a.bytes},
                    {"device", a.device}});
        break;
    }
  }

  // CPU side: runtime and driver API calls, one track per thread.
  for (const ApiCall& call : c.api) {
    NameTrack(kPidCpu, call.thread, "thread " + std::to_string(call.thread));
    w.Complete(kPidCpu, call.thread, ApiName(call),
               call.kind == ApiKind::kRuntime ? "runtime" : "driver", Us(call.start),
               dur(call.start, call.end),
               {{"op_id", op_of(call.correlation)}, {"correlation", call.correlation}});
  }

  // The runtime's own memory events, and the driver's allocations as CUPTI saw them.
  for (const MemoryEvent& m : memory)
    w.Counter(kPidStep, m.space == MemSpace::kGpu ? "arena (GiB)" : "pinned host (GiB)", Us(m.time),
              {{"allocated", static_cast<double>(m.total) / kGiB}});
  for (const DriverMemory& m : c.driver_memory) {
    if (m.allocation) {
      driver_live[m.address] = m.bytes;
      driver_allocated += static_cast<int64_t>(m.bytes);
    } else if (auto it = driver_live.find(m.address); it != driver_live.end()) {
      driver_allocated -= static_cast<int64_t>(it->second);
      driver_live.erase(it);
    }
    w.Counter(kPidGpu, "driver allocations (GiB)", Us(m.time),
              {{"allocated", static_cast<double>(driver_allocated) / kGiB}});
  }
}

TraceMetadata CuptiTracer::DeviceMetadata() {
  TraceMetadata m;
  int device = 0;
  CTXPLAN_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CTXPLAN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int driver = 0, runtime = 0;
  CTXPLAN_CUDA_CHECK(cudaDriverGetVersion(&driver));
  CTXPLAN_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  uint32_t cupti = 0;
  CTXPLAN_CUPTI_CHECK(cuptiGetVersion(&cupti));
  m["gpu"] = prop.name;
  m["gpu_memory_bytes"] = std::to_string(prop.totalGlobalMem);
  m["compute_capability"] = std::to_string(prop.major) + "." + std::to_string(prop.minor);
  m["cuda_driver_version"] = VersionString(driver);
  m["cuda_runtime_version"] = VersionString(runtime);
  m["cupti_api_version"] = std::to_string(cupti);
  return m;
}

}  // namespace ctxplan::gpu
