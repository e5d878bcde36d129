// The calibration fit recovers a known profile: samples are made by the kernel-time model itself
// from a profile unlike any catalogue GPU's, fitted, and the parameters compared. Bad sample
// files are one clear error naming the file and line.
#include <gtest/gtest.h>

#include <random>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/sim/calibration.h"
#include "ctxplan/sim/kernel_time_model.h"

namespace ctxplan::sim {
namespace {

KernelProfile TruthProfile() {
  KernelProfile k;
  k.provenance = Provenance::kMeasured;
  k.launch_us = 3.0;
  k.gemm_tflops = 650;
  k.gemm_tile_rows = 128;
  k.gemm_tile_cols = 256;
  k.gemm_split_max = 2;
  k.gemm_wave_us = 1.0;
  k.gemm_accumulate_tflops = 600;
  k.gemm_accumulate_tile_rows = 128;
  k.gemm_accumulate_tile_cols = 128;
  k.gemm_accumulate_wave_us_per_byte = 2.0;
  k.loss_efficiency = 0.8;
  k.loss_ns_per_logit = 0.004;  // the softmax's share: ~25% of the loss at hidden 2048
  k.attention_fwd_tflops_d128 = 500;
  k.attention_fwd_tflops_d64 = 380;
  k.attention_bwd_tflops_d128 = 340;
  k.attention_bwd_tflops_d64 = 210;
  k.attention_fwd_item_us = 3.0;
  k.attention_bwd_item_us = 5.0;
  k.attention_bwd_own_item_us = 20.0;  // own launches: heaviest first, their own item cost
  k.page_fwd_efficiency = {{32, 0.5}, {64, 0.95}, {96, 0.6}, {128, 1.02}};
  k.page_bwd_efficiency = {{32, 0.4}, {64, 0.9}, {96, 0.55}, {128, 1.0}};
  k.sparse_fwd_efficiency = 0.85;
  k.sparse_bwd_efficiency = 0.9;
  // Sparse selections by page size: under 128 tokens a key block is unrelated pages.
  k.sparse_fwd_page_efficiency = {{64, 0.7}, {128, 0.85}};
  k.sparse_bwd_page_efficiency = {{64, 0.5}, {128, 0.9}};
  k.memory_efficiency = 0.83;
  k.page_score_fixed_us = 8.0;
  k.page_score_ns_per_tile_page = 0.4;
  k.page_score_ns_per_tile_element = 1.0;
  k.page_topk_fixed_us = 9.0;
  k.page_topk_ns_per_page = 20;
  k.copy_call_us = 1.5;
  k.lora_efficiency = 0.7;
  // RMSNorm cold at the common pair, and 1.8x that rate after the kernel that wrote its input.
  k.l2_cache_mib = 50;
  k.memory_kernel_fixed_us = {{"rmsnorm_fwd", k.launch_us}};
  k.memory_kernel_efficiency = {{"rmsnorm_fwd", k.memory_efficiency}};
  k.memory_kernel_warm_fixed_us = {{"rmsnorm_fwd", 1.2}};
  k.memory_kernel_warm_efficiency = {{"rmsnorm_fwd", 1.8 * k.memory_efficiency}};
  return k;
}

CalibrationSample Row(std::string op) {
  CalibrationSample s;
  s.op = std::move(op);
  return s;
}

// The time model that times the synthetic samples: `profile` on `gpu`, a host that never binds.
KernelTimeModel TruthModel(const GpuSpec& gpu, const KernelProfile& profile) {
  MachineSpec machine;
  machine.gpu = gpu;
  machine.host_ram_bytes = 1;
  machine.host_memory_gbs = 100;
  return KernelTimeModel(machine, profile);
}

// A power-group attention row: a 4096-token causal launch sustained at 0.85 of the clock, drawing
// `watts`, 1024-wide KV (kv_heads = 1024 / head_dim).
CalibrationSample PowerAttentionRow(const KernelTimeModel& truth, bool backward, int64_t head_dim,
                                    double watts) {
  CalibrationSample s = Row(backward ? "power_attention_bwd" : "power_attention_fwd");
  const int64_t heads = 4096 / head_dim;
  s.m = 4096, s.heads = heads, s.kv_heads = 1024 / head_dim;
  s.head_dim = head_dim, s.grad_bytes = 2;
  const double pairs = 4096 * 4097 / 2.0;
  const OpCost cost = backward ? AttentionBackwardCost(pairs, 4096, 4096, heads, 1024, head_dim, 2)
                               : AttentionForwardCost(pairs, 4096, 4096, heads, 1024, head_dim);
  s.bytes = cost.bytes, s.flops = cost.flops;
  s.seconds = truth.Seconds(cost, Phase::kFill) / 0.85;
  s.sm_clock_mhz = 1980 * 0.85;
  s.watts = watts;
  return s;
}

// A grid like ctxplan-measure's, timed by the model with the true profile. sparse_heads: the
// (H_q, H_kv, d_h) of the page-sparse rows (Qwen2.5-7B's unless given).
struct SparseHeads {
  int64_t heads, kv_heads, head_dim;
};
CalibrationSamples MakeSamples(const GpuSpec& gpu,
                               const KernelProfile& truth_profile = TruthProfile(),
                               const std::vector<SparseHeads>& sparse_heads = {{28, 4, 128}}) {
  const KernelTimeModel truth = TruthModel(gpu, truth_profile);
  CalibrationSamples out;
  out.header = {{"gpu_name", "Test GPU"},
                {"driver", "1.0"},
                {"date", "2026-11-24"},
                {"commit", "abc"},
                {"l2_bytes", "52428800"}};
  if (truth_profile.sparse_bwd_gathered) out.header["sparse_bwd"] = "gathered";
  auto add = [&](CalibrationSample s, const OpCost& cost, Phase phase = Phase::kFill) {
    s.seconds = truth.Seconds(cost, phase);
    out.rows.push_back(s);
  };
  CalibrationSample launch = Row("launch");
  launch.seconds = 3.0e-6;
  out.rows.push_back(launch);
  for (const double bytes : {64.0 * (1 << 20), 1024.0 * (1 << 20)}) {
    CalibrationSample d2d = Row("copy_d2d");
    d2d.bytes = bytes;
    d2d.seconds = 2 * bytes / (gpu.d2d_copy_gbs.value * 1e9);
    out.rows.push_back(d2d);
  }
  for (const char* op : {"copy_h2d", "copy_d2h"}) {
    for (const int64_t bytes : {64 << 20, 256 << 20}) {
      CalibrationSample s = Row(op);
      s.bytes = static_cast<double>(bytes);
      s.copies = 1;
      add(s, CopyCost(bytes, op == std::string("copy_h2d"), 1));
    }
    CalibrationSample batch = Row(op);
    batch.bytes = 128 << 10;
    batch.copies = 256;
    add(batch, CopyCost(int64_t{128 << 10} * 256, op == std::string("copy_h2d"), 256));
  }
  CalibrationSample duplex = Row("copy_duplex");
  duplex.bytes = 256 << 20;
  duplex.seconds = 2 * duplex.bytes / (gpu.host_duplex_gbs.value * 1e9);
  out.rows.push_back(duplex);
  CalibrationSample weights = Row("weights_init");
  weights.m = 1'000'000'000;
  weights.seconds = 4.0;
  out.rows.push_back(weights);
  for (const char* op : {"pin", "host_memcpy", "device_alloc"}) {
    CalibrationSample s = Row(op);
    s.bytes = 1 << 30;
    s.seconds = 0.1;
    out.rows.push_back(s);
  }
  for (const int64_t m : {512, 1024, 4096, 16384}) {
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{4096, 4096},
                               {28672, 4096},
                               {4096, 14336},
                               {512, 3584},
                               {3584, 3584}}) {
      CalibrationSample s = Row("gemm_fwd");
      s.m = m, s.n = n, s.k = k;
      add(s, LinearForwardCost(m, n, k));
      s.op = "gemm_bwd_input";
      add(s, LinearBackwardInputCost(m, n, k));
      s.op = "gemm_bwd_weight";
      for (const int64_t grad_bytes : {2, 4}) {
        s.grad_bytes = grad_bytes;
        add(s, LinearBackwardWeightCost(m, n, k, {}, grad_bytes));
      }
    }
    for (const int64_t hidden : {2048, 4096}) {  // two hidden sizes part GEMMs and softmax
      CalibrationSample loss = Row("loss");
      loss.m = m, loss.n = 152064, loss.k = hidden, loss.grad_bytes = 2;
      add(loss, LossForwardBackwardCost(m, hidden, 152064, true, 2));
    }
    CalibrationSample norm = Row("rmsnorm_fwd");
    norm.m = m, norm.n = 4096;
    norm.bytes = RmsNormForwardCost(m, 4096).bytes;
    add(norm, RmsNormForwardCost(m, 4096));
    if (m <= 1024) {  // within the L2
      CalibrationSample warm = Row("rmsnorm_fwd_warm");
      warm.m = m, warm.n = 4096;
      warm.bytes = norm.bytes;
      add(warm, WarmInput(RmsNormForwardCost(m, 4096)));
    }
  }
  // Attention: own only, dense paged at each page size, sparse at several budgets.
  for (const bool backward : {false, true}) {
    const char* op = backward ? "attention_bwd" : "attention_fwd";
    const Phase phase = backward ? Phase::kBackward : Phase::kFill;
    for (const int64_t d : {128, 64}) {
      const int64_t heads = d == 128 ? 28 : 32, kv_heads = d == 128 ? 4 : 8;
      for (const int64_t t : {1024, 4096, 16384}) {
        CalibrationSample s = Row(op);
        s.m = t, s.heads = heads, s.kv_heads = kv_heads, s.head_dim = d, s.grad_bytes = 2;
        const double pairs = t * (t + 1.0) / 2.0;
        add(s,
            backward ? AttentionBackwardCost(pairs, t, t, heads, kv_heads * d, d, 2)
                     : AttentionForwardCost(pairs, t, t, heads, kv_heads * d, d),
            phase);
      }
      // Page 128 at three chunk sizes besides: the items over pages have their own fixed cost.
      for (const auto& [p, t] : std::vector<std::pair<int64_t, int64_t>>{
               {32, 4096}, {64, 4096}, {96, 4096}, {128, 4096}, {128, 1024}, {128, 16384}}) {
        CalibrationSample s = Row(op);
        const int64_t pages = 32768 / p;
        s.m = t, s.heads = heads, s.kv_heads = kv_heads, s.head_dim = d, s.grad_bytes = 2;
        s.page_tokens = p, s.pages = pages;
        const double own = t * (t + 1.0) / 2.0, paged = t * 32768.0;
        OpCost a = backward ? AttentionBackwardCost(own, t, t, heads, kv_heads * d, d, 2)
                            : AttentionForwardCost(own, t, t, heads, kv_heads * d, d);
        a.shape.merged = true;  // one launch with the paged part
        const OpCost b =
            backward
                ? AttentionBackwardCost(paged, t, 32768, heads, kv_heads * d, d, 2, false, p, pages)
                : AttentionForwardCost(paged, t, 32768, heads, kv_heads * d, d, false, p, pages);
        s.seconds = truth.Seconds(a, phase) + truth.Seconds(b, phase) - 3.0e-6;
        out.rows.push_back(s);
      }
    }
    for (const auto& [hq, hkv, d] : sparse_heads) {
      for (const auto& [p, budget] : std::vector<std::pair<int64_t, int64_t>>{
               {128, 16}, {128, 64}, {128, 128}, {64, 16}, {64, 64}}) {
        if (hq / hkv == 2 && p != 128) continue;  // group 2: ctxplan-measure's union rows
        CalibrationSample s = Row(op);
        const int64_t t = 4096, pages = 65536 / p, per_tile = budget + 1, kv_dim = hkv * d;
        s.m = t, s.heads = hq, s.kv_heads = hkv, s.head_dim = d, s.grad_bytes = 2;
        s.page_tokens = p, s.pages = pages, s.pages_per_tile = per_tile;
        const double own = t * (t + 1.0) / 2.0, paged = t * static_cast<double>(per_tile * p);
        const int64_t read = 32 * per_tile * p;
        OpCost a = backward ? AttentionBackwardCost(own, t, t, hq, kv_dim, d, 2)
                            : AttentionForwardCost(own, t, t, hq, kv_dim, d);
        a.shape.merged = true;
        // The pages some tile selects, expected over random selections (as the fit assumes).
        const int64_t union_pages = std::llround(
            pages * (1.0 - std::pow(1.0 - static_cast<double>(per_tile) / pages, 32.0)));
        const OpCost b = backward ? AttentionBackwardCost(paged, t, read, hq, kv_dim, d, 2, true, p,
                                                          per_tile, union_pages)
                                  : AttentionForwardCost(paged, t, read, hq, kv_dim, d, true, p,
                                                         per_tile, union_pages);
        s.seconds = truth.Seconds(a, phase) + truth.Seconds(b, phase) - 3.0e-6;
        out.rows.push_back(s);
      }
    }
  }
  // LoRA adapters of a fused linear: rows m tokens, n outputs, k input, heads projections,
  // head_dim rank.
  for (const int64_t t : {1024, 4096}) {
    for (const int64_t r : {16, 64}) {
      const LoraAdapters lora{r, 3};
      CalibrationSample s = Row("lora_fwd");
      s.m = t, s.n = 6144, s.k = 4096, s.heads = 3, s.head_dim = r, s.grad_bytes = 2;
      add(s, LoraForwardCost(t, 6144, 4096, lora));
      s.op = "lora_bwd_input";
      add(s, LoraBackwardInputCost(t, 6144, 4096, lora));
      s.op = "lora_bwd_weight";
      add(s, LoraBackwardWeightCost(t, 6144, 4096, lora, 2));
    }
  }
  // Power: a GEMM sustained under the limit at 0.7 of the maximum clock, and with idle gaps at
  // higher clocks, drawing idle + (fraction of time busy) x 1500 W x clock^2.2.
  out.header["max_sm_clock_mhz"] = "1980";
  out.header["power_limit_w"] = "700";
  CalibrationSample idle = Row("power_idle");
  idle.sm_clock_mhz = 1980;
  idle.watts = 100;
  out.rows.push_back(idle);
  const OpCost gemm = LinearForwardCost(4096, 28672, 4096);
  const double gemm_seconds = truth.Seconds(gemm, Phase::kFill);
  for (const auto& [x, gap_us] :
       {std::pair<double, int64_t>{0.7, 0}, {0.8, 500}, {0.9, 1500}, {1.0, 4000}}) {
    CalibrationSample s = Row(gap_us == 0 ? "power_gemm_fwd" : "power_duty_gemm_fwd");
    s.m = 4096, s.n = 28672, s.k = 4096, s.copies = gap_us;
    s.bytes = gemm.bytes, s.flops = gemm.flops;
    const double busy = gemm_seconds / x;
    s.seconds = busy + static_cast<double>(gap_us) * 1e-6;
    s.sm_clock_mhz = 1980 * x;
    s.watts = 100 + busy / s.seconds * 1500 * std::pow(x, 2.2);
    out.rows.push_back(s);
  }
  for (const bool backward : {false, true})  // attention sustained at 0.85 of the clock
    out.rows.push_back(PowerAttentionRow(truth, backward, 128, 690));
  CalibrationSample swiglu = Row("power_swiglu_fwd");
  swiglu.m = 16384, swiglu.n = 14336;
  swiglu.bytes = SwigluForwardCost(16384, 14336).bytes;
  swiglu.seconds = truth.Seconds(SwigluForwardCost(16384, 14336), Phase::kFill);
  swiglu.sm_clock_mhz = 1980;
  swiglu.watts = 600;
  out.rows.push_back(swiglu);
  for (const int64_t t : {1024, 16384}) {  // the per-tile cost: chunk sizes apart
    CalibrationSample score = Row("page_score");
    score.m = t, score.heads = 28, score.kv_heads = 4, score.head_dim = 128, score.pages = 512;
    add(score, PageScoreCost(t, 128, 512, 3584, 512));
  }
  for (const int64_t pages : {512, 2048, 8192}) {
    CalibrationSample score = Row("page_score");
    score.m = 4096, score.heads = 28, score.kv_heads = 4, score.head_dim = 128, score.pages = pages;
    add(score, PageScoreCost(4096, 128, pages, 3584, 512));
    CalibrationSample topk = Row("page_topk");
    topk.m = 32, topk.pages = pages, topk.pages_per_tile = 65;
    add(topk, PageTopKCost(32, pages, std::min<int64_t>(pages, 65)));
  }
  return out;
}

