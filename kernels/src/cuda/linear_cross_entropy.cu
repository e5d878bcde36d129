// Fused linear + cross-entropy over a chunk, tiled over tokens and vocabulary, forward and
// backward in one call; the [t][V] logits never exist whole.
//
// Per token tile of `rows` tokens (x_tile [rows][d]):
//   pass 1, for each vocab tile v0 (W_tile = W[v0 : v0 + cols], [cols][d]):
//     logits [rows][cols] fp32 = x_tile W_tile^T                         (cuBLASLt)
//     LseTileKernel: per row, the tile's max and sum of exp folded into the running
//     (max, sum) of the row; the label's logit picked up when the label is in the tile
//   FinalizeKernel: lse = max + log(sum); loss_sum (+)= sum over labelled rows of lse -
//   logit[label] pass 2, for each vocab tile:
//     logits recomputed (cuBLASLt)
//     SoftmaxGradKernel: g [rows][cols] bf16 = (exp(logit - lse) - onehot) * grad_scale
//                        (0 on rows without a label)
//     dx_acc [rows][d] fp32 (+)= g W_tile   (cuBLASLt, beta 0 on the first vocab tile, then 1)
//     d_w[v0 : v0 + cols] += g^T x_tile     (cuBLASLt, beta 1)
//   dx [rows][d] bf16 = dx_acc (a conversion kernel)
// fp32 logits keep softmax's argument exact to fp32: bf16 logits would put errors of a few
// percent into the probabilities of large logits.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/cuda/gemm.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ops_util.cuh"

namespace ctxplan::kernels::cuda {
namespace {

using detail::CeilDiv;
using detail::IsAligned;
using detail::LoadVec;
using detail::StoreVec;

constexpr const char* kName = "LinearCrossEntropy";
constexpr int kRowThreads = 256;
constexpr int kFinalizeThreads = 1024;
constexpr int kConvertThreads = 256;
constexpr size_t kAlign = 256;
static_assert(kRowThreads % detail::kWarpSize == 0);
static_assert(kFinalizeThreads % detail::kWarpSize == 0);

__device__ __forceinline__ float NegInf() {
  return __int_as_float(0xff800000);
}

// Merges (m2, s2) into (m, s): the log-sum-exp state max and sum of exp(x - max).
__device__ __forceinline__ void MergeLse(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == NegInf()) {
    s = s + s2;  // both empty (0 + 0), or NaN carried
  } else {
    s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  }
  m = mx;
}

// grid: rows blocks. logits row r at logits + r * ld, `cols` valid columns.
template <int kVec>
__global__ void __launch_bounds__(kRowThreads)
    LseTileKernel(const float* __restrict__ logits, int64_t ld, int cols,
                  const int32_t* __restrict__ labels, int64_t v0, bool first_tile,
                  float* __restrict__ run_max, float* __restrict__ run_sum,
                  float* __restrict__ label_logit) {
  __shared__ float shared_max[kRowThreads / detail::kWarpSize];
  __shared__ float shared_sum[kRowThreads / detail::kWarpSize];
  detail::GridDependencyWaitAndTrigger();
  const int64_t row = blockIdx.x;
  const float* l = logits + row * ld;
  float m = NegInf(), s = 0.0f;
  for (int c = threadIdx.x * kVec; c < cols; c += kRowThreads * kVec) {
    float v[kVec];
    LoadVec<kVec>(l + c, v);
    float local = v[0];
#pragma unroll
    for (int e = 1; e < kVec; ++e) local = fmaxf(local, v[e]);
    if (local > m) {
      s *= __expf(m - local);
      m = local;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) s += __expf(v[e] - m);
  }
#pragma unroll
  for (int offset = detail::kWarpSize / 2; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    MergeLse(m, s, m2, s2);
  }
  const int lane = threadIdx.x % detail::kWarpSize;
  const int warp = threadIdx.x / detail::kWarpSize;
  if (lane == 0) {
    shared_max[warp] = m;
    shared_sum[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kRowThreads / detail::kWarpSize; ++w) {
      MergeLse(m, s, shared_max[w], shared_sum[w]);
    }
    if (first_tile) {
      run_max[row] = m;
      run_sum[row] = s;
    } else {
      float rm = run_max[row], rs = run_sum[row];
      MergeLse(rm, rs, m, s);
      run_max[row] = rm;
      run_sum[row] = rs;
    }
    const int32_t label = labels[row];
    if (label >= v0 && label < v0 + cols) label_logit[row] = l[label - v0];
  }
}

// One block: lse per row, and loss_sum (+)= the rows' losses (double sums, fixed order).
__global__ void __launch_bounds__(kFinalizeThreads)
    FinalizeKernel(const float* __restrict__ run_max, const float* __restrict__ run_sum,
                   const float* __restrict__ label_logit, const int32_t* __restrict__ labels,
                   int64_t rows, int64_t vocab, bool accumulate, float* __restrict__ lse,
                   float* __restrict__ loss_sum) {
  __shared__ double shared[kFinalizeThreads / detail::kWarpSize];
  detail::GridDependencyWaitAndTrigger();
  double loss = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kFinalizeThreads) {
    const float value = run_max[r] + logf(run_sum[r]);
    lse[r] = value;
    const int32_t label = labels[r];
    if (label >= 0 && label < vocab) loss += static_cast<double>(value) - label_logit[r];
  }
#pragma unroll
  for (int offset = detail::kWarpSize / 2; offset > 0; offset >>= 1) {
    loss += __shfl_xor_sync(0xffffffffu, loss, offset);
  }
  const int lane = threadIdx.x % detail::kWarpSize;
  const int warp = threadIdx.x / detail::kWarpSize;
  if (lane == 0) shared[warp] = loss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < kFinalizeThreads / detail::kWarpSize; ++w) total += shared[w];
    const double before = accumulate ? static_cast<double>(*loss_sum) : 0.0;
    *loss_sum = static_cast<float>(before + total);
  }
}

