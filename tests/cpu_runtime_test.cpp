// The chunk-recurrent runtime on the CPU backend against ordinary full-sequence backprop: the
// correctness anchor of DESIGN.md. Dense chunked gradients must equal full-sequence gradients;
// offload on must equal offload off exactly; a budget covering every page must equal dense.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/cpu/cpu_backend.h"
#include "ctxplan/runtime/cpu/full_sequence_reference.h"
#include "ctxplan/runtime/io/token_data.h"
#include "ctxplan/runtime/plan/step_backend.h"
#include "support/compare.h"

namespace ctxplan {
namespace {

using test::RelativeError;

const ModelSpec& Tiny() {
  static const ModelSpec model = LoadModel("tiny");
  return model;
}

struct Data {
  std::vector<int32_t> tokens, labels;
};

Data RandomData(int64_t n, uint64_t seed, int64_t vocab) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
  Data d;
  for (int64_t i = 0; i < n; ++i) d.tokens.push_back(id(rng));
  for (int64_t i = 0; i < n; ++i) d.labels.push_back(i + 1 < n ? d.tokens[i + 1] : -1);
  d.labels[static_cast<size_t>(n / 3)] = -1;  // an ignored position in the middle
  return d;
}

RunOptions Options(int64_t n, int64_t chunk, int64_t page, int64_t budget, bool offload,
                   bool keep = false) {
  RunOptions o;
  o.context_tokens = n;
  o.chunk_tokens = chunk;
  o.page_tokens = page;
  o.page_budget = budget;
  o.sink_pages = 1;
  o.query_tile = std::min<int64_t>(4, chunk);
  o.offload = offload;
  o.optimizer = OptimizerKind::kNone;
  o.keep_layer_inputs = keep;
  return o;
}

struct Result {
  StepOutputs out;
  ModelWeights grads;
};

// One step of `options` on the CPU backend, no optimizer: its outputs and gradients.
Result Chunked(const ModelSpec& model, const ModelWeights& weights, const Data& data,
               const RunOptions& options) {
  ModelWeights w = weights;
  Result r{{}, ZeroWeights(model)};
  CpuBackend backend(model, w, r.grads, nullptr);
  r.out = RunStep(StepPlan(model, options), {data.tokens, data.labels}, backend);
  return r;
}
Result Chunked(const ModelWeights& weights, const Data& data, const RunOptions& options) {
  return Chunked(Tiny(), weights, data, options);
}

std::vector<float> Flatten(ModelWeights& w) {
  std::vector<float> all;
  w.ForEach([&](const std::string&, std::vector<float>& t) {
    all.insert(all.end(), t.begin(), t.end());
  });
  return all;
}

// Per tensor, so that a wrong small tensor (a norm weight) cannot hide in the total.
void ExpectGradsClose(ModelWeights& got, ModelWeights& want, double tolerance,
                      const std::string& where) {
  std::vector<std::pair<std::string, std::vector<float>*>> a, b;
  got.ForEach([&](const std::string& n, std::vector<float>& t) { a.emplace_back(n, &t); });
  want.ForEach([&](const std::string& n, std::vector<float>& t) { b.emplace_back(n, &t); });
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_LE(RelativeError(*a[i].second, *b[i].second), tolerance) << where << " " << a[i].first;
}

TEST(CpuRuntime, ChunkedDenseGradientsEqualFullSequenceBackprop) {
  const ModelWeights weights = RandomWeights(Tiny(), 7);
  struct Case {
    int64_t n, chunk, page;
  };
  for (const Case c :
       {Case{50, 16, 8}, Case{64, 32, 16}, Case{37, 8, 4}, Case{24, 24, 8}, Case{33, 8, 8}}) {
    const Data data = RandomData(c.n, 100 + c.n, Tiny().vocab_size);
    int64_t labelled = 0;
    for (int32_t l : data.labels) labelled += l >= 0;
    LossAndGrads full = FullSequenceBackprop(Tiny(), weights, data.tokens, data.labels,
                                             1.0f / static_cast<float>(labelled));
    for (int variant = 0; variant < 3; ++variant) {
      const bool offload = variant != 1, keep = variant == 2;  // on, off, on + kept inputs
      Result chunked = Chunked(weights, data,
                               Options(c.n, c.chunk, c.page, RunOptions::kAllPages, offload, keep));
      const std::string where = "n=" + std::to_string(c.n) + " c=" + std::to_string(c.chunk) +
                                " p=" + std::to_string(c.page) +
                                " offload=" + std::to_string(offload) +
                                " keep=" + std::to_string(keep);
      EXPECT_EQ(chunked.out.labelled, full.labelled) << where;
      EXPECT_NEAR(chunked.out.loss_sum, full.loss_sum, 1e-5 * std::abs(full.loss_sum)) << where;
      ExpectGradsClose(chunked.grads, full.grads, 1e-5, where);
    }
  }
}

TEST(CpuRuntime, OffloadOnEqualsOffExactly) {
  const ModelWeights weights = RandomWeights(Tiny(), 11);
  const Data data = RandomData(96, 5, Tiny().vocab_size);
  for (int64_t budget : {int64_t{2}, RunOptions::kAllPages}) {
    Result on = Chunked(weights, data, Options(96, 16, 4, budget, true));
    Result off = Chunked(weights, data, Options(96, 16, 4, budget, false));
    EXPECT_EQ(on.out.loss_sum, off.out.loss_sum);
    EXPECT_EQ(Flatten(on.grads), Flatten(off.grads)) << "budget " << budget;
    // Offload moves the pages to pinned host memory; without it the host holds none.
    EXPECT_GT(on.out.peak_host_bytes, 0);
    EXPECT_EQ(off.out.peak_host_bytes, 0);
  }
}

// Issue 12: the GPU tier of the page store changes where pages live, never what the step
// computes: gradients bit for bit with the tier off, partial (inside a chunk's pages, on a chunk
// boundary) and holding every page, dense and sparse, layer inputs kept or recomputed; the host
// holds fewer pages the larger the tier.
TEST(CpuRuntime, GpuTierOffPartialFullEqualExactly) {
  const ModelWeights weights = RandomWeights(Tiny(), 29);
  const Data data = RandomData(96, 31, Tiny().vocab_size);  // 24 pages of 4, chunks of 16
  for (int64_t budget : {int64_t{2}, RunOptions::kAllPages}) {
    for (bool keep : {false, true}) {
      const Result off = Chunked(weights, data, Options(96, 16, 4, budget, true, keep));
      int64_t host_before = off.out.peak_host_bytes;
      for (int64_t tier : {int64_t{3}, int64_t{8}, int64_t{24}, int64_t{100}}) {
        RunOptions o = Options(96, 16, 4, budget, true, keep);
        o.gpu_tier_pages = tier;
        const Result with = Chunked(weights, data, o);
        const std::string where = "budget " + std::to_string(budget) + " keep " +
                                  std::to_string(keep) + " tier " + std::to_string(tier);
        EXPECT_EQ(with.out.loss_sum, off.out.loss_sum) << where;
        Result a = with, b = off;  // Flatten takes its weights mutable
        EXPECT_EQ(Flatten(a.grads), Flatten(b.grads)) << where;
        if (host_before > 0) {
          EXPECT_LT(with.out.peak_host_bytes, host_before) << where;
        }
        host_before = with.out.peak_host_bytes;
        if (tier >= 24) {
          EXPECT_EQ(with.out.peak_host_bytes, 0) << where;
        }
      }
    }
  }
}

// Page reads (page_reads.h): dense, each attention op reads every earlier page once, so a
// layer's reads are the fill's, the recompute's and the backward's earlier pages; the earliest
// pages are read most.
TEST(CpuRuntime, PageReadsCountEveryAttendedPage) {
  const ModelWeights weights = RandomWeights(Tiny(), 37);
  const Data data = RandomData(96, 41, Tiny().vocab_size);  // 6 chunks of 16 = 4 pages of 4
  const Result r = Chunked(weights, data, Options(96, 16, 4, RunOptions::kAllPages, true));
  const PageReads& reads = r.out.page_reads;
  ASSERT_EQ(reads.pages, 24);
  ASSERT_EQ(reads.layers, Tiny().num_hidden_layers);
  // Fill: chunks 0..4 over 4i pages; recompute and backward: chunks 0..5.
  EXPECT_EQ(reads.total(), static_cast<uint64_t>((4 * 10 + 2 * 4 * 15) * reads.layers));
  EXPECT_EQ(reads.counts[0], 4u + 5u + 5u);  // page 0: fill chunks 1..4, then 1..5 twice
  EXPECT_EQ(reads.counts[23], 0u);           // the last chunk's pages: never earlier
  const PageReadShares half = ShareOfReads(reads, 0.5);
  EXPECT_DOUBLE_EQ(half.earliest,
                   half.most_read_per_layer);  // dense: the earliest are the most read
  EXPECT_GE(half.most_read, half.most_read_per_layer);
  EXPECT_GT(half.earliest, 0.5);
}

TEST(PageReads, SharesOfAHandMadeTable) {
  PageReads reads;
  reads.Reset(2, 4);
  reads.counts = {1, 1, 8, 0,                          // layer 0: page 2 read most
                  5, 1, 1, 1};                         // layer 1: page 0 read most
  const PageReadShares s = ShareOfReads(reads, 0.25);  // one page a layer
  EXPECT_DOUBLE_EQ(s.earliest, (1.0 + 5.0) / 18.0);
  EXPECT_DOUBLE_EQ(s.most_read_per_layer, (8.0 + 5.0) / 18.0);
  EXPECT_DOUBLE_EQ(s.most_read, (8.0 + 5.0) / 18.0);  // two pages overall: 8 and 5
  EXPECT_DOUBLE_EQ(ShareOfReads(reads, 1.0).earliest, 1.0);
  EXPECT_DOUBLE_EQ(ShareOfReads(PageReads{}, 0.5).earliest, 0.0);
}

TEST(CpuRuntime, KeptLayerInputsEqualRecomputedOnesExactly) {
  const ModelWeights weights = RandomWeights(Tiny(), 19);
  const Data data = RandomData(88, 23, Tiny().vocab_size);
  for (int64_t budget : {int64_t{2}, RunOptions::kAllPages}) {
    Result recompute = Chunked(weights, data, Options(88, 16, 4, budget, true, false));
    Result keep = Chunked(weights, data, Options(88, 16, 4, budget, true, true));
    EXPECT_EQ(recompute.out.loss_sum, keep.out.loss_sum);
    EXPECT_EQ(Flatten(recompute.grads), Flatten(keep.grads)) << "budget " << budget;
    EXPECT_LT(keep.out.ops_executed, recompute.out.ops_executed);
  }
}

TEST(CpuRuntime, BudgetCoveringEveryPageEqualsDense) {
  const ModelWeights weights = RandomWeights(Tiny(), 13);
  const Data data = RandomData(80, 9, Tiny().vocab_size);
  for (bool offload : {true, false}) {
    Result dense = Chunked(weights, data, Options(80, 16, 4, RunOptions::kAllPages, offload));
    Result all = Chunked(weights, data, Options(80, 16, 4, 80 / 4, offload));
    EXPECT_EQ(dense.out.loss_sum, all.out.loss_sum);
    EXPECT_EQ(Flatten(dense.grads), Flatten(all.grads));
  }
}

TEST(CpuRuntime, SparseAttentionChangesTheResultButStaysFinite) {
  const ModelWeights weights = RandomWeights(Tiny(), 17);
  const Data data = RandomData(96, 21, Tiny().vocab_size);
  Result dense = Chunked(weights, data, Options(96, 16, 4, RunOptions::kAllPages, true));
  Result sparse = Chunked(weights, data, Options(96, 16, 4, 2, true));
  const std::vector<float> a = Flatten(sparse.grads), b = Flatten(dense.grads);
  const double difference = RelativeError(a, b);
  EXPECT_TRUE(std::isfinite(difference));
  EXPECT_GT(difference, 1e-4);  // later chunks see 3 of up to 20 earlier pages
  EXPECT_TRUE(std::isfinite(sparse.out.loss_sum));
}

}  // namespace
}  // namespace ctxplan

