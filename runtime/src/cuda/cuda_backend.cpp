// The CUDA backend's construction: every device buffer laid out in one arena, the weights (and
// LoRA adapters) uploaded, the host page stores pinned, each start-up phase timed. And CudaBackend
// itself, which builds the TypedImpl of the run's gradient dtype and forwards to it.
#include "ctxplan/runtime/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/cuda/weights_upload.h"
#include "cuda_backend_impl.h"

namespace ctxplan::cuda_backend_detail {

namespace {

// Seconds of the steady clock since `start`: ctxtrain's start-up phases, measured where they run.
double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

template <typename G>
TypedImpl<G>::TypedImpl(const StepPlan& plan, ModelWeights weights, CudaAdamW adamw,
                        std::ostream* log, const LoraWeights* lora, StagePeers* peers)
    : m_(plan.model()), o_(plan.options()), g_(plan.geometry()), adamw_(adamw), peers_(peers) {
  const auto constructed = std::chrono::steady_clock::now();
  rank_ = peers_ ? peers_->rank() : 0;
  if (g_.stages() != (peers_ ? peers_->world_size() : 1))
    throw InternalError("CUDA backend: a plan of " + std::to_string(g_.stages()) +
                        " pipeline stages run by " +
                        std::to_string(peers_ ? peers_->world_size() : 1) + " ranks");
  // A tied LM head: the first and the last stage each hold the embedding and sum their two
  // gradients of it before the optimizer, over the world (with two GPUs, the only ranks; more
  // are refused by RunOptions::Validate).
  sums_tied_embedding_ = g_.stages() == 2 && m_.tie_word_embeddings && o_.lora_rank == 0;
  first_layer_ = g_.stage_first_layer(rank_);
  end_layer_ = g_.stage_first_layer(rank_ + 1);
  stage_layers_ = end_layer_ - first_layer_;
  SliceToStage(weights);
  if (o_.lora_rank > 0 && (lora == nullptr || lora->rank != o_.lora_rank))
    throw InternalError("CUDA backend: a LoRA plan of rank " + std::to_string(o_.lora_rank) +
                        " without adapters of that rank");
  if (o_.lora_rank > 0 && o_.optimizer == OptimizerKind::kAdamWHost)
    throw InputError(
        "--optimizer adamw-host with --lora-rank: the CUDA backend steps LoRA "
        "adapters on the GPU; accepted: adamw-gpu, none");
  if (m_.head_dim != 64 && m_.head_dim != 128)
    throw InputError("model head_dim " + std::to_string(m_.head_dim) +
                     ": the CUDA attention kernels take 64 or 128");
  if (!o_.dense() && o_.query_tile % 128 != 0)
    throw InputError("--query-tile " + std::to_string(o_.query_tile) +
                     ": the CUDA page-sparse attention selects pages per 128 queries; accepted: "
                     "a multiple of 128");
  fault_ = gpu::InjectedFaultFromEnvironment(rank_);
  d_ = m_.hidden_size;
  q_dim_ = m_.q_dim();
  kv_dim_ = m_.kv_dim();
  qkv_dim_ = q_dim_ + 2 * kv_dim_;
  inter_ = m_.intermediate_size;
  vocab_ = m_.vocab_size;
  layers_ = m_.num_hidden_layers;
  scale_ = 1.0f / std::sqrt(static_cast<float>(m_.head_dim));
  shape_ = KvPageShape{o_.page_tokens, m_.num_key_value_heads, m_.head_dim};
  pe_ = shape_.page_elements();
  total_pages_ = (o_.context_tokens + o_.page_tokens - 1) / o_.page_tokens;
  own_capacity_ = o_.chunk_tokens / o_.page_tokens;
  slot_capacity_ = std::max<int64_t>(g_.max_union_pages(), 1);
  // The GPU tier (offload with RunOptions::gpu_tier_pages): one pool each for KV and dKV holds
  // the tier's pages of every layer, then the union slots and own slots of both parities
  // (TierPool); page tables index it. Its slots stage the host tier's pages only.
  tier_pages_ = g_.gpu_tier_pages();
  host_slot_capacity_ = std::max<int64_t>(g_.max_host_union_pages(), 1);

  for (cudaStream_t* s : {&compute_, &h2d_, &d2h_})
    CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
  events_.resize(kEventRing);
  for (cudaEvent_t& e : events_)
    CTXPLAN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  event_op_.assign(kEventRing, kNoOp);

  // Every device buffer, by category, then one arena for all of them.
  ArenaPlan want;
  WantLike(want, weights_, weights, MemCategory::kWeights, "weights");  // bf16
  if (o_.lora_rank == 0) {  // under LoRA the base is frozen: no gradients, no moments
    WantLike(want, grads_, weights, MemCategory::kGrads, "gradients");  // G
    if (o_.optimizer == OptimizerKind::kAdamWGpu) {
      WantLike(want, adam_m_, weights, MemCategory::kOptimizer, "AdamW m");  // fp32
      WantLike(want, adam_v_, weights, MemCategory::kOptimizer, "AdamW v");
    }
  } else {
    // The base's gradients stay empty arrays, one set per layer, so Grad(op) stays valid. The
    // adapters of this stage's layers only: another stage's stay empty (their projections
    // absent), so uploads, steps and downloads pass them by.
    grads_.layers.resize(static_cast<size_t>(layers_));
    lora_scale_ = lora->scale;
    lora_.resize(static_cast<size_t>(layers_));
    for (size_t l = 0; l < lora_.size(); ++l)
      for (OpPart part : kLoraParts) {
        if (!Owns(static_cast<int32_t>(l))) continue;
        const std::vector<LoraProjection>& host = lora->layers[l].Part(part);
        std::vector<DeviceLoraProjection<G>>& dev = LoraPart(l, part);
        dev.resize(host.size());
        for (size_t n = 0; n < host.size(); ++n) {
          DeviceLoraProjection<G>& d = dev[n];
          d.out_offset = host[n].out_offset;
          d.out = host[n].out;
          d.in = host[n].in;
          want.Want(d.a, host[n].a.size(), MemCategory::kWeights, "LoRA A [r][in]");
          want.Want(d.b, host[n].b.size(), MemCategory::kWeights, "LoRA B [out][r]");
          want.Want(d.grad_a, host[n].a.size(), MemCategory::kGrads, "LoRA dA");
          want.Want(d.grad_b, host[n].b.size(), MemCategory::kGrads, "LoRA dB");
          if (o_.optimizer == OptimizerKind::kAdamWGpu)
            for (DeviceArray<float>* moment : {&d.m_a, &d.v_a})
              want.Want(*moment, host[n].a.size(), MemCategory::kOptimizer, "LoRA moments");
          if (o_.optimizer == OptimizerKind::kAdamWGpu)
            for (DeviceArray<float>* moment : {&d.m_b, &d.v_b})
              want.Want(*moment, host[n].b.size(), MemCategory::kOptimizer, "LoRA moments");
        }
      }
    const auto rows = static_cast<size_t>(o_.chunk_tokens * o_.lora_rank);
    want.Want(lora_u_, rows, MemCategory::kActivations, "LoRA x A^T [c][r]");
    want.Want(lora_du_, rows, MemCategory::kActivations, "LoRA dy B [c][r]");
    want.Want(frozen_dw_, static_cast<size_t>(d_), MemCategory::kWorkspace,
              "frozen norm gradient [d]");
  }

  // One layer's activations and their gradients, for c tokens: PlanGeometry::activation_bytes
  // counts these buffers one by one, so a buffer added here is added there.
  const auto c = static_cast<size_t>(o_.chunk_tokens);
  constexpr MemCategory kAct = MemCategory::kActivations;
  for (DeviceArray<bf16>* b : {&h_, &h_alt_, &pending_, &xn_, &o_out_, &hmid_, &xn2_, &xnf_, &hf_,
                               &dh_, &d_hmid_, &d_xn2_, &d_xn_, &d_xnf_})
    want.Want(*b, c * static_cast<size_t>(d_), kAct, "[c][d] activation");
  want.Want(qkv_, c * static_cast<size_t>(qkv_dim_), kAct, "qkv [c][q+2kv]");
  want.Want(dqkv_, qkv_.size(), kAct, "dqkv [c][q+2kv]");
  for (DeviceArray<bf16>* b : {&q_, &attn_, &dq_, &d_attn_})
    want.Want(*b, c * static_cast<size_t>(q_dim_), kAct, "[c][H_q*d_h] activation");
  for (DeviceArray<bf16>* b : {&k_, &v_, &dk_, &dv_})
    want.Want(*b, c * static_cast<size_t>(kv_dim_), kAct, "[c][H_kv*d_h] activation");
  want.Want(gate_up_, c * 2 * static_cast<size_t>(inter_), kAct, "gate_up [c][2i]");
  want.Want(d_gate_up_, gate_up_.size(), kAct, "d_gate_up [c][2i]");
  want.Want(act_, c * static_cast<size_t>(inter_), kAct, "act [c][i]");
  want.Want(d_act_, act_.size(), kAct, "d_act [c][i]");
  want.Want(lse_, c * static_cast<size_t>(m_.num_attention_heads), kAct, "lse [c][H_q]");
  for (DeviceArray<float>* b : {&rstd1_, &rstd2_, &rstdf_}) want.Want(*b, c, kAct, "rstd [c]");
  const int64_t tiles = (o_.chunk_tokens + o_.query_tile - 1) / o_.query_tile;
  want.Want(scores_, static_cast<size_t>(tiles * std::max<int64_t>(total_pages_, 1)), kAct,
            "page scores [tiles][pages]");
  const int64_t per_tile = o_.dense() ? 1 : o_.page_budget + o_.sink_pages;
  want.Want(selected_, static_cast<size_t>(tiles * per_tile), kAct, "selection [tiles][k+s]");
  selected_host_.Resize(selected_.size());
  if (!o_.dense())  // the union of a sparse backward's selections, per parity
    for (int p = 0; p < 2; ++p) {
      want.Want(union_dev_[p], static_cast<size_t>(slot_capacity_), kAct, "union [pages]");
      union_host_[p].Resize(static_cast<size_t>(slot_capacity_));
      CTXPLAN_CUDA_CHECK(cudaEventCreateWithFlags(&union_copied_[p], cudaEventDisableTiming));
    }

  // Workspaces.
  constexpr MemCategory kWs = MemCategory::kWorkspace;
  want.Want(norm_scratch_, k::RmsNormBackwardScratchBytes(o_.chunk_tokens, d_), kWs,
            "RMSNorm backward scratch");
  if (!Lora())
    want.Want(final_norm_partials_, k::RmsNormBackwardScratchBytes(o_.chunk_tokens, d_) / 4, kWs,
              "final norm d_weight partials [rows][d]");
  const k::AttentionShape full{o_.chunk_tokens, m_.num_attention_heads, m_.num_key_value_heads,
                               m_.head_dim, scale_};
  want.Want(attention_ws_, k::AttentionBackwardWorkspaceBytes(full), kWs,
            "attention backward workspace");
  want.Want(score_ws_,
            k::PageScoreWorkspaceBytes(o_.chunk_tokens, m_.num_key_value_heads, m_.head_dim,
                                       o_.query_tile),
            kWs, "page score workspace");
  want.Want(loss_ws_, k::LinearCrossEntropyWorkspaceBytes(LossShape(o_.chunk_tokens)), kWs,
            "loss workspace");
  want.Want(loss_, static_cast<size_t>(g_.num_chunks()), kWs, "loss per chunk");
  want.Want(tokens_, static_cast<size_t>(o_.context_tokens), kWs, "tokens [n]");
  want.Want(labels_, static_cast<size_t>(o_.context_tokens), kWs, "labels [n]");

  // What pass 2 reads back: per layer of one chunk, or of every chunk when kept.
  const size_t saved = SavedLayerSlots(g_, rank_);
  saved_input_.resize(saved);
  saved_attn_.resize(saved);
  saved_lse_.resize(saved);
  saved_selection_.resize(saved);
  saved_selection_host_.resize(saved);
  constexpr MemCategory kIn = MemCategory::kLayerInputs;
  for (size_t i = 0; i < saved; ++i) {
    if (!Owns(static_cast<int32_t>(i % static_cast<size_t>(layers_)))) continue;
    want.Want(saved_input_[i], c * static_cast<size_t>(d_), kIn, "layer input [c][d]");
    want.Want(saved_attn_[i], c * static_cast<size_t>(q_dim_), kIn, "attention out [c][q]");
    want.Want(saved_lse_[i], lse_.size(), kIn, "lse [c][H_q]");
    want.Want(saved_selection_[i], selected_.size(), kIn, "selection [tiles][k+s]");
  }
  const auto cd = c * static_cast<size_t>(d_);
  for (int p = 0; p < 2; ++p) {
    if (rank_ < g_.last_stage()) {
      want.Want(forward_send_[p], 2 * cd, kAct, "boundary out [2][c][d]");
      want.Want(backward_recv_[p], cd, kAct, "boundary gradient in [c][d]");
    }
    if (rank_ > 0) {
      want.Want(forward_recv_[p], 2 * cd, kAct, "boundary in [2][c][d]");
      want.Want(backward_send_[p], cd, kAct, "boundary gradient out [c][d]");
    }
  }
  if (o_.keep_layer_inputs) {
    saved_top_h_.resize(static_cast<size_t>(g_.num_chunks()));
    saved_top_pending_.resize(static_cast<size_t>(g_.num_chunks()));
    for (auto* v : {&saved_top_h_, &saved_top_pending_})
      for (DeviceArray<bf16>& b : *v) want.Want(b, c * static_cast<size_t>(d_), kIn, "top [c][d]");
  }

  // Pages: summaries on the GPU; KV and dKV either in pinned host page stores with GPU slot
  // pools, or in device stores.
  summaries_.resize(static_cast<size_t>(layers_));
  for (int32_t l = first_layer_; l < end_layer_; ++l)
    want.Want(summaries_[static_cast<size_t>(l)],
              static_cast<size_t>(std::max<int64_t>(total_pages_, 1) * kv_dim_),
              MemCategory::kPageSummaries, "summaries [pages][H_kv][d_h]");
  want.Want(identity_, static_cast<size_t>(std::max<int64_t>(total_pages_, 1)), kWs,
            "identity page table");
  want.Want(own_identity_, static_cast<size_t>(own_capacity_), kWs, "own page table");
  // Device page stores (offload off) hold the pages that go home: the last chunk writes none
  // (PlanGeometry::writes_pages), and no later chunk adds dKV into it. At 32K tokens in one
  // chunk of 32K that is every page, 3.5 GiB at 7B.
  const auto store = static_cast<size_t>(
      std::max<int64_t>(total_pages_ - g_.Chunk(g_.num_chunks() - 1).own_pages, 1) * pe_);
  if (o_.offload && tier_pages_ > 0) {
    const auto pool = static_cast<size_t>(TierPoolPages() * pe_);
    want.Want(tier_kv_pool_, pool, MemCategory::kKvPages, "GPU tier KV + slots");
    want.Want(tier_dkv_pool_, pool, MemCategory::kDkvPages, "GPU tier dKV + slots");
    for (int p = 0; p < 2; ++p) {
      want.Want(slot_table_[p], static_cast<size_t>(std::max<int64_t>(total_pages_, 1)),
                MemCategory::kPageSlots, "slot table [pages]");
      slot_table_host_[p].Resize(slot_table_[p].size());
      want.Want(tier_own_table_[p], static_cast<size_t>(own_capacity_), MemCategory::kPageSlots,
                "own page table [own pages]");
    }
    want.Want(tier_table_, static_cast<size_t>(std::max<int64_t>(total_pages_, 1)),
              MemCategory::kPageSlots, "GPU tier page table [pages]");
  } else if (o_.offload) {
    for (int p = 0; p < 2; ++p) {
      const auto slots = static_cast<size_t>(slot_capacity_ * pe_);
      const auto own = static_cast<size_t>(own_capacity_ * pe_);
      want.Want(kv_slots_[p], slots, MemCategory::kPageSlots, "KV slots");
      want.Want(dkv_slots_[p], slots, MemCategory::kPageSlots, "dKV slots");
      want.Want(own_kv_slots_[p], own, MemCategory::kPageSlots, "own KV slots");
      want.Want(own_dkv_slots_[p], own, MemCategory::kPageSlots, "own dKV slots");
      want.Want(slot_table_[p], static_cast<size_t>(std::max<int64_t>(total_pages_, 1)),
                MemCategory::kPageSlots, "slot table [pages]");
      slot_table_host_[p].Resize(slot_table_[p].size());
    }
  } else {
    device_kv_.resize(static_cast<size_t>(layers_));
    device_dkv_.resize(static_cast<size_t>(layers_));
    for (int32_t l = first_layer_; l < end_layer_; ++l) {
      want.Want(device_kv_[static_cast<size_t>(l)], store, MemCategory::kKvPages, "KV pages");
      want.Want(device_dkv_[static_cast<size_t>(l)], store, MemCategory::kDkvPages, "dKV pages");
    }
  }
  if (fault_ == gpu::InjectedFault::kArenaOom)
    want.ReserveExtra(uint64_t{1} << 50, MemCategory::kWorkspace);
  if (fault_ == gpu::InjectedFault::kCopyError) {  // a device address that was, and is no more
    CTXPLAN_CUDA_CHECK(cudaMalloc(&freed_device_memory_, kFreedBytes));
    CTXPLAN_CUDA_CHECK(cudaFree(freed_device_memory_));
  }
  auto phase = std::chrono::steady_clock::now();
  arena_ = want.Commit(log);
  startup_.arena_seconds = SecondsSince(phase);

  phase = std::chrono::steady_clock::now();
  Upload(weights);  // and frees them: the host RAM is for the pinned pages pinned next
  if (o_.lora_rank > 0) UploadLora(*lora);
  startup_.weights_upload_seconds = SecondsSince(phase);  // synchronous copies: all done here
  if (o_.optimizer == OptimizerKind::kAdamWHost) {
    // The host keeps the moments and a copy of the weights it updates; the gradients come
    // home into pinned staging. Regions are copied whole (tensor padding included).
    // Start-up counts all of it as pinning: the host optimizer's buffers, set up once.
    phase = std::chrono::steady_clock::now();
    host_grads_.Resize(arena_->category_stats(MemCategory::kGrads).reserved_bytes / sizeof(G));
    host_weights_.Resize(arena_->category_stats(MemCategory::kWeights).reserved_bytes /
                         sizeof(bf16));
    CTXPLAN_CUDA_CHECK(cudaMemcpy(host_weights_.get(), Region(MemCategory::kWeights),
                                  host_weights_.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    size_t params = 0;
    weights_.ForEach([&](DeviceArray<bf16>& t) { params += t.size(); });
    host_m_.assign(params, 0.0f);
    host_v_.assign(params, 0.0f);
    startup_.pinning_seconds += SecondsSince(phase);
  }
  if (o_.optimizer == OptimizerKind::kAdamWGpu) {
    ClearRegion(MemCategory::kOptimizer);
  }
  ZeroGrads();
  std::vector<int32_t> identity(identity_.size());
  for (size_t i = 0; i < identity.size(); ++i) identity[i] = static_cast<int32_t>(i);
  CTXPLAN_CUDA_CHECK(
      cudaMemcpy(identity_.get(), identity.data(), identity_.bytes(), cudaMemcpyHostToDevice));
  CTXPLAN_CUDA_CHECK(cudaMemcpy(own_identity_.get(), identity.data(), own_identity_.bytes(),
                                cudaMemcpyHostToDevice));

  // Pinned host homes of the pages: pinned up front (pinning synchronises the device), pages
  // handed out as chunks write them; dKV pages only on their first write.
  if (o_.offload) {
    phase = std::chrono::steady_clock::now();
    try {
      gpu::PinnedPageStoreOptions kv;
      kv.page_bytes = static_cast<uint64_t>(pe_) * sizeof(bf16);
      // The last chunk writes no pages home (writes_pages): neither its KV nor, being attended
      // by no later chunk, its dKV.
      // Pages of the GPU tier have no host home.
      const int64_t homed = g_.host_store_pages();
      kv.capacity_pages = static_cast<uint64_t>(stage_layers_ * homed);
      kv.category = MemCategory::kKvPages;
      if (fault_ == gpu::InjectedFault::kPinnedAlloc) {  // one block of a PiB: cudaHostAlloc fails
        kv.block_bytes = uint64_t{1} << 50;
        kv.capacity_pages = kv.block_bytes / kv.page_bytes;
      }
      kv_store_ = std::make_unique<gpu::PinnedPageStore>(kv, log);
      gpu::PinnedPageStoreOptions dkv;
      dkv.page_bytes = static_cast<uint64_t>(pe_) * sizeof(G);
      dkv.capacity_pages = fault_ == gpu::InjectedFault::kHostStore
                               ? 1
                               : static_cast<uint64_t>(stage_layers_ * homed);
      dkv.category = MemCategory::kDkvPages;
      dkv_store_ = std::make_unique<gpu::PinnedPageStore>(dkv, log);
    } catch (const gpu::PinnedMemoryError& e) {
      throw TrainingError(std::string("cannot pin the host page stores: ") + e.what());
    }
    startup_.pinning_seconds += SecondsSince(phase);
    kv_page_.assign(static_cast<size_t>(layers_),
                    std::vector<gpu::PageId>(static_cast<size_t>(total_pages_), gpu::kNoPage));
    dkv_page_ = kv_page_;
  }
  CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
  arena_->SampleDeviceUsed();
  startup_.total_seconds = SecondsSince(constructed);
}

template <typename G>
TypedImpl<G>::~TypedImpl() {
  // Destroyed by a failure mid-step: NCCL kernels still waiting for a peer would hold the
  // synchronisation below (and any cudaFree) forever.
  if (peers_ != nullptr && std::uncaught_exceptions() > 0) peers_->Abort();
  cudaDeviceSynchronize();
  for (cudaEvent_t e : union_copied_)
    if (e != nullptr) cudaEventDestroy(e);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  for (cudaStream_t s : {compute_, h2d_, d2h_}) cudaStreamDestroy(s);
}

template <typename G>
CudaMemoryReport TypedImpl<G>::Memory() {
  CudaMemoryReport r;
  r.arena_reserved_bytes = static_cast<int64_t>(arena_->reserved_bytes());
  r.arena_allocated_peak_bytes = static_cast<int64_t>(arena_->peak_allocated_bytes());
  arena_->SampleDeviceUsed();
  r.device_used_peak_bytes = static_cast<int64_t>(arena_->peak_device_used_bytes());
  // Host memory the run holds: pinned page stores, the host optimizer's pinned staging and its
  // moments (pageable).
  r.host_bytes =
      static_cast<int64_t>(host_grads_.size() * sizeof(G) + host_weights_.size() * sizeof(bf16) +
                           (host_m_.size() + host_v_.size()) * sizeof(float));
  if (kv_store_) {
    r.host_bytes +=
        static_cast<int64_t>(kv_store_->peak_pinned_bytes() + dkv_store_->peak_pinned_bytes());
    r.pinned_pages_peak_bytes =
        static_cast<int64_t>(kv_store_->peak_in_use_bytes() + dkv_store_->peak_in_use_bytes());
  }
  return r;
}

// Rounds each tensor to bf16 on the host (in parallel: 7.6B values at 7B) and copies it up.
template <typename G>
void TypedImpl<G>::Upload(ModelWeights& w) {
  std::vector<std::vector<float>*> host = HostTensors(w);
  size_t i = 0;
  std::vector<uint16_t> staging;
  weights_.ForEach([&](DeviceArray<bf16>& t) {
    if (!host[i]->empty()) gpu::UploadAsBf16(*host[i], t.get(), staging);
    std::vector<float>().swap(*host[i]);  // frees the host copy as soon as it is up
    ++i;
  });
}

template <typename G>
void TypedImpl<G>::UploadLora(const LoraWeights& lora) {
  std::vector<uint16_t> staging;
  auto up = [&](DeviceArray<bf16>& to, const std::vector<float>& from) {
    CTXPLAN_CHECK(to.size() == from.size(), "CUDA backend: a LoRA tensor changed size");
    gpu::UploadAsBf16(from, to.get(), staging);
  };
  for (size_t l = 0; l < lora_.size(); ++l)
    for (OpPart part : kLoraParts) {
      const std::vector<LoraProjection>& host = lora.layers[l].Part(part);
      std::vector<DeviceLoraProjection<G>>& dev = LoraPart(l, part);  // empty: another stage's
      CTXPLAN_CHECK(dev.empty() || dev.size() == host.size(),
                    "CUDA backend: LoRA projections changed in number");
      for (size_t n = 0; n < dev.size(); ++n) {
        up(dev[n].a, host[n].a);
        up(dev[n].b, host[n].b);
      }
    }
}

// Zeroes one category's whole region of the arena (its buffers are contiguous in it).
template <typename G>
void TypedImpl<G>::ClearRegion(MemCategory category) {
  const gpu::ArenaCategoryStats s = arena_->category_stats(category);
  if (s.reserved_bytes == 0) return;
  CTXPLAN_CUDA_CHECK(cudaMemsetAsync(arena_->base() + arena_->region_offset(category), 0,
                                     s.reserved_bytes, compute_));
}

template class TypedImpl<float>;
template class TypedImpl<bf16>;

}  // namespace ctxplan::cuda_backend_detail

namespace ctxplan {

using cuda_backend_detail::bf16;
using cuda_backend_detail::TypedImpl;

CudaBackend::CudaBackend(const StepPlan& plan, ModelWeights weights, CudaAdamW adamw,
                         std::ostream* log, const LoraWeights* lora, StagePeers* peers) {
  if (plan.options().grad_dtype == GradDtype::kFp32)
    impl_ = std::make_unique<TypedImpl<float>>(plan, std::move(weights), adamw, log, lora, peers);
  else
    impl_ = std::make_unique<TypedImpl<bf16>>(plan, std::move(weights), adamw, log, lora, peers);
}
CudaBackend::~CudaBackend() = default;
void CudaBackend::BeginStep(const StepPlan& plan, const StepInputs& inputs) {
  impl_->BeginStep(plan, inputs);
}
void CudaBackend::Execute(const Op& op) {
  impl_->Execute(op);
}
StepOutputs CudaBackend::EndStep() {
  return impl_->EndStep();
}
void CudaBackend::ZeroGrads() {
  impl_->ZeroGrads();
}
ModelWeights CudaBackend::DownloadWeights() const {
  return impl_->DownloadWeights();
}
ModelWeights CudaBackend::DownloadGrads() const {
  return impl_->DownloadGrads();
}
CudaOptimizerState CudaBackend::DownloadOptimizer() const {
  return impl_->DownloadOptimizer();
}
void CudaBackend::UploadOptimizer(CudaOptimizerState state) {
  impl_->UploadOptimizer(std::move(state));
}
CudaMemoryReport CudaBackend::Memory() const {
  return impl_->Memory();
}
LoraWeights CudaBackend::DownloadLora() const {
  return impl_->DownloadLora(false);
}
LoraWeights CudaBackend::DownloadLoraGrads() const {
  return impl_->DownloadLora(true);
}
CudaStartupTimes CudaBackend::StartupTimes() const {
  return impl_->StartupTimes();
}

}  // namespace ctxplan
