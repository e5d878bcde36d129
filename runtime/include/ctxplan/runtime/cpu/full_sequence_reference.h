// Ordinary full-sequence backprop of a Qwen2 / Llama model on the CPU: the correctness anchor of
// chunk-recurrent training (DESIGN.md, "The training method"). With dense attention and no
// sparsity, the chunk-recurrent executor must reproduce these loss and gradients up to
// floating-point rounding.
//
// Deliberately the plainest formulation: one forward over the whole sequence that keeps every
// activation, then the backward layer by layer from the top, built only from the CPU reference
// kernels (kernels/cpu/reference.h). No chunks, no pages, no recompute: nothing here shares a
// code path with the executor beyond the kernels themselves, so the two are independent checks of
// each other. Memory is O(n * L * (d + I)) floats: a reference for small models and sequences.
#pragma once

#include <cstdint>
#include <span>

#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/model_weights.h"

namespace ctxplan {

struct LossAndGrads {
  double loss_sum = 0.0;  // sum of cross-entropies (natural log) over labelled positions
  int64_t labelled = 0;   // positions with label >= 0
  ModelWeights grads;     // d(loss_sum * grad_scale) / d(parameter), shaped like the weights
};

// Ordinary backprop over the whole sequence at once: one forward keeping every activation,
// loss = sum of cross-entropies over positions with label >= 0 (labels[i] is the target for
// position i; -1 = ignored), gradients of (loss_sum * grad_scale) w.r.t. every parameter.
//
// The model: h = embed(tokens); per layer: x = rmsnorm(h); [q; k; v] = x Wqkv^T (+ b);
// q, k = rope(q, k) at positions 0..n-1; a = causal GQA attention, scale 1/sqrt(d_h);
// h += a Wo^T; y = rmsnorm(h); h += swiglu(y Wgu^T) Wdown^T; finally logits = rmsnorm(h) W_lm^T,
// W_lm = the embedding when tied (its gradient then gets both the LM-head and the lookup terms).
// tokens and labels have the same length n >= 0 (n = 0 gives zero loss and zero gradients);
// token ids must lie in [0, V) and labels below V (InputError otherwise; any negative label is
// ignored, as -100 is in Hugging Face); the weights must be shaped for `model` (ZeroWeights'
// shapes) and tokens and labels equally long (InternalError otherwise: the caller's bug).
LossAndGrads FullSequenceBackprop(const ModelSpec& model, const ModelWeights& weights,
                                  std::span<const int32_t> tokens, std::span<const int32_t> labels,
                                  float grad_scale);

// The forward alone: the same loss_sum as FullSequenceBackprop, bit for bit (the same kernels in
// the same order), keeping one layer's activations at a time and computing no gradients. For
// finite differences and evaluation.
double FullSequenceLoss(const ModelSpec& model, const ModelWeights& weights,
                        std::span<const int32_t> tokens, std::span<const int32_t> labels);

}  // namespace ctxplan
