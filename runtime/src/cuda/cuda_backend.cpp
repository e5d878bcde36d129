#include "ctxplan/runtime/cuda/cuda_backend.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "ctxplan/kernels/cuda/attention.h"
#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/cuda/gemm.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan_geometry.h"

namespace ctxplan {

namespace k = kernels::cuda;
using kernels::KvPageShape;
using kernels::PagedKv;
using kernels::PageSelection;
using bf16 = __nv_bfloat16;

namespace {

// One device allocation, made when the backend is built and never inside a step.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t n) { Resize(n); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceArray() {
    if (ptr_) cudaFree(ptr_);  // destructors cannot throw; a failing free is reported nowhere
  }
  void Resize(size_t n) {
    if (ptr_) CTXPLAN_CUDA_CHECK(cudaFree(ptr_));
    ptr_ = nullptr;
    n_ = n;
    if (n > 0) CTXPLAN_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), n * sizeof(T)));
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

// Pinned host memory: the home of offloaded pages and the staging of small tables.
template <typename T>
class PinnedArray {
 public:
  PinnedArray() = default;
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  PinnedArray(PinnedArray&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  ~PinnedArray() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  void Resize(size_t n) {
    if (ptr_) CTXPLAN_CUDA_CHECK(cudaFreeHost(ptr_));
    ptr_ = nullptr;
    n_ = n;
    if (n > 0) {
      const cudaError_t status =
          cudaHostAlloc(reinterpret_cast<void**>(&ptr_), n * sizeof(T), cudaHostAllocDefault);
      if (status != cudaSuccess)
        throw TrainingError("pinning " + std::to_string(n * sizeof(T)) +
                            " bytes of host memory failed: " + cudaGetErrorString(status));
    }
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

template <typename T>
struct DeviceLayer {
  DeviceArray<T> attn_norm, qkv, qkv_bias, o, mlp_norm, gate_up, down;
};

template <typename T>
struct DeviceWeights {
  DeviceArray<T> embedding;
  std::vector<DeviceLayer<T>> layers;
  DeviceArray<T> final_norm, lm_head;

  // The same tensors, in the same order, as ModelWeights::ForEach.
  template <typename F>
  void ForEach(F visit) {
    visit(embedding);
    for (DeviceLayer<T>& l : layers) {
      visit(l.attn_norm);
      visit(l.qkv);
      if (l.qkv_bias.size() > 0) visit(l.qkv_bias);
      visit(l.o);
      visit(l.mlp_norm);
      visit(l.gate_up);
      visit(l.down);
    }
    visit(final_norm);
    if (lm_head.size() > 0) visit(lm_head);
  }
};

template <typename T>
DeviceWeights<T> AllocateLike(const ModelWeights& host) {
  DeviceWeights<T> d;
  d.embedding.Resize(host.embedding.size());
  d.layers.resize(host.layers.size());
  for (size_t i = 0; i < host.layers.size(); ++i) {
    const LayerWeights& h = host.layers[i];
    DeviceLayer<T>& l = d.layers[i];
    l.attn_norm.Resize(h.attn_norm.size());
    l.qkv.Resize(h.qkv.size());
    l.qkv_bias.Resize(h.qkv_bias.size());
    l.o.Resize(h.o.size());
    l.mlp_norm.Resize(h.mlp_norm.size());
    l.gate_up.Resize(h.gate_up.size());
    l.down.Resize(h.down.size());
  }
  d.final_norm.Resize(host.final_norm.size());
  d.lm_head.Resize(host.lm_head.size());
  return d;
}

std::vector<std::vector<float>*> HostTensors(ModelWeights& w) {
  std::vector<std::vector<float>*> all;
  w.ForEach([&](const std::string&, std::vector<float>& t) { all.push_back(&t); });
  return all;
}

}  // namespace

class CudaBackend::Impl {
 public:
  Impl(const StepPlan& plan, const ModelWeights& weights, CudaAdamW adamw)
      : m_(plan.model()), o_(plan.options()), g_(plan.geometry()), adamw_(adamw) {
    if (o_.lora_rank > 0)
      throw InputError(
          "--lora-rank: the CUDA backend trains full parameters only so far; "
          "accepted: 0");
    if (o_.grad_dtype != GradDtype::kFp32)
      throw InputError(
          "--grad-dtype: the CUDA backend keeps fp32 gradients and dKV so far; "
          "accepted: fp32");
    if (o_.optimizer == OptimizerKind::kAdamWHost)
      throw InputError(
          "--optimizer: the CUDA backend steps AdamW on the GPU so far; accepted: "
          "adamw-gpu, none");
    if (m_.head_dim != 64 && m_.head_dim != 128)
      throw InputError("model head_dim " + std::to_string(m_.head_dim) +
                       ": the CUDA attention kernels take 64 or 128");
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

    for (cudaStream_t* s : {&compute_, &h2d_, &d2h_})
      CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
    events_.resize(kEventRing);
    for (cudaEvent_t& e : events_)
      CTXPLAN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    event_op_.assign(kEventRing, kNoOp);

    // Weights in bf16, gradients and moments in fp32.
    weights_ = AllocateLike<bf16>(weights);
    grads_ = AllocateLike<float>(weights);
    Upload(weights);
    if (o_.optimizer == OptimizerKind::kAdamWGpu) {
      adam_m_ = AllocateLike<float>(weights);
      adam_v_ = AllocateLike<float>(weights);
      adam_m_.ForEach(
          [&](DeviceArray<float>& t) { CTXPLAN_CUDA_CHECK(cudaMemset(t.get(), 0, t.bytes())); });
      adam_v_.ForEach(
          [&](DeviceArray<float>& t) { CTXPLAN_CUDA_CHECK(cudaMemset(t.get(), 0, t.bytes())); });
    }
    ZeroGrads();

    // Per-chunk buffers (c tokens).
    const size_t c = static_cast<size_t>(o_.chunk_tokens);
    for (DeviceArray<bf16>* b : {&h_, &h_alt_, &pending_, &xn_, &o_out_, &hmid_, &xn2_, &xnf_, &hf_,
                                 &dh_, &d_hmid_, &d_xn2_, &d_xn_, &d_xnf_})
      b->Resize(c * static_cast<size_t>(d_));
    qkv_.Resize(c * static_cast<size_t>(qkv_dim_));
    dqkv_.Resize(qkv_.size());
    for (DeviceArray<bf16>* b : {&q_, &attn_, &dq_, &d_attn_})
      b->Resize(c * static_cast<size_t>(q_dim_));
    for (DeviceArray<bf16>* b : {&k_, &v_, &dk_, &dv_}) b->Resize(c * static_cast<size_t>(kv_dim_));
    gate_up_.Resize(c * 2 * static_cast<size_t>(inter_));
    d_gate_up_.Resize(gate_up_.size());
    act_.Resize(c * static_cast<size_t>(inter_));
    d_act_.Resize(act_.size());
    lse_.Resize(c * static_cast<size_t>(m_.num_attention_heads));
    for (DeviceArray<float>* b : {&rstd1_, &rstd2_, &rstdf_}) b->Resize(c);
    norm_scratch_.Resize(k::RmsNormBackwardScratchBytes(o_.chunk_tokens, d_));
    k::AttentionShape full{o_.chunk_tokens, m_.num_attention_heads, m_.num_key_value_heads,
                           m_.head_dim, scale_};
    attention_ws_.Resize(k::AttentionBackwardWorkspaceBytes(full));
    score_ws_.Resize(k::PageScoreWorkspaceBytes(o_.chunk_tokens, m_.num_key_value_heads,
                                                m_.head_dim, o_.query_tile));
    const int64_t tiles = (o_.chunk_tokens + o_.query_tile - 1) / o_.query_tile;
    scores_.Resize(static_cast<size_t>(tiles * std::max<int64_t>(total_pages_, 1)));
    const int64_t per_tile = o_.dense() ? 1 : o_.page_budget + o_.sink_pages;
    selected_.Resize(static_cast<size_t>(tiles * per_tile));
    selected_host_.Resize(selected_.size());
    loss_ws_.Resize(k::LinearCrossEntropyWorkspaceBytes(LossShape(o_.chunk_tokens)));
    loss_.Resize(static_cast<size_t>(g_.num_chunks()));
    tokens_.Resize(static_cast<size_t>(o_.context_tokens));
    labels_.Resize(static_cast<size_t>(o_.context_tokens));

    // What pass 2 reads back: per layer of one chunk, or of every chunk when kept.
    const size_t saved =
        static_cast<size_t>(layers_ * (o_.keep_layer_inputs ? g_.num_chunks() : 1));
    saved_input_.resize(saved);
    saved_attn_.resize(saved);
    saved_lse_.resize(saved);
    saved_selection_.resize(saved);
    saved_selection_host_.resize(saved);
    for (size_t i = 0; i < saved; ++i) {
      saved_input_[i].Resize(c * static_cast<size_t>(d_));
      saved_attn_[i].Resize(c * static_cast<size_t>(q_dim_));
      saved_lse_[i].Resize(lse_.size());
      saved_selection_[i].Resize(selected_.size());
    }
    if (o_.keep_layer_inputs) {
      saved_top_h_.resize(static_cast<size_t>(g_.num_chunks()));
      saved_top_pending_.resize(static_cast<size_t>(g_.num_chunks()));
      for (auto* v : {&saved_top_h_, &saved_top_pending_})
        for (DeviceArray<bf16>& b : *v) b.Resize(c * static_cast<size_t>(d_));
    }

    // Pages: summaries on the GPU; KV and dKV either pinned on the host with slot pools, or in
    // device stores.
    summaries_.resize(static_cast<size_t>(layers_));
    for (DeviceArray<bf16>& s : summaries_)
      s.Resize(static_cast<size_t>(std::max<int64_t>(total_pages_, 1) * kv_dim_));
    const size_t store = static_cast<size_t>(total_pages_ * pe_);
    identity_.Resize(static_cast<size_t>(std::max<int64_t>(total_pages_, 1)));
    std::vector<int32_t> identity(identity_.size());
    for (size_t i = 0; i < identity.size(); ++i) identity[i] = static_cast<int32_t>(i);
    CTXPLAN_CUDA_CHECK(
        cudaMemcpy(identity_.get(), identity.data(), identity_.bytes(), cudaMemcpyHostToDevice));
    if (o_.offload) {
      host_kv_.resize(static_cast<size_t>(layers_));
      host_dkv_.resize(static_cast<size_t>(layers_));
      for (auto& a : host_kv_) a.Resize(store);
      for (auto& a : host_dkv_) a.Resize(store);
      for (int p = 0; p < 2; ++p) {
        kv_slots_[p].Resize(static_cast<size_t>(slot_capacity_ * pe_));
        dkv_slots_[p].Resize(static_cast<size_t>(slot_capacity_ * pe_));
        own_kv_slots_[p].Resize(static_cast<size_t>(own_capacity_ * pe_));
        own_dkv_slots_[p].Resize(static_cast<size_t>(own_capacity_ * pe_));
        slot_table_[p].Resize(static_cast<size_t>(std::max<int64_t>(total_pages_, 1)));
        slot_table_host_[p].Resize(slot_table_[p].size());
      }
    } else {
      device_kv_.resize(static_cast<size_t>(layers_));
      device_dkv_.resize(static_cast<size_t>(layers_));
      for (auto& a : device_kv_) a.Resize(store);
      for (auto& a : device_dkv_) a.Resize(store);
    }
    std::vector<int32_t> own_identity(static_cast<size_t>(own_capacity_));
    for (size_t i = 0; i < own_identity.size(); ++i) own_identity[i] = static_cast<int32_t>(i);
    own_identity_.Resize(own_identity.size());
    CTXPLAN_CUDA_CHECK(cudaMemcpy(own_identity_.get(), own_identity.data(), own_identity_.bytes(),
                                  cudaMemcpyHostToDevice));
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
  }

  ~Impl() {
    cudaDeviceSynchronize();
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaStream_t s : {compute_, h2d_, d2h_}) cudaStreamDestroy(s);
  }

  void ZeroGrads() {
    grads_.ForEach([&](DeviceArray<float>& t) {
      CTXPLAN_CUDA_CHECK(cudaMemsetAsync(t.get(), 0, t.bytes(), compute_));
    });
    CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(compute_));
  }

