#include "ctxplan/sim/analytic_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/lora.h"
#include "ctxplan/runtime/plan/step_plan.h"

namespace ctxplan::sim {

namespace {

// --- memory ----------------------------------------------------------------------------------

struct MemoryState {
  CategoryBytes bytes{};
  CategoryBytes reserved{};  // floors, as MemoryTracker::Reserve
  CategoryBytes Counted() const {
    CategoryBytes counted{};
    for (size_t c = 0; c < bytes.size(); ++c) counted[c] = std::max(bytes[c], reserved[c]);
    return counted;
  }
  int64_t Total() const {
    int64_t total = 0;
    for (int64_t b : Counted()) total += b;
    return total;
  }
  int64_t& operator[](MemCategory c) { return bytes[static_cast<size_t>(c)]; }
};

void Observe(MemoryPeak& peak, const MemoryState& state) {
  const int64_t total = state.Total();
  if (total > peak.peak_bytes) {
    peak.peak_bytes = total;
    peak.at_peak = state.Counted();
  }
}

// --- time ------------------------------------------------------------------------------------

// Durations of one layer's segments (the ops between two points where streams wait for each
// other), summed op by op exactly as the event path times them.
struct Segment {
  Tick ticks = 0;
  double flops = 0.0;
  StepEnergy energy;  // energy.clock_bound_seconds: the part of `ticks` at the SM clock

  // This segment with its clock-bound part `slower` times longer (a lower clock).
  void Slow(double slower) {
    if (slower == 1.0) return;
    ticks += SecondsToTicks(energy.clock_bound_seconds * (slower - 1));
    energy.clock_bound_seconds *= slower;
  }
};

class SegmentBuilder {
 public:
  SegmentBuilder(const KernelTimeModel& model, Phase phase) : model_(model), phase_(phase) {}
  SegmentBuilder& operator()(Segment& segment, const OpCost& cost) {
    const KernelTimeModel::OpTime t = model_.Time(cost, phase_);
    segment.ticks += SecondsToTicks(t.seconds);
    segment.flops += cost.flops;
    segment.energy += t.energy;
    return *this;
  }

 private:
  const KernelTimeModel& model_;
  Phase phase_;
};

struct ForwardLayer {
  Segment pre, kv_write, summary, select, attn_own, attn_paged, post;
  Tick h2d = 0, d2h = 0;
  double h2d_bytes = 0, d2h_bytes = 0;
  bool paged = false, copy_in = false, copy_out = false, sparse = false, fill = false;

  void Slow(double slower) {
    for (Segment* s : {&pre, &kv_write, &summary, &select, &attn_own, &attn_paged, &post})
      s->Slow(slower);
  }
};

struct BackwardLayer {
  Segment zero, before_attention, attn_own, attn_paged, dkv_accumulate, after;
  Tick h2d = 0, d2h = 0;
  double h2d_bytes = 0, d2h_bytes = 0;
  bool paged = false, copy_in = false, copy_out = false, own_dkv = false;

  void Slow(double slower) {
    for (Segment* s : {&zero, &before_attention, &attn_own, &attn_paged, &dkv_accumulate, &after})
      s->Slow(slower);
  }
};

// The state the max-plus recurrence carries from layer to layer: when each stream is next free,
// and when each slot buffer is released.
struct StreamClock {
  static constexpr int kTerms = 7;
  // compute, h2d, d2h, slot release 0/1, own-page release 0/1
  std::array<Tick, kTerms> t{};
  uint64_t slot_uses = 0;
  uint64_t own_uses = 0;

  Tick& compute() { return t[0]; }
  Tick& h2d() { return t[1]; }
  Tick& d2h() { return t[2]; }
  Tick& slot_release(int parity) { return t[3 + parity]; }
  Tick& own_release(int parity) { return t[5 + parity]; }
};

class TimeRecurrence {
 public:
  TimeRecurrence(const PlanGeometry& geometry, const KernelTimeModel& model, StepPrediction& result,
                 int32_t stage)
      : g_(geometry),
        m_(geometry.model()),
        o_(geometry.options()),
        model_(model),
        result_(result),
        stage_(stage),
        layers_(geometry.stage_layers(stage)) {}

  // The compute stream waits for an input that arrives at `when` (a stage boundary).
  void WaitUntil(Tick when) { clock_.compute() = std::max(clock_.compute(), when); }
  Tick ComputeEnd() { return clock_.compute(); }

