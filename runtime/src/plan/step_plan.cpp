#include "ctxplan/runtime/step_plan.h"

#include <algorithm>
#include <array>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/lora.h"

namespace ctxplan {

namespace {

// Builds the ops of one layer (or one chunk boundary) into a reusable batch, numbering them as
// they are pushed so that later ops of the batch can name earlier ones as dependencies.
class OpBatch {
 public:
  explicit OpBatch(OpId* next_id) : next_id_(next_id) { ops_.reserve(64); }

  void Clear() { ops_.clear(); }
  const std::vector<Op>& ops() const { return ops_; }
  OpId last_compute() const { return last_compute_; }

  OpId Push(Op op, std::initializer_list<OpId> deps = {}) {
    op.id = (*next_id_)++;
    for (OpId dep : deps) {
      if (dep == kNoOp) continue;
      CTXPLAN_CHECK(op.num_deps < Op::kMaxDeps, "too many dependencies");
      CTXPLAN_CHECK(dep < op.id && op.id - dep <= StepPlan::kMaxDependencyDistance,
                    "dependency out of window");
      op.deps[op.num_deps++] = dep;
    }
    if (op.stream == Stream::kCompute && !IsMemory(op.kind)) last_compute_ = op.id;
    ops_.push_back(op);
    return op.id;
  }

 private:
  OpId* next_id_;
  OpId last_compute_ = kNoOp;
  std::vector<Op> ops_;
};

// The context every op of a layer shares.
struct Where {
  Phase phase;
  int32_t chunk;
  int32_t layer;
};

Op Kernel(const Where& w, OpKind kind, OpCost cost, int64_t m, int64_t n = 0, int64_t k = 0,
          OpPart part = OpPart::kNone) {
  Op op;
  op.kind = kind;
  op.stream = Stream::kCompute;
  op.phase = w.phase;
  op.chunk = w.chunk;
  op.layer = w.layer;
  op.part = part;
  op.m = m;
  op.n = n;
  op.k = k;
  op.cost = cost;
  return op;
}

// `pages` and `bytes` bound the copy (the slots hold them); it is timed at `expected_bytes` in
// `expected_copies` runs (the page union's expected size, PlanGeometry), or at its bound.
Op Copy(const Where& w, bool host_to_device, int64_t pages, int64_t bytes, int64_t copies = 1,
        int64_t expected_bytes = -1, int64_t expected_copies = -1) {
  Op op;
  op.kind = host_to_device ? OpKind::kCopyH2D : OpKind::kCopyD2H;
  op.stream = host_to_device ? Stream::kH2D : Stream::kD2H;
  op.phase = w.phase;
  op.chunk = w.chunk;
  op.layer = w.layer;
  op.pages = pages;
  op.bytes = bytes;
  op.cost = CopyCost(expected_bytes >= 0 ? expected_bytes : bytes, host_to_device,
                     expected_copies >= 0 ? expected_copies : copies);
  return op;
}

Op Memory(const Where& w, bool alloc, Stream stream, MemSpace space, MemCategory category,
          int64_t bytes) {
  Op op;
  op.kind = alloc ? OpKind::kAlloc : OpKind::kFree;
  op.stream = stream;
  op.phase = w.phase;
  op.chunk = w.chunk;
  op.space = space;
  op.category = category;
  op.bytes = bytes;
  return op;
}

// Emits the ops of a step into batches; the coroutine in StepPlan::Ops() yields them.
class PlanWriter {
 public:
  explicit PlanWriter(const PlanGeometry& geometry)
      : g_(geometry),
        m_(geometry.model()),
        o_(geometry.options()),
        batch_(&next_id_),
        kv_home_(static_cast<size_t>(geometry.num_layers()), kNoOp),
        dkv_home_(static_cast<size_t>(geometry.num_layers()), kNoOp) {}

  OpBatch& batch() { return batch_; }

