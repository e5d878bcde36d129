#include "ctxplan/runtime/cuda/peer_links.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <system_error>
#include <thread>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/cuda/injected_fault.h"
#include "ctxplan/runtime/dist/poll_pause.h"
#include "ctxplan/runtime/dist/rendezvous.h"

namespace ctxplan::gpu {
namespace {

using Clock = std::chrono::steady_clock;

// The group this thread has open, if any: Send/Recv inside it defer their wait to End().
thread_local PeerGroup* t_open_group = nullptr;

// Scratch layout: the warm-up's send byte, one receive byte per pair slot, the all-reduce value.
constexpr size_t kWarmupSendOffset = 0;
constexpr size_t kWarmupRecvOffset = 16;
constexpr size_t kValueOffset = 64;
constexpr size_t kScratchBytes = 256;

std::string RankPrefix(int rank) {
  return "rank " + std::to_string(rank) + ": ";
}

// NCCL's last error ends in a newline and can be empty; messages stay one line.
std::string LastNcclError() {
  const char* text = ncclGetLastError(nullptr);
  std::string out = text == nullptr ? "" : text;
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  for (char& c : out)
    if (c == '\n' || c == '\r') c = ' ';
  return out;
}

std::string ResultText(ncclResult_t result) {
  std::string text = ncclGetErrorString(result);
  const std::string last = LastNcclError();
  if (!last.empty()) text += " (" + last + ")";
  return text;
}

// Before the first NCCL call of the process: NCCL reads its environment once.
void DisableNvls() {
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
}

ncclConfig_t NonBlockingConfig() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

struct DeviceCount {
  int count = 0;
  std::string why_none;  // cudaGetDeviceCount's error where it failed
};

DeviceCount CountDevices() {
  DeviceCount out;
  const cudaError_t status = cudaGetDeviceCount(&out.count);
  if (status != cudaSuccess) {
    out.count = 0;
    out.why_none = std::string(" (cudaGetDeviceCount: ") + cudaGetErrorString(status) + ")";
    (void)cudaGetLastError();  // no device is an answer here, not a sticky error
  }
  return out;
}

void Pause(Clock::time_point started) {
  const std::chrono::microseconds pause = dist::PollPause(Clock::now() - started);
  if (pause.count() == 0)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(pause);
}

}  // namespace

void ThrowNccl(ncclResult_t result, const char* call, const char* file, int line, int rank) {
  throw TrainingError((rank >= 0 ? RankPrefix(rank) : std::string()) + file + ":" +
                      std::to_string(line) + ": " + call + ": " + ResultText(result));
}

PeerLinks::PeerLinks(int rank, int world_size, int device, std::chrono::seconds timeout)
    : rank_(rank), world_size_(world_size), device_(device), timeout_(timeout) {
  inject_nccl_error_ = InjectedFaultFromEnvironment(rank) == InjectedFault::kNcclError;
  SetDevice();
  try {
    for (cudaStream_t& s : streams_)
      CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&world_stream_, cudaStreamNonBlocking));
    void* scratch = nullptr;
    CTXPLAN_CUDA_CHECK(cudaMalloc(&scratch, kScratchBytes));
    scratch_ = static_cast<std::byte*>(scratch);
    CTXPLAN_CUDA_CHECK(cudaMemset(scratch_, 0, kScratchBytes));
    void* host = nullptr;
    CTXPLAN_CUDA_CHECK(cudaMallocHost(&host, sizeof(double)));
    host_value_ = static_cast<double*>(host);
  } catch (...) {
    aborted_ = true;  // nothing of NCCL exists yet: the destructor only frees
    Finalize();
    throw;
  }
}

PeerLinks::~PeerLinks() {
  // Destroyed by an error unwinding the run (a CUDA error, a peer gone): the queued transfers
  // will never drain, and finalizing would wait out the whole timeout before aborting.
  if (std::uncaught_exceptions() > 0) Abort();
  Finalize();
}

void PeerLinks::SetDevice() const {
  CTXPLAN_CUDA_CHECK(cudaSetDevice(device_));
}

int PeerLinks::SlotOf(Stream s) {
  switch (s) {
    case Stream::kSendNext:
      return kSlotSendNext;
    case Stream::kRecvPrev:
      return kSlotRecvPrev;
    case Stream::kSendPrev:
      return kSlotSendPrev;
    case Stream::kRecvNext:
      return kSlotRecvNext;
    default:
      throw InternalError("PeerLinks: stream " + std::string(StreamName(s)) +
                          " is not a peer stream (send_next, recv_prev, send_prev, recv_next)");
  }
}

