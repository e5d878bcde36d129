// Groups launch, gemm, loss and memory: the empty-kernel launch cost, the linear layers'
// cuBLASLt GEMMs, the fused linear + cross-entropy, and the memory-bound kernels, each called
// through the same entry points (kernels/cuda/ops.h, gemm.h) and with the same arguments as the
// runtime's CUDA backend (runtime/src/cuda/cuda_backend.cpp).
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cuda/gemm.h"
#include "ctxplan/kernels/cuda/lora_gemm.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ctxplan/kernels/paged_kv.h"
#include "measure_common.h"
#include "measure_groups.h"

namespace ctxplan::calibrate {

namespace cu = ctxplan::kernels::cuda;
using kernels::KvPageShape;
using kernels::PagedKv;

namespace {

// --- launch ------------------------------------------------------------------------------------
constexpr int64_t kLaunchBatch = 2000;  // back-to-back launches per timed batch

// --- gemm: the grid of (tokens m) x (out n, in k) -----------------------------------------------
const std::vector<int64_t> kGemmTokens = {256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 16384};
const std::vector<int64_t> kGemmTokensQuick = {1024, 4096, 16384};
const std::vector<std::pair<int64_t, int64_t>> kGemmOutIn = {
    {2048, 2048}, {6144, 2048},  {16384, 2048}, {2048, 8192}, {4096, 4096},
    {8192, 4096}, {28672, 4096}, {4096, 14336}, {8192, 8192}, {16384, 8192}};
const std::vector<std::pair<int64_t, int64_t>> kGemmOutInQuick = {
    {4096, 4096}, {28672, 4096}, {4096, 14336}};

// --- lora: each fused linear's adapters (its projections' outputs and input) of Llama-3-8B and
// Llama-3.2-1B, over chunk tokens, at ranks 16 and 64
struct LoraPart {
  std::vector<int64_t> outs;  // each projection's outputs
  int64_t in = 0;
};
const std::vector<LoraPart> kLoraParts = {
    {{4096, 1024, 1024}, 4096}, {{4096}, 4096}, {{14336, 14336}, 4096}, {{4096}, 14336},
    {{2048, 512, 512}, 2048},   {{2048}, 2048}, {{8192, 8192}, 2048},   {{2048}, 8192}};
const std::vector<LoraPart> kLoraPartsQuick = {{{4096, 1024, 1024}, 4096}, {{14336, 14336}, 4096}};
const std::vector<int64_t> kLoraTokens = {1024, 4096, 8192};
const std::vector<int64_t> kLoraTokensQuick = {4096};
const std::vector<int64_t> kLoraRanks = {16, 64};
const std::vector<int64_t> kLoraRanksQuick = {16};

// --- loss: tokens x vocabulary x hidden (two hidden sizes part the GEMMs from the softmax) ------
const std::vector<int64_t> kLossTokens = {256, 512, 1024, 2048, 4096, 8192};
const std::vector<int64_t> kLossTokensQuick = {4096};
const std::vector<int64_t> kLossVocab = {32000, 128256, 152064};
const std::vector<int64_t> kLossVocabQuick = {152064};
const std::vector<int64_t> kLossHidden = {2048, 4096};
const std::vector<int64_t> kLossHiddenQuick = {2048, 4096};

// --- memory-bound kernels: a Llama-3-8B-like layer ----------------------------------------------
const std::vector<int64_t> kMemoryTokens = {1024, 4096, 16384};
const std::vector<int64_t> kMemoryTokensQuick = {4096};
// The warm rows ("<kernel>_warm"): each call reads what the call before it wrote, all of it
// within the L2 (RMSNorm at 1024 tokens: 33.5 MB of 50-60 MiB), as a small chunk's norm reads
// the projection's output the kernel before wrote.
const std::vector<int64_t> kWarmTokens = {256, 512, 1024};
constexpr int64_t kHidden = 4096;
constexpr int64_t kIntermediate = 14336;
constexpr int64_t kVocab = 128256;
constexpr int64_t kHeads = 32;
constexpr int64_t kKvHeads = 8;
constexpr int64_t kHeadDim = 128;
constexpr int64_t kQDim = kHeads * kHeadDim;     // 4096
constexpr int64_t kKvDim = kKvHeads * kHeadDim;  // 1024
constexpr int64_t kPageTokens = 128;             // the runtime's default page
constexpr float kEps = 1e-5f;
constexpr double kRopeTheta = 5e5;
constexpr int64_t kRopeFirstPosition = 65536;  // a chunk deep in the context
const std::vector<int64_t> kZeroFillBytes = {1 * kMiB, 16 * kMiB, 256 * kMiB};
// Idle gaps after each sustained GEMM (1.3-1.5 ms under the power limit): duty cycles of about
// 3/4, 1/2 and 1/4.
const std::vector<int64_t> kPowerDutyGapsUs = {500, 1500, 4000};
const std::vector<int64_t> kAdamWParams = {16 * kMiB, 256 * kMiB};  // 16M and 256M parameters

int64_t CeilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

// =================================================================================================
void MeasureLaunch(Session& session) {
  Progress progress("launch", 1);
  progress.Step("launch");
  Sample s;
  s.op = "launch";
  s.seconds = MedianSecondsPerCall(
      session, [&](int64_t) { LaunchEmptyKernel(session.stream); }, kLaunchBatch);
  session.Add(s);
}

// =================================================================================================
// Y [m x n] = X [m x k] W^T (LinearForward, no bias); dX [m x k] = dY [m x n] W
// (LinearBackwardInput); dW [n x k] += dY^T X (LinearBackwardWeight, beta 1) in bf16 and fp32.
namespace {

// The four GEMMs of one linear layer at tokens m, out n, in k (forward_only: the forward alone).
void MeasureGemmShape(Session& session, cu::CublasLtGemm& gemm, int64_t m, int64_t n, int64_t k,
                      bool forward_only) {
  cudaStream_t stream = session.stream;
  Rotating<bf16> x(m * k, -1, 1, 1);            // X: [m][k]
  Rotating<bf16> w(n * k, -0.05, 0.05, 2);      // W: [n][k] (Hugging Face [out][in])
  Rotating<bf16> y(m * n, -1, 1, 3);            // Y (forward output) and dY: [m][n]
  Rotating<bf16> dx(m * k, -1, 1, 4);           // dX: [m][k]
  Rotating<float> dw32(n * k, -1e-3, 1e-3, 5);  // dW fp32: [n][k], accumulated
  Rotating<bf16> dw16(n * k, -1e-3, 1e-3, 6);   // dW bf16: [n][k], accumulated
  auto row = [&](const char* op, int64_t grad_bytes, const OpCost& cost) {
    Sample s;
    s.op = op;
    s.m = m;
    s.n = n;
    s.k = k;
    s.grad_bytes = grad_bytes;
    return s.Cost(cost);
  };
  Sample fwd = row("gemm_fwd", 0, LinearForwardCost(m, n, k));
  fwd.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
    cu::LinearForward(gemm, x[i], w[i], nullptr, m, n, k, y[i], stream);
  });
  session.Add(fwd);
  if (forward_only) return;
  Sample bwd_input = row("gemm_bwd_input", 0, LinearBackwardInputCost(m, n, k));
  bwd_input.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
    cu::LinearBackwardInput(gemm, y[i], w[i], m, n, k, dx[i], stream);
  });
  session.Add(bwd_input);
  Sample bwd_w16 =
      row("gemm_bwd_weight", kBf16Bytes, LinearBackwardWeightCost(m, n, k, {}, kBf16Bytes));
  bwd_w16.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
    cu::LinearBackwardWeight(gemm, x[i], y[i], m, n, k, dw16[i], static_cast<bf16*>(nullptr),
                             stream);
  });
  session.Add(bwd_w16);
  Sample bwd_w32 =
      row("gemm_bwd_weight", kFp32Bytes, LinearBackwardWeightCost(m, n, k, {}, kFp32Bytes));
  bwd_w32.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
    cu::LinearBackwardWeight(gemm, x[i], y[i], m, n, k, dw32[i], static_cast<float*>(nullptr),
                             stream);
  });
  session.Add(bwd_w32);
}

}  // namespace

