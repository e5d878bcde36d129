// The NCCL links between pipeline stages, all ranks in this process (PeerLinks::ConnectLocal, rank
// i on GPU i). The multi-GPU tests skip themselves with fewer than 2 GPUs; every test is bounded
// by timeouts well under 20 s, so a broken link fails instead of hanging ctest.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/gpu.h"

#if defined(CTXPLAN_HAVE_NCCL)
#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/cuda/peer_links.h"
#endif

namespace ctxplan::gpu {
namespace {

#if defined(CTXPLAN_HAVE_NCCL)

int GpuCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  (void)cudaGetLastError();  // no device is not an error for the tests that follow
  return count;
}

#define SKIP_WITHOUT_TWO_GPUS()                                                   \
  do {                                                                            \
    const int gpus = GpuCount();                                                  \
    if (gpus < 2) GTEST_SKIP() << "needs 2 CUDA GPUs; this machine has " << gpus; \
  } while (false)

using std::chrono::seconds;

constexpr seconds kConnectTimeout{10};
constexpr seconds kWaitTimeout{10};

// Every GPU of the machine, up to 8 (one pipeline stage each).
int AllRanks() {
  return std::min(GpuCount(), 8);
}

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t word = rng();
    for (size_t j = 0; j < 8 && i + j < n; ++j) out[i + j] = static_cast<uint8_t>(word >> (8 * j));
  }
  return out;
}

// A device allocation on one GPU, filled from and read back to the host.
class DeviceBytes {
 public:
  DeviceBytes(int device, size_t bytes) : device_(device), bytes_(bytes) {
    CTXPLAN_CUDA_CHECK(cudaSetDevice(device_));
    CTXPLAN_CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(bytes_, 1)));
    CTXPLAN_CUDA_CHECK(cudaMemset(ptr_, 0, std::max<size_t>(bytes_, 1)));
  }
  DeviceBytes(int device, const std::vector<uint8_t>& host) : DeviceBytes(device, host.size()) {
    CTXPLAN_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice));
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() {
    (void)cudaSetDevice(device_);
    (void)cudaFree(ptr_);
  }
  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }
  std::vector<uint8_t> Read() const {
    std::vector<uint8_t> host(bytes_);
    CTXPLAN_CUDA_CHECK(cudaSetDevice(device_));
    CTXPLAN_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  int device_;
  size_t bytes_;
  void* ptr_ = nullptr;
};

