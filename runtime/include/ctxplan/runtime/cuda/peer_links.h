// The NCCL links of one pipeline stage (one process per GPU, rank r = stage r): activations go to
// stage r+1 and their gradients come back. Each boundary (r, r+1) has two 2-rank communicators of
// its own, one per direction, each used by one stream on each side, so every communicator's calls
// happen in one order on one stream on both of its ranks: the forward and backward traffic of a
// boundary can never wait on each other inside NCCL. A world communicator carries the loss
// all-reduce and the barrier.
//
// Every communicator is non-blocking (ncclConfig_t::blocking = 0), so no NCCL call can wait for a
// peer forever on the host: connecting, splitting and enqueueing are polled against a deadline,
// and WaitStream replaces cudaStreamSynchronize with a poll that aborts the communicators when a
// peer stops answering. A rank that dies or hangs turns into a TrainingError on its neighbours,
// never into a hang.
//
// The price of non-blocking communicators: NCCL may return from ncclSend/ncclRecv before it has
// put the kernel on the stream (it finishes in a thread of its own). Send and Recv therefore wait
// until NCCL has enqueued the operation, so that work recorded on the stream after them (events,
// copies) is ordered after the transfer, as with any stream operation. NCCL starts a host thread
// per non-blocking call: about 60 us of host time per Send/Recv (measured on 2 H200s, 4 KiB);
// a PeerGroup pays it once for all the transfers it holds.
//
// NVLink multicast (NVLS) stays off: Connect and ConnectLocal set NCCL_NVLS_ENABLE=0 before the
// first NCCL call, and nothing here registers memory or uses symmetric/multicast features. A
// program that uses multicast can take the shared host's GPUs out of service.
//
// Not thread-safe: one host thread drives a PeerLinks (ConnectLocal's tests drive several from
// one thread, inside a PeerGroup, or one thread each).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ctxplan/runtime/dist/rank_env.h"
#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/runtime/plan/step_backend.h"

namespace ctxplan::gpu {

// Throws TrainingError, one line: "rank 1: .../peer_links.cpp:120: ncclSend(...): remote process
// exited or there was a network error (<ncclGetLastError>)"; without the rank prefix when
// rank < 0. ncclInProgress is not an error to the macros below: non-blocking communicators return
// it while NCCL finishes the call in the background (poll ncclCommGetAsyncError).
[[noreturn]] void ThrowNccl(ncclResult_t result, const char* call, const char* file, int line,
                            int rank = -1);

}  // namespace ctxplan::gpu

