// CPU reference of the fused, tiled linear + cross-entropy at the top of the model.
//
// logits = x W^T would be t x V floats (a 16K-token chunk and a 152K vocabulary: 10 GB), so they
// never exist whole: the tokens are cut into tiles of token_tile rows and the vocabulary into tiles
// of vocab_tile rows of W, and only one [token_tile][vocab_tile] logits tile lives at a time.
// Per token tile:
//   pass 1: for each vocab tile, compute the logits tile and fold it into an online log-sum-exp
//           per token (running max and running sum of exp(logit - max), in double);
//   pass 2: for each vocab tile, recompute the logits tile, form g = (softmax - onehot) *
//           grad_scale, and accumulate dx += g W_tile, dW_tile += g^T x.
// The recompute doubles the logits FLOPs; it is the price of the memory bound, exactly as on GPU.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <Eigen/Core>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::kernels::cpu {
namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMatrixMap = Eigen::Map<const RowMatrix>;
using MatrixMap = Eigen::Map<RowMatrix>;

}  // namespace

double LinearCrossEntropy(const float* x, const float* w, std::span<const int32_t> labels,
                          int64_t hidden, int64_t vocab, int64_t token_tile, int64_t vocab_tile,
                          float grad_scale, float* dx, float* d_w) {
  const int64_t tokens = static_cast<int64_t>(labels.size());
  CTXPLAN_CHECK(hidden > 0 && vocab > 0, "bad linear cross-entropy shape");
  CTXPLAN_CHECK(token_tile > 0 && vocab_tile > 0, "tiles must be positive");
  // Labels come from data: check them all before touching any output. Negative labels mark
  // positions without a target (-1 here, -100 in Hugging Face): no loss, no gradient.
  for (int64_t t = 0; t < tokens; ++t) {
    if (labels[t] >= vocab) {
      throw InputError("label " + std::to_string(labels[t]) + " at position " + std::to_string(t) +
                       " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  if (dx != nullptr) std::fill_n(dx, tokens * hidden, 0.0f);

  const int64_t tile_rows = std::min(token_tile, tokens);
  const int64_t tile_cols = std::min(vocab_tile, vocab);
  RowMatrix logits(tile_rows, tile_cols);  // the only logits buffer: [token_tile][vocab_tile]
  RowMatrix g(tile_rows, tile_cols);       // softmax - onehot of the same tile
  std::vector<double> running_max(static_cast<size_t>(tile_rows));
  std::vector<double> running_sum(static_cast<size_t>(tile_rows));
  std::vector<double> lse(static_cast<size_t>(tile_rows));
  double loss = 0.0;

  for (int64_t t0 = 0; t0 < tokens; t0 += token_tile) {
    const int64_t rows = std::min(token_tile, tokens - t0);
    const int32_t* tile_labels = labels.data() + t0;
    // A tile with no labelled position contributes neither loss nor gradient (dx is already 0).
    if (std::none_of(tile_labels, tile_labels + rows, [](int32_t l) { return l >= 0; })) continue;
    const ConstMatrixMap x_tile(x + t0 * hidden, rows, hidden);  // [rows][d]

    // Pass 1: online log-sum-exp over the vocabulary tiles.
    std::fill_n(running_max.begin(), rows, -std::numeric_limits<double>::infinity());
    std::fill_n(running_sum.begin(), rows, 0.0);
    for (int64_t v0 = 0; v0 < vocab; v0 += vocab_tile) {
      const int64_t cols = std::min(vocab_tile, vocab - v0);
      const ConstMatrixMap w_tile(w + v0 * hidden, cols, hidden);  // [cols][d]
      auto l = logits.topLeftCorner(rows, cols);
      l.noalias() = x_tile * w_tile.transpose();
      for (int64_t r = 0; r < rows; ++r) {
        const double tile_max = static_cast<double>(l.row(r).maxCoeff());
        const double new_max = std::max(running_max[r], tile_max);
        // Rescale the sum so far to the new max (exp(-inf) = 0 on the first tile).
        double sum = running_sum[r] * std::exp(running_max[r] - new_max);
        for (int64_t c = 0; c < cols; ++c) sum += std::exp(static_cast<double>(l(r, c)) - new_max);
        running_max[r] = new_max;
        running_sum[r] = sum;
      }
      // The label's logit is the other half of the loss; take it while its tile is at hand.
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t label = tile_labels[r];
        if (label >= v0 && label < v0 + cols) loss -= static_cast<double>(l(r, label - v0));
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      lse[r] = running_max[r] + std::log(running_sum[r]);
      if (tile_labels[r] >= 0) loss += lse[r];
    }
    if (dx == nullptr && d_w == nullptr) continue;

    // Pass 2: recompute each logits tile and backpropagate (softmax - onehot) through it.
    for (int64_t v0 = 0; v0 < vocab; v0 += vocab_tile) {
      const int64_t cols = std::min(vocab_tile, vocab - v0);
      const ConstMatrixMap w_tile(w + v0 * hidden, cols, hidden);  // [cols][d]
      auto l = logits.topLeftCorner(rows, cols);
      auto gt = g.topLeftCorner(rows, cols);
      l.noalias() = x_tile * w_tile.transpose();
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t label = tile_labels[r];
        if (label < 0) {
          gt.row(r).setZero();
          continue;
        }
        for (int64_t c = 0; c < cols; ++c) {
          const double p = std::exp(static_cast<double>(l(r, c)) - lse[r]);
          const double y = (v0 + c == label) ? 1.0 : 0.0;
          gt(r, c) = static_cast<float>((p - y) * grad_scale);
        }
      }
      if (dx != nullptr) MatrixMap(dx + t0 * hidden, rows, hidden).noalias() += gt * w_tile;
      if (d_w != nullptr) {
        MatrixMap(d_w + v0 * hidden, cols, hidden).noalias() += gt.transpose() * x_tile;
      }
    }
  }
  return loss;
}

}  // namespace ctxplan::kernels::cpu