const char* PeerLinks::SlotName(int slot) {
  static constexpr const char* kNames[kSlotCount] = {"send_next", "recv_prev", "send_prev",
                                                     "recv_next"};
  return kNames[slot];
}

std::string PeerLinks::CommName(ncclComm_t comm) const {
  if (comm == world_) return "the world communicator";
  for (int slot = 0; slot < kSlotCount; ++slot) {
    if (comm != pair_[slot]) continue;
    const bool next = slot == kSlotSendNext || slot == kSlotRecvNext;
    return std::string("the ") + SlotName(slot) + " communicator (with rank " +
           std::to_string(next ? rank_ + 1 : rank_ - 1) + ")";
  }
  return "a communicator being created";
}

cudaStream_t PeerLinks::stream(Stream s) const {
  return streams_[SlotOf(s)];
}

bool PeerLinks::HasPeer(Stream s) const {
  const int slot = SlotOf(s);
  const bool next = slot == kSlotSendNext || slot == kSlotRecvNext;
  return next ? rank_ + 1 < world_size_ : rank_ > 0;
}

void PeerLinks::WaitReady(ncclComm_t comm, Clock::time_point deadline, const char* phase) {
  const auto started = Clock::now();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    CTXPLAN_NCCL_CHECK_RANK(rank_, ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      const std::string message =
          RankPrefix(rank_) + "NCCL error on " + CommName(comm) + ": " + ResultText(state);
      Abort();
      throw TrainingError(message);
    }
    if (Clock::now() >= deadline) {
      const std::string seconds = std::to_string(timeout_.count());
      const std::string message =
          phase != nullptr
              ? RankPrefix(rank_) + "NCCL did not connect within " + seconds + " s (" + phase + ")"
              : RankPrefix(rank_) + "NCCL did not start a transfer on " + CommName(comm) +
                    " within " + seconds + " s (the neighbour never posted its side?)";
      Abort();
      throw TrainingError(message);
    }
    Pause(started);
  }
}

void PeerLinks::AfterIssue(ncclComm_t comm, const char* phase) {
  if (t_open_group != nullptr) {
    t_open_group->issued_.push_back({this, comm, phase});
    return;
  }
  WaitReady(comm, Clock::now() + timeout_, phase);
}

void PeerLinks::RequireUsable(const char* what) const {
  if (aborted_)
    throw InternalError(
        RankPrefix(rank_) + what +
        " after the NCCL communicators were aborted (a TrainingError was ignored?)");
}

void PeerLinks::IssueSplit(int k) {
  // Splits 0 and 1 make the forward communicators of the even boundaries (0,1), (2,3), .. and of
  // the odd ones (1,2), (3,4), ..; splits 2 and 3 the backward ones. A rank belongs to at most one
  // boundary of each parity, so one split per parity and direction gives every boundary its own
  // communicator; the lower rank of a pair gets key order 0.
  const bool forward = k < 2;
  const int parity = k % 2;
  const int boundary = rank_ % 2 == parity ? rank_ : rank_ - 1;
  const bool member = boundary >= 0 && boundary + 1 < world_size_;
  const bool lower = boundary == rank_;
  split_slot_ = -1;
  ncclComm_t* child = &no_color_sink_;
  if (member) {
    split_slot_ =
        forward ? (lower ? kSlotSendNext : kSlotRecvPrev) : (lower ? kSlotRecvNext : kSlotSendPrev);
    child = &pair_[split_slot_];
  }
  ncclConfig_t config = NonBlockingConfig();
  SetDevice();
  CTXPLAN_NCCL_CHECK_RANK(
      rank_, ncclCommSplit(world_, member ? boundary : NCCL_SPLIT_NOCOLOR, rank_, child, &config));
  AfterIssue(world_, "splitting the pair communicators");
}

