#include "ctxplan/kernels/cost.h"

#include <algorithm>

#include "ctxplan/models/gpu_spec.h"

namespace ctxplan {

namespace {
OpCost Memory(MemoryKernel kernel, double bytes, double flops = 0.0) {
  OpCost cost{flops, bytes, RateClass::kMemoryBound, {}};
  cost.shape.memory_kernel = kernel;
  return cost;
}
double D(int64_t v) {
  return static_cast<double>(v);
}
}  // namespace

std::string_view MemoryKernelName(MemoryKernel kernel) {
  static_assert(kMemoryKernelNames.size() + 1 == static_cast<size_t>(MemoryKernel::kCount_));
  if (kernel == MemoryKernel::kOther || kernel == MemoryKernel::kCount_) return "";
  return kMemoryKernelNames[static_cast<size_t>(kernel) - 1];
}

static KernelShape GemmShape(int64_t rows, int64_t cols, int64_t depth) {
  KernelShape s;
  s.rows = rows;
  s.cols = cols;
  s.depth = depth;
  return s;
}

// [rows x depth] * [depth x cols] -> [rows x cols], bf16 in and out.
static OpCost GemmCost(int64_t rows, int64_t cols, int64_t depth) {
  return {2.0 * D(rows) * D(cols) * D(depth),
          D(rows * depth + depth * cols + rows * cols) * kBf16Bytes, RateClass::kGemm,
          GemmShape(rows, cols, depth)};
}

// The adapters of an op, all projections: thin GEMMs timed by their traffic (lora_bytes).
static OpCost AdapterCost(double flops, double bytes, double lora_bytes, int32_t launches) {
  OpCost cost{flops, bytes, RateClass::kGemm, {}};
  cost.shape.lora_bytes = lora_bytes;
  cost.shape.launches = launches;
  return cost;
}

// Per projection u = x A^T reads x [m x k]; y += u B^T reads and writes its output columns.
OpCost LoraForwardCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora) {
  if (lora.rank <= 0) return {};
  const double p = lora.projections, r = D(lora.rank);
  return AdapterCost(2.0 * D(m) * r * D(n + k), D(lora.rank * (n + k)) * kBf16Bytes,
                     (p * D(m) * D(k) + 2.0 * D(m) * D(n) + 2.0 * p * D(m) * r) * kBf16Bytes,
                     2 * lora.projections);
}

// dX [m x k] of dY [m x n]: per projection du = dY B reads its dY columns, dX += du A reads and
// writes all of dX.
OpCost LoraBackwardInputCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora) {
  if (lora.rank <= 0) return {};
  const double p = lora.projections, r = D(lora.rank);
  return AdapterCost(2.0 * D(m) * r * D(n + k), D(lora.rank * (n + k)) * kBf16Bytes,
                     (D(m) * D(n) + 2.0 * p * D(m) * D(k) + 2.0 * p * D(m) * r) * kBf16Bytes,
                     2 * lora.projections);
}

// Per projection du = dY B and u = x A^T again, then dA += du^T x and dB += dY^T u: x [m x k]
// read twice, its dY columns twice; thin outputs summed over the m tokens (split-K).
OpCost LoraBackwardWeightCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora,
                              int64_t grad_bytes) {
  if (lora.rank <= 0) return {};
  const double p = lora.projections, r = D(lora.rank);
  OpCost cost =
      AdapterCost(4.0 * D(m) * r * D(n + k), 2.0 * r * D(n + k) * D(grad_bytes),
                  (2.0 * p * D(m) * D(k) + 2.0 * D(m) * D(n) + 4.0 * p * D(m) * r) * kBf16Bytes,
                  4 * lora.projections);
  cost.shape.accumulates = true;
  return cost;
}

namespace {
// The base GEMM's cost with its adapters' run after it.
OpCost WithAdapters(OpCost base, const OpCost& adapters) {
  if (adapters.rate == RateClass::kNone) return base;
  base.flops += adapters.flops;
  base.bytes += adapters.bytes;
  base.shape.lora_bytes += adapters.shape.lora_bytes;
  base.shape.launches += adapters.shape.launches;
  return base;
}
}  // namespace

OpCost LinearForwardCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora, bool split_outputs) {
  OpCost cost = WithAdapters(GemmCost(m, n, k), LoraForwardCost(m, n, k, lora));
  if (split_outputs) {
    cost.shape.side_bytes += 2.0 * D(m * n) * kBf16Bytes;
    cost.shape.launches += 3;
  }
  return cost;
}

