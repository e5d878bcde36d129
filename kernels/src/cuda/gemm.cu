// cuBLASLt GEMMs (gemm.h) and the linear layers built on them (ops.h): forward with the bias
// epilogue, input gradient, weight gradient accumulated with beta = 1 into bf16 or fp32, and the
// bias gradient: the column sums of dy, by two small kernels of our own (partial sums of row
// slices into the GEMM workspace, then their sums in a fixed order), or, for widths that are not
// a multiple of 8 or a workspace too small, as a cuBLASLt GEMV against a vector of ones (a
// split-K GEMM kernel of cuBLASLt's that keeps too few bytes in flight: kernels/PERF.md).
//
// Row-major to cuBLASLt's column-major: a row-major [r][c] matrix with row stride ld IS the
// column-major [c][r] matrix with leading dimension ld. So row-major D = op(A) op(B) is computed
// as column-major D^T = op(B)^T op(A)^T: cuBLASLt's A is our B, its B is our A, M = n, N = m.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/cuda/gemm.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ops_util.cuh"

namespace ctxplan::kernels::cuda {
namespace {

constexpr const char* kName = "CublasLtGemm";
constexpr int kHeuristicCandidates = 8;

// Largest power of two (<= 256) dividing the address: cuBLASLt's alignment preferences.
uint32_t AlignmentOf(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

void SetAttr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* value,
             size_t size) {
  CTXPLAN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, value, size));
}

}  // namespace

// One cached plan per problem shape (and operand alignments): descriptors plus the algorithm.
struct CublasLtGemm::Cache {
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  using Key = std::array<int64_t, 14>;
  std::map<Key, Plan> plans;

  ~Cache() {
    for (auto& [key, plan] : plans) {
      // Destruction never throws: statuses are ignored here.
      if (plan.a != nullptr) cublasLtMatrixLayoutDestroy(plan.a);
      if (plan.b != nullptr) cublasLtMatrixLayoutDestroy(plan.b);
      if (plan.d != nullptr) cublasLtMatrixLayoutDestroy(plan.d);
      if (plan.desc != nullptr) cublasLtMatmulDescDestroy(plan.desc);
    }
  }
};

CublasLtGemm::CublasLtGemm(size_t workspace_bytes, int64_t ones)
    : workspace_bytes_(workspace_bytes), ones_count_(ones), cache_(std::make_unique<Cache>()) {
  if (ones < 1) throw std::invalid_argument(std::string(kName) + ": ones must be >= 1");
  CTXPLAN_CUBLAS_CHECK(cublasLtCreate(&handle_));
  if (workspace_bytes_ > 0) CTXPLAN_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  CTXPLAN_CUDA_CHECK(cudaMalloc(&ones_, static_cast<size_t>(ones_count_) * sizeof(bf16)));
  const std::vector<bf16> host(static_cast<size_t>(ones_count_), __float2bfloat16(1.0f));
  CTXPLAN_CUDA_CHECK(
      cudaMemcpy(ones_, host.data(), host.size() * sizeof(bf16), cudaMemcpyHostToDevice));
}

