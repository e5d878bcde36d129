// The transformer layer's ops, one method per op kind (op_dispatch.h), on the compute stream:
// embedding, RMSNorm, the linear projections and their LoRA adapters, RoPE, SwiGLU and the loss.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "ctxplan/kernels/cuda/check.h"
#include "cuda_backend_impl.h"

namespace ctxplan::cuda_backend_detail {

template <typename G>
void TypedImpl<G>::EmbeddingForward(const Op&) {
  k::EmbeddingForward(tokens_.get() + c_.start, weights_.embedding.get(), T(), vocab_, d_, h_.get(),
                      compute_);
  has_pending_ = false;
}

template <typename G>
void TypedImpl<G>::EmbeddingBackward(const Op&) {
  if (!Lora())  // frozen under LoRA
    k::EmbeddingBackward(tokens_.get() + c_.start, dh_.get(), T(), vocab_, d_,
                         grads_.embedding.get(), compute_);
}

template <typename G>
void TypedImpl<G>::NormForward(const Op& op) {
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
        k::RmsNormResidualForward(h, pending, weights_.final_norm.get(), T(), d_, Eps(), hf_.get(),
                                  xnf_.get(), rstdf_.get(), compute_);
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

template <typename G>
void TypedImpl<G>::NormBackward(const Op& op) {
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
template <typename G>
void TypedImpl<G>::FinalNormBackward() {
  if (final_norm_backwards_ == 0)
    CTXPLAN_CUDA_CHECK(
        cudaMemsetAsync(final_norm_partials_.get(), 0, final_norm_partials_.bytes(), compute_));
  const int rows = k::RmsNormBackwardIntoPartials(hf_.get(), weights_.final_norm.get(),
                                                  rstdf_.get(), d_xnf_.get(), T(), d_, dh_.get(),
                                                  final_norm_partials_.get(), compute_);
  final_norm_rows_ = std::max(final_norm_rows_, rows);
  if (++final_norm_backwards_ == g_.num_chunks()) {
    k::RmsNormAddPartials(final_norm_partials_.get(), final_norm_rows_, d_, grads_.final_norm.get(),
                          compute_);
    final_norm_backwards_ = 0;
    final_norm_rows_ = 0;
  }
}

template <typename G>
void TypedImpl<G>::Copy2D(bf16* dst, int64_t dst_cols, const bf16* src, int64_t src_cols,
                          int64_t cols, cudaStream_t stream) {
  CTXPLAN_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<size_t>(dst_cols) * sizeof(bf16), src,
                                       static_cast<size_t>(src_cols) * sizeof(bf16),
                                       static_cast<size_t>(cols) * sizeof(bf16),
                                       static_cast<size_t>(T()), cudaMemcpyDeviceToDevice, stream));
}

template <typename G>
void TypedImpl<G>::LinearForward(const Op& op) {
  DeviceLayer<bf16>& w = W(op);
  const int64_t t = T();
  switch (op.part) {
    case OpPart::kQkv:
      k::LinearForward(gemm_, xn_.get(), w.qkv.get(),
                       w.qkv_bias.size() ? w.qkv_bias.get() : nullptr, t, qkv_dim_, d_, qkv_.get(),
                       compute_);
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
        CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(saved_top_pending_[static_cast<size_t>(c_.index)].get(),
                                           pending_.get(), bytes, cudaMemcpyDeviceToDevice,
                                           compute_));
      }
      break;
    default:
      throw InternalError("CUDA backend: linear without a part");
  }
}

// Under LoRA the base's weight gradients are skipped (frozen) and the adapters' backward follows
// the base's input gradient, or replaces its weight gradient.
template <typename G>
void TypedImpl<G>::LinearBackward(const Op& op, bool input) {
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

template <typename G>
void TypedImpl<G>::LinearBackwardBase(const Op& op, bool input) {
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

// y [t][y_stride] += scale * (x A^T) B^T on each projection's columns.
template <typename G>
void TypedImpl<G>::LoraForward(const Op& op, const bf16* x, bf16* y, int64_t y_stride) {
  if (!Lora()) return;
  for (DeviceLoraProjection<G>& p : LoraPart(static_cast<size_t>(op.layer), op.part))
    k::LoraForward(gemm_, LoraGemm(p), x, lora_u_.get(), y, y_stride, compute_);
}

// The input op: dx [t][in] += du A with du = scale * dy_seg B. The weight op: dA += du^T x and
// dB += scale * dy_seg^T (x A^T).
template <typename G>
void TypedImpl<G>::LoraBackward(const Op& op, bool input, const bf16* x, const bf16* dy,
                                int64_t dy_stride, bf16* dx) {
  constexpr cudaDataType_t kGradType = std::is_same_v<G, float> ? CUDA_R_32F : CUDA_R_16BF;
  for (DeviceLoraProjection<G>& p : LoraPart(static_cast<size_t>(op.layer), op.part)) {
    if (input)
      k::LoraBackwardInput(gemm_, LoraGemm(p), dy, dy_stride, lora_du_.get(), dx, compute_);
    else
      k::LoraBackwardWeight(gemm_, LoraGemm(p), x, dy, dy_stride, lora_u_.get(), lora_du_.get(),
                            p.grad_a.get(), p.grad_b.get(), kGradType, compute_);
  }
}

template <typename G>
void TypedImpl<G>::RopeForward(const Op&) {
  k::RopeForward(q_.get(), T(), m_.num_attention_heads, m_.head_dim, q_dim_, c_.start,
                 m_.rope_theta, compute_);
  k::RopeForward(k_.get(), T(), m_.num_key_value_heads, m_.head_dim, kv_dim_, c_.start,
                 m_.rope_theta, compute_);
}

template <typename G>
void TypedImpl<G>::RopeBackward(const Op&) {
  k::RopeBackward(dq_.get(), T(), m_.num_attention_heads, m_.head_dim, q_dim_, c_.start,
                  m_.rope_theta, compute_);
  k::RopeBackward(dk_.get(), T(), m_.num_key_value_heads, m_.head_dim, kv_dim_, c_.start,
                  m_.rope_theta, compute_);
}

template <typename G>
void TypedImpl<G>::SwigluForward(const Op&) {
  k::SwigluForward(gate_up_.get(), T(), inter_, act_.get(), compute_);
}

template <typename G>
void TypedImpl<G>::SwigluBackward(const Op&) {
  k::SwigluBackward(gate_up_.get(), d_act_.get(), T(), inter_, d_gate_up_.get(), compute_);
}

template <typename G>
void TypedImpl<G>::Loss(const Op&) {
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

template class TypedImpl<float>;
template class TypedImpl<bf16>;

}  // namespace ctxplan::cuda_backend_detail