OpCost LinearBackwardInputCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora,
                               bool join_inputs) {
  // The same GEMM as the forward with the roles of n and k swapped.
  OpCost cost = WithAdapters(GemmCost(m, k, n), LoraBackwardInputCost(m, n, k, lora));
  if (join_inputs) {
    cost.shape.side_bytes += 2.0 * D(m * n) * kBf16Bytes;
    cost.shape.launches += 3;
  }
  return cost;
}

OpCost LinearBackwardWeightCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora,
                                int64_t grad_bytes) {
  // Under LoRA the base is frozen: the adapters' gradients alone.
  if (lora.rank > 0) return LoraBackwardWeightCost(m, n, k, lora, grad_bytes);
  double flops = 2.0 * D(m) * D(n) * D(k);
  double bytes = D(m * k + m * n) * kBf16Bytes + 2.0 * D(k * n) * D(grad_bytes);
  KernelShape shape = GemmShape(n, k, m);  // dW [n x k], summed over the m tokens
  shape.accumulates = true;
  shape.out_bytes = static_cast<int32_t>(grad_bytes);
  return {flops, bytes, RateClass::kGemm, shape};
}

OpCost EmbeddingForwardCost(int64_t tokens, int64_t hidden) {
  return Memory(MemoryKernel::kEmbeddingForward, 2.0 * D(tokens * hidden) * kBf16Bytes);
}
OpCost EmbeddingBackwardCost(int64_t tokens, int64_t hidden, int64_t grad_bytes) {
  return Memory(MemoryKernel::kOther, D(tokens * hidden) * (kBf16Bytes + 2.0 * D(grad_bytes)));
}
OpCost RmsNormForwardCost(int64_t tokens, int64_t hidden) {
  // Reads x and the residual, writes the sum and the normalised output.
  return Memory(MemoryKernel::kRmsNormForward, 4.0 * D(tokens * hidden) * kBf16Bytes,
                6.0 * D(tokens * hidden));
}
OpCost RmsNormBackwardCost(int64_t tokens, int64_t hidden) {
  // Reads x, dy and the residual's gradient, writes dx.
  return Memory(MemoryKernel::kRmsNormBackward, 4.0 * D(tokens * hidden) * kBf16Bytes,
                8.0 * D(tokens * hidden));
}
OpCost RopeCost(int64_t tokens, int64_t q_dim, int64_t kv_dim) {
  OpCost cost = Memory(MemoryKernel::kRope, 2.0 * D(tokens * (q_dim + kv_dim)) * kBf16Bytes,
                       3.0 * D(tokens * (q_dim + kv_dim)));
  cost.shape.launches = 2;  // the queries, then the keys
  return cost;
}
OpCost KvWriteCost(int64_t tokens, int64_t kv_dim) {
  return Memory(MemoryKernel::kKvWrite, 2.0 * 2.0 * D(tokens * kv_dim) * kBf16Bytes);
}
OpCost PageSummaryCost(int64_t pages, int64_t page_tokens, int64_t kv_dim) {
  return Memory(MemoryKernel::kOther, D(pages) * D(page_tokens * kv_dim + kv_dim) * kBf16Bytes,
                D(pages) * D(page_tokens * kv_dim));
}
OpCost PageScoreCost(int64_t q_tokens, int64_t query_tile, int64_t pages, int64_t q_dim,
                     int64_t kv_dim) {
  int64_t tiles = (q_tokens + query_tile - 1) / query_tile;
  double flops = 2.0 * D(q_tokens) * D(pages) * D(q_dim);
  double bytes = D(q_tokens * q_dim + pages * kv_dim) * kBf16Bytes + D(tiles * pages) * kFp32Bytes;
  OpCost cost{flops, bytes, RateClass::kPageScore, {}};
  cost.shape.rows = tiles;
  cost.shape.cols = pages;
  cost.shape.depth = kv_dim;  // a tile's summed query, which every score block loads
  cost.shape.launches = 2;    // the query tiles' sums, then the scores
  return cost;
}
OpCost PageTopKCost(int64_t tiles, int64_t pages, int64_t pages_per_tile) {
  OpCost cost{
      D(tiles * pages) * 4.0, D(tiles * pages) * kFp32Bytes * 2.0, RateClass::kPageTopK, {}};
  cost.shape.rows = tiles;
  cost.shape.cols = pages;
  cost.shape.tile_pages = pages_per_tile;
  return cost;
}
static KernelShape AttentionLaunchShape(int64_t q_tokens, int64_t num_heads, int64_t kv_dim,
                                        int64_t head_dim, int64_t page_tokens, int64_t tile_pages,
                                        int64_t key_pages) {
  KernelShape s;
  s.rows = q_tokens;
  s.heads = static_cast<int32_t>(num_heads);
  s.kv_heads = static_cast<int32_t>(kv_dim / head_dim);
  s.head_dim = static_cast<int32_t>(head_dim);
  s.page_tokens = static_cast<int32_t>(page_tokens);
  s.tile_pages = tile_pages;
  s.key_pages = key_pages > 0 ? key_pages : tile_pages;
  return s;
}

