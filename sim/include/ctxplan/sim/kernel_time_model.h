// How long an op takes on a machine, from its cost descriptor and launch shape (kernels/cost.h)
// and the GPU's kernel profile (models/gpu/*.yaml `kernel_model`, measured by `ctxplan
// calibrate` or scaled from a calibrated sibling). Every op kind has a time as a function of its
// shape; the parameters are few and named (KernelProfile), and their values come from
// microbenchmarks of the kernels of kernels/, never from the end-to-end runs the planner is
// judged on (traces/recorded/README.md).
//
//   every op      launches x launch_us (kernels) or copies x copy_call_us (copies), plus:
//   GEMM          output tiles in whole waves over the SMs (a launch of fewer tiles than SMs
//                 splits its depth), each wave its FLOPs at the rate plus a fixed wave cost;
//                 weight gradients (adding into fp32 or bf16) with their own tiles and costs
//   LoRA          the adapters' thin GEMMs after the base GEMM: their launches and their
//                 traffic at lora_efficiency of the memory-bound rate
//   fused loss    the GEMM model over tokens x vocab, at loss_efficiency of the rate
//   attention     items (128 queries x one head forward, 128 keys x one KV head backward) one
//                 per SM: each item's fixed cost and its 128 x 128 blocks (causal ones whole) at
//                 the head dim's rate, x the page size's fraction over pages (a size off the
//                 fast path runs another kernel path), x the sparse fraction; the tail of the
//                 launch's longest item. A chunk's own part merged into its paged launch pays
//                 no tail of its own.
//   memory-bound  bytes at memory_efficiency of the device copy bandwidth; the kernels measured
//                 apart at their own fixed cost and fraction
//   page score    the queries read at the memory rate, a fixed cost, tiles x pages x a cost
//   page top-k    pages x page_topk_ns_per_page per wave of query tiles (one SM a tile), plus
//                 the selections' read-back on the host (MachineSpec::selection_read_back_*),
//                 when the stream has nothing queued behind the top-k and idles
//   copies        bytes over the pinned link (both directions share it in the backward)
//   host compute  AdamW on the host at host_adamw_gparams
//   peer          a stage boundary's transfer: latency + bytes over the machine's peer link
//                 (or the network between machines), timed on the receive
//
// The compute-bound parts (GEMM, loss and attention compute) are at the model's SM clock: the
// maximum clock unless AtClock() says otherwise (the clock a step holds under the power limit,
// clock_model.h).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/sim/clock_model.h"
#include "ctxplan/sim/tick.h"

namespace ctxplan::sim {

// The profile the planner uses for `gpu`: its own kernel_model when the YAML has one (measured,
// or already scaled from its sibling at load time), else one derived from the spec values alone
// (flat rates, as before profiles existed; provenance kEstimate, derived_from "spec values").
KernelProfile EffectiveKernelProfile(const GpuSpec& gpu);

// Where a prediction's times come from, for reports: "measured (NVIDIA H200, 2026-11-24)",
// "estimate (scaled from h200)", "estimate (spec values only)".
std::string DescribeKernelProfile(const KernelProfile& profile);

class KernelTimeModel {
 public:
  explicit KernelTimeModel(const MachineSpec& machine);
  KernelTimeModel(const MachineSpec& machine, KernelProfile profile);

  // Duration of one op in ticks; zero for memory bookkeeping. A receive between stages on
  // different machines crosses the network, not the peer link.
  Tick Duration(const Op& op) const;
  // A stage boundary's transfer of `bytes` from rank `from` to rank `to`: over the peer link
  // inside a machine, over the network between machines (ranks fill machines in order).
  Tick PeerDuration(int64_t bytes, int from, int to) const;
  // Copies in the backward share the link with copies the other way (both directions stream
  // at once there), so they get half the measured duplex bandwidth; elsewhere one direction
  // has the link to itself.
  Tick Duration(const OpCost& cost, Phase phase) const {
    return SecondsToTicks(Seconds(cost, phase));
  }
  double Seconds(const OpCost& cost, Phase phase) const { return Time(cost, phase).seconds; }

  // An op's seconds and what it draws: the part of its time that runs at the SM clock and the
  // energy above idle (clock_model.h).
  struct OpTime {
    double seconds = 0;
    StepEnergy energy;  // at this model's clock
  };
  OpTime Time(const OpCost& cost, Phase phase) const;

  // This model with compute-bound work at `fraction` of the maximum SM clock, in every pass or
  // at each pass's own.
  KernelTimeModel AtClock(double fraction) const;
  KernelTimeModel AtClocks(const PassClocks& fractions) const;
  // This model for a run pipelined over `stages` GPUs: the GPUs of one machine copy to and from
  // the host at the same time (their stages run side by side), and share what the host's links
  // give them together (MachineSpec::host_links_*); a machine that measured none, or one GPU,
  // leaves each link as if alone.
  KernelTimeModel ForStages(int stages) const;
  void ShareHostLinks(int stages);  // the same, in place
  // The GPUs of one machine that copy at once in a run of `stages` pipeline stages.
  int HostCopiers(int stages) const { return std::min(std::max(1, stages), gpus_per_machine_); }
  // The SM clock the compute-bound kernels of `phase`'s pass run at, a fraction of the maximum.
  double clock_fraction(Phase phase) const {
    return clocks_[static_cast<size_t>(PowerPassOf(phase))];
  }
  const PassClocks& pass_clocks() const { return clocks_; }