// grid: rows blocks. g row r at g + r * ldg.
template <int kVec>
__global__ void __launch_bounds__(kRowThreads)
    SoftmaxGradKernel(const float* __restrict__ logits, int64_t ld, int cols,
                      const int32_t* __restrict__ labels, int64_t v0, int64_t vocab,
                      const float* __restrict__ lse, float grad_scale, bf16* __restrict__ g,
                      int64_t ldg) {
  detail::GridDependencyWaitAndTrigger();
  const int64_t row = blockIdx.x;
  const int32_t label = labels[row];
  const bool labelled = label >= 0 && label < vocab;
  const float row_lse = lse[row];
  const int64_t label_col = labelled ? label - v0 : -1;  // may lie outside this tile
  const float* l = logits + row * ld;
  bf16* out = g + row * ldg;
  for (int c = threadIdx.x * kVec; c < cols; c += kRowThreads * kVec) {
    float v[kVec];
    if (labelled) {
      LoadVec<kVec>(l + c, v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float p = __expf(v[e] - row_lse);
        v[e] = (c + e == label_col ? p - 1.0f : p) * grad_scale;
      }
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = 0.0f;
    }
    StoreVec<kVec>(out + c, v);
  }
}

// dx [n] bf16 = acc [n] fp32.
template <int kVec>
__global__ void __launch_bounds__(kConvertThreads)
    ConvertKernel(const float* __restrict__ acc, int64_t n, bf16* __restrict__ dx) {
  detail::GridDependencyWaitAndTrigger();
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (i >= n) return;
  float v[kVec];
  LoadVec<kVec>(acc + i, v);
  StoreVec<kVec>(dx + i, v);
}

