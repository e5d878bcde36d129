// The CUDA backend's view of a pipeline stage's neighbours (StagePeers), on the NCCL links of
// peer_links.h. Kept apart from both so that the backend builds without NCCL.
#pragma once

#include <chrono>
#include <span>

#include "ctxplan/runtime/cuda/cuda_backend.h"
#include "ctxplan/runtime/cuda/peer_links.h"

namespace ctxplan::gpu {

class NcclStagePeers final : public StagePeers {
 public:
  // `timeout`: how long a wait may see no progress before it calls a peer dead.
  NcclStagePeers(PeerLinks& links, std::chrono::seconds timeout)
      : links_(links), timeout_(timeout) {}

  int rank() const override { return links_.rank(); }
  int world_size() const override { return links_.world_size(); }
  // nullptr for a direction without a neighbour (the first stage has no previous one).
  void* stream(Stream s) const override { return links_.HasPeer(s) ? links_.stream(s) : nullptr; }
  void Send(Stream s, const void* data, size_t bytes) override { links_.Send(s, data, bytes); }
  void Recv(Stream s, void* data, size_t bytes) override { links_.Recv(s, data, bytes); }
  void Synchronize(std::span<void* const> streams) override {
    for (void* s : streams) links_.WaitStream(static_cast<cudaStream_t>(s), timeout_);
  }
  void WaitEvent(void* event) override {
    links_.WaitEvent(static_cast<cudaEvent_t>(event), timeout_);
  }
  void AllReduceSum(void* data, size_t count, bool fp32, void* after) override {
    links_.AllReduceSumInPlace(data, count, fp32, static_cast<cudaStream_t>(after));
  }
  void Abort() noexcept override { links_.Abort(); }

 private:
  PeerLinks& links_;
  std::chrono::seconds timeout_;
};

}  // namespace ctxplan::gpu
