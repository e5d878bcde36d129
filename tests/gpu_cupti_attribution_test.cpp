// The CUPTI tracer attributes every GPU activity to the plan op that launched it, whatever API
// launched it: our own kernels go through the runtime API (cudaLaunchKernelExC), cuBLASLt's GEMMs
// (nvjet_*) through the driver API (cuLaunchKernelEx) with no runtime call around them. The first
// Qwen2.5-7B trace lost most GEMMs that way (their linear ops showed ~0 time), so this drives the
// linear layers and one of our kernels through the tracer exactly as the runtime does (an
// observer's BeforeOp / AfterOp around each op's launches) and checks each kernel's op in the
// Chrome trace. Every test skips itself without a GPU, or when another tool holds CUPTI.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/cuda/gemm.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ctxplan/kernels/op_kind.h"
#include "ctxplan/runtime/cuda/cupti_check.h"
#include "ctxplan/runtime/cuda/cupti_tracer.h"
#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/traces/chrome_trace_writer.h"
#include "ctxplan/traces/json_reader.h"
#include "support/cupti.h"

namespace ctxplan::gpu {
namespace {

namespace k = kernels::cuda;
using k::bf16;

// Device buffers of one layer's linear layers, Qwen-like proportions at a small size.
struct Layer {
  static constexpr int64_t kTokens = 1024, kHidden = 1024, kQkv = 1536, kInter = 2816;
  bf16* x = nullptr;        // [t][d]
  bf16* w_qkv = nullptr;    // [qkv][d]
  bf16* b_qkv = nullptr;    // [qkv]
  bf16* qkv = nullptr;      // [t][qkv]
  bf16* w_gu = nullptr;     // [2I][d]
  bf16* gate_up = nullptr;  // [t][2I]
  bf16* act = nullptr;      // [t][I]
  bf16* w_down = nullptr;   // [d][I]
  bf16* out = nullptr;      // [t][d]
  bf16* d_act = nullptr;    // [t][I]
  float* g_down = nullptr;  // [d][I]
  float* g_qkv = nullptr;   // [qkv][d]
  float* g_bias = nullptr;  // [qkv]
  std::vector<void*> all;

  template <typename T>
  T* Alloc(int64_t count) {
    void* p = nullptr;
    CTXPLAN_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(count) * sizeof(T)));
    CTXPLAN_CUDA_CHECK(cudaMemset(p, 0, static_cast<size_t>(count) * sizeof(T)));
    all.push_back(p);
    return static_cast<T*>(p);
  }
  Layer() {
    x = Alloc<bf16>(kTokens * kHidden);
    w_qkv = Alloc<bf16>(kQkv * kHidden);
    b_qkv = Alloc<bf16>(kQkv);
    qkv = Alloc<bf16>(kTokens * kQkv);
    w_gu = Alloc<bf16>(2 * kInter * kHidden);
    gate_up = Alloc<bf16>(kTokens * 2 * kInter);
    act = Alloc<bf16>(kTokens * kInter);
    w_down = Alloc<bf16>(kHidden * kInter);
    out = Alloc<bf16>(kTokens * kHidden);
    d_act = Alloc<bf16>(kTokens * kInter);
    g_down = Alloc<float>(kHidden * kInter);
    g_qkv = Alloc<float>(kQkv * kHidden);
    g_bias = Alloc<float>(kQkv);
  }
  ~Layer() {
    for (void* p : all) cudaFree(p);
  }
};

struct PlannedOp {
  Op op;
  bool ours = false;  // one of our kernels (else cuBLASLt's)
};

Op MakeOp(OpId id, OpKind kind, OpPart part) {
  Op op;
  op.id = id;
  op.kind = kind;
  op.part = part;
  op.stream = Stream::kCompute;
  op.phase = Phase::kFill;
  op.chunk = 0;
  op.layer = 0;
  return op;
}

// The ops, in launch order on one stream: the cuBLASLt paths the CUDA backend uses (bias
// epilogue, plain, input gradient, fp32 weight gradient, bias gradient: our column-sum kernels) and
// SwiGLU.
std::vector<PlannedOp> Ops(OpId first) {
  return {{MakeOp(first + 0, OpKind::kLinearForward, OpPart::kQkv), false},
          {MakeOp(first + 1, OpKind::kLinearForward, OpPart::kGateUp), false},
          {MakeOp(first + 2, OpKind::kSwigluForward, OpPart::kNone), true},
          {MakeOp(first + 3, OpKind::kLinearForward, OpPart::kDown), false},
          {MakeOp(first + 4, OpKind::kLinearBackwardInput, OpPart::kDown), false},
          {MakeOp(first + 5, OpKind::kLinearBackwardWeight, OpPart::kDown), false},
          {MakeOp(first + 6, OpKind::kLinearBackwardWeight, OpPart::kQkv), false}};
}

