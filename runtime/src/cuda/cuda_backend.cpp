#include "ctxplan/runtime/cuda/cuda_backend.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ctxplan/kernels/cuda/attention.h"
#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/cuda/gemm.h"
#include "ctxplan/kernels/cuda/lora_gemm.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/bf16.h"
#include "ctxplan/runtime/cuda/device_arena.h"
#include "ctxplan/runtime/cuda/injected_fault.h"
#include "ctxplan/runtime/cuda/memcpy_batch.h"
#include "ctxplan/runtime/cuda/pinned_page_store.h"
#include "ctxplan/runtime/cuda/probe_kernel.h"
#include "ctxplan/runtime/cuda/sm_copy.h"
#include "ctxplan/runtime/cuda/weights_upload.h"
#include "ctxplan/runtime/host_adamw.h"
#include "ctxplan/runtime/lora.h"
#include "ctxplan/runtime/op_dispatch.h"
#include "ctxplan/runtime/plan_geometry.h"
#include "device_buffers.h"
#include "device_weights.h"

namespace ctxplan {

namespace k = kernels::cuda;
using kernels::KvPageShape;
using kernels::PagedKv;
using kernels::PageSelection;
using bf16 = __nv_bfloat16;
using gpu::ArenaPlan;
using gpu::DeviceArray;
using gpu::DeviceLayer;
using gpu::DeviceLoraProjection;
using gpu::DeviceWeights;
using gpu::HostTensors;
using gpu::PinnedArray;
using gpu::WantLike;

namespace {

// The host's bf16 conversion (bf16.h) from CUDA's bf16 type; uploads round in weights_upload.h.
inline float ToFloat(float x) {
  return x;
}
inline float ToFloat(bf16 x) {
  return Bf16ToFp32(static_cast<__nv_bfloat16_raw>(x).x);
}

// Seconds of the steady clock since `start`: ctxtrain's start-up phases, measured where they run.
double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// The backend's interface; TypedImpl<G> implements it for G = float or bf16 gradients and dKV.
class CudaBackend::Impl {
 public:
  virtual ~Impl() = default;
  virtual void BeginStep(const StepPlan& plan, const StepInputs& inputs) = 0;
  virtual void Execute(const Op& op) = 0;
  virtual StepOutputs EndStep() = 0;
  virtual void ZeroGrads() = 0;
  virtual ModelWeights DownloadWeights() = 0;
  virtual ModelWeights DownloadGrads() = 0;
  virtual CudaOptimizerState DownloadOptimizer() = 0;
  virtual void UploadOptimizer(const CudaOptimizerState& state) = 0;
  virtual CudaMemoryReport Memory() = 0;
  virtual LoraWeights DownloadLora(bool grads) = 0;
  virtual CudaStartupTimes StartupTimes() const = 0;
};

namespace {

template <typename G>  // gradients and dKV pages: float or bf16 (the run's grad dtype)
class TypedImpl final : public CudaBackend::Impl {
 public:
  static constexpr const char* kName = "CUDA backend";
  TypedImpl(const StepPlan& plan, ModelWeights weights, CudaAdamW adamw, std::ostream* log,
            const LoraWeights* lora, StagePeers* peers)
      : m_(plan.model()), o_(plan.options()), g_(plan.geometry()), adamw_(adamw), peers_(peers) {
    const auto constructed = std::chrono::steady_clock::now();
    rank_ = peers_ ? peers_->rank() : 0;
    if (g_.stages() != (peers_ ? peers_->world_size() : 1))
      throw InternalError("CUDA backend: a plan of " + std::to_string(g_.stages()) +
                          " pipeline stages run by " +
                          std::to_string(peers_ ? peers_->world_size() : 1) + " ranks");
    if (g_.stages() > 1 && m_.tie_word_embeddings)
      throw InputError("--gpus " + std::to_string(g_.stages()) + " with model " + m_.name +
                       ": its LM head is tied to the embedding, which the pipeline does not "
                       "share between the first and last GPU yet; accepted: --gpus 1, or an "
                       "untied model");
    if (g_.stages() > 1 && o_.lora_rank > 0)
      throw InputError("--lora-rank with --gpus " + std::to_string(g_.stages()) +
                       ": not yet; accepted: --lora-rank 0 (full fine-tune) on several GPUs");
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
      // The base's gradients stay empty arrays, one set per layer, so Grad(op) stays valid.
      grads_.layers.resize(static_cast<size_t>(layers_));
      lora_scale_ = lora->scale;
      lora_.resize(static_cast<size_t>(layers_));
      for (size_t l = 0; l < lora_.size(); ++l)
        for (OpPart part : kLoraParts) {
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
        for (DeviceArray<bf16>& b : *v)
          want.Want(b, c * static_cast<size_t>(d_), kIn, "top [c][d]");
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
        const int64_t homed = std::max<int64_t>(
            total_pages_ - g_.Chunk(g_.num_chunks() - 1).own_pages - tier_pages_, 1);
        kv.capacity_pages = static_cast<uint64_t>(stage_layers_ * homed);
        kv.category = MemCategory::kKvPages;
        if (fault_ ==
            gpu::InjectedFault::kPinnedAlloc) {  // one block of a PiB: cudaHostAlloc fails
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

  CudaStartupTimes StartupTimes() const override { return startup_; }

  ~TypedImpl() override {
    // Destroyed by a failure mid-step: NCCL kernels still waiting for a peer would hold the
    // synchronisation below (and any cudaFree) forever.
    if (peers_ != nullptr && std::uncaught_exceptions() > 0) peers_->Abort();
    cudaDeviceSynchronize();
    for (cudaEvent_t e : union_copied_)
      if (e != nullptr) cudaEventDestroy(e);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaStream_t s : {compute_, h2d_, d2h_}) cudaStreamDestroy(s);
  }

  CudaMemoryReport Memory() override {
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

  bool Lora() const { return o_.lora_rank > 0; }
  std::vector<DeviceLoraProjection<G>>& LoraPart(size_t layer, OpPart part) {
    return lora_[layer].Part(part);
  }

  void UploadLora(const LoraWeights& lora) {
    std::vector<uint16_t> staging;
    auto up = [&](DeviceArray<bf16>& to, const std::vector<float>& from) {
      CTXPLAN_CHECK(to.size() == from.size(), "CUDA backend: a LoRA tensor changed size");
      gpu::UploadAsBf16(from, to.get(), staging);
    };
    for (size_t l = 0; l < lora_.size(); ++l)
      for (OpPart part : kLoraParts) {
        const std::vector<LoraProjection>& host = lora.layers[l].Part(part);
        std::vector<DeviceLoraProjection<G>>& dev = LoraPart(l, part);
        for (size_t n = 0; n < host.size(); ++n) {
          up(dev[n].a, host[n].a);
          up(dev[n].b, host[n].b);
        }
      }
  }

  LoraWeights DownloadLora(bool grads) override {
    CTXPLAN_CHECK(Lora(), "CUDA backend: no LoRA adapters in a full fine-tune");
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    LoraWeights out = ZeroLora(m_, o_.lora_rank);
    out.scale = lora_scale_;
    auto down = [&](std::vector<float>& to, auto& from) {
      using T = typename std::remove_reference_t<decltype(from)>::value_type;
      std::vector<T> staging(from.size());
      CTXPLAN_CUDA_CHECK(
          cudaMemcpy(staging.data(), from.get(), from.bytes(), cudaMemcpyDeviceToHost));
      for (size_t j = 0; j < staging.size(); ++j) to[j] = ToFloat(staging[j]);
    };
    for (size_t l = 0; l < lora_.size(); ++l)
      for (OpPart part : kLoraParts) {
        std::vector<LoraProjection>& host = out.layers[l].Part(part);
        std::vector<DeviceLoraProjection<G>>& dev = LoraPart(l, part);
        for (size_t n = 0; n < host.size(); ++n) {
          if (grads) {
            down(host[n].a, dev[n].grad_a);
            down(host[n].b, dev[n].grad_b);
          } else {
            down(host[n].a, dev[n].a);
            down(host[n].b, dev[n].b);
          }
        }
      }
    return out;
  }

  k::LoraProjectionGemm LoraGemm(const DeviceLoraProjection<G>& p) const {
    return {T(), o_.lora_rank, p.in, p.out, p.out_offset, lora_scale_, p.a.get(), p.b.get()};
  }

  // y [t][y_stride] += scale * (x A^T) B^T on each projection's columns.
  void LoraForward(const Op& op, const bf16* x, bf16* y, int64_t y_stride) {
    if (!Lora()) return;
    for (DeviceLoraProjection<G>& p : LoraPart(static_cast<size_t>(op.layer), op.part))
      k::LoraForward(gemm_, LoraGemm(p), x, lora_u_.get(), y, y_stride, compute_);
  }

  // The input op: dx [t][in] += du A with du = scale * dy_seg B. The weight op: dA += du^T x and
  // dB += scale * dy_seg^T (x A^T).
  void LoraBackward(const Op& op, bool input, const bf16* x, const bf16* dy, int64_t dy_stride,
                    bf16* dx) {
    constexpr cudaDataType_t kGradType = std::is_same_v<G, float> ? CUDA_R_32F : CUDA_R_16BF;
    for (DeviceLoraProjection<G>& p : LoraPart(static_cast<size_t>(op.layer), op.part)) {
      if (input)
        k::LoraBackwardInput(gemm_, LoraGemm(p), dy, dy_stride, lora_du_.get(), dx, compute_);
      else
        k::LoraBackwardWeight(gemm_, LoraGemm(p), x, dy, dy_stride, lora_u_.get(), lora_du_.get(),
                              p.grad_a.get(), p.grad_b.get(), kGradType, compute_);
    }
  }

  // Where a norm's weight gradient goes: its gradient, or a sink when the base is frozen.
  G* NormGrad(DeviceArray<G>& grad) { return Lora() ? frozen_dw_.get() : grad.get(); }

  std::byte* Region(MemCategory category) const {
    return arena_->base() + arena_->region_offset(category);
  }

  // Zeroes one category's whole region of the arena (its buffers are contiguous in it).
  void ClearRegion(MemCategory category) {
    const gpu::ArenaCategoryStats s = arena_->category_stats(category);
    if (s.reserved_bytes == 0) return;
    CTXPLAN_CUDA_CHECK(cudaMemsetAsync(arena_->base() + arena_->region_offset(category), 0,
                                       s.reserved_bytes, compute_));
  }

  void ZeroGrads() override {
    ClearRegion(MemCategory::kGrads);
    CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(compute_));
  }

  ModelWeights DownloadWeights() override {
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    ModelWeights out = ZeroWeights(m_);
    SliceToStage(out);
    std::vector<std::vector<float>*> host = HostTensors(out);
    size_t i = 0;
    weights_.ForEach([&](DeviceArray<bf16>& t) {
      std::vector<bf16> staging(t.size());
      CTXPLAN_CUDA_CHECK(cudaMemcpy(staging.data(), t.get(), t.bytes(), cudaMemcpyDeviceToHost));
      for (size_t j = 0; j < staging.size(); ++j) (*host[i])[j] = ToFloat(staging[j]);
      ++i;
    });
    return out;
  }

  ModelWeights DownloadGrads() override {
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    ModelWeights out = ZeroWeights(m_);
    SliceToStage(out);
    std::vector<std::vector<float>*> host = HostTensors(out);
    size_t i = 0;
    grads_.ForEach([&](DeviceArray<G>& t) {
      std::vector<G> staging(t.size());
      CTXPLAN_CUDA_CHECK(cudaMemcpy(staging.data(), t.get(), t.bytes(), cudaMemcpyDeviceToHost));
      for (size_t j = 0; j < staging.size(); ++j) (*host[i])[j] = ToFloat(staging[j]);
      ++i;
    });
    return out;
  }

  // AdamW on the GPU: the fp32 moments (a stage's tensors with several GPUs) and the steps taken,
  // so that a checkpoint resumes the very update the run would have made.
  CudaOptimizerState DownloadOptimizer() override {
    CudaOptimizerState state;
    if (o_.optimizer != OptimizerKind::kAdamWGpu || Lora()) return state;
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    for (auto [device, host] : {std::pair{&adam_m_, &state.m}, std::pair{&adam_v_, &state.v}}) {
      *host = ZeroWeights(m_);
      SliceToStage(*host);
      std::vector<std::vector<float>*> tensors = HostTensors(*host);
      size_t i = 0;
      device->ForEach([&](DeviceArray<float>& t) {
        CTXPLAN_CHECK(tensors[i]->size() == t.size(), "CUDA backend: a moment's shape");
        if (t.size() > 0)
          CTXPLAN_CUDA_CHECK(
              cudaMemcpy(tensors[i]->data(), t.get(), t.bytes(), cudaMemcpyDeviceToHost));
        ++i;
      });
    }
    state.steps_taken = adam_step_;
    return state;
  }

  void UploadOptimizer(const CudaOptimizerState& state) override {
    if (o_.optimizer != OptimizerKind::kAdamWGpu || Lora())
      throw InternalError("CUDA backend: optimizer state for a run without AdamW on the GPU");
    for (auto [device, host] : {std::pair{&adam_m_, &state.m}, std::pair{&adam_v_, &state.v}}) {
      ModelWeights shaped = *host;  // a stage's tensors, or the whole model's cut to them
      SliceToStage(shaped);
      std::vector<std::vector<float>*> tensors = HostTensors(shaped);
      size_t i = 0;
      device->ForEach([&](DeviceArray<float>& t) {
        if (i >= tensors.size() || tensors[i]->size() != t.size())
          throw InputError("optimizer state not shaped as model " + m_.name +
                           " (its moments); accepted: a checkpoint of this model");
        if (t.size() > 0)
          CTXPLAN_CUDA_CHECK(
              cudaMemcpy(t.get(), tensors[i]->data(), t.bytes(), cudaMemcpyHostToDevice));
        ++i;
      });
    }
    adam_step_ = state.steps_taken;
  }

  void BeginStep(const StepPlan& plan, const StepInputs& inputs) override {
    if (plan.options().context_tokens != o_.context_tokens ||
        plan.options().chunk_tokens != o_.chunk_tokens)
      throw InternalError("CudaBackend: a step of another plan than the one it was built for");
    page_unions_.clear();
    labelled_total_ =
        std::count_if(inputs.labels.begin(), inputs.labels.end(), [](int32_t l) { return l >= 0; });
    labelled_ = labelled_total_;
    CTXPLAN_CUDA_CHECK(
        cudaMemcpy(tokens_.get(), inputs.tokens.data(), tokens_.bytes(), cudaMemcpyHostToDevice));
    CTXPLAN_CUDA_CHECK(
        cudaMemcpy(labels_.get(), inputs.labels.data(), labels_.bytes(), cudaMemcpyHostToDevice));
    CTXPLAN_CUDA_CHECK(cudaMemset(loss_.get(), 0, loss_.bytes()));
    if (o_.offload) {
      // dKV starts at zero each step. Releasing in reverse allocation order restores the free
      // list exactly, so every step lays its pages out as the first did (and copies coalesce).
      for (auto it = dkv_allocated_.rbegin(); it != dkv_allocated_.rend(); ++it)
        dkv_store_->Release(*it);
      dkv_allocated_.clear();
      for (std::vector<gpu::PageId>& layer : dkv_page_)
        std::fill(layer.begin(), layer.end(), gpu::kNoPage);
      if (tier_pages_ > 0)  // the tier's dKV accumulates in place from zero
        CTXPLAN_CUDA_CHECK(cudaMemsetAsync(
            tier_dkv_pool_.get(), 0,
            static_cast<size_t>(stage_layers_ * tier_pages_ * pe_) * sizeof(G), compute_));
    } else {
      ClearRegion(MemCategory::kDkvPages);
    }
    std::fill(event_op_.begin(), event_op_.end(), kNoOp);
    memory_ = {};
    ops_ = 0;
    chunk_index_ = -1;
    slot_uses_ = own_uses_ = 0;
    final_norm_backwards_ = 0;
    final_norm_rows_ = 0;
    layer_key_ = {-1, -1, -1};
    table_user_[0] = table_user_[1] = kNoOp;
    table_staged_[0] = table_staged_[1] = own_table_staged_[0] = own_table_staged_[1] =
        tier_table_staged_ = {-1, -1, -1};
    page_reads_.Reset(layers_, total_pages_);
  }

  StepOutputs EndStep() override {
    CTXPLAN_CHECK(final_norm_backwards_ == 0,
                  "CUDA backend: the step ended with the final norm's d_weight partials unsummed");
    if (peers_ != nullptr) {  // a failed peer throws rather than hangs
      std::vector<void*> streams{compute_, h2d_, d2h_};
      for (Stream s : {Stream::kSendNext, Stream::kRecvPrev, Stream::kSendPrev, Stream::kRecvNext})
        if (void* peer = peers_->stream(s)) streams.push_back(peer);
      peers_->Synchronize(streams);
    } else
      CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    arena_->SampleDeviceUsed();
    std::vector<float> losses(loss_.size());
    CTXPLAN_CUDA_CHECK(
        cudaMemcpy(losses.data(), loss_.get(), loss_.bytes(), cudaMemcpyDeviceToHost));
    StepOutputs out;
    for (size_t i = 0; i < losses.size(); ++i) {
      if (!std::isfinite(losses[i]))
        throw TrainingError("the loss of chunk " + std::to_string(i) + " is " +
                            std::to_string(losses[i]) + ": the run diverged");
      out.loss_sum += losses[i];
    }
    out.labelled = labelled_;
    out.ops_executed = ops_;
    out.peak_arena_bytes = memory_.peak(MemSpace::kGpu);
    out.peak_host_bytes = memory_.peak(MemSpace::kHost);
    out.page_unions = std::move(page_unions_);
    out.page_reads = std::move(page_reads_);
    return out;
  }

  void Execute(const Op& op) override {
    if (op.rank != rank_) return;  // another stage's, on its own GPU
    if (IsMemory(op.kind)) {
      memory_.Apply(op);
      return;
    }
    ++ops_;
    if (op.chunk >= 0 && op.chunk != chunk_index_) StartChunk(op.chunk);
    NoteLayer(op);
    if (op.stream == Stream::kHost) {  // CPU work: wait for its inputs, run it, done
      for (int i = 0; i < op.num_deps; ++i) WaitOnHost(op.deps[i]);
      Run(op);
      return;  // no event: every later op is issued after it finished
    }
    const cudaStream_t stream = StreamOf(op.stream);
    for (int i = 0; i < op.num_deps; ++i) Wait(stream, op.deps[i]);
    try {
      Run(op);
    } catch (const gpu::PageStoreExhaustedError& e) {
      throw TrainingError(std::string("the host page store ran out mid-step: ") + e.what());
    }
    if (op.kind == OpKind::kAttentionBackward) InjectAfterAttentionBackward(stream);
    CTXPLAN_CUDA_CHECK(cudaEventRecord(events_[op.id % kEventRing], stream));
    event_op_[op.id % kEventRing] = op.id;
  }

 private:
  static constexpr size_t kEventRing = 2 * StepPlan::kMaxDependencyDistance + 1024;
  static constexpr size_t kFreedBytes = size_t{2} << 20;  // copy-error's freed device block

  // The injected faults that strike mid-step (injected_fault.h).
  void InjectAfterAttentionBackward(cudaStream_t stream) {
    if (fault_ == gpu::InjectedFault::kCudaError)
      gpu::LaunchProbeKernel(reinterpret_cast<float*>(uintptr_t{256}), 1, 1.0f, 0.0f, stream);
    if (fault_ == gpu::InjectedFault::kKill) {
      CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());  // the step well under way on the GPU
      ::raise(SIGKILL);
    }
  }

  cudaStream_t StreamOf(Stream s) const {
    switch (s) {
      case Stream::kH2D:
        return h2d_;
      case Stream::kD2H:
        return d2h_;
      case Stream::kSendNext:
      case Stream::kRecvPrev:
      case Stream::kSendPrev:
      case Stream::kRecvNext:
        CTXPLAN_CHECK(peers_ != nullptr, "CUDA backend: a peer op without peers");
        return static_cast<cudaStream_t>(peers_->stream(s));
      default:
        return compute_;
    }
  }

  // The host's waits inside a step. With peers, a wait may hang on a transfer from a rank that
  // died: it polls, bounded by the peers' timeout, instead of blocking in CUDA for ever.
  void HostWait(cudaEvent_t event) {
    if (peers_ != nullptr)
      peers_->WaitEvent(event);
    else
      CTXPLAN_CUDA_CHECK(cudaEventSynchronize(event));
  }
  void HostWait(cudaStream_t stream) {
    if (peers_ != nullptr) {
      void* const streams[] = {stream};
      peers_->Synchronize(streams);
    } else {
      CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  }

  void WaitOnHost(OpId dep) {
    if (dep == kNoOp) return;
    const size_t slot = dep % kEventRing;
    if (event_op_[slot] == dep) HostWait(events_[slot]);
  }

  void Wait(cudaStream_t stream, OpId dep) {
    if (dep == kNoOp) return;
    const size_t slot = dep % kEventRing;
    if (event_op_[slot] != dep) return;  // a memory op (no GPU work) or long finished
    CTXPLAN_CUDA_CHECK(cudaStreamWaitEvent(stream, events_[slot], 0));
  }

  // Slot buffers alternate per layer exactly as the plan's do: every layer of every pass is one
  // use, the fill's page-writing layers one use of the own-page buffers.
  void NoteLayer(const Op& op) {
    if (op.layer < 0) return;
    const std::array<int32_t, 3> key{static_cast<int32_t>(op.phase), op.chunk, op.layer};
    if (key == layer_key_) return;
    layer_key_ = key;
    parity_ = static_cast<int>(slot_uses_++ & 1);
    if (op.phase == Phase::kFill && g_.writes_pages(op.chunk))
      own_parity_ = static_cast<int>(own_uses_++ & 1);
  }

  int64_t T() const { return c_.tokens; }
  size_t S(const Op& op) const { return SavedLayerSlot(op, g_); }
  bool Saves(const Op& op) const { return SavesLayerState(op, o_.keep_layer_inputs); }
  DeviceLayer<bf16>& W(const Op& op) { return weights_.layers[static_cast<size_t>(op.layer)]; }
  DeviceLayer<G>& Grad(const Op& op) { return grads_.layers[static_cast<size_t>(op.layer)]; }
  float Eps() const { return static_cast<float>(m_.rms_norm_eps); }
  k::LinearCrossEntropyShape LossShape(int64_t tokens) const {
    return {tokens, d_, vocab_, std::max<int64_t>(tokens, 1),
            std::min(PlanGeometry::kLossVocabTile, vocab_)};
  }

  void StartChunk(int32_t index) {
    chunk_index_ = index;
    c_ = g_.Chunk(index);
    has_pending_ = false;
  }

  // Rounds each tensor to bf16 on the host (in parallel: 7.6B values at 7B) and copies it up.
  void Upload(ModelWeights& w) {
    std::vector<std::vector<float>*> host = HostTensors(w);
    size_t i = 0;
    std::vector<uint16_t> staging;
    weights_.ForEach([&](DeviceArray<bf16>& t) {
      if (!host[i]->empty()) gpu::UploadAsBf16(*host[i], t.get(), staging);
      std::vector<float>().swap(*host[i]);  // frees the host copy as soon as it is up
      ++i;
    });
  }

  void Run(const Op& op) { DispatchComputeOp(*this, op); }

  // --- pipeline stage boundaries (the plan double-buffers them: op.pages is the buffer) -----
  // Forward: the residual stream and its pending add, so that the next stage finishes the add
  // exactly as one GPU would; backward: the residual gradient.
  void BoundaryPack(const Op& op) {
    const auto p = static_cast<size_t>(op.pages);
    const size_t cd = static_cast<size_t>(T() * d_) * sizeof(bf16);
    if (op.phase == Phase::kBackward) {
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(backward_send_[p].get(), dh_.get(), cd,
                                         cudaMemcpyDeviceToDevice, compute_));
      return;
    }
    bf16* out = forward_send_[p].get();
    CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(out, h_.get(), cd, cudaMemcpyDeviceToDevice, compute_));
    if (has_pending_)
      CTXPLAN_CUDA_CHECK(
          cudaMemcpyAsync(out + T() * d_, pending_.get(), cd, cudaMemcpyDeviceToDevice, compute_));
    else
      CTXPLAN_CUDA_CHECK(cudaMemsetAsync(out + T() * d_, 0, cd, compute_));
  }
  void BoundaryUnpack(const Op& op) {
    const auto p = static_cast<size_t>(op.pages);
    const size_t cd = static_cast<size_t>(T() * d_) * sizeof(bf16);
    if (op.phase == Phase::kBackward) {
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(dh_.get(), backward_recv_[p].get(), cd,
                                         cudaMemcpyDeviceToDevice, compute_));
      return;
    }
    const bf16* in = forward_recv_[p].get();
    CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(h_.get(), in, cd, cudaMemcpyDeviceToDevice, compute_));
    CTXPLAN_CUDA_CHECK(
        cudaMemcpyAsync(pending_.get(), in + T() * d_, cd, cudaMemcpyDeviceToDevice, compute_));
    has_pending_ = true;
  }
  void PeerSend(const Op& op) {
    const auto p = static_cast<size_t>(op.pages);
    const bool forward = op.stream == Stream::kSendNext;
    peers_->Send(op.stream,
                 forward ? static_cast<const void*>(forward_send_[p].get())
                         : static_cast<const void*>(backward_send_[p].get()),
                 static_cast<size_t>(op.bytes));
  }
  void PeerRecv(const Op& op) {
    const auto p = static_cast<size_t>(op.pages);
    const bool forward = op.stream == Stream::kRecvPrev;
    peers_->Recv(op.stream,
                 forward ? static_cast<void*>(forward_recv_[p].get())
                         : static_cast<void*>(backward_recv_[p].get()),
                 static_cast<size_t>(op.bytes));
  }

