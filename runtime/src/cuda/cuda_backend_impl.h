// The CUDA backend's implementation (cuda_backend.h says what the backend does): TypedImpl<G>, one
// class for G = float or bf16 gradients and dKV pages, its members defined by concern in
//   cuda_backend.cpp            construction: the arena's layout, the pinned page stores, the
//                               start-up phases; and CudaBackend, which picks G
//   cuda_backend_step.cpp       a step: the op dispatcher, the streams' and the host's waits, the
//                               pipeline stage boundaries
//   cuda_backend_layers.cpp     the layer's ops: embedding, RMSNorm, linears and their LoRA
//                               adapters, RoPE, SwiGLU, the loss
//   cuda_backend_attention.cpp  KV pages, page selection and attention, and where the kernels find
//                               the pages
//   cuda_backend_offload.cpp    page copies between the GPU and the pinned host page stores
//   cuda_backend_optimizer.cpp  AdamW on the GPU or the host, and the state a checkpoint carries
// Each file instantiates the members it defines for both G (template class at its end), so a
// member compiles once and only this declaration is shared. Private to the backend: included by
// those files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cuda/attention.h"
#include "ctxplan/kernels/cuda/gemm.h"
#include "ctxplan/kernels/cuda/lora_gemm.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/cuda/cuda_backend.h"
#include "ctxplan/runtime/cuda/device_arena.h"
#include "ctxplan/runtime/cuda/injected_fault.h"
#include "ctxplan/runtime/cuda/memcpy_batch.h"
#include "ctxplan/runtime/cuda/pinned_page_store.h"
#include "ctxplan/runtime/plan/lora.h"
#include "ctxplan/runtime/plan/op_dispatch.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "device_buffers.h"
#include "device_weights.h"

namespace ctxplan {

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
  virtual void UploadOptimizer(CudaOptimizerState state) = 0;
  virtual CudaMemoryReport Memory() = 0;
  virtual LoraWeights DownloadLora(bool grads) = 0;
  virtual CudaStartupTimes StartupTimes() const = 0;
};

namespace cuda_backend_detail {

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

template <typename G>  // gradients and dKV pages: float or bf16 (the run's grad dtype)
class TypedImpl final : public CudaBackend::Impl {
 public:
  static constexpr const char* kName = "CUDA backend";
  // cuda_backend.cpp
  TypedImpl(const StepPlan& plan, ModelWeights weights, CudaAdamW adamw, std::ostream* log,
            const LoraWeights* lora, StagePeers* peers);
  ~TypedImpl() override;
  CudaMemoryReport Memory() override;
  CudaStartupTimes StartupTimes() const override { return startup_; }
  // cuda_backend_step.cpp
  void BeginStep(const StepPlan& plan, const StepInputs& inputs) override;
  StepOutputs EndStep() override;
  void Execute(const Op& op) override;
  // cuda_backend_optimizer.cpp
  void ZeroGrads() override;
  ModelWeights DownloadWeights() override;
  ModelWeights DownloadGrads() override;
  CudaOptimizerState DownloadOptimizer() override;
  void UploadOptimizer(CudaOptimizerState state) override;
  void UploadOptimizerState(CudaOptimizerState state);  // UploadOptimizer between syncs
  LoraWeights DownloadLora(bool grads) override;
  void CopyLoraMoments(LoraWeights& m, LoraWeights& v, cudaMemcpyKind kind);
  void CopyHostMoments(ModelWeights& m, ModelWeights& v, bool to_host_optimizer);
  // cuda_backend_step.cpp
  void SumTiedEmbeddingGrads();

 private:
  static constexpr size_t kEventRing = 2 * StepPlan::kMaxDependencyDistance + 1024;
  static constexpr size_t kFreedBytes = size_t{2} << 20;  // copy-error's freed device block

  template <typename Backend>
  friend void ctxplan::DispatchComputeOp(Backend& backend, const Op& op);

  bool Lora() const { return o_.lora_rank > 0; }
  std::vector<DeviceLoraProjection<G>>& LoraPart(size_t layer, OpPart part) {
    return lora_[layer].Part(part);
  }
  int64_t T() const { return c_.tokens; }
  size_t S(const Op& op) const { return SavedLayerSlot(op, g_); }
  bool Saves(const Op& op) const { return SavesLayerState(op, o_.keep_layer_inputs); }
  DeviceLayer<bf16>& W(const Op& op) { return weights_.layers[static_cast<size_t>(op.layer)]; }
  DeviceLayer<G>& Grad(const Op& op) { return grads_.layers[static_cast<size_t>(op.layer)]; }
  float Eps() const { return static_cast<float>(m_.rms_norm_eps); }
  bool Owns(int32_t layer) const { return layer >= first_layer_ && layer < end_layer_; }
  std::byte* Region(MemCategory category) const {
    return arena_->base() + arena_->region_offset(category);
  }

  // --- construction (cuda_backend.cpp) ---
  void Upload(ModelWeights& w);
  void UploadLora(const LoraWeights& lora);
  void ClearRegion(MemCategory category);