void Launch(const Op& op, k::CublasLtGemm& gemm, Layer& l, cudaStream_t stream) {
  constexpr int64_t t = Layer::kTokens, d = Layer::kHidden, n = Layer::kQkv, i = Layer::kInter;
  switch (op.kind) {
    case OpKind::kLinearForward:
      if (op.part == OpPart::kQkv)
        k::LinearForward(gemm, l.x, l.w_qkv, l.b_qkv, t, n, d, l.qkv, stream);
      if (op.part == OpPart::kGateUp)
        k::LinearForward(gemm, l.x, l.w_gu, nullptr, t, 2 * i, d, l.gate_up, stream);
      if (op.part == OpPart::kDown)
        k::LinearForward(gemm, l.act, l.w_down, nullptr, t, d, i, l.out, stream);
      break;
    case OpKind::kSwigluForward:
      k::SwigluForward(l.gate_up, t, i, l.act, stream);
      break;
    case OpKind::kLinearBackwardInput:
      k::LinearBackwardInput(gemm, l.out, l.w_down, t, d, i, l.d_act, stream);
      break;
    case OpKind::kLinearBackwardWeight:
      if (op.part == OpPart::kDown)
        k::LinearBackwardWeight(gemm, l.act, l.out, t, d, i, l.g_down, static_cast<float*>(nullptr),
                                stream);
      if (op.part == OpPart::kQkv)
        k::LinearBackwardWeight(gemm, l.x, l.qkv, t, n, d, l.g_qkv, l.g_bias, stream);
      break;
    default:
      FAIL() << "unexpected op kind";
  }
}

// One traced step of `ops`, each bracketed as RunStep brackets it (CuptiOpObserver).
TraceStepSummary TracedStep(CuptiTracer& tracer, const std::vector<PlannedOp>& ops,
                            k::CublasLtGemm& gemm, Layer& layer, cudaStream_t stream) {
  CuptiOpObserver observer(tracer);
  tracer.BeginStep();
  for (const PlannedOp& p : ops) {
    observer.BeforeOp(p.op);
    Launch(p.op, gemm, layer, stream);
    observer.AfterOp(p.op);
  }
  return tracer.EndStep();
}

const JsonValue* Member(const JsonValue& object, std::string_view key) {
  for (const auto& [name, value] : object.members)
    if (name == key) return &value;
  return nullptr;
}

int64_t IntMember(const JsonValue& object, std::string_view key) {
  const JsonValue* v = Member(object, key);
  return v != nullptr && v->kind == JsonValue::Kind::kNumber ? std::stoll(v->text) : -2;
}

std::string StringMember(const JsonValue& object, std::string_view key) {
  const JsonValue* v = Member(object, key);
  return v != nullptr && v->kind == JsonValue::Kind::kString ? v->text : std::string();
}

struct ChromeEvent {
  int64_t pid = 0;
  std::string name, category;
  double ts = 0;
  int64_t op_id = -2;  // -1: mapped to no op; -2: no op_id argument
  std::string timed_on;
  int64_t activities = -1;
};

std::vector<ChromeEvent> CompleteEvents(const std::string& json) {
  const JsonValue doc = JsonParser(json, "CUPTI tracer Chrome trace", 0).ParseDocument();
  const JsonValue* events = Member(doc, "traceEvents");
  EXPECT_TRUE(events != nullptr && events->kind == JsonValue::Kind::kArray);
  std::vector<ChromeEvent> out;
  if (events == nullptr) return out;
  for (const JsonValue& e : events->items) {
    if (StringMember(e, "ph") != "X") continue;
    ChromeEvent c;
    c.pid = IntMember(e, "pid");
    c.name = StringMember(e, "name");
    c.category = StringMember(e, "cat");
    if (const JsonValue* ts = Member(e, "ts")) c.ts = std::stod(ts->text);
    if (const JsonValue* args = Member(e, "args")) {
      c.op_id = IntMember(*args, "op_id");
      c.timed_on = StringMember(*args, "timed_on");
      c.activities = IntMember(*args, "activities");
    }
    out.push_back(std::move(c));
  }
  return out;
}

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += "\n  " + n;
  return out;
}

