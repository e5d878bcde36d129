// Cost descriptors: FLOPs and HBM bytes (read + write) of each op from its shapes. The planner's
// kernel-time model turns them into time; the benchmarks of the real kernels report achieved
// rates against the same numbers, so a descriptor is the contract between kernel and simulator.
//
// Conventions: storage is bf16 (2 bytes) unless a byte width is passed; FLOPs count a
// multiply-add as 2; "pairs" is the number of (query, key) position pairs attended, summed over
// queries, for one head.
#pragma once

#include <cstdint>
#include <string_view>

namespace ctxplan {

// Which achieved rate bounds an op: the planner has a measured or estimated rate for each.
enum class RateClass : uint8_t {
  kGemm,                     // tensor-core matrix multiply (cuBLASLt)
  kFusedLoss,                // the fused linear + cross-entropy: GEMM tiles with the loss between
  kAttentionForward,         // flash-class attention forward
  kSparseAttentionForward,   // attention forward over page-sparse selections of earlier pages
  kAttentionBackward,        // flash-class attention backward
  kSparseAttentionBackward,  // attention backward over page-sparse selections of earlier pages
  kMemoryBound,              // elementwise / reduction kernels: bytes over HBM bandwidth
  kPageScore,                // query tiles against page summaries: a launch floor, then bytes
  kPageTopK,                 // top-k per query tile: one block a tile walks its pages
  kHostToDevice,             // copy engine, host -> device
  kDeviceToHost,             // copy engine, device -> host
  kHostCompute,              // CPU work (optimizer on the host): bytes over host DRAM bandwidth
  kPeer,                     // GPU to GPU (NCCL send/receive): bytes over the peer link
  kNone,                     // bookkeeping, no duration
};

// Which memory-bound kernel an op runs (kOther: one the profile times by the common rate). A
// profile may time each from its own samples, a fixed cost and a rate (KernelProfile); the
// names are ctxplan-measure's sample names.
enum class MemoryKernel : uint8_t {
  kOther,
  kEmbeddingForward,
  kRmsNormForward,
  kRmsNormBackward,
  kRope,
  kKvWrite,
  kDkvAccumulate,
  kSwigluForward,
  kSwigluBackward,
  kZeroFill,
  kAdamW,
  kCount_
};
std::string_view MemoryKernelName(MemoryKernel kernel);  // "" for kOther

// The launch behind an op, as the kernel-time model needs it beyond FLOPs and bytes: a GEMM's
// output grid decides its tile and wave quantisation, an attention launch's page size, head dim
// and pages per query tile decide which kernel path runs and how full its blocks are, a page copy
// is many small copies. Fields a rate class does not use stay zero.
struct KernelShape {
  // GEMMs: the output is rows x cols, summed over depth (forward: tokens x out, in; weight
  // gradient: out x in, tokens). The fused loss: tokens x vocab, hidden.
  int64_t rows = 0, cols = 0, depth = 0;
  // Attention: the chunk's query tokens (rows), query and KV heads, head dim, the page size of
  // the keys (0: the chunk's own positions, contiguous), the pages each query tile attends and the
  // pages the launch covers (every earlier page, or the union of the tiles' selections). The
  // kernels run a chunk's own and paged parts as one launch: the own part of a chunk with earlier
  // pages is `merged` into the paged op's launch.
  int32_t heads = 0, kv_heads = 0, head_dim = 0;
  int32_t page_tokens = 0;
  int64_t tile_pages = 0;
  int64_t key_pages = 0;
  bool merged = false;
  // Page score and top-k: query tiles (rows) and candidate pages (cols); the score's summed
  // query width (depth: KV heads x head dim); the top-k's selected pages a tile (tile_pages).
  // Launches (kernels or cudaMemcpyAsync calls) the op makes: LoRA's adapter GEMMs, a page
  // copy's runs of pages. Each pays the per-launch cost.
  int32_t launches = 1;
  // Memory traffic of helper copies inside the op (the QKV projection splits its fused output
  // rows into Q, K and V), timed at the memory-bound rate on top of the GEMM.
  double side_bytes = 0.0;
  // HBM traffic of the LoRA adapters' thin GEMMs after the op's own (LoraAdapters), timed at
  // the profile's lora_efficiency of the memory-bound rate.
  double lora_bytes = 0.0;
  // Memory-bound ops: the kernel, and whether the kernel just before it on the stream wrote its
  // input (the step plan knows: RoPE after the QKV projection, the MLP's norm after the output
  // projection). Then, where the op's traffic fits the L2, its input is still there.
  MemoryKernel memory_kernel = MemoryKernel::kOther;
  bool warm_input = false;
  // A GEMM adding into its output (beta 1: weight gradients), of this many bytes an element.
  // The fused loss: its head gradient's bytes an element. The attention backward: its dKV pool's.
  bool accumulates = false;
  int32_t out_bytes = 2;
  // The fused loss: the vocabulary columns of one logits tile (its GEMMs run a tile at a time).
  int64_t vocab_tile = 0;
};

struct OpCost {
  double flops = 0.0;
  double bytes = 0.0;  // bytes moved: HBM traffic for kernels, link traffic for copies
  RateClass rate = RateClass::kNone;
  KernelShape shape;
};

// `cost` run right after the kernel that wrote its input (KernelShape::warm_input).
inline OpCost WarmInput(OpCost cost) {
  cost.shape.warm_input = true;
  return cost;
}

inline constexpr int64_t kBf16Bytes = 2;
inline constexpr int64_t kFp32Bytes = 4;
// The RMSNorm backward writes d_weight as fp32 partial rows, one per thread block, at most this
// many (kernels/src/cuda/rmsnorm.cu); the planner counts them in the workspace.
inline constexpr int64_t kRmsNormMaxPartialRows = 1024;

// The LoRA adapters on a fused linear (runtime/lora.h): rank `rank` (0: none) on each of its
// `projections` (Q, K, V: 3; gate, up: 2; O, down: 1). Each projection runs thin GEMMs to rank r
// and back (kernels/cuda/lora_gemm.h); they read the op's [tokens x in] input or [tokens x out]
// gradient again and add into its output, so they are HBM-bound launches after the base GEMM:
// the cost's lora_bytes and launches.
struct LoraAdapters {
  int64_t rank = 0;
  int32_t projections = 1;
};

// The adapters alone, as each of the three linear ops runs them after its own GEMM (all their
// projections; ctxplan-measure times them so): kGemm costs with an empty shape, their traffic in
// lora_bytes.
OpCost LoraForwardCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora);
OpCost LoraBackwardInputCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora);
OpCost LoraBackwardWeightCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora,
                              int64_t grad_bytes);