  bool Owns(int32_t layer) const { return layer >= first_layer_ && layer < end_layer_; }
  // Drops the tensors other stages hold (a no-op with one GPU), so `w` has this stage's shape.
  void SliceToStage(ModelWeights& w) const {
    if (g_.stages() > 1)
      KeepStageTensors(w, first_layer_, end_layer_, rank_ == 0, rank_ == g_.last_stage());
  }

  template <typename Backend>
  friend void ctxplan::DispatchComputeOp(Backend& backend, const Op& op);

  void EmbeddingForward(const Op&) {
    k::EmbeddingForward(tokens_.get() + c_.start, weights_.embedding.get(), T(), vocab_, d_,
                        h_.get(), compute_);
    has_pending_ = false;
  }

  void EmbeddingBackward(const Op&) {
    if (!Lora())  // frozen under LoRA
      k::EmbeddingBackward(tokens_.get() + c_.start, dh_.get(), T(), vocab_, d_,
                           grads_.embedding.get(), compute_);
  }

  void RopeForward(const Op&) {
    k::RopeForward(q_.get(), T(), m_.num_attention_heads, m_.head_dim, q_dim_, c_.start,
                   m_.rope_theta, compute_);
    k::RopeForward(k_.get(), T(), m_.num_key_value_heads, m_.head_dim, kv_dim_, c_.start,
                   m_.rope_theta, compute_);
  }