void PeerLinks::FinishSplit() {
  if (split_slot_ < 0) return;
  const int slot = split_slot_;
  split_slot_ = -1;
  ncclComm_t comm = pair_[slot];
  CTXPLAN_CHECK(comm != nullptr,
                RankPrefix(rank_) + "ncclCommSplit made no " + SlotName(slot) + " communicator");
  WaitReady(comm, Clock::now() + timeout_, "splitting the pair communicators");
  int count = 0, user_rank = -1;
  CTXPLAN_NCCL_CHECK_RANK(rank_, ncclCommCount(comm, &count));
  CTXPLAN_NCCL_CHECK_RANK(rank_, ncclCommUserRank(comm, &user_rank));
  const int expected = slot == kSlotSendNext || slot == kSlotRecvNext ? 0 : 1;
  CTXPLAN_CHECK(count == 2 && user_rank == expected,
                RankPrefix(rank_) + SlotName(slot) + " communicator has " + std::to_string(count) +
                    " ranks and this rank is " + std::to_string(user_rank) + " in it");
}

void PeerLinks::IssuePairWarmup() {
  SetDevice();
  for (int slot = 0; slot < kSlotCount; ++slot) {
    if (pair_[slot] == nullptr) continue;
    const int peer = slot == kSlotSendNext || slot == kSlotRecvNext ? 1 : 0;
    if (slot == kSlotSendNext || slot == kSlotSendPrev) {
      CTXPLAN_NCCL_CHECK_RANK(rank_, ncclSend(scratch_ + kWarmupSendOffset, 1, ncclUint8, peer,
                                              pair_[slot], streams_[slot]));
    } else {
      CTXPLAN_NCCL_CHECK_RANK(rank_, ncclRecv(scratch_ + kWarmupRecvOffset + slot, 1, ncclUint8,
                                              peer, pair_[slot], streams_[slot]));
    }
    AfterIssue(pair_[slot], "first exchange with the neighbour ranks");
  }
}

void PeerLinks::IssueWorldAllReduce(const char* phase) {
  SetDevice();
  double* value = reinterpret_cast<double*>(scratch_ + kValueOffset);
  CTXPLAN_NCCL_CHECK_RANK(
      rank_, ncclAllReduce(value, value, 1, ncclFloat64, ncclSum, world_, world_stream_));
  AfterIssue(world_, phase);
}

void PeerLinks::WaitAllStreams(std::chrono::seconds timeout) {
  for (cudaStream_t s : streams_) WaitStream(s, timeout);
  WaitStream(world_stream_, timeout);
}

std::unique_ptr<PeerLinks> PeerLinks::Connect(const dist::RankEnv& env,
                                              std::chrono::seconds timeout) {
  CTXPLAN_CHECK(timeout.count() > 0, "PeerLinks::Connect needs a positive timeout");
  CTXPLAN_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size,
                "PeerLinks::Connect: inconsistent RankEnv " + dist::Describe(env));
  DisableNvls();
  const DeviceCount devices = CountDevices();
  if (env.local_rank < 0 || env.local_rank >= devices.count) {
    throw InputError(RankPrefix(env.rank) +
                     "local rank LOCAL_RANK=" + std::to_string(env.local_rank) +
                     " names no CUDA device: this node has " + std::to_string(devices.count) +
                     devices.why_none + "; accepted: 0.." + std::to_string(devices.count - 1));
  }
  std::unique_ptr<PeerLinks> links(
      new PeerLinks(env.rank, env.world_size, env.local_rank, timeout));
  try {
    ncclUniqueId id{};
    if (env.rank == 0) CTXPLAN_NCCL_CHECK_RANK(env.rank, ncclGetUniqueId(&id));
    const std::vector<std::byte> shared =
        dist::ShareFromRankZero(env, std::as_bytes(std::span(&id, 1)), timeout);
    if (shared.size() != sizeof(id)) {
      throw dist::DistError(RankPrefix(env.rank) + "rank 0 handed out " +
                            std::to_string(shared.size()) + " bytes, not an ncclUniqueId (" +
                            std::to_string(sizeof(id)) + ")");
    }
    std::memcpy(&id, shared.data(), sizeof(id));

    ncclConfig_t config = NonBlockingConfig();
    links->SetDevice();
    CTXPLAN_NCCL_CHECK_RANK(
        env.rank, ncclCommInitRankConfig(&links->world_, env.world_size, id, env.rank, &config));
    links->AfterIssue(links->world_, "creating the world communicator");
    for (int k = 0; k < kSplitCount; ++k) {
      links->IssueSplit(k);
      links->FinishSplit();
    }
    {
      PeerGroup group;
      links->IssuePairWarmup();
      group.End();
    }
    links->IssueWorldAllReduce("first all-reduce of the world communicator");
    links->WaitAllStreams(timeout);
  } catch (...) {
    links->Abort();
    throw;
  }
  return links;
}