CublasLtGemm::~CublasLtGemm() {
  cache_.reset();
  if (ones_ != nullptr) cudaFree(ones_);
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

void CublasLtGemm::Run(const Problem& p, cudaStream_t stream) {
  if (p.m < 0 || p.n < 0 || p.k < 0) throw std::invalid_argument("CublasLtGemm: negative shape");
  if (p.m == 0 || p.n == 0) return;
  if (p.k == 0) throw std::invalid_argument("CublasLtGemm: k = 0");
  if (p.a == nullptr || p.b == nullptr || p.d == nullptr) {
    throw std::invalid_argument("CublasLtGemm: null operand");
  }
  if (p.d_type != CUDA_R_16BF && p.d_type != CUDA_R_32F) {
    throw std::invalid_argument("CublasLtGemm: output must be bf16 or fp32");
  }
  if (p.bias != nullptr && p.d_type != CUDA_R_16BF) {
    throw std::invalid_argument("CublasLtGemm: the bias epilogue needs a bf16 output");
  }
  if (p.lda < (p.trans_a ? p.m : p.k) || p.ldb < (p.trans_b ? p.k : p.n) || p.ldd < p.n) {
    throw std::invalid_argument("CublasLtGemm: leading dimension too small");
  }

  // Column-major problem: D^T [n x m] = op(B)^T [n x k] * op(A)^T [k x m].
  const cublasOperation_t op_a = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // on the B buffer
  const cublasOperation_t op_b = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // on the A buffer
  const uint32_t align_a = AlignmentOf(p.b), align_b = AlignmentOf(p.a), align_d = AlignmentOf(p.d);
  const Cache::Key key = {
      p.trans_a,      p.trans_b,         p.m,     p.n,     p.k,    p.lda, p.ldb, p.ldd, p.d_type,
      p.beta != 0.0f, p.bias != nullptr, align_a, align_b, align_d};
  auto it = cache_->plans.find(key);
  if (it == cache_->plans.end()) {
    // Built in place; if anything below throws, the half-built entry is destroyed and erased.
    auto& stored = cache_->plans[key];
    try {
      CTXPLAN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&stored.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      SetAttr(stored.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a));
      SetAttr(stored.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b));
      const cublasLtEpilogue_t epilogue =
          p.bias != nullptr ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
      SetAttr(stored.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
      if (p.bias != nullptr) {
        const cudaDataType_t bias_type = CUDA_R_16BF;
        SetAttr(stored.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
        SetAttr(stored.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof(p.bias));
      }
      // Stored shapes (rows x cols, column-major) of the cuBLASLt operands.
      const uint64_t a_rows = op_a == CUBLAS_OP_N ? p.n : p.k;
      const uint64_t a_cols = op_a == CUBLAS_OP_N ? p.k : p.n;
      const uint64_t b_rows = op_b == CUBLAS_OP_N ? p.k : p.m;
      const uint64_t b_cols = op_b == CUBLAS_OP_N ? p.m : p.k;
      CTXPLAN_CUBLAS_CHECK(
          cublasLtMatrixLayoutCreate(&stored.a, CUDA_R_16BF, a_rows, a_cols, p.ldb));
      CTXPLAN_CUBLAS_CHECK(
          cublasLtMatrixLayoutCreate(&stored.b, CUDA_R_16BF, b_rows, b_cols, p.lda));
      CTXPLAN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&stored.d, p.d_type, p.n, p.m, p.ldd));

      cublasLtMatmulPreference_t pref = nullptr;
      CTXPLAN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      const uint64_t max_workspace = workspace_bytes_;
      const uint32_t align_c = align_d;
      cublasLtMatmulHeuristicResult_t results[kHeuristicCandidates] = {};
      int returned = 0;
      cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace));
      if (status == CUBLAS_STATUS_SUCCESS) {
        status = cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a));
      }
      if (status == CUBLAS_STATUS_SUCCESS) {
        status = cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b));
      }
      if (status == CUBLAS_STATUS_SUCCESS) {
        status = cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c));
      }
      if (status == CUBLAS_STATUS_SUCCESS) {
        status = cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d));
      }
      if (status == CUBLAS_STATUS_SUCCESS) {
        status = cublasLtMatmulAlgoGetHeuristic(handle_, stored.desc, stored.a, stored.b, stored.d,
                                                stored.d, pref, kHeuristicCandidates, results,
                                                &returned);
      }
      cublasLtMatmulPreferenceDestroy(pref);
      CTXPLAN_CUBLAS_CHECK(status);
      if (returned < 1) {
        throw CudaError("CublasLtGemm: no cuBLASLt algorithm for m=" + std::to_string(p.m) +
                        " n=" + std::to_string(p.n) + " k=" + std::to_string(p.k));
      }
      stored.algo = results[0].algo;
    } catch (...) {
      Cache::Plan broken = stored;
      cache_->plans.erase(key);
      if (broken.a != nullptr) cublasLtMatrixLayoutDestroy(broken.a);
      if (broken.b != nullptr) cublasLtMatrixLayoutDestroy(broken.b);
      if (broken.d != nullptr) cublasLtMatrixLayoutDestroy(broken.d);
      if (broken.desc != nullptr) cublasLtMatmulDescDestroy(broken.desc);
      throw;
    }
    it = cache_->plans.find(key);
  }
  Cache::Plan& plan = it->second;
  if (p.bias != nullptr) {
    SetAttr(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof(p.bias));
  }
  CTXPLAN_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &p.alpha, p.b, plan.a, p.a, plan.b,
                                      &p.beta, p.d, plan.d, p.d, plan.d, &plan.algo, workspace_,
                                      workspace_bytes_, stream));
}