  ModelWeights DownloadWeights() {
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    ModelWeights out = ZeroWeights(m_);
    std::vector<std::vector<float>*> host = HostTensors(out);
    size_t i = 0;
    weights_.ForEach([&](DeviceArray<bf16>& t) {
      std::vector<bf16> staging(t.size());
      CTXPLAN_CUDA_CHECK(cudaMemcpy(staging.data(), t.get(), t.bytes(), cudaMemcpyDeviceToHost));
      for (size_t j = 0; j < staging.size(); ++j) (*host[i])[j] = __bfloat162float(staging[j]);
      ++i;
    });
    return out;
  }

  ModelWeights DownloadGrads() {
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    ModelWeights out = ZeroWeights(m_);
    std::vector<std::vector<float>*> host = HostTensors(out);
    size_t i = 0;
    grads_.ForEach([&](DeviceArray<float>& t) {
      CTXPLAN_CUDA_CHECK(cudaMemcpy(host[i]->data(), t.get(), t.bytes(), cudaMemcpyDeviceToHost));
      ++i;
    });
    return out;
  }

  void BeginStep(const StepPlan& plan, const StepInputs& inputs) {
    if (plan.options().context_tokens != o_.context_tokens ||
        plan.options().chunk_tokens != o_.chunk_tokens)
      throw InternalError("CudaBackend: a step of another plan than the one it was built for");
    labelled_total_ =
        std::count_if(inputs.labels.begin(), inputs.labels.end(), [](int32_t l) { return l >= 0; });
    labelled_ = labelled_total_;
    CTXPLAN_CUDA_CHECK(
        cudaMemcpy(tokens_.get(), inputs.tokens.data(), tokens_.bytes(), cudaMemcpyHostToDevice));
    CTXPLAN_CUDA_CHECK(
        cudaMemcpy(labels_.get(), inputs.labels.data(), labels_.bytes(), cudaMemcpyHostToDevice));
    CTXPLAN_CUDA_CHECK(cudaMemset(loss_.get(), 0, loss_.bytes()));
    if (!o_.offload)
      for (auto& a : device_dkv_) CTXPLAN_CUDA_CHECK(cudaMemset(a.get(), 0, a.bytes()));
    dkv_present_.assign(static_cast<size_t>(layers_),
                        std::vector<char>(static_cast<size_t>(total_pages_), 0));
    std::fill(event_op_.begin(), event_op_.end(), kNoOp);
    memory_ = {};
    ops_ = 0;
    chunk_index_ = -1;
    slot_uses_ = own_uses_ = 0;
    layer_key_ = {-1, -1, -1};
    table_user_[0] = table_user_[1] = kNoOp;
  }

