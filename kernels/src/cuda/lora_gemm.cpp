#include "ctxplan/kernels/cuda/lora_gemm.h"

namespace ctxplan::kernels::cuda {

namespace {
// du [t][r] = scale * dy[:, seg] [t][out] B [out][r]
void LoraGradU(CublasLtGemm& gemm, const LoraProjectionGemm& p, const __nv_bfloat16* dy,
               int64_t dy_stride, __nv_bfloat16* du, cudaStream_t stream) {
  CublasLtGemm::Problem g;
  g.m = p.tokens;
  g.n = p.rank;
  g.k = p.out;
  g.a = dy + p.out_offset;
  g.lda = dy_stride;
  g.b = p.b;
  g.ldb = p.rank;
  g.d = du;
  g.ldd = p.rank;
  g.alpha = p.scale;
  gemm.Run(g, stream);
}
}  // namespace

void LoraDown(CublasLtGemm& gemm, const LoraProjectionGemm& p, const __nv_bfloat16* x,
              __nv_bfloat16* u, cudaStream_t stream) {
  CublasLtGemm::Problem g;
  g.trans_b = true;
  g.m = p.tokens;
  g.n = p.rank;
  g.k = p.in;
  g.a = x;
  g.lda = p.in;
  g.b = p.a;
  g.ldb = p.in;
  g.d = u;
  g.ldd = p.rank;
  gemm.Run(g, stream);
}

void LoraForward(CublasLtGemm& gemm, const LoraProjectionGemm& p, const __nv_bfloat16* x,
                 __nv_bfloat16* u, __nv_bfloat16* y, int64_t y_stride, cudaStream_t stream) {
  LoraDown(gemm, p, x, u, stream);
  CublasLtGemm::Problem g;  // y_seg [t][out] += scale * u [t][r] B^T
  g.trans_b = true;
  g.m = p.tokens;
  g.n = p.out;
  g.k = p.rank;
  g.a = u;
  g.lda = p.rank;
  g.b = p.b;
  g.ldb = p.rank;
  g.d = y + p.out_offset;
  g.ldd = y_stride;
  g.alpha = p.scale;
  g.beta = 1.0f;
  gemm.Run(g, stream);
}

void LoraBackwardInput(CublasLtGemm& gemm, const LoraProjectionGemm& p, const __nv_bfloat16* dy,
                       int64_t dy_stride, __nv_bfloat16* du, __nv_bfloat16* dx,
                       cudaStream_t stream) {
  LoraGradU(gemm, p, dy, dy_stride, du, stream);
  CublasLtGemm::Problem g;  // dx [t][in] += du [t][r] A [r][in]
  g.m = p.tokens;
  g.n = p.in;
  g.k = p.rank;
  g.a = du;
  g.lda = p.rank;
  g.b = p.a;
  g.ldb = p.in;
  g.d = dx;
  g.ldd = p.in;
  g.beta = 1.0f;
  gemm.Run(g, stream);
}

void LoraBackwardWeight(CublasLtGemm& gemm, const LoraProjectionGemm& p, const __nv_bfloat16* x,
                        const __nv_bfloat16* dy, int64_t dy_stride, __nv_bfloat16* u,
                        __nv_bfloat16* du, void* grad_a, void* grad_b, cudaDataType_t grad_type,
                        cudaStream_t stream) {
  LoraGradU(gemm, p, dy, dy_stride, du, stream);
  CublasLtGemm::Problem ga;  // dA [r][in] += du^T [r][t] x [t][in]
  ga.trans_a = true;
  ga.m = p.rank;
  ga.n = p.in;
  ga.k = p.tokens;
  ga.a = du;
  ga.lda = p.rank;
  ga.b = x;
  ga.ldb = p.in;
  ga.d = grad_a;
  ga.d_type = grad_type;
  ga.ldd = p.in;
  ga.beta = 1.0f;
  gemm.Run(ga, stream);
  LoraDown(gemm, p, x, u, stream);
  CublasLtGemm::Problem gb;  // dB [out][r] += scale * dy_seg^T [out][t] u [t][r]
  gb.trans_a = true;
  gb.m = p.out;
  gb.n = p.rank;
  gb.k = p.tokens;
  gb.a = dy + p.out_offset;
  gb.lda = dy_stride;
  gb.b = u;
  gb.ldb = p.rank;
  gb.d = grad_b;
  gb.d_type = grad_type;
  gb.ldd = p.rank;
  gb.alpha = p.scale;
  gb.beta = 1.0f;
  gemm.Run(gb, stream);
}

}  // namespace ctxplan::kernels::cuda
