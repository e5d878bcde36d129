// Every CUDA, cuBLAS(Lt) call is checked, and the last error after every launch. A failure
// throws CudaError naming the call, the file and line, and the error string: library code
// throws, only main() decides how to exit.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace ctxplan::kernels {

class CudaError : public std::runtime_error {
 public:
  explicit CudaError(const std::string& message) : std::runtime_error(message) {}
};

inline void ThrowCuda(cudaError_t status, const char* call, const char* file, int line) {
  throw CudaError(std::string(file) + ":" + std::to_string(line) + ": " + call + ": " +
                  cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

inline void ThrowCublas(cublasStatus_t status, const char* call, const char* file, int line) {
  throw CudaError(std::string(file) + ":" + std::to_string(line) + ": " + call +
                  ": cuBLAS status " + std::to_string(static_cast<int>(status)));
}

}  // namespace ctxplan::kernels

#define CTXPLAN_CUDA_CHECK(call)                                                 \
  do {                                                                           \
    const cudaError_t ctxplan_status_ = (call);                                  \
    if (ctxplan_status_ != cudaSuccess)                                          \
      ::ctxplan::kernels::ThrowCuda(ctxplan_status_, #call, __FILE__, __LINE__); \
  } while (false)

#define CTXPLAN_CUBLAS_CHECK(call)                                                 \
  do {                                                                             \
    const cublasStatus_t ctxplan_status_ = (call);                                 \
    if (ctxplan_status_ != CUBLAS_STATUS_SUCCESS)                                  \
      ::ctxplan::kernels::ThrowCublas(ctxplan_status_, #call, __FILE__, __LINE__); \
  } while (false)

// After every kernel launch: launch-configuration errors surface here, asynchronous faults at
// the next synchronising call.
#define CTXPLAN_CUDA_CHECK_LAUNCH() CTXPLAN_CUDA_CHECK(cudaGetLastError())