// fn(rank) on one thread per rank, as the one-process-per-GPU runtime drives its links (no
// groups): each rank's calls wait only for its own side. Rethrows the first failure.
void OnEachRank(int ranks, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

void WaitAll(PeerLinks& links) {
  for (Stream s : {Stream::kSendNext, Stream::kRecvPrev, Stream::kSendPrev, Stream::kRecvNext})
    links.WaitStream(links.stream(s), kWaitTimeout);
}

TEST(PeerLinksTest, OneRankHasNoNeighbours) {
  SKIP_WITHOUT_GPU();
  auto links = PeerLinks::ConnectLocal(1, kConnectTimeout);
  ASSERT_EQ(links.size(), 1u);
  PeerLinks& l = *links[0];
  EXPECT_EQ(l.rank(), 0);
  EXPECT_EQ(l.world_size(), 1);
  EXPECT_EQ(l.device(), 0);
  std::vector<cudaStream_t> streams;
  for (Stream s : {Stream::kSendNext, Stream::kRecvPrev, Stream::kSendPrev, Stream::kRecvNext}) {
    EXPECT_FALSE(l.HasPeer(s));
    streams.push_back(l.stream(s));
  }
  std::sort(streams.begin(), streams.end());
  EXPECT_EQ(std::unique(streams.begin(), streams.end()), streams.end()) << "streams shared";
  EXPECT_THROW(l.stream(Stream::kCompute), InternalError);
  DeviceBytes buffer(0, 64);
  EXPECT_THROW(l.Send(Stream::kSendNext, buffer.get(), 64), InternalError);
  EXPECT_THROW(l.Send(Stream::kSendPrev, buffer.get(), 64), InternalError);
  EXPECT_THROW(l.Send(Stream::kRecvPrev, buffer.get(), 64), InternalError);
  EXPECT_THROW(l.Recv(Stream::kSendNext, buffer.get(), 64), InternalError);
  EXPECT_DOUBLE_EQ(l.AllReduceSum(2.5), 2.5);
  l.Barrier();
  l.WaitStream(l.stream(Stream::kSendNext), kWaitTimeout);
  l.CheckHealthy();
  l.Abort();
  l.Abort();  // twice is fine
  EXPECT_THROW(l.CheckHealthy(), TrainingError);
  EXPECT_THROW(l.Send(Stream::kSendNext, buffer.get(), 64), InternalError);
}

// Stage 0 -> 1 on send_next/recv_prev, and back on send_prev/recv_next: an activation-sized
// buffer (29 MiB, more than NCCL's internal chunking) and a small one, byte for byte.
TEST(PeerLinksTest, TwoStagesExchangeBothWays) {
  SKIP_WITHOUT_TWO_GPUS();
  const int ranks = AllRanks();
  const std::vector<size_t> sizes = {size_t{29} << 20, size_t{1} << 10};
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::unique_ptr<DeviceBytes>> on0, there, back;
  for (size_t i = 0; i < sizes.size(); ++i) {
    data.push_back(RandomBytes(sizes[i], 17 + i));
    on0.push_back(std::make_unique<DeviceBytes>(0, data[i]));
    there.push_back(std::make_unique<DeviceBytes>(1, sizes[i]));
    back.push_back(std::make_unique<DeviceBytes>(0, sizes[i]));
  }
  auto links = PeerLinks::ConnectLocal(ranks, kConnectTimeout);
  ASSERT_EQ(static_cast<int>(links.size()), ranks);
  EXPECT_TRUE(links[0]->HasPeer(Stream::kSendNext));
  EXPECT_FALSE(links[0]->HasPeer(Stream::kRecvPrev));
  EXPECT_TRUE(links[1]->HasPeer(Stream::kRecvPrev));
  EXPECT_THROW(links[0]->Send(Stream::kSendPrev, on0[0]->get(), 1), InternalError);
  EXPECT_THROW(links[ranks - 1]->Send(Stream::kSendNext, on0[0]->get(), 1), InternalError);

  OnEachRank(2, [&](int r) {
    PeerLinks& l = *links[r];
    if (r == 0) {
      for (size_t i = 0; i < sizes.size(); ++i) l.Send(Stream::kSendNext, on0[i]->get(), sizes[i]);
      for (size_t i = 0; i < sizes.size(); ++i) l.Recv(Stream::kRecvNext, back[i]->get(), sizes[i]);
    } else {
      for (size_t i = 0; i < sizes.size(); ++i)
        l.Recv(Stream::kRecvPrev, there[i]->get(), sizes[i]);
      // Sending what arrived: the host waits for the receive stream first (the runtime would
      // order the two streams with an event).
      l.WaitStream(l.stream(Stream::kRecvPrev), kWaitTimeout);
      for (size_t i = 0; i < sizes.size(); ++i)
        l.Send(Stream::kSendPrev, there[i]->get(), sizes[i]);
    }
    WaitAll(l);
  });
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_TRUE(there[i]->Read() == data[i]) << "stage 1 got other bytes, size " << sizes[i];
    EXPECT_TRUE(back[i]->Read() == data[i]) << "stage 0 got other bytes back, size " << sizes[i];
  }
  for (auto& l : links) l->CheckHealthy();
}

