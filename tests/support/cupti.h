// CUPTI tests skip themselves under compute-sanitizer (or Nsight, or another profiler): CUPTI
// already has its one subscriber there and no tracer can be enabled; the tracer says so with a
// CuptiError.
#pragma once

#include <cupti.h>

#include <cstdio>

#include "ctxplan/runtime/cuda/cupti_check.h"
#include "ctxplan/runtime/cuda/cupti_tracer.h"
#include "gpu.h"

namespace ctxplan::test {

inline bool CuptiBusy() {
  static const bool busy = [] {
    try {
      gpu::CuptiTracerOptions options;
      options.enabled = true;
      gpu::CuptiTracer probe(options);
      return false;
    } catch (const gpu::CuptiError& e) {
      std::printf("CUPTI unavailable: %s\n", e.what());
      return e.result() == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    }
  }();
  return busy;
}

}  // namespace ctxplan::test

#define SKIP_WITHOUT_CUPTI()                                                  \
  do {                                                                        \
    SKIP_WITHOUT_GPU();                                                       \
    if (::ctxplan::test::CuptiBusy())                                         \
      GTEST_SKIP() << "CUPTI is in use by another tool (compute-sanitizer?)"; \
  } while (false)