  void RopeBackward(const Op&) {
    k::RopeBackward(dq_.get(), T(), m_.num_attention_heads, m_.head_dim, q_dim_, c_.start,
                    m_.rope_theta, compute_);
    k::RopeBackward(dk_.get(), T(), m_.num_key_value_heads, m_.head_dim, kv_dim_, c_.start,
                    m_.rope_theta, compute_);
  }

  void KvWrite(const Op& op) {
    PagedKv<bf16> own = OwnKv(op.layer);
    k::KvWrite(k_.get(), v_.get(), kv_dim_, T(), own, compute_);
  }

  void PageSummary(const Op& op) {
    PagedKv<bf16> own = OwnKv(op.layer);
    k::PageSummary(PagedKv<const bf16>{own.shape, own.pool, own.page_slot, own.num_pages},
                   summaries_[static_cast<size_t>(op.layer)].get() + c_.earlier_pages * kv_dim_,
                   compute_);
  }

  void PageScore(const Op& op) {
    k::PageScore(q_.get(), T(), m_.num_attention_heads, m_.num_key_value_heads, m_.head_dim,
                 o_.query_tile, summaries_[static_cast<size_t>(op.layer)].get(), c_.earlier_pages,
                 scores_.get(), score_ws_.get(), score_ws_.bytes(), compute_);
  }