void MeasureGemm(Session& session) {
  const auto& tokens = session.quick ? kGemmTokensQuick : kGemmTokens;
  const auto& out_in = session.quick ? kGemmOutInQuick : kGemmOutIn;
  cu::CublasLtGemm gemm;  // one per stream, as the runtime has
  Progress progress("gemm", tokens.size() * out_in.size());
  for (const auto& [n, k] : out_in) {
    for (const int64_t m : tokens) {
      progress.Step(Describe("gemm", {{"m", m}, {"n", n}, {"k", k}}));
      MeasureGemmShape(session, gemm, m, n, k, false);
    }
  }
}

// =================================================================================================
// A fused linear's LoRA adapters as the CUDA backend runs them after its GEMM (lora_gemm.h), all
// its projections per call: the forward, the input gradient, the weight gradients (bf16, the
// default gradient type). Rows: m tokens, n the projections' outputs summed, k their input,
// heads the projections, head_dim the rank; bytes the traffic (the cost's lora_bytes).
void MeasureLora(Session& session) {
  const auto& parts = session.quick ? kLoraPartsQuick : kLoraParts;
  const auto& tokens_list = session.quick ? kLoraTokensQuick : kLoraTokens;
  const auto& ranks = session.quick ? kLoraRanksQuick : kLoraRanks;
  cudaStream_t stream = session.stream;
  cu::CublasLtGemm gemm;
  Progress progress("lora", parts.size() * tokens_list.size() * ranks.size());
  for (const LoraPart& part : parts) {
    int64_t n = 0;
    for (const int64_t out : part.outs) n += out;
    const int64_t k = part.in;
    const auto projections = static_cast<int32_t>(part.outs.size());
    for (const int64_t r : ranks) {
      // Each projection's A [r][in], B [out][r] and bf16 gradients, at their offsets in [n].
      std::vector<DeviceArray<bf16>> a, b, grad_a, grad_b;
      for (const int64_t out : part.outs) {
        a.push_back(RandomArray<bf16>(r * k, -0.05, 0.05, 31));
        b.push_back(RandomArray<bf16>(out * r, -0.05, 0.05, 32));
        grad_a.push_back(RandomArray<bf16>(r * k, -1e-3, 1e-3, 33));
        grad_b.push_back(RandomArray<bf16>(out * r, -1e-3, 1e-3, 34));
      }
      for (const int64_t t : tokens_list) {
        progress.Step(Describe("lora", {{"m", t}, {"n", n}, {"k", k}, {"r", r}}));
        Rotating<bf16> x(t * k, -1, 1, 35);     // x, and dx: [t][k]
        Rotating<bf16> y(t * n, -1, 1, 36);     // y, and dy: [t][n]
        Rotating<bf16> dx(t * k, -1, 1, 37);    // dx: [t][k], accumulated
        DeviceArray<bf16> u(t * r), du(t * r);  // [t][r] scratch, as the backend's
        auto projection = [&](size_t j, int64_t offset) {
          return cu::LoraProjectionGemm{t,      r,        k,          part.outs[j],
                                        offset, 1.0f / r, a[j].get(), b[j].get()};
        };
        auto each = [&](const std::function<void(const cu::LoraProjectionGemm&, size_t)>& run) {
          int64_t offset = 0;
          for (size_t j = 0; j < part.outs.size(); ++j) {
            run(projection(j, offset), j);
            offset += part.outs[j];
          }
        };
        const LoraAdapters lora{r, projections};
        auto row = [&](const char* op, const OpCost& cost) {
          Sample s;
          s.op = op;
          s.m = t;
          s.n = n;
          s.k = k;
          s.heads = projections;
          s.head_dim = r;
          s.grad_bytes = kBf16Bytes;
          s.bytes = cost.shape.lora_bytes;
          s.flops = cost.flops;
          return s;
        };
        Sample fwd = row("lora_fwd", LoraForwardCost(t, n, k, lora));
        fwd.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
          each([&](const cu::LoraProjectionGemm& p, size_t) {
            cu::LoraForward(gemm, p, x[i], u.get(), y[i], n, stream);
          });
        });
        session.Add(fwd);
        Sample input = row("lora_bwd_input", LoraBackwardInputCost(t, n, k, lora));
        input.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
          each([&](const cu::LoraProjectionGemm& p, size_t) {
            cu::LoraBackwardInput(gemm, p, y[i], n, du.get(), dx[i], stream);
          });
        });
        session.Add(input);
        Sample weight = row("lora_bwd_weight", LoraBackwardWeightCost(t, n, k, lora, kBf16Bytes));
        weight.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
          each([&](const cu::LoraProjectionGemm& p, size_t j) {
            cu::LoraBackwardWeight(gemm, p, x[i], y[i], n, u.get(), du.get(), grad_a[j].get(),
                                   grad_b[j].get(), CUDA_R_16BF, stream);
          });
        });
        session.Add(weight);
      }
    }
  }
}

