#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "calibration_internal.h"
#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::sim::detail {

namespace {

// An item's fixed cost: up to 40 us (the backward's own launches, timed heaviest first, fit 28 us
// on the H200 and 32 on the H100).
constexpr double kAttentionItemUsMax = 40.0, kAttentionItemUsStep = 0.5;
constexpr double kGatheredItemUsMax = 48.0;
constexpr double kUnionBlockUsMax = 120.0;

}  // namespace

// Per direction: the item cost that, with a rate per head dim, explains the launches over the
// chunk's own positions best; then each page size's fraction (dense launches over pages,
// their own part included as the kernel runs it); then the sparse fraction.
void FitAttention(const FitContext& c) {
  const CalibrationSamples& samples = c.samples;
  GpuSpec& gpu = c.gpu;
  KernelProfile& k = c.k;
  k.page_fwd_efficiency.clear();
  k.page_bwd_efficiency.clear();
  k.page_fwd_efficiency_d64.clear();
  k.page_bwd_efficiency_d64.clear();
  k.sparse_fwd_efficiency = k.sparse_bwd_efficiency = 1.0;
  k.sparse_fwd_page_efficiency.clear();
  k.sparse_bwd_page_efficiency.clear();
  k.sparse_fwd_page_efficiency_d64.clear();
  k.sparse_bwd_page_efficiency_d64.clear();
  for (const bool backward : {false, true}) {
    const std::string op = backward ? "attention_bwd" : "attention_fwd";
    auto own_rows = [&](int64_t head_dim) {
      auto rows = Select(samples, [&](const CalibrationSample& s) {
        return s.op == op && s.pages == 0 && s.head_dim == head_dim;
      });
      Require(rows, op + " (own positions, d_h " + std::to_string(head_dim) + ")");
      return rows;
    };
    const auto own128 = own_rows(128), own64 = own_rows(64);
    auto rate = [backward](KernelProfile& p, bool d64) -> double& {
      return backward ? (d64 ? p.attention_bwd_tflops_d64 : p.attention_bwd_tflops_d128)
                      : (d64 ? p.attention_fwd_tflops_d64 : p.attention_fwd_tflops_d128);
    };
    auto fit_own = [&] {
      Candidate best;
      for (const double item : Grid(kAttentionItemUsMax, kAttentionItemUsStep)) {
        KernelProfile trial = k;
        (backward ? trial.attention_bwd_own_item_us : trial.attention_fwd_item_us) = item;
        for (const bool d64 : {false, true})
          rate(trial, d64) = ImpliedMedian(
              gpu, trial, [&](KernelProfile& p, double x) { rate(p, d64) = x; },
              d64 ? own64 : own128, 1, 1e5);
        best.Consider(trial, Score(gpu, trial, own128) + Score(gpu, trial, own64));
      }
      k = best.profile;
    };
    fit_own();
    if (!backward && k.attention_fwd_rows128_efficiency_d64 > 0) {
      // The d_h 64 rate is the 192-row blocks' (the rule gives most own launches 192 rows): the
      // launches it leaves at 128 rows imply their fraction, then the rate and item cost refit.
      std::vector<const CalibrationSample*> rows128;
      for (const CalibrationSample* s : own64)
        if (AttentionForwardQueryRows(s->m, s->heads, 64, false, gpu.sm_count) == 128)
          rows128.push_back(s);
      if (!rows128.empty()) {
        k.attention_fwd_rows128_efficiency_d64 = ImpliedMedian(
            gpu, k, [](KernelProfile& p, double x) { p.attention_fwd_rows128_efficiency_d64 = x; },
            rows128, 0.3, 2.0);
        fit_own();
      }
    }

    // One page table: each page size's fraction, the implied median of its rows with the other
    // sizes held (each starting at `start`). False when no row is of this head dim.
    auto fit_page_table = [&](bool d64, bool sparse,
                              const std::vector<const CalibrationSample*>& rows, double start) {
      std::map<int64_t, std::vector<const CalibrationSample*>> by_page;
      for (const CalibrationSample* s : rows)
        if ((s->head_dim <= 64) == d64) by_page[s->page_tokens].push_back(s);
      for (const auto& [p, page_rows] : by_page) k.page_table(backward, d64, sparse)[p] = start;
      for (const auto& [p, page_rows] : by_page) {
        const int64_t page = p;
        k.page_table(backward, d64, sparse)[p] = ImpliedMedian(
            gpu, k,
            [=](KernelProfile& q, double x) { q.page_table(backward, d64, sparse)[page] = x; },
            page_rows, 0.02, 2.0);
      }
      return !by_page.empty();
    };
    // Head dim 64 runs its own kernel path over pages: its own table where it has samples.
    const auto dense = Select(samples, [&](const CalibrationSample& s) {
      return s.op == op && s.pages > 0 && s.pages_per_tile == 0;
    });
    auto fit_dense = [&] {
      for (const bool d64 : {false, true})
        if (!fit_page_table(d64, false, dense, 1.0) && !d64)
          throw InputError("calibration samples have no dense paged " + op + " rows");
    };
    // A fixed cost: the grid value whose fit (the rest implied by `fit`) explains `rows` best.
    auto fit_fixed_cost = [&](double KernelProfile::*cost, double max, const auto& fit,
                              const std::vector<const CalibrationSample*>& rows) {
      const KernelProfile before = k;
      Candidate best;
      for (const double us : Grid(max, kAttentionItemUsStep)) {
        k = before;
        k.*cost = us;
        fit();
        best.Consider(k, Score(gpu, k, rows));
      }
      k = best.profile;
    };
    if (backward) {
      // The backward's items over pages: their own fixed cost, with the page tables that explain
      // the dense paged rows (its own launches fitted theirs above).
      fit_fixed_cost(&KernelProfile::attention_bwd_item_us, kAttentionItemUsMax, fit_dense, dense);
    } else {
      fit_dense();
    }
    // Page-sparse rows; those at GQA groups 1-2 whose backward takes key blocks over the union
    // (AttentionBackwardOverUnion) fit the union's block cost alone, below.
    auto page_sparse = [&](const CalibrationSample& s) {
      return s.op == op && s.pages > 0 && s.pages_per_tile > 0 && s.pages_per_tile < s.pages;
    };
    auto by_union = [](const CalibrationSample& s) {
      return AttentionBackwardOverUnion(s.m, s.heads, s.kv_heads, s.head_dim, s.page_tokens,
                                        /*dkv_f32=*/s.grad_bytes == 4);
    };
    const auto sparse =
        Select(samples, [&](const CalibrationSample& s) { return page_sparse(s) && !by_union(s); });
    Require(sparse, op + " sparse");
    // The sparse fraction overall, then per page size where a size has its own sparse rows; per
    // head dim, head dim 64 having its own backward blocks (its table only where it has rows).
    auto fit_sparse = [&] {
      (backward ? k.sparse_bwd_efficiency : k.sparse_fwd_efficiency) = ImpliedMedian(
          gpu, k,
          [backward](KernelProfile& q, double x) {
            (backward ? q.sparse_bwd_efficiency : q.sparse_fwd_efficiency) = x;
          },
          sparse, 0.02, 2.0);
      const double overall = backward ? k.sparse_bwd_efficiency : k.sparse_fwd_efficiency;
      for (const bool d64 : {false, true}) fit_page_table(d64, true, sparse, overall);
    };
    // GQA groups among the backward's sparse rows at a head dim: two tell a gathered block's
    // fixed cost apart from the per-pair rate (samples before c15c0e7's grid hold one at head dim
    // 128, before 2026-11-28's one at head dim 64).
    auto groups_at = [&](int64_t head_dim) {
      std::set<int64_t> groups;
      if (backward && k.sparse_bwd_gathered)
        for (const CalibrationSample* s : sparse)
          if (s->head_dim == head_dim && s->kv_heads > 0) groups.insert(s->heads / s->kv_heads);
      return groups.size();
    };
    if (groups_at(128) >= 2) {
      // Gathered blocks: their own fixed cost, with the fractions that explain the sparse rows.
      fit_fixed_cost(&KernelProfile::attention_bwd_gathered_item_us, kGatheredItemUsMax, fit_sparse,
                     sparse);
    } else {
      fit_sparse();
    }
    if (groups_at(64) >= 2) {
      // Then head dim 64's own, the fractions refitted with each candidate (their overall median
      // is both head dims': judged on every sparse row).
      fit_fixed_cost(&KernelProfile::attention_bwd_gathered_item_us_d64, kGatheredItemUsMax,
                     fit_sparse, sparse);
    }
    // The union's rows by its blocks (UnionKeyBlocksOf): whole 128-key pages fit the block cost
    // and per-pair rate; 64-key blocks (pages of 48 and 64) their own rate after; part-full
    // blocks (96) and halves (192) are timed from these, not fitted.
    auto union_keys = [](const CalibrationSample& s) {
      return s.page_tokens % 128 == 0                                 ? int64_t{128}
             : UnionKeyBlocksOf(s.page_tokens, s.head_dim).keys == 64 ? int64_t{64}
                                                                      : int64_t{0};
    };
    // A union block size's rows: their block cost, and with each candidate the per-pair rate
    // that explains them (against the dense backward's; the 64-key blocks' against the 128-key
    // ones'), with rate_d64 head dim 64's apart where the rows hold both (each from its own).
    auto fit_union_blocks = [&](int64_t keys, double KernelProfile::*cost,
                                double KernelProfile::*rate, double KernelProfile::*rate_d64) {
      const auto rows = Select(samples, [&](const CalibrationSample& s) {
        return page_sparse(s) && by_union(s) && union_keys(s) == keys;
      });
      if (rows.empty()) return false;
      std::vector<const CalibrationSample*> at[2];  // [d64]
      for (const CalibrationSample* s : rows) at[s->head_dim <= 64].push_back(s);
      const bool apart = rate_d64 != nullptr && !at[0].empty() && !at[1].empty();
      auto implied = [&](double KernelProfile::*member,
                         const std::vector<const CalibrationSample*>& of) {
        k.*member = ImpliedMedian(
            gpu, k, [member](KernelProfile& q, double x) { q.*member = x; }, of, 0.3, 2.0);
      };
      fit_fixed_cost(
          cost, kUnionBlockUsMax,
          [&] {
            implied(rate, apart ? at[0] : rows);
            if (apart) implied(rate_d64, at[1]);
          },
          rows);
      return true;
    };
    if (backward && fit_union_blocks(128, &KernelProfile::attention_bwd_union_block_us,
                                     &KernelProfile::sparse_bwd_union_efficiency, nullptr)) {
      fit_union_blocks(64, &KernelProfile::attention_bwd_union64_block_us,
                       &KernelProfile::sparse_bwd_union64_efficiency,
                       &KernelProfile::sparse_bwd_union64_efficiency_d64);
    }
  }
  c.Measured(gpu.attention_fwd_tflops, k.attention_fwd_tflops_d128,
             "ctxtrain's attention forward, d_h 128, a full wave of items");
  c.Measured(gpu.attention_bwd_tflops, k.attention_bwd_tflops_d128,
             "ctxtrain's attention backward, d_h 128, a full wave of items");
}

}  // namespace ctxplan::sim::detail