  ForwardLayer Forward(const ChunkGeometry& c, Phase phase) const {
    const int64_t t = c.tokens, d = m_.hidden_size, q = m_.q_dim(), kv = m_.kv_dim();
    const int64_t inter = m_.intermediate_size, r = o_.lora_rank;
    SegmentBuilder add(model_, phase);
    ForwardLayer f;
    f.fill = phase == Phase::kFill && g_.writes_pages(c.index);
    f.paged = c.earlier_pages > 0;
    // With offload, what the host tier holds crosses PCIe (the GPU tier's pages stay).
    f.copy_in = o_.offload && c.host_union_pages > 0;
    f.copy_out = f.fill && o_.offload && c.own_host_pages > 0;
    f.sparse = c.sparse;
    // The projections, norms, MLP, the KV write and the own positions' attention depend on the
    // chunk's tokens alone (the latter also on whether it runs inside the paged launch): timed
    // once per size.
    TokenSegments& k = forward_cache_;
    if (t != k.tokens || f.paged != k.paged) {
      k = TokenSegments{};
      k.tokens = t;
      k.paged = f.paged;
      // The ops that follow their input's producer as step_plan.cpp marks them (Warm).
      add(k.pre, WarmInput(RmsNormForwardCost(t, d)))(
          k.pre, LinearForwardCost(t, q + 2 * kv, d, LoraOn(OpPart::kQkv, r), true))(
          k.pre, WarmInput(RopeCost(t, q, kv)));
      add(k.kv_write, KvWriteCost(t, kv));
      add(k.summary, PageSummaryCost(c.own_pages, o_.page_tokens, kv));
      add(k.attn_own, g_.own_attention_forward_cost(c));
      add(k.post, LinearForwardCost(t, d, q, LoraOn(OpPart::kO, r)))(
          k.post, WarmInput(RmsNormForwardCost(t, d)))(
          k.post, LinearForwardCost(t, 2 * inter, d, LoraOn(OpPart::kGateUp, r)))(
          k.post, SwigluForwardCost(t, inter))(
          k.post, LinearForwardCost(t, d, inter, LoraOn(OpPart::kDown, r)));
    }
    f.pre = k.pre;
    if (f.fill) {
      f.kv_write = k.kv_write;
      f.summary = k.summary;
    }
    if (c.sparse) {
      add(f.select, PageScoreCost(t, o_.query_tile, c.earlier_pages, q, kv))(
          f.select, PageTopKCost(c.tiles, c.earlier_pages, c.pages_per_tile));
    }
    f.attn_own = k.attn_own;
    if (f.paged) add(f.attn_paged, g_.paged_attention_forward_cost(c));
    f.post = k.post;
    if (f.copy_in) {
      const OpCost copy = CopyCost(c.expected_host_union_pages * g_.kv_page_bytes(), true,
                                   g_.union_copy_runs(c, c.expected_host_union_pages));
      f.h2d = model_.Duration(copy, phase);
      f.h2d_bytes = copy.bytes;
    }
    if (f.copy_out) {
      const OpCost copy = CopyCost(c.own_host_pages * g_.kv_page_bytes(), false);
      f.d2h = model_.Duration(copy, phase);
      f.d2h_bytes = copy.bytes;
    }
    return f;
  }

  BackwardLayer Backward(const ChunkGeometry& c, const DkvState& dkv) const {
    const int64_t t = c.tokens, d = m_.hidden_size, q = m_.q_dim(), kv = m_.kv_dim();
    const int64_t inter = m_.intermediate_size, r = o_.lora_rank, gb = o_.grad_bytes();
    SegmentBuilder add(model_, Phase::kBackward);
    BackwardLayer b;
    b.paged = c.earlier_pages > 0;
    b.own_dkv = dkv.own_touched > 0;
    const int64_t pretouched = dkv.pretouched_host_union, own_touched = dkv.own_touched_host;
    b.copy_in = o_.offload && c.host_union_pages + pretouched + own_touched > 0;
    b.copy_out = o_.offload && c.host_union_pages > 0;
    const int64_t fresh_pages = c.union_pages - dkv.pretouched_union;
    if (b.paged && fresh_pages > 0) add(b.zero, ZeroFillCost(fresh_pages * g_.dkv_page_bytes()));
    auto linear = [&](Segment& s, int64_t out, int64_t in, OpPart part) {
      add(s, LinearBackwardInputCost(t, out, in, LoraOn(part, r), part == OpPart::kQkv))(
          s, LinearBackwardWeightCost(t, out, in, LoraOn(part, r), gb));
    };
    // The layer's recomputed forward and its MLP and output projection's backward, the input
    // projections' backward after attention, the own positions' attention and the dKV they add
    // depend on the chunk's tokens alone (and whether it has earlier pages): timed once per size.
    TokenSegments& k = backward_cache_;
    if (t != k.tokens || b.paged != k.paged) {
      k = TokenSegments{};
      k.tokens = t;
      k.paged = b.paged;
      Segment& pre = k.pre;
      add(pre, RmsNormForwardCost(t, d))(
          pre, LinearForwardCost(t, q + 2 * kv, d, LoraOn(OpPart::kQkv, r), true))(
          pre, WarmInput(RopeCost(t, q, kv)))(pre,
                                              LinearForwardCost(t, d, q, LoraOn(OpPart::kO, r)))(
          pre, WarmInput(RmsNormForwardCost(t, d)))(
          pre, LinearForwardCost(t, 2 * inter, d, LoraOn(OpPart::kGateUp, r)))(
          pre, SwigluForwardCost(t, inter));
      linear(pre, d, inter, OpPart::kDown);
      add(pre, SwigluBackwardCost(t, inter));
      linear(pre, 2 * inter, d, OpPart::kGateUp);
      add(pre, RmsNormBackwardCost(t, d));
      linear(pre, d, q, OpPart::kO);
      add(k.post, WarmInput(RopeCost(t, q, kv)));
      linear(k.post, q + 2 * kv, d, OpPart::kQkv);
      add(k.post, RmsNormBackwardCost(t, d));
      add(k.attn_own, g_.own_attention_backward_cost(c));
      add(k.dkv_accumulate, DkvAccumulateCost(t, kv, gb));
    }
    b.before_attention = k.pre;
    b.after = k.post;
    b.attn_own = k.attn_own;
    if (b.own_dkv) b.dkv_accumulate = k.dkv_accumulate;
    if (b.paged) add(b.attn_paged, g_.paged_attention_backward_cost(c));
    if (b.copy_in) {
      const int64_t expected_pretouched = dkv.expected_pretouched_host_union;
      const OpCost copy =
          CopyCost(c.expected_host_union_pages * g_.kv_page_bytes() +
                       (expected_pretouched + own_touched) * g_.dkv_page_bytes(),
                   true,
                   g_.union_copy_runs(c, c.expected_host_union_pages) +
                       g_.union_copy_runs(c, expected_pretouched) + (own_touched > 0 ? 1 : 0));
      b.h2d = model_.Duration(copy, Phase::kBackward);
      b.h2d_bytes = copy.bytes;
    }
    if (b.copy_out) {
      const OpCost copy = CopyCost(c.expected_host_union_pages * g_.dkv_page_bytes(), false,
                                   g_.union_copy_runs(c, c.expected_host_union_pages));
      b.d2h = model_.Duration(copy, Phase::kBackward);
      b.d2h_bytes = copy.bytes;
    }
    return b;
  }

