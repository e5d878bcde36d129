// Device helpers shared by the elementwise / row kernels of ops.h (embedding, RMSNorm, RoPE,
// SwiGLU, page helpers, loss, AdamW): 16-byte vector loads and stores of bf16 / fp32 converted
// to fp32 registers, warp and block reductions, launch arithmetic. Private to kernels/src/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "ctxplan/kernels/cuda/check.h"

namespace ctxplan::kernels::cuda::detail {

using bf16 = __nv_bfloat16;

inline constexpr int kWarpSize = 32;

inline int64_t CeilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

inline bool IsAligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// --- programmatic dependent launch (PDL) ------------------------------------------------------
// Every kernel of ops.h is launched with the programmatic-stream-serialization attribute and
// starts with these two instructions: it waits until the kernel before it in the stream has
// completed and its writes are visible (griddepcontrol.wait), then lets the kernel after it be
// scheduled once all of its own blocks have started (griddepcontrol.launch_dependents). The
// launch latency and ramp-up of each kernel then overlap the tail of the previous one; the
// ordering of the stream is unchanged (no kernel touches memory before its wait). Without the
// attribute (CTXPLAN_CUDA_PDL=0) the wait returns at once and the trigger does nothing.
__device__ __forceinline__ void GridDependencyWaitAndTrigger() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

inline bool ProgrammaticLaunchEnabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("CTXPLAN_CUDA_PDL");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

// Launches `kernel` on `stream` with the PDL attribute (see above) and `smem` bytes of dynamic
// shared memory. Launch errors throw.
template <typename... KernelArgs, typename... Args>
void Launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
            Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = ProgrammaticLaunchEnabled() ? 1 : 0;
  CTXPLAN_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

// The same without dynamic shared memory.
template <typename... KernelArgs, typename... Args>
void Launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream,
            Args&&... args) {
  Launch(kernel, grid, block, size_t{0}, stream, std::forward<Args>(args)...);
}

// The current device's multiprocessor count, asked once a device (the launches that size their
// grids by it run every layer); devices past the cache's are asked every time.
inline int MultiprocessorCount() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices] = {};
  int device = 0;
  CTXPLAN_CUDA_CHECK(cudaGetDevice(&device));
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached) {
    const int known = counts[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 0;
  CTXPLAN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (cached) counts[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// --- conversions ---------------------------------------------------------------------------
__device__ __forceinline__ float ToFloat(float v) {
  return v;
}
__device__ __forceinline__ float ToFloat(bf16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T FromFloat(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return __float2bfloat16_rn(v);
  }
}

// --- vector loads / stores: kVec elements of T into fp32 registers --------------------------
// kVec = 8 (bf16: one 16-byte access; fp32: two), 4 (bf16: 8 bytes; fp32: 16 bytes) or 1.
// The caller guarantees alignment to kVec * sizeof(T) bytes (16 at most per access).
template <int kVec, typename T>
__device__ __forceinline__ void LoadVec(const T* p, float (&f)[kVec]) {
  if constexpr (kVec == 1) {
    f[0] = ToFloat(p[0]);
  } else if constexpr (std::is_same_v<T, bf16>) {
    static_assert(kVec == 8 || kVec == 4, "bf16 vectors are 4 or 8 wide");
    if constexpr (kVec == 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 v = __bfloat1622float2(h[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
      }
    } else {
      const uint2 raw = *reinterpret_cast<const uint2*>(p);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float2 v = __bfloat1622float2(h[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
      }
    }
  } else {
    static_assert(std::is_same_v<T, float>, "bf16 or fp32");
    static_assert(kVec % 4 == 0, "fp32 vectors are multiples of 4");
#pragma unroll
    for (int i = 0; i < kVec / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(p)[i];
      f[4 * i] = v.x;
      f[4 * i + 1] = v.y;
      f[4 * i + 2] = v.z;
      f[4 * i + 3] = v.w;
    }
  }
}

template <int kVec, typename T>
__device__ __forceinline__ void StoreVec(T* p, const float (&f)[kVec]) {
  if constexpr (kVec == 1) {
    p[0] = FromFloat<T>(f[0]);
  } else if constexpr (std::is_same_v<T, bf16>) {
    static_assert(kVec == 8 || kVec == 4, "bf16 vectors are 4 or 8 wide");
    if constexpr (kVec == 8) {
      uint4 raw;
      __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
      for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      *reinterpret_cast<uint4*>(p) = raw;
    } else {
      uint2 raw;
      __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
      for (int i = 0; i < 2; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      *reinterpret_cast<uint2*>(p) = raw;
    }
  } else {
    static_assert(std::is_same_v<T, float>, "bf16 or fp32");
    static_assert(kVec % 4 == 0, "fp32 vectors are multiples of 4");
#pragma unroll
    for (int i = 0; i < kVec / 4; ++i) {
      reinterpret_cast<float4*>(p)[i] =
          make_float4(f[4 * i], f[4 * i + 1], f[4 * i + 2], f[4 * i + 3]);
    }
  }
}

// Rounds through bf16 and back: what a bf16 store followed by a load would give.
__device__ __forceinline__ float RoundBf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// --- reductions (blockDim.x a multiple of 32) --------------------------------------------------
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Sum over the block, returned to every thread. Every thread of the block must call it; `shared`
// holds 32 floats. The leading barrier makes back-to-back calls on the same `shared` safe.
__device__ __forceinline__ float BlockSum(float v, float* shared) {
  v = WarpSum(v);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = lane < warps ? shared[lane] : 0.0f;
  return WarpSum(total);
}

// BlockSum for a loop that sums once an iteration: `shared` holds 2 x 32 floats and consecutive
// calls pass parity 0, 1, 0, ...; writing the other half each time, the call needs no leading
// barrier (the previous call's barrier already ordered the reads of the half it overwrites).
__device__ __forceinline__ float BlockSumAlternating(float v, float (&shared)[2][kWarpSize],
                                                     int parity) {
  v = WarpSum(v);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  if (lane == 0) shared[parity][warp] = v;
  __syncthreads();
  return WarpSum(lane < warps ? shared[parity][lane] : 0.0f);
}

}  // namespace ctxplan::kernels::cuda::detail