  StepOutputs EndStep() {
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
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
    return out;
  }

  void Execute(const Op& op) {
    if (IsMemory(op.kind)) {
      memory_.Apply(op);
      return;
    }
    ++ops_;
    if (op.chunk >= 0 && op.chunk != chunk_index_) StartChunk(op.chunk);
    NoteLayer(op);
    const cudaStream_t stream = StreamOf(op.stream);
    for (int i = 0; i < op.num_deps; ++i) Wait(stream, op.deps[i]);
    Run(op);
    CTXPLAN_CUDA_CHECK(cudaEventRecord(events_[op.id % kEventRing], stream));
    event_op_[op.id % kEventRing] = op.id;
  }

 private:
  static constexpr size_t kEventRing = 2 * StepPlan::kMaxDependencyDistance + 1024;

  cudaStream_t StreamOf(Stream s) const {
    switch (s) {
      case Stream::kH2D:
        return h2d_;
      case Stream::kD2H:
        return d2h_;
      default:
        return compute_;
    }
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
  size_t S(const Op& op) const {
    return static_cast<size_t>(o_.keep_layer_inputs ? op.chunk * layers_ + op.layer : op.layer);
  }
  bool Saves(const Op& op) const {
    return op.phase == Phase::kRecompute || (op.phase == Phase::kFill && o_.keep_layer_inputs);
  }
  DeviceLayer<bf16>& W(const Op& op) { return weights_.layers[static_cast<size_t>(op.layer)]; }
  DeviceLayer<float>& G(const Op& op) { return grads_.layers[static_cast<size_t>(op.layer)]; }
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

  void Upload(const ModelWeights& w) {
    // ForEach only reads here.
    std::vector<std::vector<float>*> host = HostTensors(const_cast<ModelWeights&>(w));
    size_t i = 0;
    weights_.ForEach([&](DeviceArray<bf16>& t) {
      std::vector<bf16> staging(host[i]->size());
      for (size_t j = 0; j < staging.size(); ++j) staging[j] = __float2bfloat16((*host[i])[j]);
      CTXPLAN_CUDA_CHECK(cudaMemcpy(t.get(), staging.data(), t.bytes(), cudaMemcpyHostToDevice));
      ++i;
    });
  }

  void Run(const Op& op) {
    switch (op.kind) {
      case OpKind::kEmbeddingForward:
        k::EmbeddingForward(tokens_.get() + c_.start, weights_.embedding.get(), T(), vocab_, d_,
                            h_.get(), compute_);
        has_pending_ = false;
        break;
      case OpKind::kEmbeddingBackward:
        k::EmbeddingBackward(tokens_.get() + c_.start, dh_.get(), T(), vocab_, d_,
                             grads_.embedding.get(), compute_);
        break;
      case OpKind::kRmsNormForward:
        NormForward(op);
        break;
      case OpKind::kRmsNormBackward:
        NormBackward(op);
        break;
      case OpKind::kLinearForward:
        LinearForward(op);
        break;
      case OpKind::kLinearBackwardInput:
        LinearBackward(op, true);
        break;
      case OpKind::kLinearBackwardWeight:
        LinearBackward(op, false);
        break;
      case OpKind::kRopeForward:
        k::RopeForward(q_.get(), T(), m_.num_attention_heads, m_.head_dim, q_dim_, c_.start,
                       m_.rope_theta, compute_);
        k::RopeForward(k_.get(), T(), m_.num_key_value_heads, m_.head_dim, kv_dim_, c_.start,
                       m_.rope_theta, compute_);
        break;
      case OpKind::kRopeBackward:
        k::RopeBackward(dq_.get(), T(), m_.num_attention_heads, m_.head_dim, q_dim_, c_.start,
                        m_.rope_theta, compute_);
        k::RopeBackward(dk_.get(), T(), m_.num_key_value_heads, m_.head_dim, kv_dim_, c_.start,
                        m_.rope_theta, compute_);
        break;
      case OpKind::kKvWrite: {
        PagedKv<bf16> own = OwnKv(op.layer);
        k::KvWrite(k_.get(), v_.get(), kv_dim_, T(), own, compute_);
        break;
      }
      case OpKind::kPageSummary: {
        PagedKv<bf16> own = OwnKv(op.layer);
        k::PageSummary(PagedKv<const bf16>{own.shape, own.pool, own.page_slot, own.num_pages},
                       summaries_[static_cast<size_t>(op.layer)].get() + c_.earlier_pages * kv_dim_,
                       compute_);
        break;
      }
      case OpKind::kPageScore:
        k::PageScore(q_.get(), T(), m_.num_attention_heads, m_.num_key_value_heads, m_.head_dim,
                     o_.query_tile, summaries_[static_cast<size_t>(op.layer)].get(),
                     c_.earlier_pages, scores_.get(), score_ws_.get(), score_ws_.bytes(), compute_);
        break;
      case OpKind::kPageTopK:
        TopK(op);
        break;
      case OpKind::kAttentionForward:
        AttentionForward(op);
        break;
      case OpKind::kAttentionBackward:
        AttentionBackward(op);
        break;
      case OpKind::kDkvAccumulate: {
        PagedKv<float> own = OwnDkv(op.layer);
        k::DkvAccumulate(PagedKv<const float>{own.shape, own.pool, own.page_slot, own.num_pages},
                         T(), dk_.get(), dv_.get(), kv_dim_, compute_);
        break;
      }
      case OpKind::kSwigluForward:
        k::SwigluForward(gate_up_.get(), T(), inter_, act_.get(), compute_);
        break;
      case OpKind::kSwigluBackward:
        k::SwigluBackward(gate_up_.get(), d_act_.get(), T(), inter_, d_gate_up_.get(), compute_);
        break;
      case OpKind::kLossForwardBackward: {
        const bool tied = weights_.lm_head.size() == 0;
        const float scale = labelled_total_ > 0 ? 1.0f / static_cast<float>(labelled_total_) : 0.0f;
        k::LinearCrossEntropy(gemm_, LossShape(T()), xnf_.get(),
                              tied ? weights_.embedding.get() : weights_.lm_head.get(),
                              labels_.get() + c_.start, scale, d_xnf_.get(),
                              tied ? grads_.embedding.get() : grads_.lm_head.get(),
                              loss_.get() + c_.index, loss_ws_.get(), compute_);
        break;
      }
      case OpKind::kZeroFill:
        break;  // fresh dKV slots are zeroed when the backward's copy stages the union
      case OpKind::kAdamW:
        Optimizer();
        break;
      case OpKind::kCopyH2D:
        CopyIn(op);
        break;
      case OpKind::kCopyD2H:
        CopyOut(op);
        break;
      default:
        throw InternalError("CUDA backend: unexpected op " + std::string(OpKindName(op.kind)));
    }
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
        k::RmsNormBackward(hf_.get(), weights_.final_norm.get(), rstdf_.get(), d_xnf_.get(),
                           nullptr, T(), d_, dh_.get(), grads_.final_norm.get(),
                           norm_scratch_.get(), compute_);
        break;
      case OpPart::kMlpNorm:
        k::RmsNormBackward(hmid_ptr_, W(op).mlp_norm.get(), rstd2_.get(), d_xn2_.get(), dh_.get(),
                           T(), d_, d_hmid_.get(), G(op).mlp_norm.get(), norm_scratch_.get(),
                           compute_);
        break;
      case OpPart::kAttnNorm:
        k::RmsNormBackward(x_, W(op).attn_norm.get(), rstd1_.get(), d_xn_.get(), d_hmid_.get(), T(),
                           d_, dh_.get(), G(op).attn_norm.get(), norm_scratch_.get(), compute_);
        break;
      default:
        throw InternalError("CUDA backend: RMSNorm backward without a part");
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
        Copy2D(q_.get(), q_dim_, qkv_.get(), qkv_dim_, q_dim_, compute_);
        Copy2D(k_.get(), kv_dim_, qkv_.get() + q_dim_, qkv_dim_, kv_dim_, compute_);
        Copy2D(v_.get(), kv_dim_, qkv_.get() + q_dim_ + kv_dim_, qkv_dim_, kv_dim_, compute_);
        break;
      case OpPart::kO:
        k::LinearForward(gemm_, op.phase == Phase::kBackward ? saved_attn_[S(op)].get() : attn_ptr_,
                         w.o.get(), nullptr, t, d_, q_dim_, o_out_.get(), compute_);
        break;
      case OpPart::kGateUp:
        k::LinearForward(gemm_, xn2_.get(), w.gate_up.get(), nullptr, t, 2 * inter_, d_,
                         gate_up_.get(), compute_);
        break;
      case OpPart::kDown:
        k::LinearForward(gemm_, act_.get(), w.down.get(), nullptr, t, d_, inter_, pending_.get(),
                         compute_);
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

  void LinearBackward(const Op& op, bool input) {
    DeviceLayer<bf16>& w = W(op);
    DeviceLayer<float>& g = G(op);
    const int64_t t = T();
    switch (op.part) {
      case OpPart::kDown:
        if (input)
          k::LinearBackwardInput(gemm_, dh_.get(), w.down.get(), t, d_, inter_, d_act_.get(),
                                 compute_);
        else
          k::LinearBackwardWeight(gemm_, act_.get(), dh_.get(), t, d_, inter_, g.down.get(),
                                  static_cast<float*>(nullptr), compute_);
        break;
      case OpPart::kGateUp:
        if (input)
          k::LinearBackwardInput(gemm_, d_gate_up_.get(), w.gate_up.get(), t, 2 * inter_, d_,
                                 d_xn2_.get(), compute_);
        else
          k::LinearBackwardWeight(gemm_, xn2_.get(), d_gate_up_.get(), t, 2 * inter_, d_,
                                  g.gate_up.get(), static_cast<float*>(nullptr), compute_);
        break;
      case OpPart::kO:
        if (input)
          k::LinearBackwardInput(gemm_, d_hmid_.get(), w.o.get(), t, d_, q_dim_, d_attn_.get(),
                                 compute_);
        else
          k::LinearBackwardWeight(gemm_, saved_attn_[S(op)].get(), d_hmid_.get(), t, d_, q_dim_,
                                  g.o.get(), static_cast<float*>(nullptr), compute_);
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
              gemm_, xn_.get(), dqkv_.get(), t, qkv_dim_, d_, g.qkv.get(),
              g.qkv_bias.size() ? g.qkv_bias.get() : static_cast<float*>(nullptr), compute_);
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
    if (o_.offload) {
      p.pool = own_kv_slots_[own_parity_].get();
      p.page_slot = own_identity_.get();
    } else {
      p.pool = device_kv_[static_cast<size_t>(layer)].get() + c_.earlier_pages * pe_;
      p.page_slot = own_identity_.get();
    }
    return p;
  }

  PagedKv<float> OwnDkv(int32_t layer) {
    PagedKv<float> p;
    p.shape = shape_;
    p.num_pages = c_.own_pages;
    p.page_slot = own_identity_.get();
    p.pool = o_.offload ? own_dkv_slots_[parity_].get()
                        : device_dkv_[static_cast<size_t>(layer)].get() + c_.earlier_pages * pe_;
    return p;
  }

  template <typename T>
  PagedKv<T> Earlier(int32_t layer, bool dkv) {
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

  void TopK(const Op& op) {
    pages_per_tile_ = k::PageTopK(scores_.get(), c_.tiles, c_.earlier_pages, o_.page_budget,
                                  o_.sink_pages, selected_.get(), compute_);
    const size_t n = static_cast<size_t>(c_.tiles * pages_per_tile_);
    // The union's copies are issued from the host: read the selections back (a short sync).
    CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(selected_host_.get(), selected_.get(), n * sizeof(int32_t),
                                       cudaMemcpyDeviceToHost, compute_));
    CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(compute_));
    selection_host_.assign(selected_host_.get(), selected_host_.get() + n);
    if (Saves(op)) {
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(saved_selection_[S(op)].get(), selected_.get(),
                                         n * sizeof(int32_t), cudaMemcpyDeviceToDevice, compute_));
      saved_selection_host_[S(op)] = selection_host_;
    }
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

  std::vector<int32_t> UnionPages(const Op& op) const {
    return AttendedPages(
        c_, op.phase == Phase::kBackward ? saved_selection_host_[S(op)] : selection_host_);
  }

  k::AttentionShape Shape() const {
    return {T(), m_.num_attention_heads, m_.num_key_value_heads, m_.head_dim, scale_};
  }
  bool LastAttentionOp(const Op& op) const {
    return op.part == OpPart::kPaged || c_.earlier_pages == 0;
  }

  void AttentionForward(const Op& op) {
    if (!LastAttentionOp(op)) return;
    attn_ptr_ = Saves(op) ? saved_attn_[S(op)].get() : attn_.get();
    float* lse = Saves(op) ? saved_lse_[S(op)].get() : lse_.get();
    PagedKv<bf16> e = Earlier<bf16>(op.layer, false);
    k::AttentionForward(Shape(), q_.get(), k_.get(), v_.get(),
                        PagedKv<const bf16>{e.shape, e.pool, e.page_slot, e.num_pages},
                        Selection(op), attn_ptr_, lse, compute_);
  }

  void AttentionBackward(const Op& op) {
    if (!LastAttentionOp(op)) return;
    PagedKv<bf16> e = Earlier<bf16>(op.layer, false);
    PagedKv<float> de = Earlier<float>(op.layer, true);
    k::AttentionBackward(Shape(), q_.get(), k_.get(), v_.get(),
                         PagedKv<const bf16>{e.shape, e.pool, e.page_slot, e.num_pages},
                         Selection(op), saved_attn_[S(op)].get(), saved_lse_[S(op)].get(),
                         d_attn_.get(), dq_.get(), dk_.get(), dv_.get(), de, attention_ws_.get(),
                         attention_ws_.bytes(), compute_);
    if (!o_.offload)
      for (const int32_t page : UnionPages(op))
        dkv_present_[static_cast<size_t>(op.layer)][static_cast<size_t>(page)] = 1;
  }

  // Copies runs of consecutive pages at once.
  template <typename T>
  void CopyPages(T* dst_base, const std::vector<int64_t>& dst_index, const T* src_base,
                 const std::vector<int64_t>& src_index, cudaMemcpyKind kind, cudaStream_t stream) {
    const size_t page_bytes = static_cast<size_t>(pe_) * sizeof(T);
    size_t i = 0;
    while (i < dst_index.size()) {
      size_t run = 1;
      while (i + run < dst_index.size() &&
             dst_index[i + run] == dst_index[i] + static_cast<int64_t>(run) &&
             src_index[i + run] == src_index[i] + static_cast<int64_t>(run))
        ++run;
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(dst_base + dst_index[i] * pe_,
                                         src_base + src_index[i] * pe_, run * page_bytes, kind,
                                         stream));
      i += run;
    }
  }