  void Kernel(const OpCost& cost, Phase phase) { Add(model_.Time(cost, phase), cost.flops); }

  // The ops outside the layers (embedding, final norm, loss) depend on a chunk's tokens alone:
  // timed once per size and phase. cost_of() gives the op's cost.
  enum class Outside { kEmbedding, kFinalNorm, kLoss, kFinalNormBackward, kEmbeddingBackward };
  template <typename CostOf>
  void KernelOutside(Outside which, int64_t tokens, Phase phase, CostOf cost_of) {
    OutsideTime& memo = outside_[static_cast<size_t>(which)];
    if (memo.tokens != tokens || memo.phase != phase) {
      const OpCost cost = cost_of();
      memo = {tokens, phase, model_.Time(cost, phase), cost.flops};
    }
    Add(memo.time, memo.flops);
  }

  // Runs the layers of one forward pass over a chunk.
  void RunForward(const ForwardLayer& f) {
    RunLayers([&] { ForwardStep(f); }, ActiveTerms(f.copy_in, f.copy_out));
    const int64_t layers = layers_;
    const Tick compute = f.pre.ticks + f.kv_write.ticks + f.summary.ticks + f.select.ticks +
                         f.attn_own.ticks + f.attn_paged.ticks + f.post.ticks;
    result_.busy_ticks[static_cast<size_t>(Stream::kCompute)] += layers * compute;
    result_.busy_ticks[static_cast<size_t>(Stream::kH2D)] += layers * f.h2d;
    result_.busy_ticks[static_cast<size_t>(Stream::kD2H)] += layers * f.d2h;
    result_.flops += static_cast<double>(layers) *
                     (f.pre.flops + f.kv_write.flops + f.summary.flops + f.select.flops +
                      f.attn_own.flops + f.attn_paged.flops + f.post.flops);
    StepEnergy energy = f.pre.energy;
    for (const Segment* s :
         {&f.kv_write, &f.summary, &f.select, &f.attn_own, &f.attn_paged, &f.post})
      energy += s->energy;
    result_.energy += energy.Times(static_cast<double>(layers));
    result_.h2d_bytes += static_cast<double>(layers) * f.h2d_bytes;
    result_.d2h_bytes += static_cast<double>(layers) * f.d2h_bytes;
  }

  void RunBackward(const BackwardLayer& b) {
    RunLayers([&] { BackwardStep(b); }, ActiveTerms(b.copy_in, false));
    const int64_t layers = layers_;
    const Tick compute = b.zero.ticks + b.before_attention.ticks + b.attn_own.ticks +
                         b.attn_paged.ticks + b.dkv_accumulate.ticks + b.after.ticks;
    result_.busy_ticks[static_cast<size_t>(Stream::kCompute)] += layers * compute;
    result_.busy_ticks[static_cast<size_t>(Stream::kH2D)] += layers * b.h2d;
    result_.busy_ticks[static_cast<size_t>(Stream::kD2H)] += layers * b.d2h;
    result_.flops +=
        static_cast<double>(layers) * (b.zero.flops + b.before_attention.flops + b.attn_own.flops +
                                       b.attn_paged.flops + b.dkv_accumulate.flops + b.after.flops);
    StepEnergy energy = b.zero.energy;
    for (const Segment* s :
         {&b.before_attention, &b.attn_own, &b.attn_paged, &b.dkv_accumulate, &b.after})
      energy += s->energy;
    result_.energy += energy.Times(static_cast<double>(layers));
    result_.h2d_bytes += static_cast<double>(layers) * b.h2d_bytes;
    result_.d2h_bytes += static_cast<double>(layers) * b.d2h_bytes;
  }

