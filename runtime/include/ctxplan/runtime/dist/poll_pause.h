// How a host thread that polls for the GPU or a peer (instead of blocking in CUDA, so that a
// dead peer cannot hang it) pauses between two polls. CUDA- and NCCL-free.
#pragma once

#include <algorithm>
#include <chrono>

namespace ctxplan::dist {

// A pause of zero means yield the core and poll again.
//
// Why yield for as long as 50 ms: the step's usual host waits are a layer-chunk long (the page
// selection's read-back waits for a layer's kernels, 1-30 ms). A millisecond's sleep there wakes
// half a millisecond late on average, with the GPU idle until the host issues the next kernels:
// 9.8 s of a 184 s step on 4x H200 at 4M tokens (8,160 waits a pass). Yielding costs the waiting
// rank's core, as CUDA's own spinning synchronisation does. Past 50 ms (a pipeline's bubbles, a
// neighbour's stall) the thread sleeps a hundredth of what it has waited, at most 1 ms: late by
// at most ~1% of the wait, and no core burnt on a long one.
inline std::chrono::microseconds PollPause(std::chrono::steady_clock::duration waited) {
  constexpr auto kYieldFor = std::chrono::milliseconds(50);
  constexpr auto kLongestSleep = std::chrono::microseconds(1000);
  if (waited < kYieldFor) return std::chrono::microseconds(0);
  return std::min(kLongestSleep,
                  std::chrono::duration_cast<std::chrono::microseconds>(waited) / 100);
}

}  // namespace ctxplan::dist