// [m x k] * [k x n] -> [m x n], plus the adapters' down and up GEMMs.
// `split_outputs`: the fused QKV projection's output rows are split into Q, K and V afterwards
// (three strided device copies, read and written once: the shape's side_bytes).
OpCost LinearForwardCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora = {},
                         bool split_outputs = false);
// dX [m x k] = dY [m x n] * W^T, plus the adapters' dX. `join_inputs`: the QKV projection's dQ,
// dK, dV are first joined into one [m x n] gradient (three strided copies).
OpCost LinearBackwardInputCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora = {},
                               bool join_inputs = false);
// dW [k x n] += X^T dY in `grad_bytes`; with adapters only their gradients (the base is frozen).
OpCost LinearBackwardWeightCost(int64_t m, int64_t n, int64_t k, LoraAdapters lora,
                                int64_t grad_bytes);

OpCost EmbeddingForwardCost(int64_t tokens, int64_t hidden);
OpCost EmbeddingBackwardCost(int64_t tokens, int64_t hidden, int64_t grad_bytes);
OpCost RmsNormForwardCost(int64_t tokens, int64_t hidden);       // with the residual add
OpCost RmsNormBackwardCost(int64_t tokens, int64_t hidden);      // with the residual's gradient
OpCost RopeCost(int64_t tokens, int64_t q_dim, int64_t kv_dim);  // forward or backward
OpCost KvWriteCost(int64_t tokens, int64_t kv_dim);
OpCost PageSummaryCost(int64_t pages, int64_t page_tokens, int64_t kv_dim);
OpCost PageScoreCost(int64_t q_tokens, int64_t query_tile, int64_t pages, int64_t q_dim,
                     int64_t kv_dim);