#define CTXPLAN_NCCL_CHECK(call)                                                       \
  do {                                                                                 \
    const ncclResult_t ctxplan_nccl_status_ = (call);                                  \
    if (ctxplan_nccl_status_ != ncclSuccess && ctxplan_nccl_status_ != ncclInProgress) \
      ::ctxplan::gpu::ThrowNccl(ctxplan_nccl_status_, #call, __FILE__, __LINE__);      \
  } while (false)

// The same, naming the rank whose call failed (messages from several ranks end in one log).
#define CTXPLAN_NCCL_CHECK_RANK(rank, call)                                               \
  do {                                                                                    \
    const ncclResult_t ctxplan_nccl_status_ = (call);                                     \
    if (ctxplan_nccl_status_ != ncclSuccess && ctxplan_nccl_status_ != ncclInProgress)    \
      ::ctxplan::gpu::ThrowNccl(ctxplan_nccl_status_, #call, __FILE__, __LINE__, (rank)); \
  } while (false)

namespace ctxplan::gpu {

class PeerLinks {
 public:
  // One process per GPU: selects GPU env.local_rank, shares rank 0's ncclUniqueId through
  // dist::ShareFromRankZero, creates the world communicator and the pair communicators, and makes
  // one small exchange on each so that NCCL's lazy connections exist before the first real
  // transfer. Collective: every rank of env calls it. `timeout` bounds the rendezvous and each
  // NCCL phase (init, each split, the first exchange).
  // InputError: env.local_rank is not a CUDA device of this node. dist::DistError: the
  // rendezvous failed. TrainingError: NCCL failed or did not finish a phase in time (then every
  // communicator made so far is aborted).
  static std::unique_ptr<PeerLinks> Connect(const dist::RankEnv& env, std::chrono::seconds timeout);

  // Tests: `ranks` ranks in this process, rank i on device i, driven from one thread. The world
  // communicators are made like ncclCommInitAll does (one id, ncclCommInitRankConfig per device
  // inside one group), since ncclCommInitAll takes no config and its blocking communicators could
  // not be grouped with the non-blocking pair communicators. `timeout` is each links' timeout
  // (connecting, enqueueing, AllReduceSum) as in Connect.
  // InputError: fewer than `ranks` CUDA devices. InternalError: ranks < 1.
  static std::vector<std::unique_ptr<PeerLinks>> ConnectLocal(
      int ranks, std::chrono::seconds timeout = std::chrono::seconds(30));

  PeerLinks(const PeerLinks&) = delete;
  PeerLinks& operator=(const PeerLinks&) = delete;
  // Finalizes and destroys the communicators (bounded by the timeout; past it they are aborted);
  // aborts them at once when destroyed by an exception's unwinding; only frees the streams and
  // buffers once aborted. Never throws.
  ~PeerLinks();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }
  std::chrono::seconds timeout() const { return timeout_; }

  // The in-order stream of a peer direction: kSendNext, kRecvPrev, kSendPrev or kRecvNext
  // (non-blocking streams on device()). InternalError for any other Stream.
  cudaStream_t stream(Stream s) const;
  // Whether the neighbour of direction `s` exists (rank 0 has no previous stage, the last rank no
  // next one).
  bool HasPeer(Stream s) const;

  // Stream-ordered transfer of `bytes` bytes (bf16 tensors are sent as their bytes) to or from the
  // neighbour: Send on kSendNext (to rank+1) or kSendPrev (to rank-1), Recv on kRecvPrev (from
  // rank-1) or kRecvNext (from rank+1). The matching call on the neighbour must have the same
  // size. Returns once NCCL has put the transfer on stream(s) (inside a PeerGroup: once the group
  // ends), not when the bytes have arrived: wait on the stream or record an event on it.
  // InternalError: a direction that is not a send (Send) or receive (Recv) direction, a missing
  // neighbour, or links already aborted. TrainingError: NCCL failed, or did not enqueue within
  // timeout() (a neighbour that never posted its side of a first connection).
  void Send(Stream s, const void* data, size_t bytes);
  void Recv(Stream s, void* data, size_t bytes);

  // The sum of `value` over all ranks (the step's loss). Collective over the world; synchronous,
  // bounded by timeout() like WaitStream. Not inside a PeerGroup.
  double AllReduceSum(double value);
  // Returns once every rank has called it (a one-value all-reduce; NCCL has no barrier).
  void Barrier();
  // Sums `count` elements (fp32, or bf16 when !fp32) of device buffer `data` over all ranks, in
  // place, after the work queued on `after` (a stream of device()). Collective over the world;
  // returns once done on this rank, bounded by timeout() like WaitStream. Not inside a
  // PeerGroup. With two ranks each element is one sum of the two: both get the same bits.
  void AllReduceSumInPlace(void* data, size_t count, bool fp32, cudaStream_t after);

  // Throws TrainingError "rank R: NCCL error on <communicator>: <cause>" when any communicator
  // has an asynchronous error (a peer that exited, a network failure), after aborting them all:
  // NCCL leaves a failed communicator unusable, and its kernels must be stopped for the streams
  // to drain. Also throws once the links were aborted.
  void CheckHealthy();

  // Returns when everything enqueued on `s` (any stream of device(), not only the peer ones) has
  // completed. Polls the stream and CheckHealthy about every millisecond instead of blocking in
  // cudaStreamSynchronize, which would hang forever on a transfer whose peer is gone. Past
  // `timeout` it aborts every communicator (their kernels then exit) and throws TrainingError
  // "rank R: no progress for N s (a peer rank died or hung?)".
  void WaitStream(cudaStream_t s, std::chrono::seconds timeout);
  // cudaEventSynchronize, bounded the same way.
  void WaitEvent(cudaEvent_t e, std::chrono::seconds timeout);

  // ncclCommAbort on every communicator, all at once (one after the other can hang: see the
  // .cpp): pending transfers are cancelled, the links are unusable afterwards. Idempotent.
  void Abort();
  bool aborted() const { return aborted_; }

 private:
  friend class PeerGroup;

  // Index of the four pair communicators and their streams.
  enum Slot : int { kSlotSendNext, kSlotRecvPrev, kSlotSendPrev, kSlotRecvNext, kSlotCount };
  static constexpr int kSplitCount = 4;

  PeerLinks(int rank, int world_size, int device, std::chrono::seconds timeout);

  static int SlotOf(Stream s);
  static const char* SlotName(int slot);
  std::string CommName(ncclComm_t comm) const;
  void SetDevice() const;
  void RequireUsable(const char* what) const;
  // Split k (0..3) of the world communicator: forward or backward direction, even or odd
  // boundaries. FinishSplit checks the child once the split has completed.
  void IssueSplit(int k);
  void FinishSplit();
  // The 1-byte exchange on every pair communicator; the world all-reduce of the scratch value.
  void IssuePairWarmup();
  void IssueWorldAllReduce(const char* phase);
  void Transfer(int slot, void* data, size_t bytes, bool send);
  // After an NCCL call on `comm`: inside a PeerGroup, leaves the wait to its End(); otherwise
  // waits (WaitReady) until NCCL has finished the call. `phase` names a connection step for the
  // timeout message; nullptr for a transfer.
  void AfterIssue(ncclComm_t comm, const char* phase);
  // Polls `comm` until NCCL has finished the call in progress on it. TrainingError, after Abort,
  // on an NCCL error or past `deadline`.
  void WaitReady(ncclComm_t comm, std::chrono::steady_clock::time_point deadline,
                 const char* phase);
  void WaitAllStreams(std::chrono::seconds timeout);
  void Finalize() noexcept;

  // Polls `query` (cudaStreamQuery or cudaEventQuery) until it succeeds; the peers' health
  // checked between polls; past `timeout`, Abort and TrainingError.
  void WaitUntil(const std::function<cudaError_t()>& query, std::chrono::seconds timeout);

  int rank_;
  int world_size_;
  int device_;
  std::chrono::seconds timeout_;
  bool aborted_ = false;
  bool inject_nccl_error_ =
      false;  // CTXPLAN_INJECT_FAULT=nccl-error: the first transfer's peer is invalid
  ncclComm_t world_ = nullptr;
  // ncclCommSplit writes the child handle when the split completes, from NCCL's thread: these
  // must stay where they are until then (a PeerLinks never moves: it lives behind unique_ptr).
  std::array<ncclComm_t, kSlotCount> pair_{};
  ncclComm_t no_color_sink_ = nullptr;
  int split_slot_ = -1;  // the slot the split in progress fills; -1: none (not a member)
  std::array<cudaStream_t, kSlotCount> streams_{};
  cudaStream_t world_stream_ = nullptr;
  // Device scratch: the warm-up bytes and the all-reduce value; pinned host copy of the value
  // (a pageable copy would block the host until the all-reduce finished, defeating the timeout).
  std::byte* scratch_ = nullptr;
  double* host_value_ = nullptr;
};

// Issues the Send/Recv calls made on this thread between its construction and End() as one NCCL
// group (ncclGroupStart/ncclGroupEnd). Needed where one thread issues both sides of a transfer
// (ConnectLocal tests): NCCL connects a pair only once both sides are posted, and a thread that
// waited for its first call to be enqueued would never reach the second. Also batches
// several transfers of one rank into one launch. Not nestable; not for AllReduceSum or Barrier.
class PeerGroup {
 public:
  PeerGroup();
  PeerGroup(const PeerGroup&) = delete;
  PeerGroup& operator=(const PeerGroup&) = delete;
  // Without End() (an exception unwinding): closes the NCCL group, so that this thread's next
  // NCCL call is not swallowed into it, and aborts the links it issued on, whose peers may never
  // see their half of a transfer.
  ~PeerGroup();
  // ncclGroupEnd, then waits until NCCL has enqueued every call of the group (each links'
  // timeout). TrainingError as PeerLinks::Send.
  void End();

 private:
  friend class PeerLinks;
  struct Issued {
    PeerLinks* links;
    ncclComm_t comm;
    const char* phase;
  };
  std::vector<Issued> issued_;
  bool ended_ = false;
};

}  // namespace ctxplan::gpu