// The step's summary and Chrome events (pid 1: ops, 2: GPU activities, 3: API calls) agree with
// `ops`: every kernel on an op, the right one, and every op timed on the GPU for > 0 ns.
void CheckAttribution(const TraceStepSummary& s, const std::vector<ChromeEvent>& events,
                      const std::vector<PlannedOp>& ops) {
  std::printf(
      "step: %zu ops, %llu kernels, %llu API calls (%llu driver), %llu external correlations, "
      "%llu unattributed, %llu dropped\n",
      s.ops.size(), (unsigned long long)s.kernels, (unsigned long long)s.api_calls,
      (unsigned long long)s.driver_api_calls, (unsigned long long)s.external_correlations,
      (unsigned long long)s.unattributed, (unsigned long long)s.dropped_records);
  EXPECT_EQ(s.unattributed, 0u) << "kernels mapped to no op:" << Join(s.unattributed_kernels);
  EXPECT_TRUE(s.unattributed_kernels.empty());
  EXPECT_EQ(s.dropped_records, 0u);
  EXPECT_EQ(s.untimed, 0u);
  EXPECT_GE(s.kernels, ops.size());

  std::map<OpId, const PlannedOp*> by_id;
  for (const PlannedOp& p : ops) by_id[p.op.id] = &p;

  // Per op: its measured span, from the summary.
  ASSERT_EQ(s.ops.size(), ops.size());
  for (const OpRecord& r : s.ops) {
    ASSERT_TRUE(by_id.contains(r.op_id)) << "op " << r.op_id;
    EXPECT_GT(r.end_ns - r.start_ns, 0) << "op " << r.op_id << " measured no GPU time";
    EXPECT_EQ(r.kind, static_cast<uint8_t>(by_id[r.op_id]->op.kind)) << "op " << r.op_id;
  }

  // Per kernel: its op, and what kind of kernel it is (ours or cuBLASLt's).
  std::map<OpId, int> kernels_of;
  std::vector<std::pair<double, int64_t>> order;  // (start, op) on the one stream
  size_t kernels = 0;
  for (const ChromeEvent& e : events) {
    if (e.pid != 2 || e.category != "kernel") continue;
    ++kernels;
    order.emplace_back(e.ts, e.op_id);
    ASSERT_TRUE(e.op_id >= 0 && by_id.contains(static_cast<OpId>(e.op_id)))
        << "kernel " << e.name << " attributed to op " << e.op_id;
    const PlannedOp& p = *by_id[static_cast<OpId>(e.op_id)];
    const bool swiglu = e.name.find("SwigluForward") != std::string::npos;
    EXPECT_EQ(swiglu, p.ours) << "kernel " << e.name << " attributed to op " << e.op_id << " ("
                              << OpKindName(p.op.kind) << ")";
    ++kernels_of[p.op.id];
    std::printf("  op %lld %-16s <- %.90s\n", (long long)e.op_id,
                std::string(OpKindName(p.op.kind)).c_str(), e.name.c_str());
  }
  EXPECT_EQ(kernels, s.kernels);
  for (const PlannedOp& p : ops) EXPECT_GE(kernels_of[p.op.id], 1) << "op " << p.op.id;
  // One stream, ops launched in id order: kernels start in op order, so a kernel attributed to a
  // neighbour op would show here even where both are cuBLASLt's.
  std::sort(order.begin(), order.end());
  for (size_t i = 1; i < order.size(); ++i)
    EXPECT_LE(order[i - 1].second, order[i].second) << "kernel " << i << " starts out of op order";

  // Per op event: timed on the GPU, from its activities (not the CPU fallback).
  size_t op_events = 0;
  for (const ChromeEvent& e : events) {
    if (e.pid != 1) continue;
    ++op_events;
    EXPECT_EQ(e.timed_on, "gpu") << "op " << e.op_id << " (" << e.name << ")";
    EXPECT_GE(e.activities, 1) << "op " << e.op_id;
  }
  EXPECT_EQ(op_events, ops.size());

  // How the launches were seen (not asserted: which API a library launches through is its own
  // business, attribution above is what must hold).
  std::map<std::string, int> launches;
  for (const ChromeEvent& e : events)
    if (e.pid == 3 && e.op_id >= 0 && e.name.find("aunch") != std::string::npos)
      ++launches[e.category + " " + e.name];
  for (const auto& [name, count] : launches) std::printf("  %d x %s\n", count, name.c_str());
}

