// One operation of the step plan. Small and flat: a 4M-token step has millions of them, and the
// simulator touches each once.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/op_kind.h"

namespace ctxplan {

// Op ids number the plan's ops in emission order, from 0. They are stable: the same model,
// options and plan version give the same ids, so a trace's ops line up with the prediction.
using OpId = uint64_t;
inline constexpr OpId kNoOp = ~OpId{0};

// In-order queues of work, as CUDA streams are: an op starts after the previous op of its stream
// and after its dependencies (ops of other streams). Every rank (pipeline stage, one GPU) has
// its own set. The four peer streams carry a stage's NCCL sends and receives, one per direction
// and neighbour, as each is one communicator whose calls must stay in order on both sides.
enum class Stream : uint8_t {
  kCompute,
  kH2D,
  kD2H,
  kHost,
  kSendNext,  // activations to stage r+1 (fill and recompute)
  kRecvPrev,  // activations from stage r-1
  kSendPrev,  // their gradient to stage r-1 (backward)
  kRecvNext,  // their gradient from stage r+1
  kCount_
};
inline constexpr int kStreamCount = static_cast<int>(Stream::kCount_);

enum class Phase : uint8_t {
  kSetup,      // buffers allocated before the step
  kFill,       // pass 1: forward over chunks 0..N-2, writing KV pages
  kRecompute,  // pass 2, step 1: forward of one chunk keeping layer inputs
  kLoss,       // pass 2, step 2: fused linear + cross-entropy
  kBackward,   // pass 2, step 3: backward of one chunk, layer by layer
  kOptimizer,  // after the last chunk
  kCount_
};

// Which GEMM / part of a layer an op belongs to, for traces and per-kind calibration.
enum class OpPart : uint8_t {
  kNone,
  kQkv,     // fused Q/K/V projection
  kO,       // attention output projection
  kGateUp,  // fused gate and up projections
  kDown,
  kLmHead,
  kOwn,        // attention among the chunk's own positions (causal)
  kPaged,      // attention over earlier positions held in KV pages
  kAttnNorm,   // RMSNorm before attention (fused with the residual add before it)
  kMlpNorm,    // RMSNorm before the MLP
  kFinalNorm,  // RMSNorm before the LM head
  kCount_
};

enum class MemSpace : uint8_t { kGpu, kHost };

enum class MemCategory : uint8_t {
  kWeights,
  kGrads,
  kOptimizer,
  kLayerInputs,    // per chunk in pass 2: each layer's input, attention output, LSE, page lists
  kActivations,    // one layer's activations and their gradients for c tokens; page scores
  kPageSlots,      // offload on: the bounded pool of GPU page slots
  kKvPages,        // KV pages (GPU when offload is off, host when on)
  kDkvPages,       // dKV pages, allocated on first write
  kPageSummaries,  // mean key per page, layer and KV head (GPU)
  kWorkspace,      // cuBLAS workspace, loss tiles
  kGradStaging,    // host optimizer: gradients copied to the host
  kCount_
};
inline constexpr int kMemCategoryCount = static_cast<int>(MemCategory::kCount_);

struct Op {
  static constexpr int kMaxDeps = 3;

  OpId id = kNoOp;
  OpKind kind = OpKind::kAlloc;
  Stream stream = Stream::kCompute;
  Phase phase = Phase::kSetup;
  OpPart part = OpPart::kNone;
  uint8_t num_deps = 0;
  // The pipeline stage (GPU) that runs it, 0 with one GPU. Dependencies may name ops of other
  // ranks (a receive waits for its send): a rank's backend ignores those, NCCL orders them.
  int16_t rank = 0;
  int32_t chunk = -1;                 // -1: not tied to a chunk
  int32_t layer = -1;                 // -1: not tied to a layer
  std::array<OpId, kMaxDeps> deps{};  // ops of other streams this op waits for

  // Shapes. GEMMs: m tokens, n out features, k in features. Attention: m query tokens,
  // n key/value positions read. Norms, RoPE, SwiGLU, KV write: m tokens. Copies and page ops:
  // `pages` pages of one layer. Boundary and peer ops: m tokens, `bytes` the tensor's bytes,
  // `pages` the send/receive buffer (0 or 1) it uses.
  int64_t m = 0, n = 0, k = 0;
  int64_t pages = 0;
  OpCost cost;
  // kAttentionBackward (the paged op, or the own op of a chunk with no earlier pages) whose
  // layer's kDkvAccumulate follows with the same inputs ready: a backend may add the own pages'
  // dKV as it writes dK/dV (the CUDA backend does, and leaves the kDkvAccumulate op empty; the
  // cost stays on the kDkvAccumulate op).
  bool adds_own_dkv = false;

  // kAlloc / kFree: what and how much.
  MemSpace space = MemSpace::kGpu;
  MemCategory category = MemCategory::kWorkspace;
  int64_t bytes = 0;
};

std::string_view StreamName(Stream stream);
std::string_view PhaseName(Phase phase);
std::string_view OpPartName(OpPart part);
std::string_view MemCategoryName(MemCategory category);

}  // namespace ctxplan