  void DkvAccumulate(const Op& op) {
    if (own_dkv_added_layer_ == op.layer) return;  // done by the attention backward
    PagedKv<G> own = OwnDkv(op.layer);
    k::DkvAccumulate(PagedKv<const G>{own.shape, own.pool, own.page_slot, own.num_pages}, T(),
                     dk_.get(), dv_.get(), kv_dim_, compute_);
  }

  void SwigluForward(const Op&) {
    k::SwigluForward(gate_up_.get(), T(), inter_, act_.get(), compute_);
  }

  void SwigluBackward(const Op&) {
    k::SwigluBackward(gate_up_.get(), d_act_.get(), T(), inter_, d_gate_up_.get(), compute_);
  }

  void Loss(const Op&) {
    const bool tied = weights_.lm_head.size() == 0;
    const float scale = labelled_total_ > 0 ? 1.0f / static_cast<float>(labelled_total_) : 0.0f;
    k::LinearCrossEntropy(gemm_, LossShape(T()), xnf_.get(),
                          tied ? weights_.embedding.get() : weights_.lm_head.get(),
                          labels_.get() + c_.start, scale, d_xnf_.get(),
                          Lora() ? nullptr
                          : tied ? grads_.embedding.get()
                                 : grads_.lm_head.get(),
                          loss_.get() + c_.index, loss_ws_.get(), compute_);
  }

  // Fresh dKV slots are zeroed when the backward's copy stages the union.
  void ZeroFill(const Op&) {}

  void OptimizerStep(const Op&) {
    if (o_.optimizer == OptimizerKind::kAdamWHost)
      HostOptimizer();
    else
      Optimizer();
  }