TEST(Calibration, FitRecoversTheProfileThatMadeTheSamples) {
  const GpuSpec gpu = LoadGpu("h200");
  const CalibrationFit fit = FitCalibration(MakeSamples(gpu), gpu, "synthetic.csv");
  const KernelProfile truth = TruthProfile();
  const KernelProfile& k = fit.gpu.kernels;
  EXPECT_EQ(k.provenance, Provenance::kMeasured);
  EXPECT_EQ(k.gpu_name, "Test GPU");
  EXPECT_NEAR(k.launch_us, truth.launch_us, 1e-9);
  EXPECT_EQ(k.gemm_tile_rows, truth.gemm_tile_rows);
  EXPECT_EQ(k.gemm_tile_cols, truth.gemm_tile_cols);
  EXPECT_NEAR(k.gemm_tflops / truth.gemm_tflops, 1.0, 0.01);
  EXPECT_EQ(k.gemm_split_max, truth.gemm_split_max);
  EXPECT_NEAR(k.gemm_wave_us, truth.gemm_wave_us, 1e-9);
  EXPECT_EQ(k.gemm_accumulate_tile_rows, truth.gemm_accumulate_tile_rows);
  EXPECT_EQ(k.gemm_accumulate_tile_cols, truth.gemm_accumulate_tile_cols);
  EXPECT_NEAR(k.gemm_accumulate_wave_us_per_byte, truth.gemm_accumulate_wave_us_per_byte, 1e-9);
  EXPECT_NEAR(k.gemm_accumulate_tflops / truth.gemm_accumulate_tflops, 1.0, 0.01);
  EXPECT_NEAR(k.attention_fwd_item_us, truth.attention_fwd_item_us, 1e-9);
  EXPECT_NEAR(k.attention_bwd_item_us, truth.attention_bwd_item_us, 1e-9);
  EXPECT_NEAR(k.attention_bwd_own_item_us, truth.attention_bwd_own_item_us, 1e-9);
  EXPECT_NEAR(k.loss_efficiency / truth.loss_efficiency, 1.0, 0.01);
  EXPECT_NEAR(k.loss_ns_per_logit / truth.loss_ns_per_logit, 1.0, 0.01);
  EXPECT_NEAR(k.attention_fwd_tflops_d128 / truth.attention_fwd_tflops_d128, 1.0, 0.01);
  EXPECT_NEAR(k.attention_bwd_tflops_d64 / truth.attention_bwd_tflops_d64, 1.0, 0.01);
  for (const int64_t p : {32, 64, 96}) {
    EXPECT_NEAR(k.page_fwd_efficiency.at(p) / truth.page_fwd_efficiency.at(p), 1.0, 0.02) << p;
    EXPECT_NEAR(k.page_bwd_efficiency.at(p) / truth.page_bwd_efficiency.at(p), 1.0, 0.02) << p;
  }
  for (const int64_t p : {64, 128}) {
    EXPECT_NEAR(k.sparse_fwd_page_efficiency.at(p) / truth.sparse_fwd_page_efficiency.at(p), 1.0,
                0.02)
        << p;
    EXPECT_NEAR(k.sparse_bwd_page_efficiency.at(p) / truth.sparse_bwd_page_efficiency.at(p), 1.0,
                0.02)
        << p;
  }
  EXPECT_NEAR(k.memory_efficiency / truth.memory_efficiency, 1.0, 0.01);
  // A kernel with samples at several sizes is fitted apart where that explains them better;
  // here the common pair made them, so any pair of its own is the common one again.
  ASSERT_TRUE(k.memory_kernel_fixed_us.contains("rmsnorm_fwd"));  // with its warm rate
  EXPECT_NEAR(k.memory_kernel_fixed_us.at("rmsnorm_fwd"), truth.launch_us, 0.051);
  EXPECT_NEAR(k.memory_kernel_efficiency.at("rmsnorm_fwd") / truth.memory_efficiency, 1.0, 0.01);
  // The warm rows' rate, in the L2 the header gives.
  EXPECT_DOUBLE_EQ(k.l2_cache_mib, 50);
  ASSERT_TRUE(k.memory_kernel_warm_efficiency.contains("rmsnorm_fwd"));
  EXPECT_NEAR(k.memory_kernel_warm_fixed_us.at("rmsnorm_fwd"), 1.2, 0.051);
  EXPECT_NEAR(k.memory_kernel_warm_efficiency.at("rmsnorm_fwd") /
                  truth.memory_kernel_warm_efficiency.at("rmsnorm_fwd"),
              1.0, 0.02);
  EXPECT_NEAR(k.page_score_ns_per_tile_element, truth.page_score_ns_per_tile_element, 0.021);
  EXPECT_NEAR(k.copy_call_us / truth.copy_call_us, 1.0, 0.05);
  EXPECT_NEAR(k.weights_init_gparams, 0.25, 1e-9);
  EXPECT_NEAR(k.page_topk_ns_per_page / truth.page_topk_ns_per_page, 1.0, 0.02);
  EXPECT_NEAR(k.lora_efficiency / truth.lora_efficiency, 1.0, 0.02);
  EXPECT_NEAR(fit.duty_cycle_power_exponent, 2.2, 0.01);
  EXPECT_NEAR(k.idle_w, 100, 1e-9);
  // The synthetic sustained rows ran exactly at 1 / NVML's clock.
  EXPECT_GE(k.nvml_clock_speed_error, 0);
  EXPECT_LT(k.nvml_clock_speed_error, 0.01);
  for (const FitResidual& r : fit.residuals)
    EXPECT_LT(r.max_error, 0.05) << r.group << " " << r.worst;
  // The profile written is one the catalogue loader reads back as it was.
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / "ctxplan-calibration-test.yaml";
  {
    std::ofstream out(path);
    out << GpuProfileYaml(fit.gpu);
  }
  const GpuSpec loaded = LoadGpu(path.string());
  std::filesystem::remove(path);
  EXPECT_EQ(loaded.kernels.provenance, Provenance::kMeasured);
  EXPECT_NEAR(loaded.kernels.gemm_tflops / k.gemm_tflops, 1.0, 1e-5);
  EXPECT_NEAR(loaded.kernels.page_bwd_efficiency.at(96) / k.page_bwd_efficiency.at(96), 1.0, 1e-3);
  EXPECT_NEAR(loaded.kernels.lora_efficiency / k.lora_efficiency, 1.0, 1e-3);
  EXPECT_NEAR(loaded.kernels.nvml_clock_speed_error, k.nvml_clock_speed_error, 1e-6);
  EXPECT_EQ(loaded.kernels.memory_kernel_fixed_us, k.memory_kernel_fixed_us);
  EXPECT_NEAR(loaded.kernels.page_score_ns_per_tile_element, k.page_score_ns_per_tile_element,
              1e-9);
  EXPECT_EQ(loaded.bf16_gemm_tflops.provenance, Provenance::kMeasured);
}

