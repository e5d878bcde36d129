// The step's inputs in ctxtrain: a window of a token file (--data), or a synthetic task
// (--task retrieval / random), the same for a step number on every run with one seed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/io/token_data.h"

namespace ctxplan::train {

class DataSource {
 public:
  // `data`: a token file, or empty for `task`. Throws InputError for a task that is not one.
  DataSource(const std::string& data, const std::string& task, uint64_t seed,
             const ModelSpec& model, int64_t n);
  TokenSequence Step(int64_t step) const;

 private:
  std::optional<TokenFile> file_;
  std::string task_;
  int64_t vocab_, n_;
  uint64_t seed_;
};

}  // namespace ctxplan::train