  void Setup() {
    Where w{Phase::kSetup, -1, -1};
    auto gpu = [&](MemCategory category, int64_t bytes) {
      if (bytes > 0)
        batch_.Push(Memory(w, true, Stream::kCompute, MemSpace::kGpu, category, bytes));
    };
    auto host = [&](MemCategory category, int64_t bytes) {
      if (bytes > 0) batch_.Push(Memory(w, true, Stream::kHost, MemSpace::kHost, category, bytes));
    };
    gpu(MemCategory::kWeights, g_.weight_bytes());
    gpu(MemCategory::kGrads, g_.grad_bytes());
    if (o_.optimizer == OptimizerKind::kAdamWGpu)
      gpu(MemCategory::kOptimizer, g_.optimizer_state_bytes());
    gpu(MemCategory::kActivations, g_.activation_bytes());
    gpu(MemCategory::kWorkspace, g_.workspace_bytes());
    gpu(MemCategory::kPageSlots, g_.page_slot_bytes());
    // The GPU tier of the page store: KV and dKV of its pages of every layer, up front.
    if (const int64_t tier = g_.gpu_tier_pages(); tier > 0) {
      gpu(MemCategory::kKvPages, tier * m_.num_hidden_layers * g_.kv_page_bytes());
      gpu(MemCategory::kDkvPages, tier * LayerDkvBytes());
    }
    if (o_.optimizer == OptimizerKind::kAdamWHost) {
      host(MemCategory::kOptimizer, g_.host_optimizer_bytes());
      host(MemCategory::kGradStaging, g_.grad_bytes());
    }
  }

  void FillChunkStart(const ChunkGeometry& c) {
    Where w{Phase::kFill, c.index, -1};
    const int64_t layers = m_.num_hidden_layers;
    if (o_.keep_layer_inputs)
      batch_.Push(Memory(w, true, Stream::kCompute, MemSpace::kGpu, MemCategory::kLayerInputs,
                         g_.layer_inputs_bytes(c)));
    if (g_.writes_pages(c.index)) {
      batch_.Push(Memory(w, true, Stream::kCompute, MemSpace::kGpu, MemCategory::kPageSummaries,
                         c.own_pages * layers * g_.summary_page_bytes()));
      const int64_t kv_bytes = c.own_pages * layers * g_.kv_page_bytes();
      if (o_.offload) {
        if (c.own_host_pages > 0)
          batch_.Push(Memory(w, true, Stream::kD2H, MemSpace::kHost, MemCategory::kKvPages,
                             c.own_host_pages * layers * g_.kv_page_bytes()));
      } else
        batch_.Push(
            Memory(w, true, Stream::kCompute, MemSpace::kGpu, MemCategory::kKvPages, kv_bytes));
    }
    batch_.Push(Kernel(w, OpKind::kEmbeddingForward, EmbeddingForwardCost(c.tokens, m_.hidden_size),
                       c.tokens));
  }

