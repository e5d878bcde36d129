#include "ctxplan/runtime/cpu/cpu_backend.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/op_dispatch.h"
#include "ctxplan/runtime/plan/plan_geometry.h"

namespace ctxplan {

namespace cpu = kernels::cpu;
using kernels::KvPageShape;
using kernels::PagedKv;
using kernels::PageSelection;

class CpuBackend::Impl {
 public:
  static constexpr const char* kName = "CPU backend";
  Impl(const ModelSpec& model, ModelWeights& weights, ModelWeights& grads,
       OptimizerState* optimizer, LoraState* lora)
      : m_(model), w_(weights), g_(grads), optimizer_(optimizer), lora_(lora) {
    d_ = m_.hidden_size;
    q_dim_ = m_.q_dim();
    kv_dim_ = m_.kv_dim();
    inter_ = m_.intermediate_size;
    vocab_ = m_.vocab_size;
    layers_ = m_.num_hidden_layers;
    scale_ = 1.0f / std::sqrt(static_cast<float>(m_.head_dim));
  }

  void BeginStep(const StepPlan& plan, const StepInputs& inputs) {
    o_ = plan.options();
    if (o_.lora_rank > 0 && (lora_ == nullptr || lora_->weights.rank != o_.lora_rank))
      throw InternalError("CPU backend: a LoRA plan of rank " + std::to_string(o_.lora_rank) +
                          " without adapters of that rank");
    frozen_dw_.assign(static_cast<size_t>(d_), 0.0f);
    if (o_.optimizer == OptimizerKind::kAdamWHost || o_.optimizer == OptimizerKind::kAdamWGpu) {
      if (optimizer_ == nullptr) throw InternalError("an optimizer step without optimizer state");
    }
    geometry_.emplace(m_, o_);
    tokens_ = inputs.tokens;
    labels_ = inputs.labels;
    labelled_total_ =
        std::count_if(labels_.begin(), labels_.end(), [](int32_t l) { return l >= 0; });
    shape_ = KvPageShape{o_.page_tokens, m_.num_key_value_heads, m_.head_dim};
    const int64_t total_pages = (o_.context_tokens + o_.page_tokens - 1) / o_.page_tokens;
    const size_t store = static_cast<size_t>(total_pages * shape_.page_elements());
    kv_store_.assign(static_cast<size_t>(layers_), std::vector<float>(store, 0.0f));
    dkv_store_.assign(static_cast<size_t>(layers_), std::vector<float>(store, 0.0f));
    dkv_present_.assign(static_cast<size_t>(layers_),
                        std::vector<char>(static_cast<size_t>(total_pages), 0));
    summaries_.assign(static_cast<size_t>(layers_),
                      std::vector<float>(static_cast<size_t>(total_pages * kv_dim_), 0.0f));
    // With offload: one pool each for KV and dKV, [tier | union slots | own slots] (pool_slots).
    tier_pages_ = geometry_->gpu_tier_pages();
    slot_capacity_ = geometry_->max_host_union_pages();
    const int64_t own_capacity = o_.chunk_tokens / o_.page_tokens;
    kv_pool_.clear();
    dkv_pool_.clear();
    if (o_.offload) {
      const int64_t slots = layers_ * tier_pages_ + slot_capacity_ + own_capacity;
      kv_pool_.assign(static_cast<size_t>(slots * shape_.page_elements()), 0.0f);
      dkv_pool_.assign(kv_pool_.size(), 0.0f);  // the tier's dKV starts at zero
    }
    table_for_ = {-1, -1, -1};
    page_reads_.Reset(layers_, total_pages);
    // What pass 2 reads back: per layer of the current chunk, or per chunk and layer when the
    // fill keeps them.
    const size_t saved = SavedLayerSlots(*geometry_);
    saved_input_.assign(saved, {});
    saved_attn_.assign(saved, {});
    saved_lse_.assign(saved, {});
    saved_selection_.assign(saved, {});
    saved_top_.assign(static_cast<size_t>(geometry_->num_chunks()), {});
    loss_sum_ = 0.0;
    labelled_ = 0;
    ops_ = 0;
    boundary_.clear();
    stage_state_.clear();
    rank_ = 0;
    memory_ = {};
    chunk_index_ = -1;
  }

  StepOutputs EndStep() {
    StepOutputs out;
    out.loss_sum = loss_sum_;
    out.labelled = labelled_;
    out.ops_executed = ops_;
    out.peak_arena_bytes = memory_.peak(MemSpace::kGpu);
    out.peak_host_bytes = memory_.peak(MemSpace::kHost);
    out.page_reads = std::move(page_reads_);
    return out;
  }

  void Execute(const Op& op) {
    if (IsMemory(op.kind)) {
      memory_.Apply(op);
      return;
    }
    ++ops_;
    if (op.rank != rank_) SwitchRank(op.rank);
    if (op.chunk >= 0 && op.chunk != chunk_index_) StartChunk(op.chunk);
    DispatchComputeOp(*this, op);
  }

