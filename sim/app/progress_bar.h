// A one-line progress bar on stderr, drawn only when stderr is a terminal (scripts and CI logs
// get nothing).
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace ctxplan::cli {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total)
      : label_(std::move(label)), total_(total), enabled_(isatty(STDERR_FILENO) == 1) {}
  ~ProgressBar() { Done(); }

  void Update(int64_t done) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (done < total_ && now - last_draw_ < std::chrono::milliseconds(50)) return;
    last_draw_ = now;
    constexpr int kWidth = 40;
    const int filled = total_ > 0 ? static_cast<int>(kWidth * done / total_) : kWidth;
    std::string bar(static_cast<size_t>(filled), '=');
    bar.resize(kWidth, ' ');
    std::fprintf(stderr, "\r%s [%s] %lld/%lld", label_.c_str(), bar.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_));
    std::fflush(stderr);
    drawn_ = true;
  }
  void Done() {
    if (drawn_) std::fprintf(stderr, "\n");
    drawn_ = false;
  }

 private:
  std::string label_;
  int64_t total_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace ctxplan::cli