  const KernelProfile& profile() const { return profile_; }
  // A GPU's PCIe copy rates, bytes a second: one way alone on its link (after ForStages, its
  // share of the host's), and the host-to-device rate beside a device-to-host copy.
  double h2d_bytes_per_second() const { return h2d_bytes_per_second_; }
  double d2h_bytes_per_second() const { return d2h_bytes_per_second_; }
  int gpus_per_machine() const { return gpus_per_machine_; }

  // --- the pieces, public for calibration fits and tests --------------------------------------
  // Tensor-core seconds of a GEMM-shaped launch, with tile and wave quantisation.
  double GemmComputeSeconds(const KernelShape& shape) const;
  // The fused loss's GEMMs at the maximum clock, a vocabulary tile at a time.
  double LossGemmSeconds(const OpCost& cost) const;
  // Seconds of an attention op's compute (no launch, no memory bound).
  double AttentionComputeSeconds(const OpCost& cost) const;
  // The forward: one 128 x 128 block of pairs takes `block` seconds, an item `item`.
  double AttentionForwardSeconds(const OpCost& cost, double block, double item, bool d64,
                                 bool sparse) const;
  // The fraction of the contiguous rate reached over pages of `page_tokens` (1 for 0).
  static double PageEfficiency(const std::map<int64_t, double>& table, int64_t page_tokens);

  // The paged attention's per-FLOP rate over pages of `page_tokens` against pages of 128 on this
  // profile, forward and backward, for the head dim and dense or page-sparse selection: below 1
  // where a page size is off the kernels' fast path (what `ctxplan plan` warns of).
  struct PageRate {
    double forward = 1.0, backward = 1.0;
    // False where a table of the profile that times this page size lacks it: the rate is then
    // the nearest measured size's (PageEfficiency), and the kernels may take another loader.
    bool measured = true;
  };
  PageRate PageRateAgainst128(int64_t page_tokens, int64_t head_dim, bool sparse) const;
  // The attention's per-FLOP rate at `head_dim` against head dim 128 on this profile, forward and
  // backward (1 above 64: the kernels' rates are measured at 64 and 128).
  PageRate HeadDimRateAgainst128(int64_t head_dim) const;
  // A page top-k's selection read-back on the host: the wait for the stream, the union of the
  // rows x tile_pages selected pages, the table of the cols earlier pages. The top-k op's time
  // includes it (the compute stream has nothing else queued until the host issues the layer's
  // attention).
  double SelectionReadBackSeconds(const KernelShape& shape) const;
  // The part of an op's Duration that is host work after its kernel, with the GPU idle (a top-k's
  // read-back): the event path's observers see the kernel's span without it.
  Tick HostTicks(const Op& op) const {
    return op.kind == OpKind::kPageTopK ? SecondsToTicks(SelectionReadBackSeconds(op.cost.shape))
                                        : 0;
  }
  // The paged attention's fraction of the contiguous rate over pages of `page_tokens` (the
  // profile's page table for the head dim, times its sparse table where pages are selected).
  double PagedEfficiency(int64_t page_tokens, bool backward, bool d64, bool sparse) const;

 private:
  KernelProfile profile_;
  PassClocks clocks_ = {1.0, 1.0, 1.0};  // of the maximum SM clock, by pass
  int64_t sm_count_ = 1;
  double hbm_bytes_per_second_ = 0;  // memory-bound kernels
  double h2d_bytes_per_second_ = 0;
  double d2h_bytes_per_second_ = 0;
  double duplex_bytes_per_second_ = 0;  // host to device while a device-to-host copy runs
  // The selection read-back (SelectionReadBackSeconds): fixed, per entry, per earlier page.
  double read_back_seconds_ = 0, read_back_seconds_per_entry_ = 0, read_back_seconds_per_page_ = 0;
  double host_bytes_per_second_ = 0;
  // The machine's GPUs all copying one way at once, summed over them (0: not measured).
  double links_h2d_bytes_per_second_ = 0;
  double links_d2h_bytes_per_second_ = 0;
  int gpus_per_machine_ = 1;
  double peer_bytes_per_second_ = 0;     // between GPUs of one machine, one way
  double network_bytes_per_second_ = 0;  // between machines, one way per GPU
  double peer_latency_seconds_ = 0;
  // The memory-bound kernels the profile measured apart, by MemoryKernel: their fixed cost and
  // their time over the common rate's.
  struct MemoryKernelTime {
    bool measured = false;
    double fixed_seconds = 0, slower = 1;
    // After the kernel that wrote its input, its traffic within the L2 (0: no warm rate).
    double warm_fixed_seconds = 0, warm_slower = 0;
  };
  double l2_bytes_ = 0;
  std::array<MemoryKernelTime, static_cast<size_t>(MemoryKernel::kCount_)> memory_kernels_{};
};

}  // namespace ctxplan::sim
