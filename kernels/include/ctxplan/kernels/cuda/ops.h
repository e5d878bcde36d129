// CUDA kernels of the training step other than attention and page selection (sm_90a): embedding,
// RMSNorm, RoPE, SwiGLU, the page helpers, the linear layers (cuBLASLt), the fused linear +
// cross-entropy and AdamW. bf16 storage, fp32 accumulation.
//
// Each launcher computes what its CPU reference in ctxplan/kernels/cpu/reference.h defines, up to
// the rounding of bf16 storage and fp32 arithmetic (tests/gpu_kernels_test.cpp checks it).
// Conventions:
//   - every pointer is DEVICE memory (token ids, labels and page tables too) unless marked
//     otherwise; shapes are in the comments, row-major; `t` = tokens of the chunk, `d` = hidden;
//   - "accumulated" outputs are added to, every other output is overwritten;
//   - everything is enqueued on `stream` (the last argument) and nothing synchronises; launch
//     errors throw CudaError (check.h), broken preconditions std::invalid_argument before anything
//     is enqueued;
//   - any width works; widths that are multiples of 8 elements with 16-byte aligned pointers take
//     the vectorised path (16-byte accesses), others a scalar path;
//   - scratch / workspace buffers are device memory the caller owns, sized by the *Bytes()
//     helpers, 256-byte aligned; one launch at a time may use a given scratch buffer;
//   - the kernels are launched with programmatic dependent launch (PDL): each waits for the
//     kernel before it in the stream to complete before touching memory, and lets the next one be
//     scheduled early, so launch latency overlaps the previous kernel's tail. Stream order is
//     unchanged. CTXPLAN_CUDA_PDL=0 in the environment launches them plainly.
// This header is plain C++: g++ includes it (the kernels live in kernels/src/cuda/*.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "ctxplan/kernels/paged_kv.h"

