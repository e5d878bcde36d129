// The CPU backend: executes the step plan with the CPU reference kernels on fp32 host tensors.
// It is the whole chunk-recurrent algorithm, page store and offload copies included, small and
// slow, so CI can hold it against ordinary full-sequence backprop.
//
// "GPU" memory is emulated: with offload on, KV and dKV pages live in a host store and are staged
// into a bounded pool of slots by the plan's copies, exactly as the CUDA backend moves them; with
// offload off, they live in the "device" page store. Offload on and off must give bit-identical
// results.
#pragma once

#include <memory>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/runtime/plan/lora.h"
#include "ctxplan/runtime/plan/model_weights.h"
#include "ctxplan/runtime/plan/step_backend.h"

namespace ctxplan {

struct OptimizerState {
  ModelWeights m;  // first moments
  ModelWeights v;  // second moments
  kernels::cpu::AdamWParams params;
};

// A LoRA run's adapters, their gradients (the caller zeroes them per step) and AdamW moments.
struct LoraState {
  LoraWeights weights, grads, m, v;
};

class CpuBackend final : public StepBackend {
 public:
  // `weights` are trained in place; `grads` accumulate over the step (the caller zeroes them);
  // `optimizer` may be null when the plan has no optimizer step (its moments are unused with
  // LoRA, its step parameters used). With a LoRA plan, `lora` holds the adapters: the base
  // weights stay frozen (no gradient reaches `grads`) and the optimizer steps the adapters.
  CpuBackend(const ModelSpec& model, ModelWeights& weights, ModelWeights& grads,
             OptimizerState* optimizer, LoraState* lora = nullptr);
  ~CpuBackend() override;

  void BeginStep(const StepPlan& plan, const StepInputs& inputs) override;
  void Execute(const Op& op) override;
  StepOutputs EndStep() override;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ctxplan