// The true profile with gathered page-sparse backward blocks: 12 us a block, 20 at head dim 64;
// the sparse rows of these GQA groups, two at each head dim.
KernelProfile GatheredTruth() {
  KernelProfile truth = TruthProfile();
  truth.sparse_bwd_gathered = true;
  truth.attention_bwd_gathered_item_us = 12.0;
  truth.attention_bwd_gathered_item_us_d64 = 20.0;
  return truth;
}
const std::vector<SparseHeads> kTwoGroups = {{28, 4, 128}, {32, 8, 128}, {32, 8, 64}, {28, 4, 64}};

// At GQA groups 1-2 the page-sparse backward runs key blocks over the union
// (AttentionBackwardOverUnion): their block cost is fitted on those rows alone, the gathered
// blocks' on the others; the groups' rows time gathered blocks where the profile has no union
// cost, and move with it where it has one.
TEST(Calibration, UnionBlockCostAtGroupsOneAndTwo) {
  const GpuSpec gpu = LoadGpu("h200");
  KernelProfile truth = GatheredTruth();
  truth.attention_bwd_union_block_us = 30.0;
  truth.sparse_bwd_union_efficiency = 0.8;
  std::vector<SparseHeads> heads = kTwoGroups;
  heads.push_back({16, 16, 64});
  heads.push_back({16, 16, 128});
  const CalibrationSamples samples = MakeSamples(gpu, truth, heads);
  const KernelProfile k = FitCalibration(samples, gpu, "s.csv").gpu.kernels;
  EXPECT_NEAR(k.attention_bwd_union_block_us, 30.0, 0.51);
  EXPECT_NEAR(k.sparse_bwd_union_efficiency, 0.8, 0.01);
  EXPECT_NEAR(k.attention_bwd_gathered_item_us, 12.0, 0.51);
  EXPECT_NEAR(k.attention_bwd_gathered_item_us_d64, 20.0, 0.51);
  // Without rows at those groups: no union cost, and their time is the gathered blocks'.
  const KernelProfile none =
      FitCalibration(MakeSamples(gpu, truth, kTwoGroups), gpu, "s.csv").gpu.kernels;
  EXPECT_EQ(none.attention_bwd_union_block_us, 0.0);
  const MachineSpec machine = MakeMachine(gpu, int64_t{128} << 30);
  auto paged_seconds = [&](const KernelProfile& profile, int64_t hq, int64_t hkv) {
    const OpCost b = AttentionBackwardCost(4096.0 * 65 * 128, 4096, 32 * 65 * 128, hq, hkv * 64, 64,
                                           2, true, 128, 65, 300);
    return KernelTimeModel(machine, profile).Seconds(b, Phase::kBackward);
  };
  KernelProfile cheaper = truth;
  cheaper.attention_bwd_union_block_us = 10.0;
  EXPECT_LT(paged_seconds(cheaper, 16, 16), paged_seconds(truth, 16, 16));
  EXPECT_EQ(paged_seconds(cheaper, 32, 8), paged_seconds(truth, 32, 8));  // group 4: gathered
  // Group 1 with a union cost ignores the gathered blocks' cost; without one it takes it.
  KernelProfile other_gathered = truth;
  other_gathered.attention_bwd_gathered_item_us_d64 = 5.0;
  EXPECT_EQ(paged_seconds(other_gathered, 16, 16), paged_seconds(truth, 16, 16));
  KernelProfile gathered_only = truth, other_gathered_only = other_gathered;
  gathered_only.attention_bwd_union_block_us = 0.0;
  other_gathered_only.attention_bwd_union_block_us = 0.0;
  EXPECT_GT(paged_seconds(gathered_only, 16, 16), paged_seconds(other_gathered_only, 16, 16));
}