  void CopyIn(const Op& op) {
    if (op.phase == Phase::kOptimizer) return;
    const size_t l = static_cast<size_t>(op.layer);
    union_ = UnionPages(op);
    if (static_cast<int64_t>(union_.size()) > slot_capacity_)
      throw InputError(
          "page selections of chunk " + std::to_string(c_.index) + " layer " + std::to_string(l) +
          " need " + std::to_string(union_.size()) + " page slots but the plan provisioned " +
          std::to_string(slot_capacity_) +
          "; accepted: a selection model that bounds the union (--selection disjoint)");
    // The host staging of this parity's table was last read by a copy two layers ago: it must
    // have finished before the host rewrites the table.
    const OpId previous = table_user_[parity_];
    if (previous != kNoOp && event_op_[previous % kEventRing] == previous)
      CTXPLAN_CUDA_CHECK(cudaEventSynchronize(events_[previous % kEventRing]));
    table_user_[parity_] = op.id;
    int32_t* table = slot_table_host_[parity_].get();
    std::fill(table, table + std::max<int64_t>(c_.earlier_pages, 0), -1);
    std::vector<int64_t> slots(union_.size()), pages(union_.size());
    for (size_t j = 0; j < union_.size(); ++j) {
      table[union_[j]] = static_cast<int32_t>(j);
      slots[j] = static_cast<int64_t>(j);
      pages[j] = union_[j];
    }
    if (c_.earlier_pages > 0)
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(slot_table_[parity_].get(), table,
                                         static_cast<size_t>(c_.earlier_pages) * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, h2d_));
    CopyPages(kv_slots_[parity_].get(), slots, host_kv_[l].get(), pages, cudaMemcpyHostToDevice,
              h2d_);
    if (op.phase != Phase::kBackward) return;
    // dKV: pages that hold some come in, the others start at zero; then the chunk's own dKV.
    const size_t page_bytes = static_cast<size_t>(pe_) * sizeof(float);
    std::vector<int64_t> in_slots, in_pages;
    for (size_t j = 0; j < union_.size(); ++j) {
      if (dkv_present_[l][static_cast<size_t>(union_[j])]) {
        in_slots.push_back(static_cast<int64_t>(j));
        in_pages.push_back(union_[j]);
      } else {
        CTXPLAN_CUDA_CHECK(
            cudaMemsetAsync(dkv_slots_[parity_].get() + j * pe_, 0, page_bytes, h2d_));
      }
    }
    CopyPages(dkv_slots_[parity_].get(), in_slots, host_dkv_[l].get(), in_pages,
              cudaMemcpyHostToDevice, h2d_);
    for (int64_t j = 0; j < c_.own_pages; ++j) {
      const int64_t page = c_.earlier_pages + j;
      float* slot = own_dkv_slots_[parity_].get() + j * pe_;
      if (dkv_present_[l][static_cast<size_t>(page)])
        CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(slot, host_dkv_[l].get() + page * pe_, page_bytes,
                                           cudaMemcpyHostToDevice, h2d_));
      else
        CTXPLAN_CUDA_CHECK(cudaMemsetAsync(slot, 0, page_bytes, h2d_));
    }
  }

  void CopyOut(const Op& op) {
    if (op.phase == Phase::kOptimizer) return;
    const size_t l = static_cast<size_t>(op.layer);
    if (op.phase == Phase::kFill) {  // the chunk's fresh KV pages go home
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(
          host_kv_[l].get() + c_.earlier_pages * pe_, own_kv_slots_[own_parity_].get(),
          static_cast<size_t>(c_.own_pages * pe_) * sizeof(bf16), cudaMemcpyDeviceToHost, d2h_));
      return;
    }
    std::vector<int64_t> slots(union_.size()), pages(union_.size());
    for (size_t j = 0; j < union_.size(); ++j) {
      slots[j] = static_cast<int64_t>(j);
      pages[j] = union_[j];
      dkv_present_[l][static_cast<size_t>(union_[j])] = 1;
    }
    CopyPages(host_dkv_[l].get(), pages, dkv_slots_[parity_].get(), slots, cudaMemcpyDeviceToHost,
              d2h_);
  }

  void Optimizer() {
    ++adam_step_;
    k::AdamWParams p;
    p.lr = adamw_.lr;
    p.beta1 = adamw_.beta1;
    p.beta2 = adamw_.beta2;
    p.eps = adamw_.eps;
    p.weight_decay = adamw_.weight_decay;
    p.step = adam_step_;
    std::vector<DeviceArray<bf16>*> w;
    std::vector<DeviceArray<float>*> g, m, v;
    weights_.ForEach([&](DeviceArray<bf16>& t) { w.push_back(&t); });
    grads_.ForEach([&](DeviceArray<float>& t) { g.push_back(&t); });
    adam_m_.ForEach([&](DeviceArray<float>& t) { m.push_back(&t); });
    adam_v_.ForEach([&](DeviceArray<float>& t) { v.push_back(&t); });
    for (size_t i = 0; i < w.size(); ++i)
      k::AdamW(w[i]->get(), g[i]->get(), m[i]->get(), v[i]->get(),
               static_cast<int64_t>(w[i]->size()), p, compute_);
  }

  // --- state -------------------------------------------------------------------------------
  const ModelSpec m_;
  const RunOptions o_;
  const PlanGeometry g_;
  CudaAdamW adamw_;
  int64_t adam_step_ = 0;
  int64_t d_ = 0, q_dim_ = 0, kv_dim_ = 0, qkv_dim_ = 0, inter_ = 0, vocab_ = 0, layers_ = 0;
  float scale_ = 1.0f;
  KvPageShape shape_;
  int64_t pe_ = 0, total_pages_ = 0, own_capacity_ = 0, slot_capacity_ = 0;

  cudaStream_t compute_ = nullptr, h2d_ = nullptr, d2h_ = nullptr;
  std::vector<cudaEvent_t> events_;
  std::vector<OpId> event_op_;  // which op each event last recorded
  k::CublasLtGemm gemm_;

  DeviceWeights<bf16> weights_;
  DeviceWeights<float> grads_, adam_m_, adam_v_;

  DeviceArray<int32_t> tokens_, labels_;
  DeviceArray<bf16> h_, h_alt_, pending_, xn_, qkv_, q_, k_, v_, attn_, o_out_, hmid_, xn2_,
      gate_up_, act_, xnf_, hf_;
  DeviceArray<bf16> dh_, d_act_, d_gate_up_, d_xn2_, d_hmid_, d_attn_, dq_, dk_, dv_, dqkv_, d_xn_,
      d_xnf_;
  DeviceArray<float> lse_, rstd1_, rstd2_, rstdf_, scores_, loss_;
  DeviceArray<std::byte> norm_scratch_, attention_ws_, score_ws_, loss_ws_;
  DeviceArray<int32_t> selected_;
  PinnedArray<int32_t> selected_host_;
  std::vector<int32_t> selection_host_;
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
  std::vector<PinnedArray<bf16>> host_kv_;  // offload on: [layer][pages][page elements]
  std::vector<PinnedArray<float>> host_dkv_;
  std::vector<DeviceArray<bf16>> device_kv_;  // offload off
  std::vector<DeviceArray<float>> device_dkv_;
  DeviceArray<bf16> kv_slots_[2], own_kv_slots_[2];
  DeviceArray<float> dkv_slots_[2], own_dkv_slots_[2];
  DeviceArray<int32_t> slot_table_[2];
  PinnedArray<int32_t> slot_table_host_[2];
  std::vector<int32_t> union_;
  std::vector<std::vector<char>> dkv_present_;
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
};

CudaBackend::CudaBackend(const StepPlan& plan, const ModelWeights& weights, CudaAdamW adamw)
    : impl_(std::make_unique<Impl>(plan, weights, adamw)) {}
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

}  // namespace ctxplan