// Every boundary moves 10 buffers forward and 10 backward at once, all queued before any is
// waited for. One thread issues both sides of every transfer, so each round is one PeerGroup:
// outside a group the first call would wait for NCCL to enqueue it, which for a first connection
// needs the other side, and NCCL requires one thread driving several GPUs to group their calls.
TEST(PeerLinksTest, RingOfTransfersFromOneThread) {
  SKIP_WITHOUT_TWO_GPUS();
  const int ranks = AllRanks();
  constexpr int kRounds = 10;
  struct Transfer {
    std::vector<uint8_t> data;
    std::unique_ptr<DeviceBytes> from, to;
  };
  // [boundary][round]: forward is b -> b+1, backward b+1 -> b.
  std::vector<std::vector<Transfer>> forward(ranks - 1), backward(ranks - 1);
  for (int b = 0; b + 1 < ranks; ++b) {
    for (int i = 0; i < kRounds; ++i) {
      const size_t bytes = 1 + static_cast<size_t>(i) * 100003;  // odd sizes, up to ~0.9 MB
      Transfer f{RandomBytes(bytes, 1000 * b + i), nullptr, nullptr};
      f.from = std::make_unique<DeviceBytes>(b, f.data);
      f.to = std::make_unique<DeviceBytes>(b + 1, bytes);
      forward[b].push_back(std::move(f));
      Transfer k{RandomBytes(bytes, 5000 + 1000 * b + i), nullptr, nullptr};
      k.from = std::make_unique<DeviceBytes>(b + 1, k.data);
      k.to = std::make_unique<DeviceBytes>(b, bytes);
      backward[b].push_back(std::move(k));
    }
  }
  auto links = PeerLinks::ConnectLocal(ranks, kConnectTimeout);
  for (int i = 0; i < kRounds; ++i) {
    PeerGroup group;
    for (int b = 0; b + 1 < ranks; ++b) {
      const Transfer& f = forward[b][i];
      const Transfer& k = backward[b][i];
      links[b]->Send(Stream::kSendNext, f.from->get(), f.data.size());
      links[b + 1]->Recv(Stream::kRecvPrev, f.to->get(), f.data.size());
      links[b + 1]->Send(Stream::kSendPrev, k.from->get(), k.data.size());
      links[b]->Recv(Stream::kRecvNext, k.to->get(), k.data.size());
    }
    group.End();
  }
  for (auto& l : links) WaitAll(*l);
  for (int b = 0; b + 1 < ranks; ++b) {
    for (int i = 0; i < kRounds; ++i) {
      EXPECT_TRUE(forward[b][i].to->Read() == forward[b][i].data)
          << "forward " << b << "->" << b + 1 << " round " << i;
      EXPECT_TRUE(backward[b][i].to->Read() == backward[b][i].data)
          << "backward " << b + 1 << "->" << b << " round " << i;
    }
  }
}

TEST(PeerLinksTest, AllReduceSumBarrierAndWaitStream) {
  SKIP_WITHOUT_TWO_GPUS();
  const int ranks = AllRanks();
  auto links = PeerLinks::ConnectLocal(ranks, kConnectTimeout);
  double expected = 0;
  for (int r = 0; r < ranks; ++r) expected += r + 1.5;
  std::vector<double> sums(ranks, -1.0);
  OnEachRank(ranks, [&](int r) {
    PeerLinks& l = *links[r];
    sums[r] = l.AllReduceSum(r + 1.5);
    l.Barrier();
    // A stream with nothing pending returns at once.
    l.WaitStream(l.stream(Stream::kSendNext), kWaitTimeout);
  });
  for (int r = 0; r < ranks; ++r) EXPECT_DOUBLE_EQ(sums[r], expected) << "rank " << r;
}