OpCost AttentionForwardCost(double pairs, int64_t q_tokens, int64_t kv_tokens_read,
                            int64_t num_heads, int64_t kv_dim, int64_t head_dim, bool page_sparse,
                            int64_t page_tokens, int64_t tile_pages, int64_t key_pages) {
  double flops = 4.0 * pairs * D(num_heads) * D(head_dim);
  double bytes = 2.0 * D(q_tokens * num_heads * head_dim) * kBf16Bytes +  // Q in, O out
                 2.0 * D(kv_tokens_read * kv_dim) * kBf16Bytes +          // K, V
                 D(q_tokens * num_heads) * kFp32Bytes;                    // log-sum-exp
  return {flops, bytes,
          page_sparse ? RateClass::kSparseAttentionForward : RateClass::kAttentionForward,
          AttentionLaunchShape(q_tokens, num_heads, kv_dim, head_dim, page_tokens, tile_pages,
                               key_pages)};
}
OpCost AttentionBackwardCost(double pairs, int64_t q_tokens, int64_t kv_tokens_read,
                             int64_t num_heads, int64_t kv_dim, int64_t head_dim,
                             int64_t grad_bytes, bool page_sparse, int64_t page_tokens,
                             int64_t tile_pages, int64_t key_pages) {
  // S = QK^T recomputed, then dV, dP, dQ, dK: five GEMM-shaped products against forward's two.
  double flops = 10.0 * pairs * D(num_heads) * D(head_dim);
  double bytes = 4.0 * D(q_tokens * num_heads * head_dim) * kBf16Bytes +   // Q, O, dO in; dQ out
                 2.0 * D(kv_tokens_read * kv_dim) * kBf16Bytes +           // K, V
                 2.0 * 2.0 * D(kv_tokens_read * kv_dim) * D(grad_bytes) +  // dK, dV RMW
                 D(q_tokens * num_heads) * kFp32Bytes;
  KernelShape shape = AttentionLaunchShape(q_tokens, num_heads, kv_dim, head_dim, page_tokens,
                                           tile_pages, key_pages);
  shape.out_bytes = static_cast<int32_t>(grad_bytes);
  return {flops, bytes,
          page_sparse ? RateClass::kSparseAttentionBackward : RateClass::kAttentionBackward, shape};
}
OpCost DkvAccumulateCost(int64_t tokens, int64_t kv_dim, int64_t grad_bytes) {
  return Memory(MemoryKernel::kDkvAccumulate, 3.0 * 2.0 * D(tokens * kv_dim) * D(grad_bytes),
                2.0 * D(tokens * kv_dim));
}
OpCost SwigluForwardCost(int64_t tokens, int64_t intermediate) {
  return Memory(MemoryKernel::kSwigluForward, 3.0 * D(tokens * intermediate) * kBf16Bytes,
                6.0 * D(tokens * intermediate));
}
OpCost SwigluBackwardCost(int64_t tokens, int64_t intermediate) {
  return Memory(MemoryKernel::kSwigluBackward, 5.0 * D(tokens * intermediate) * kBf16Bytes,
                12.0 * D(tokens * intermediate));
}
OpCost LossForwardBackwardCost(int64_t tokens, int64_t hidden, int64_t vocab, bool head_trainable,
                               int64_t grad_bytes) {
  double gemms = head_trainable ? 4.0 : 3.0;
  double flops = gemms * 2.0 * D(tokens) * D(vocab) * D(hidden);
  double bytes = 2.0 * D(vocab * hidden) * kBf16Bytes + 2.0 * D(tokens * hidden) * kBf16Bytes +
                 (head_trainable ? 2.0 * D(vocab * hidden) * D(grad_bytes) : 0.0);
  KernelShape shape = GemmShape(tokens, vocab, hidden);
  shape.out_bytes = static_cast<int32_t>(grad_bytes);
  shape.vocab_tile = std::min(kLossVocabTile, vocab);
  return {flops, bytes, RateClass::kFusedLoss, shape};
}
OpCost ZeroFillCost(int64_t bytes) {
  return Memory(MemoryKernel::kZeroFill, D(bytes));
}
OpCost AdamWCost(int64_t params, int64_t param_bytes, int64_t grad_bytes, bool on_host) {
  // Reads parameter, gradient and both fp32 moments; writes parameter and moments.
  double bytes = D(params) * (2.0 * D(param_bytes) + D(grad_bytes) + 4.0 * kFp32Bytes);
  OpCost cost{
      12.0 * D(params), bytes, on_host ? RateClass::kHostCompute : RateClass::kMemoryBound, {}};
  if (!on_host) cost.shape.memory_kernel = MemoryKernel::kAdamW;
  return cost;
}
OpCost BoundaryCopyCost(int64_t bytes) {
  return Memory(MemoryKernel::kOther, 2.0 * D(bytes));  // read and write
}
OpCost PeerCost(int64_t bytes) {
  return {0.0, D(bytes), RateClass::kPeer, {}};
}
OpCost CopyCost(int64_t bytes, bool host_to_device, int64_t copies) {
  OpCost cost{
      0.0, D(bytes), host_to_device ? RateClass::kHostToDevice : RateClass::kDeviceToHost, {}};
  cost.shape.launches = static_cast<int32_t>(copies);
  return cost;
}

