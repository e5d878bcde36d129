#include "measure_common.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>

namespace ctxplan::calibrate {

namespace {

// xorshift64: fast enough that a 1M-value pattern costs a few milliseconds per buffer.
class Xorshift {
 public:
  explicit Xorshift(uint32_t seed) : s_(uint64_t{seed} * 0x9E3779B97F4A7C15ull + 1) {}
  double Uniform() {  // [0, 1)
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return static_cast<double>(s_ >> 11) * 0x1.0p-53;
  }

 private:
  uint64_t s_;
};

constexpr size_t kPatternElements = size_t{1} << 20;

// The host pattern (up to kPatternElements values) copied to dst, then doubled on the device
// until n elements are filled.
template <typename T, typename Make>
void FillWith(T* dst, size_t n, uint32_t seed, Make make) {
  if (n == 0) return;
  const size_t pattern = std::min(n, kPatternElements);
  std::vector<T> host(pattern);
  Xorshift rng(seed);
  for (T& v : host) v = make(rng.Uniform());
  CTXPLAN_CUDA_CHECK(cudaMemcpy(dst, host.data(), pattern * sizeof(T), cudaMemcpyHostToDevice));
  for (size_t filled = pattern; filled < n; filled *= 2) {
    const size_t count = std::min(filled, n - filled);
    CTXPLAN_CUDA_CHECK(cudaMemcpy(dst + filled, dst, count * sizeof(T), cudaMemcpyDeviceToDevice));
  }
}

}  // namespace

void Fill(bf16* dst, size_t n, double lo, double hi, uint32_t seed) {
  FillWith(dst, n, seed,
           [&](double u) { return __float2bfloat16(static_cast<float>(lo + (hi - lo) * u)); });
}

void Fill(float* dst, size_t n, double lo, double hi, uint32_t seed) {
  FillWith(dst, n, seed, [&](double u) { return static_cast<float>(lo + (hi - lo) * u); });
}

void Fill(int32_t* dst, size_t n, double lo, double hi, uint32_t seed) {
  FillWith(dst, n, seed,
           [&](double u) { return static_cast<int32_t>(std::floor(lo + (hi - lo) * u)); });
}

PinnedHost::PinnedHost(size_t bytes) {
  CTXPLAN_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&ptr_), bytes, cudaHostAllocPortable));
  // Touched, and not zeros (the copy engines do not care, but nothing here should be special).
  std::memset(ptr_, 0x5a, bytes);
}

PinnedHost::~PinnedHost() {
  if (ptr_ != nullptr) (void)cudaFreeHost(ptr_);
}

double MedianSecondsPerCall(Session& session, const std::function<void(int64_t)>& call,
                            int64_t batch) {
  cudaStream_t stream = session.stream;
  cudaEvent_t start = nullptr, stop = nullptr;
  CTXPLAN_CUDA_CHECK(cudaEventCreate(&start));
  CTXPLAN_CUDA_CHECK(cudaEventCreate(&stop));
  // Destroys the events on every path (a kernel may throw std::invalid_argument on the first
  // call: the shape is then skipped and the run goes on).
  struct Events {
    cudaEvent_t a, b;
    ~Events() {
      (void)cudaEventDestroy(a);
      (void)cudaEventDestroy(b);
    }
  } events{start, stop};
  auto elapsed = [&] {
    CTXPLAN_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CTXPLAN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return static_cast<double>(ms) * 1e-3;
  };

  int64_t index = 0;
  call(index++);  // warm-up
  CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (batch <= 0) {
    CTXPLAN_CUDA_CHECK(cudaEventRecord(start, stream));
    call(index++);
    CTXPLAN_CUDA_CHECK(cudaEventRecord(stop, stream));
    const double probe = std::max(elapsed(), 1e-7);
    const double batch_seconds = session.sustain_seconds > 0
                                     ? 0.5 * session.sustain_seconds / session.reps
                                     : kMinBatchSeconds;
    batch = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(batch_seconds / probe)), 1,
                                session.sustain_seconds > 0 ? kMaxBatch * 10 : kMaxBatch);
  }
  if (session.sustain_seconds > 0) {  // heat: back to back until clock and power settle
    const auto start = std::chrono::steady_clock::now();
    while (SecondsSince(start) < 0.5 * session.sustain_seconds) {
      for (int64_t i = 0; i < batch / session.reps + 1; ++i) call(index++);
      CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  }
  std::vector<double> per_call;
  if (session.clocks != nullptr) session.clocks->Begin();
  for (int r = 0; r < session.reps; ++r) {
    CTXPLAN_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int64_t i = 0; i < batch; ++i) call(index++);
    CTXPLAN_CUDA_CHECK(cudaEventRecord(stop, stream));
    per_call.push_back(elapsed() / static_cast<double>(batch));
  }
  if (session.clocks != nullptr) session.last_window = session.clocks->End();
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

double MedianWallSeconds(int reps, const std::function<double()>& once) {
  (void)once();  // warm-up
  std::vector<double> seconds;
  for (int r = 0; r < reps; ++r) seconds.push_back(once());
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

double SecondsSince(const std::chrono::steady_clock::time_point& start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

Progress::Progress(std::string group, size_t total)
    : group_(std::move(group)), total_(total), terminal_(isatty(STDERR_FILENO) == 1) {}

Progress::~Progress() {
  EndLine();
}

void Progress::Step(const std::string& what) {
  ++done_;
  if (terminal_) {
    // \033[K clears what a longer previous line left.
    std::fprintf(stderr, "\r[%s] %zu/%zu %s\033[K", group_.c_str(), done_, total_, what.c_str());
    open_line_ = true;
  } else {
    std::fprintf(stderr, "[%s] %zu/%zu %s\n", group_.c_str(), done_, total_, what.c_str());
  }
  std::fflush(stderr);
}

void Progress::Note(const std::string& line) {
  EndLine();
  std::fprintf(stderr, "[%s] note: %s\n", group_.c_str(), line.c_str());
  std::fflush(stderr);
}

void Progress::EndLine() {
  if (!open_line_) return;
  std::fprintf(stderr, "\n");
  open_line_ = false;
}

std::string Describe(const std::string& op,
                     std::initializer_list<std::pair<const char*, int64_t>> fields) {
  std::string s = op;
  for (const auto& [name, value] : fields) {
    s += ' ';
    s += name;
    s += '=';
    s += std::to_string(value);
  }
  return s;
}

}  // namespace ctxplan::calibrate