std::vector<std::unique_ptr<PeerLinks>> PeerLinks::ConnectLocal(int ranks,
                                                                std::chrono::seconds timeout) {
  CTXPLAN_CHECK(ranks >= 1, "PeerLinks::ConnectLocal needs at least one rank");
  CTXPLAN_CHECK(timeout.count() > 0, "PeerLinks::ConnectLocal needs a positive timeout");
  DisableNvls();
  const DeviceCount devices = CountDevices();
  if (ranks > devices.count) {
    throw InputError("PeerLinks::ConnectLocal: " + std::to_string(ranks) +
                     " ranks need as many CUDA devices; this machine has " +
                     std::to_string(devices.count) + devices.why_none);
  }
  std::vector<std::unique_ptr<PeerLinks>> links;
  for (int i = 0; i < ranks; ++i)
    links.push_back(std::unique_ptr<PeerLinks>(new PeerLinks(i, ranks, i, timeout)));
  try {
    ncclUniqueId id{};
    CTXPLAN_NCCL_CHECK(ncclGetUniqueId(&id));
    // One thread creates every rank: inside one group, as ncclCommInitAll does, since each
    // rank's init waits for all the others.
    {
      PeerGroup group;
      for (auto& l : links) {
        ncclConfig_t config = NonBlockingConfig();
        l->SetDevice();
        CTXPLAN_NCCL_CHECK_RANK(l->rank_,
                                ncclCommInitRankConfig(&l->world_, ranks, id, l->rank_, &config));
        l->AfterIssue(l->world_, "creating the world communicator");
      }
      group.End();
    }
    for (int k = 0; k < kSplitCount; ++k) {
      {
        PeerGroup group;  // ncclCommSplit is collective over the world
        for (auto& l : links) l->IssueSplit(k);
        group.End();
      }
      for (auto& l : links) l->FinishSplit();
    }
    {
      PeerGroup group;
      for (auto& l : links) l->IssuePairWarmup();
      group.End();
    }
    {
      PeerGroup group;
      for (auto& l : links) l->IssueWorldAllReduce("first all-reduce of the world communicator");
      group.End();
    }
    for (auto& l : links) l->WaitAllStreams(timeout);
  } catch (...) {
    for (auto& l : links) l->Abort();
    throw;
  }
  return links;
}

void PeerLinks::Transfer(int slot, void* data, size_t bytes, bool send) {
  const char* what = send ? "Send" : "Recv";
  RequireUsable(what);
  ncclComm_t comm = pair_[slot];
  if (comm == nullptr) {
    const bool next = slot == kSlotSendNext || slot == kSlotRecvNext;
    throw InternalError(RankPrefix(rank_) + what + " on " + SlotName(slot) + ": " +
                        (next ? "the last stage has no next rank" : "rank 0 has no previous rank"));
  }
  if (bytes == 0) return;  // both sides know the size: nothing to match
  CTXPLAN_CHECK(data != nullptr, RankPrefix(rank_) + what + " of " + std::to_string(bytes) +
                                     " bytes from a null buffer");
  int peer = slot == kSlotSendNext || slot == kSlotRecvNext ? 1 : 0;
  if (std::exchange(inject_nccl_error_, false)) peer = 2;  // a pair communicator has ranks 0, 1
  SetDevice();
  if (send) {
    CTXPLAN_NCCL_CHECK_RANK(rank_, ncclSend(data, bytes, ncclUint8, peer, comm, streams_[slot]));
  } else {
    CTXPLAN_NCCL_CHECK_RANK(rank_, ncclRecv(data, bytes, ncclUint8, peer, comm, streams_[slot]));
  }
  AfterIssue(comm, nullptr);
}

void PeerLinks::Send(Stream s, const void* data, size_t bytes) {
  const int slot = SlotOf(s);
  if (slot != kSlotSendNext && slot != kSlotSendPrev)
    throw InternalError(RankPrefix(rank_) + "Send on " + SlotName(slot) +
                        ": not a send direction (send_next, send_prev)");
  Transfer(slot, const_cast<void*>(data), bytes, /*send=*/true);
}

void PeerLinks::Recv(Stream s, void* data, size_t bytes) {
  const int slot = SlotOf(s);
  if (slot != kSlotRecvPrev && slot != kSlotRecvNext)
    throw InternalError(RankPrefix(rank_) + "Recv on " + SlotName(slot) +
                        ": not a receive direction (recv_prev, recv_next)");
  Transfer(slot, data, bytes, /*send=*/false);
}