 private:
  template <typename Backend>
  friend void ctxplan::DispatchComputeOp(Backend& backend, const Op& op);

  int64_t T() const { return c_.tokens; }
  static size_t L(const Op& op) { return static_cast<size_t>(op.layer); }
  size_t S(const Op& op) const { return SavedLayerSlot(op, *geometry_); }
  bool Saves(const Op& op) const { return SavesLayerState(op, o_.keep_layer_inputs); }
  std::span<const int32_t> ChunkTokens() const {
    return tokens_.subspan(static_cast<size_t>(c_.start), static_cast<size_t>(c_.tokens));
  }
  std::span<const int32_t> ChunkLabels() const {
    return labels_.subspan(static_cast<size_t>(c_.start), static_cast<size_t>(c_.tokens));
  }
  LayerWeights& W(const Op& op) { return w_.layers[L(op)]; }
  LayerWeights& G(const Op& op) { return g_.layers[L(op)]; }
  bool Lora() const { return o_.lora_rank > 0; }
  // Where a norm's weight gradient goes: its gradient, or a scratch when the base is frozen.
  float* NormGrad(std::vector<float>& grad) { return Lora() ? frozen_dw_.data() : grad.data(); }
  // The adapters' contribution to a linear part's output y [t][y_stride] (LoRA runs).
  void AddLora(const Op& op, const float* x, float* y, int64_t y_stride) {
    if (!Lora()) return;
    lora_cpu::Forward(lora_->weights.layers[L(op)].Part(op.part), lora_->weights.scale, x, T(), y,
                      y_stride);
  }

  // --- pipeline stage boundaries ----------------------------------------------------------
  // One process runs every stage in the plan's order, so a boundary is a queue per direction and
  // stage: a pack enqueues what a send would carry, the matching unpack (in the plan's order,
  // first in first out, as the sends are) dequeues it. Forward: the residual stream and its
  // pending add, so the next stage finishes the add as one GPU would; backward: its gradient.
  void BoundaryPack(const Op& op) {
    if (op.phase == Phase::kBackward) {
      boundary_[BoundaryKey(op.rank - 1, false)].push_back({dh_, {}});
      return;
    }
    std::vector<float> pending = has_pending_ ? pending_ : std::vector<float>(h_.size(), 0.0f);
    boundary_[BoundaryKey(op.rank, true)].push_back({h_, std::move(pending)});
  }
  void BoundaryUnpack(const Op& op) {
    const bool backward = op.phase == Phase::kBackward;
    auto& queue = boundary_[BoundaryKey(backward ? op.rank : op.rank - 1, !backward)];
    CTXPLAN_CHECK(!queue.empty(), "CPU backend: an unpack before its pack");
    std::pair<std::vector<float>, std::vector<float>> tensors = std::move(queue.front());
    queue.pop_front();
    if (backward) {
      dh_ = std::move(tensors.first);
      return;
    }
    h_ = std::move(tensors.first);
    pending_ = std::move(tensors.second);
    has_pending_ = true;
  }
  // Each stage would run on its own GPU with its own residual stream; here the stages take
  // turns, an item at a time (PipelineSchedule), so the state an item leaves for the stage's
  // next op (the forward's residual stream for the loss, the chunk) is kept per stage.
  struct StageState {
    std::vector<float> h, pending, dh;
    bool has_pending = false;
    int32_t chunk_index = -1;
  };
  void SwitchRank(int32_t rank) {
    if (stage_state_.size() <= static_cast<size_t>(std::max(rank, rank_)))
      stage_state_.resize(static_cast<size_t>(std::max(rank, rank_)) + 1);
    StageState& out = stage_state_[static_cast<size_t>(rank_)];
    out = {std::move(h_), std::move(pending_), std::move(dh_), has_pending_, chunk_index_};
    StageState& in = stage_state_[static_cast<size_t>(rank)];
    h_ = std::move(in.h);
    pending_ = std::move(in.pending);
    dh_ = std::move(in.dh);
    has_pending_ = in.has_pending;
    chunk_index_ = in.chunk_index;
    if (chunk_index_ >= 0) c_ = geometry_->Chunk(chunk_index_);
    rank_ = rank;
  }

  void PeerSend(const Op&) {}  // the queue is the link
  void PeerRecv(const Op&) {}
  // The boundary between stage `lower` and lower + 1, one direction.
  static int64_t BoundaryKey(int32_t lower, bool forward) { return 2 * lower + (forward ? 0 : 1); }

  void StartChunk(int32_t index) {
    chunk_index_ = index;
    c_ = geometry_->Chunk(index);
    const size_t t = static_cast<size_t>(c_.tokens);
    h_.assign(t * static_cast<size_t>(d_), 0.0f);
    pending_.assign(h_.size(), 0.0f);
    has_pending_ = false;
  }

  // --- forward ---------------------------------------------------------------------------
  void EmbeddingForward(const Op&) {
    cpu::EmbeddingForward(ChunkTokens(), w_.embedding.data(), vocab_, d_, h_.data());
    has_pending_ = false;
  }