// pages_per_tile: the selection's entries a tile (sinks included), which the host reads back.
OpCost PageTopKCost(int64_t tiles, int64_t pages, int64_t pages_per_tile);
// `pairs`: attended (query, key) pairs per head; `kv_tokens_read`: K/V positions loaded.
// page_sparse: the pairs are those of page-sparse selections (its own rate class: each query tile
// gathers its own pages, scattered over the whole context).
// page_tokens: the keys' page size (0 for the chunk's own positions); tile_pages: the pages one
// query tile attends (the shape's tile_pages, for the kernel-time model).
OpCost AttentionForwardCost(double pairs, int64_t q_tokens, int64_t kv_tokens_read,
                            int64_t num_heads, int64_t kv_dim, int64_t head_dim,
                            bool page_sparse = false, int64_t page_tokens = 0,
                            int64_t tile_pages = 0, int64_t key_pages = 0);
// dK/dV of pages are accumulated (read-modify-write) in `grad_bytes`. page_sparse: the pairs are
// those of page-sparse selections (its own rate class: the kernel's per-key-block costs weigh
// more when each key block serves a few query tiles instead of all of them).
OpCost AttentionBackwardCost(double pairs, int64_t q_tokens, int64_t kv_tokens_read,
                             int64_t num_heads, int64_t kv_dim, int64_t head_dim,
                             int64_t grad_bytes, bool page_sparse = false, int64_t page_tokens = 0,
                             int64_t tile_pages = 0, int64_t key_pages = 0);
OpCost DkvAccumulateCost(int64_t tokens, int64_t kv_dim, int64_t grad_bytes);

// Whether the attention backward's own key blocks go one a query head instead of one a KV head
// (kernels/src/cuda/attention_bwd.cu), with GQA groups of 3 or more: at head_dim 128 where the
// group's queries (Q, dO and the dQ accumulator, tokens * group * head_dim * 8 bytes) exceed
// 32 MiB, or (own_only: a launch over the chunk's own positions alone, no earlier pages) where
// the chunk has 4096 tokens or more; at head_dim 64 an own-only launch of 4096-16383 tokens.
// Their dK/dV are then summed over the group in an fp32 accumulator of the backward's workspace
// (2 * tokens * kv_heads * head_dim * 4 bytes), and the launch has heads, not kv_heads, blocks a
// 128-query block.
bool AttentionBackwardSplitsOwnHeads(int64_t tokens, int64_t heads, int64_t kv_heads,
                                     int64_t head_dim, bool own_only);