bool AttentionBackwardSplitsOwnHeads(int64_t tokens, int64_t heads, int64_t kv_heads,
                                     int64_t head_dim, bool own_only) {
  // The blocks resident together at one KV head's own blocks walk the group's heads at every
  // query tile, touching all of the group's queries: past the L2 a quarter of their reads went
  // to DRAM (H200, 16K causal, 28 / 4 heads: L2 hit 72%, DRAM 26% busy; 28 / 28 heads 97% and 2%,
  // kernels/PERF.md), which at the power limit costs ~4% of the clock. 32 MiB: below the H100's
  // 50 MB of L2 and the H200's 60; groups of 2 (28 / 14 heads) kept their hit rate unsplit.
  // A launch of own positions only (a sequence's first chunk) from 4096 tokens on besides: its
  // own blocks are the whole launch, one wave of very unequal blocks (block i sees t / 64 - 2i
  // query tiles) that the split evens out: 1.45x at 4096 tokens, 1.30x at 8192 (H100, 28 / 4
  // heads, kernels/PERF.md); over earlier pages it does not pay below the L2 budget.
  // At head dim 64 (H200, 32 / 8 heads, own positions only) the split ran 1.23x at 4096 tokens,
  // 1.11x at 8192 and 0.98-0.99x at 16384-65536, the L2 rule's lengths included: it splits a
  // first chunk under 16384 tokens only.
  constexpr int64_t kL2Budget = int64_t{32} << 20;
  constexpr int64_t kOwnOnlyTokens = 4096;
  constexpr int64_t kOwnOnlyTokensEndD64 = 16384;
  const int64_t group = kv_heads > 0 ? heads / kv_heads : 1;
  if (group < 3) return false;
  if (head_dim == 64) return own_only && tokens >= kOwnOnlyTokens && tokens < kOwnOnlyTokensEndD64;
  return head_dim == 128 &&
         (tokens * group * head_dim * 8 > kL2Budget || (own_only && tokens >= kOwnOnlyTokens));
}

