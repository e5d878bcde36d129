// The explorer's model, headless: a QCoreApplication and no widgets. It must reproduce the CLI's
// answers, refuse invalid input without losing its state, and never apply a stale result.
#include <QCoreApplication>
#include <QElapsedTimer>
#include <QEventLoop>
#include <QTimer>

#include <cstdlib>
#include <vector>

#include <gtest/gtest.h>

#include "ctxplan/models/units.h"
#include "explorer_model.h"

namespace ctxplan::gui {
namespace {

// One application for the whole binary; Qt wants it before any event loop runs.
QCoreApplication& App() {
  static int argc = 1;
  static char name[] = "gui_explorer_model_test";
  static char* argv[] = {name, nullptr};
  static QCoreApplication* app = [] {
    qputenv("QT_QPA_PLATFORM", "offscreen");
    return new QCoreApplication(argc, argv);
  }();
  return *app;
}

// Runs the event loop until `done` holds or `timeout_ms` passes; returns whether it held.
template <typename Done>
bool SpinUntil(Done done, int timeout_ms = 20000) {
  App();
  QElapsedTimer timer;
  timer.start();
  while (!done() && timer.elapsed() < timeout_ms) {
    QCoreApplication::processEvents(QEventLoop::AllEvents | QEventLoop::WaitForMoreEvents, 50);
  }
  return done();
}

// Records every signal the model emits.
struct Recorder {
  explicit Recorder(ExplorerModel& model) {
    QObject::connect(&model, &ExplorerModel::resultReady,
                     [this](const ExplorerResult& r) { results.push_back(r); });
    QObject::connect(&model, &ExplorerModel::errorOccurred,
                     [this](const QString& message) { errors.push_back(message); });
    QObject::connect(&model, &ExplorerModel::selectionChanged, [this] { ++changes; });
  }
  std::vector<ExplorerResult> results;
  std::vector<QString> errors;
  int changes = 0;
};

class ExplorerModelTest : public ::testing::Test {
 protected:
  void SetUp() override { App(); }
};

TEST_F(ExplorerModelTest, DefaultsReproduceTheCliMaxContext) {
  ExplorerModel model;
  EXPECT_EQ(model.selection().model_name, "qwen2.5-7b");
  EXPECT_EQ(model.selection().machine_name, "h200-125g");
  const ExplorerResult r = model.ComputeNow();
  ASSERT_TRUE(r.ok()) << r.error;
  // `ctxplan max-context` with no flags: about 1.1M tokens, bound by the 117 GiB of usable RAM.
  EXPECT_GT(r.max_context_tokens, 900'000);
  EXPECT_LT(r.max_context_tokens, 1'300'000);
  EXPECT_EQ(r.limit, sim::CapacityLimit::kHostMemory);
  EXPECT_TRUE(r.at_max.fits());
  // The report at the selected context (1M by default) is consistent with itself.
  EXPECT_EQ(r.report.context_tokens, r.selection.options.context_tokens);
  EXPECT_GT(r.report.tokens_per_second, 0.0);
  EXPECT_GT(r.report.prediction.step_seconds(), 0.0);
  EXPECT_LE(r.report.gpu_memory.allocated, r.report.gpu_memory.reserved);
  EXPECT_LT(r.report.gpu_memory.reserved, r.report.gpu_memory.device);
  int64_t gpu_sum = 0, host_sum = 0;
  for (const int64_t bytes : r.report.prediction.gpu.at_peak) gpu_sum += bytes;
  for (const int64_t bytes : r.report.prediction.host.at_peak) host_sum += bytes;
  EXPECT_EQ(gpu_sum, r.report.gpu_memory.allocated);
  EXPECT_EQ(host_sum, r.report.host_peak);
  EXPECT_EQ(model.result().generation, r.generation);
}

TEST_F(ExplorerModelTest, OffloadOffMovesPagesFromHostToGpu) {
  ExplorerModel model;
  ASSERT_TRUE(model.SetContextTokens(128 * 1024));
  const ExplorerResult on = model.ComputeNow();
  ASSERT_TRUE(on.ok()) << on.error;
  ASSERT_TRUE(model.SetOffload(false));
  const ExplorerResult off = model.ComputeNow();
  ASSERT_TRUE(off.ok()) << off.error;
  EXPECT_FALSE(off.selection.options.offload);
  EXPECT_GT(off.report.gpu_memory.allocated, on.report.gpu_memory.allocated);
  EXPECT_GT(off.report.gpu_memory.device, on.report.gpu_memory.device);
  EXPECT_GT(on.report.host_peak, int64_t{1} << 30);  // 128K tokens of KV and dKV pages
  EXPECT_LT(off.report.host_peak, 64 * kMiB);        // nothing is pinned on the host
}

// Issue 13: two GPUs halve each GPU's layers (its weights, gradients, optimizer state) and
// nearly halve the step; the two-GPU host holds the same pages (two one-GPU machines would hold
// half each); more GPUs than layers are refused.
TEST_F(ExplorerModelTest, TwoGpusHalveTheGpuMemoryAndTheStep) {
  ExplorerModel model;
  ASSERT_TRUE(model.SetMachineName("h200-x2"));
  ASSERT_TRUE(model.SetContextTokens(128 * 1024));
  const ExplorerResult one = model.ComputeNow();
  ASSERT_TRUE(one.ok()) << one.error;
  ASSERT_TRUE(model.SetGpus(2));
  const ExplorerResult two = model.ComputeNow();
  ASSERT_TRUE(two.ok()) << two.error;
  EXPECT_EQ(two.selection.options.pipeline_stages, 2);
  EXPECT_LT(two.report.gpu_memory.allocated, 0.6 * one.report.gpu_memory.allocated);
  EXPECT_LT(two.report.prediction.step_seconds(), 0.55 * one.report.prediction.step_seconds());
  EXPECT_NEAR(static_cast<double>(two.report.host_peak) / one.report.host_peak, 1.0, 0.01);
  EXPECT_FALSE(model.SetGpus(29));  // Qwen2.5-7B has 28 layers
  EXPECT_EQ(model.selection().options.pipeline_stages, 2);
}

// Issue 15: LoRA, the query tile, the sinks and keeping the layer inputs are the user's to move
// in the explorer too, each validated as the CLI validates its flag.
TEST_F(ExplorerModelTest, LoraQueryTileSinksAndKeptInputsChangeThePlan) {
  ExplorerModel model;
  ASSERT_TRUE(model.SetContextTokens(32 * 1024));
  const ExplorerResult full = model.ComputeNow();
  ASSERT_TRUE(full.ok()) << full.error;

  // LoRA freezes the base: no gradients or moments of its 7.6B parameters on the GPU.
  ASSERT_TRUE(model.SetLoraRank(16));
  const ExplorerResult lora = model.ComputeNow();
  ASSERT_TRUE(lora.ok()) << lora.error;
  EXPECT_EQ(lora.selection.options.lora_rank, 16);
  EXPECT_LT(lora.report.gpu_memory.allocated, 0.5 * full.report.gpu_memory.allocated);
  ASSERT_TRUE(model.SetLoraRank(0));

  // Kept layer inputs: one forward less a chunk, their memory on the GPU.
  ASSERT_TRUE(model.SetKeepLayerInputs(true));
  const ExplorerResult kept = model.ComputeNow();
  ASSERT_TRUE(kept.ok()) << kept.error;
  EXPECT_TRUE(kept.selection.options.keep_layer_inputs);
  EXPECT_LT(kept.report.prediction.step_seconds(), full.report.prediction.step_seconds());
  EXPECT_GT(kept.report.gpu_memory.allocated, full.report.gpu_memory.allocated);
  ASSERT_TRUE(model.SetKeepLayerInputs(false));

  // More sinks and a larger query tile: more earlier pages attended, fewer selections.
  ASSERT_TRUE(model.SetSinkPages(4));
  ASSERT_TRUE(model.SetQueryTile(256));
  const ExplorerResult wider = model.ComputeNow();
  ASSERT_TRUE(wider.ok()) << wider.error;
  EXPECT_EQ(wider.selection.options.sink_pages, 4);
  EXPECT_EQ(wider.selection.options.query_tile, 256);

  Recorder recorder(model);
  EXPECT_FALSE(model.SetLoraRank(-1));
  EXPECT_FALSE(model.SetQueryTile(0));
  EXPECT_FALSE(model.SetQueryTile(2 * model.selection().options.chunk_tokens));
  EXPECT_FALSE(model.SetSinkPages(-1));
  ASSERT_TRUE(model.SetMachineName("h200-x2"));
  ASSERT_TRUE(model.SetGpus(2));
  EXPECT_FALSE(model.SetKeepLayerInputs(true));  // not with several GPUs yet
  ASSERT_EQ(recorder.errors.size(), 5u);
  EXPECT_TRUE(recorder.errors[0].contains("--lora-rank")) << recorder.errors[0].toStdString();
  EXPECT_TRUE(recorder.errors[1].contains("--query-tile")) << recorder.errors[1].toStdString();
  EXPECT_TRUE(recorder.errors[3].contains("--sinks")) << recorder.errors[3].toStdString();
  EXPECT_TRUE(recorder.errors[4].contains("--keep-layer-inputs"))
      << recorder.errors[4].toStdString();
  EXPECT_EQ(model.selection().options.sink_pages, 4);
  EXPECT_FALSE(model.selection().options.keep_layer_inputs);
}

TEST_F(ExplorerModelTest, InvalidChunkIsRefusedAndTheStateKept) {
  ExplorerModel model;
  Recorder recorder(model);
  const uint64_t generation = model.generation();
  const int64_t chunk = model.selection().options.chunk_tokens;
  EXPECT_FALSE(model.SetChunkTokens(4000));  // not a multiple of the 128-token page
  ASSERT_EQ(recorder.errors.size(), 1u);
  EXPECT_TRUE(recorder.errors[0].contains("chunk")) << recorder.errors[0].toStdString();
  EXPECT_TRUE(recorder.errors[0].contains("4000")) << recorder.errors[0].toStdString();
  EXPECT_EQ(model.selection().options.chunk_tokens, chunk);
  EXPECT_EQ(model.generation(), generation);  // nothing was requested
  EXPECT_EQ(recorder.changes, 0);
  EXPECT_FALSE(model.busy());

  // Other refusals, one per kind of setter; none changes anything.
  EXPECT_FALSE(model.SetPageTokens(3000));
  EXPECT_FALSE(model.SetModelName("no-such-model"));
  EXPECT_FALSE(model.SetMachineName("no-such-machine"));
  EXPECT_FALSE(model.SetGradDtype("fp8"));
  EXPECT_FALSE(model.SetOptimizer("sgd"));
  EXPECT_FALSE(model.SetSelectionModel("overlap:2"));
  EXPECT_FALSE(model.SetContextTokens(0));
  EXPECT_FALSE(model.SetPageBudget(-1));
  EXPECT_EQ(recorder.errors.size(), 9u);
  EXPECT_EQ(recorder.changes, 0);
  EXPECT_EQ(model.selection().model_name, "qwen2.5-7b");
  EXPECT_EQ(model.selection().options.page_tokens, 128);

  // A valid change is taken, and a chunk that holds whole pages after all is accepted.
  EXPECT_TRUE(model.SetChunkTokens(8192));
  EXPECT_EQ(model.selection().options.chunk_tokens, 8192);
  EXPECT_EQ(recorder.changes, 1);
  EXPECT_GT(model.generation(), generation);
}

TEST_F(ExplorerModelTest, CurveIsLogSpacedAndMonotone) {
  const std::vector<int64_t> contexts = ExplorerModel::CurveContexts();
  ASSERT_EQ(contexts.size(), static_cast<size_t>(ExplorerModel::kCurvePoints));
  EXPECT_EQ(contexts.front(), 4096);
  EXPECT_EQ(contexts.back(), 4 << 20);

  for (const bool offload : {true, false}) {
    ExplorerModel model;
    ASSERT_TRUE(model.SetOffload(offload));
    const ExplorerResult r = model.ComputeNow();
    ASSERT_TRUE(r.ok()) << r.error;
    ASSERT_EQ(r.curve.size(), contexts.size());
    for (size_t i = 0; i < r.curve.size(); ++i) {
      SCOPED_TRACE(testing::Message() << "offload " << offload << ", point " << i);
      EXPECT_EQ(r.curve[i].context_tokens, contexts[i]);
      if (i == 0) continue;
      EXPECT_GT(r.curve[i].context_tokens, r.curve[i - 1].context_tokens);
      EXPECT_GE(r.curve[i].gpu_allocated, r.curve[i - 1].gpu_allocated);
      EXPECT_GE(r.curve[i].gpu_device, r.curve[i - 1].gpu_device);
      EXPECT_GE(r.curve[i].host_peak, r.curve[i - 1].host_peak);
      // Monotone memory means fitting is a prefix: once a point fails, the rest fail too.
      if (!r.curve[i - 1].fits()) {
        EXPECT_FALSE(r.curve[i].fits());
      }
    }
    // The fit marks agree with the max-context search; where the step fits its speed is the
    // analytic path's, step time and tokens/s consistent; where it does not, none is claimed.
    for (const CurvePoint& p : r.curve) {
      EXPECT_EQ(p.fits(), p.context_tokens <= r.max_context_tokens) << p.context_tokens;
      if (p.fits()) {
        EXPECT_GT(p.tokens_per_second, 0) << p.context_tokens;
        EXPECT_NEAR(p.tokens_per_second * p.step_seconds, static_cast<double>(p.context_tokens),
                    1e-6 * p.context_tokens);
      } else {
        EXPECT_EQ(p.tokens_per_second, 0) << p.context_tokens;
      }
    }
  }
}

// The GPU tier (issue 12): auto holds pages in the GPU memory the plan leaves free, so the
// host holds fewer and the max context grows; a bad setting is refused with the library's line.
TEST_F(ExplorerModelTest, GpuTierMovesTheHostLimit) {
  ExplorerModel model;
  const ExplorerResult off = model.ComputeNow();
  ASSERT_TRUE(off.ok()) << off.error;
  ASSERT_TRUE(model.SetGpuTier("auto"));
  const ExplorerResult tiered = model.ComputeNow();
  ASSERT_TRUE(tiered.ok()) << tiered.error;
  EXPECT_GT(tiered.max_context_tokens, off.max_context_tokens + 300'000);
  EXPECT_LT(tiered.report.host_peak, off.report.host_peak);
  EXPECT_GE(tiered.report.tokens_per_second, off.report.tokens_per_second);
  QString error;
  QObject::connect(&model, &ExplorerModel::errorOccurred,
                   [&error](const QString& message) { error = message; });
  EXPECT_FALSE(model.SetGpuTier("lots"));
  EXPECT_TRUE(error.contains("GPU tier")) << error.toStdString();
  EXPECT_EQ(model.selection().gpu_tier_text, "auto");
}

// Recommend (issue 15): the search runs on the worker and selects the fastest settings that fit,
// which then compute at least as fast as what was selected before.
TEST_F(ExplorerModelTest, RecommendSelectsTheFastestSettings) {
  ExplorerModel model;
  ASSERT_TRUE(model.SetContextTokens(32 * 1024));
  const ExplorerResult before = model.ComputeNow();
  ASSERT_TRUE(before.ok()) << before.error;
  const std::optional<RunOptions> best = ExplorerModel::RecommendedOptions(model.selection());
  ASSERT_TRUE(best.has_value());
  bool applied = false;
  QObject::connect(&model, &ExplorerModel::recommendationDone,
                   [&applied](bool ok, const QString&) { applied = ok; });
  model.Recommend();
  model.WaitForWorkers();  // the search, then the refresh it requested
  model.WaitForWorkers();
  ASSERT_TRUE(applied);
  EXPECT_EQ(model.selection().options.chunk_tokens, best->chunk_tokens);
  EXPECT_EQ(model.selection().options.page_tokens, best->page_tokens);
  EXPECT_EQ(model.selection().options.offload, best->offload);
  const ExplorerResult after = model.ComputeNow();
  ASSERT_TRUE(after.ok()) << after.error;
  EXPECT_GE(after.report.tokens_per_second, before.report.tokens_per_second);
}

TEST_F(ExplorerModelTest, AsyncDeliversOnlyTheNewestGeneration) {
  ExplorerModel model;
  Recorder recorder(model);
  std::vector<bool> busy;
  QObject::connect(&model, &ExplorerModel::busyChanged, [&busy](bool b) { busy.push_back(b); });

  // Two requests back to back: the first is stale before the event loop ever runs.
  ASSERT_TRUE(model.SetContextTokens(64 * 1024));
  const uint64_t first = model.generation();
  ASSERT_TRUE(model.SetContextTokens(256 * 1024));
  const uint64_t second = model.generation();
  EXPECT_GT(second, first);
  EXPECT_TRUE(model.busy());

  ASSERT_TRUE(SpinUntil([&] { return !recorder.results.empty(); }));
  // Whatever the worker still had queued is delivered now, and must be dropped.
  model.WaitForWorkers();
  QCoreApplication::processEvents();

  ASSERT_EQ(recorder.results.size(), 1u);
  const ExplorerResult r = recorder.results[0];  // a copy: ComputeNow() below appends
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.generation, second);
  EXPECT_EQ(r.report.context_tokens, 256 * 1024);
  EXPECT_EQ(model.result().generation, second);
  EXPECT_FALSE(model.busy());
  EXPECT_EQ(busy, (std::vector<bool>{true, false}));

  // The async answer equals the synchronous one for the same selection.
  const ExplorerResult now = model.ComputeNow();
  EXPECT_EQ(now.report.gpu_memory.allocated, r.report.gpu_memory.allocated);
  EXPECT_EQ(now.report.host_peak, r.report.host_peak);
  EXPECT_EQ(now.report.prediction.step_ticks, r.report.prediction.step_ticks);
  EXPECT_EQ(now.max_context_tokens, r.max_context_tokens);
}

TEST_F(ExplorerModelTest, AResultThatArrivesLateIsDropped) {
  ExplorerModel model;
  Recorder recorder(model);
  ASSERT_TRUE(model.SetContextTokens(64 * 1024));
  // The first job finishes and queues its result, which is not delivered yet ...
  model.WaitForWorkers(/*deliver=*/false);
  // ... when a newer request makes it stale.
  ASSERT_TRUE(model.SetContextTokens(512 * 1024));
  ASSERT_TRUE(SpinUntil([&] { return !recorder.results.empty(); }));
  model.WaitForWorkers();
  QCoreApplication::processEvents();
  EXPECT_EQ(model.dropped_results(), 1u);
  ASSERT_EQ(recorder.results.size(), 1u);
  EXPECT_EQ(recorder.results[0].generation, model.generation());
  EXPECT_EQ(recorder.results[0].report.context_tokens, 512 * 1024);
  EXPECT_EQ(model.result().report.context_tokens, 512 * 1024);
}

TEST_F(ExplorerModelTest, ComputeNowMakesARequestInFlightStale) {
  ExplorerModel model;
  Recorder recorder(model);
  ASSERT_TRUE(model.SetContextTokens(32 * 1024));  // async request
  const ExplorerResult now = model.ComputeNow();   // newer generation, applied at once
  ASSERT_EQ(recorder.results.size(), 1u);
  model.WaitForWorkers();
  QCoreApplication::processEvents();
  ASSERT_EQ(recorder.results.size(), 1u);  // the async one was dropped
  EXPECT_EQ(model.result().generation, now.generation);
}

TEST_F(ExplorerModelTest, DestroyingTheModelWithWorkInFlightIsSafe) {
  for (int i = 0; i < 20; ++i) {
    ExplorerModel model;
    model.SetContextTokens(int64_t{1} << (12 + i % 10));
    model.SetOffload(i % 2 == 0);
  }
  QCoreApplication::processEvents();  // nothing is left to deliver to a dead model
}

// The selection changes on this thread while both workers run (a recommendation search and a
// timeline export), and this thread computes as well: the jobs read only their own copies, and
// the planner runs on several threads at once. scripts/tsan.sh runs this under ThreadSanitizer,
// which reports a job that reads the model's own state.
TEST_F(ExplorerModelTest, EditingWhileTheWorkersRunIsSafe) {
  ExplorerModel model;
  ASSERT_TRUE(model.SetContextTokens(16 * 1024));
  model.WaitForWorkers();
  bool recommended = true, exported = false;
  QString recommendation;
  QObject::connect(&model, &ExplorerModel::recommendationDone,
                   [&](bool applied, const QString& message) {
                     recommended = applied;
                     recommendation = message;
                   });
  QObject::connect(&model, &ExplorerModel::timelineFinished,
                   [&](bool, const QString&) { exported = true; });
  const QString path = QString::fromUtf8(CTXPLAN_BINARY_DIR) + "/gui_explorer_edit_timeline.json";
  model.Recommend();
  model.ExportTimeline(path);
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(model.SetContextTokens(int64_t{32 * 1024} << (i % 3)));
    ASSERT_TRUE(model.SetOffload(i % 2 == 0));
    const ExplorerResult now = model.ComputeNow();
    EXPECT_TRUE(now.ok()) << now.error;
  }
  ASSERT_TRUE(SpinUntil([&] { return exported && !recommendation.isEmpty(); }));
  model.WaitForWorkers();
  QCoreApplication::processEvents();
  EXPECT_FALSE(recommended);
  EXPECT_EQ(recommendation.toStdString(), "the selection changed while searching");
  EXPECT_EQ(model.result().generation, model.generation());
  EXPECT_EQ(model.result().report.context_tokens, 64 * 1024);
  std::remove(path.toUtf8().constData());
}

TEST_F(ExplorerModelTest, TimelineIsWrittenAsChromeTrace) {
  ExplorerModel model;
  ASSERT_TRUE(model.SetContextTokens(16 * 1024));
  const QString path = QString::fromUtf8(CTXPLAN_BINARY_DIR) + "/gui_explorer_timeline.json";
  std::remove(path.toUtf8().constData());
  bool finished = false, ok = false;
  QString message;
  QObject::connect(&model, &ExplorerModel::timelineFinished, [&](bool success, const QString& m) {
    finished = true;
    ok = success;
    message = m;
  });
  model.ExportTimeline(path);
  ASSERT_TRUE(SpinUntil([&] { return finished; }));
  EXPECT_TRUE(ok) << message.toStdString();
  EXPECT_TRUE(message.contains("ops")) << message.toStdString();
  FILE* file = std::fopen(path.toUtf8().constData(), "rb");
  ASSERT_NE(file, nullptr);
  char head[32] = {};
  EXPECT_GT(std::fread(head, 1, sizeof head - 1, file), 0u);
  std::fclose(file);
  EXPECT_EQ(std::string(head).rfind("{\"otherData\"", 0), 0u) << head;
  std::remove(path.toUtf8().constData());

  // A directory that does not exist: an error message, not a crash.
  finished = false;
  model.ExportTimeline(QString::fromUtf8(CTXPLAN_BINARY_DIR) + "/no/such/dir/t.json");
  ASSERT_TRUE(SpinUntil([&] { return finished; }));
  EXPECT_FALSE(ok);
  EXPECT_TRUE(message.startsWith("timeline:")) << message.toStdString();
}

}  // namespace
}  // namespace ctxplan::gui
