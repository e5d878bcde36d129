// Training data: a binary file of token ids, and synthetic tasks generated from a seed.
//
// Every sequence here is (tokens, labels) of one length n: tokens[i] is the input at position i,
// labels[i] the token the model must predict there (the next token), or -1 for "no loss here".
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace ctxplan {

struct TokenSequence {
  std::vector<int32_t> tokens;  // n input ids in [0, vocab)
  std::vector<int32_t> labels;  // n targets in [0, vocab), or -1: ignored by the loss
};

// A data file: little-endian uint32 token ids, nothing else (no header). The constructor checks
// the whole file once, streaming it (size a multiple of 4, every id below `vocab_size`), and
// keeps it open; windows are read from disk on demand, so a file of billions of tokens costs no
// memory. Move-only.
class TokenFile {
 public:
  // InputError, one line naming the file: cannot open, size not a multiple of 4, or an id not
  // below `vocab_size` (naming its byte offset).
  TokenFile(std::filesystem::path path, int64_t vocab_size);
  TokenFile(TokenFile&&) noexcept;
  TokenFile& operator=(TokenFile&&) noexcept;
  ~TokenFile();

  const std::filesystem::path& path() const { return path_; }
  int64_t size() const { return size_; }  // tokens

  // Tokens [start, start + count) of the file; the range must lie inside it (a caller bug if not).
  std::vector<int32_t> Read(int64_t start, int64_t count) const;

  // The sequence of training step `step` for a context of `n` tokens: n + 1 consecutive tokens of
  // the file, inputs the first n, labels the last n (the next token at every position).
  // The file is cut into W = (size - 1) / n windows, window w starting at token w * n (so
  // consecutive windows share one boundary token, and each is a true slice of the file, never
  // glued across its end); step s takes window s mod W, wrapping around once the file is used up.
  // InputError if the file is too short: "data file X holds K tokens; a context of n needs n+1".
  TokenSequence Window(int64_t step, int64_t n) const;

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// Writes ids (each in [0, 2^32)) as a data file, atomically. InputError if it cannot be written.
void WriteTokenFile(const std::filesystem::path& path, std::span<const int32_t> tokens);

// n ids uniform in [0, vocab), a pure function of the seed (the same on every platform).
std::vector<int32_t> RandomTokens(int64_t vocab, int64_t n, uint64_t seed);

// The seed of training step `step` of a run seeded `run_seed`: distinct steps get unrelated
// streams, and a resumed run regenerates exactly the data it would have seen.
uint64_t StepSeed(uint64_t run_seed, int64_t step);

// A synthetic long-range retrieval task: learnable only by carrying information across the whole
// context, so across many chunks in chunk-recurrent training.
//
// The vocabulary is split into three disjoint classes: fillers [0, F) with F = vocab / 2, keys
// [F, F + K) with K = (vocab - F) / 2, and values [F + K, vocab). A sequence of n tokens is
//   - a random key at key_position p, uniform in the first max(1, n / 20) positions (the first
//     5% of the context), and a random value right after it at p + 1;
//   - the same key again at the last position, query_position = n - 1;
//   - random fillers everywhere else.
// Labels: labels[n - 1] = value (after the key recurs, predict the value that followed it), and
// every other label is -1, so the loss measures retrieval alone. With `label_filler`, labels[i]
// = tokens[i + 1] for i < n - 1 as well (plain next-token prediction; the fillers are uniform, so
// that part only adds a constant ~ln(F) floor).
// What the loss at the query shows: a model that ignores the context reaches at best ln(V_values)
// (it can learn that a value comes, not which); only retrieval from position p + 1, n - 2 tokens
// back, takes it below that, towards 0.
// Deterministic in (vocab, n, seed), on every platform. InputError unless vocab >= 4 and n >= 4.
struct RetrievalSample {
  std::vector<int32_t> tokens;  // n
  std::vector<int32_t> labels;  // n
  int32_t key = 0;
  int32_t value = 0;
  int64_t key_position = 0;    // p: tokens[p] = key, tokens[p + 1] = value
  int64_t query_position = 0;  // n - 1: tokens[n - 1] = key, labels[n - 1] = value
};
RetrievalSample SyntheticRetrieval(int64_t vocab, int64_t n, uint64_t seed,
                                   bool label_filler = false);

}  // namespace ctxplan