  // One layer's forward in the fill pass or the recompute.
  void LayerForward(const ChunkGeometry& c, Phase phase, int32_t layer) {
    const Where w{phase, c.index, layer};
    const int64_t t = c.tokens, d = m_.hidden_size, q = m_.q_dim(), kv = m_.kv_dim();
    const bool fill = phase == Phase::kFill && g_.writes_pages(c.index);
    const bool paged = c.earlier_pages > 0;
    const bool copy_in = o_.offload && c.host_union_pages > 0;
    const int parity = NextSlotParity();

    OpId h2d = kNoOp;
    if (copy_in && !c.sparse)  // dense: the pages are known, prefetch as soon as a slot frees
      h2d = batch_.Push(Copy(w, true, c.host_union_pages, c.host_union_pages * g_.kv_page_bytes(),
                             g_.union_copy_runs(c, c.host_union_pages)),
                        {slot_release_[parity], KvHome(layer)});
    batch_.Push(
        Kernel(w, OpKind::kRmsNormForward, RmsNormForwardCost(t, d), t, 0, 0, OpPart::kAttnNorm));
    batch_.Push(Kernel(w, OpKind::kLinearForward,
                       LinearForwardCost(t, q + 2 * kv, d, LoraOn(OpPart::kQkv, o_.lora_rank),
                                         /*split_outputs=*/true),
                       t, q + 2 * kv, d, OpPart::kQkv));
    batch_.Push(Kernel(w, OpKind::kRopeForward, RopeCost(t, q, kv), t));
    OpId kv_write = kNoOp;
    const int own_parity = fill ? NextOwnParity() : 0;
    if (fill) {
      kv_write = batch_.Push(Kernel(w, OpKind::kKvWrite, KvWriteCost(t, kv), t),
                             {o_.offload ? own_release_[own_parity] : kNoOp});
      Op summary =
          Kernel(w, OpKind::kPageSummary, PageSummaryCost(c.own_pages, o_.page_tokens, kv), t);
      summary.pages = c.own_pages;
      batch_.Push(summary);
    }
    if (c.sparse) {
      Op score =
          Kernel(w, OpKind::kPageScore, PageScoreCost(t, o_.query_tile, c.earlier_pages, q, kv), t);
      score.pages = c.earlier_pages;
      batch_.Push(score);
      Op topk = Kernel(w, OpKind::kPageTopK, PageTopKCost(c.tiles, c.earlier_pages), t);
      topk.pages = c.earlier_pages;
      OpId selected = batch_.Push(topk);
      if (copy_in)
        h2d = batch_.Push(Copy(w, true, c.host_union_pages, c.host_union_pages * g_.kv_page_bytes(),
                               g_.union_copy_runs(c, c.host_union_pages),
                               c.expected_host_union_pages * g_.kv_page_bytes(),
                               g_.union_copy_runs(c, c.expected_host_union_pages)),
                          {selected, slot_release_[parity], KvHome(layer)});
    }
    // Over earlier pages the own positions run inside the paged launch (merged), which waits
    // for the pages' copy: so does the own op's share.
    batch_.Push(Kernel(w, OpKind::kAttentionForward, g_.own_attention_forward_cost(c), t, t, 0,
                       OpPart::kOwn),
                {paged ? h2d : kNoOp});
    if (paged) {
      Op attention = Kernel(w, OpKind::kAttentionForward, g_.paged_attention_forward_cost(c), t,
                            PagedTokensRead(c), 0, OpPart::kPaged);
      attention.pages = c.union_pages;
      const OpId id = batch_.Push(attention, {h2d});
      if (copy_in) slot_release_[parity] = id;
    }
    batch_.Push(Kernel(w, OpKind::kLinearForward,
                       LinearForwardCost(t, d, q, LoraOn(OpPart::kO, o_.lora_rank)), t, d, q,
                       OpPart::kO));
    batch_.Push(
        Kernel(w, OpKind::kRmsNormForward, RmsNormForwardCost(t, d), t, 0, 0, OpPart::kMlpNorm));
    batch_.Push(Kernel(
        w, OpKind::kLinearForward,
        LinearForwardCost(t, 2 * m_.intermediate_size, d, LoraOn(OpPart::kGateUp, o_.lora_rank)), t,
        2 * m_.intermediate_size, d, OpPart::kGateUp));
    batch_.Push(Kernel(w, OpKind::kSwigluForward, SwigluForwardCost(t, m_.intermediate_size), t));
    batch_.Push(
        Kernel(w, OpKind::kLinearForward,
               LinearForwardCost(t, d, m_.intermediate_size, LoraOn(OpPart::kDown, o_.lora_rank)),
               t, d, m_.intermediate_size, OpPart::kDown));
    if (fill && o_.offload && c.own_host_pages > 0) {
      Op d2h = Copy(w, false, c.own_host_pages, c.own_host_pages * g_.kv_page_bytes());
      own_release_[own_parity] = batch_.Push(d2h, {kv_write});
      kv_home_[static_cast<size_t>(layer)] = own_release_[own_parity];
    }
  }