bool AttentionBackwardOverUnion(int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                int64_t page_tokens, bool dkv_f32) {
  // Measured on the H200 (kernels/PERF.md, 2026-11-28: the union's blocks' time over the gathered
  // ones', 6144 random earlier tokens a 128-query tile of ~61K). Pages of whole 128-key blocks:
  // group 1 at head_dim 64 0.51-0.77 at every chunk; group 1 at head_dim 128 0.54-0.76 from
  // chunks of 4096 (3072: 0.91-0.95); group 2 at head_dim 64 0.78-0.82 from 3072 (1024:
  // 0.93-1.01); group 2 at head_dim 128 0.80-0.82 at 16384 (4096: 0.91-0.93). Other pages, group 1
  // only (at group 2 0.92-1.06): head_dim 64 where the union's blocks are at least three quarters
  // full (48 and 64 in 64-key blocks 0.59-0.80, 96 in 128-key blocks 0.72-0.73, 192 in 64-key
  // halves 0.60), head_dim 128 pages of 64 from chunks of 4096 (0.84-0.88; 3072: 0.98). Those
  // on an fp32 dKV pool; on a bf16 one (the runtime's) the gathered blocks' bf16 atomics cost
  // more, and at group 1 head_dim 128 the union won at every chunk too (1024: 0.74-0.85 at
  // pages 64-256; 3072: 0.51-0.79 at pages 48-256 but 32), at group 2 over whole 128-key pages at
  // every chunk (head_dim 128 1024: 0.93-0.96, 3072-4096: 0.69-0.75; head_dim 64 1024:
  // 0.91-0.98), at group 2 head_dim 64 over pages of 64 from 3072 (64-key blocks 0.88-0.95;
  // 1024: 0.99-1.01) and 192 (halves, 0.91-0.92 at 3072; 48 and 96: 1.01-1.17), and at group 2
  // head_dim 128 over pages of 96 and 192 (128-key blocks three quarters full: 0.88-0.97 at
  // 3072-12288; 64: 0.97-1.14). From group 3 on the gathered blocks win. Chunks up to 16384 tokens,
  // as measured (the 128-key blocks' selection lists fit in shared memory to ~24K at query tiles of
  // 128).
  constexpr int64_t kMaxTokens = 16384;
  if (kv_heads <= 0 || heads % kv_heads != 0 || page_tokens <= 0 || tokens > kMaxTokens)
    return false;
  const int64_t group = heads / kv_heads;
  if (page_tokens % 128 == 0) {
    if (group == 1) return head_dim == 64 || tokens >= 4096 || !dkv_f32;
    if (group == 2) return !dkv_f32 || tokens >= (head_dim == 64 ? 3072 : 16384);
    return false;
  }
  if (group == 2) {
    if (dkv_f32) return false;
    if (head_dim == 64) return (page_tokens == 64 && tokens >= 3072) || page_tokens == 192;
    const UnionKeyBlocks cut = UnionKeyBlocksOf(page_tokens, head_dim);
    return cut.keys == 128 && cut.fill >= 0.75;
  }
  if (group != 1) return false;
  if (head_dim == 64 || !dkv_f32) return UnionKeyBlocksOf(page_tokens, head_dim).fill >= 0.75;
  return page_tokens == 64 && tokens >= 4096;
}

UnionKeyBlocks UnionKeyBlocksOf(int64_t page_tokens, int64_t head_dim) {
  if (page_tokens <= 0) return {};
  if (page_tokens % 128 == 0) return {128, static_cast<double>(page_tokens / 128), 1.0};
  if (head_dim == 64 && page_tokens > 64 && page_tokens % 64 == 0)
    return {128, static_cast<double>(page_tokens) / 128.0, 1.0};  // halves
  const int64_t keys = page_tokens <= 64 ? 64 : 128;
  const int64_t per_page = (page_tokens + keys - 1) / keys;
  return {keys, static_cast<double>(per_page),
          static_cast<double>(page_tokens) / static_cast<double>(per_page * keys)};
}

int64_t AttentionForwardQueryRows(int64_t tokens, int64_t heads, int64_t head_dim, bool selected,
                                  int64_t sm_count) {
  // At head_dim 64 a tile's exponentials keep the MUFU units as busy as its GEMMs keep the tensor
  // cores, and two consumers' S -> softmax -> S chains left the pipes idle: three ran 1.20x at
  // chunks of 3072 over earlier pages and 1.16x at 16K-64K causal (H200, 32 / 8 heads,
  // kernels/PERF.md). Their blocks are 1.5x longer, so a launch of few waves loses to its last
  // wave: 0.81x at 1024 tokens (192 blocks of 192 rows, two waves of 132, where 256 of 128 rows
  // also take two). 192 rows where waves(192) * 1.5 / 1.2 <= waves(128).
  constexpr int64_t kRows = 128, kRowsD64 = 192;
  if (head_dim != 64 || selected || tokens <= 0 || heads <= 0 || sm_count <= 0) return kRows;
  auto waves = [&](int64_t rows) {
    const int64_t blocks = (tokens + rows - 1) / rows * heads;
    return (blocks + sm_count - 1) / sm_count;
  };
  return waves(kRowsD64) * 5 <= waves(kRows) * 4 ? kRowsD64 : kRows;
}

bool AttentionForwardSlices(int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            bool selected, int64_t sm_count) {
  // Three consumers over slices ran 1.06-1.24x one head's 128 queries on two wherever the launch
  // had 2.9 waves of slice blocks or more, and 0.80-0.85x at 1.5 (chunk 1024, 32 / 8 heads: 192
  // blocks on 132 multiprocessors, where 256 of 128 queries take two waves too; H100 and H200,
  // kernels/PERF.md).
  if (head_dim != 64 || !selected || tokens <= 0 || kv_heads <= 0 || heads % kv_heads != 0 ||
      sm_count <= 0)
    return false;
  const int64_t tiles = (tokens + 127) / 128;
  const int64_t blocks = tiles * kv_heads * ForwardSliceBlocks(static_cast<int>(heads / kv_heads));
  return blocks >= 2 * sm_count;
}

}  // namespace ctxplan