// At group 1 the union's pages of 64 run in 64-key blocks (UnionKeyBlocksOf): their own block cost
// and per-pair rate, head dim 64's rate apart, fitted on those rows after the 128-key blocks'
// (which keep theirs); a profile without them times those blocks as 128-key ones.
TEST(Calibration, UnionSixtyFourKeyBlocksAtGroupOne) {
  const GpuSpec gpu = LoadGpu("h200");
  KernelProfile truth = GatheredTruth();
  truth.attention_bwd_union_block_us = 30.0;
  truth.sparse_bwd_union_efficiency = 0.8;
  truth.attention_bwd_union64_block_us = 8.0;
  truth.sparse_bwd_union64_efficiency = 0.6;
  truth.sparse_bwd_union64_efficiency_d64 = 0.75;
  std::vector<SparseHeads> heads = kTwoGroups;
  heads.push_back({16, 16, 64});
  heads.push_back({16, 16, 128});
  const KernelProfile k = FitCalibration(MakeSamples(gpu, truth, heads), gpu, "s.csv").gpu.kernels;
  EXPECT_NEAR(k.attention_bwd_union_block_us, 30.0, 0.51);
  EXPECT_NEAR(k.sparse_bwd_union_efficiency, 0.8, 0.01);
  EXPECT_NEAR(k.attention_bwd_union64_block_us, 8.0, 0.51);
  EXPECT_NEAR(k.sparse_bwd_union64_efficiency, 0.6, 0.01);
  EXPECT_NEAR(k.sparse_bwd_union64_efficiency_d64, 0.75, 0.01);
  const MachineSpec machine = MakeMachine(gpu, int64_t{128} << 30);
  auto p64_seconds = [&](const KernelProfile& profile) {
    const OpCost b = AttentionBackwardCost(4096.0 * 65 * 64, 4096, 32 * 65 * 64, 16, 16 * 64, 64, 2,
                                           true, 64, 65, 900);
    return KernelTimeModel(machine, profile).Seconds(b, Phase::kBackward);
  };
  KernelProfile as_128 = truth;
  as_128.attention_bwd_union64_block_us = 0.0;
  as_128.sparse_bwd_union64_efficiency = 1.0;
  // 30 us a block where they cost 8 (at 0.8 / 0.6 the rate): the blocks' cost tells.
  EXPECT_GT(p64_seconds(as_128), 1.2 * p64_seconds(truth));
}

