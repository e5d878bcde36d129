// Issue 13: the layers pipelined over two GPUs on NCCL against the same step on one GPU. Each
// rank runs in its own thread on its own device, as each would in its own process: the same
// plan, the same weights and data; every rank executes its stage's ops, the boundaries cross on
// NCCL. The kernels and their order per layer are the one GPU's, so the gradients agree to
// within the fp32 atomics' order (the GPU tests' tolerance); the loss comes from the last stage.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <exception>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/cuda/cuda_backend.h"
#include "ctxplan/runtime/token_data.h"
#include "support/compare.h"
#include "support/gpu.h"

#ifdef CTXPLAN_HAVE_NCCL
#include "ctxplan/runtime/cuda/nccl_stage_peers.h"
#include "ctxplan/runtime/cuda/peer_links.h"
#endif

namespace ctxplan {
namespace {

using test::RelativeError;
using test::SharpWeights;

int GpuCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  (void)cudaGetLastError();
  return count;
}

ModelSpec Small() {
  return test::SmallGpuModel(4);
}

RunOptions Options(int64_t budget, bool offload, int64_t tier, int32_t stages) {
  RunOptions o;
  o.context_tokens = 600;  // 5 chunks, the last one short
  o.chunk_tokens = 128;
  o.page_tokens = 64;
  o.query_tile = 128;
  o.page_budget = budget;
  o.sink_pages = 1;
  o.offload = offload;
  o.gpu_tier_pages = tier;
  o.grad_dtype = GradDtype::kFp32;
  o.optimizer = OptimizerKind::kNone;
  o.pipeline_stages = stages;
  return o;
}

TEST(Pipeline, TwoGpusGiveTheOneGpuGradients) {
  SKIP_WITHOUT_GPU();
#ifndef CTXPLAN_HAVE_NCCL
  GTEST_SKIP() << "built without NCCL";
#else
  if (GpuCount() < 2) GTEST_SKIP() << "fewer than 2 GPUs";
  const ModelSpec model = Small();
  const ModelWeights weights = SharpWeights(model, 23);
  std::vector<int32_t> tokens = RandomTokens(model.vocab_size, 600, 29);
  std::vector<int32_t> labels(tokens.begin() + 1, tokens.end());
  labels.push_back(-1);
  std::vector<std::unique_ptr<gpu::PeerLinks> > links = gpu::PeerLinks::ConnectLocal(2);
  struct Case {
    int64_t budget;
    bool offload;
    int64_t tier;
  };
  for (const Case c : {Case{RunOptions::kAllPages, true, 0}, Case{2, true, 0},
                       Case{RunOptions::kAllPages, false, 0}, Case{2, true, 5}}) {
    const std::string where = "budget " + std::to_string(c.budget) + " offload " +
                              std::to_string(c.offload) + " tier " + std::to_string(c.tier);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    const StepPlan one_plan(model, Options(c.budget, c.offload, c.tier, 1));
    CudaBackend one(one_plan, weights);
    const StepOutputs want = RunStep(one_plan, {tokens, labels}, one);
    ModelWeights want_grads = one.DownloadGrads();

    const StepPlan plan(model, Options(c.budget, c.offload, c.tier, 2));
    std::vector<StepOutputs> got(2);
    std::vector<ModelWeights> grads(2);
    std::vector<std::string> errors(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r)
      ranks.emplace_back([&, r] {
        try {
          if (cudaSetDevice(r) != cudaSuccess) throw std::runtime_error("cudaSetDevice");
          gpu::NcclStagePeers peers(*links[static_cast<size_t>(r)], std::chrono::seconds(60));
          CudaBackend backend(plan, weights, {}, nullptr, nullptr, &peers);
          got[static_cast<size_t>(r)] = RunStep(plan, {tokens, labels}, backend);
          grads[static_cast<size_t>(r)] = backend.DownloadGrads();
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
      });
    for (std::thread& t : ranks) t.join();
    ASSERT_EQ(errors[0], "") << where;
    ASSERT_EQ(errors[1], "") << where;
    // The loss is the last stage's; the first's chunks never reach it.
    EXPECT_NEAR(got[1].loss_sum / want.loss_sum, 1.0, 1e-5) << where;
    EXPECT_EQ(got[0].loss_sum, 0.0) << where;
    // Each tensor from the rank that holds it (the other's is empty).
    std::vector<std::vector<float>*> want_tensors;
    want_grads.ForEach(
        [&](const std::string&, std::vector<float>& t) { want_tensors.push_back(&t); });
    std::vector<std::string> names;
    want_grads.ForEach([&](const std::string& n, std::vector<float>&) { names.push_back(n); });
    double worst = 0;
    size_t compared = 0;
    for (int r = 0; r < 2; ++r) {
      // Walk the rank's tensors by name: its empty ones are the other stage's.
      std::map<std::string, std::vector<float>*> mine;
      grads[static_cast<size_t>(r)].ForEach(
          [&](const std::string& n, std::vector<float>& t) { mine[n] = &t; });
      for (size_t i = 0; i < names.size(); ++i) {
        const auto it = mine.find(names[i]);
        if (it == mine.end() || it->second->empty()) continue;
        ASSERT_EQ(it->second->size(), want_tensors[i]->size()) << names[i];
        const double e = RelativeError(*it->second, *want_tensors[i]);
        EXPECT_LE(e, 1e-5) << where << " " << names[i] << " rank " << r;
        worst = std::max(worst, e);
        ++compared;
      }
    }
    EXPECT_EQ(compared, names.size()) << where << ": every tensor on exactly one rank";
    std::printf("  2 GPUs, %-32s gradients within %.2e of one GPU (%zu tensors)\n", where.c_str(),
                worst, compared);
  }
#endif
}

}  // namespace
}  // namespace ctxplan