namespace ctxplan {
namespace {

// Acceptance: the loss falls on a learnable long-range task. The key sits in the first chunk,
// its query at the end of the fourth: only attention across chunks (through the KV pages and
// back through the dKV pages) can carry it. A model that ignores the context cannot go below
// ln(values) = ln 8.
TEST(CpuRuntime, LossFallsOnLongRangeRetrieval) {
  ModelSpec model = LoadModel("tiny");
  model.vocab_size = 32;  // 16 fillers, 8 keys, 8 values
  ModelWeights weights = RandomWeights(model, 3);
  ModelWeights grads = ZeroWeights(model);
  OptimizerState optimizer{ZeroWeights(model), ZeroWeights(model), {}};
  optimizer.params.lr = 3e-3f;
  RunOptions o;
  o.context_tokens = 64;
  o.chunk_tokens = 16;
  o.page_tokens = 4;
  o.query_tile = 4;
  o.page_budget = RunOptions::kAllPages;
  o.optimizer = OptimizerKind::kAdamWGpu;
  const StepPlan plan(model, o);
  CpuBackend backend(model, weights, grads, &optimizer);
  constexpr int kSteps = 600, kWindow = 100;
  double first = 0, last = 0;
  for (int s = 0; s < kSteps; ++s) {
    const RetrievalSample sample = SyntheticRetrieval(model.vocab_size, 64, StepSeed(1, s));
    ASSERT_LT(sample.key_position + 1, 16) << "the key must lie in the first chunk";
    grads.ForEach(
        [](const std::string&, std::vector<float>& t) { std::fill(t.begin(), t.end(), 0.0f); });
    const StepOutputs out = RunStep(plan, {sample.tokens, sample.labels}, backend);
    ASSERT_EQ(out.labelled, 1);
    if (s < kWindow) first += out.mean_loss() / kWindow;
    if (s >= kSteps - kWindow) last += out.mean_loss() / kWindow;
  }
  EXPECT_LT(last, first - 0.5);
  EXPECT_LT(last, 0.8 * std::log(8.0)) << "first " << first << " last " << last;
}

TEST(CpuRuntime, NonFiniteLossStopsNamingTheChunk) {
  ModelWeights weights = RandomWeights(Tiny(), 5);
  weights.final_norm[3] = NAN;
  ModelWeights grads = ZeroWeights(Tiny());
  CpuBackend backend(Tiny(), weights, grads, nullptr);
  const Data data = RandomData(48, 1, Tiny().vocab_size);
  try {
    RunStep(StepPlan(Tiny(), Options(48, 16, 4, RunOptions::kAllPages, true)),
            {data.tokens, data.labels}, backend);
    FAIL() << "a NaN loss went unnoticed";
  } catch (const TrainingError& e) {
    EXPECT_NE(std::string(e.what()).find("chunk 2"), std::string::npos) << e.what();
  }
}

// A rank of several GPUs makes only its stage's random weights: they equal the whole model's
// sliced to that stage (values, and the empty tensors of the others), with QKV bias or not and a
// tied head or not, over 1 to 4 stages.
TEST(CpuRuntime, AStagesRandomWeightsAreTheWholeModelsSliced) {
  ModelSpec biased = Tiny();
  biased.num_hidden_layers = 4;
  biased.attention_bias = true;
  ModelSpec tied = biased;
  tied.attention_bias = false;
  tied.tie_word_embeddings = true;
  for (const ModelSpec& model : {biased, tied}) {
    const ModelWeights whole = RandomWeights(model, 23);
    for (int32_t stages = 1; stages <= 4; ++stages) {
      for (int32_t stage = 0; stage < stages; ++stage) {
        SCOPED_TRACE(std::to_string(stage) + " of " + std::to_string(stages));
        ModelWeights sliced = whole;
        KeepStageTensors(sliced, model, stage, stages);
        ModelWeights made = RandomWeights(model, 23, stage, stages);
        std::vector<std::pair<std::string, std::vector<float>>> want, got;
        sliced.ForEach([&](const std::string& n, std::vector<float>& t) {
          want.push_back({n, t});
        });
        made.ForEach([&](const std::string& n, std::vector<float>& t) { got.push_back({n, t}); });
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(got[i].first, want[i].first);
          EXPECT_EQ(got[i].second, want[i].second) << want[i].first;
        }
        EXPECT_EQ(made.ParameterCount(), sliced.ParameterCount());
        EXPECT_GT(made.ParameterCount(), 0);
      }
    }
  }
}

// Issue 13: layers pipelined over GPUs change where the step runs, never what it computes. One
// process runs every stage in the plan's interleaved order, the boundaries passing the residual
// stream and its pending add forward and their gradient back: gradients and loss bit for bit
// equal to one GPU's, dense and sparse, offload on and off, with a GPU tier, over 2 to 4 stages
// (a 4-layer tiny model) and fewer chunks than stages.
TEST(CpuRuntime, PipelineStagesEqualOneGpuExactly) {
  ModelSpec model = Tiny();
  model.num_hidden_layers = 4;
  const ModelWeights weights = RandomWeights(model, 41);
  struct Case {
    int64_t n, chunk, budget;
    bool offload;
    int64_t tier;
  };
  for (const Case c : {Case{96, 16, 2, true, 0}, Case{96, 16, RunOptions::kAllPages, false, 0},
                       Case{96, 16, 2, true, 5}, Case{40, 16, RunOptions::kAllPages, true, 0},
                       Case{16, 16, 2, true, 0}}) {
    const Data data = RandomData(c.n, 7 + c.n, model.vocab_size);
    auto run = [&](int32_t stages) {
      RunOptions o = Options(c.n, c.chunk, 4, c.budget, c.offload);
      o.gpu_tier_pages = c.tier;
      o.pipeline_stages = stages;
      return Chunked(model, weights, data, o);
    };
    Result one = run(1);
    for (int32_t stages : {2, 3, 4}) {
      Result piped = run(stages);
      const std::string where = "n " + std::to_string(c.n) + " budget " + std::to_string(c.budget) +
                                " offload " + std::to_string(c.offload) + " tier " +
                                std::to_string(c.tier) + " stages " + std::to_string(stages);
      EXPECT_EQ(piped.out.loss_sum, one.out.loss_sum) << where;
      EXPECT_EQ(piped.out.labelled, one.out.labelled) << where;
      EXPECT_EQ(Flatten(piped.grads), Flatten(one.grads)) << where;
    }
  }
}

// A tied LM head over two stages (the CUDA backend's limit for tied models): the plan runs the
// embedding on the first stage and the head on the last, which share one tensor here; gradients
// and loss bit for bit equal to one GPU's. (Over CUDA each stage keeps a copy, their gradients
// summed: gpu_pipeline_test.TwoGpusShareATiedEmbedding.)
TEST(CpuRuntime, TiedHeadOverTwoStagesEqualsOneGpu) {
  ModelSpec model = Tiny();
  model.name += "-tied";
  model.num_hidden_layers = 4;
  model.tie_word_embeddings = true;
  const ModelWeights weights = RandomWeights(model, 43);
  ASSERT_TRUE(weights.lm_head.empty());
  const Data data = RandomData(96, 11, model.vocab_size);
  auto run = [&](int32_t stages) {
    RunOptions o = Options(96, 16, 4, 2, true);
    o.pipeline_stages = stages;
    return Chunked(model, weights, data, o);
  };
  Result one = run(1), two = run(2);
  EXPECT_EQ(two.out.loss_sum, one.out.loss_sum);
  EXPECT_EQ(Flatten(two.grads), Flatten(one.grads));
  EXPECT_NE(one.grads.embedding, std::vector<float>(one.grads.embedding.size(), 0.0f));
  // Three stages and more: refused for a tied model (RunOptions::Validate).
  RunOptions three = Options(96, 16, 4, 2, true);
  three.pipeline_stages = 3;
  EXPECT_THROW(three.Validate(model), InputError);
}

}  // namespace
}  // namespace ctxplan