// A gathered page-sparse backward block's fixed cost is told apart from the per-pair rate where
// the sparse rows hold two GQA groups (items a block: 2 x group), at each head dim apart: head dim
// 64's is fitted on its own where its rows hold two groups, and left to the shared one else.
TEST(Calibration, GatheredBlockCostOfEachHeadDim) {
  const GpuSpec gpu = LoadGpu("h200");
  const KernelProfile truth = GatheredTruth();
  const KernelProfile k =
      FitCalibration(MakeSamples(gpu, truth, kTwoGroups), gpu, "s.csv").gpu.kernels;
  EXPECT_TRUE(k.sparse_bwd_gathered);
  EXPECT_NEAR(k.attention_bwd_gathered_item_us, 12.0, 0.51);
  EXPECT_NEAR(k.attention_bwd_gathered_item_us_d64, 20.0, 0.51);
  // Head dim 64 at one group (the grids before 2026-11-28): the shared cost alone.
  const std::vector<SparseHeads> one_group = {{28, 4, 128}, {32, 8, 128}, {32, 8, 64}};
  const KernelProfile one =
      FitCalibration(MakeSamples(gpu, truth, one_group), gpu, "s.csv").gpu.kernels;
  EXPECT_EQ(one.attention_bwd_gathered_item_us_d64, 0.0);
  EXPECT_GT(one.attention_bwd_gathered_item_us, 0.0);
}