double PeerLinks::AllReduceSum(double value) {
  RequireUsable("AllReduceSum");
  CTXPLAN_CHECK(t_open_group == nullptr,
                RankPrefix(rank_) + "AllReduceSum inside a PeerGroup (it waits for its result)");
  SetDevice();
  double* device_value = reinterpret_cast<double*>(scratch_ + kValueOffset);
  *host_value_ = value;
  CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(device_value, host_value_, sizeof(double),
                                     cudaMemcpyHostToDevice, world_stream_));
  IssueWorldAllReduce(nullptr);
  CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(host_value_, device_value, sizeof(double),
                                     cudaMemcpyDeviceToHost, world_stream_));
  WaitStream(world_stream_, timeout_);
  return *host_value_;
}

void PeerLinks::AllReduceSumInPlace(void* data, size_t count, bool fp32, cudaStream_t after) {
  RequireUsable("AllReduceSumInPlace");
  CTXPLAN_CHECK(t_open_group == nullptr,
                RankPrefix(rank_) + "AllReduceSumInPlace inside a PeerGroup (it waits for it)");
  SetDevice();
  cudaEvent_t ready = nullptr;
  CTXPLAN_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(ready, after);
  const cudaError_t ordered =
      recorded == cudaSuccess ? cudaStreamWaitEvent(world_stream_, ready, 0) : recorded;
  CTXPLAN_CUDA_CHECK(cudaEventDestroy(ready));  // freed once the wait it orders has happened
  CTXPLAN_CUDA_CHECK(ordered);
  CTXPLAN_NCCL_CHECK_RANK(rank_, ncclAllReduce(data, data, count, fp32 ? ncclFloat32 : ncclBfloat16,
                                               ncclSum, world_, world_stream_));
  AfterIssue(world_, nullptr);
  WaitStream(world_stream_, timeout_);
}

void PeerLinks::Barrier() {
  (void)AllReduceSum(0.0);
}

void PeerLinks::CheckHealthy() {
  if (aborted_) throw TrainingError(RankPrefix(rank_) + "the NCCL communicators were aborted");
  std::array<ncclComm_t, kSlotCount + 1> comms{};
  std::copy(pair_.begin(), pair_.end(), comms.begin());
  comms[kSlotCount] = world_;
  for (ncclComm_t comm : comms) {
    if (comm == nullptr) continue;
    ncclResult_t state = ncclSuccess;
    CTXPLAN_NCCL_CHECK_RANK(rank_, ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess || state == ncclInProgress) continue;
    const std::string message =
        RankPrefix(rank_) + "NCCL error on " + CommName(comm) + ": " + ResultText(state);
    Abort();
    throw TrainingError(message);
  }
}

void PeerLinks::WaitStream(cudaStream_t s, std::chrono::seconds timeout) {
  WaitUntil([s] { return cudaStreamQuery(s); }, timeout);
}

void PeerLinks::WaitEvent(cudaEvent_t e, std::chrono::seconds timeout) {
  WaitUntil([e] { return cudaEventQuery(e); }, timeout);
}

void PeerLinks::WaitUntil(const std::function<cudaError_t()>& query, std::chrono::seconds timeout) {
  SetDevice();
  const auto started = Clock::now();
  const auto deadline = started + timeout;
  for (;;) {
    const cudaError_t status = query();
    if (status != cudaErrorNotReady) CTXPLAN_CUDA_CHECK(status);
    CheckHealthy();
    if (status == cudaSuccess) return;
    if (Clock::now() >= deadline) {
      Abort();
      throw TrainingError(RankPrefix(rank_) + "no progress for " + std::to_string(timeout.count()) +
                          " s (a peer rank died or hung?)");
    }
    Pause(started);
  }
}