// =================================================================================================
// The fused linear + cross-entropy, forward and backward in one call, head trainable, bf16
// gradients, with the runtime's tiling (one token tile per chunk, 8192-column vocabulary tiles).
void MeasureLoss(Session& session) {
  const auto& tokens_list = session.quick ? kLossTokensQuick : kLossTokens;
  const auto& vocab_list = session.quick ? kLossVocabQuick : kLossVocab;
  cu::CublasLtGemm gemm;
  const auto& hidden_list = session.quick ? kLossHiddenQuick : kLossHidden;
  Progress progress("loss", tokens_list.size() * vocab_list.size() * hidden_list.size());
  for (const int64_t d : hidden_list)
    for (const int64_t vocab : vocab_list) {
      auto w = RandomArray<bf16>(vocab * d, -0.05, 0.05, 11);   // head W: [V][d]
      auto dw = RandomArray<bf16>(vocab * d, -1e-4, 1e-4, 12);  // dW: [V][d], accumulated
      for (const int64_t t : tokens_list) {
        progress.Step(Describe("loss", {{"m", t}, {"n", vocab}, {"k", d}}));
        const cu::LinearCrossEntropyShape shape{t, d, vocab, t, std::min(kLossVocabTile, vocab)};
        auto x = RandomArray<bf16>(t * d, -1, 1, 13);         // x: [t][d]
        auto labels = RandomArray<int32_t>(t, 0, vocab, 14);  // labels: [t] in [0, V)
        DeviceArray<bf16> dx(t * d);                          // dx: [t][d]
        DeviceArray<float> loss(1);                           // loss_sum: [1]
        DeviceArray<std::byte> workspace(cu::LinearCrossEntropyWorkspaceBytes(shape));
        Sample s;
        s.op = "loss";
        s.m = t;
        s.n = vocab;
        s.k = d;
        s.grad_bytes = kBf16Bytes;
        s.Cost(LossForwardBackwardCost(t, d, vocab, true, kBf16Bytes));
        s.seconds = MedianSecondsPerCall(session, [&](int64_t) {
          cu::LinearCrossEntropy(gemm, shape, x.get(), w.get(), labels.get(),
                                 1.0f / static_cast<float>(t), dx.get(), dw.get(), loss.get(),
                                 workspace.get(), session.stream);
        });
        session.Add(s);
      }
    }
}

