// The measurement groups of ctxplan-measure (--only picks among them). Each appends its rows to
// session.samples; a shape a kernel rejects (std::invalid_argument) is skipped with a note on
// stderr. CUDA errors throw kernels::CudaError.
#pragma once

#include <cuda_runtime_api.h>

#include "ctxplan/runtime/cuda/probe_kernel.h"
#include "measure_common.h"

namespace ctxplan::calibrate {

void MeasureLaunch(Session& session);     // measure_kernels.cpp
void MeasureGemm(Session& session);       // measure_kernels.cpp
void MeasureLoss(Session& session);       // measure_kernels.cpp
void MeasureLora(Session& session);       // measure_kernels.cpp
void MeasureMemory(Session& session);     // measure_kernels.cpp
void MeasureAttention(Session& session);  // measure_attention.cpp
void MeasureSelect(Session& session);     // measure_attention.cpp
void MeasureReadBack(Session& session);   // measure_read_back.cpp
void MeasureCopy(Session& session);       // measure_transfers.cpp
void MeasureLinks(Session& session);      // measure_transfers.cpp
void MeasureHost(Session& session);       // measure_transfers.cpp
void MeasurePower(Session& session);      // measure_power.cpp
// The power group's pieces: a few kernels timed under session.sustain_seconds.
void MeasurePowerKernels(Session& session);    // measure_kernels.cpp
void MeasurePowerDuty(Session& session);       // measure_kernels.cpp
void MeasurePowerAttention(Session& session);  // measure_attention.cpp
void MeasurePowerCopy(Session& session);       // measure_transfers.cpp

// The empty and idle kernels (ctxplan/runtime/cuda/probe_kernel.h).
using gpu::LaunchEmptyKernel;
using gpu::LaunchIdleKernel;

}  // namespace ctxplan::calibrate