// The power group's attention rows at head dim 64 give its own watts; the head dim 128 rows keep
// theirs, and a group of one head dim gives one value for both (the d64 entries 0).
TEST(Calibration, PowerGroupFitsHeadDim64AttentionApart) {
  const GpuSpec gpu = LoadGpu("h200");
  CalibrationSamples samples = MakeSamples(gpu);
  const KernelProfile one = FitCalibration(samples, gpu, "s.csv").gpu.kernels;
  EXPECT_EQ(one.attention_fwd_w_d64, 0.0);
  EXPECT_EQ(one.attention_bwd_w_d64, 0.0);
  ASSERT_GT(one.attention_fwd_w, 0.0);
  const KernelTimeModel truth = TruthModel(gpu, TruthProfile());
  for (const bool backward : {false, true})  // as the head dim 128 rows, 0.6 the watts above idle
    samples.rows.push_back(PowerAttentionRow(truth, backward, 64, 100 + 0.6 * (690 - 100)));
  const KernelProfile apart = FitCalibration(samples, gpu, "s.csv").gpu.kernels;
  EXPECT_NEAR(apart.attention_fwd_w, one.attention_fwd_w, 1e-6);
  EXPECT_NEAR(apart.attention_bwd_w, one.attention_bwd_w, 1e-6);
  for (const bool backward : {false, true}) {
    // Watts at the full rate: 0.6 of head dim 128's, over the two head dims' efficiencies.
    const double ratio = apart.attention_w(backward, true) / apart.attention_w(backward, false);
    EXPECT_GT(ratio, 0.4) << backward;
    EXPECT_LT(ratio, 0.75) << backward;
  }
}

