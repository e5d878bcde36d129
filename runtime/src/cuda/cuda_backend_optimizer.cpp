// The optimizer and the state a checkpoint carries: AdamW on the GPU (the full model or the LoRA
// adapters) or on the host's threads, zeroing the gradients, and the weights, gradients, moments
// and adapters downloaded (widened to fp32) or uploaded between runs.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/bf16.h"
#include "ctxplan/runtime/cpu/host_adamw.h"
#include "cuda_backend_impl.h"

namespace ctxplan::cuda_backend_detail {

namespace {

// The host's bf16 conversion (bf16.h) from CUDA's bf16 type; uploads round in weights_upload.h.
inline float ToFloat(float x) {
  return x;
}
inline float ToFloat(bf16 x) {
  return Bf16ToFp32(static_cast<__nv_bfloat16_raw>(x).x);
}

}  // namespace

template <typename G>
void TypedImpl<G>::OptimizerStep(const Op&) {
  if (o_.optimizer == OptimizerKind::kAdamWHost)
    HostOptimizer();
  else
    Optimizer();
}

template <typename G>
void TypedImpl<G>::Optimizer() {
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

template <typename G>
void TypedImpl<G>::OptimizerLora() {
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

// The next AdamW step's parameters (bias corrections count the steps taken).
template <typename G>
k::AdamWParams TypedImpl<G>::NextAdamWStep() {
  k::AdamWParams p;
  p.lr = adamw_.lr;
  p.beta1 = adamw_.beta1;
  p.beta2 = adamw_.beta2;
  p.eps = adamw_.eps;
  p.weight_decay = adamw_.weight_decay;
  p.step = ++adam_step_;
  return p;
}

// AdamW on the CPU over the staged gradients (host_adamw.h), on the host copy of the weights.
template <typename G>
void TypedImpl<G>::HostOptimizer() {
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
  const HostAdamWParams p{next.lr, next.beta1, next.beta2, next.eps, next.weight_decay, next.step};
  using GradBits = std::conditional_t<std::is_same_v<G, float>, float, uint16_t>;
  HostAdamWStep<GradBits>(p, tensors, reinterpret_cast<uint16_t*>(host_weights_.get()),
                          reinterpret_cast<const GradBits*>(host_grads_.get()), host_m_.data(),
                          host_v_.data(),
                          std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
}

template <typename G>
void TypedImpl<G>::ZeroGrads() {
  ClearRegion(MemCategory::kGrads);
  CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(compute_));
}

template <typename G>
ModelWeights TypedImpl<G>::DownloadWeights() {
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

template <typename G>
ModelWeights TypedImpl<G>::DownloadGrads() {
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
template <typename G>
CudaOptimizerState TypedImpl<G>::DownloadOptimizer() {
  CudaOptimizerState state;
  if (o_.optimizer == OptimizerKind::kNone) return state;
  CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
  state.steps_taken = adam_step_;
  if (o_.optimizer == OptimizerKind::kAdamWHost) {
    state.m = ZeroWeights(m_);
    state.v = ZeroWeights(m_);
    SliceToStage(state.m);
    SliceToStage(state.v);
    CopyHostMoments(state.m, state.v, /*to_host_optimizer=*/false);
    return state;
  }
  if (Lora()) {
    state.lora_m = ZeroLora(m_, o_.lora_rank);
    state.lora_v = ZeroLora(m_, o_.lora_rank);
    CopyLoraMoments(state.lora_m, state.lora_v, cudaMemcpyDeviceToHost);
    return state;
  }
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

// The LoRA moments of this stage's layers between the GPU and `m`, `v` (shaped by ZeroLora).
template <typename G>
void TypedImpl<G>::CopyLoraMoments(LoraWeights& m, LoraWeights& v, cudaMemcpyKind kind) {
  for (size_t l = 0; l < lora_.size(); ++l)
    for (OpPart part : kLoraParts) {
      std::vector<DeviceLoraProjection<G>>& dev = LoraPart(l, part);  // empty: another stage's
      std::vector<LoraProjection>& hm = m.layers.at(l).Part(part);
      std::vector<LoraProjection>& hv = v.layers.at(l).Part(part);
      for (size_t n = 0; n < dev.size(); ++n) {
        DeviceLoraProjection<G>& d = dev[n];
        const std::pair<DeviceArray<float>*, std::vector<float>*> pairs[] = {{&d.m_a, &hm.at(n).a},
                                                                             {&d.v_a, &hv.at(n).a},
                                                                             {&d.m_b, &hm.at(n).b},
                                                                             {&d.v_b, &hv.at(n).b}};
        for (auto [device, host] : pairs) {
          if (host->size() != device->size())
            throw InputError("LoRA optimizer state not shaped as rank-" +
                             std::to_string(o_.lora_rank) + " adapters of model " + m_.name +
                             "; accepted: a checkpoint of this model and LoRA rank");
          if (kind == cudaMemcpyDeviceToHost)
            CTXPLAN_CUDA_CHECK(
                cudaMemcpy(host->data(), device->get(), device->bytes(), cudaMemcpyDeviceToHost));
          else
            CTXPLAN_CUDA_CHECK(
                cudaMemcpy(device->get(), host->data(), device->bytes(), cudaMemcpyHostToDevice));
        }
      }
    }
}

// The host AdamW's moments (flat, in the weights' order) and `m`, `v` (a stage's tensors).
template <typename G>
void TypedImpl<G>::CopyHostMoments(ModelWeights& m, ModelWeights& v, bool to_host_optimizer) {
  std::vector<std::vector<float>*> tm = HostTensors(m), tv = HostTensors(v);
  size_t i = 0, offset = 0;
  weights_.ForEach([&](DeviceArray<bf16>& t) {
    if (i >= tm.size() || tm[i]->size() != t.size() || tv[i]->size() != t.size())
      throw InputError("optimizer state not shaped as model " + m_.name +
                       " (its moments); accepted: a checkpoint of this model");
    for (auto [flat, tensor] : {std::pair{&host_m_, tm[i]}, std::pair{&host_v_, tv[i]}}) {
      float* at = flat->data() + offset;
      if (to_host_optimizer)
        std::copy(tensor->begin(), tensor->end(), at);
      else
        std::copy(at, at + t.size(), tensor->begin());
    }
    offset += t.size();
    ++i;
  });
  CTXPLAN_CHECK(offset == host_m_.size(), "CUDA backend: the host moments' size");
}

template <typename G>
void TypedImpl<G>::UploadOptimizer(CudaOptimizerState state) {
  if (o_.optimizer == OptimizerKind::kNone)
    throw InternalError("CUDA backend: optimizer state for a run without an optimizer");
  // The constructor cleared the moments with a memset on compute_, a non-blocking stream that
  // the synchronous copies below do not wait for: unsynchronised, the memset could land after
  // them and zero the resumed moments.
  CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
  UploadOptimizerState(std::move(state));
  // A pageable copy can return before its DMA lands; the next step's kernels must see it.
  CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
}

template <typename G>
void TypedImpl<G>::UploadOptimizerState(CudaOptimizerState state) {
  if (Lora()) {
    if (state.lora_m.rank != o_.lora_rank || state.lora_v.rank != o_.lora_rank)
      throw InputError("LoRA optimizer state of rank " + std::to_string(state.lora_m.rank) +
                       " for a rank-" + std::to_string(o_.lora_rank) +
                       " run; accepted: a checkpoint of this LoRA rank");
    CopyLoraMoments(state.lora_m, state.lora_v, cudaMemcpyHostToDevice);
    adam_step_ = state.steps_taken;
    return;
  }
  // A stage's tensors, or the whole model's cut to them.
  SliceToStage(state.m);
  SliceToStage(state.v);
  if (o_.optimizer == OptimizerKind::kAdamWHost) {
    CopyHostMoments(state.m, state.v, /*to_host_optimizer=*/true);
    adam_step_ = state.steps_taken;
    return;
  }
  for (auto [device, host] : {std::pair{&adam_m_, &state.m}, std::pair{&adam_v_, &state.v}}) {
    std::vector<std::vector<float>*> tensors = HostTensors(*host);
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

template <typename G>
LoraWeights TypedImpl<G>::DownloadLora(bool grads) {
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
      std::vector<DeviceLoraProjection<G>>& dev = LoraPart(l, part);  // empty: another stage's
      for (size_t n = 0; n < dev.size(); ++n) {
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

template class TypedImpl<float>;
template class TypedImpl<bf16>;

}  // namespace ctxplan::cuda_backend_detail