  void RecomputeStart(const ChunkGeometry& c) {
    Where w{Phase::kRecompute, c.index, -1};
    batch_.Push(Memory(w, true, Stream::kCompute, MemSpace::kGpu, MemCategory::kLayerInputs,
                       g_.layer_inputs_bytes(c)));
    batch_.Push(Kernel(w, OpKind::kEmbeddingForward, EmbeddingForwardCost(c.tokens, m_.hidden_size),
                       c.tokens));
  }

  void Loss(const ChunkGeometry& c) {
    Where w{Phase::kLoss, c.index, -1};
    const int64_t t = c.tokens, d = m_.hidden_size;
    batch_.Push(
        Kernel(w, OpKind::kRmsNormForward, RmsNormForwardCost(t, d), t, 0, 0, OpPart::kFinalNorm));
    batch_.Push(
        Kernel(w, OpKind::kLossForwardBackward,
               LossForwardBackwardCost(t, d, m_.vocab_size, o_.lora_rank == 0, o_.grad_bytes()), t,
               m_.vocab_size, d, OpPart::kLmHead));
    batch_.Push(Kernel(w, OpKind::kRmsNormBackward, RmsNormBackwardCost(t, d), t, 0, 0,
                       OpPart::kFinalNorm));
  }

  // dKV pages that come alive as chunk `c` starts its backward.
  void BackwardStart(const ChunkGeometry& c, const DkvState& dkv) {
    Where w{Phase::kBackward, c.index, -1};
    // With offload the host tier's pages (the GPU tier's are allocated up front).
    const int64_t live = o_.offload ? dkv.live_host_pages : dkv.live_pages;
    const int64_t grow = (live - dkv_live_pages_) * LayerDkvBytes();
    CTXPLAN_CHECK(grow >= 0, "dKV pages shrank at a chunk start");
    dkv_live_pages_ = live;
    if (grow > 0) {
      if (o_.offload)
        batch_.Push(Memory(w, true, Stream::kD2H, MemSpace::kHost, MemCategory::kDkvPages, grow));
      else
        batch_.Push(
            Memory(w, true, Stream::kCompute, MemSpace::kGpu, MemCategory::kDkvPages, grow));
    }
  }