void PeerLinks::Abort() {
  if (aborted_) return;
  aborted_ = true;
  // All communicators at once, one thread each. ncclCommAbort sets its communicator's abort flag
  // and then frees its device memory; cudaFree waits for every kernel on the device, also another
  // communicator's transfer still waiting for a dead peer, which only exits once its own flag is
  // set. Aborted one after the other, the first free would wait for the second abort forever.
  // A split still running writes its child handle only once the world abort has stopped it: that
  // child is aborted in a second round.
  std::array<ncclComm_t*, kSlotCount + 2> handles{};
  for (int slot = 0; slot < kSlotCount; ++slot) handles[slot] = &pair_[slot];
  handles[kSlotCount] = &world_;
  handles[kSlotCount + 1] = &no_color_sink_;
  ncclComm_t* pending_child = split_slot_ >= 0 ? &pair_[split_slot_] : &no_color_sink_;
  for (int round = 0; round < 2; ++round) {
    std::vector<std::thread> aborts;
    for (ncclComm_t* handle : handles) {
      if (round == 0 && handle == pending_child) continue;
      const ncclComm_t comm = *handle;
      if (comm == nullptr) continue;
      *handle = nullptr;
      auto abort = [comm, device = device_] {
        (void)cudaSetDevice(device);
        (void)ncclCommAbort(comm);
      };
      try {
        aborts.emplace_back(abort);
      } catch (const std::system_error&) {
        abort();  // no thread to be had: inline, hoping no kernel of the others is stuck
      }
    }
    for (std::thread& t : aborts) t.join();
  }
  split_slot_ = -1;
}

void PeerLinks::Finalize() noexcept {
  (void)cudaSetDevice(device_);
  if (!aborted_) {
    // ncclCommFinalize flushes this rank's queued work and needs no peer; bounded all the same,
    // since a transfer whose peer is gone never drains. Issued on every communicator before
    // polling any, so that they drain together.
    std::vector<ncclComm_t> comms;
    for (ncclComm_t comm : pair_)
      if (comm != nullptr) comms.push_back(comm);
    if (world_ != nullptr) comms.push_back(world_);
    bool clean = true;
    for (ncclComm_t comm : comms) {
      const ncclResult_t result = ncclCommFinalize(comm);
      if (result != ncclSuccess && result != ncclInProgress) clean = false;
    }
    const auto started = Clock::now();
    const auto deadline = started + timeout_;
    for (ncclComm_t comm : comms) {
      while (clean) {
        ncclResult_t state = ncclInternalError;
        if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
        if (state == ncclSuccess) break;
        if (state != ncclInProgress || Clock::now() >= deadline) clean = false;
        Pause(started);
      }
    }
    if (clean) {
      for (ncclComm_t comm : comms) (void)ncclCommDestroy(comm);
      world_ = nullptr;
      pair_.fill(nullptr);
      aborted_ = true;  // released: nothing left for Abort
    } else {
      Abort();  // allowed after ncclCommFinalize, and frees what it did not
    }
  }
  for (cudaStream_t& s : streams_) {
    if (s != nullptr) (void)cudaStreamDestroy(s);
    s = nullptr;
  }
  if (world_stream_ != nullptr) (void)cudaStreamDestroy(world_stream_);
  world_stream_ = nullptr;
  if (scratch_ != nullptr) (void)cudaFree(scratch_);
  scratch_ = nullptr;
  if (host_value_ != nullptr) (void)cudaFreeHost(host_value_);
  host_value_ = nullptr;
}

PeerGroup::PeerGroup() {
  if (t_open_group != nullptr) throw InternalError("PeerGroup inside another PeerGroup");
  CTXPLAN_NCCL_CHECK(ncclGroupStart());
  t_open_group = this;
}

PeerGroup::~PeerGroup() {
  if (ended_) return;
  t_open_group = nullptr;
  // Unwinding: what was issued launches now, half of a matched pair perhaps; abort those links so
  // that nothing is left waiting for a peer that will never come.
  (void)ncclGroupEnd();
  for (const Issued& issued : issued_) issued.links->Abort();
}

void PeerGroup::End() {
  CTXPLAN_CHECK(!ended_ && t_open_group == this, "PeerGroup::End called twice");
  ended_ = true;
  t_open_group = nullptr;
  const ncclResult_t result = ncclGroupEnd();
  if (result != ncclSuccess && result != ncclInProgress) {
    const int rank = issued_.empty() ? -1 : issued_.front().links->rank();
    for (const Issued& issued : issued_) issued.links->Abort();
    ThrowNccl(result, "ncclGroupEnd()", __FILE__, __LINE__, rank);
  }
  const auto now = Clock::now();
  try {
    for (const Issued& issued : issued_) {
      if (issued.links->aborted()) continue;
      issued.links->WaitReady(issued.comm, now + issued.links->timeout(), issued.phase);
    }
  } catch (...) {
    // One thread drove these ranks together: if one is stuck, the others wait for it.
    for (const Issued& issued : issued_) issued.links->Abort();
    throw;
  }
}

}  // namespace ctxplan::gpu
