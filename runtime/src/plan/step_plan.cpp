#include "ctxplan/runtime/plan/step_plan.h"

#include <algorithm>
#include <array>
#include <deque>
#include <memory>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/lora.h"

namespace ctxplan {

namespace {

// Builds the ops of one layer (or one chunk boundary) into a reusable batch, numbering them as
// they are pushed so that later ops of the batch can name earlier ones as dependencies.
class OpBatch {
 public:
  OpBatch(OpId* next_id, int16_t rank) : next_id_(next_id), rank_(rank) { ops_.reserve(64); }

  void Clear() { ops_.clear(); }
  const std::vector<Op>& ops() const { return ops_; }
  OpId last_compute() const { return last_compute_; }

  OpId Push(Op op, std::initializer_list<OpId> deps = {}) {
    op.id = (*next_id_)++;
    op.rank = rank_;
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
  int16_t rank_;
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

// The kernel just before it on the compute stream wrote this op's input (KernelShape::warm_input):
// where the op's traffic fits the L2 it reads its input from there. The analytic model
// (sim/src/analytic_model.cpp) marks the same ops.
Op Warm(Op op) {
  op.cost = WarmInput(op.cost);
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

Op Peer(const Where& w, bool send, Stream stream, int64_t tokens, int64_t bytes, int parity) {
  Op op;
  op.kind = send ? OpKind::kPeerSend : OpKind::kPeerRecv;
  op.stream = stream;
  op.phase = w.phase;
  op.chunk = w.chunk;
  op.m = tokens;
  op.bytes = bytes;
  op.pages = parity;
  // The transfer is timed on the receive, which waits for the send to be posted: a send is done
  // when its receiver has the data, so the two would count the link twice.
  op.cost = PeerCost(send ? 0 : bytes);
  return op;
}

Op Boundary(const Where& w, bool pack, int64_t tokens, int64_t bytes, int parity) {
  Op op = Kernel(w, pack ? OpKind::kBoundaryPack : OpKind::kBoundaryUnpack, BoundaryCopyCost(bytes),
                 tokens);
  op.bytes = bytes;
  op.pages = parity;
  return op;
}

// The sends of one stage boundary in one direction, as both ends see them: the sender's send ids
// in order (the receiver takes them first in, first out) and, per buffer parity, the ops that
// last used each end's buffer. Each end double-buffers, so a pack waits for the send (and the
// receive) of two transfers ago, and a receive for the unpack of two transfers ago.
struct BoundaryLink {
  std::deque<OpId> sent;  // sends not yet received
  std::array<OpId, 2> last_send{kNoOp, kNoOp}, last_recv{kNoOp, kNoOp};
  std::array<OpId, 2> last_unpack{kNoOp, kNoOp};
  uint64_t sends = 0, recvs = 0;
};

// Emits the ops of one pipeline stage's share of a step into batches; the coroutine in
// StepPlan::Ops() interleaves the stages' batches and yields them. Op ids are shared.
class PlanWriter {
 public:
  PlanWriter(const PlanGeometry& geometry, int32_t rank, OpId* next_id)
      : g_(geometry),
        m_(geometry.model()),
        o_(geometry.options()),
        rank_(rank),
        first_layer_(geometry.stage_first_layer(rank)),
        end_layer_(geometry.stage_first_layer(rank + 1)),
        next_id_(next_id),
        batch_(next_id, static_cast<int16_t>(rank)),
        kv_home_(static_cast<size_t>(geometry.num_layers()), kNoOp),
        dkv_home_(static_cast<size_t>(geometry.num_layers()), kNoOp) {}

  OpBatch& batch() { return batch_; }
  int32_t first_layer() const { return first_layer_; }
  int32_t end_layer() const { return end_layer_; }
  bool first_stage() const { return rank_ == 0; }
  bool last_stage() const { return rank_ == g_.last_stage(); }
  // The links to the next stage (forward sends) and from it (backward sends); set by Ops().
  BoundaryLink* forward_out = nullptr;   // this -> next
  BoundaryLink* forward_in = nullptr;    // previous -> this
  BoundaryLink* backward_out = nullptr;  // this -> previous
  BoundaryLink* backward_in = nullptr;   // next -> this

  // The end of this stage's forward over chunk `c` (fill or recompute): the residual stream
  // and its pending add to the next stage.
  void SendForward(const ChunkGeometry& c, Phase phase) {
    Send(*forward_out, Where{phase, c.index, -1}, Stream::kSendNext, c.tokens,
         g_.boundary_forward_bytes(c));
  }
  // ... and the start of the next stage's.
  void RecvForward(const ChunkGeometry& c, Phase phase) {
    Recv(*forward_in, Where{phase, c.index, -1}, Stream::kRecvPrev, c.tokens,
         g_.boundary_forward_bytes(c));
  }
  // The end of this stage's backward over chunk `c`: the residual gradient to the previous stage.
  void SendBackward(const ChunkGeometry& c) {
    Send(*backward_out, Where{Phase::kBackward, c.index, -1}, Stream::kSendPrev, c.tokens,
         g_.boundary_backward_bytes(c));
  }
  void RecvBackward(const ChunkGeometry& c) {
    Recv(*backward_in, Where{Phase::kBackward, c.index, -1}, Stream::kRecvNext, c.tokens,
         g_.boundary_backward_bytes(c));
  }

  void Setup() {
    Where w{Phase::kSetup, -1, -1};
    auto gpu = [&](MemCategory category, int64_t bytes) {
      if (bytes > 0)
        batch_.Push(Memory(w, true, Stream::kCompute, MemSpace::kGpu, category, bytes));
    };
    auto host = [&](MemCategory category, int64_t bytes) {
      if (bytes > 0) batch_.Push(Memory(w, true, Stream::kHost, MemSpace::kHost, category, bytes));
    };
    gpu(MemCategory::kWeights, g_.weight_bytes(rank_));
    gpu(MemCategory::kGrads, g_.grad_bytes(rank_));
    if (o_.optimizer == OptimizerKind::kAdamWGpu)
      gpu(MemCategory::kOptimizer, g_.optimizer_state_bytes(rank_));
    gpu(MemCategory::kActivations, g_.activation_bytes() + g_.boundary_buffer_bytes(rank_));
    gpu(MemCategory::kWorkspace, g_.workspace_bytes());
    gpu(MemCategory::kPageSlots, g_.page_slot_bytes());
    // The GPU tier of the page store: KV and dKV of its pages of every layer, up front.
    if (const int64_t tier = g_.gpu_tier_pages(); tier > 0) {
      gpu(MemCategory::kKvPages, tier * StageLayers() * g_.kv_page_bytes());
      gpu(MemCategory::kDkvPages, tier * LayerDkvBytes());
    }
    if (o_.optimizer == OptimizerKind::kAdamWHost) {
      host(MemCategory::kOptimizer, g_.host_optimizer_bytes(rank_));
      host(MemCategory::kGradStaging, g_.grad_bytes(rank_));
    }
  }

  void FillChunkStart(const ChunkGeometry& c) {
    Where w{Phase::kFill, c.index, -1};
    const int64_t layers = StageLayers();
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
    if (first_stage())
      batch_.Push(Kernel(w, OpKind::kEmbeddingForward,
                         EmbeddingForwardCost(c.tokens, m_.hidden_size), c.tokens));
    else
      RecvForward(c, Phase::kFill);
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
    // After the layer before's down projection (or the embedding), which wrote its input.
    batch_.Push(Warm(
        Kernel(w, OpKind::kRmsNormForward, RmsNormForwardCost(t, d), t, 0, 0, OpPart::kAttnNorm)));
    batch_.Push(Kernel(w, OpKind::kLinearForward,
                       LinearForwardCost(t, q + 2 * kv, d, LoraOn(OpPart::kQkv, o_.lora_rank),
                                         /*split_outputs=*/true),
                       t, q + 2 * kv, d, OpPart::kQkv));
    batch_.Push(Warm(Kernel(w, OpKind::kRopeForward, RopeCost(t, q, kv), t)));
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
      Op topk = Kernel(w, OpKind::kPageTopK, PageTopKCost(c.tiles, c.earlier_pages, c.pages_per_tile), t);
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
    batch_.Push(Warm(
        Kernel(w, OpKind::kRmsNormForward, RmsNormForwardCost(t, d), t, 0, 0, OpPart::kMlpNorm)));
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
                       g_.layer_inputs_bytes(c, rank_)));
    if (first_stage())
      batch_.Push(Kernel(w, OpKind::kEmbeddingForward,
                         EmbeddingForwardCost(c.tokens, m_.hidden_size), c.tokens));
    else
      RecvForward(c, Phase::kRecompute);
  }

  void Loss(const ChunkGeometry& c) {
    Where w{Phase::kLoss, c.index, -1};
    const int64_t t = c.tokens, d = m_.hidden_size;
    batch_.Push(Warm(
        Kernel(w, OpKind::kRmsNormForward, RmsNormForwardCost(t, d), t, 0, 0, OpPart::kFinalNorm)));
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
      // Timed at the union's expected size, the dKV pages it brings back too: they are pages of
      // the same union (with the worst case here, a 1M step's backward moved 5.1 TB in the plan
      // where the runtime moved ~3.4).
      const int64_t expected_pretouched = dkv.expected_pretouched_host_union;
      const int64_t expected_bytes = c.expected_host_union_pages * g_.kv_page_bytes() +
                                     (expected_pretouched + own_touched) * g_.dkv_page_bytes();
      const int64_t expected_copies = g_.union_copy_runs(c, c.expected_host_union_pages) +
                                      g_.union_copy_runs(c, expected_pretouched) +
                                      (own_touched > 0 ? 1 : 0);
      h2d = batch_.Push(Copy(w, true, pages, bytes, copies, expected_bytes, expected_copies),
                        {slot_release_[parity], KvHome(layer), DkvHome(layer)});
    }
    const int64_t fresh_pages = c.union_pages - dkv.pretouched_union;
    if (paged && fresh_pages > 0) {
      Op zero = Kernel(w, OpKind::kZeroFill, ZeroFillCost(fresh_pages * g_.dkv_page_bytes()), t);
      zero.pages = fresh_pages;
      batch_.Push(zero);
    }
    // Recompute the layer's internals from its saved input (attention output and LSE are kept):
    // the norm reads it cold, the rest follow their producers.
    batch_.Push(
        Kernel(w, OpKind::kRmsNormForward, RmsNormForwardCost(t, d), t, 0, 0, OpPart::kAttnNorm));
    batch_.Push(
        Kernel(w, OpKind::kLinearForward,
               LinearForwardCost(t, q + 2 * kv, d, LoraOn(OpPart::kQkv, r), /*split_outputs=*/true),
               t, q + 2 * kv, d, OpPart::kQkv));
    batch_.Push(Warm(Kernel(w, OpKind::kRopeForward, RopeCost(t, q, kv), t)));
    batch_.Push(Kernel(w, OpKind::kLinearForward, LinearForwardCost(t, d, q, LoraOn(OpPart::kO, r)),
                       t, d, q, OpPart::kO));
    batch_.Push(Warm(
        Kernel(w, OpKind::kRmsNormForward, RmsNormForwardCost(t, d), t, 0, 0, OpPart::kMlpNorm)));
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
    batch_.Push(Warm(Kernel(w, OpKind::kRopeBackward, RopeCost(t, q, kv), t)));  // dQ, dK
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
    const int64_t layers = StageLayers();
    if (first_stage())
      batch_.Push(Kernel(w, OpKind::kEmbeddingBackward,
                         EmbeddingBackwardCost(c.tokens, m_.hidden_size, o_.grad_bytes()),
                         c.tokens));
    else
      SendBackward(c);
    batch_.Push(Memory(w, false, Stream::kCompute, MemSpace::kGpu, MemCategory::kLayerInputs,
                       g_.layer_inputs_bytes(c, rank_)));
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
    const int64_t params = g_.trainable_params(rank_);
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
        OpId d2h = batch_.Push(Copy(w, false, 0, g_.grad_bytes(rank_)), {batch_.last_compute()});
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
  int64_t StageLayers() const { return end_layer_ - first_layer_; }
  int64_t LayerDkvBytes() const { return StageLayers() * g_.dkv_page_bytes(); }

  void Send(BoundaryLink& link, const Where& w, Stream stream, int64_t tokens, int64_t bytes) {
    const int parity = static_cast<int>(link.sends++ & 1);
    const OpId pack = batch_.Push(Boundary(w, true, tokens, bytes, parity),
                                  {link.last_send[parity], link.last_recv[parity]});
    link.last_send[parity] = batch_.Push(Peer(w, true, stream, tokens, bytes, parity), {pack});
    link.sent.push_back(link.last_send[parity]);
  }
  void Recv(BoundaryLink& link, const Where& w, Stream stream, int64_t tokens, int64_t bytes) {
    CTXPLAN_CHECK(!link.sent.empty(), "a stage receives what was never sent");
    const int parity = static_cast<int>(link.recvs++ & 1);
    const OpId recv = batch_.Push(Peer(w, false, stream, tokens, bytes, parity),
                                  {link.sent.front(), link.last_unpack[parity]});
    link.sent.pop_front();
    link.last_recv[parity] = recv;
    link.last_unpack[parity] = batch_.Push(Boundary(w, false, tokens, bytes, parity), {recv});
  }
  // The last copy that brought this layer's KV (dKV) pages home: a later copy back to the GPU
  // reads what it wrote. Never binding when a chunk of compute separates the two, but the data
  // dependency is real and the CUDA backend must order it.
  OpId KvHome(int32_t layer) const { return Recent(kv_home_[static_cast<size_t>(layer)]); }
  OpId DkvHome(int32_t layer) const { return Recent(dkv_home_[static_cast<size_t>(layer)]); }
  // Beyond the dependency window the copy finished long ago: in-order streams already order it.
  OpId Recent(OpId op) const {
    return op != kNoOp && *next_id_ - op <= StepPlan::kMaxDependencyDistance / 2 ? op : kNoOp;
  }
  int NextSlotParity() { return static_cast<int>(slot_uses_++ & 1); }
  int NextOwnParity() { return static_cast<int>(own_uses_++ & 1); }

  const PlanGeometry& g_;
  const ModelSpec& m_;
  const RunOptions& o_;
  int32_t rank_;
  int32_t first_layer_, end_layer_;  // the stage's layers
  OpId* next_id_;
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
  const PlanGeometry& g = geometry_;
  const int32_t stages = g.stages();
  OpId next_id = 0;
  std::vector<std::unique_ptr<PlanWriter>> writers;
  for (int32_t r = 0; r < stages; ++r)
    writers.push_back(std::make_unique<PlanWriter>(g, r, &next_id));
  // links[2r]: stage r -> r+1 (activations), links[2r+1]: stage r+1 -> r (their gradient).
  std::vector<BoundaryLink> links(static_cast<size_t>(2 * std::max(stages - 1, 0)));
  for (int32_t r = 0; r + 1 < stages; ++r) {
    BoundaryLink* forward = &links[static_cast<size_t>(2 * r)];
    BoundaryLink* backward = &links[static_cast<size_t>(2 * r + 1)];
    writers[static_cast<size_t>(r)]->forward_out = forward;
    writers[static_cast<size_t>(r) + 1]->forward_in = forward;
    writers[static_cast<size_t>(r) + 1]->backward_out = backward;
    writers[static_cast<size_t>(r)]->backward_in = backward;
  }

  for (int32_t r = 0; r < stages; ++r) {
    OpBatch& batch = writers[static_cast<size_t>(r)]->batch();
    batch.Clear();
    writers[static_cast<size_t>(r)]->Setup();
    for (const Op& op : batch.ops()) co_yield op;
  }

  // The stages' items in the schedule's order, so each op follows what it depends on and
  // dependencies stay close.
  std::vector<int64_t> selected_by_later_chunks(static_cast<size_t>(stages), 0);  // T_{i+1}
  PipelineSchedule schedule(g);
  PipelineItem item;
  while (schedule.Next(item)) {
    const auto s = static_cast<size_t>(item.stage);
    PlanWriter& writer = *writers[s];
    OpBatch& batch = writer.batch();
    const ChunkGeometry chunk = g.Chunk(item.chunk);
    if (item.kind == PipelineItemKind::kBackward) {
      const DkvState dkv = g.Dkv(chunk, selected_by_later_chunks[s]);
      batch.Clear();
      if (writer.last_stage()) writer.Loss(chunk);
      writer.BackwardStart(chunk, dkv);
      if (!writer.last_stage()) writer.RecvBackward(chunk);
      for (const Op& op : batch.ops()) co_yield op;
      for (int32_t l = writer.end_layer() - 1; l >= writer.first_layer(); --l) {
        batch.Clear();
        writer.LayerBackward(chunk, dkv, l);
        for (const Op& op : batch.ops()) co_yield op;
      }
      batch.Clear();
      writer.BackwardEnd(chunk, dkv);
      for (const Op& op : batch.ops()) co_yield op;
      selected_by_later_chunks[s] += chunk.union_pages;
      continue;
    }
    const Phase phase = item.kind == PipelineItemKind::kFill ? Phase::kFill : Phase::kRecompute;
    batch.Clear();
    if (phase == Phase::kFill)
      writer.FillChunkStart(chunk);
    else
      writer.RecomputeStart(chunk);
    for (const Op& op : batch.ops()) co_yield op;
    for (int32_t l = writer.first_layer(); l < writer.end_layer(); ++l) {
      batch.Clear();
      writer.LayerForward(chunk, phase, l);
      if (l + 1 == writer.end_layer() && !writer.last_stage()) writer.SendForward(chunk, phase);
      for (const Op& op : batch.ops()) co_yield op;
    }
  }

  for (int32_t r = 0; r < stages; ++r) {
    OpBatch& batch = writers[static_cast<size_t>(r)]->batch();
    batch.Clear();
    writers[static_cast<size_t>(r)]->Optimizer();
    for (const Op& op : batch.ops()) co_yield op;
  }
}

}  // namespace ctxplan
