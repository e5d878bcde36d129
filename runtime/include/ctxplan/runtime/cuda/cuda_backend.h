// The CUDA backend: executes the step plan on the GPU with the kernels of kernels/ (bf16
// storage, fp32 accumulation, cuBLASLt GEMMs) on three streams — compute, H2D and D2H — whose
// cross-stream waits are exactly the plan's dependencies (one CUDA event per op, in a ring that
// covers the plan's dependency window).
//
// Version 1 scope: full fine-tune, fp32 parameter gradients and fp32 dKV, AdamW on the GPU or no
// optimizer, dense or page-sparse attention (the tiles' selections are read back to the host to
// issue the union's copies), offload on or off, layer inputs recomputed or kept. Buffers are
// allocated once, when the backend is built; pinned host pages with offload on.
#pragma once

#include <memory>

#include "ctxplan/runtime/model_weights.h"
#include "ctxplan/runtime/step_backend.h"

namespace ctxplan {

struct CudaAdamW {
  float lr = 1e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.0f;
};

class CudaBackend final : public StepBackend {
 public:
  // Sized for `plan` (its model and options); `weights` are uploaded in bf16.
  CudaBackend(const StepPlan& plan, const ModelWeights& weights, CudaAdamW adamw = {});
  ~CudaBackend() override;

  void BeginStep(const StepPlan& plan, const StepInputs& inputs) override;
  void Execute(const Op& op) override;
  StepOutputs EndStep() override;

  void ZeroGrads();
  ModelWeights DownloadWeights() const;  // bf16 on the GPU, widened to fp32
  ModelWeights DownloadGrads() const;    // fp32

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ctxplan