  void LayerBackward(const ChunkGeometry& c, const DkvState& dkv, int32_t layer) {
    const Where w{Phase::kBackward, c.index, layer};
    const int64_t t = c.tokens, d = m_.hidden_size, q = m_.q_dim(), kv = m_.kv_dim();
    const int64_t inter = m_.intermediate_size, r = o_.lora_rank, gb = o_.grad_bytes();
    const bool paged = c.earlier_pages > 0;
    const bool own_dkv = dkv.own_touched > 0;
    const int parity = NextSlotParity();

    OpId h2d = kNoOp;
    const int64_t host_union = c.host_union_pages;
    const int64_t pretouched = dkv.pretouched_host_union, own_touched = dkv.own_touched_host;
    if (o_.offload && host_union + pretouched + own_touched > 0) {
      const int64_t pages = host_union + pretouched + own_touched;
      const int64_t bytes =
          host_union * g_.kv_page_bytes() + (pretouched + own_touched) * g_.dkv_page_bytes();
      const int64_t copies = g_.union_copy_runs(c, host_union) + g_.union_copy_runs(c, pretouched) +
                             (own_touched > 0 ? 1 : 0);
      const int64_t expected_bytes =
          bytes - (host_union - c.expected_host_union_pages) * g_.kv_page_bytes();
      const int64_t expected_copies = copies - g_.union_copy_runs(c, host_union) +
                                      g_.union_copy_runs(c, c.expected_host_union_pages);
      h2d = batch_.Push(Copy(w, true, pages, bytes, copies, expected_bytes, expected_copies),
                        {slot_release_[parity], KvHome(layer), DkvHome(layer)});
    }
    const int64_t fresh_pages = c.union_pages - dkv.pretouched_union;
    if (paged && fresh_pages > 0) {
      Op zero = Kernel(w, OpKind::kZeroFill, ZeroFillCost(fresh_pages * g_.dkv_page_bytes()), t);
      zero.pages = fresh_pages;
      batch_.Push(zero);
    }
    // Recompute the layer's internals from its saved input (attention output and LSE are kept).
    batch_.Push(
        Kernel(w, OpKind::kRmsNormForward, RmsNormForwardCost(t, d), t, 0, 0, OpPart::kAttnNorm));
    batch_.Push(
        Kernel(w, OpKind::kLinearForward,
               LinearForwardCost(t, q + 2 * kv, d, LoraOn(OpPart::kQkv, r), /*split_outputs=*/true),
               t, q + 2 * kv, d, OpPart::kQkv));
    batch_.Push(Kernel(w, OpKind::kRopeForward, RopeCost(t, q, kv), t));
    batch_.Push(Kernel(w, OpKind::kLinearForward, LinearForwardCost(t, d, q, LoraOn(OpPart::kO, r)),
                       t, d, q, OpPart::kO));
    batch_.Push(
        Kernel(w, OpKind::kRmsNormForward, RmsNormForwardCost(t, d), t, 0, 0, OpPart::kMlpNorm));
    batch_.Push(Kernel(w, OpKind::kLinearForward,
                       LinearForwardCost(t, 2 * inter, d, LoraOn(OpPart::kGateUp, r)), t, 2 * inter,
                       d, OpPart::kGateUp));
    batch_.Push(Kernel(w, OpKind::kSwigluForward, SwigluForwardCost(t, inter), t));
    // Backward, top of the layer first.
    Linear(w, t, d, inter, OpPart::kDown);
    batch_.Push(Kernel(w, OpKind::kSwigluBackward, SwigluBackwardCost(t, inter), t));
    Linear(w, t, 2 * inter, d, OpPart::kGateUp);
    batch_.Push(
        Kernel(w, OpKind::kRmsNormBackward, RmsNormBackwardCost(t, d), t, 0, 0, OpPart::kMlpNorm));
    Linear(w, t, d, q, OpPart::kO);
    // The layer's attention backward adds the own pages' dKV (DkvAccumulate) as it writes dK/dV:
    // the paged op when there is one (its kernel covers the own positions too), else the own op,
    // which then waits for the own pages' copy in.
    Op own_attention = Kernel(w, OpKind::kAttentionBackward, g_.own_attention_backward_cost(c), t,
                              t, 0, OpPart::kOwn);
    own_attention.adds_own_dkv = own_dkv && !paged;
    batch_.Push(own_attention, {own_attention.adds_own_dkv || paged ? h2d : kNoOp});
    OpId release = kNoOp;
    if (paged) {
      Op attention = Kernel(w, OpKind::kAttentionBackward, g_.paged_attention_backward_cost(c), t,
                            PagedTokensRead(c), 0, OpPart::kPaged);
      attention.pages = c.union_pages;
      attention.adds_own_dkv = own_dkv;  // the accumulate below waits for no other op
      release = batch_.Push(attention, {h2d});
    }
    if (own_dkv) {
      Op accumulate = Kernel(w, OpKind::kDkvAccumulate, DkvAccumulateCost(t, kv, gb), t);
      accumulate.pages = dkv.own_touched;
      const OpId id = batch_.Push(accumulate, {paged ? kNoOp : h2d});
      if (!paged) release = id;
    }
    batch_.Push(Kernel(w, OpKind::kRopeBackward, RopeCost(t, q, kv), t));
    Linear(w, t, q + 2 * kv, d, OpPart::kQkv);
    batch_.Push(
        Kernel(w, OpKind::kRmsNormBackward, RmsNormBackwardCost(t, d), t, 0, 0, OpPart::kAttnNorm));
    if (o_.offload && host_union > 0) {
      Op d2h =
          Copy(w, false, host_union, host_union * g_.dkv_page_bytes(),
               g_.union_copy_runs(c, host_union), c.expected_host_union_pages * g_.dkv_page_bytes(),
               g_.union_copy_runs(c, c.expected_host_union_pages));
      release = batch_.Push(d2h, {release});
      dkv_home_[static_cast<size_t>(layer)] = release;
    }
    if (o_.offload && release != kNoOp) slot_release_[parity] = release;
  }