TEST(CuptiAttribution, CublasLtAndOwnKernelsMapToTheirOps) {
  SKIP_WITHOUT_CUPTI();
  cudaStream_t stream;
  CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    k::CublasLtGemm gemm;
    Layer layer;
    CuptiTracerOptions options;
    options.enabled = true;
    CuptiTracer tracer(options);
    ASSERT_TRUE(tracer.enabled());

    // Step 1 meets every GEMM shape for the first time (cuBLASLt's heuristic, module loads);
    // step 2 is warm, as the recorded step of a real run is. Both must attribute everything.
    for (int step = 0; step < 2; ++step) {
      SCOPED_TRACE("step " + std::to_string(step + 1));
      std::ostringstream json;
      ChromeTraceWriter chrome(json);
      tracer.SetOutputs(nullptr, &chrome);
      const std::vector<PlannedOp> ops = Ops(100 * (step + 1));
      const TraceStepSummary s = TracedStep(tracer, ops, gemm, layer, stream);
      chrome.Finish();
      tracer.SetOutputs(nullptr, nullptr);
      CheckAttribution(s, CompleteEvents(json.str()), ops);
    }

    // Without a Chrome trace API records are only counted, never kept: attribution is the same.
    const std::vector<PlannedOp> ops = Ops(300);
    const TraceStepSummary s = TracedStep(tracer, ops, gemm, layer, stream);
    EXPECT_EQ(s.unattributed, 0u) << Join(s.unattributed_kernels);
    ASSERT_EQ(s.ops.size(), ops.size());
    for (const OpRecord& r : s.ops) EXPECT_GT(r.end_ns - r.start_ns, 0) << "op " << r.op_id;
  }
  CTXPLAN_CUDA_CHECK(cudaStreamDestroy(stream));
}

// Work launched outside any op is counted and named, not pinned on a neighbour.
TEST(CuptiAttribution, WorkOutsideOpsIsUnattributedAndNamed) {
  SKIP_WITHOUT_CUPTI();
  cudaStream_t stream;
  CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    k::CublasLtGemm gemm;
    Layer layer;
    CuptiTracerOptions options;
    options.enabled = true;
    CuptiTracer tracer(options);
    const std::vector<PlannedOp> ops = Ops(1);
    CuptiOpObserver observer(tracer);
    tracer.BeginStep();
    observer.BeforeOp(ops[0].op);
    Launch(ops[0].op, gemm, layer, stream);
    observer.AfterOp(ops[0].op);
    Launch(ops[1].op, gemm, layer, stream);  // a GEMM outside any op
    Launch(ops[2].op, gemm, layer, stream);  // and one of ours
    const TraceStepSummary s = tracer.EndStep();
    std::printf("unattributed: %llu%s\n", (unsigned long long)s.unattributed,
                Join(s.unattributed_kernels).c_str());
    EXPECT_GE(s.unattributed, 2u);
    EXPECT_TRUE(
        std::any_of(s.unattributed_kernels.begin(), s.unattributed_kernels.end(),
                    [](const std::string& n) { return n.find("SwigluForward") != n.npos; }));
    ASSERT_EQ(s.ops.size(), 1u);
    EXPECT_GT(s.ops[0].end_ns - s.ops[0].start_ns, 0);
  }
  CTXPLAN_CUDA_CHECK(cudaStreamDestroy(stream));
}

