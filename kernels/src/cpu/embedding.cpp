// CPU reference of the token embedding: a row gather forward, a scatter-add backward.
#include <algorithm>
#include <string>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::kernels::cpu {
namespace {

// Token ids come from data files: an id outside the table is the user's data, not our bug, and
// must never become an out-of-bounds read or write. Every id is checked before anything is written
// so that a bad batch leaves the outputs (and an accumulated d_table) untouched.
void CheckTokens(std::span<const int32_t> tokens, int64_t vocab) {
  for (size_t t = 0; t < tokens.size(); ++t) {
    if (tokens[t] < 0 || tokens[t] >= vocab) {
      throw InputError("token id " + std::to_string(tokens[t]) + " at position " +
                       std::to_string(t) + " is outside the vocabulary [0, " +
                       std::to_string(vocab) + ")");
    }
  }
}

}  // namespace

void EmbeddingForward(std::span<const int32_t> tokens, const float* table, int64_t vocab,
                      int64_t hidden, float* out) {
  CTXPLAN_CHECK(vocab >= 0 && hidden >= 0, "negative embedding shape");
  CheckTokens(tokens, vocab);
  for (size_t t = 0; t < tokens.size(); ++t) {
    std::copy_n(table + static_cast<int64_t>(tokens[t]) * hidden, hidden,
                out + static_cast<int64_t>(t) * hidden);
  }
}

void EmbeddingBackward(std::span<const int32_t> tokens, const float* d_out, int64_t vocab,
                       int64_t hidden, float* d_table) {
  CTXPLAN_CHECK(vocab >= 0 && hidden >= 0, "negative embedding shape");
  CheckTokens(tokens, vocab);
  // Repeated ids add up: sequential, in token order, so the result is deterministic.
  for (size_t t = 0; t < tokens.size(); ++t) {
    float* row = d_table + static_cast<int64_t>(tokens[t]) * hidden;
    const float* grad = d_out + static_cast<int64_t>(t) * hidden;
    for (int64_t i = 0; i < hidden; ++i) row[i] += grad[i];
  }
}

}  // namespace ctxplan::kernels::cpu