  void RopeForward(const Op&) {
    cpu::RopeForward(q_.data(), T(), m_.num_attention_heads, m_.head_dim, c_.start, m_.rope_theta);
    cpu::RopeForward(k_.data(), T(), m_.num_key_value_heads, m_.head_dim, c_.start, m_.rope_theta);
  }

  void SwigluForward(const Op&) {
    act_.resize(static_cast<size_t>(T() * inter_));
    cpu::SwigluForward(gate_up_.data(), T(), inter_, act_.data());
  }

  void AddPending() {
    if (!has_pending_) return;
    for (size_t i = 0; i < h_.size(); ++i) h_[i] += pending_[i];
    has_pending_ = false;
  }

  void NormForward(const Op& op) {
    const size_t n = h_.size();
    switch (op.part) {
      case OpPart::kAttnNorm: {
        if (op.phase == Phase::kBackward) {  // recompute internals from the saved input
          x_ = saved_input_[S(op)];
        } else {
          AddPending();
          x_ = h_;
          if (Saves(op)) saved_input_[S(op)] = h_;
        }
        xn_.resize(n);
        rstd1_.resize(static_cast<size_t>(T()));
        cpu::RmsNormForward(x_.data(), W(op).attn_norm.data(), T(), d_,
                            static_cast<float>(m_.rms_norm_eps), xn_.data(), rstd1_.data());
        break;
      }
      case OpPart::kMlpNorm: {
        // h_mid = x + attention output projected; the MLP's norm reads it.
        hmid_.resize(n);
        for (size_t i = 0; i < n; ++i) hmid_[i] = x_[i] + o_out_[i];
        if (op.phase != Phase::kBackward) h_ = hmid_;
        xn2_.resize(n);
        rstd2_.resize(static_cast<size_t>(T()));
        cpu::RmsNormForward(hmid_.data(), W(op).mlp_norm.data(), T(), d_,
                            static_cast<float>(m_.rms_norm_eps), xn2_.data(), rstd2_.data());
        break;
      }
      case OpPart::kFinalNorm: {
        if (o_.keep_layer_inputs) {  // the fill kept the top layer's output
          h_ = saved_top_[static_cast<size_t>(c_.index)];
          has_pending_ = false;
        }
        AddPending();
        xnf_.resize(n);
        rstdf_.resize(static_cast<size_t>(T()));
        cpu::RmsNormForward(h_.data(), w_.final_norm.data(), T(), d_,
                            static_cast<float>(m_.rms_norm_eps), xnf_.data(), rstdf_.data());
        break;
      }
      default:
        throw InternalError("CPU backend: RMSNorm without a part");
    }
  }

  void LinearForward(const Op& op) {
    LayerWeights& w = W(op);
    const int64_t t = T();
    switch (op.part) {
      case OpPart::kQkv: {
        qkv_.resize(static_cast<size_t>(t * (q_dim_ + 2 * kv_dim_)));
        cpu::LinearForward(xn_.data(), w.qkv.data(),
                           w.qkv_bias.empty() ? nullptr : w.qkv_bias.data(), t,
                           q_dim_ + 2 * kv_dim_, d_, qkv_.data());
        AddLora(op, xn_.data(), qkv_.data(), q_dim_ + 2 * kv_dim_);
        SplitQkv();
        break;
      }
      case OpPart::kO:
        o_out_.resize(static_cast<size_t>(t * d_));
        cpu::LinearForward(AttentionOutput(op).data(), w.o.data(), nullptr, t, d_, q_dim_,
                           o_out_.data());
        AddLora(op, AttentionOutput(op).data(), o_out_.data(), d_);
        break;
      case OpPart::kGateUp:
        gate_up_.resize(static_cast<size_t>(t * 2 * inter_));
        cpu::LinearForward(xn2_.data(), w.gate_up.data(), nullptr, t, 2 * inter_, d_,
                           gate_up_.data());
        AddLora(op, xn2_.data(), gate_up_.data(), 2 * inter_);
        break;
      case OpPart::kDown:
        pending_.resize(static_cast<size_t>(t * d_));
        cpu::LinearForward(act_.data(), w.down.data(), nullptr, t, d_, inter_, pending_.data());
        AddLora(op, act_.data(), pending_.data(), d_);
        has_pending_ = true;
        if (op.phase == Phase::kFill && o_.keep_layer_inputs && op.layer == layers_ - 1) {
          std::vector<float>& top = saved_top_[static_cast<size_t>(c_.index)];
          top = h_;
          for (size_t i = 0; i < top.size(); ++i) top[i] += pending_[i];
        }
        break;
      default:
        throw InternalError("CPU backend: linear without a part");
    }
  }

  void SplitQkv() {
    const int64_t t = T(), row = q_dim_ + 2 * kv_dim_;
    q_.resize(static_cast<size_t>(t * q_dim_));
    k_.resize(static_cast<size_t>(t * kv_dim_));
    v_.resize(static_cast<size_t>(t * kv_dim_));
    for (int64_t i = 0; i < t; ++i) {
      const float* r = qkv_.data() + i * row;
      std::copy_n(r, q_dim_, q_.data() + i * q_dim_);
      std::copy_n(r + q_dim_, kv_dim_, k_.data() + i * kv_dim_);
      std::copy_n(r + q_dim_ + kv_dim_, kv_dim_, v_.data() + i * kv_dim_);
    }
  }