  void Optimizer() {
    const int64_t params = g_.trainable_params(stage_);
    switch (o_.optimizer) {
      case OptimizerKind::kNone:
        return;
      case OptimizerKind::kAdamWGpu:
        Kernel(AdamWCost(params, kBf16Bytes, o_.grad_bytes(), false), Phase::kOptimizer);
        return;
      case OptimizerKind::kAdamWHost: {
        const OpCost d2h = CopyCost(g_.grad_bytes(stage_), false);
        const OpCost update = AdamWCost(params, kBf16Bytes, o_.grad_bytes(), true);
        const OpCost h2d = CopyCost(params * kBf16Bytes, true);
        const Tick d2h_ticks = model_.Duration(d2h, Phase::kOptimizer);
        const Tick update_ticks = model_.Duration(update, Phase::kOptimizer);
        const Tick h2d_ticks = model_.Duration(h2d, Phase::kOptimizer);
        clock_.d2h() = std::max(clock_.d2h(), clock_.compute()) + d2h_ticks;
        host_ = std::max(host_, clock_.d2h()) + update_ticks;
        clock_.h2d() = std::max(clock_.h2d(), host_) + h2d_ticks;
        result_.gpu_idle_tail_ticks = End() - clock_.compute();
        result_.busy_ticks[static_cast<size_t>(Stream::kD2H)] += d2h_ticks;
        result_.busy_ticks[static_cast<size_t>(Stream::kHost)] += update_ticks;
        result_.busy_ticks[static_cast<size_t>(Stream::kH2D)] += h2d_ticks;
        result_.flops += update.flops;
        result_.d2h_bytes += d2h.bytes;
        result_.h2d_bytes += h2d.bytes;
        return;
      }
    }
  }

  Tick End() { return std::max({clock_.compute(), clock_.h2d(), clock_.d2h(), host_}); }

 private:
  // Which terms of the clock a pass reads or writes; the others must not take part in the
  // steady-state test.
  std::array<bool, StreamClock::kTerms> ActiveTerms(bool copy_in, bool copy_out) const {
    return {true, copy_in, copy_out, copy_in, copy_in, copy_out, copy_out};
  }

  // Steps `layers` times; once the clock after two layers is the clock before them shifted
  // uniformly on its active terms (and the parities are back), the remainder is extrapolated.
  template <typename Step>
  void RunLayers(Step step, const std::array<bool, StreamClock::kTerms>& active) {
    const int64_t layers = layers_;
    int64_t done = 0;
    StreamClock two_back;
    Tick last_shift = -1;
    while (done < layers) {
      if (done >= 2 && (layers - done) >= 2 && (done % 2) == 0) {
        Tick shift = -1;
        bool uniform = true;
        for (int i = 0; i < StreamClock::kTerms && uniform; ++i) {
          if (!active[i]) continue;
          const Tick delta = clock_.t[i] - two_back.t[i];
          if (shift < 0) shift = delta;
          uniform = delta == shift;
        }
        if (uniform && shift == last_shift) {
          const int64_t pairs = (layers - done) / 2;
          for (int i = 0; i < StreamClock::kTerms; ++i)
            if (active[i]) clock_.t[i] += pairs * shift;
          // An even number of layers leaves both buffer parities as they are.
          done += 2 * pairs;
          continue;
        }
        last_shift = uniform ? shift : -1;
      }
      if (done % 2 == 0) two_back = clock_;
      step();
      ++done;
    }
  }

  void ForwardStep(const ForwardLayer& f) {
    StreamClock& k = clock_;
    const int parity = static_cast<int>(k.slot_uses++ & 1);
    Tick h2d_end = 0;
    if (f.copy_in && !f.sparse) {
      k.h2d() = std::max(k.h2d(), k.slot_release(parity)) + f.h2d;
      h2d_end = k.h2d();
    }
    k.compute() += f.pre.ticks;
    Tick kv_write_end = 0;
    int own_parity = 0;
    if (f.fill) {
      own_parity = static_cast<int>(k.own_uses++ & 1);
      if (f.copy_out) k.compute() = std::max(k.compute(), k.own_release(own_parity));
      k.compute() += f.kv_write.ticks;
      kv_write_end = k.compute();
      k.compute() += f.summary.ticks;
    }
    if (f.sparse) {
      k.compute() += f.select.ticks;
      if (f.copy_in) {
        k.h2d() = std::max({k.h2d(), k.compute(), k.slot_release(parity)}) + f.h2d;
        h2d_end = k.h2d();
      }
    }
    // Over earlier pages the own positions run inside the paged launch, after the copy.
    if (f.paged && f.copy_in) k.compute() = std::max(k.compute(), h2d_end);
    k.compute() += f.attn_own.ticks;
    if (f.paged) {
      k.compute() += f.attn_paged.ticks;
      if (f.copy_in) k.slot_release(parity) = k.compute();
    }
    k.compute() += f.post.ticks;
    if (f.copy_out) {
      k.d2h() = std::max(k.d2h(), kv_write_end) + f.d2h;
      k.own_release(own_parity) = k.d2h();
    }
  }

  void BackwardStep(const BackwardLayer& b) {
    StreamClock& k = clock_;
    const int parity = static_cast<int>(k.slot_uses++ & 1);
    Tick h2d_end = 0;
    if (b.copy_in) {
      k.h2d() = std::max(k.h2d(), k.slot_release(parity)) + b.h2d;
      h2d_end = k.h2d();
    }
    k.compute() += b.zero.ticks + b.before_attention.ticks;
    // The own positions' attention runs inside the paged launch (after the copy), or alone
    // adding the own pages' dKV (after the copy too).
    if (b.copy_in && (b.paged || b.own_dkv)) k.compute() = std::max(k.compute(), h2d_end);
    k.compute() += b.attn_own.ticks;
    Tick release = -1;
    if (b.paged) {
      k.compute() += b.attn_paged.ticks;
      release = k.compute();
    }
    if (b.own_dkv) {
      k.compute() += b.dkv_accumulate.ticks;
      if (!b.paged) release = k.compute();
    }
    k.compute() += b.after.ticks;
    if (b.copy_out) {
      k.d2h() = std::max(k.d2h(), release) + b.d2h;
      release = k.d2h();
    }
    if (o_.offload && release >= 0) k.slot_release(parity) = release;
  }

