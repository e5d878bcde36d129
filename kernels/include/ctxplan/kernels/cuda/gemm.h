// cuBLASLt GEMMs for the linear layers and the loss head: bf16 operands, fp32 accumulation, bf16
// or fp32 output, optional bias epilogue, any beta (weight gradients accumulate with beta = 1).
//
// CublasLtGemm owns the cuBLASLt handle, one workspace (sized once, at construction; the bias
// gradient's partial sums use it too) and a device vector of bf16 ones (bias gradients as GEMVs
// where our column-sum kernels do not apply). Plans (matmul descriptor, layouts and the
// heuristic's algorithm) are cached per problem shape, so the heuristic runs once per shape.
// The workspace is shared by every call: use one CublasLtGemm per stream (calls on one stream are
// ordered, so they never use the workspace at the same time). Not thread-safe.
// This header is plain C++ (g++ includes it).
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace ctxplan::kernels::cuda {

class CublasLtGemm {
 public:
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;  // Hopper: 32 MiB advised
  static constexpr int64_t kDefaultOnes = int64_t{1} << 16;

  // Creates the handle and allocates the workspace and `ones` bf16 ones (synchronously).
  explicit CublasLtGemm(size_t workspace_bytes = kDefaultWorkspaceBytes,
                        int64_t ones = kDefaultOnes);
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // Row-major D[m][n] = alpha * op(A)[m][k] * op(B)[k][n] + bias[n] + beta * D.
  // Leading dimensions are row strides in elements of the matrices as STORED: A is stored
  // [m][k] (lda >= k) or, with trans_a, [k][m] (lda >= m); B is stored [k][n] (ldb >= n) or,
  // with trans_b, [n][k] (ldb >= k); D is [m][n] (ldd >= n).
  struct Problem {
    bool trans_a = false;
    bool trans_b = false;
    int64_t m = 0, n = 0, k = 0;
    const __nv_bfloat16* a = nullptr;
    int64_t lda = 0;
    const __nv_bfloat16* b = nullptr;
    int64_t ldb = 0;
    void* d = nullptr;                    // bf16 or fp32, per d_type
    cudaDataType_t d_type = CUDA_R_16BF;  // CUDA_R_16BF or CUDA_R_32F
    int64_t ldd = 0;
    float alpha = 1.0f;
    float beta = 0.0f;
    const __nv_bfloat16* bias = nullptr;  // [n], bf16 output only
  };
  // Enqueues the GEMM on `stream`. Throws CudaError when cuBLASLt has no algorithm for it.
  void Run(const Problem& problem, cudaStream_t stream);

  const __nv_bfloat16* ones() const { return ones_; }  // [ones_count()] bf16 1.0
  int64_t ones_count() const { return ones_count_; }
  size_t workspace_bytes() const { return workspace_bytes_; }
  // The workspace itself: the linear layers' own kernels (the bias gradient's partial sums) use
  // it between GEMMs on the same stream.
  void* workspace() const { return workspace_; }

 private:
  struct Cache;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  __nv_bfloat16* ones_ = nullptr;
  int64_t ones_count_ = 0;
  std::unique_ptr<Cache> cache_;
};

}  // namespace ctxplan::kernels::cuda
