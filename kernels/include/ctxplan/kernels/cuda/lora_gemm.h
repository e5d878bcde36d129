// LoRA adapters' GEMMs for one projection (runtime/include/ctxplan/runtime/plan/lora.h), on
// cuBLASLt: the CUDA backend runs them after each fused linear, ctxplan-measure times them as it
// does. A projection writes columns [out_offset, out_offset + out) of its fused linear's output:
//   y[:, seg] += scale * (x A^T) B^T,   A [r][in], B [out][r] bf16
// The GEMMs are thin (one side is the rank, 8-64): each reads a [t][in] input or a [t][out]
// gradient and writes or adds into a [t][*] output, so HBM, not the tensor cores, bounds them
// (kernels/cost.h LoraAdapters). Plain C++ (g++ includes it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ctxplan/kernels/cuda/gemm.h"

namespace ctxplan::kernels::cuda {

struct LoraProjectionGemm {
  int64_t tokens = 0;  // t
  int64_t rank = 0;    // r
  int64_t in = 0, out = 0, out_offset = 0;
  float scale = 1.0f;                // alpha / r
  const __nv_bfloat16* a = nullptr;  // A [r][in]
  const __nv_bfloat16* b = nullptr;  // B [out][r]
};

// u [t][r] = x [t][in] A^T
void LoraDown(CublasLtGemm& gemm, const LoraProjectionGemm& p, const __nv_bfloat16* x,
              __nv_bfloat16* u, cudaStream_t stream);

// y [t][y_stride] columns seg += scale * (x A^T) B^T; u [t][r] is scratch (holds x A^T after).
void LoraForward(CublasLtGemm& gemm, const LoraProjectionGemm& p, const __nv_bfloat16* x,
                 __nv_bfloat16* u, __nv_bfloat16* y, int64_t y_stride, cudaStream_t stream);

// du [t][r] = scale * dy[:, seg] B, then dx [t][in] += du A.
void LoraBackwardInput(CublasLtGemm& gemm, const LoraProjectionGemm& p, const __nv_bfloat16* dy,
                       int64_t dy_stride, __nv_bfloat16* du, __nv_bfloat16* dx,
                       cudaStream_t stream);

// du [t][r] = scale * dy[:, seg] B; dA [r][in] += du^T x; u = x A^T; dB [out][r] += scale *
// dy[:, seg]^T u. grad_a, grad_b of `grad_type` (CUDA_R_32F or CUDA_R_16BF).
void LoraBackwardWeight(CublasLtGemm& gemm, const LoraProjectionGemm& p, const __nv_bfloat16* x,
                        const __nv_bfloat16* dy, int64_t dy_stride, __nv_bfloat16* u,
                        __nv_bfloat16* du, void* grad_a, void* grad_b, cudaDataType_t grad_type,
                        cudaStream_t stream);

}  // namespace ctxplan::kernels::cuda