  void Add(const KernelTimeModel::OpTime& t, double flops) {
    const Tick ticks = SecondsToTicks(t.seconds);
    clock_.compute() += ticks;
    result_.busy_ticks[static_cast<size_t>(Stream::kCompute)] += ticks;
    result_.flops += flops;
    result_.energy += t.energy;
  }

  const PlanGeometry& g_;
  const ModelSpec& m_;
  const RunOptions& o_;
  const KernelTimeModel& model_;
  StepPrediction& result_;
  int32_t stage_;
  int64_t layers_;  // the stage's
  StreamClock clock_;
  Tick host_ = 0;
  // Segments that depend on a chunk's token count alone (and whether it has earlier pages), for
  // the last count timed; kv_write and summary are the forward's, dkv_accumulate the backward's.
  struct TokenSegments {
    int64_t tokens = -1;
    bool paged = false;
    Segment pre, post, kv_write, summary, attn_own, dkv_accumulate;
  };
  mutable TokenSegments forward_cache_, backward_cache_;
  struct OutsideTime {
    int64_t tokens = -1;
    Phase phase = Phase::kFill;
    KernelTimeModel::OpTime time;
    double flops = 0;
  };
  std::array<OutsideTime, 5> outside_;  // by Outside
};

}  // namespace

// The layers one pass over the chunks built at the maximum clock, kept so that the pass at the
// sustained clock slows them instead of timing every op again.
struct LayerCache {
  // By chunk: every pipeline stage runs the same layers on a chunk.
  std::vector<ForwardLayer> fill, recompute;
  std::vector<BackwardLayer> backward;
  std::vector<bool> fill_built, recompute_built, backward_built;
};

namespace {

// One pipeline stage's GPU and host memory over the step (the whole model with one GPU).
MemoryPrediction StageMemory(const PlanGeometry& g, int32_t stage) {
  const RunOptions& o = g.options();
  const int64_t layers = g.stage_layers(stage);
  const int32_t chunks = g.num_chunks();
  MemoryPrediction p;

  MemoryState gpu, host;
  gpu[MemCategory::kWeights] = g.weight_bytes(stage);
  gpu[MemCategory::kGrads] = g.grad_bytes(stage);
  if (o.optimizer == OptimizerKind::kAdamWGpu)
    gpu[MemCategory::kOptimizer] = g.optimizer_state_bytes(stage);
  gpu[MemCategory::kActivations] = g.activation_bytes() + g.boundary_buffer_bytes(stage);
  gpu[MemCategory::kWorkspace] = g.workspace_bytes();
  gpu[MemCategory::kPageSlots] = g.page_slot_bytes();
  if (o.optimizer == OptimizerKind::kAdamWHost) {
    host[MemCategory::kOptimizer] = g.host_optimizer_bytes(stage);
    host[MemCategory::kGradStaging] = g.grad_bytes(stage);
  }
  MemoryState& kv_space = o.offload ? host : gpu;
  // The host page stores the runtime pins up front (PlanGeometry::host_store_pages).
  host.reserved[static_cast<size_t>(MemCategory::kKvPages)] = g.kv_host_store_bytes(stage);
  host.reserved[static_cast<size_t>(MemCategory::kDkvPages)] = g.dkv_host_store_bytes(stage);
  // The GPU tier of the page store (offload with one), allocated up front.
  if (const int64_t tier = g.gpu_tier_pages(); tier > 0) {
    gpu[MemCategory::kKvPages] = tier * layers * g.kv_page_bytes();
    gpu[MemCategory::kDkvPages] = tier * layers * g.dkv_page_bytes();
  }
  Observe(p.gpu, gpu);
  Observe(p.host, host);
  const MemoryState gpu_fixed = gpu, host_fixed = host;

  // Pass 1: summaries (and KV pages) of chunks 0..N-2 accumulate, and every chunk's layer inputs
  // when they are kept. Chunks that write pages are full, so the end of the pass is the total.
  const ChunkGeometry first = g.Chunk(0);
  const int64_t writers = chunks - 1;
  gpu[MemCategory::kPageSummaries] = writers * first.own_pages * layers * g.summary_page_bytes();
  // With offload, the pages of the host tier: those past the GPU tier's.
  const int64_t kv_pages =
      o.offload ? std::max<int64_t>(0, writers * first.own_pages - g.gpu_tier_pages())
                : writers * first.own_pages;
  kv_space[MemCategory::kKvPages] = kv_pages * layers * g.kv_page_bytes();
  if (o.keep_layer_inputs)
    for (int32_t i = 0; i < chunks; ++i)
      gpu[MemCategory::kLayerInputs] += g.layer_inputs_bytes(g.Chunk(i), stage);
  Observe(p.gpu, gpu);
  Observe(p.host, host);

  // Pass 2: per chunk, layer inputs then dKV pages come alive; at its end they die with the
  // chunk's pages. A pipeline stage recomputes its warm-up's chunks ahead, whose inputs live
  // while it runs this chunk's backward.
  const int32_t warm_up = PipelineSchedule::WarmUp(g, stage);
  const int64_t dkv_layer_bytes = layers * g.dkv_page_bytes();
  int64_t selected_by_later_chunks = 0;
  for (int32_t i = chunks - 1; i >= 0; --i) {
    const ChunkGeometry c = g.Chunk(i);
    const DkvState dkv = g.Dkv(c, selected_by_later_chunks);
    if (!o.keep_layer_inputs) {
      gpu[MemCategory::kLayerInputs] = g.layer_inputs_bytes(c, stage);
      for (int32_t j = std::max(0, i - warm_up); j < i; ++j)
        gpu[MemCategory::kLayerInputs] += g.layer_inputs_bytes(g.Chunk(j), stage);
      Observe(p.gpu, gpu);
    }
    kv_space[MemCategory::kDkvPages] =
        (o.offload ? dkv.live_host_pages : dkv.live_pages) * dkv_layer_bytes;
    Observe(p.gpu, gpu);
    Observe(p.host, host);
    if (o.keep_layer_inputs)
      gpu[MemCategory::kLayerInputs] -= g.layer_inputs_bytes(c, stage);
    else
      gpu[MemCategory::kLayerInputs] = 0;
    if (g.writes_pages(i)) {
      gpu[MemCategory::kPageSummaries] -= c.own_pages * layers * g.summary_page_bytes();
      kv_space[MemCategory::kKvPages] -=
          (o.offload ? c.own_host_pages : c.own_pages) * layers * g.kv_page_bytes();
    }
    kv_space[MemCategory::kDkvPages] =
        (o.offload ? dkv.live_after_host_pages : dkv.live_after_pages) * dkv_layer_bytes;
    selected_by_later_chunks += c.union_pages;
  }
  CTXPLAN_CHECK(gpu.bytes == gpu_fixed.bytes && host.bytes == host_fixed.bytes,
                "analytic memory does not return to the fixed buffers");
  p.gpu.end_bytes = gpu.Total();
  p.host.end_bytes = host.Total();
  return p;
}

}  // namespace

MemoryPrediction AnalyticModel::PredictMemory(const PlanGeometry& g, int gpus_per_machine) {
  if (g.stages() == 1) return StageMemory(g, 0);
  // The GPU with the highest peak; the machine whose stages hold the most host memory, their
  // peaks summed (they come together, at the start of pass 2).
  MemoryPrediction p;
  MemoryPeak machine;
  for (int32_t r = 0; r < g.stages(); ++r) {
    const MemoryPrediction stage = StageMemory(g, r);
    p.gpu_peak_by_stage.push_back(stage.gpu.peak_bytes);
    p.host_peak_by_stage.push_back(stage.host.peak_bytes);
    if (stage.gpu.peak_bytes >= p.gpu.peak_bytes) p.gpu = stage.gpu;
    machine.peak_bytes += stage.host.peak_bytes;
    machine.end_bytes += stage.host.end_bytes;
    for (size_t c = 0; c < machine.at_peak.size(); ++c) machine.at_peak[c] += stage.host.at_peak[c];
    if ((r + 1) % std::max(1, gpus_per_machine) == 0 || r == g.last_stage()) {
      if (machine.peak_bytes >= p.host.peak_bytes) p.host = machine;
      machine = {};
    }
  }
  return p;
}

namespace {
// The per-chunk layers, kept per thread from one prediction to the next: a sweep predicts
// thousands of configurations, and a cache allocated afresh each time (a megabyte at 1,024
// chunks) faulted its pages in every time: kept, ctxplan_bench's grid faults 41x fewer pages and
// runs 7-12% faster. Each prediction rebuilds it before use.
LayerCache& ThreadLayerCache() {
  thread_local LayerCache cache;
  return cache;
}

// A prediction holding the plan's memory peaks, its time still to come.
StepPrediction WithMemory(const MemoryPrediction& memory) {
  StepPrediction result;
  result.gpu = memory.gpu;
  result.host = memory.host;
  result.gpu_peak_by_rank = memory.gpu_peak_by_stage;
  result.host_peak_by_rank = memory.host_peak_by_stage;
  return result;
}
}  // namespace

StepPrediction AnalyticModel::Predict(const PlanGeometry& g) const {
  StepPrediction result = WithMemory(PredictMemory(g, time_model_.gpus_per_machine()));
  // The step at the maximum clock, and what its work draws; then again at the clock whose
  // power fits the limit (clock_model.h), its layers slowed rather than timed anew.
  LayerCache& layers = ThreadLayerCache();
  const PassClocks clocks = TimeAtMaxClock(g, result, layers);
  if (clocks != PassClocks{1.0, 1.0, 1.0})
    PredictTime(g, ForRun(g, clocks), result, layers, /*reuse=*/true);
  return result;
}

StepPrediction AnalyticModel::PredictAtClock(const PlanGeometry& g, double clock_fraction) const {
  StepPrediction result = WithMemory(PredictMemory(g, time_model_.gpus_per_machine()));
  PredictTime(g, ForRun(g, {clock_fraction, clock_fraction, clock_fraction}), result,
              ThreadLayerCache(), /*reuse=*/false);
  return result;
}

KernelTimeModel AnalyticModel::ForRun(const PlanGeometry& g, const PassClocks& clocks) const {
  KernelTimeModel m = time_model_.AtClocks(clocks);  // one copy of the profile, not two
  m.ShareHostLinks(g.options().pipeline_stages);
  return m;
}

PassClocks AnalyticModel::SustainedClocks(const PlanGeometry& g) const {
  StepPrediction result;
  return TimeAtMaxClock(g, result, ThreadLayerCache());
}

PassClocks AnalyticModel::TimeAtMaxClock(const PlanGeometry& g, StepPrediction& result,
                                         LayerCache& layers) const {
  const KernelTimeModel at_max = ForRun(g, {1.0, 1.0, 1.0});
  PredictTime(g, at_max, result, layers, /*reuse=*/false);
  PassClocks clocks;
  for (int p = 0; p < kPowerPassCount; ++p)
    clocks[static_cast<size_t>(p)] =
        SustainedClockFraction(at_max.profile(), result.seconds_by_pass[static_cast<size_t>(p)],
                               result.energy_by_pass[static_cast<size_t>(p)]);
  return clocks;
}

void AnalyticModel::PredictTime(const PlanGeometry& g, const KernelTimeModel& time_model,
                                StepPrediction& result, LayerCache& layers, bool reuse) {
  const int32_t chunks = g.num_chunks();
  const auto n = static_cast<size_t>(chunks);
  if (reuse) {
    // The pass at the sustained clocks slows the cached layers in place: it is their last use.
    for (ForwardLayer& f : layers.fill) f.Slow(1.0 / time_model.clock_fraction(Phase::kFill));
    for (ForwardLayer& f : layers.recompute)
      f.Slow(1.0 / time_model.clock_fraction(Phase::kRecompute));
    for (BackwardLayer& b : layers.backward)
      b.Slow(1.0 / time_model.clock_fraction(Phase::kBackward));
  } else {
    layers.fill.assign(n, {});
    layers.recompute.assign(n, {});
    layers.backward.assign(n, {});
    layers.fill_built.assign(n, false);
    layers.recompute_built.assign(n, false);
    layers.backward_built.assign(n, false);
  }
  // T_{i+1} of each chunk: the pages later chunks selected (their dKV pages).
  std::vector<int64_t> selected_after(n + 1, 0);
  for (int32_t i = chunks - 1; i >= 0; --i)
    selected_after[static_cast<size_t>(i)] =
        selected_after[static_cast<size_t>(i) + 1] + g.Chunk(i).union_pages;
  auto forward = [&](const ChunkGeometry& c, Phase phase,
                     TimeRecurrence& time) -> const ForwardLayer& {
    const auto i = static_cast<size_t>(c.index);
    auto& cache = phase == Phase::kFill ? layers.fill : layers.recompute;
    auto&& built = phase == Phase::kFill ? layers.fill_built[i] : layers.recompute_built[i];
    if (!reuse && !built) {
      cache[i] = time.Forward(c, phase);
      built = true;
    }
    return cache[i];
  };
  auto backward = [&](const ChunkGeometry& c, const DkvState& dkv,
                      TimeRecurrence& time) -> const BackwardLayer& {
    const auto i = static_cast<size_t>(c.index);
    if (!reuse && !layers.backward_built[i]) {
      layers.backward[i] = time.Backward(c, dkv);
      layers.backward_built[i] = true;
    }
    return layers.backward[i];
  };

  const MemoryPeak gpu = result.gpu, host = result.host;
  const std::vector<int64_t> by_rank = result.gpu_peak_by_rank;
  const std::vector<int64_t> host_by_rank = result.host_peak_by_rank;
  result = StepPrediction{};
  result.gpu = gpu;
  result.host = host;
  result.gpu_peak_by_rank = by_rank;
  result.host_peak_by_rank = host_by_rank;
  result.pass_clocks = time_model.pass_clocks();
  const ModelSpec& m = g.model();
  const RunOptions& o = g.options();
  const int32_t stages = g.stages();
  std::vector<StepPrediction> partial(static_cast<size_t>(stages));
  std::vector<TimeRecurrence> time;
  time.reserve(static_cast<size_t>(stages));
  for (int32_t r = 0; r < stages; ++r)
    time.emplace_back(g, time_model, partial[static_cast<size_t>(r)], r);
  // What crossed each boundary and when it arrives: forward[r] from stage r to r + 1, backward[r]
  // from r + 1 to r, first in first out as the plan's sends are.
  std::vector<std::deque<Tick>> forward_arrivals(static_cast<size_t>(stages));
  std::vector<std::deque<Tick>> backward_arrivals(static_cast<size_t>(stages));
  // The send is posted (its latency on the sender's stream), the receive carries the bytes.
  auto send = [&](TimeRecurrence& t, int32_t from, int32_t to, int64_t bytes, Phase phase,
                  std::deque<Tick>& arrivals) {
    t.Kernel(BoundaryCopyCost(bytes), phase);  // pack
    const Tick transfer = time_model.PeerDuration(bytes, from, to);
    arrivals.push_back(t.ComputeEnd() + transfer);
    const bool forward = to > from;
    partial[static_cast<size_t>(from)]
        .busy_ticks[static_cast<size_t>(forward ? Stream::kSendNext : Stream::kSendPrev)] +=
        time_model.Duration(PeerCost(0), phase);
    partial[static_cast<size_t>(to)]
        .busy_ticks[static_cast<size_t>(forward ? Stream::kRecvPrev : Stream::kRecvNext)] +=
        transfer;
  };
  auto receive = [&](TimeRecurrence& t, int64_t bytes, Phase phase, std::deque<Tick>& arrivals) {
    t.WaitUntil(arrivals.front());
    arrivals.pop_front();
    t.Kernel(BoundaryCopyCost(bytes), phase);  // unpack
  };

  // What an item of the schedule drew and how long it held its stage's compute stream (waits for
  // copies and for other stages included), into its pass's share: each pass's clock follows.
  auto account = [&](int32_t r, Phase phase, Tick compute_before, const StepEnergy& drawn_before) {
    StepPrediction& p = partial[static_cast<size_t>(r)];
    const auto pass = static_cast<size_t>(PowerPassOf(phase));
    p.seconds_by_pass[pass] +=
        TicksToSeconds(time[static_cast<size_t>(r)].ComputeEnd() - compute_before);
    p.energy_by_pass[pass] += p.energy - drawn_before;
  };
  PipelineSchedule schedule(g);
  PipelineItem item;
  while (schedule.Next(item)) {
    const int32_t r = item.stage;
    const auto s = static_cast<size_t>(r);
    TimeRecurrence& t = time[s];
    const ChunkGeometry c = g.Chunk(item.chunk);
    const Tick compute_before = t.ComputeEnd();
    const StepEnergy drawn_before = partial[s].energy;
    if (item.kind == PipelineItemKind::kBackward) {
      const DkvState dkv = g.Dkv(c, selected_after[static_cast<size_t>(item.chunk) + 1]);
      using Outside = TimeRecurrence::Outside;
      if (r == g.last_stage()) {
        t.KernelOutside(Outside::kFinalNorm, c.tokens, Phase::kLoss,
                        [&] { return WarmInput(RmsNormForwardCost(c.tokens, m.hidden_size)); });
        t.KernelOutside(Outside::kLoss, c.tokens, Phase::kLoss, [&] {
          return LossForwardBackwardCost(c.tokens, m.hidden_size, m.vocab_size, o.lora_rank == 0,
                                         o.grad_bytes());
        });
        t.KernelOutside(Outside::kFinalNormBackward, c.tokens, Phase::kLoss,
                        [&] { return RmsNormBackwardCost(c.tokens, m.hidden_size); });
      } else {
        receive(t, g.boundary_backward_bytes(c), Phase::kBackward, backward_arrivals[s]);
      }
      t.RunBackward(backward(c, dkv, t));
      if (r == 0)
        t.KernelOutside(Outside::kEmbeddingBackward, c.tokens, Phase::kBackward, [&] {
          return EmbeddingBackwardCost(c.tokens, m.hidden_size, o.grad_bytes());
        });
      else
        send(t, r, r - 1, g.boundary_backward_bytes(c), Phase::kBackward, backward_arrivals[s - 1]);
      account(r, Phase::kBackward, compute_before, drawn_before);
      continue;
    }
    const Phase phase = item.kind == PipelineItemKind::kFill ? Phase::kFill : Phase::kRecompute;
    if (r == 0)
      t.KernelOutside(TimeRecurrence::Outside::kEmbedding, c.tokens, phase,
                      [&] { return EmbeddingForwardCost(c.tokens, m.hidden_size); });
    else
      receive(t, g.boundary_forward_bytes(c), phase, forward_arrivals[s - 1]);
    t.RunForward(forward(c, phase, t));
    if (r < g.last_stage())
      send(t, r, r + 1, g.boundary_forward_bytes(c), phase, forward_arrivals[s]);
    account(r, phase, compute_before, drawn_before);
  }

  // The busiest stage's streams and energy (its power sets the clock); the model's FLOPs and
  // copies in all; the step ends with the last stage's optimizer.
  double most_joules = -1;
  for (int32_t r = 0; r < stages; ++r) {
    TimeRecurrence& t = time[static_cast<size_t>(r)];
    const Tick compute_before = t.ComputeEnd();
    const StepEnergy drawn_before = partial[static_cast<size_t>(r)].energy;
    t.Optimizer();
    account(r, Phase::kOptimizer, compute_before, drawn_before);
    const StepPrediction& p = partial[static_cast<size_t>(r)];
    result.step_ticks = std::max(result.step_ticks, t.End());
    for (size_t k = 0; k < p.busy_ticks.size(); ++k)
      result.busy_ticks[k] = std::max(result.busy_ticks[k], p.busy_ticks[k]);
    result.flops += p.flops;
    result.h2d_bytes += p.h2d_bytes;
    result.d2h_bytes += p.d2h_bytes;
    result.gpu_idle_tail_ticks = std::max(result.gpu_idle_tail_ticks, p.gpu_idle_tail_ticks);
    const double joules = p.energy.clock_joules + p.energy.fixed_joules;
    if (joules > most_joules) {
      most_joules = joules;
      result.energy = p.energy;
      result.energy_by_pass = p.energy_by_pass;
      result.seconds_by_pass = p.seconds_by_pass;
    }
  }
  // The clock reported for the step: the passes' clocks weighted by their time.
  double seconds = 0, weighted = 0;
  for (int q = 0; q < kPowerPassCount; ++q) {
    seconds += result.seconds_by_pass[static_cast<size_t>(q)];
    weighted +=
        result.seconds_by_pass[static_cast<size_t>(q)] * result.pass_clocks[static_cast<size_t>(q)];
  }
  result.sm_clock_fraction = seconds > 0 ? weighted / seconds : result.pass_clocks[0];
}

}  // namespace ctxplan::sim