// A device buffer summed over every rank in place (a tied embedding's two gradients), fp32 and
// bf16, after work queued on another stream: each rank gets the sum, and with two ranks the very
// same bits.
TEST(PeerLinksTest, AllReduceSumInPlaceOfADeviceBuffer) {
  SKIP_WITHOUT_TWO_GPUS();
  const int ranks = AllRanks();
  auto links = PeerLinks::ConnectLocal(ranks, kConnectTimeout);
  constexpr size_t kCount = (size_t{1} << 20) + 3;  // not a multiple of any chunking
  for (const bool fp32 : {true, false}) {
    // Rank r holds r + 1 + (i % 16) / 16 at element i: exact in bf16 too (at most 8 significant
    // bits), and so are two ranks' sums.
    std::vector<std::vector<float>> got(ranks);
    OnEachRank(ranks, [&](int r) {
      PeerLinks& l = *links[r];
      CTXPLAN_CUDA_CHECK(cudaSetDevice(l.device()));  // this thread's buffers on the rank's GPU
      const size_t bytes = kCount * (fp32 ? 4 : 2);
      void* data = nullptr;
      CTXPLAN_CUDA_CHECK(cudaMalloc(&data, bytes));
      cudaStream_t producer = nullptr;
      CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking));
      std::vector<float> values(kCount);
      for (size_t i = 0; i < kCount; ++i)
        values[i] = static_cast<float>(r + 1) + static_cast<float>(i % 16) / 16.0f;
      std::vector<uint16_t> halves(kCount);
      for (size_t i = 0; i < kCount; ++i) {
        uint32_t bits = 0;
        std::memcpy(&bits, &values[i], 4);
        halves[i] = static_cast<uint16_t>(bits >> 16);  // exact: the low half is zero
      }
      // The values arrive on `producer`: the all-reduce must wait for them.
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(data,
                                         fp32 ? static_cast<void*>(values.data()) : halves.data(),
                                         bytes, cudaMemcpyHostToDevice, producer));
      l.AllReduceSumInPlace(data, kCount, fp32, producer);
      std::vector<float>& out = got[static_cast<size_t>(r)];
      out.resize(kCount);
      if (fp32) {
        CTXPLAN_CUDA_CHECK(cudaMemcpy(out.data(), data, bytes, cudaMemcpyDeviceToHost));
      } else {
        CTXPLAN_CUDA_CHECK(cudaMemcpy(halves.data(), data, bytes, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < kCount; ++i) {
          const uint32_t bits = static_cast<uint32_t>(halves[i]) << 16;
          std::memcpy(&out[i], &bits, 4);
        }
      }
      CTXPLAN_CUDA_CHECK(cudaStreamDestroy(producer));
      CTXPLAN_CUDA_CHECK(cudaFree(data));
    });
    for (size_t i = 0; i < kCount; i += 4099) {
      float expected = 0;
      for (int r = 0; r < ranks; ++r)
        expected += static_cast<float>(r + 1) + static_cast<float>(i % 16) / 16.0f;
      // fp32: exact; bf16: exact for two ranks, within its rounding for more.
      EXPECT_NEAR(got[0][i], expected, fp32 || ranks == 2 ? 0.0f : expected / 64.0f)
          << (fp32 ? "fp32" : "bf16") << " element " << i;
    }
    if (ranks == 2) {
      EXPECT_TRUE(got[0] == got[1]) << (fp32 ? "fp32" : "bf16");
    }
  }
}

// A receive whose sender never comes: WaitStream gives up after its timeout with a TrainingError
// naming the rank, instead of hanging like cudaStreamSynchronize would.
TEST(PeerLinksTest, UnmatchedRecvTimesOut) {
  SKIP_WITHOUT_TWO_GPUS();
  DeviceBytes buffer(1, size_t{1} << 20);
  auto links = PeerLinks::ConnectLocal(2, kConnectTimeout);
  links[1]->Recv(Stream::kRecvPrev, buffer.get(), buffer.size());
  const auto started = std::chrono::steady_clock::now();
  try {
    links[1]->WaitStream(links[1]->stream(Stream::kRecvPrev), seconds(2));
    ADD_FAILURE() << "WaitStream returned on a receive nobody sends";
  } catch (const TrainingError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
    EXPECT_NE(message.find("no progress for 2 s"), std::string::npos) << message;
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_GE(waited, 1.9);
  EXPECT_LT(waited, 6.0);
  EXPECT_TRUE(links[1]->aborted());
  EXPECT_THROW(links[1]->CheckHealthy(), TrainingError);
  for (auto& l : links) l->Abort();
}

#else  // !CTXPLAN_HAVE_NCCL

TEST(PeerLinksTest, NeedsNccl) {
  GTEST_SKIP() << "built without NCCL: multi-GPU is off";
}

#endif

}  // namespace
}  // namespace ctxplan::gpu
