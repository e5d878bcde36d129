#include "ctxplan/sim/kernel_time_model.h"

#include <algorithm>
#include <cmath>

#include "ctxplan/models/errors.h"

namespace ctxplan::sim {

KernelTimeModel::KernelTimeModel(const MachineSpec& machine, KernelTimeCalibration calibration)
    : calibration_(calibration) {
  const GpuSpec& gpu = machine.gpu;
  const KernelTimeCalibration& c = calibration_;
  gemm_seconds_per_flop_ = 1.0 / (gpu.bf16_gemm_tflops.value * 1e12 * c.gemm_efficiency);
  fused_loss_seconds_per_flop_ = gemm_seconds_per_flop_ / c.fused_loss_efficiency;
  attention_fwd_seconds_per_flop_ =
      1.0 / (gpu.attention_fwd_tflops.value * 1e12 * c.attention_forward_efficiency);
  attention_bwd_seconds_per_flop_ =
      1.0 / (gpu.attention_bwd_tflops.value * 1e12 * c.attention_backward_efficiency);
  sparse_attention_fwd_seconds_per_flop_ =
      attention_fwd_seconds_per_flop_ / c.sparse_attention_forward_efficiency;
  sparse_attention_bwd_seconds_per_flop_ =
      attention_bwd_seconds_per_flop_ / c.sparse_attention_backward_efficiency;
  hbm_seconds_per_byte_ = 1.0 / (gpu.d2d_copy_gbs.value * 1e9 * c.memory_efficiency);
  h2d_seconds_per_byte_ = 1.0 / (gpu.host_h2d_gbs.value * 1e9);
  d2h_seconds_per_byte_ = 1.0 / (gpu.host_d2h_gbs.value * 1e9);
  const double duplex_per_direction =
      std::min({gpu.host_duplex_gbs.value / 2.0, gpu.host_h2d_gbs.value, gpu.host_d2h_gbs.value});
  duplex_seconds_per_byte_ = 1.0 / (duplex_per_direction * 1e9);
  host_seconds_per_byte_ = 1.0 / (machine.host_memory_gbs * 1e9);
  CTXPLAN_CHECK(std::isfinite(gemm_seconds_per_flop_) && std::isfinite(hbm_seconds_per_byte_) &&
                    std::isfinite(host_seconds_per_byte_),
                "machine spec rates must be positive");
}

Tick KernelTimeModel::Duration(const OpCost& cost, Phase phase) const {
  const KernelTimeCalibration& c = calibration_;
  double seconds = 0.0;
  switch (cost.rate) {
    case RateClass::kNone:
      return 0;
    case RateClass::kGemm:
    case RateClass::kFusedLoss:
      seconds =
          std::max(cost.flops * (cost.rate == RateClass::kGemm ? gemm_seconds_per_flop_
                                                               : fused_loss_seconds_per_flop_),
                   cost.bytes * hbm_seconds_per_byte_);
      seconds = std::max(seconds, c.min_kernel_seconds);
      break;
    case RateClass::kAttentionForward:
    case RateClass::kSparseAttentionForward:
      seconds = std::max(cost.flops * (cost.rate == RateClass::kAttentionForward
                                           ? attention_fwd_seconds_per_flop_
                                           : sparse_attention_fwd_seconds_per_flop_),
                         cost.bytes * hbm_seconds_per_byte_);
      seconds = std::max(seconds, c.min_kernel_seconds);
      break;
    case RateClass::kAttentionBackward:
    case RateClass::kSparseAttentionBackward:
      seconds = std::max(cost.flops * (cost.rate == RateClass::kAttentionBackward
                                           ? attention_bwd_seconds_per_flop_
                                           : sparse_attention_bwd_seconds_per_flop_),
                         cost.bytes * hbm_seconds_per_byte_);
      seconds = std::max(seconds, c.min_kernel_seconds);
      break;
    case RateClass::kMemoryBound:
      seconds = std::max(cost.bytes * hbm_seconds_per_byte_, c.min_kernel_seconds);
      break;
    case RateClass::kHostToDevice:
    case RateClass::kDeviceToHost: {
      const bool both_ways = phase == Phase::kBackward;
      const double per_byte = both_ways                               ? duplex_seconds_per_byte_
                              : cost.rate == RateClass::kHostToDevice ? h2d_seconds_per_byte_
                                                                      : d2h_seconds_per_byte_;
      seconds = c.copy_latency_seconds + cost.bytes * per_byte;
      break;
    }
    case RateClass::kHostCompute:
      seconds = cost.bytes * host_seconds_per_byte_;
      break;
  }
  return SecondsToTicks(seconds);
}

}  // namespace ctxplan::sim