// --- linear layers -------------------------------------------------------------------------------
namespace {

void CheckLinear(const char* name, int64_t m, int64_t n, int64_t k) {
  if (m < 0 || n < 0 || k <= 0) {
    throw std::invalid_argument(std::string(name) + ": bad shape m=" + std::to_string(m) +
                                " n=" + std::to_string(n) + " k=" + std::to_string(k));
  }
}

// --- bias gradient: d_bias [n] += column sums of dy [m][n] ---------------------------------------
// Pass 1 (BiasPartialKernel): grid (ceil(n / 256), splits); a block of 8 warps sums rows
// [split * rows_per_split, ...) of a 256-column strip: a lane owns 8 columns (one 16-byte load a
// row), warp w takes rows w, w + 8, ..., kBiasUnroll rows in flight at once; the 8 warps' sums
// are added in order through shared memory into partial [split][n] fp32.
// Pass 2 (BiasColumnSumKernel): d_bias[col] += the `splits` partials of col, in order.
// Both deterministic. ~32 splits keep every multiprocessor busy (18 strips x 32 = 576 blocks at
// n = 4608) with few partial rows for pass 2.
constexpr int kBiasThreads = 256;
constexpr int kBiasWarps = kBiasThreads / detail::kWarpSize;
constexpr int kBiasStrip = detail::kWarpSize * 8;  // columns of a block: 8 bf16 a lane
constexpr int kBiasUnroll = 4;
constexpr int kBiasSplits = 32;
constexpr int kBiasSumTile = 32;  // pass 2: (32 columns) x (8 row groups) threads

__global__ void __launch_bounds__(kBiasThreads)
    BiasPartialKernel(const bf16* __restrict__ dy, int64_t m, int64_t n, int64_t rows_per_split,
                      float* __restrict__ partial) {
  __shared__ float sums[kBiasWarps][kBiasStrip];
  detail::GridDependencyWaitAndTrigger();
  const int lane = threadIdx.x % detail::kWarpSize;
  const int warp = threadIdx.x / detail::kWarpSize;
  const int64_t strip = static_cast<int64_t>(blockIdx.x) * kBiasStrip;
  const int64_t col = strip + lane * 8;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_split;
  const int64_t r_end = std::min(m, r_begin + rows_per_split);
  float acc[8] = {};
  if (col < n) {
    for (int64_t r0 = r_begin + warp; r0 < r_end; r0 += kBiasWarps * kBiasUnroll) {
      float v[kBiasUnroll][8];
#pragma unroll
      for (int u = 0; u < kBiasUnroll; ++u) {
        const int64_t r = r0 + u * kBiasWarps;
        if (r < r_end) {
          detail::LoadVec<8>(dy + r * n + col, v[u]);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) v[u][e] = 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < kBiasUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += v[u][e];
      }
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) sums[warp][lane * 8 + e] = acc[e];
  __syncthreads();
  const int64_t out = strip + threadIdx.x;
  if (out < n) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kBiasWarps; ++w) total += sums[w][threadIdx.x];
    partial[blockIdx.y * n + out] = total;
  }
}

// grid: ceil(n / 32) blocks of (32, 8) threads.
template <typename GradT>
__global__ void __launch_bounds__(kBiasSumTile * 8)
    BiasColumnSumKernel(const float* __restrict__ partial, int splits, int64_t n,
                        GradT* __restrict__ d_bias) {
  constexpr int kGroups = 8;
  __shared__ float sums[kGroups][kBiasSumTile + 1];
  detail::GridDependencyWaitAndTrigger();
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kBiasSumTile + threadIdx.x;
  float sum = 0.0f;
  if (col < n) {
#pragma unroll 4
    for (int s = threadIdx.y; s < splits; s += kGroups) sum += partial[s * n + col];
  }
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float total = 0.0f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) total += sums[g][threadIdx.x];
    d_bias[col] = detail::FromFloat<GradT>(detail::ToFloat(d_bias[col]) + total);
  }
}

// Launches the two bias passes when dy suits them (16-byte rows) and the GEMM workspace holds the
// partials; returns false otherwise. The workspace is free between GEMMs on this stream (gemm.h:
// one CublasLtGemm per stream), so the partials may live there.
template <typename GradT>
bool LaunchBiasColumnSums(CublasLtGemm& gemm, const bf16* dy, int64_t m, int64_t n, GradT* d_bias,
                          cudaStream_t stream) {
  if (n % 8 != 0 || !detail::IsAligned(dy, 16) || gemm.workspace() == nullptr) return false;
  const int64_t rows_per_split = detail::CeilDiv(m, kBiasSplits);
  const int64_t splits = detail::CeilDiv(m, rows_per_split);
  if (static_cast<size_t>(splits * n) * sizeof(float) > gemm.workspace_bytes()) return false;
  float* partial = static_cast<float*>(gemm.workspace());  // [splits][n]
  detail::Launch(
      BiasPartialKernel,
      dim3(static_cast<unsigned>(detail::CeilDiv(n, kBiasStrip)), static_cast<unsigned>(splits)),
      dim3(kBiasThreads), stream, dy, m, n, rows_per_split, partial);
  detail::Launch(BiasColumnSumKernel<GradT>,
                 dim3(static_cast<unsigned>(detail::CeilDiv(n, kBiasSumTile))),
                 dim3(kBiasSumTile, 8), stream, static_cast<const float*>(partial),
                 static_cast<int>(splits), n, d_bias);
  return true;
}