// =================================================================================================
// Memory-bound kernels. Each function measures one op at `t` tokens and returns its row.
namespace {

// The seconds of one call as it runs in a step, behind a longer kernel (a projection, attention)
// that hides its launch: each call queued after a 20 us idle kernel, less that kernel alone.
// Back to back, a small kernel is paced by its launches instead: RoPE, whose launch carries a
// 2 KiB table, took 12.7 us a call at 256 tokens (d_h 128) and 6.1 us so (H200, 2026-11-26).
constexpr double kCoverSeconds = 20e-6;
double StepSecondsPerCall(Session& session, const std::function<void(int64_t)>& call) {
  const double cover = MedianSecondsPerCall(
      session, [&](int64_t) { LaunchIdleKernel(kCoverSeconds, session.stream); });
  const double both = MedianSecondsPerCall(session, [&](int64_t i) {
    LaunchIdleKernel(kCoverSeconds, session.stream);
    call(i);
  });
  return std::max(both - cover, 1e-7);
}

Sample TokenRow(const char* op, int64_t t, int64_t n, const OpCost& cost) {
  Sample s;
  s.op = op;
  s.m = t;
  s.n = n;
  return s.Cost(cost);
}

// h = residual + x, y = RMSNorm(h): the runtime's RmsNormResidualForward.
Sample RmsNormForward(Session& session, int64_t t) {
  const int64_t d = kHidden;
  Rotating<bf16> residual(t * d, -2, 2, 21);         // [t][d]
  Rotating<bf16> x(t * d, -2, 2, 22);                // [t][d]
  Rotating<bf16> h(t * d, -2, 2, 23);                // [t][d]
  Rotating<bf16> y(t * d, -2, 2, 24);                // [t][d]
  Rotating<float> rstd(t, 0.5, 2, 25);               // [t]
  auto weight = RandomArray<bf16>(d, 0.5, 1.5, 26);  // [d]
  Sample s = TokenRow("rmsnorm_fwd", t, d, RmsNormForwardCost(t, d));
  s.seconds = StepSecondsPerCall(session, [&](int64_t i) {
    cu::RmsNormResidualForward(residual[i], x[i], weight.get(), t, d, kEps, h[i], y[i], rstd[i],
                               session.stream);
  });
  return s;
}

// A layer norm's backward with the residual stream's gradient fused (d_add), d_weight (bf16,
// the default grad dtype) summed every call: the runtime's attention / MLP norm backward.
// final_norm: the final norm's RmsNormBackwardIntoPartials instead (no d_add, d_weight left in
// fp32 partial rows summed once a step).
Sample RmsNormBackward(Session& session, int64_t t, bool final_norm) {
  const int64_t d = kHidden;
  Rotating<bf16> x(t * d, -2, 2, 31);                     // [t][d]
  Rotating<bf16> dy(t * d, -1, 1, 32);                    // [t][d]
  Rotating<bf16> d_add(t * d, -1, 1, 33);                 // [t][d]
  Rotating<bf16> dx(t * d, -1, 1, 34);                    // [t][d]
  Rotating<float> rstd(t, 0.5, 2, 35);                    // [t]
  auto weight = RandomArray<bf16>(d, 0.5, 1.5, 36);       // [d]
  auto d_weight = RandomArray<bf16>(d, -1e-3, 1e-3, 37);  // [d], accumulated
  const size_t scratch_bytes = cu::RmsNormBackwardScratchBytes(t, d);
  DeviceArray<std::byte> scratch(scratch_bytes);               // d_weight partial rows, fp32
  DeviceArray<float> partials(scratch_bytes / sizeof(float));  // the final norm's, kept
  CTXPLAN_CUDA_CHECK(cudaMemset(partials.get(), 0, partials.bytes()));
  Sample s =
      TokenRow(final_norm ? "rmsnorm_bwd_final" : "rmsnorm_bwd", t, d, RmsNormBackwardCost(t, d));
  s.grad_bytes = final_norm ? 0 : kBf16Bytes;
  s.seconds = StepSecondsPerCall(session, [&](int64_t i) {
    if (final_norm) {
      (void)cu::RmsNormBackwardIntoPartials(x[i], weight.get(), rstd[i], dy[i], t, d, dx[i],
                                            partials.get(), session.stream);
    } else {
      cu::RmsNormBackward(x[i], weight.get(), rstd[i], dy[i], d_add[i], t, d, dx[i], d_weight.get(),
                          scratch.get(), session.stream);
    }
  });
  return s;
}

// The same, each call's x the y of the call before (ping-pong) and the residual rotated: x was
// just written, within the L2, as the MLP's norm reads the output projection's output while the
// residual stream comes from further back.
Sample RmsNormForwardWarm(Session& session, int64_t t) {
  const int64_t d = kHidden;
  Rotating<bf16> residual(t * d, -2, 2, 121);         // [t][d]
  Rotating<bf16> h(t * d, -2, 2, 122);                // [t][d]
  auto x_a = RandomArray<bf16>(t * d, -2, 2, 123);    // [t][d]: x in, then y out
  auto x_b = RandomArray<bf16>(t * d, -2, 2, 124);    // [t][d]
  Rotating<float> rstd(t, 0.5, 2, 125);               // [t]
  auto weight = RandomArray<bf16>(d, 0.5, 1.5, 126);  // [d]
  Sample s = TokenRow("rmsnorm_fwd_warm", t, d, RmsNormForwardCost(t, d));
  s.seconds = StepSecondsPerCall(session, [&](int64_t i) {
    const bool even = i % 2 == 0;
    cu::RmsNormResidualForward(residual[i], even ? x_a.get() : x_b.get(), weight.get(), t, d, kEps,
                               h[i], even ? x_b.get() : x_a.get(), rstd[i], session.stream);
  });
  return s;
}

// RoPE as the runtime's op runs it: Q [t][H_q][d_h] and K [t][H_kv][d_h], two launches.
Sample Rope(Session& session, int64_t t, int64_t head_dim = kHeadDim, bool warm = false) {
  const int64_t q_dim = kHeads * head_dim, kv_dim = kKvHeads * head_dim;
  // Rotated over copies, or (warm) the first copy every call, rotating again what the call before
  // wrote, within the L2, as RoPE follows the QKV projection.
  Rotating<bf16> q(t * q_dim, -1, 1, 41);   // [t][H_q][d_h], rotated in place
  Rotating<bf16> k(t * kv_dim, -1, 1, 42);  // [t][H_kv][d_h]
  Sample s = TokenRow(warm ? "rope_warm" : "rope", t, q_dim, RopeCost(t, q_dim, kv_dim));
  s.k = kv_dim;
  s.heads = kHeads;
  s.kv_heads = kKvHeads;
  s.head_dim = head_dim;
  s.seconds = StepSecondsPerCall(session, [&](int64_t i) {
    const int64_t copy = warm ? 0 : i;
    cu::RopeForward(q[copy], t, kHeads, head_dim, q_dim, kRopeFirstPosition, kRopeTheta,
                    session.stream);
    cu::RopeForward(k[copy], t, kKvHeads, head_dim, kv_dim, kRopeFirstPosition, kRopeTheta,
                    session.stream);
  });
  return s;
}

// sustained: back to back, for the power group's draw (no idle kernel between the calls).
Sample Swiglu(Session& session, int64_t t, bool backward, bool sustained = false) {
  const int64_t I = kIntermediate;
  Rotating<bf16> gate_up(t * 2 * I, -6, 6, 51);    // [t][2I] = [gate | up]
  Rotating<bf16> out(t * I, -1, 1, 52);            // forward: out [t][I]; backward: d_out
  Rotating<bf16> d_gate_up(t * 2 * I, -1, 1, 53);  // [t][2I]
  Sample s = backward ? TokenRow("swiglu_bwd", t, I, SwigluBackwardCost(t, I))
                      : TokenRow("swiglu_fwd", t, I, SwigluForwardCost(t, I));
  auto call = [&](int64_t i) {
    if (backward) {
      cu::SwigluBackward(gate_up[i], out[i], t, I, d_gate_up[i], session.stream);
    } else {
      cu::SwigluForward(gate_up[i], t, I, out[i], session.stream);
    }
  };
  s.seconds = sustained ? MedianSecondsPerCall(session, call) : StepSecondsPerCall(session, call);
  return s;
}

// Embedding rows: k = the vocabulary. Backward into a bf16 table (grad bytes 2).
Sample Embedding(Session& session, int64_t t, bool backward) {
  const int64_t d = kHidden;
  Rotating<int32_t> ids(t, 0, kVocab, 61);                      // [t] in [0, V)
  Rotating<bf16> rows(t * d, -1, 1, 62);                        // out / d_out: [t][d]
  auto table = RandomArray<bf16>(kVocab * d, -1e-2, 1e-2, 63);  // table or d_table: [V][d]
  Sample s = backward ? TokenRow("embedding_bwd", t, d, EmbeddingBackwardCost(t, d, kBf16Bytes))
                      : TokenRow("embedding_fwd", t, d, EmbeddingForwardCost(t, d));
  s.k = kVocab;
  s.grad_bytes = backward ? kBf16Bytes : 0;
  s.seconds = StepSecondsPerCall(session, [&](int64_t i) {
    if (backward) {
      cu::EmbeddingBackward(ids[i], rows[i], t, kVocab, d, table.get(), session.stream);
    } else {
      cu::EmbeddingForward(ids[i], table.get(), t, kVocab, d, rows[i], session.stream);
    }
  });
  return s;
}

// The chunk's K and V into its own 128-token pages (KvWrite), or the dKV later chunks left in
// them (bf16) added to dK / dV (DkvAccumulate). Identity page table, as the runtime's own pages.
Sample PageHelper(Session& session, int64_t t, bool accumulate) {
  const KvPageShape shape{kPageTokens, kKvHeads, kHeadDim};
  const int64_t own_pages = CeilDiv(t, kPageTokens);
  Rotating<bf16> k(t * kKvDim, -1, 1, 71);                            // K / dK: [t][H_kv][d_h]
  Rotating<bf16> v(t * kKvDim, -1, 1, 72);                            // V / dV: [t][H_kv][d_h]
  Rotating<bf16> pool(own_pages * shape.page_elements(), -1, 1, 73);  // [pages][2][p][H_kv][d_h]
  std::vector<int32_t> identity(static_cast<size_t>(own_pages));
  for (size_t p = 0; p < identity.size(); ++p) identity[p] = static_cast<int32_t>(p);
  DeviceArray<int32_t> page_slot(identity.size());  // [own pages]: logical page -> slot
  CTXPLAN_CUDA_CHECK(
      cudaMemcpy(page_slot.get(), identity.data(), page_slot.bytes(), cudaMemcpyHostToDevice));
  Sample s = accumulate
                 ? TokenRow("dkv_accumulate", t, kKvDim, DkvAccumulateCost(t, kKvDim, kBf16Bytes))
                 : TokenRow("kv_write", t, kKvDim, KvWriteCost(t, kKvDim));
  s.kv_heads = kKvHeads;
  s.head_dim = kHeadDim;
  s.page_tokens = kPageTokens;
  s.grad_bytes = accumulate ? kBf16Bytes : 0;
  s.seconds = StepSecondsPerCall(session, [&](int64_t i) {
    if (accumulate) {
      cu::DkvAccumulate(PagedKv<const bf16>{shape, pool[i], page_slot.get(), own_pages}, t, k[i],
                        v[i], kKvDim, session.stream);
    } else {
      cu::KvWrite(k[i], v[i], kKvDim, t, PagedKv<bf16>{shape, pool[i], page_slot.get(), own_pages},
                  session.stream);
    }
  });
  return s;
}

Sample ZeroFill(Session& session, int64_t bytes) {
  Rotating<float> buffer(static_cast<size_t>(bytes) / sizeof(float), -1, 1, 81);  // [bytes]
  Sample s;
  s.op = "zero_fill";
  s.Cost(ZeroFillCost(bytes));
  s.seconds = StepSecondsPerCall(session, [&](int64_t i) {
    CTXPLAN_CUDA_CHECK(cudaMemsetAsync(buffer[i], 0, static_cast<size_t>(bytes), session.stream));
  });
  return s;
}

// AdamW on the GPU: bf16 parameters and gradients, fp32 moments.
Sample AdamW(Session& session, int64_t params) {
  Rotating<bf16> param(params, -0.05, 0.05, 91);  // [n]
  Rotating<bf16> grad(params, -1e-2, 1e-2, 92);   // [n]
  Rotating<float> m(params, -1e-3, 1e-3, 93);     // [n]
  Rotating<float> v(params, 1e-8, 1e-6, 94);      // [n], >= 0
  cu::AdamWParams p;
  p.weight_decay = 0.1f;
  p.step = 10;
  Sample s;
  s.op = "adamw";
  s.m = params;
  s.grad_bytes = kBf16Bytes;
  s.Cost(AdamWCost(params, kBf16Bytes, kBf16Bytes, false));
  s.seconds = StepSecondsPerCall(session, [&](int64_t i) {
    cu::AdamW(param[i], grad[i], m[i], v[i], params, p, session.stream);
  });
  return s;
}

}  // namespace

