// A step on the GPU: each op of the plan issued on its stream once the ops it depends on are (one
// CUDA event per op, in a ring that covers the plan's dependency window), the host's own waits
// inside a step, and the pipeline stage boundaries, whose tensors cross to the neighbouring stages
// on the peer streams.
#include <cuda_runtime_api.h>
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/cuda/probe_kernel.h"
#include "cuda_backend_impl.h"

namespace ctxplan::cuda_backend_detail {

template <typename G>
void TypedImpl<G>::BeginStep(const StepPlan& plan, const StepInputs& inputs) {
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
  tied_embedding_summed_ = false;
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

template <typename G>
StepOutputs TypedImpl<G>::EndStep() {
  CTXPLAN_CHECK(final_norm_backwards_ == 0,
                "CUDA backend: the step ended with the final norm's d_weight partials unsummed");
  SumTiedEmbeddingGrads();  // without an optimizer: the step's gradients are its output
  if (peers_ != nullptr) {  // a failed peer throws rather than hangs
    std::vector<void*> streams{compute_, h2d_, d2h_};
    for (Stream s : {Stream::kSendNext, Stream::kRecvPrev, Stream::kSendPrev, Stream::kRecvNext})
      if (void* peer = peers_->stream(s)) streams.push_back(peer);
    peers_->Synchronize(streams);
  } else
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
  arena_->SampleDeviceUsed();
  std::vector<float> losses(loss_.size());
  CTXPLAN_CUDA_CHECK(cudaMemcpy(losses.data(), loss_.get(), loss_.bytes(), cudaMemcpyDeviceToHost));
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

template <typename G>
void TypedImpl<G>::Execute(const Op& op) {
  if (op.rank != rank_) return;  // another stage's, on its own GPU
  if (IsMemory(op.kind)) {
    memory_.Apply(op);
    return;
  }
  ++ops_;
  if (op.phase == Phase::kOptimizer) SumTiedEmbeddingGrads();  // before the first update op
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

// Tied LM head over two GPUs: the embedding's gradient from the first stage's embedding
// backward plus the head's from the last stage's loss, on both, once a step after the last
// backward op (the compute stream's), so both stages update equal copies identically.
template <typename G>
void TypedImpl<G>::SumTiedEmbeddingGrads() {
  if (!sums_tied_embedding_ || tied_embedding_summed_) return;
  tied_embedding_summed_ = true;
  peers_->AllReduceSum(grads_.embedding.get(), grads_.embedding.size(), std::is_same_v<G, float>,
                       compute_);
}

template <typename G>
void TypedImpl<G>::Run(const Op& op) {
  DispatchComputeOp(*this, op);
}

// The injected faults that strike mid-step (injected_fault.h).
template <typename G>
void TypedImpl<G>::InjectAfterAttentionBackward(cudaStream_t stream) {
  if (fault_ == gpu::InjectedFault::kCudaError)
    gpu::LaunchProbeKernel(reinterpret_cast<float*>(uintptr_t{256}), 1, 1.0f, 0.0f, stream);
  if (fault_ == gpu::InjectedFault::kKill) {
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());  // the step well under way on the GPU
    ::raise(SIGKILL);
  }
}

template <typename G>
cudaStream_t TypedImpl<G>::StreamOf(Stream s) const {
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
template <typename G>
void TypedImpl<G>::HostWait(cudaEvent_t event) {
  if (peers_ != nullptr)
    peers_->WaitEvent(event);
  else
    CTXPLAN_CUDA_CHECK(cudaEventSynchronize(event));
}

template <typename G>
void TypedImpl<G>::HostWait(cudaStream_t stream) {
  if (peers_ != nullptr) {
    void* const streams[] = {stream};
    peers_->Synchronize(streams);
  } else {
    CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
}

template <typename G>
void TypedImpl<G>::WaitOnHost(OpId dep) {
  if (dep == kNoOp) return;
  const size_t slot = dep % kEventRing;
  if (event_op_[slot] == dep) HostWait(events_[slot]);
}

template <typename G>
void TypedImpl<G>::Wait(cudaStream_t stream, OpId dep) {
  if (dep == kNoOp) return;
  const size_t slot = dep % kEventRing;
  if (event_op_[slot] != dep) return;  // a memory op (no GPU work) or long finished
  CTXPLAN_CUDA_CHECK(cudaStreamWaitEvent(stream, events_[slot], 0));
}

// Slot buffers alternate per layer exactly as the plan's do: every layer of every pass is one
// use, the fill's page-writing layers one use of the own-page buffers.
template <typename G>
void TypedImpl<G>::NoteLayer(const Op& op) {
  if (op.layer < 0) return;
  const std::array<int32_t, 3> key{static_cast<int32_t>(op.phase), op.chunk, op.layer};
  if (key == layer_key_) return;
  layer_key_ = key;
  parity_ = static_cast<int>(slot_uses_++ & 1);
  if (op.phase == Phase::kFill && g_.writes_pages(op.chunk))
    own_parity_ = static_cast<int>(own_uses_++ & 1);
}

template <typename G>
void TypedImpl<G>::StartChunk(int32_t index) {
  chunk_index_ = index;
  c_ = g_.Chunk(index);
  has_pending_ = false;
}

// --- pipeline stage boundaries (the plan double-buffers them: op.pages is the buffer) -----
// Forward: the residual stream and its pending add, so that the next stage finishes the add
// exactly as one GPU would; backward: the residual gradient.
template <typename G>
void TypedImpl<G>::BoundaryPack(const Op& op) {
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

template <typename G>
void TypedImpl<G>::BoundaryUnpack(const Op& op) {
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

template <typename G>
void TypedImpl<G>::PeerSend(const Op& op) {
  const auto p = static_cast<size_t>(op.pages);
  const bool forward = op.stream == Stream::kSendNext;
  peers_->Send(op.stream,
               forward ? static_cast<const void*>(forward_send_[p].get())
                       : static_cast<const void*>(backward_send_[p].get()),
               static_cast<size_t>(op.bytes));
}

template <typename G>
void TypedImpl<G>::PeerRecv(const Op& op) {
  const auto p = static_cast<size_t>(op.pages);
  const bool forward = op.stream == Stream::kRecvPrev;
  peers_->Recv(op.stream,
               forward ? static_cast<void*>(forward_recv_[p].get())
                       : static_cast<void*>(backward_recv_[p].get()),
               static_cast<size_t>(op.bytes));
}

// Drops the tensors other stages hold (a no-op with one GPU), so `w` has this stage's shape.
template <typename G>
void TypedImpl<G>::SliceToStage(ModelWeights& w) const {
  // (A tied LM head: the last stage keeps its own copy of the embedding; summed gradients keep
  // the two copies equal.)
  if (g_.stages() > 1) KeepStageTensors(w, m_, rank_, g_.stages());
}

template class TypedImpl<float>;
template class TypedImpl<bf16>;

}  // namespace ctxplan::cuda_backend_detail