  // In the backward the attention output is the one the recompute saved.
  const std::vector<float>& AttentionOutput(const Op& op) const {
    return op.phase == Phase::kBackward ? saved_attn_[S(op)] : attn_;
  }

  // --- pages -----------------------------------------------------------------------------
  float* StorePage(std::vector<float>& store, int64_t page) {
    return store.data() + page * shape_.page_elements();
  }

  // Own pages of the chunk: in the own-slot pool (offload) or straight in the device store.
  PagedKv<float> OwnPages(int32_t layer, bool dkv) {
    own_table_.resize(static_cast<size_t>(c_.own_pages));
    PagedKv<float> pages;
    pages.shape = shape_;
    pages.num_pages = c_.own_pages;
    if (o_.offload) {
      for (int64_t j = 0; j < c_.own_pages; ++j)
        own_table_[static_cast<size_t>(j)] = PoolSlotOfOwn(layer, j);
      pages.pool = (dkv ? dkv_pool_ : kv_pool_).data();
    } else {
      for (int64_t j = 0; j < c_.own_pages; ++j)
        own_table_[static_cast<size_t>(j)] = static_cast<int32_t>(c_.earlier_pages + j);
      pages.pool = (dkv ? dkv_store_ : kv_store_)[static_cast<size_t>(layer)].data();
    }
    pages.page_slot = own_table_.data();
    return pages;
  }

  void KvWrite(const Op& op) { cpu::KvWrite(k_.data(), v_.data(), T(), OwnPages(op.layer, false)); }

  void PageSummary(const Op& op) {
    PagedKv<float> own = OwnPages(op.layer, false);
    PagedKv<const float> view{own.shape, own.pool, own.page_slot, own.num_pages};
    cpu::PageSummary(view, summaries_[L(op)].data() + c_.earlier_pages * kv_dim_);
  }

  void PageScore(const Op& op) {
    scores_.resize(static_cast<size_t>(c_.tiles * c_.earlier_pages));
    cpu::PageScore(q_.data(), T(), m_.num_attention_heads, m_.num_key_value_heads, m_.head_dim,
                   o_.query_tile, summaries_[L(op)].data(), c_.earlier_pages, scores_.data());
  }

  void PageTopK(const Op& op) {
    selection_.resize(static_cast<size_t>(c_.tiles * (o_.page_budget + o_.sink_pages)));
    pages_per_tile_ = cpu::PageTopK(scores_.data(), c_.tiles, c_.earlier_pages, o_.page_budget,
                                    o_.sink_pages, selection_.data());
    selection_.resize(static_cast<size_t>(c_.tiles * pages_per_tile_));
    if (Saves(op)) saved_selection_[S(op)] = selection_;
  }

  std::vector<int32_t> UnionPages(const Op& op) const {
    return AttendedPages(c_, op.phase == Phase::kBackward ? saved_selection_[S(op)] : selection_);
  }

  // Where a page of the pools lives: the GPU tier's pages of every layer first, then the union
  // slots, then the own slots.
  int32_t TierSlot(size_t layer, int64_t page) const {
    return static_cast<int32_t>(static_cast<int64_t>(layer) * tier_pages_ + page);
  }
  int32_t UnionSlot(size_t j) const {
    return static_cast<int32_t>(layers_ * tier_pages_ + static_cast<int64_t>(j));
  }
  int32_t PoolSlotOfOwn(int32_t layer, int64_t j) const {
    const int64_t page = c_.earlier_pages + j;
    if (page < tier_pages_) return TierSlot(static_cast<size_t>(layer), page);
    return static_cast<int32_t>(layers_ * tier_pages_ + slot_capacity_ + j);
  }
  float* Pool(std::vector<float>& pool, int32_t slot) {
    return pool.data() + static_cast<size_t>(slot) * static_cast<size_t>(shape_.page_elements());
  }

  // The slot table of `op`'s layer: every attended page to its tier page or a union slot, the
  // host pages (union_) in slot order. Built by the layer's copy in, or by its attention when
  // no copy came (every page in the tier).
  void StageTable(const Op& op) {
    const std::array<int32_t, 3> key{static_cast<int32_t>(op.phase), op.chunk, op.layer};
    if (table_for_ == key) return;
    table_for_ = key;
    const size_t l = L(op);
    const std::vector<int32_t> attended = UnionPages(op);
    union_.clear();
    slot_table_.assign(static_cast<size_t>(c_.earlier_pages), -1);
    for (const int32_t page : attended) {
      if (page < tier_pages_) {
        slot_table_[static_cast<size_t>(page)] = TierSlot(l, page);
      } else {
        slot_table_[static_cast<size_t>(page)] = UnionSlot(union_.size());
        union_.push_back(page);
      }
    }
    if (static_cast<int64_t>(union_.size()) > slot_capacity_)
      throw InputError(
          "page selections of chunk " + std::to_string(c_.index) + " layer " + std::to_string(l) +
          " need " + std::to_string(union_.size()) + " page slots but the plan provisioned " +
          std::to_string(slot_capacity_) +
          "; accepted: a selection model that bounds the union (--selection disjoint)");
  }