// The catalogue's calibrated profiles are what `ctxplan calibrate` fits from the samples committed
// beside them (models/gpu/calibration/): refitting reproduces every kernel-model value.
TEST(Calibration, CommittedProfilesAreTheFitOfTheirSamples) {
  for (const std::string name : {"h200", "h100-sxm"}) {
    SCOPED_TRACE(name);
    const GpuSpec committed = LoadGpu(name);
    const CalibrationFit fit =
        FitCalibration(ReadCalibrationSamples(std::string(CTXPLAN_SOURCE_DIR) +
                                              "/models/gpu/calibration/" + name + "-samples.csv"),
                       committed, name + "-samples.csv");
    const KernelProfile& a = committed.kernels;
    const KernelProfile& b = fit.gpu.kernels;
    ASSERT_EQ(a.provenance, Provenance::kMeasured);
    EXPECT_EQ(a.gpu_name, b.gpu_name);
    auto near = [](double x, double y) {
      return std::abs(x - y) <= 1e-4 * std::max(1.0, std::abs(y));
    };
    // Page tables are written to 4 significant digits: within half their last digit.
    auto near_table = [](double x, double y) { return std::abs(x - y) <= 5e-4 * std::abs(y); };
    EXPECT_TRUE(near(a.gemm_tflops, b.gemm_tflops)) << a.gemm_tflops << " " << b.gemm_tflops;
    EXPECT_EQ(a.gemm_tile_cols, b.gemm_tile_cols);
    // The samples say which backward they timed (own_bwd: split): the yaml carries it.
    EXPECT_TRUE(a.own_bwd_split);
    EXPECT_EQ(a.own_bwd_split, b.own_bwd_split);
    EXPECT_EQ(a.gemm_split_max, b.gemm_split_max);
    EXPECT_TRUE(near(a.gemm_accumulate_tflops, b.gemm_accumulate_tflops));
    EXPECT_TRUE(near(a.attention_bwd_tflops_d64, b.attention_bwd_tflops_d64));
    EXPECT_TRUE(near(a.attention_bwd_item_us, b.attention_bwd_item_us));
    EXPECT_TRUE(near(a.attention_bwd_own_item_us, b.attention_bwd_own_item_us));
    EXPECT_TRUE(
        near(a.attention_fwd_rows128_efficiency_d64, b.attention_fwd_rows128_efficiency_d64));
    EXPECT_EQ(a.attention_fwd_slices_d64, b.attention_fwd_slices_d64);
    EXPECT_TRUE(near_table(a.page_fwd_efficiency.at(96), b.page_fwd_efficiency.at(96)))
        << a.page_fwd_efficiency.at(96) << " " << b.page_fwd_efficiency.at(96);
    EXPECT_TRUE(near(a.sparse_bwd_efficiency, b.sparse_bwd_efficiency));
    EXPECT_TRUE(
        near_table(a.sparse_bwd_page_efficiency.at(64), b.sparse_bwd_page_efficiency.at(64)));
    EXPECT_TRUE(near(a.page_topk_fixed_us, b.page_topk_fixed_us));
    EXPECT_TRUE(near(a.host_adamw_gparams, b.host_adamw_gparams));
    EXPECT_TRUE(near(a.gemm_w, b.gemm_w)) << a.gemm_w << " " << b.gemm_w;
    EXPECT_TRUE(near(a.power_limit_w, b.power_limit_w));
    EXPECT_TRUE(near(a.nvml_clock_speed_error, b.nvml_clock_speed_error));
    EXPECT_TRUE(near(a.lora_efficiency, b.lora_efficiency));
    EXPECT_TRUE(near_table(a.page_fwd_efficiency_d64.at(96), b.page_fwd_efficiency_d64.at(96)));
    EXPECT_TRUE(near(committed.host_h2d_gbs.value, fit.gpu.host_h2d_gbs.value));
    EXPECT_TRUE(near(a.page_score_ns_per_tile_element, b.page_score_ns_per_tile_element));
    ASSERT_EQ(a.memory_kernel_fixed_us.size(), b.memory_kernel_fixed_us.size());
    for (const auto& [kernel, fixed] : a.memory_kernel_fixed_us) {
      EXPECT_TRUE(near(fixed, b.memory_kernel_fixed_us.at(kernel))) << kernel;
      EXPECT_TRUE(
          near(a.memory_kernel_efficiency.at(kernel), b.memory_kernel_efficiency.at(kernel)))
          << kernel;
    }
  }
  // NVML's clock reading is the kernels' speed on the H200 (the matrix test compares the
  // predicted clock with it there), not on the H100; unknown for a profile scaled from another GPU.
  EXPECT_LT(LoadGpu("h200").kernels.nvml_clock_speed_error, 0.05);
  EXPECT_GT(LoadGpu("h100-sxm").kernels.nvml_clock_speed_error, 0.05);
  EXPECT_LT(LoadGpu("h100-sxm-estimate").kernels.nvml_clock_speed_error, 0);
}