  // After chunk `c`'s backward: its gradients reach the embedding, its pages and buffers die.
  void BackwardEnd(const ChunkGeometry& c, const DkvState& dkv) {
    Where w{Phase::kBackward, c.index, -1};
    const int64_t layers = m_.num_hidden_layers;
    batch_.Push(Kernel(w, OpKind::kEmbeddingBackward,
                       EmbeddingBackwardCost(c.tokens, m_.hidden_size, o_.grad_bytes()), c.tokens));
    batch_.Push(Memory(w, false, Stream::kCompute, MemSpace::kGpu, MemCategory::kLayerInputs,
                       g_.layer_inputs_bytes(c)));
    const bool filled = g_.writes_pages(c.index);
    if (filled)
      batch_.Push(Memory(w, false, Stream::kCompute, MemSpace::kGpu, MemCategory::kPageSummaries,
                         c.own_pages * layers * g_.summary_page_bytes()));
    // Host pages die on the D2H stream, after the chunk's last copy home.
    const Stream stream = o_.offload ? Stream::kD2H : Stream::kCompute;
    const MemSpace space = o_.offload ? MemSpace::kHost : MemSpace::kGpu;
    const int64_t kv_pages = o_.offload ? c.own_host_pages : c.own_pages;
    if (filled && kv_pages > 0)
      batch_.Push(Memory(w, false, stream, space, MemCategory::kKvPages,
                         kv_pages * layers * g_.kv_page_bytes()));
    const int64_t live_after = o_.offload ? dkv.live_after_host_pages : dkv.live_after_pages;
    const int64_t shrink = (dkv_live_pages_ - live_after) * LayerDkvBytes();
    CTXPLAN_CHECK(shrink >= 0, "dKV pages grew at a chunk end");
    dkv_live_pages_ = live_after;
    if (shrink > 0) batch_.Push(Memory(w, false, stream, space, MemCategory::kDkvPages, shrink));
  }

  void Optimizer() {
    Where w{Phase::kOptimizer, -1, -1};
    const int64_t params = g_.trainable_params();
    switch (o_.optimizer) {
      case OptimizerKind::kNone:
        return;
      case OptimizerKind::kAdamWGpu:
        batch_.Push(Kernel(w, OpKind::kAdamW, AdamWCost(params, kBf16Bytes, o_.grad_bytes(), false),
                           params));
        return;
      case OptimizerKind::kAdamWHost: {
        // Gradients home once the last kernel has written them, the update on the CPU, the
        // new weights back.
        OpId d2h = batch_.Push(Copy(w, false, 0, g_.grad_bytes()), {batch_.last_compute()});
        Op update =
            Kernel(w, OpKind::kAdamW, AdamWCost(params, kBf16Bytes, o_.grad_bytes(), true), params);
        update.stream = Stream::kHost;
        OpId host = batch_.Push(update, {d2h});
        batch_.Push(Copy(w, true, 0, params * kBf16Bytes), {host});
        return;
      }
    }
  }

