// CPU reference kernels: the definition of the right answer for every op of the training step.
// fp32 storage, fp64 accumulation where sums are long; Eigen for the matrix products. Simple and
// obviously correct before fast. The CUDA kernels are tested against these.
//
// Conventions: row-major; shapes in the comments; "accumulate" outputs are added to, every other
// output is overwritten. Linear weights use Hugging Face's layout W[out][in].
#pragma once

#include <cstdint>
#include <span>

#include "ctxplan/kernels/paged_kv.h"

namespace ctxplan::kernels::cpu {

// --- embedding ---
// out[t][d] = table[tokens[t]][d]
void EmbeddingForward(std::span<const int32_t> tokens, const float* table /*[V][d]*/, int64_t vocab,
                      int64_t hidden, float* out /*[t][d]*/);
// d_table[tokens[t]] += d_out[t] (accumulate)
void EmbeddingBackward(std::span<const int32_t> tokens, const float* d_out /*[t][d]*/,
                       int64_t vocab, int64_t hidden, float* d_table /*[V][d]*/);

// --- RMSNorm: y = x / rms(x) * weight ---
void RmsNormForward(const float* x /*[t][d]*/, const float* weight /*[d]*/, int64_t tokens,
                    int64_t hidden, float eps, float* y /*[t][d]*/, float* rstd /*[t]*/);
// dx overwritten; d_weight accumulated.
void RmsNormBackward(const float* x, const float* weight, const float* rstd, const float* dy,
                     int64_t tokens, int64_t hidden, float* dx, float* d_weight);

// --- linear: y = x W^T + b ---
void LinearForward(const float* x /*[m][k]*/, const float* w /*[n][k]*/,
                   const float* bias /*[n] or null*/, int64_t m, int64_t n, int64_t k,
                   float* y /*[m][n]*/);
// dx = dy W (overwritten, skipped when null); dW += dy^T x; d_bias += sum(dy) (when non-null).
void LinearBackward(const float* x, const float* w, const float* dy /*[m][n]*/, int64_t m,
                    int64_t n, int64_t k, float* dx /*[m][k]*/, float* d_w /*[n][k]*/,
                    float* d_bias /*[n]*/);

// --- RoPE (Hugging Face rotate_half convention), in place on x[t][heads][head_dim] ---
// Position of row i is first_position + i; inv_freq[j] = theta^(-2j/head_dim).
void RopeForward(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t first_position,
                 double theta);
// The transpose (inverse rotation): gradients flow back through RoPE.
void RopeBackward(float* dx, int64_t tokens, int64_t heads, int64_t head_dim,
                  int64_t first_position, double theta);

// --- SwiGLU: out = silu(gate) * up, with gate_up[t] = [gate (I) | up (I)] ---
void SwigluForward(const float* gate_up /*[t][2I]*/, int64_t tokens, int64_t intermediate,
                   float* out /*[t][I]*/);
void SwigluBackward(const float* gate_up, const float* d_out /*[t][I]*/, int64_t tokens,
                    int64_t intermediate, float* d_gate_up /*[t][2I]*/);

// --- attention over the chunk's own positions (causal) and earlier pages ---
// q [t][H_q][d_h] (post-RoPE), k_own/v_own [t][H_kv][d_h]; GQA: query head h reads KV head
// h / (H_q / H_kv). Query i of the chunk sees own keys 0..i and the earlier pages its tile
// selects (all of them when selection.pages == nullptr). scale = 1/sqrt(d_h) typically.
struct AttentionShape {
  int64_t tokens = 0;  // t, queries of the chunk
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  float scale = 0.0f;
};
void AttentionForward(const AttentionShape& shape, const float* q, const float* k_own,
                      const float* v_own, const PagedKv<const float>& earlier,
                      const PageSelection& selection, float* out /*[t][H_q][d_h]*/,
                      float* lse /*[t][H_q], natural log*/);
// dq, dk_own, dv_own overwritten; dkv (earlier pages, same slots as `earlier`) accumulated.
void AttentionBackward(const AttentionShape& shape, const float* q, const float* k_own,
                       const float* v_own, const PagedKv<const float>& earlier,
                       const PageSelection& selection, const float* out, const float* lse,
                       const float* d_out, float* dq, float* dk_own, float* dv_own,
                       const PagedKv<float>& dkv);

// --- page selection ---
// Mean key of each of `pages` full pages, per KV head: summaries[page][H_kv][d_h].
void PageSummary(const PagedKv<const float>& kv, float* summaries);
// scores[tile][page] = sum over the tile's queries and all query heads of q . summary of the
// query head's KV head (heads of a GQA group summed).
void PageScore(const float* q /*[t][H_q][d_h]*/, int64_t tokens, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t query_tile, const float* summaries,
               int64_t pages, float* scores /*[tiles][pages]*/);
// selected[tile] = the first `sinks` pages, then the `budget` best-scoring other pages (ties:
// lower page first), ascending; when pages <= sinks + budget, every page.
// Returns pages_per_tile = min(pages, sinks + budget).
int64_t PageTopK(const float* scores, int64_t tiles, int64_t pages, int64_t budget, int64_t sinks,
                 int32_t* selected /*[tiles][pages_per_tile]*/);

// --- fused linear + cross-entropy over a chunk, tiled over tokens and vocabulary ---
// logits = x W^T never exist whole; returns the summed loss over labelled positions (label -1:
// ignored). dx overwritten, d_w accumulated (skipped when null), both scaled by `grad_scale`.
double LinearCrossEntropy(const float* x /*[t][d]*/, const float* w /*[V][d]*/,
                          std::span<const int32_t> labels, int64_t hidden, int64_t vocab,
                          int64_t token_tile, int64_t vocab_tile, float grad_scale,
                          float* dx /*[t][d]*/, float* d_w /*[V][d]*/);

// --- AdamW (decoupled weight decay), fp32 moments ---
struct AdamWParams {
  float lr = 1e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;  // 1-based, for bias correction
};
void AdamW(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p);

// --- helpers of the plan ---
// dk_own/dv_own [t][H_kv][d_h] += the dKV that later chunks left in the chunk's own pages.
void DkvAccumulate(const PagedKv<const float>& own_dkv, int64_t tokens, float* dk_own,
                   float* dv_own);
// Writes the chunk's K and V into its own pages (the page table covers ceil(t / p) pages).
void KvWrite(const float* k /*[t][H_kv][d_h]*/, const float* v, int64_t tokens,
             const PagedKv<float>& own_pages);

}  // namespace ctxplan::kernels::cpu