void MeasureMemory(Session& session) {
  struct Case {
    std::string what;
    std::function<Sample()> measure;
  };
  std::vector<Case> cases;
  for (const int64_t t : session.quick ? kMemoryTokensQuick : kMemoryTokens) {
    auto add = [&](const char* op, std::function<Sample()> measure) {
      cases.push_back({Describe(op, {{"m", t}}), std::move(measure)});
    };
    add("rmsnorm_fwd", [&session, t] { return RmsNormForward(session, t); });
    add("rmsnorm_bwd", [&session, t] { return RmsNormBackward(session, t, false); });
    add("rmsnorm_bwd_final", [&session, t] { return RmsNormBackward(session, t, true); });
    add("rope", [&session, t] { return Rope(session, t); });
    add("swiglu_fwd", [&session, t] { return Swiglu(session, t, false); });
    add("swiglu_bwd", [&session, t] { return Swiglu(session, t, true); });
    add("embedding_fwd", [&session, t] { return Embedding(session, t, false); });
    add("embedding_bwd", [&session, t] { return Embedding(session, t, true); });
    add("kv_write", [&session, t] { return PageHelper(session, t, false); });
    add("dkv_accumulate", [&session, t] { return PageHelper(session, t, true); });
  }
  // RoPE also at Llama-3.2-1B's head dim 64 (32 / 8 heads) and at the small sizes where its two
  // launches' latency, not its bytes, sets the time; warm at both head dims.
  for (const int64_t t : kWarmTokens) {
    cases.push_back({Describe("rmsnorm_fwd_warm", {{"m", t}}),
                     [&session, t] { return RmsNormForwardWarm(session, t); }});
    for (const int64_t head_dim : {int64_t{128}, int64_t{64}}) {
      if (t != 1024 || head_dim != kHeadDim)  // the grid above has it
        cases.push_back({Describe("rope", {{"m", t}, {"head_dim", head_dim}}),
                         [&session, t, head_dim] { return Rope(session, t, head_dim); }});
      cases.push_back({Describe("rope_warm", {{"m", t}, {"head_dim", head_dim}}),
                       [&session, t, head_dim] { return Rope(session, t, head_dim, true); }});
    }
  }
  for (const int64_t bytes : kZeroFillBytes)
    cases.push_back({Describe("zero_fill", {{"bytes", bytes}}),
                     [&session, bytes] { return ZeroFill(session, bytes); }});
  for (const int64_t params : kAdamWParams)
    cases.push_back({Describe("adamw", {{"m", params}}),
                     [&session, params] { return AdamW(session, params); }});

  Progress progress("memory", cases.size());
  for (const Case& c : cases) {
    progress.Step(c.what);
    try {
      session.Add(c.measure());
    } catch (const std::invalid_argument& e) {
      progress.Note("skipped " + c.what + ": " + e.what());
    }
  }
}