  void CopyIn(const Op& op) {
    if (op.phase == Phase::kOptimizer) return;  // host optimizer: weights are shared on the CPU
    const size_t l = L(op);
    StageTable(op);
    const size_t pe = static_cast<size_t>(shape_.page_elements());
    for (size_t j = 0; j < union_.size(); ++j) {  // the host tier's pages into their slots
      const int64_t page = union_[j];
      std::copy_n(StorePage(kv_store_[l], page), pe, Pool(kv_pool_, UnionSlot(j)));
      if (op.phase == Phase::kBackward) {
        float* slot = Pool(dkv_pool_, UnionSlot(j));
        if (dkv_present_[l][static_cast<size_t>(page)])
          std::copy_n(StorePage(dkv_store_[l], page), pe, slot);
        else
          std::fill_n(slot, pe, 0.0f);
      }
    }
    if (op.phase == Phase::kBackward) {  // the chunk's own dKV, left by later chunks
      for (int64_t j = 0; j < c_.own_pages; ++j) {
        const int64_t page = c_.earlier_pages + j;
        if (page < tier_pages_) continue;  // accumulated in place
        float* slot = Pool(dkv_pool_, PoolSlotOfOwn(op.layer, j));
        if (dkv_present_[l][static_cast<size_t>(page)])
          std::copy_n(StorePage(dkv_store_[l], page), pe, slot);
        else
          std::fill_n(slot, pe, 0.0f);
      }
    }
  }

  void CopyOut(const Op& op) {
    if (op.phase == Phase::kOptimizer) return;
    const size_t l = L(op);
    const size_t pe = static_cast<size_t>(shape_.page_elements());
    if (op.phase == Phase::kFill) {  // the chunk's fresh KV pages of the host tier go home
      for (int64_t j = 0; j < c_.own_pages; ++j) {
        const int64_t page = c_.earlier_pages + j;
        if (page >= tier_pages_)
          std::copy_n(Pool(kv_pool_, PoolSlotOfOwn(op.layer, j)), pe,
                      StorePage(kv_store_[l], page));
      }
      return;
    }
    StageTable(op);
    for (size_t j = 0; j < union_.size(); ++j) {  // accumulated dKV of the host tier goes home
      const int64_t page = union_[j];
      std::copy_n(Pool(dkv_pool_, UnionSlot(j)), pe, StorePage(dkv_store_[l], page));
      dkv_present_[l][static_cast<size_t>(page)] = 1;
    }
  }

  // The earlier pages as the attention kernels see them: slots (offload) or the device store.
  PagedKv<float> Earlier(const Op& op, bool dkv) {
    const size_t l = L(op);
    PagedKv<float> pages;
    pages.shape = shape_;
    pages.num_pages = c_.earlier_pages;
    if (o_.offload) {
      StageTable(op);
      pages.pool = (dkv ? dkv_pool_ : kv_pool_).data();
      pages.page_slot = slot_table_.data();
    } else {
      identity_.resize(static_cast<size_t>(c_.earlier_pages));
      for (size_t i = 0; i < identity_.size(); ++i) identity_[i] = static_cast<int32_t>(i);
      pages.pool = (dkv ? dkv_store_ : kv_store_)[l].data();
      pages.page_slot = identity_.data();
    }
    return pages;
  }

  PageSelection Selection(const Op& op) const {
    PageSelection s;
    s.query_tile = o_.query_tile;
    if (c_.sparse) {
      const std::vector<int32_t>& sel =
          op.phase == Phase::kBackward ? saved_selection_[S(op)] : selection_;
      s.pages_per_tile = static_cast<int64_t>(sel.size()) / c_.tiles;
      s.pages = sel.data();
    }
    return s;
  }

  cpu::AttentionShape Shape() const {
    return {T(), m_.num_attention_heads, m_.num_key_value_heads, m_.head_dim, scale_};
  }

  void AttentionForward(const Op& op) {
    if (!IsLastAttentionOp(op, c_)) return;
    if (c_.earlier_pages > 0) page_reads_.Add(op.layer, UnionPages(op));
    attn_.resize(static_cast<size_t>(T() * q_dim_));
    lse_.resize(static_cast<size_t>(T() * m_.num_attention_heads));
    PagedKv<float> e = Earlier(op, false);
    cpu::AttentionForward(Shape(), q_.data(), k_.data(), v_.data(),
                          PagedKv<const float>{e.shape, e.pool, e.page_slot, e.num_pages},
                          Selection(op), attn_.data(), lse_.data());
    if (Saves(op)) {
      saved_attn_[S(op)] = attn_;
      saved_lse_[S(op)] = lse_;
    }
  }