  void NormForward(const Op& op) {
    DeviceLayer<bf16>* w = op.layer >= 0 ? &W(op) : nullptr;
    switch (op.part) {
      case OpPart::kAttnNorm: {
        if (op.phase == Phase::kBackward) {
          x_ = saved_input_[S(op)].get();
          k::RmsNormForward(x_, w->attn_norm.get(), T(), d_, Eps(), xn_.get(), rstd1_.get(),
                            compute_);
          break;
        }
        if (has_pending_) {  // h += the previous MLP output, in place
          k::RmsNormResidualForward(h_.get(), pending_.get(), w->attn_norm.get(), T(), d_, Eps(),
                                    h_.get(), xn_.get(), rstd1_.get(), compute_);
          has_pending_ = false;
        } else {
          k::RmsNormForward(h_.get(), w->attn_norm.get(), T(), d_, Eps(), xn_.get(), rstd1_.get(),
                            compute_);
        }
        x_ = h_.get();
        if (Saves(op))
          CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(saved_input_[S(op)].get(), h_.get(),
                                             static_cast<size_t>(T() * d_) * sizeof(bf16),
                                             cudaMemcpyDeviceToDevice, compute_));
        break;
      }
      case OpPart::kMlpNorm: {
        // h_mid = x + o_out; in the forward passes it becomes the residual stream.
        bf16* out = op.phase == Phase::kBackward ? hmid_.get() : h_alt_.get();
        k::RmsNormResidualForward(x_, o_out_.get(), w->mlp_norm.get(), T(), d_, Eps(), out,
                                  xn2_.get(), rstd2_.get(), compute_);
        if (op.phase != Phase::kBackward) {
          std::swap(h_, h_alt_);
          hmid_ptr_ = h_.get();
        } else {
          hmid_ptr_ = hmid_.get();
        }
        break;
      }
      case OpPart::kFinalNorm: {
        const bf16* h = h_.get();
        const bf16* pending = has_pending_ ? pending_.get() : nullptr;
        if (o_.keep_layer_inputs) {
          h = saved_top_h_[static_cast<size_t>(c_.index)].get();
          pending = saved_top_pending_[static_cast<size_t>(c_.index)].get();
        }
        if (pending) {
          k::RmsNormResidualForward(h, pending, weights_.final_norm.get(), T(), d_, Eps(),
                                    hf_.get(), xnf_.get(), rstdf_.get(), compute_);
        } else {
          CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(hf_.get(), h,
                                             static_cast<size_t>(T() * d_) * sizeof(bf16),
                                             cudaMemcpyDeviceToDevice, compute_));
          k::RmsNormForward(hf_.get(), weights_.final_norm.get(), T(), d_, Eps(), xnf_.get(),
                            rstdf_.get(), compute_);
        }
        has_pending_ = false;
        break;
      }
      default:
        throw InternalError("CUDA backend: RMSNorm without a part");
    }
  }

  void NormBackward(const Op& op) {
    switch (op.part) {
      case OpPart::kFinalNorm:
        if (Lora()) {  // a frozen norm: its d_weight is discarded
          k::RmsNormBackward(hf_.get(), weights_.final_norm.get(), rstdf_.get(), d_xnf_.get(),
                             nullptr, T(), d_, dh_.get(), frozen_dw_.get(), norm_scratch_.get(),
                             compute_);
        } else {
          FinalNormBackward();
        }
        break;
      case OpPart::kMlpNorm:
        k::RmsNormBackward(hmid_ptr_, W(op).mlp_norm.get(), rstd2_.get(), d_xn2_.get(), dh_.get(),
                           T(), d_, d_hmid_.get(), NormGrad(Grad(op).mlp_norm), norm_scratch_.get(),
                           compute_);
        break;
      case OpPart::kAttnNorm:
        k::RmsNormBackward(x_, W(op).attn_norm.get(), rstd1_.get(), d_xn_.get(), d_hmid_.get(), T(),
                           d_, dh_.get(), NormGrad(Grad(op).attn_norm), norm_scratch_.get(),
                           compute_);
        break;
      default:
        throw InternalError("CUDA backend: RMSNorm backward without a part");
    }
  }

  // The final norm's backward runs once a chunk: its d_weight stays in fp32 partial rows across
  // the step's chunks and is summed into the gradient once, after the last chunk (the per-call
  // column sum is a second kernel, ~10% of the call; kernels/src/cuda/rmsnorm.cu).
  void FinalNormBackward() {
    if (final_norm_backwards_ == 0)
      CTXPLAN_CUDA_CHECK(
          cudaMemsetAsync(final_norm_partials_.get(), 0, final_norm_partials_.bytes(), compute_));
    const int rows = k::RmsNormBackwardIntoPartials(hf_.get(), weights_.final_norm.get(),
                                                    rstdf_.get(), d_xnf_.get(), T(), d_, dh_.get(),
                                                    final_norm_partials_.get(), compute_);
    final_norm_rows_ = std::max(final_norm_rows_, rows);
    if (++final_norm_backwards_ == g_.num_chunks()) {
      k::RmsNormAddPartials(final_norm_partials_.get(), final_norm_rows_, d_,
                            grads_.final_norm.get(), compute_);
      final_norm_backwards_ = 0;
      final_norm_rows_ = 0;
    }
  }

  void Copy2D(bf16* dst, int64_t dst_cols, const bf16* src, int64_t src_cols, int64_t cols,
              cudaStream_t stream) {
    CTXPLAN_CUDA_CHECK(cudaMemcpy2DAsync(
        dst, static_cast<size_t>(dst_cols) * sizeof(bf16), src,
        static_cast<size_t>(src_cols) * sizeof(bf16), static_cast<size_t>(cols) * sizeof(bf16),
        static_cast<size_t>(T()), cudaMemcpyDeviceToDevice, stream));
  }

  void LinearForward(const Op& op) {
    DeviceLayer<bf16>& w = W(op);
    const int64_t t = T();
    switch (op.part) {
      case OpPart::kQkv:
        k::LinearForward(gemm_, xn_.get(), w.qkv.get(),
                         w.qkv_bias.size() ? w.qkv_bias.get() : nullptr, t, qkv_dim_, d_,
                         qkv_.get(), compute_);
        LoraForward(op, xn_.get(), qkv_.get(), qkv_dim_);
        Copy2D(q_.get(), q_dim_, qkv_.get(), qkv_dim_, q_dim_, compute_);
        Copy2D(k_.get(), kv_dim_, qkv_.get() + q_dim_, qkv_dim_, kv_dim_, compute_);
        Copy2D(v_.get(), kv_dim_, qkv_.get() + q_dim_ + kv_dim_, qkv_dim_, kv_dim_, compute_);
        break;
      case OpPart::kO: {
        const bf16* x = op.phase == Phase::kBackward ? saved_attn_[S(op)].get() : attn_ptr_;
        k::LinearForward(gemm_, x, w.o.get(), nullptr, t, d_, q_dim_, o_out_.get(), compute_);
        LoraForward(op, x, o_out_.get(), d_);
        break;
      }
      case OpPart::kGateUp:
        k::LinearForward(gemm_, xn2_.get(), w.gate_up.get(), nullptr, t, 2 * inter_, d_,
                         gate_up_.get(), compute_);
        LoraForward(op, xn2_.get(), gate_up_.get(), 2 * inter_);
        break;
      case OpPart::kDown:
        k::LinearForward(gemm_, act_.get(), w.down.get(), nullptr, t, d_, inter_, pending_.get(),
                         compute_);
        LoraForward(op, act_.get(), pending_.get(), d_);
        has_pending_ = true;
        if (op.phase == Phase::kFill && o_.keep_layer_inputs && op.layer == layers_ - 1) {
          const size_t bytes = static_cast<size_t>(t * d_) * sizeof(bf16);
          CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(saved_top_h_[static_cast<size_t>(c_.index)].get(),
                                             h_.get(), bytes, cudaMemcpyDeviceToDevice, compute_));
          CTXPLAN_CUDA_CHECK(
              cudaMemcpyAsync(saved_top_pending_[static_cast<size_t>(c_.index)].get(),
                              pending_.get(), bytes, cudaMemcpyDeviceToDevice, compute_));
        }
        break;
      default:
        throw InternalError("CUDA backend: linear without a part");
    }
  }

  // Under LoRA the base's weight gradients are skipped (frozen) and the adapters' backward follows
  // the base's input gradient, or replaces its weight gradient.
  void LinearBackward(const Op& op, bool input) {
    if (Lora()) {
      if (input) LinearBackwardBase(op, true);
      switch (op.part) {
        case OpPart::kDown:
          LoraBackward(op, input, act_.get(), dh_.get(), d_, d_act_.get());
          break;
        case OpPart::kGateUp:
          LoraBackward(op, input, xn2_.get(), d_gate_up_.get(), 2 * inter_, d_xn2_.get());
          break;
        case OpPart::kO:
          LoraBackward(op, input, saved_attn_[S(op)].get(), d_hmid_.get(), d_, d_attn_.get());
          break;
        case OpPart::kQkv:  // dqkv_ joined by the input op, which runs first
          LoraBackward(op, input, xn_.get(), dqkv_.get(), qkv_dim_, d_xn_.get());
          break;
        default:
          throw InternalError("CUDA backend: linear backward without a part");
      }
      return;
    }
    LinearBackwardBase(op, input);
  }

  void LinearBackwardBase(const Op& op, bool input) {
    DeviceLayer<bf16>& w = W(op);
    const int64_t t = T();
    switch (op.part) {
      case OpPart::kDown:
        if (input)
          k::LinearBackwardInput(gemm_, dh_.get(), w.down.get(), t, d_, inter_, d_act_.get(),
                                 compute_);
        else
          k::LinearBackwardWeight(gemm_, act_.get(), dh_.get(), t, d_, inter_, Grad(op).down.get(),
                                  static_cast<G*>(nullptr), compute_);
        break;
      case OpPart::kGateUp:
        if (input)
          k::LinearBackwardInput(gemm_, d_gate_up_.get(), w.gate_up.get(), t, 2 * inter_, d_,
                                 d_xn2_.get(), compute_);
        else
          k::LinearBackwardWeight(gemm_, xn2_.get(), d_gate_up_.get(), t, 2 * inter_, d_,
                                  Grad(op).gate_up.get(), static_cast<G*>(nullptr), compute_);
        break;
      case OpPart::kO:
        if (input)
          k::LinearBackwardInput(gemm_, d_hmid_.get(), w.o.get(), t, d_, q_dim_, d_attn_.get(),
                                 compute_);
        else
          k::LinearBackwardWeight(gemm_, saved_attn_[S(op)].get(), d_hmid_.get(), t, d_, q_dim_,
                                  Grad(op).o.get(), static_cast<G*>(nullptr), compute_);
        break;
      case OpPart::kQkv:
        if (input) {
          Copy2D(dqkv_.get(), qkv_dim_, dq_.get(), q_dim_, q_dim_, compute_);
          Copy2D(dqkv_.get() + q_dim_, qkv_dim_, dk_.get(), kv_dim_, kv_dim_, compute_);
          Copy2D(dqkv_.get() + q_dim_ + kv_dim_, qkv_dim_, dv_.get(), kv_dim_, kv_dim_, compute_);
          k::LinearBackwardInput(gemm_, dqkv_.get(), w.qkv.get(), t, qkv_dim_, d_, d_xn_.get(),
                                 compute_);
        } else {
          k::LinearBackwardWeight(
              gemm_, xn_.get(), dqkv_.get(), t, qkv_dim_, d_, Grad(op).qkv.get(),
              Grad(op).qkv_bias.size() ? Grad(op).qkv_bias.get() : static_cast<G*>(nullptr),
              compute_);
        }
        break;
      default:
        throw InternalError("CUDA backend: linear backward without a part");
    }
  }

  // --- pages -------------------------------------------------------------------------------
  PagedKv<bf16> OwnKv(int32_t layer) {
    PagedKv<bf16> p;
    p.shape = shape_;
    p.num_pages = c_.own_pages;
    if (tier_pages_ > 0) {
      p.pool = tier_kv_pool_.get();
      p.page_slot = OwnTable(layer, own_parity_);
    } else if (o_.offload) {
      p.pool = own_kv_slots_[own_parity_].get();
      p.page_slot = own_identity_.get();
    } else {
      p.pool = device_kv_[static_cast<size_t>(layer)].get() + c_.earlier_pages * pe_;
      p.page_slot = own_identity_.get();
    }
    return p;
  }

  PagedKv<G> OwnDkv(int32_t layer) {
    PagedKv<G> p;
    p.shape = shape_;
    p.num_pages = c_.own_pages;
    p.page_slot = own_identity_.get();
    p.pool = o_.offload ? own_dkv_slots_[parity_].get()
                        : device_dkv_[static_cast<size_t>(layer)].get() + c_.earlier_pages * pe_;
    if (tier_pages_ > 0) {
      p.pool = tier_dkv_pool_.get();
      p.page_slot = OwnTable(layer, parity_);
    }
    return p;
  }

  // --- the GPU tier's pool: [layers x tier pages | union slots, parity 0 and 1 | own slots,
  // parity 0 and 1], in pages of pe_ elements (KV bf16, dKV G) ---
  int64_t TierPoolPages() const {
    return stage_layers_ * tier_pages_ + 2 * host_slot_capacity_ + 2 * own_capacity_;
  }
  int64_t TierBase(int32_t layer) const { return int64_t{layer - first_layer_} * tier_pages_; }
  int64_t UnionSlotBase(int parity) const {
    return stage_layers_ * tier_pages_ + parity * host_slot_capacity_;
  }
  int64_t OwnSlotBase(int parity) const {
    return stage_layers_ * tier_pages_ + 2 * host_slot_capacity_ + parity * own_capacity_;
  }

  // The chunk's own pages in the pool, for `layer` on the buffers of `parity`: the tier's pages
  // in place, the others in the own slots. Filled by a kernel on the compute stream, where every
  // op that reads it runs.
  const int32_t* OwnTable(int32_t layer, int parity) {
    const std::array<int32_t, 3> key{c_.index, layer, parity};
    if (own_table_staged_[parity] != key) {
      own_table_staged_[parity] = key;
      gpu::FillPageTable(tier_own_table_[parity].get(), c_.own_pages, c_.earlier_pages, tier_pages_,
                         TierBase(layer), OwnSlotBase(parity), compute_);
    }
    return tier_own_table_[parity].get();
  }

  // The earlier pages of `layer` in the pool: the layer's copy in wrote the parity's table
  // (CopyIn). A layer whose pages are all in the tier has no copy; its table is filled on the
  // compute stream into a table of its own. Not into the parity's: the H2D stream may already be
  // writing that one for a later layer's copy, which the plan orders after the last layer that
  // copied, not after this one.
  template <typename T>
  PagedKv<T> EarlierInTier(int32_t layer, bool dkv) {
    const int32_t* table = slot_table_[parity_].get();
    if (table_staged_[parity_] != layer_key_) {
      CTXPLAN_CHECK(c_.earlier_pages <= tier_pages_,
                    "CUDA backend: a layer with pages in the host tier attended before its copy");
      if (tier_table_staged_ != layer_key_) {
        tier_table_staged_ = layer_key_;
        gpu::FillPageTable(tier_table_.get(), c_.earlier_pages, 0, tier_pages_, TierBase(layer), 0,
                           compute_);
      }
      table = tier_table_.get();
    }
    PagedKv<T> p;
    p.shape = shape_;
    p.num_pages = c_.earlier_pages;
    p.pool = reinterpret_cast<T*>(dkv ? static_cast<void*>(tier_dkv_pool_.get())
                                      : static_cast<void*>(tier_kv_pool_.get()));
    p.page_slot = table;
    return p;
  }

  template <typename T>
  PagedKv<T> Earlier(int32_t layer, bool dkv) {
    if (tier_pages_ > 0) return EarlierInTier<T>(layer, dkv);
    PagedKv<T> p;
    p.shape = shape_;
    p.num_pages = c_.earlier_pages;
    if (o_.offload) {
      p.pool = reinterpret_cast<T*>(dkv ? static_cast<void*>(dkv_slots_[parity_].get())
                                        : static_cast<void*>(kv_slots_[parity_].get()));
      p.page_slot = slot_table_[parity_].get();
    } else {
      p.pool = reinterpret_cast<T*>(
          dkv ? static_cast<void*>(device_dkv_[static_cast<size_t>(layer)].get())
              : static_cast<void*>(device_kv_[static_cast<size_t>(layer)].get()));
      p.page_slot = identity_.get();
    }
    return p;
  }

  void PageTopK(const Op& op) {
    pages_per_tile_ = k::PageTopK(scores_.get(), c_.tiles, c_.earlier_pages, o_.page_budget,
                                  o_.sink_pages, selected_.get(), compute_);
    const size_t n = static_cast<size_t>(c_.tiles * pages_per_tile_);
    // The union's copies are issued from the host: the selections, written straight into
    // pinned memory (sm_copy.h: not queued on a copy engine behind the offload copies), and a
    // short sync. The backward's copy is queued before the sync: after it, it would wait for the
    // host to wake (the op's span was 25-58 us in recompute against 8 us in the fill).
    gpu::CopyBySms(selected_.get(), selected_host_.get(), static_cast<int64_t>(n), compute_);
    if (Saves(op))
      gpu::CopyBySms(selected_.get(), saved_selection_[S(op)].get(), static_cast<int64_t>(n),
                     compute_);
    HostWait(compute_);
    selection_host_.assign(selected_host_.get(), selected_host_.get() + n);
    if (Saves(op)) saved_selection_host_[S(op)] = selection_host_;
    selected_union_ = AttendedPages(c_, selection_host_);
    page_unions_.push_back(
        {op.phase, op.chunk, op.layer, static_cast<int64_t>(selected_union_.size())});
  }

  PageSelection Selection(const Op& op) const {
    PageSelection s;
    s.query_tile = o_.query_tile;
    if (c_.sparse) {
      s.pages_per_tile = std::min(c_.earlier_pages, o_.page_budget + o_.sink_pages);
      s.pages = op.phase == Phase::kBackward ? saved_selection_[S(op)].get() : selected_.get();
    }
    return s;
  }

  // The pages the tiles' selections of `op`'s layer attend, at most the slots the plan provisioned
  // (the staging copies and the backward's key-block launch both rely on that bound).
  std::vector<int32_t> UnionPages(const Op& op) const {
    // A sparse forward's union was taken when its selections came back (PageTopK).
    std::vector<int32_t> pages = op.phase == Phase::kBackward
                                     ? AttendedPages(c_, saved_selection_host_[S(op)])
                                 : c_.sparse ? selected_union_
                                             : AttendedPages(c_, selection_host_);
    if (static_cast<int64_t>(pages.size()) > slot_capacity_)
      throw InputError("page selections of chunk " + std::to_string(c_.index) + " layer " +
                       std::to_string(op.layer) + " need " + std::to_string(pages.size()) +
                       " page slots but the plan provisioned " + std::to_string(slot_capacity_) +
                       "; accepted: a selection model that bounds the union (--selection "
                       "disjoint)");
    return pages;
  }

  k::AttentionShape Shape() const {
    return {T(), m_.num_attention_heads, m_.num_key_value_heads, m_.head_dim, scale_};
  }

  void AttentionForward(const Op& op) {
    if (!IsLastAttentionOp(op, c_)) return;
    if (c_.earlier_pages > 0) page_reads_.Add(op.layer, UnionPages(op));
    attn_ptr_ = Saves(op) ? saved_attn_[S(op)].get() : attn_.get();
    float* lse = Saves(op) ? saved_lse_[S(op)].get() : lse_.get();
    PagedKv<bf16> e = Earlier<bf16>(op.layer, false);
    k::AttentionForward(Shape(), q_.get(), k_.get(), v_.get(),
                        PagedKv<const bf16>{e.shape, e.pool, e.page_slot, e.num_pages},
                        Selection(op), attn_ptr_, lse, compute_);
  }

  void AttentionBackward(const Op& op) {
    if (!IsLastAttentionOp(op, c_)) return;
    const std::vector<int32_t> pages =
        c_.earlier_pages > 0 ? UnionPages(op) : std::vector<int32_t>{};
    page_reads_.Add(op.layer, pages);
    PagedKv<bf16> e = Earlier<bf16>(op.layer, false);
    PagedKv<G> de = Earlier<G>(op.layer, true);
    PageSelection selection = Selection(op);
    if (c_.sparse) {
      // The backward launches key blocks over the union of the tiles' selections only. Its
      // pinned staging was last read by the copy two layers ago: wait for that before rewriting.
      HostWait(union_copied_[parity_]);
      std::copy(pages.begin(), pages.end(), union_host_[parity_].get());
      gpu::CopyBySms(union_host_[parity_].get(), union_dev_[parity_].get(),
                     static_cast<int64_t>(pages.size()), compute_);
      CTXPLAN_CUDA_CHECK(cudaEventRecord(union_copied_[parity_], compute_));
      selection.union_pages = union_dev_[parity_].get();
      selection.num_union_pages = static_cast<int64_t>(pages.size());
    }
    // The layer's DkvAccumulate, fused: dK/dV of the own positions come out with what later
    // chunks left in their pages already added.
    own_dkv_added_layer_ = -1;
    PagedKv<const G> own_dkv{};
    if (op.adds_own_dkv) {
      const PagedKv<G> own = OwnDkv(op.layer);
      own_dkv = {own.shape, own.pool, own.page_slot, own.num_pages};
      own_dkv_added_layer_ = op.layer;
    }
    k::AttentionBackward(Shape(), q_.get(), k_.get(), v_.get(),
                         PagedKv<const bf16>{e.shape, e.pool, e.page_slot, e.num_pages}, selection,
                         saved_attn_[S(op)].get(), saved_lse_[S(op)].get(), d_attn_.get(),
                         dq_.get(), dk_.get(), dv_.get(), de, attention_ws_.get(),
                         attention_ws_.bytes(), compute_, op.adds_own_dkv ? &own_dkv : nullptr);
  }

  struct PagePair {  // one page copy: device slot <-> pinned host page
    std::byte* dst;
    const std::byte* src;
  };

  // One copy per run of pages that are contiguous on both sides, the runs issued as one batch.
  void CopyRuns(const std::vector<PagePair>& pairs, size_t page_bytes, cudaStream_t stream) {
    copy_batch_.Clear();
    size_t i = 0;
    while (i < pairs.size()) {
      size_t run = 1;
      while (i + run < pairs.size() && pairs[i + run].dst == pairs[i].dst + run * page_bytes &&
             pairs[i + run].src == pairs[i].src + run * page_bytes)
        ++run;
      copy_batch_.Add(pairs[i].dst, pairs[i].src, run * page_bytes);
      i += run;
    }
    if (freed_device_memory_ != nullptr && stream == d2h_ && copy_batch_.size() > 0) {
      // copy-error: the first copy home reads a freed device block instead of its slot (named a
      // device address, so the copy engine, not the host, reads it).
      const void* freed = std::exchange(freed_device_memory_, nullptr);
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(copy_batch_.dsts[0], freed,
                                         std::min(copy_batch_.sizes[0], kFreedBytes),
                                         cudaMemcpyDeviceToHost, stream));
    }
    gpu::IssueCopyBatch(copy_batch_, stream);
  }

  // Zeroes the slots listed (ascending), one memset per run of consecutive slots.
  void ZeroSlots(std::byte* base, const std::vector<int64_t>& slots, size_t slot_bytes,
                 cudaStream_t stream) {
    size_t i = 0;
    while (i < slots.size()) {
      size_t run = 1;
      while (i + run < slots.size() && slots[i + run] == slots[i] + static_cast<int64_t>(run))
        ++run;
      CTXPLAN_CUDA_CHECK(cudaMemsetAsync(base + static_cast<size_t>(slots[i]) * slot_bytes, 0,
                                         run * slot_bytes, stream));
      i += run;
    }
  }

  // CopyIn with the GPU tier: the layer's table maps each attended page to its tier page or to a
  // union slot; only the host tier's pages (union_) and the host tier's own dKV come in.
  void CopyInTiered(const Op& op) {
    const auto l = static_cast<size_t>(op.layer);
    const std::vector<int32_t> attended = UnionPages(op);
    const OpId previous = table_user_[parity_];
    if (previous != kNoOp && event_op_[previous % kEventRing] == previous)
      HostWait(events_[previous % kEventRing]);
    table_user_[parity_] = op.id;
    table_staged_[parity_] = layer_key_;
    int32_t* table = slot_table_host_[parity_].get();
    std::fill(table, table + std::max<int64_t>(c_.earlier_pages, 0), -1);
    union_.clear();
    for (const int32_t page : attended) {
      if (page < tier_pages_) {
        table[page] = static_cast<int32_t>(TierBase(op.layer) + page);
      } else {
        table[page] =
            static_cast<int32_t>(UnionSlotBase(parity_) + static_cast<int64_t>(union_.size()));
        union_.push_back(page);
      }
    }
    CTXPLAN_CHECK(static_cast<int64_t>(union_.size()) <= host_slot_capacity_,
                  "CUDA backend: the host tier's union of chunk " + std::to_string(c_.index) +
                      " layer " + std::to_string(l) + " exceeds its slots");
    if (c_.earlier_pages > 0)
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(slot_table_[parity_].get(), table,
                                         static_cast<size_t>(c_.earlier_pages) * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, h2d_));
    StageUnionKv(l, reinterpret_cast<std::byte*>(tier_kv_pool_.get()) +
                        static_cast<size_t>(UnionSlotBase(parity_) * pe_) * sizeof(bf16));
    if (op.phase != Phase::kBackward) return;

    auto* pool = reinterpret_cast<std::byte*>(tier_dkv_pool_.get());
    const size_t dkv_bytes = static_cast<size_t>(pe_) * sizeof(G);
    StageDkv(l, pool + static_cast<size_t>(UnionSlotBase(parity_)) * dkv_bytes,
             pool + static_cast<size_t>(OwnSlotBase(parity_)) * dkv_bytes);
  }

  // CopyOut with the GPU tier: the host tier's fresh KV (fill) and accumulated dKV go home.
  void CopyOutTiered(const Op& op) {
    const auto l = static_cast<size_t>(op.layer);
    pairs_.clear();
    if (op.phase == Phase::kFill) {
      const size_t kv_bytes = static_cast<size_t>(pe_) * sizeof(bf16);
      auto* slots = reinterpret_cast<std::byte*>(tier_kv_pool_.get()) +
                    static_cast<size_t>(OwnSlotBase(own_parity_)) * kv_bytes;
      for (int64_t j = 0; j < c_.own_pages; ++j) {
        const int64_t page = c_.earlier_pages + j;
        if (page < tier_pages_) continue;  // written in place in the tier
        gpu::PageId& home = kv_page_[l][static_cast<size_t>(page)];
        if (home == gpu::kNoPage) home = kv_store_->Allocate();  // kept for every later step
        pairs_.push_back({kv_store_->HostPtr(home), slots + static_cast<size_t>(j) * kv_bytes});
      }
      CopyRuns(pairs_, kv_bytes, d2h_);
      return;
    }
    const size_t dkv_bytes = static_cast<size_t>(pe_) * sizeof(G);
    auto* slots = reinterpret_cast<std::byte*>(tier_dkv_pool_.get()) +
                  static_cast<size_t>(UnionSlotBase(parity_)) * dkv_bytes;
    for (size_t j = 0; j < union_.size(); ++j)
      pairs_.push_back({dkv_store_->HostPtr(DkvHome(l, union_[j])), slots + j * dkv_bytes});
    CopyRuns(pairs_, dkv_bytes, d2h_);
  }

  // The host page of dKV page `page` of layer `l`, allocated on its first write of the step.
  gpu::PageId DkvHome(size_t l, int64_t page) {
    gpu::PageId& home = dkv_page_[l][static_cast<size_t>(page)];
    if (home == gpu::kNoPage) {
      home = dkv_store_->Allocate();
      dkv_allocated_.push_back(home);
    }
    return home;
  }

  void CopyIn(const Op& op) {
    if (op.phase == Phase::kOptimizer) {  // the host optimizer's new weights
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(Region(MemCategory::kWeights), host_weights_.get(),
                                         host_weights_.size() * sizeof(bf16),
                                         cudaMemcpyHostToDevice, h2d_));
      return;
    }
    if (tier_pages_ > 0) return CopyInTiered(op);
    const auto l = static_cast<size_t>(op.layer);
    union_ = UnionPages(op);
    // The host staging of this parity's table was last read by a copy two layers ago: it must
    // have finished before the host rewrites the table.
    const OpId previous = table_user_[parity_];
    if (previous != kNoOp && event_op_[previous % kEventRing] == previous)
      HostWait(events_[previous % kEventRing]);
    table_user_[parity_] = op.id;
    int32_t* table = slot_table_host_[parity_].get();
    std::fill(table, table + std::max<int64_t>(c_.earlier_pages, 0), -1);
    for (size_t j = 0; j < union_.size(); ++j) table[union_[j]] = static_cast<int32_t>(j);
    if (c_.earlier_pages > 0)
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(slot_table_[parity_].get(), table,
                                         static_cast<size_t>(c_.earlier_pages) * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, h2d_));
    StageUnionKv(l, reinterpret_cast<std::byte*>(kv_slots_[parity_].get()));
    if (op.phase != Phase::kBackward) return;

    StageDkv(l, reinterpret_cast<std::byte*>(dkv_slots_[parity_].get()),
             reinterpret_cast<std::byte*>(own_dkv_slots_[parity_].get()));
  }

  // The union's host pages (union_) of layer `l` into consecutive slots from `slots`.
  void StageUnionKv(size_t l, std::byte* slots) {
    const size_t kv_bytes = static_cast<size_t>(pe_) * sizeof(bf16);
    pairs_.clear();
    for (size_t j = 0; j < union_.size(); ++j) {
      const gpu::PageId home = kv_page_[l][static_cast<size_t>(union_[j])];
      CTXPLAN_CHECK(home != gpu::kNoPage, "CUDA backend: KV page " + std::to_string(union_[j]) +
                                              " of layer " + std::to_string(l) +
                                              " is read before the fill wrote it home");
      pairs_.push_back({slots + j * kv_bytes, kv_store_->HostPtr(home)});
    }
    CopyRuns(pairs_, kv_bytes, h2d_);
  }

  // dKV: the union's host pages written earlier this step come in, the others start at zero;
  // then the same for the chunk's own pages (own page j into own slot j). Pages of the GPU tier
  // accumulate in place and are skipped.
  void StageDkv(size_t l, std::byte* union_slots, std::byte* own_slots) {
    const size_t dkv_bytes = static_cast<size_t>(pe_) * sizeof(G);
    for (int own = 0; own < 2; ++own) {
      std::byte* slots = own ? own_slots : union_slots;
      const size_t count = own ? static_cast<size_t>(c_.own_pages) : union_.size();
      pairs_.clear();
      zero_.clear();
      for (size_t j = 0; j < count; ++j) {
        const int64_t page = own ? c_.earlier_pages + static_cast<int64_t>(j) : union_[j];
        if (page < tier_pages_) continue;
        const gpu::PageId home = dkv_page_[l][static_cast<size_t>(page)];
        if (home == gpu::kNoPage)
          zero_.push_back(static_cast<int64_t>(j));
        else
          pairs_.push_back({slots + j * dkv_bytes, dkv_store_->HostPtr(home)});
      }
      ZeroSlots(slots, zero_, dkv_bytes, h2d_);
      CopyRuns(pairs_, dkv_bytes, h2d_);
    }
  }

  void CopyOut(const Op& op) {
    if (op.phase == Phase::kOptimizer) {  // the gradients go home to the host optimizer
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(host_grads_.get(), Region(MemCategory::kGrads),
                                         host_grads_.size() * sizeof(G), cudaMemcpyDeviceToHost,
                                         d2h_));
      return;
    }
    if (tier_pages_ > 0) return CopyOutTiered(op);
    const auto l = static_cast<size_t>(op.layer);
    pairs_.clear();
    if (op.phase == Phase::kFill) {  // the chunk's fresh KV pages go home
      const size_t kv_bytes = static_cast<size_t>(pe_) * sizeof(bf16);
      auto* slots = reinterpret_cast<std::byte*>(own_kv_slots_[own_parity_].get());
      for (int64_t j = 0; j < c_.own_pages; ++j) {
        gpu::PageId& home = kv_page_[l][static_cast<size_t>(c_.earlier_pages + j)];
        if (home == gpu::kNoPage) home = kv_store_->Allocate();  // kept for every later step
        pairs_.push_back({kv_store_->HostPtr(home), slots + static_cast<size_t>(j) * kv_bytes});
      }
      CopyRuns(pairs_, kv_bytes, d2h_);
      return;
    }
    const size_t dkv_bytes = static_cast<size_t>(pe_) * sizeof(G);
    auto* slots = reinterpret_cast<std::byte*>(dkv_slots_[parity_].get());
    for (size_t j = 0; j < union_.size(); ++j)
      pairs_.push_back({dkv_store_->HostPtr(DkvHome(l, union_[j])), slots + j * dkv_bytes});
    CopyRuns(pairs_, dkv_bytes, d2h_);
  }

  // AdamW on the CPU over the staged gradients (host_adamw.h), on the host copy of the weights.
  void HostOptimizer() {
    std::vector<HostAdamWTensor> tensors;
    std::vector<const bf16*> w_ptrs;
    weights_.ForEach([&](DeviceArray<bf16>& t) { w_ptrs.push_back(t.get()); });
    const auto* w_base = reinterpret_cast<const bf16*>(Region(MemCategory::kWeights));
    const auto* g_base = reinterpret_cast<const G*>(Region(MemCategory::kGrads));
    size_t i = 0, moment = 0;
    grads_.ForEach([&](DeviceArray<G>& t) {
      tensors.push_back({static_cast<size_t>(w_ptrs[i] - w_base),
                         static_cast<size_t>(t.get() - g_base), moment, t.size()});
      moment += t.size();
      ++i;
    });
    const k::AdamWParams next = NextAdamWStep();
    const HostAdamWParams p{next.lr,  next.beta1,        next.beta2,
                            next.eps, next.weight_decay, next.step};
    using GradBits = std::conditional_t<std::is_same_v<G, float>, float, uint16_t>;
    HostAdamWStep<GradBits>(p, tensors, reinterpret_cast<uint16_t*>(host_weights_.get()),
                            reinterpret_cast<const GradBits*>(host_grads_.get()), host_m_.data(),
                            host_v_.data(),
                            std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  }

  // The next AdamW step's parameters (bias corrections count the steps taken).
  k::AdamWParams NextAdamWStep() {
    k::AdamWParams p;
    p.lr = adamw_.lr;
    p.beta1 = adamw_.beta1;
    p.beta2 = adamw_.beta2;
    p.eps = adamw_.eps;
    p.weight_decay = adamw_.weight_decay;
    p.step = ++adam_step_;
    return p;
  }

  void Optimizer() {
    if (Lora()) {
      OptimizerLora();
      return;
    }
    const k::AdamWParams p = NextAdamWStep();
    std::vector<DeviceArray<bf16>*> w;
    std::vector<DeviceArray<G>*> g;
    std::vector<DeviceArray<float>*> m, v;
    weights_.ForEach([&](DeviceArray<bf16>& t) { w.push_back(&t); });
    grads_.ForEach([&](DeviceArray<G>& t) { g.push_back(&t); });
    adam_m_.ForEach([&](DeviceArray<float>& t) { m.push_back(&t); });
    adam_v_.ForEach([&](DeviceArray<float>& t) { v.push_back(&t); });
    for (size_t i = 0; i < w.size(); ++i)
      if (w[i]->size() > 0)  // another stage's tensor
        k::AdamW(w[i]->get(), g[i]->get(), m[i]->get(), v[i]->get(),
                 static_cast<int64_t>(w[i]->size()), p, compute_);
  }

  void OptimizerLora() {
    const k::AdamWParams p = NextAdamWStep();
    for (size_t l = 0; l < lora_.size(); ++l)
      for (OpPart part : kLoraParts)
        for (DeviceLoraProjection<G>& d : LoraPart(l, part)) {
          k::AdamW(d.a.get(), d.grad_a.get(), d.m_a.get(), d.v_a.get(),
                   static_cast<int64_t>(d.a.size()), p, compute_);
          k::AdamW(d.b.get(), d.grad_b.get(), d.m_b.get(), d.v_b.get(),
                   static_cast<int64_t>(d.b.size()), p, compute_);
        }
  }

  // --- state -------------------------------------------------------------------------------
  const ModelSpec m_;
  const RunOptions o_;
  const PlanGeometry g_;
  CudaAdamW adamw_;
  StagePeers* peers_ = nullptr;  // several GPUs: the neighbouring stages
  int32_t rank_ = 0;             // the pipeline stage this backend runs
  int32_t first_layer_ = 0, end_layer_ = 0, stage_layers_ = 0;  // its layers
  // Boundary buffers, per parity: forward [2][c][d] (residual, pending add), backward [c][d].
  DeviceArray<bf16> forward_send_[2], forward_recv_[2], backward_send_[2], backward_recv_[2];
  int64_t adam_step_ = 0;
  int64_t d_ = 0, q_dim_ = 0, kv_dim_ = 0, qkv_dim_ = 0, inter_ = 0, vocab_ = 0, layers_ = 0;
  float scale_ = 1.0f;
  KvPageShape shape_;
  int64_t pe_ = 0, total_pages_ = 0, own_capacity_ = 0, slot_capacity_ = 0;
  int64_t tier_pages_ = 0, host_slot_capacity_ = 0;  // the GPU tier (TierPoolPages)

  cudaStream_t compute_ = nullptr, h2d_ = nullptr, d2h_ = nullptr;
  std::vector<cudaEvent_t> events_;
  std::vector<OpId> event_op_;  // which op each event last recorded
  k::CublasLtGemm gemm_;

  DeviceWeights<bf16> weights_;
  std::unique_ptr<gpu::DeviceArena> arena_;  // every device buffer below lives in it
  // LoRA: the adapters of every layer's parts, their scratch [c][r], a sink for frozen norms.
  std::vector<LoraParts<DeviceLoraProjection<G>>> lora_;
  float lora_scale_ = 1.0f;
  DeviceArray<bf16> lora_u_, lora_du_;
  DeviceArray<G> frozen_dw_;
  // adamw-host: the staged gradients and the host's weights (laid out as their arena regions),
  // and the moments (one per parameter, in ForEach order).
  PinnedArray<G> host_grads_;
  PinnedArray<bf16> host_weights_;
  std::vector<float> host_m_, host_v_;
  DeviceWeights<G> grads_;
  DeviceWeights<float> adam_m_, adam_v_;

  DeviceArray<int32_t> tokens_, labels_;
  DeviceArray<bf16> h_, h_alt_, pending_, xn_, qkv_, q_, k_, v_, attn_, o_out_, hmid_, xn2_,
      gate_up_, act_, xnf_, hf_;
  DeviceArray<bf16> dh_, d_act_, d_gate_up_, d_xn2_, d_hmid_, d_attn_, dq_, dk_, dv_, dqkv_, d_xn_,
      d_xnf_;
  DeviceArray<float> lse_, rstd1_, rstd2_, rstdf_, scores_, loss_;
  DeviceArray<std::byte> norm_scratch_, attention_ws_, score_ws_, loss_ws_;
  DeviceArray<float> final_norm_partials_;  // [rows][d]: see FinalNormBackward
  int final_norm_rows_ = 0;                 // the most partial rows a call of this step added to
  int64_t final_norm_backwards_ = 0;        // the step's final-norm backwards run so far
  DeviceArray<int32_t> selected_;
  PinnedArray<int32_t> selected_host_;
  std::vector<int32_t> selection_host_;
  std::vector<int32_t> selected_union_;  // [distinct pages] of selection_host_, ascending
  int64_t pages_per_tile_ = 0;
  const bf16* x_ = nullptr;   // the current layer's input
  bf16* attn_ptr_ = nullptr;  // where the forward wrote this layer's attention output
  const bf16* hmid_ptr_ = nullptr;

  std::vector<DeviceArray<bf16>> saved_input_, saved_attn_;
  std::vector<DeviceArray<float>> saved_lse_;
  std::vector<DeviceArray<int32_t>> saved_selection_;
  std::vector<std::vector<int32_t>> saved_selection_host_;
  std::vector<DeviceArray<bf16>> saved_top_h_, saved_top_pending_;

  std::vector<DeviceArray<bf16>> summaries_;  // [layer][pages][kv_dim]
  DeviceArray<int32_t> identity_, own_identity_;
  // Offload on: the pinned host homes of KV (bf16) and dKV (G) pages, and which store page holds
  // each [layer][logical page] (kNoPage: not written yet this step, for dKV).
  std::unique_ptr<gpu::PinnedPageStore> kv_store_, dkv_store_;
  std::vector<std::vector<gpu::PageId>> kv_page_, dkv_page_;
  std::vector<DeviceArray<bf16>> device_kv_;  // offload off: [layer][pages][page elements]
  std::vector<DeviceArray<G>> device_dkv_;
  DeviceArray<bf16> kv_slots_[2], own_kv_slots_[2];  // [slots][2][p][H_kv][d_h]
  DeviceArray<G> dkv_slots_[2], own_dkv_slots_[2];
  DeviceArray<int32_t> slot_table_[2];
  PinnedArray<int32_t> slot_table_host_[2];
  // The GPU tier: its pools (TierPoolPages), the own pages' tables per parity, and the
  // (phase, chunk, layer) / (chunk, layer, parity) each parity's tables were last written for.
  DeviceArray<bf16> tier_kv_pool_;
  DeviceArray<G> tier_dkv_pool_;
  DeviceArray<int32_t> tier_own_table_[2];
  DeviceArray<int32_t> tier_table_;  // [pages]: a layer's earlier pages, all in the tier
  std::array<int32_t, 3> tier_table_staged_{-1, -1, -1};
  std::array<int32_t, 3> table_staged_[2] = {{-1, -1, -1}, {-1, -1, -1}};
  std::array<int32_t, 3> own_table_staged_[2] = {{-1, -1, -1}, {-1, -1, -1}};
  std::vector<int32_t> union_;
  std::vector<StepOutputs::PageUnion> page_unions_;  // this step's, for its trace
  PageReads page_reads_;                             // this step's (page_reads.h)
  // Sparse backward: the union's page list on the device, its pinned staging, and an event after
  // each upload (so the host rewrites a staging buffer only once its copy is done), per parity.
  DeviceArray<int32_t> union_dev_[2];
  PinnedArray<int32_t> union_host_[2];
  cudaEvent_t union_copied_[2] = {nullptr, nullptr};
  int32_t own_dkv_added_layer_ = -1;        // the layer whose attention backward did DkvAccumulate
  std::vector<gpu::PageId> dkv_allocated_;  // this step's dKV pages, in allocation order
  std::vector<PagePair> pairs_;             // scratch of CopyIn / CopyOut
  gpu::CopyBatch copy_batch_;               // scratch of CopyRuns
  std::vector<int64_t> zero_;
  OpId table_user_[2] = {kNoOp, kNoOp};  // the copy that last read each staging table

  int32_t chunk_index_ = -1;
  ChunkGeometry c_;
  bool has_pending_ = false;
  std::array<int32_t, 3> layer_key_{-1, -1, -1};
  uint64_t slot_uses_ = 0, own_uses_ = 0;
  int parity_ = 0, own_parity_ = 0;
  int64_t labelled_total_ = 0, labelled_ = 0;
  uint64_t ops_ = 0;
  PlanMemoryTally memory_;
  gpu::InjectedFault fault_ = gpu::InjectedFault::kNone;
  void* freed_device_memory_ = nullptr;  // copy-error: freed at start-up, copied from mid-offload
  CudaStartupTimes startup_;
};

}  // namespace

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
void CudaBackend::UploadOptimizer(const CudaOptimizerState& state) {
  impl_->UploadOptimizer(state);
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