namespace ctxplan::kernels::cuda {

using bf16 = __nv_bfloat16;

class CublasLtGemm;  // gemm.h

// --- embedding (embedding.cu) --------------------------------------------------------------
// out[i] = table[tokens[i]]. An id outside [0, vocab) cannot throw from the device: its row of
// `out` is written as NaN (the CPU reference throws InputError; validate ids on the host first).
//   tokens [t] int32; table [V][d] bf16; out [t][d] bf16
void EmbeddingForward(const int32_t* tokens, const bf16* table, int64_t num_tokens, int64_t vocab,
                      int64_t hidden, bf16* out, cudaStream_t stream);

// d_table[tokens[i]] += d_out[i] (accumulated). Deterministic, no atomics: the first occurrence
// of each id sums the rows of all its occurrences in token order (fp32) and adds them once.
// Ids outside [0, vocab) are skipped.
//   tokens [t] int32; d_out [t][d] bf16; d_table [V][d] fp32 or bf16 (accumulated)
void EmbeddingBackward(const int32_t* tokens, const bf16* d_out, int64_t num_tokens, int64_t vocab,
                       int64_t hidden, float* d_table, cudaStream_t stream);
void EmbeddingBackward(const int32_t* tokens, const bf16* d_out, int64_t num_tokens, int64_t vocab,
                       int64_t hidden, bf16* d_table, cudaStream_t stream);

// --- RMSNorm (rmsnorm.cu): y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps) ----------
// A row is held in registers: hidden <= 16384 (forward) and <= 8192 (backward); wider rows throw
// std::invalid_argument.
//   x [t][d] bf16; weight [d] bf16; y [t][d] bf16; rstd [t] fp32 (saved for the backward)
void RmsNormForward(const bf16* x, const bf16* weight, int64_t tokens, int64_t hidden, float eps,
                    bf16* y, float* rstd, cudaStream_t stream);

// Fused residual add: h = residual + x (rounded to bf16 and stored), then y = RMSNorm(h) of the
// stored h. `h` may alias `residual` (in-place update of the residual stream).
//   residual [t][d] bf16; x [t][d] bf16; weight [d] bf16; h [t][d] bf16; y [t][d] bf16;
//   rstd [t] fp32
void RmsNormResidualForward(const bf16* residual, const bf16* x, const bf16* weight, int64_t tokens,
                            int64_t hidden, float eps, bf16* h, bf16* y, float* rstd,
                            cudaStream_t stream);

// Scratch of RmsNormBackward: one fp32 row of d_weight partial sums per thread block.
size_t RmsNormBackwardScratchBytes(int64_t tokens, int64_t hidden);

// dx = RMSNorm backward of dy (+ d_add when non-null: the residual stream's gradient, fused;
// d_add may alias dx); d_weight += sum over tokens of dy * x * rstd (accumulated, deterministic).
//   x [t][d] bf16; weight [d] bf16; rstd [t] fp32 (from the forward); dy [t][d] bf16;
//   d_add [t][d] bf16 or null; dx [t][d] bf16; d_weight [d] fp32 or bf16 (accumulated);
//   scratch: RmsNormBackwardScratchBytes(tokens, hidden) bytes
void RmsNormBackward(const bf16* x, const bf16* weight, const float* rstd, const bf16* dy,
                     const bf16* d_add, int64_t tokens, int64_t hidden, bf16* dx, float* d_weight,
                     void* scratch, cudaStream_t stream);
void RmsNormBackward(const bf16* x, const bf16* weight, const float* rstd, const bf16* dy,
                     const bf16* d_add, int64_t tokens, int64_t hidden, bf16* dx, bf16* d_weight,
                     void* scratch, cudaStream_t stream);

// The same backward (no d_add) with d_weight left in its fp32 partial rows, which are ADDED TO
// instead of summed into d_weight at once: for a norm whose backward runs once a chunk (the final
// norm), the partial rows stay across the step's chunks and RmsNormAddPartials sums them into
// d_weight once a step, after the last chunk. Which rows a call adds to depends on its grid; the
// sum over rows is the gradient, in a fixed order (deterministic).
//   partials [rows][d] fp32: RmsNormBackwardScratchBytes(largest tokens of a call, d) bytes,
//   zeroed before the step's first call; returns the rows this call added to (the sum needs
//   the largest of the step's returns).
int RmsNormBackwardIntoPartials(const bf16* x, const bf16* weight, const float* rstd,
                                const bf16* dy, int64_t tokens, int64_t hidden, bf16* dx,
                                float* partials, cudaStream_t stream);
// d_weight [d] += the column sums of partials [rows][d].
void RmsNormAddPartials(const float* partials, int rows, int64_t hidden, float* d_weight,
                        cudaStream_t stream);
void RmsNormAddPartials(const float* partials, int rows, int64_t hidden, bf16* d_weight,
                        cudaStream_t stream);

// --- RoPE (rope.cu), Hugging Face rotate_half, in place ---------------------------------------
// Row i (position first_position + i) holds `heads` heads of head_dim at x + i * row_stride;
// row_stride = heads * head_dim for a contiguous [t][H][d_h] tensor, larger to rotate the Q and
// K heads inside a fused QKV row ([t][(H_q + 2 H_kv) d_h] with heads = H_q + H_kv). Angles
// position * theta^(-2j/d_h) are formed and reduced modulo 2 pi in double, so positions in the
// millions keep their precision. head_dim even, at most 512.
//   x [t][row_stride] bf16, heads * head_dim elements of each row rotated in place
void RopeForward(bf16* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride,
                 int64_t first_position, double theta, cudaStream_t stream);
// The transpose (rotation by -angle): gradients flow back through RoPE.
void RopeBackward(bf16* dx, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride,
                  int64_t first_position, double theta, cudaStream_t stream);

// --- SwiGLU (swiglu.cu): out = silu(gate) * up, gate_up[i] = [gate (I) | up (I)] --------------
//   gate_up [t][2I] bf16; out [t][I] bf16
void SwigluForward(const bf16* gate_up, int64_t tokens, int64_t intermediate, bf16* out,
                   cudaStream_t stream);
//   gate_up [t][2I] bf16; d_out [t][I] bf16; d_gate_up [t][2I] bf16 (may alias gate_up)
void SwigluBackward(const bf16* gate_up, const bf16* d_out, int64_t tokens, int64_t intermediate,
                    bf16* d_gate_up, cudaStream_t stream);

// --- page helpers (page_helpers.cu); page layout in paged_kv.h --------------------------------
// Writes the chunk's post-RoPE K and V into its own pages: token i goes to logical page
// i / p (slot own_pages.page_slot[i / p]), row i % p. A partly filled last page keeps its tail.
//   k, v: rows of kv_dim = H_kv * d_h bf16 at k + i * row_stride (row_stride = kv_dim when
//         contiguous [t][H_kv][d_h]; larger inside a fused QKV row)
//   own_pages.pool [slots][2][p][H_kv][d_h] bf16; own_pages.page_slot [ceil(t / p)] int32
void KvWrite(const bf16* k, const bf16* v, int64_t row_stride, int64_t tokens,
             const PagedKv<bf16>& own_pages, cudaStream_t stream);

// dk_own / dv_own += the dKV that later chunks accumulated in the chunk's own pages.
//   own_dkv.pool [slots][2][p][H_kv][d_h] fp32 or bf16; own_dkv.page_slot [ceil(t / p)] int32
//   dk_own, dv_own: rows of kv_dim bf16 at + i * row_stride (accumulated)
void DkvAccumulate(const PagedKv<const float>& own_dkv, int64_t tokens, bf16* dk_own, bf16* dv_own,
                   int64_t row_stride, cudaStream_t stream);
void DkvAccumulate(const PagedKv<const bf16>& own_dkv, int64_t tokens, bf16* dk_own, bf16* dv_own,
                   int64_t row_stride, cudaStream_t stream);

// --- linear layers (gemm.cu), cuBLASLt; W in Hugging Face layout [out][in] ---------------------
// y = x W^T + bias (bias fused as the cuBLASLt epilogue).
//   x [m][k] bf16; w [n][k] bf16; bias [n] bf16 or null; y [m][n] bf16
void LinearForward(CublasLtGemm& gemm, const bf16* x, const bf16* w, const bf16* bias, int64_t m,
                   int64_t n, int64_t k, bf16* y, cudaStream_t stream);
// dx = dy W (overwritten).
//   dy [m][n] bf16; w [n][k] bf16; dx [m][k] bf16
void LinearBackwardInput(CublasLtGemm& gemm, const bf16* dy, const bf16* w, int64_t m, int64_t n,
                         int64_t k, bf16* dx, cudaStream_t stream);
// d_w += dy^T x (GEMM with beta = 1, fp32 accumulation); d_bias += column sums of dy when
// non-null (two kernels of ours, partial sums in the gemm's workspace, deterministic; a cuBLASLt
// GEMV against a vector of ones when n % 8 != 0, dy is not 16-byte aligned or the workspace is
// too small).
//   x [m][k] bf16; dy [m][n] bf16; d_w [n][k] fp32 or bf16; d_bias [n] same type or null
void LinearBackwardWeight(CublasLtGemm& gemm, const bf16* x, const bf16* dy, int64_t m, int64_t n,
                          int64_t k, float* d_w, float* d_bias, cudaStream_t stream);
void LinearBackwardWeight(CublasLtGemm& gemm, const bf16* x, const bf16* dy, int64_t m, int64_t n,
                          int64_t k, bf16* d_w, bf16* d_bias, cudaStream_t stream);

// --- fused linear + cross-entropy (linear_cross_entropy.cu) ------------------------------------
// The loss head over a chunk, forward and backward in one call, tiled as the CPU reference is:
// per token tile, pass 1 runs a cuBLASLt GEMM per vocabulary tile into an fp32 logits tile and
// folds it into an online log-sum-exp per token; pass 2 recomputes each logits tile, forms
// g = (softmax - onehot) * grad_scale in bf16 and accumulates dx (fp32) += g W_tile and
// d_w[tile] += g^T x with two more GEMMs. Only one [token_tile][vocab_tile] logits tile exists.
// Labels < 0 (e.g. -1, -100) and >= vocab carry no loss and no gradient (the CPU reference throws
// on >= vocab: validate on the host).
struct LinearCrossEntropyShape {
  int64_t tokens = 0;  // t
  int64_t hidden = 0;  // d
  int64_t vocab = 0;   // V
  int64_t token_tile = 4096;
  int64_t vocab_tile = 8192;
};
size_t LinearCrossEntropyWorkspaceBytes(const LinearCrossEntropyShape& shape);
// loss_sum = sum over labelled positions of lse - logit[label] (fp32, overwritten, device);
// dx overwritten (skipped when null); d_w accumulated (skipped when null: pass a typed null,
// e.g. static_cast<float*>(nullptr)); both scaled by grad_scale.
//   x [t][d] bf16; w [V][d] bf16; labels [t] int32; dx [t][d] bf16; d_w [V][d] fp32 or bf16;
//   loss_sum [1] fp32; workspace: LinearCrossEntropyWorkspaceBytes(shape) bytes
void LinearCrossEntropy(CublasLtGemm& gemm, const LinearCrossEntropyShape& shape, const bf16* x,
                        const bf16* w, const int32_t* labels, float grad_scale, bf16* dx,
                        float* d_w, float* loss_sum, void* workspace, cudaStream_t stream);
void LinearCrossEntropy(CublasLtGemm& gemm, const LinearCrossEntropyShape& shape, const bf16* x,
                        const bf16* w, const int32_t* labels, float grad_scale, bf16* dx, bf16* d_w,
                        float* loss_sum, void* workspace, cudaStream_t stream);

// --- AdamW (adamw.cu), torch.optim.AdamW semantics, fp32 moments --------------------------------
struct AdamWParams {
  float lr = 1e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;  // 1-based, for bias correction (computed on the host in double)
};
//   param [n] bf16 or fp32 (updated); grad [n] bf16 or fp32; m, v [n] fp32 (updated)
void AdamW(bf16* param, const bf16* grad, float* m, float* v, int64_t n, const AdamWParams& p,
           cudaStream_t stream);
void AdamW(bf16* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p,
           cudaStream_t stream);
void AdamW(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p,
           cudaStream_t stream);

}  // namespace ctxplan::kernels::cuda