// ===============================================================================================
// Sustained (session.sustain_seconds): a Llama-3-8B and a Llama-3.2-1B MLP projection over a
// 4096-token chunk, and an HBM-bound kernel.
void MeasurePowerKernels(Session& session) {
  cu::CublasLtGemm gemm;
  MeasureGemmShape(session, gemm, 4096, 28672, 4096, true);
  MeasureGemmShape(session, gemm, 4096, 16384, 2048, true);
  session.Add(Swiglu(session, 16384, false, /*sustained=*/true));
}

// Sustained, the Llama-3-8B MLP projection of MeasurePowerKernels with an idle gap after each
// call: the GEMM runs a fraction of the time, the board's limit allows a higher clock, and its
// draw at that clock gives the exponent of power against clock (clock_model.h). Rows
// "duty_gemm_fwd": seconds of one GEMM and its gap, `copies` the gap in microseconds.
void MeasurePowerDuty(Session& session) {
  constexpr int64_t m = 4096, n = 28672, k = 4096;
  cu::CublasLtGemm gemm;
  Rotating<bf16> x(m * k, -1, 1, 1);        // X: [m][k]
  Rotating<bf16> w(n * k, -0.05, 0.05, 2);  // W: [n][k]
  Rotating<bf16> y(m * n, -1, 1, 3);        // Y: [m][n]
  for (const int64_t gap_us : kPowerDutyGapsUs) {
    Sample s;
    s.op = "duty_gemm_fwd";
    s.m = m;
    s.n = n;
    s.k = k;
    s.copies = gap_us;
    s.Cost(LinearForwardCost(m, n, k));
    s.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
      cu::LinearForward(gemm, x[i], w[i], nullptr, m, n, k, y[i], session.stream);
      LaunchIdleKernel(static_cast<double>(gap_us) * 1e-6, session.stream);
    });
    session.Add(s);
  }
}

}  // namespace ctxplan::calibrate