  void AttentionBackward(const Op& op) {
    if (!IsLastAttentionOp(op, c_)) return;
    if (c_.earlier_pages > 0) page_reads_.Add(op.layer, UnionPages(op));
    const size_t l = L(op), saved = S(op);
    dq_.resize(static_cast<size_t>(T() * q_dim_));
    dk_.resize(static_cast<size_t>(T() * kv_dim_));
    dv_.resize(static_cast<size_t>(T() * kv_dim_));
    PagedKv<float> e = Earlier(op, false);
    PagedKv<float> de = Earlier(op, true);
    cpu::AttentionBackward(Shape(), q_.data(), k_.data(), v_.data(),
                           PagedKv<const float>{e.shape, e.pool, e.page_slot, e.num_pages},
                           Selection(op), saved_attn_[saved].data(), saved_lse_[saved].data(),
                           d_attn_.data(), dq_.data(), dk_.data(), dv_.data(), de);
    if (!o_.offload)
      for (const int32_t page : UnionPages(op)) dkv_present_[l][static_cast<size_t>(page)] = 1;
  }

  void DkvAccumulate(const Op& op) {
    PagedKv<float> own = OwnPages(op.layer, true);
    cpu::DkvAccumulate(PagedKv<const float>{own.shape, own.pool, own.page_slot, own.num_pages}, T(),
                       dk_.data(), dv_.data());
  }

  // --- loss and backward -------------------------------------------------------------------
  void Loss(const Op&) {
    const bool tied = w_.lm_head.empty();
    const float* head = tied ? w_.embedding.data() : w_.lm_head.data();
    float* d_head = Lora() ? nullptr : tied ? g_.embedding.data() : g_.lm_head.data();
    d_xnf_.resize(xnf_.size());
    const float scale = labelled_total_ > 0 ? 1.0f / static_cast<float>(labelled_total_) : 0.0f;
    const std::span<const int32_t> labels = ChunkLabels();
    const double loss =
        cpu::LinearCrossEntropy(xnf_.data(), head, labels, d_, vocab_, T(),
                                std::min(kLossVocabTile, vocab_), scale, d_xnf_.data(), d_head);
    if (!std::isfinite(loss))
      throw TrainingError("the loss of chunk " + std::to_string(c_.index) + " is " +
                          std::to_string(loss) + ": the run diverged");
    loss_sum_ += loss;
    labelled_ += std::count_if(labels.begin(), labels.end(), [](int32_t v) { return v >= 0; });
  }

  void EmbeddingBackward(const Op&) {
    if (!Lora())  // frozen under LoRA
      cpu::EmbeddingBackward(ChunkTokens(), dh_.data(), vocab_, d_, g_.embedding.data());
  }

  void RopeBackward(const Op&) {
    cpu::RopeBackward(dq_.data(), T(), m_.num_attention_heads, m_.head_dim, c_.start,
                      m_.rope_theta);
    cpu::RopeBackward(dk_.data(), T(), m_.num_key_value_heads, m_.head_dim, c_.start,
                      m_.rope_theta);
  }

  void SwigluBackward(const Op&) {
    d_gate_up_.resize(gate_up_.size());
    cpu::SwigluBackward(gate_up_.data(), d_act_.data(), T(), inter_, d_gate_up_.data());
  }

  // Fresh dKV slots are zeroed when the backward's copy stages the union.
  void ZeroFill(const Op&) {}

  void NormBackward(const Op& op) {
    const size_t n = static_cast<size_t>(T() * d_);
    tmp_.resize(n);
    switch (op.part) {
      case OpPart::kFinalNorm:
        dh_.resize(n);
        cpu::RmsNormBackward(h_.data(), w_.final_norm.data(), rstdf_.data(), d_xnf_.data(), T(), d_,
                             dh_.data(), NormGrad(g_.final_norm));
        break;
      case OpPart::kMlpNorm:  // d h_mid = dh (residual) + the norm's share
        cpu::RmsNormBackward(hmid_.data(), W(op).mlp_norm.data(), rstd2_.data(), d_xn2_.data(), T(),
                             d_, tmp_.data(), NormGrad(G(op).mlp_norm));
        d_hmid_.resize(n);
        for (size_t i = 0; i < n; ++i) d_hmid_[i] = dh_[i] + tmp_[i];
        break;
      case OpPart::kAttnNorm:  // d x = d h_mid (residual) + the norm's share: the layer below's dh
        cpu::RmsNormBackward(x_.data(), W(op).attn_norm.data(), rstd1_.data(), d_xn_.data(), T(),
                             d_, tmp_.data(), NormGrad(G(op).attn_norm));
        for (size_t i = 0; i < n; ++i) dh_[i] = d_hmid_[i] + tmp_[i];
        break;
      default:
        throw InternalError("CPU backend: RMSNorm backward without a part");
    }
  }

