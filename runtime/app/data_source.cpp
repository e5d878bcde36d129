#include "data_source.h"

#include <utility>

#include "ctxplan/models/errors.h"

namespace ctxplan::train {

DataSource::DataSource(const std::string& data, const std::string& task, uint64_t seed,
                       const ModelSpec& model, int64_t n)
    : task_(task), vocab_(model.vocab_size), n_(n), seed_(seed) {
  if (!data.empty()) {
    file_.emplace(data, model.vocab_size);
  } else if (task_ != "retrieval" && task_ != "random") {
    throw InputError("--task: '" + task_ +
                     "' is not a task; accepted: retrieval (a key "
                     "placed early, queried at the end), random, or --data FILE");
  }
}

TokenSequence DataSource::Step(int64_t step) const {
  if (file_) return file_->Window(step, n_);
  const uint64_t seed = StepSeed(seed_, step);
  if (task_ == "retrieval") {
    RetrievalSample s = SyntheticRetrieval(vocab_, n_, seed, /*label_filler=*/false);
    return {std::move(s.tokens), std::move(s.labels)};
  }
  TokenSequence s;
  s.tokens = RandomTokens(vocab_, n_, seed);
  s.labels.assign(s.tokens.begin() + 1, s.tokens.end());
  s.labels.push_back(-1);
  return s;
}

}  // namespace ctxplan::train
