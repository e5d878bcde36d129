#include "ctxplan/runtime/io/token_data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "ctxplan/models/errors.h"
#include "ctxplan/traces/atomic_file.h"

namespace ctxplan {

// Ids are copied between the file and uint32 arrays as they are.
static_assert(std::endian::native == std::endian::little,
              "token files are little-endian; this host is not");

namespace fs = std::filesystem;

namespace {

constexpr size_t kBlockTokens = size_t{1} << 20;  // 4 MiB of ids per read

[[noreturn]] void Fail(const fs::path& file, const std::string& what) {
  throw InputError(file.string() + ": " + what);
}

// Reads exactly `size` bytes at `offset`; false at end of file.
bool ReadAt(int fd, const fs::path& file, void* data, size_t size, uint64_t offset) {
  char* out = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got = ::pread(fd, out, size, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      Fail(file,
           "read failed at byte offset " + std::to_string(offset) + ": " + std::strerror(errno));
    }
    if (got == 0) return false;
    out += got;
    size -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return true;
}

// splitmix64: tiny, fast, and specified bit for bit, unlike the std distributions whose output
// differs between standard libraries; a seed must mean the same data everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound) by multiply-shift; the bias (bound / 2^64) is far below anything a
  // training run can notice.
  uint64_t Below(uint64_t bound) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(Next()) * bound) >> 64);
  }

 private:
  uint64_t state_;
};

}  // namespace

TokenFile::TokenFile(fs::path path, int64_t vocab_size) : path_(std::move(path)) {
  // Ids travel as int32 from here on.
  CTXPLAN_CHECK(vocab_size > 0 && vocab_size <= int64_t{1} << 31, "vocab_size out of range");
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) Fail(path_, std::string("cannot open data file: ") + std::strerror(errno));
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0)
      Fail(path_, std::string("cannot stat data file: ") + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) Fail(path_, "data file is not a regular file");
    const uint64_t bytes = static_cast<uint64_t>(st.st_size);
    if (bytes % 4 != 0)
      Fail(path_, "size " + std::to_string(bytes) +
                      " bytes is not a multiple of 4 (a data file holds little-endian uint32 "
                      "token ids)");
    size_ = static_cast<int64_t>(bytes / 4);
    // One streaming pass: a bad id is reported here, once, with its offset, rather than in the
    // middle of a run hours later.
    std::vector<uint32_t> block(std::min<size_t>(kBlockTokens, static_cast<size_t>(size_)));
    for (int64_t start = 0; start < size_; start += static_cast<int64_t>(block.size())) {
      const size_t count = std::min(block.size(), static_cast<size_t>(size_ - start));
      if (!ReadAt(fd_, path_, block.data(), count * 4, static_cast<uint64_t>(start) * 4))
        Fail(path_, "file shrank while being read");
      for (size_t i = 0; i < count; ++i) {
        if (block[i] >= static_cast<uint64_t>(vocab_size)) {
          const int64_t token = start + static_cast<int64_t>(i);
          Fail(path_, "token id " + std::to_string(block[i]) + " at byte offset " +
                          std::to_string(token * 4) + " (token " + std::to_string(token) +
                          ") is not below the vocabulary size " + std::to_string(vocab_size));
        }
      }
    }
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), size_(other.size_) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
  }
  return *this;
}

TokenFile::~TokenFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<int32_t> TokenFile::Read(int64_t start, int64_t count) const {
  CTXPLAN_CHECK(start >= 0 && count >= 0 && start <= size_ && count <= size_ - start,
                "token range outside the data file");
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  if (!ReadAt(fd_, path_, tokens.data(), tokens.size() * 4, static_cast<uint64_t>(start) * 4))
    Fail(path_, "unexpected end of data file at token " + std::to_string(start) +
                    " (file changed while in use?)");
  return tokens;
}

TokenSequence TokenFile::Window(int64_t step, int64_t n) const {
  CTXPLAN_CHECK(step >= 0 && n >= 1, "step must be >= 0 and n >= 1");
  if (size_ < n + 1)
    throw InputError("data file " + path_.string() + " holds " + std::to_string(size_) +
                     " tokens; a context of " + std::to_string(n) + " needs " +
                     std::to_string(n + 1));
  const int64_t windows = (size_ - 1) / n;
  const int64_t start = (step % windows) * n;
  std::vector<int32_t> ids = Read(start, n + 1);
  TokenSequence sequence;
  sequence.labels.assign(ids.begin() + 1, ids.end());
  ids.pop_back();
  sequence.tokens = std::move(ids);
  return sequence;
}

void WriteTokenFile(const fs::path& path, std::span<const int32_t> tokens) {
  AtomicFileWriter file(path);
  std::vector<uint32_t> block(std::min(tokens.size(), kBlockTokens));
  for (size_t start = 0; start < tokens.size(); start += block.size()) {
    const size_t count = std::min(block.size(), tokens.size() - start);
    for (size_t i = 0; i < count; ++i) {
      CTXPLAN_CHECK(tokens[start + i] >= 0, "negative token id written to a data file");
      block[i] = static_cast<uint32_t>(tokens[start + i]);
    }
    file.stream().write(reinterpret_cast<const char*>(block.data()),
                        static_cast<std::streamsize>(count * 4));
  }
  file.Commit();
}

std::vector<int32_t> RandomTokens(int64_t vocab, int64_t n, uint64_t seed) {
  CTXPLAN_CHECK(vocab >= 1 && vocab <= INT32_MAX && n >= 0, "RandomTokens: bad vocab or n");
  Rng rng(seed);
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng.Below(static_cast<uint64_t>(vocab)));
  return tokens;
}

uint64_t StepSeed(uint64_t run_seed, int64_t step) {
  // Two rounds of splitmix64 over (seed, step): neighbouring steps and seeds decorrelate fully.
  Rng rng(run_seed ^ (static_cast<uint64_t>(step) * 0xd1b54a32d192ed03ull));
  rng.Next();
  return rng.Next();
}

RetrievalSample SyntheticRetrieval(int64_t vocab, int64_t n, uint64_t seed, bool label_filler) {
  if (vocab < 4 || vocab > INT32_MAX || n < 4)
    throw InputError(
        "synthetic retrieval task needs a vocabulary of at least 4 ids and a context "
        "of at least 4 tokens; got vocab " +
        std::to_string(vocab) + ", context " + std::to_string(n));
  const int64_t fillers = vocab / 2;
  const int64_t keys = (vocab - fillers) / 2;
  const int64_t values = vocab - fillers - keys;
  Rng rng(seed);
  RetrievalSample sample;
  sample.key = static_cast<int32_t>(fillers + static_cast<int64_t>(rng.Below(keys)));
  sample.value = static_cast<int32_t>(fillers + keys + static_cast<int64_t>(rng.Below(values)));
  const int64_t region = std::max<int64_t>(1, n / 20);
  sample.key_position = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(region)));
  sample.query_position = n - 1;

  sample.tokens.resize(static_cast<size_t>(n));
  for (int32_t& t : sample.tokens) t = static_cast<int32_t>(rng.Below(fillers));
  sample.tokens[sample.key_position] = sample.key;
  sample.tokens[sample.key_position + 1] = sample.value;
  sample.tokens[sample.query_position] = sample.key;

  sample.labels.assign(static_cast<size_t>(n), -1);
  if (label_filler)
    for (int64_t i = 0; i + 1 < n; ++i) sample.labels[i] = sample.tokens[i + 1];
  sample.labels[sample.query_position] = sample.value;
  return sample;
}

}  // namespace ctxplan
