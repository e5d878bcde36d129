#include "ctxplan/sim/kernel_changes.h"

#include <algorithm>

namespace ctxplan::sim {

namespace {

bool Touches(const KernelChange& change, int64_t page_tokens, int64_t head_dim) {
  auto in = [](const std::vector<int64_t>& list, int64_t x) {
    return list.empty() || std::find(list.begin(), list.end(), x) != list.end();
  };
  return in(change.pages, page_tokens) && in(change.head_dims, head_dim);
}

}  // namespace

const std::vector<KernelChange>& KernelChanges() {
  static const std::vector<KernelChange> changes = {
      {"2026-11-26",
       "the attention forward over pages of 32, 48, 96 and 192 came to walk them with a page "
       "cursor (2.1-2.4x faster on an H100) and the page-sparse backward's key blocks over "
       "pages of 48, 96 and 192 to end at their page",
       {32, 48, 96, 192},
       {}},
      {"2026-11-26T18:30Z",
       "the attention forward came to load every multiple of 16 as groups of 16 rows whose "
       "pages are read a tile ahead (pages of 32, 48, 96 and 192 at 0.97-1.07 of page 128's "
       "rate on an H100, 1.5-1.8x the page cursor)",
       {16, 32, 48, 80, 96, 112, 144, 160, 176, 192, 208, 224, 240},
       {}},
      {"2026-11-26T18:45Z",
       "the head_dim 64 attention backward came to run on warpgroup MMAs in 64-key blocks "
       "(1.13-1.16x dense, 1.7-2.5x page-sparse over pages of 32 to 64, on an H100)",
       {},
       {64}},
      {"2026-11-26T19:05Z",
       "the attention backward's 64-key blocks came to add dQ four columns an atomic "
       "(1.03-1.12x on an H100) at head dim 64",
       {},
       {64}},
      {"2026-11-27T06:15Z",
       "the attention backward came to add dQ by bulk reduces and to order its items for the L2 "
       "(head dim 128: 1.20-1.23x over every earlier page, 1.08-1.10x page-sparse, on an H200 "
       "and an H100)",
       {},
       {128}},
      {"2026-11-27T08:36Z",
       "the attention kernels' exponentials came to flush results under 2^-126 to zero (one "
       "instruction where there were four; 64K causal on an H200: forward 1.05x, backward "
       "1.03-1.05x)",
       {},
       {}},
      {"2026-11-27T08:37Z",
       "the page-sparse attention backward over pages that are not whole 128-key blocks came to "
       "gather each query tile's selected positions into blocks (pages of 32 to 96 and 192 at "
       "0.96-1.09 of page 128's rate on an H200, 1.3-2.2x the key blocks before)",
       {16, 32, 48, 64, 80, 96, 112, 144, 160, 176, 192, 208, 224, 240},
       {}},
      {"2026-11-27T08:52Z",
       "the attention backward came to start every KV head's blocks over the chunk's own "
       "positions before any block over earlier pages (the heaviest own blocks of the last KV "
       "heads had started last)",
       {},
       {}},
      {"2026-11-27T09:12Z",
       "the page-sparse attention backward came to gather at every page size (pages of 128 and "
       "256 at 1.10-1.26x the key blocks over the union's pages, on an H100)",
       {128, 256, 384, 512},
       {}},
      {"2026-11-27T14:10Z",
       "the attention kernels came to load by TMA: the forward's queries, own keys and pages of "
       "a multiple of 32, the backward's query operands (64K causal on an H200: forward "
       "1.06x, backward 1.03x; forward over pages 1.02-1.09x)",
       {},
       {}},
      {"2026-11-27T16:20Z",
       "the attention kernels came to build their wgmma descriptors once a tile, the backward at "
       "head dim 128 to take an item's whole dQ in one warpgroup and, for chunks whose GQA group "
       "of queries outgrows the L2, its own key blocks one a query head (64K causal on an H200: "
       "backward 1.03-1.04x, forward 1.00-1.01x)",
       {},
       {}},
      {"2026-11-27T19:15Z",
       "the attention backward came to run its items without a block barrier (the two "
       "warpgroups meeting only where one needs the other's dS or buffer; gathered page-sparse "
       "blocks keep it) and a first chunk's own-only launch from 4096 tokens to split its key "
       "blocks one a query head (64K causal: backward 1.03x on an H200, 1.01-1.02x on an H100; "
       "a first chunk of 4096 tokens 1.44x)",
       {},
       {128}},
      {"2026-11-27T21:12Z",
       "the attention backward at head dim 64 came to run dense chunks in 128-key blocks of two "
       "warpgroups with an item's whole dQ in one of them (sweep: dense 1.21x on an H200, "
       "page-sparse 1.13x) and a first chunk of 4096-16383 tokens to split its key blocks one a "
       "query head (1.23x at 4096, 1.11x at 8192)",
       {},
       {64}},
      {"2026-11-27T23:20Z",
       "the attention backward at head dim 64 came to issue the owner's dQ of one item under the "
       "next item's S and dP (dense 1.09x on an H100's sweep, 64K causal 1.10x)",
       {},
       {64}},
      {"2026-11-27T23:50Z",
       "the attention forward at head dim 64 came to run three consumer warpgroups on blocks of "
       "192 queries without a page selection, where they fill the waves (sweep on an H200: dense "
       "1.12x, 1.20x at chunks of 3072; 16K-64K causal 1.16x)",
       {},
       {64}},
      {"2026-11-28T02:25Z",
       "the attention backward's dense key blocks came to run beside a producer warpgroup that "
       "loads their operands and adds their dQ, and to wait for their key block's copies (H100: "
       "64K causal 1.03-1.05x, the sweep's dense rows 1.07x at head dim 128, 1.09x at 64)",
       {},
       {}},
      {"2026-11-28T04:45Z",
       "the attention backward's gathered page-sparse blocks (and a page-sparse launch's own "
       "positions) came to run beside the producer warpgroup too, without their item barrier "
       "(the sweep's page-sparse rows 1.03x on both GPUs at both head dims)",
       {},
       {}},
      {"2026-11-28T07:30Z",
       "the attention forward came to take query-head slices on three consumers for page-sparse "
       "head dim 64 where their blocks fill two waves (1.06-1.24x there), and to rescale O only "
       "where a row's max moves past 2^8 (1.00-1.015x)",
       {},
       {}},
      {"2026-11-29T08:45Z",
       "the attention backward at head dim 64 came to hold each warpgroup's keys and values in "
       "registers for S and dP (64K causal on an H200 1.03x; the sweep's dense rows 1.04x, "
       "page-sparse 1.03x)",
       {},
       {64}},
  };
  return changes;
}

std::vector<KernelChange> ChangesAfterProfile(const KernelProfile& profile, int64_t page_tokens,
                                              int64_t head_dim) {
  std::vector<KernelChange> out;
  if (profile.date.empty()) return out;
  for (const KernelChange& change : KernelChanges())
    if (change.date > profile.date && Touches(change, page_tokens, head_dim)) out.push_back(change);
  return out;
}

std::vector<KernelChange> ChangesBetween(const KernelProfile& profile, std::string_view run_date,
                                         int64_t page_tokens, int64_t head_dim) {
  std::vector<KernelChange> out;
  if (profile.date.empty() || run_date.empty()) return out;
  // A trace's time has seconds (2026-11-27T06:15:30Z); the changes' have minutes.
  const std::string run = run_date.size() > 17 && run_date[16] == ':'
                              ? std::string(run_date.substr(0, 16)) + "Z"
                              : std::string(run_date);
  const std::string_view profile_date = profile.date;
  const auto [early, late] = std::minmax(profile_date, std::string_view(run));
  for (const KernelChange& change : KernelChanges())
    if (Touches(change, page_tokens, head_dim) && change.date > early && change.date <= late)
      out.push_back(change);
  return out;
}

bool RunAndProfileKernelsDiffer(const KernelProfile& profile, std::string_view run_date,
                                int64_t page_tokens, int64_t head_dim) {
  return !ChangesBetween(profile, run_date, page_tokens, head_dim).empty();
}

}  // namespace ctxplan::sim
