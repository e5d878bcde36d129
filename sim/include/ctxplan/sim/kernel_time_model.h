// How long an op takes on a machine: a roofline per op, from its cost descriptor and the GPU's
// achieved rates (measured where we have them, else estimated from the datasheet), with
// per-class efficiency factors. Made to be replaced by calibration tables from real traces.
#pragma once

#include <array>
#include <cstdint>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/runtime/op.h"
#include "ctxplan/sim/tick.h"

namespace ctxplan::sim {

struct KernelTimeCalibration {
  // Fraction of the GPU spec's achieved rate that each rate class reaches (1 = the spec's rate).
  double gemm_efficiency = 1.0;
  double attention_forward_efficiency = 1.0;
  double attention_backward_efficiency = 1.0;
  // The forward and backward over page-sparse selections reach these fractions of their dense
  // rates: the forward's tiles gather pages scattered over the whole context; the backward's key
  // blocks serve a few query tiles each, not all, and pay their fixed costs (K/V load, the dKV
  // read-add-write, one block per SM) for less work. Measured with ctxtrain on the H200
  // (Qwen2.5-7B, 512K, k 64 of 128-token pages, chunk 4096, offload off; the CUDA backend runs a
  // layer's own and paged attention as one launch): forward (the warp-specialised kernel of
  // 8fc76af) 9.77 s a step, of which the own part is predicted 1.64 s at the dense rate, so the
  // paged part runs at 0.81 of it; backward 6.0 ms a call, own 0.96 ms, paged 5.54 ms at 0.7 of
  // the backward's rate (so ~0.77).
  double sparse_attention_forward_efficiency = 0.81;
  double sparse_attention_backward_efficiency = 0.77;
  // The fused linear + cross-entropy reaches this fraction of the GEMM rate: its vocabulary tiles
  // alternate GEMMs with the softmax and the logits' gradient. H200 (Qwen2.5-7B, chunk 4096):
  // 613.6 TFLOP/s in kernels_bench (0.86 of the plain cuBLASLt GEMM of the shape, 0.83 of the
  // spec's rate); in ctxtrain at 512K 3.80 s a step against 3.09 s at the GEMM rate (0.81).
  double fused_loss_efficiency = 0.81;
  // Memory-bound kernels reach this fraction of the measured device-to-device copy bandwidth.
  double memory_efficiency = 0.8;
  // A kernel never takes less than this (launch and tail effects).
  double min_kernel_seconds = 2.5e-6;
  // Fixed cost of one copy (descriptor setup, completion), on top of bytes / bandwidth.
  double copy_latency_seconds = 5e-6;
};

class KernelTimeModel {
 public:
  KernelTimeModel(const MachineSpec& machine, KernelTimeCalibration calibration = {});

  // Duration of one op in ticks; zero for memory bookkeeping.
  Tick Duration(const Op& op) const { return Duration(op.cost, op.phase); }
  // Copies in the backward share the link with copies the other way (both directions stream
  // at once there), so they get half the measured duplex bandwidth; elsewhere one direction
  // has the link to itself.
  Tick Duration(const OpCost& cost, Phase phase) const;

  const KernelTimeCalibration& calibration() const { return calibration_; }

 private:
  KernelTimeCalibration calibration_;
  // Seconds per FLOP / per byte for each rate class, precomputed.
  double gemm_seconds_per_flop_ = 0;
  double fused_loss_seconds_per_flop_ = 0;
  double attention_fwd_seconds_per_flop_ = 0;
  double attention_bwd_seconds_per_flop_ = 0;
  double sparse_attention_fwd_seconds_per_flop_ = 0;
  double sparse_attention_bwd_seconds_per_flop_ = 0;
  double hbm_seconds_per_byte_ = 0;
  double h2d_seconds_per_byte_ = 0;
  double d2h_seconds_per_byte_ = 0;
  double duplex_seconds_per_byte_ = 0;  // per direction while both run
  double host_seconds_per_byte_ = 0;
};

}  // namespace ctxplan::sim
