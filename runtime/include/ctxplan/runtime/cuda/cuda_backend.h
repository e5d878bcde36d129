// The CUDA backend: executes the step plan on the GPU with the kernels of kernels/ (bf16
// storage, fp32 accumulation, cuBLASLt GEMMs) on three streams — compute, H2D and D2H — whose
// cross-stream waits are exactly the plan's dependencies (one CUDA event per op, in a ring that
// covers the plan's dependency window).
//
// Several GPUs: one backend a process and GPU runs one pipeline stage (StagePeers): its layers'
// weights, gradients, optimizer state and pages; the stage boundaries' tensors cross on NCCL in
// double-buffered send and receive buffers. Full fine-tune of untied models only, for now.
//
// Scope: full fine-tune or LoRA (lora.h: adapters on every projection, the base frozen); parameter
// gradients and dKV in the run's grad dtype (bf16 or fp32); AdamW on the GPU, on the host
// (gradients staged home, the update on the CPU's threads, the weights back), or none; dense or
// page-sparse attention (the tiles' selections are read back to the host to issue the union's
// copies); offload on or off; layer inputs recomputed or kept. Memory: every device buffer is
// carved out of one DeviceArena reserved when the backend is built (nothing is allocated inside a
// step); with offload, KV and dKV pages live in pinned PinnedPageStores pinned up front, dKV pages
// handed out on their first write of a step.
//
// Fault injection for tests (environment CTXPLAN_INJECT_FAULT): "pinned-alloc" makes the pinning
// ask for a PiB, so the real cudaHostAlloc failure path runs; "cuda-error" launches a kernel that
// writes to an invalid address after the first attention backward, a real sticky CUDA error.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <span>

#include "ctxplan/runtime/plan/lora.h"
#include "ctxplan/runtime/plan/model_weights.h"
#include "ctxplan/runtime/plan/step_backend.h"

namespace ctxplan {

struct CudaAdamW {
  float lr = 1e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.0f;
};

// AdamW on the GPU between runs: its fp32 moments, shaped as the weights (a stage's tensors with
// several GPUs, the others empty), and the steps it has taken (its bias correction's count).
struct CudaOptimizerState {
  ModelWeights m, v;           // full fine-tune: the base's moments (a stage's tensors)
  LoraWeights lora_m, lora_v;  // LoRA: the adapters' moments (a stage's layers; others zero)
  int64_t steps_taken = 0;
};

// Measured memory, next to what the plan's own ops account (StepOutputs).
struct CudaMemoryReport {
  int64_t arena_reserved_bytes = 0;        // the arena's one cudaMalloc
  int64_t arena_allocated_peak_bytes = 0;  // carved out of it at the peak
  int64_t device_used_peak_bytes = 0;      // cudaMemGetInfo total - free, sampled: nvidia-smi's
  // Host memory the run holds: the page stores' pinned pages (offload on), the host optimizer's
  // pinned staging and its moments.
  int64_t host_bytes = 0;
  int64_t pinned_pages_peak_bytes = 0;  // of the page stores' pages, in use at the peak
};

// Where the constructor's time went, in seconds of the steady clock: ctxtrain reports its start-up
// by phase, and these phases happen in here. The rest of the constructor (streams, events, the
// arena's layout, zeroing, the final synchronisation) is total minus the three.
struct CudaStartupTimes {
  // Rounding the weights (and LoRA adapters) to bf16 and copying them up.
  double weights_upload_seconds = 0;
  // Reserving the arena: its one cudaMalloc.
  double arena_seconds = 0;
  // Pinning the page stores; with AdamW on the host also setting up its buffers (pinned staging,
  // its copy of the weights, its moments).
  double pinning_seconds = 0;
  // The whole constructor.
  double total_seconds = 0;
};

// A pipeline stage's links to its neighbouring stages (several GPUs, one process each;
// peer_links.h implements them on NCCL): which rank this backend runs, and transfers enqueued
// on the plan's four peer streams.
class StagePeers {
 public:
  virtual ~StagePeers() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // The cudaStream_t of a peer stream (kSendNext, kRecvPrev, kSendPrev, kRecvNext).
  virtual void* stream(Stream s) const = 0;
  virtual void Send(Stream s, const void* data, size_t bytes) = 0;
  virtual void Recv(Stream s, void* data, size_t bytes) = 0;
  // Waits until the work queued on `streams` (cudaStream_t) is done; throws TrainingError
  // instead of hanging when a peer fails.
  virtual void Synchronize(std::span<void* const> streams) = 0;
  // Waits until `event` (cudaEvent_t) has completed, bounded as Synchronize: the backend's host
  // waits inside a step may depend on a peer's transfer.
  virtual void WaitEvent(void* event) = 0;
  // Sums `count` elements (fp32, or bf16 when !fp32) of device buffer `data` over every rank, in
  // place, after the work queued on `after` (cudaStream_t); returns once done, bounded as
  // Synchronize. Collective: every rank calls it. (A tied embedding's two gradients.)
  virtual void AllReduceSum(void* data, size_t count, bool fp32, void* after) = 0;
  // Ends the transfers in flight for good (a run failing mid-step): their kernels would otherwise
  // wait for a peer that never comes, and every device synchronisation with them.
  virtual void Abort() noexcept = 0;
};

class CudaBackend final : public StepBackend {
 public:
  // Sized for `plan` (its model and options). `weights` are uploaded in bf16 and freed before the
  // host pages are pinned (pass them with std::move at large contexts: host RAM is the limit).
  // The arena's and page stores' sizes are printed on `log` (nullptr: not).
  // A LoRA plan needs `lora`, adapters of its rank (uploaded in bf16; the base is then frozen).
  // A plan over several GPUs (RunOptions::pipeline_stages) needs `peers`: the backend runs the
  // plan's ops of peers->rank() only, holding that stage's layers (the others' weights in
  // `weights` are dropped); DownloadWeights/Grads leave the others' tensors empty.
  CudaBackend(const StepPlan& plan, ModelWeights weights, CudaAdamW adamw = {},
              std::ostream* log = nullptr, const LoraWeights* lora = nullptr,
              StagePeers* peers = nullptr);
  ~CudaBackend() override;

  void BeginStep(const StepPlan& plan, const StepInputs& inputs) override;
  void Execute(const Op& op) override;
  StepOutputs EndStep() override;

  void ZeroGrads();
  ModelWeights DownloadWeights() const;  // bf16 on the GPU, widened to fp32
  ModelWeights DownloadGrads() const;    // widened to fp32
  // AdamW's state (on the GPU: the base's or the adapters' moments; on the host: the base's) for a
  // checkpoint, empty without an optimizer; and back from one, so a resumed run takes the very
  // updates a straight one would.
  CudaOptimizerState DownloadOptimizer() const;
  // By value: a stage cuts the moments to its tensors in place, not in a copy (the host AdamW's
  // of a 7B model are 61 GB).
  void UploadOptimizer(CudaOptimizerState state);
  CudaMemoryReport Memory() const;  // samples device-level memory now
  // LoRA runs: the adapters, widened to fp32, and their gradients; over several GPUs those of
  // this stage's layers (another stage's are left zero).
  LoraWeights DownloadLora() const;
  LoraWeights DownloadLoraGrads() const;
  CudaStartupTimes StartupTimes() const;  // measured while constructing

  class Impl;  // runtime/src/cuda/cuda_backend_impl.h

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ctxplan