// Whether the page-sparse attention backward runs its earlier keys as key blocks over the union
// of the query tiles' selected pages (each page's block serving every tile that selected it, its
// dK/dV added without atomics) instead of gathered blocks (one query tile's selected positions a
// block, added by atomics; kernels/src/cuda/attention_bwd.cu): at GQA groups of 1 and 2, where a
// gathered block's 2 x group items do not carry its fixed cost. `tokens`: the chunk's (up to
// 16384); `dkv_f32`: the dKV pool's type (fp32, or bf16 as the runtime's at its default grad
// dtype, whose atomics cost the gathered blocks more).
bool AttentionBackwardOverUnion(int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                int64_t page_tokens, bool dkv_f32);
// The key blocks over the union a page of `page_tokens` is cut into: 128 keys (two warpgroups)
// for whole 128-key pages and, at head_dim 64, pages of an odd number of 64-key halves (192: a
// block two halves, of one page or two, so 1.5 a page); else 64 keys (one warpgroup) for pages
// up to 64, 128 above, the page's last block cut at its end. `fill`: the part of the blocks'
// keys the pages fill (pages of 48 and 96: 0.75).
struct UnionKeyBlocks {
  int64_t keys = 0;
  double per_page = 0.0;
  double fill = 0.0;
};
UnionKeyBlocks UnionKeyBlocksOf(int64_t page_tokens, int64_t head_dim);
// Query rows a block of the attention forward takes (kernels/src/cuda/attention_fwd.cu): 192, three
// consumer warpgroups, at head_dim 64 without a page selection where the launch's blocks fill the
// multiprocessors' waves about as well as 128-row blocks would; else 128. (Over a page selection
// a block's queries must share one query tile's pages, tiles of a multiple of 128.)
int64_t AttentionForwardQueryRows(int64_t tokens, int64_t heads, int64_t head_dim, bool selected,
                                  int64_t sm_count);
// The page-sparse head_dim 64 forward on three consumers over query-head slices
// (kernels/src/cuda/attention_fwd.cu, kSlices): a 128-query tile's 2 x group slices of 64 queries
// of one KV head's query heads (slice s: head s / 2 of the group, rows 64 (s % 2) of the tile) go
// in ForwardSliceBlocks(group) blocks of two or three, the blocks of three first. Shared by the
// kernel and the time model, so both count the same blocks.
struct ForwardSliceBlock {
  int first_slice = 0, slices = 0;
};
constexpr int ForwardSliceBlocks(int group) {
  return (2 * group + 2) / 3;
}
constexpr ForwardSliceBlock ForwardSliceBlockAt(int group, int block) {
  const int threes = 2 * group - 2 * ForwardSliceBlocks(group);  // blocks of three slices
  return {2 * block + (block < threes ? block : threes), block < threes ? 3 : 2};
}
// Whether that forward takes the slices: where its slice blocks fill two waves of the
// multiprocessors or more (a block of three slices is 1.5x a 128-query block, so a launch of one
// or two waves loses to its last), at head_dim 64 over a page selection; else one head's 128
// queries a block.
bool AttentionForwardSlices(int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            bool selected, int64_t sm_count);
OpCost SwigluForwardCost(int64_t tokens, int64_t intermediate);
OpCost SwigluBackwardCost(int64_t tokens, int64_t intermediate);
// The fused loss's logits tile: kLossVocabTile vocabulary columns (fp32) a pass, so the [t][V]
// logits never exist whole (kernels/src/cuda/linear_cross_entropy.cu).
inline constexpr int64_t kLossVocabTile = 8192;
// Fused linear + cross-entropy over `tokens` positions and a `vocab` x `hidden` head, a
// kLossVocabTile tile of the vocabulary at a time: logits computed twice (LSE pass, gradient
// pass), dX, and dW accumulated.
OpCost LossForwardBackwardCost(int64_t tokens, int64_t hidden, int64_t vocab, bool head_trainable,
                               int64_t grad_bytes);
OpCost ZeroFillCost(int64_t bytes);
// AdamW over `params` with fp32 moments.
OpCost AdamWCost(int64_t params, int64_t param_bytes, int64_t grad_bytes, bool on_host);
// `copies`: the separate cudaMemcpyAsync calls it takes (runs of pages contiguous on both sides).
OpCost CopyCost(int64_t bytes, bool host_to_device, int64_t copies = 1);
// A pipeline stage boundary: `bytes` copied on the device into (out of) a peer buffer, and sent
// (received) over the link between the two stages' GPUs.
OpCost BoundaryCopyCost(int64_t bytes);
OpCost PeerCost(int64_t bytes);

}  // namespace ctxplan