// The step's copy statistics: pinned copies of known sizes inside a copy_h2d op (and a memset
// with them) and outside any op land in their size buckets, with their bytes and busy time, and
// the op's span holds its copies' busy time.
TEST(CuptiAttribution, CopiesAreCountedBySizeAndOp) {
  SKIP_WITHOUT_CUPTI();
  cudaStream_t stream;
  CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::vector<size_t> h2d_sizes = {size_t{16} << 10, size_t{200} << 10, size_t{3} << 20,
                                         size_t{8} << 20};
  const size_t d2h_bytes = size_t{128} << 10;
  const size_t largest = size_t{8} << 20;
  void* host = nullptr;
  void* device = nullptr;
  CTXPLAN_CUDA_CHECK(cudaHostAlloc(&host, largest, cudaHostAllocDefault));
  CTXPLAN_CUDA_CHECK(cudaMalloc(&device, largest));
  {
    CuptiTracerOptions options;
    options.enabled = true;
    CuptiTracer tracer(options);
    Op copy_in{};
    copy_in.id = 7;
    copy_in.kind = OpKind::kCopyH2D;
    copy_in.stream = Stream::kH2D;
    copy_in.phase = Phase::kBackward;
    CuptiOpObserver observer(tracer);
    tracer.BeginStep();
    observer.BeforeOp(copy_in);
    CTXPLAN_CUDA_CHECK(cudaMemsetAsync(device, 0, 4096, stream));
    for (const size_t bytes : h2d_sizes)
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream));
    observer.AfterOp(copy_in);
    for (int i = 0; i < 2; ++i)  // outside any op: counted by direction, not by op
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(host, device, d2h_bytes, cudaMemcpyDeviceToHost, stream));
    const TraceStepSummary s = tracer.EndStep();

    EXPECT_EQ(s.h2d.all.calls, h2d_sizes.size());
    size_t h2d_total = 0;
    for (const size_t bytes : h2d_sizes) h2d_total += bytes;
    EXPECT_EQ(s.h2d.all.bytes, h2d_total);
    // 16 KiB, 200 KiB, 3 MiB and 8 MiB: buckets <= 64 KiB, <= 256 KiB, <= 4 MiB, larger.
    const std::array<uint64_t, 5> h2d_calls = {1, 1, 0, 1, 1};
    for (size_t b = 0; b < h2d_calls.size(); ++b)
      EXPECT_EQ(s.h2d.by_size[b].calls, h2d_calls[b]) << "bucket " << b;
    EXPECT_EQ(s.h2d.by_size[4].bytes, size_t{8} << 20);
    EXPECT_EQ(s.d2h.all.calls, 2u);
    EXPECT_EQ(s.d2h.by_size[1].calls, 2u);
    EXPECT_EQ(s.d2h.all.bytes, 2 * d2h_bytes);
    // One stream: nothing ran at once, and the active time is the busy time.
    EXPECT_GT(s.h2d.all.busy_ns, 0);
    EXPECT_EQ(s.h2d.active_ns, s.h2d.all.busy_ns);
    EXPECT_EQ(s.duplex_ns, 0);
    // 8 MiB over PCIe takes at least 100 us (no link here moves 84 GB/s one way).
    EXPECT_GT(s.h2d.by_size[4].busy_ns, 100000);

    const TracedCopyOps& op = s.copy_ops[0][static_cast<size_t>(Phase::kBackward)];
    EXPECT_EQ(op.ops, 1u);
    EXPECT_EQ(op.memsets, 1u);
    EXPECT_EQ(op.memcpy_ns, s.h2d.all.busy_ns);
    EXPECT_GE(op.span_ns, op.memcpy_ns + op.memset_ns);
    EXPECT_EQ(s.copy_ops[1][static_cast<size_t>(Phase::kBackward)].ops, 0u);
    std::printf("H2D %llu copies busy %.1f us, op span %.1f us; D2H busy %.1f us\n",
                (unsigned long long)s.h2d.all.calls, s.h2d.all.busy_ns * 1e-3, op.span_ns * 1e-3,
                s.d2h.all.busy_ns * 1e-3);
  }
  CTXPLAN_CUDA_CHECK(cudaFree(device));
  CTXPLAN_CUDA_CHECK(cudaFreeHost(host));
  CTXPLAN_CUDA_CHECK(cudaStreamDestroy(stream));
}

// Tracing off costs nothing: a disabled tracer makes no CUPTI or CUDA call at all, so it runs
// even without a GPU (where any CUDA call would fail and throw), and its step is empty.
TEST(CuptiAttribution, DisabledTracerMakesNoCall) {
  CuptiTracer tracer(CuptiTracerOptions{});
  EXPECT_FALSE(tracer.enabled());
  tracer.BeginStep();
  tracer.PushOp(1);
  tracer.PopOp();
  const TraceStepSummary s = tracer.EndStep();
  EXPECT_TRUE(s.ops.empty());
  EXPECT_EQ(s.kernels, 0u);
  EXPECT_EQ(s.api_calls, 0u);
  EXPECT_EQ(tracer.NowNs(), 0);
}

}  // namespace
}  // namespace ctxplan::gpu