  // --- the step (cuda_backend_step.cpp) ---
  void Run(const Op& op);
  void InjectAfterAttentionBackward(cudaStream_t stream);
  cudaStream_t StreamOf(Stream s) const;
  void HostWait(cudaEvent_t event);
  void HostWait(cudaStream_t stream);
  void WaitOnHost(OpId dep);
  void Wait(cudaStream_t stream, OpId dep);
  void NoteLayer(const Op& op);
  void StartChunk(int32_t index);
  void BoundaryPack(const Op& op);
  void BoundaryUnpack(const Op& op);
  void PeerSend(const Op& op);
  void PeerRecv(const Op& op);
  void SliceToStage(ModelWeights& w) const;

  // --- the layer's ops (cuda_backend_layers.cpp) ---
  void EmbeddingForward(const Op&);
  void EmbeddingBackward(const Op&);
  void NormForward(const Op& op);
  void NormBackward(const Op& op);
  void FinalNormBackward();
  void Copy2D(bf16* dst, int64_t dst_cols, const bf16* src, int64_t src_cols, int64_t cols,
              cudaStream_t stream);
  void LinearForward(const Op& op);
  void LinearBackward(const Op& op, bool input);
  void LinearBackwardBase(const Op& op, bool input);
  void LoraForward(const Op& op, const bf16* x, bf16* y, int64_t y_stride);
  void LoraBackward(const Op& op, bool input, const bf16* x, const bf16* dy, int64_t dy_stride,
                    bf16* dx);
  void RopeForward(const Op&);
  void RopeBackward(const Op&);
  void SwigluForward(const Op&);
  void SwigluBackward(const Op&);
  void Loss(const Op&);
  k::LinearCrossEntropyShape LossShape(int64_t tokens) const {
    return {tokens, d_, vocab_, std::max<int64_t>(tokens, 1), std::min(kLossVocabTile, vocab_)};
  }
  k::LoraProjectionGemm LoraGemm(const DeviceLoraProjection<G>& p) const {
    return {T(), o_.lora_rank, p.in, p.out, p.out_offset, lora_scale_, p.a.get(), p.b.get()};
  }
  // Where a norm's weight gradient goes: its gradient, or a sink when the base is frozen.
  G* NormGrad(DeviceArray<G>& grad) { return Lora() ? frozen_dw_.get() : grad.get(); }

  // --- pages and attention (cuda_backend_attention.cpp) ---
  void KvWrite(const Op& op);
  void PageSummary(const Op& op);
  void PageScore(const Op& op);
  void PageTopK(const Op& op);
  PageSelection Selection(const Op& op) const;
  std::vector<int32_t> UnionPages(const Op& op) const;
  void AttentionForward(const Op& op);
  void AttentionBackward(const Op& op);
  void DkvAccumulate(const Op& op);
  PagedKv<bf16> OwnKv(int32_t layer);
  PagedKv<G> OwnDkv(int32_t layer);
  const int32_t* OwnTable(int32_t layer, int parity);
  template <typename T>
  PagedKv<T> EarlierInTier(int32_t layer, bool dkv);
  template <typename T>
  PagedKv<T> Earlier(int32_t layer, bool dkv);
  k::AttentionShape Shape() const {
    return {T(), m_.num_attention_heads, m_.num_key_value_heads, m_.head_dim, scale_};
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

  // --- offload (cuda_backend_offload.cpp) ---
  struct PagePair {  // one page copy: device slot <-> pinned host page
    std::byte* dst;
    const std::byte* src;
  };
  void CopyIn(const Op& op);
  void CopyInTiered(const Op& op);
  void StageUnionKv(size_t l, std::byte* slots);
  void StageDkv(size_t l, std::byte* union_slots, std::byte* own_slots);
  void ZeroFill(const Op&);
  void CopyOut(const Op& op);
  void CopyOutTiered(const Op& op);
  gpu::PageId DkvHome(size_t l, int64_t page);
  void CopyRuns(const std::vector<PagePair>& pairs, size_t page_bytes, cudaStream_t stream);
  void ZeroSlots(std::byte* base, const std::vector<int64_t>& slots, size_t slot_bytes,
                 cudaStream_t stream);

  // --- the optimizer (cuda_backend_optimizer.cpp) ---
  void OptimizerStep(const Op&);
  void Optimizer();
  void OptimizerLora();
  k::AdamWParams NextAdamWStep();
  void HostOptimizer();

  // --- state -------------------------------------------------------------------------------
  const ModelSpec m_;
  const RunOptions o_;
  const PlanGeometry g_;
  CudaAdamW adamw_;
  StagePeers* peers_ = nullptr;  // several GPUs: the neighbouring stages
  int32_t rank_ = 0;             // the pipeline stage this backend runs
  int32_t first_layer_ = 0, end_layer_ = 0, stage_layers_ = 0;  // its layers
  // A tied LM head over two GPUs: the first and last stage sum their embedding gradients once a
  // step (SumTiedEmbeddingGrads).
  bool sums_tied_embedding_ = false, tied_embedding_summed_ = false;
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

}  // namespace cuda_backend_detail
}  // namespace ctxplan