  // (x, dY, dX) of a linear part, for its adapters' backward after the base's.
  void LoraBackward(const Op& op, bool input, const float* x, const float* dy, int64_t dy_stride,
                    float* dx) {
    const size_t l = L(op);
    lora_cpu::Backward(lora_->weights.layers[l].Part(op.part), lora_->weights.scale, x, dy,
                       dy_stride, T(), input ? dx : nullptr,
                       input ? nullptr : &lora_->grads.layers[l].Part(op.part));
  }

  void LinearBackward(const Op& op, bool input) {
    LinearBackwardBase(op, input);
    if (!Lora()) return;
    const int64_t qkv = q_dim_ + 2 * kv_dim_;
    switch (op.part) {
      case OpPart::kDown:
        LoraBackward(op, input, act_.data(), dh_.data(), d_, d_act_.data());
        break;
      case OpPart::kGateUp:
        LoraBackward(op, input, xn2_.data(), d_gate_up_.data(), 2 * inter_, d_xn2_.data());
        break;
      case OpPart::kO:
        LoraBackward(op, input, saved_attn_[S(op)].data(), d_hmid_.data(), d_, d_attn_.data());
        break;
      case OpPart::kQkv:
        if (!input) JoinQkvGradient();  // (the input op joined it already; cheap to redo)
        LoraBackward(op, input, xn_.data(), dqkv_.data(), qkv, d_xn_.data());
        break;
      default:
        throw InternalError("CPU backend: linear backward without a part");
    }
  }

  void LinearBackwardBase(const Op& op, bool input) {
    LayerWeights& w = W(op);
    LayerWeights& g = G(op);
    const int64_t t = T();
    if (!input && Lora()) return;  // the base weights are frozen
    // (x, W, dY) of each projection; dX overwritten by the input op, dW accumulated by the
    // weight op.
    switch (op.part) {
      case OpPart::kDown:
        if (input) d_act_.resize(static_cast<size_t>(t * inter_));
        cpu::LinearBackward(act_.data(), w.down.data(), dh_.data(), t, d_, inter_,
                            input ? d_act_.data() : nullptr, input ? nullptr : g.down.data(),
                            nullptr);
        break;
      case OpPart::kGateUp:
        if (input) d_xn2_.resize(static_cast<size_t>(t * d_));
        cpu::LinearBackward(xn2_.data(), w.gate_up.data(), d_gate_up_.data(), t, 2 * inter_, d_,
                            input ? d_xn2_.data() : nullptr, input ? nullptr : g.gate_up.data(),
                            nullptr);
        break;
      case OpPart::kO:
        if (input) d_attn_.resize(static_cast<size_t>(t * q_dim_));
        cpu::LinearBackward(saved_attn_[S(op)].data(), w.o.data(), d_hmid_.data(), t, d_, q_dim_,
                            input ? d_attn_.data() : nullptr, input ? nullptr : g.o.data(),
                            nullptr);
        break;
      case OpPart::kQkv: {
        if (input) {
          JoinQkvGradient();
          d_xn_.resize(static_cast<size_t>(t * d_));
        }
        cpu::LinearBackward(xn_.data(), w.qkv.data(), dqkv_.data(), t, q_dim_ + 2 * kv_dim_, d_,
                            input ? d_xn_.data() : nullptr, input ? nullptr : g.qkv.data(),
                            input || g.qkv_bias.empty() ? nullptr : g.qkv_bias.data());
        break;
      }
      default:
        throw InternalError("CPU backend: linear backward without a part");
    }
  }

  void JoinQkvGradient() {
    const int64_t t = T(), row = q_dim_ + 2 * kv_dim_;
    dqkv_.resize(static_cast<size_t>(t * row));
    for (int64_t i = 0; i < t; ++i) {
      float* r = dqkv_.data() + i * row;
      std::copy_n(dq_.data() + i * q_dim_, q_dim_, r);
      std::copy_n(dk_.data() + i * kv_dim_, kv_dim_, r + q_dim_);
      std::copy_n(dv_.data() + i * kv_dim_, kv_dim_, r + q_dim_ + kv_dim_);
    }
  }

  void OptimizerStep(const Op& op) {
    // Every stage steps its own parameters; this one process holds them all and steps them once,
    // at the last stage's step (the plan's last op).
    if (op.rank != geometry_->last_stage()) return;
    if (Lora()) {  // the adapters alone
      std::vector<std::vector<float>*> w, g, m, v;
      lora_->weights.ForEach([&](const std::string&, std::vector<float>& t) { w.push_back(&t); });
      lora_->grads.ForEach([&](const std::string&, std::vector<float>& t) { g.push_back(&t); });
      lora_->m.ForEach([&](const std::string&, std::vector<float>& t) { m.push_back(&t); });
      lora_->v.ForEach([&](const std::string&, std::vector<float>& t) { v.push_back(&t); });
      for (size_t i = 0; i < w.size(); ++i)
        cpu::AdamW(w[i]->data(), g[i]->data(), m[i]->data(), v[i]->data(),
                   static_cast<int64_t>(w[i]->size()), optimizer_->params);
      ++optimizer_->params.step;
      return;
    }
    std::vector<std::vector<float>*> w, g, m, v;
    w_.ForEach([&](const std::string&, std::vector<float>& t) { w.push_back(&t); });
    g_.ForEach([&](const std::string&, std::vector<float>& t) { g.push_back(&t); });
    optimizer_->m.ForEach([&](const std::string&, std::vector<float>& t) { m.push_back(&t); });
    optimizer_->v.ForEach([&](const std::string&, std::vector<float>& t) { v.push_back(&t); });
    CTXPLAN_CHECK(w.size() == g.size() && w.size() == m.size() && w.size() == v.size(),
                  "optimizer state does not match the weights");
    for (size_t i = 0; i < w.size(); ++i)
      cpu::AdamW(w[i]->data(), g[i]->data(), m[i]->data(), v[i]->data(),
                 static_cast<int64_t>(w[i]->size()), optimizer_->params);
    ++optimizer_->params.step;
  }

