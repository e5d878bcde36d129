// GPU tests skip themselves where there is no CUDA device (CI builds them and runs them as
// skipped); the CUPTI ones also while another tool (compute-sanitizer, Nsight) holds CUPTI.
#pragma once

#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

namespace ctxplan::test {

inline bool HaveGpu() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();  // no device is not an error for the tests that follow
  return ok;
}

}  // namespace ctxplan::test

#define SKIP_WITHOUT_GPU()                                                          \
  do {                                                                              \
    if (!::ctxplan::test::HaveGpu()) GTEST_SKIP() << "no CUDA GPU on this machine"; \
  } while (false)
