// The kinds of operation a chunk-recurrent training step is made of. The step plan (runtime/)
// emits them, the CPU and CUDA backends implement them, the simulator times them.
#pragma once

#include <cstdint>
#include <string_view>

namespace ctxplan {

enum class OpKind : uint8_t {
  // --- compute kernels (compute stream) ---
  kEmbeddingForward,   // gather c rows of the embedding table
  kEmbeddingBackward,  // scatter-add c rows into the embedding gradient
  kRmsNormForward,     // fused with the residual add that precedes it
  kRmsNormBackward,
  kLinearForward,         // GEMM [tokens x in] * [in x out] (+bias), cuBLASLt
  kLinearBackwardInput,   // dX = dY * W^T
  kLinearBackwardWeight,  // dW += X^T * dY (accumulates across chunks)
  kRopeForward,
  kRopeBackward,
  kKvWrite,            // write the chunk's post-RoPE K and V into its KV pages
  kPageSummary,        // mean key per filled page, layer and KV head
  kPageScore,          // query tiles against page summaries
  kPageTopK,           // top-k pages per query tile
  kAttentionForward,   // paged attention: output and log-sum-exp
  kAttentionBackward,  // dQ, dK/dV of own positions, dK/dV added into dKV pages
  kDkvAccumulate,      // add the dKV that later chunks accumulated into own dK/dV
  kSwigluForward,
  kSwigluBackward,
  kLossForwardBackward,  // fused, tiled linear + cross-entropy, forward and backward
  kZeroFill,             // first-touch initialisation of dKV pages
  kAdamW,                // optimizer step (on the GPU, or on the host stream)
  // --- copies (copy engines) ---
  kCopyH2D,
  kCopyD2H,
  // --- memory bookkeeping (zero duration, on the stream that owns the buffer) ---
  kAlloc,
  kFree,
  // --- pipeline stages (several GPUs): the activations or their gradient at a stage boundary ---
  kBoundaryPack,    // compute stream: the boundary tensor into its send buffer (device copy)
  kBoundaryUnpack,  // compute stream: the received tensor into the stage's working buffers
  kPeerSend,        // NCCL send to the neighbouring stage, on its own stream
  kPeerRecv,        // NCCL receive from the neighbouring stage, on its own stream
  // (Appended: traces store kinds by number.)
  kCount_
};

inline constexpr int kOpKindCount = static_cast<int>(OpKind::kCount_);

std::string_view OpKindName(OpKind kind);
bool IsCompute(OpKind kind);
bool IsCopy(OpKind kind);
bool IsMemory(OpKind kind);
bool IsPeer(OpKind kind);  // kPeerSend, kPeerRecv

}  // namespace ctxplan