 private:
  void Linear(const Where& w, int64_t t, int64_t out, int64_t in, OpPart part) {
    batch_.Push(Kernel(
        w, OpKind::kLinearBackwardInput,
        LinearBackwardInputCost(t, out, in, LoraOn(part, o_.lora_rank), part == OpPart::kQkv), t,
        out, in, part));
    batch_.Push(
        Kernel(w, OpKind::kLinearBackwardWeight,
               LinearBackwardWeightCost(t, out, in, LoraOn(part, o_.lora_rank), o_.grad_bytes()), t,
               out, in, part));
  }
  int64_t PagedTokensRead(const ChunkGeometry& c) const { return g_.paged_tokens_read(c); }
  int64_t LayerDkvBytes() const { return m_.num_hidden_layers * g_.dkv_page_bytes(); }
  // The last copy that brought this layer's KV (dKV) pages home: a later copy back to the GPU
  // reads what it wrote. Never binding when a chunk of compute separates the two, but the data
  // dependency is real and the CUDA backend must order it.
  OpId KvHome(int32_t layer) const { return Recent(kv_home_[static_cast<size_t>(layer)]); }
  OpId DkvHome(int32_t layer) const { return Recent(dkv_home_[static_cast<size_t>(layer)]); }
  // Beyond the dependency window the copy finished long ago: in-order streams already order it.
  OpId Recent(OpId op) const {
    return op != kNoOp && next_id_ - op <= StepPlan::kMaxDependencyDistance / 2 ? op : kNoOp;
  }
  int NextSlotParity() { return static_cast<int>(slot_uses_++ & 1); }
  int NextOwnParity() { return static_cast<int>(own_uses_++ & 1); }

  const PlanGeometry& g_;
  const ModelSpec& m_;
  const RunOptions& o_;
  OpId next_id_ = 0;
  OpBatch batch_;
  // The op that must finish before slot buffer 0 / 1 may be refilled.
  std::array<OpId, 2> slot_release_{kNoOp, kNoOp};
  std::array<OpId, 2> own_release_{kNoOp, kNoOp};
  std::vector<OpId> kv_home_, dkv_home_;  // [layer]
  uint64_t slot_uses_ = 0;
  uint64_t own_uses_ = 0;
  int64_t dkv_live_pages_ = 0;
};

}  // namespace

StepPlan::StepPlan(const ModelSpec& model, const RunOptions& options) : geometry_(model, options) {}

Generator<Op> StepPlan::Ops() const {
  PlanWriter writer(geometry_);
  OpBatch& batch = writer.batch();
  const int32_t chunks = geometry_.num_chunks();
  const int32_t layers = geometry_.num_layers();

  writer.Setup();
  for (const Op& op : batch.ops()) co_yield op;

  for (int32_t i = 0; i < geometry_.fill_chunks(); ++i) {  // pass 1
    const ChunkGeometry chunk = geometry_.Chunk(i);
    batch.Clear();
    writer.FillChunkStart(chunk);
    for (const Op& op : batch.ops()) co_yield op;
    for (int32_t l = 0; l < layers; ++l) {
      batch.Clear();
      writer.LayerForward(chunk, Phase::kFill, l);
      for (const Op& op : batch.ops()) co_yield op;
    }
  }

  int64_t selected_by_later_chunks = 0;        // T_{i+1}
  for (int32_t i = chunks - 1; i >= 0; --i) {  // pass 2, in reverse chunk order
    const ChunkGeometry chunk = geometry_.Chunk(i);
    const DkvState dkv = geometry_.Dkv(chunk, selected_by_later_chunks);
    if (!options().keep_layer_inputs) {
      batch.Clear();
      writer.RecomputeStart(chunk);
      for (const Op& op : batch.ops()) co_yield op;
      for (int32_t l = 0; l < layers; ++l) {
        batch.Clear();
        writer.LayerForward(chunk, Phase::kRecompute, l);
        for (const Op& op : batch.ops()) co_yield op;
      }
    }
    batch.Clear();
    writer.Loss(chunk);
    writer.BackwardStart(chunk, dkv);
    for (const Op& op : batch.ops()) co_yield op;
    for (int32_t l = layers - 1; l >= 0; --l) {
      batch.Clear();
      writer.LayerBackward(chunk, dkv, l);
      for (const Op& op : batch.ops()) co_yield op;
    }
    batch.Clear();
    writer.BackwardEnd(chunk, dkv);
    for (const Op& op : batch.ops()) co_yield op;
    selected_by_later_chunks += chunk.union_pages;
  }

  batch.Clear();
  writer.Optimizer();
  for (const Op& op : batch.ops()) co_yield op;
}

}  // namespace ctxplan