  // --- state -------------------------------------------------------------------------------
  const ModelSpec& m_;
  ModelWeights& w_;
  ModelWeights& g_;
  OptimizerState* optimizer_;
  LoraState* lora_;
  std::vector<float> frozen_dw_;  // [d]: where frozen norms' weight gradients go under LoRA
  int64_t d_ = 0, q_dim_ = 0, kv_dim_ = 0, inter_ = 0, vocab_ = 0, layers_ = 0;
  float scale_ = 1.0f;

  RunOptions o_;
  std::optional<PlanGeometry> geometry_;
  std::span<const int32_t> tokens_, labels_;
  int64_t labelled_total_ = 0;
  KvPageShape shape_;

  // Page stores, per layer: [pages][2][p][H_kv][d_h]. The host's when offload is on (staged into
  // the slot pools), the device's when it is off.
  std::vector<std::vector<float>> kv_store_, dkv_store_;
  std::vector<std::vector<char>> dkv_present_;  // [layer][page]: dKV written at least once
  std::vector<std::vector<float>> summaries_;   // [layer][pages][kv_dim]
  // With offload: [layers x tier pages | union slots | own slots][page elements]; the GPU
  // tier's pages (RunOptions::gpu_tier_pages) never go to the stores above.
  int64_t tier_pages_ = 0, slot_capacity_ = 0;
  std::vector<float> kv_pool_, dkv_pool_;
  std::vector<int32_t> union_;       // the host tier's pages staged for the layer, slot order
  std::vector<int32_t> slot_table_;  // [earlier pages] -> pool slot or -1
  std::array<int32_t, 3> table_for_{-1, -1, -1};  // the (phase, chunk, layer) of slot_table_
  std::vector<int32_t> own_table_, identity_;

  // The current chunk.
  int32_t chunk_index_ = -1;
  ChunkGeometry c_;
  std::vector<float> h_;        // [t][d] residual stream
  std::vector<float> pending_;  // [t][d] the MLP output still to be added to h_
  // Pipeline boundaries in flight: (residual stream or its gradient, pending add) by BoundaryKey.
  std::map<int64_t, std::deque<std::pair<std::vector<float>, std::vector<float>>>> boundary_;
  std::vector<StageState> stage_state_;  // [rank], of the stages not running now
  int32_t rank_ = 0;                     // the stage running now
  bool has_pending_ = false;
  std::vector<float> x_, xn_, rstd1_, qkv_, q_, k_, v_, attn_, lse_, o_out_, hmid_, xn2_, rstd2_,
      gate_up_, act_, xnf_, rstdf_;
  std::vector<float> scores_;
  std::vector<int32_t> selection_;  // [tiles][pages_per_tile]
  int64_t pages_per_tile_ = 0;
  std::vector<std::vector<float>> saved_input_, saved_attn_, saved_lse_;  // [layer][...]
  std::vector<std::vector<int32_t>> saved_selection_;                     // [layer][...]
  std::vector<std::vector<float>> saved_top_;  // [chunk][t][d]: top layer output, when kept
  // Gradients of the current chunk.
  std::vector<float> dh_, d_act_, d_gate_up_, d_xn2_, d_hmid_, d_attn_, dq_, dk_, dv_, dqkv_, d_xn_,
      d_xnf_, tmp_;

  double loss_sum_ = 0.0;
  int64_t labelled_ = 0;
  uint64_t ops_ = 0;
  PlanMemoryTally memory_;
  PageReads page_reads_;
};

CpuBackend::CpuBackend(const ModelSpec& model, ModelWeights& weights, ModelWeights& grads,
                       OptimizerState* optimizer, LoraState* lora)
    : impl_(std::make_unique<Impl>(model, weights, grads, optimizer, lora)) {}
CpuBackend::~CpuBackend() = default;
void CpuBackend::BeginStep(const StepPlan& plan, const StepInputs& inputs) {
  impl_->BeginStep(plan, inputs);
}
void CpuBackend::Execute(const Op& op) {
  impl_->Execute(op);
}
StepOutputs CpuBackend::EndStep() {
  return impl_->EndStep();
}

}  // namespace ctxplan