size_t AlignUp(size_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

// The workspace, carved in this order.
struct Workspace {
  float* logits = nullptr;       // [tile_rows][tile_cols]
  bf16* g = nullptr;             // [tile_rows][tile_cols]
  float* dx_acc = nullptr;       // [tile_rows][d]
  float* run_max = nullptr;      // [tile_rows]
  float* run_sum = nullptr;      // [tile_rows]
  float* label_logit = nullptr;  // [tile_rows]
  float* lse = nullptr;          // [tile_rows]
  size_t bytes = 0;
};

Workspace Carve(const LinearCrossEntropyShape& s, void* base) {
  const int64_t tile_rows = std::max<int64_t>(1, std::min(s.token_tile, s.tokens));
  const int64_t tile_cols = std::max<int64_t>(1, std::min(s.vocab_tile, s.vocab));
  auto* p = static_cast<char*>(base);
  Workspace w;
  auto take = [&](size_t bytes) {
    char* at = p == nullptr ? nullptr : p + w.bytes;
    w.bytes += AlignUp(bytes);
    return at;
  };
  w.logits = reinterpret_cast<float*>(take(sizeof(float) * tile_rows * tile_cols));
  w.g = reinterpret_cast<bf16*>(take(sizeof(bf16) * tile_rows * tile_cols));
  w.dx_acc = reinterpret_cast<float*>(take(sizeof(float) * tile_rows * s.hidden));
  w.run_max = reinterpret_cast<float*>(take(sizeof(float) * tile_rows));
  w.run_sum = reinterpret_cast<float*>(take(sizeof(float) * tile_rows));
  w.label_logit = reinterpret_cast<float*>(take(sizeof(float) * tile_rows));
  w.lse = reinterpret_cast<float*>(take(sizeof(float) * tile_rows));
  return w;
}

void CheckShape(const LinearCrossEntropyShape& s) {
  if (s.tokens < 0 || s.hidden <= 0 || s.vocab <= 0 || s.token_tile <= 0 || s.vocab_tile <= 0 ||
      s.tokens > 0x7fffffff || s.vocab > 0x7fffffff) {
    throw std::invalid_argument(std::string(kName) + ": bad shape t=" + std::to_string(s.tokens) +
                                " d=" + std::to_string(s.hidden) + " V=" + std::to_string(s.vocab) +
                                " tiles " + std::to_string(s.token_tile) + "x" +
                                std::to_string(s.vocab_tile));
  }
}

template <typename GradT>
void Run(CublasLtGemm& gemm, const LinearCrossEntropyShape& s, const bf16* x, const bf16* w,
         const int32_t* labels, float grad_scale, bf16* dx, GradT* d_w, float* loss_sum,
         void* workspace, cudaStream_t stream) {
  CheckShape(s);
  if (loss_sum == nullptr || x == nullptr || w == nullptr || labels == nullptr) {
    throw std::invalid_argument(std::string(kName) + ": null x, w, labels or loss_sum");
  }
  if (s.tokens == 0) {
    CTXPLAN_CUDA_CHECK(cudaMemsetAsync(loss_sum, 0, sizeof(float), stream));
    return;
  }
  if (workspace == nullptr || !IsAligned(workspace, kAlign)) {
    throw std::invalid_argument(std::string(kName) + ": workspace must be 256-byte aligned");
  }
  const Workspace ws = Carve(s, workspace);
  const int64_t d = s.hidden;
  const int64_t ld = std::min(s.vocab_tile, s.vocab);  // row stride of the logits and g tiles
  constexpr cudaDataType_t kGradType = std::is_same_v<GradT, float> ? CUDA_R_32F : CUDA_R_16BF;
  const bool row_vec = ld % 4 == 0;

  for (int64_t t0 = 0; t0 < s.tokens; t0 += s.token_tile) {
    const int64_t rows = std::min(s.token_tile, s.tokens - t0);
    const bf16* x_tile = x + t0 * d;
    const int32_t* tile_labels = labels + t0;
    const unsigned row_blocks = static_cast<unsigned>(rows);

    auto logits_gemm = [&](int64_t v0, int64_t cols) {
      CublasLtGemm::Problem p;
      p.trans_b = true;  // W_tile stored [cols][d]
      p.m = rows;
      p.n = cols;
      p.k = d;
      p.a = x_tile;
      p.lda = d;
      p.b = w + v0 * d;
      p.ldb = d;
      p.d = ws.logits;
      p.d_type = CUDA_R_32F;
      p.ldd = ld;
      gemm.Run(p, stream);
    };

    // Pass 1: online log-sum-exp.
    for (int64_t v0 = 0; v0 < s.vocab; v0 += s.vocab_tile) {
      const int64_t cols = std::min(s.vocab_tile, s.vocab - v0);
      logits_gemm(v0, cols);
      auto kernel = row_vec && cols % 4 == 0 ? LseTileKernel<4> : LseTileKernel<1>;
      detail::Launch(kernel, dim3(row_blocks), dim3(kRowThreads), stream, ws.logits, ld,
                     static_cast<int>(cols), tile_labels, v0, v0 == 0, ws.run_max, ws.run_sum,
                     ws.label_logit);
    }
    detail::Launch(FinalizeKernel, dim3(1), dim3(kFinalizeThreads), stream, ws.run_max, ws.run_sum,
                   ws.label_logit, tile_labels, rows, s.vocab, t0 > 0, ws.lse, loss_sum);
    if (dx == nullptr && d_w == nullptr) continue;

    // Pass 2: recompute each logits tile and backpropagate softmax - onehot through it.
    for (int64_t v0 = 0; v0 < s.vocab; v0 += s.vocab_tile) {
      const int64_t cols = std::min(s.vocab_tile, s.vocab - v0);
      logits_gemm(v0, cols);
      auto kernel = row_vec && cols % 4 == 0 ? SoftmaxGradKernel<4> : SoftmaxGradKernel<1>;
      detail::Launch(kernel, dim3(row_blocks), dim3(kRowThreads), stream, ws.logits, ld,
                     static_cast<int>(cols), tile_labels, v0, s.vocab, ws.lse, grad_scale, ws.g,
                     ld);
      if (dx != nullptr) {
        // dx_acc [rows][d] (+)= g [rows][cols] * W_tile [cols][d]
        CublasLtGemm::Problem p;
        p.m = rows;
        p.n = d;
        p.k = cols;
        p.a = ws.g;
        p.lda = ld;
        p.b = w + v0 * d;
        p.ldb = d;
        p.d = ws.dx_acc;
        p.d_type = CUDA_R_32F;
        p.ldd = d;
        p.beta = v0 == 0 ? 0.0f : 1.0f;
        gemm.Run(p, stream);
      }
      if (d_w != nullptr) {
        // d_w[v0 : v0 + cols] [cols][d] += g^T [cols][rows] * x_tile [rows][d]
        CublasLtGemm::Problem p;
        p.trans_a = true;
        p.m = cols;
        p.n = d;
        p.k = rows;
        p.a = ws.g;
        p.lda = ld;
        p.b = x_tile;
        p.ldb = d;
        p.d = d_w + v0 * d;
        p.d_type = kGradType;
        p.ldd = d;
        p.beta = 1.0f;
        gemm.Run(p, stream);
      }
    }
    if (dx != nullptr) {
      const int64_t n = rows * d;
      bf16* dx_tile = dx + t0 * d;
      if (d % 8 == 0 && IsAligned(dx_tile, 16)) {
        detail::Launch(ConvertKernel<8>,
                       dim3(static_cast<unsigned>(CeilDiv(n / 8, kConvertThreads))),
                       dim3(kConvertThreads), stream, ws.dx_acc, n, dx_tile);
      } else {
        detail::Launch(ConvertKernel<1>, dim3(static_cast<unsigned>(CeilDiv(n, kConvertThreads))),
                       dim3(kConvertThreads), stream, ws.dx_acc, n, dx_tile);
      }
    }
  }
}

}  // namespace

size_t LinearCrossEntropyWorkspaceBytes(const LinearCrossEntropyShape& shape) {
  CheckShape(shape);
  return Carve(shape, nullptr).bytes;
}

void LinearCrossEntropy(CublasLtGemm& gemm, const LinearCrossEntropyShape& shape, const bf16* x,
                        const bf16* w, const int32_t* labels, float grad_scale, bf16* dx,
                        float* d_w, float* loss_sum, void* workspace, cudaStream_t stream) {
  Run(gemm, shape, x, w, labels, grad_scale, dx, d_w, loss_sum, workspace, stream);
}

void LinearCrossEntropy(CublasLtGemm& gemm, const LinearCrossEntropyShape& shape, const bf16* x,
                        const bf16* w, const int32_t* labels, float grad_scale, bf16* dx, bf16* d_w,
                        float* loss_sum, void* workspace, cudaStream_t stream) {
  Run(gemm, shape, x, w, labels, grad_scale, dx, d_w, loss_sum, workspace, stream);
}

}  // namespace ctxplan::kernels::cuda