// A profile's memory-bound kernel tables name known kernels, each fixed cost with its fraction.
TEST(Calibration, BadMemoryKernelTablesNameTheKey) {
  std::string yaml;
  {
    std::ifstream in(std::string(CTXPLAN_SOURCE_DIR) + "/models/gpu/h200.yaml");
    std::ostringstream text;
    text << in.rdbuf();
    yaml = text.str();
  }
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / "ctxplan-bad-memory-kernels.yaml";
  auto expect_error = [&](const std::string& from, const std::string& to,
                          const std::vector<std::string>& needles) {
    std::string text = yaml;
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    {
      std::ofstream out(path);
      out << text;
    }
    try {
      LoadGpu(path.string());
      ADD_FAILURE() << "accepted " << to;
    } catch (const InputError& e) {
      for (const std::string& needle : needles)
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error("memory_kernel_fixed_us: {adamw:", "memory_kernel_fixed_us: {warp_drive: 1, adamw:",
               {"memory_kernel_fixed_us.warp_drive", "not a memory-bound kernel", "rmsnorm_fwd"});
  expect_error("memory_kernel_efficiency: {adamw:", "memory_kernel_efficiency: {adamw: -1, x:",
               {"memory_kernel_efficiency"});
  expect_error("memory_kernel_efficiency: {adamw: ", "memory_kernel_efficiency: {zzz_adamw: ",
               {"memory_kernel_efficiency"});
  std::filesystem::remove(path);
}

// The machine keys from the links rows measured on the lent 4x H100 host: the sums of the
// rows with all four GPUs, as models/machine/h100-x4.yaml holds them; nothing from a GPU's own
// samples (no links rows).
TEST(Calibration, HostLinkSumsAreTheRowsOfEveryGpu) {
  const HostLinkSums links = FitHostLinkSums(ReadCalibrationSamples(
      std::string(CTXPLAN_SOURCE_DIR) + "/models/machine/calibration/h100-x4-links.csv"));
  EXPECT_EQ(links.gpus, 4);
  const MachineSpec machine = LoadMachine("h100-x4");
  EXPECT_NEAR(links.h2d_gbs, machine.host_links_h2d_gbs, 0.05);
  EXPECT_NEAR(links.d2h_gbs, machine.host_links_d2h_gbs, 0.05);
  EXPECT_EQ(FitHostLinkSums(ReadCalibrationSamples(std::string(CTXPLAN_SOURCE_DIR) +
                                                   "/models/gpu/calibration/h200-samples.csv"))
                .gpus,
            0);
}

// The read-back's three terms come back from rows a known host would give (+-3% noise); a term
// the rows say nothing for (no dependence on the earlier pages) is dropped, never negative.
TEST(Calibration, SelectionReadBackRecoversItsTerms) {
  auto rows = [](double fixed_us, double ns_per_entry, double ns_per_page) {
    CalibrationSamples samples;
    std::mt19937 rng(11);
    std::uniform_real_distribution<double> noise(0.97, 1.03);
    for (const int64_t tiles : {8, 32, 128})
      for (const int64_t per_tile : {17, 65, 257})
        for (const int64_t pages : {1024, 8192, 32768}) {
          CalibrationSample s = Row("selection_read_back");
          s.m = tiles, s.pages_per_tile = per_tile, s.pages = pages;
          s.seconds =
              (fixed_us * 1e-6 + ns_per_entry * 1e-9 * static_cast<double>(tiles * per_tile) +
               ns_per_page * 1e-9 * static_cast<double>(pages)) *
              noise(rng);
          samples.rows.push_back(s);
        }
    return samples;
  };
  const SelectionReadBackFit fit = FitSelectionReadBack(rows(45.0, 9.0, 0.4));
  EXPECT_EQ(fit.samples, 27);
  EXPECT_NEAR(fit.fixed_us, 45.0, 3.0);
  EXPECT_NEAR(fit.ns_per_entry, 9.0, 0.5);
  EXPECT_NEAR(fit.ns_per_page, 0.4, 0.05);
  EXPECT_LT(fit.max_error, 0.06);

  const SelectionReadBackFit no_pages = FitSelectionReadBack(rows(60.0, 12.0, 0.0));
  EXPECT_GE(no_pages.ns_per_page, 0.0);
  EXPECT_LT(no_pages.ns_per_page, 0.02);
  EXPECT_NEAR(no_pages.ns_per_entry, 12.0, 0.6);
  EXPECT_NEAR(no_pages.fixed_us, 60.0, 4.0);

  CalibrationSamples none;
  none.rows.push_back(Row("page_topk"));
  EXPECT_EQ(FitSelectionReadBack(none).samples, 0);
}

TEST(Calibration, BadSamplesNameTheFileAndLine) {
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / "ctxplan-bad-samples.csv";
  auto expect_error = [&](const std::string& text, const std::string& needle) {
    {
      std::ofstream out(path);
      out << text;
    }
    try {
      ReadCalibrationSamples(path);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::string header =
      "op,m,n,k,heads,kv_heads,head_dim,page_tokens,pages,pages_per_tile,grad_bytes,bytes,flops,"
      "copies,seconds\n";
  expect_error("# gpu_name: x\n", "no header line");
  expect_error("op,m\n", ":1: unexpected header");
  expect_error(header + "launch,0,0\n", ":2: 3 fields");
  expect_error(header + "launch,0,0,0,0,0,0,0,0,0,0,0,0,0,abc\n", ":2: field 15 abc");
  expect_error(header + "launch,-1,0,0,0,0,0,0,0,0,0,0,0,0,1e-6\n", ":2: field 2 -1");
  std::filesystem::remove(path);
  EXPECT_THROW(ReadCalibrationSamples(path), InputError);
}

}  // namespace
}  // namespace ctxplan::sim