template <typename GradT>
void LinearBackwardWeightImpl(CublasLtGemm& gemm, const bf16* x, const bf16* dy, int64_t m,
                              int64_t n, int64_t k, GradT* d_w, GradT* d_bias,
                              cudaStream_t stream) {
  CheckLinear("LinearBackwardWeight", n, k, std::max<int64_t>(m, 1));
  if (m == 0) return;
  constexpr cudaDataType_t kType = std::is_same_v<GradT, float> ? CUDA_R_32F : CUDA_R_16BF;
  if (d_w != nullptr) {
    // d_w [n][k] += dy^T [n][m] * x [m][k]
    CublasLtGemm::Problem p;
    p.trans_a = true;
    p.m = n;
    p.n = k;
    p.k = m;
    p.a = dy;
    p.lda = n;
    p.b = x;
    p.ldb = k;
    p.d = d_w;
    p.d_type = kType;
    p.ldd = k;
    p.beta = 1.0f;
    gemm.Run(p, stream);
  }
  if (d_bias != nullptr && !LaunchBiasColumnSums(gemm, dy, m, n, d_bias, stream)) {
    // d_bias [1][n] += ones [1][rows] * dy [rows][n], in slices of at most ones_count() rows.
    for (int64_t r0 = 0; r0 < m; r0 += gemm.ones_count()) {
      const int64_t rows = std::min(gemm.ones_count(), m - r0);
      CublasLtGemm::Problem p;
      p.m = 1;
      p.n = n;
      p.k = rows;
      p.a = gemm.ones();
      p.lda = rows;
      p.b = dy + r0 * n;
      p.ldb = n;
      p.d = d_bias;
      p.d_type = kType;
      p.ldd = n;
      p.beta = 1.0f;
      gemm.Run(p, stream);
    }
  }
}

}  // namespace

void LinearForward(CublasLtGemm& gemm, const bf16* x, const bf16* w, const bf16* bias, int64_t m,
                   int64_t n, int64_t k, bf16* y, cudaStream_t stream) {
  CheckLinear("LinearForward", m, n, k);
  CublasLtGemm::Problem p;
  p.trans_b = true;  // W stored [n][k]
  p.m = m;
  p.n = n;
  p.k = k;
  p.a = x;
  p.lda = k;
  p.b = w;
  p.ldb = k;
  p.d = y;
  p.ldd = n;
  p.bias = bias;
  gemm.Run(p, stream);
}

void LinearBackwardInput(CublasLtGemm& gemm, const bf16* dy, const bf16* w, int64_t m, int64_t n,
                         int64_t k, bf16* dx, cudaStream_t stream) {
  CheckLinear("LinearBackwardInput", m, n, k);
  // dx [m][k] = dy [m][n] * W [n][k]
  CublasLtGemm::Problem p;
  p.m = m;
  p.n = k;
  p.k = n;
  p.a = dy;
  p.lda = n;
  p.b = w;
  p.ldb = k;
  p.d = dx;
  p.ldd = k;
  if (n == 0) throw std::invalid_argument("LinearBackwardInput: n = 0");
  gemm.Run(p, stream);
}

void LinearBackwardWeight(CublasLtGemm& gemm, const bf16* x, const bf16* dy, int64_t m, int64_t n,
                          int64_t k, float* d_w, float* d_bias, cudaStream_t stream) {
  LinearBackwardWeightImpl(gemm, x, dy, m, n, k, d_w, d_bias, stream);
}

void LinearBackwardWeight(CublasLtGemm& gemm, const bf16* x, const bf16* dy, int64_t m, int64_t n,
                          int64_t k, bf16* d_w, bf16* d_bias, cudaStream_t stream) {
  LinearBackwardWeightImpl(gemm, x, dy, m, n, k, d_w, d_bias, stream);
}

}  // namespace ctxplan::kernels::cuda
