// The trade-off model, headless: the grid of settings around the explorer's selection, its
// Pareto frontier, agreement with `ctxplan recommend`, the worker's newest-request-wins rule and
// the CSV export.
#include <QCoreApplication>
#include <QElapsedTimer>
#include <QEventLoop>

#include <algorithm>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ctxplan/models/catalog.h"
#include "ctxplan/sim/recommend.h"
#include "model/tradeoff_model.h"

namespace ctxplan::gui {
namespace {

QCoreApplication& App() {
  static int argc = 1;
  static char name[] = "gui_tradeoff_model_test";
  static char* argv[] = {name, nullptr};
  static QCoreApplication* app = new QCoreApplication(argc, argv);
  return *app;
}

template <typename Done>
bool SpinUntil(Done done, int timeout_ms = 20000) {
  App();
  QElapsedTimer timer;
  timer.start();
  while (!done() && timer.elapsed() < timeout_ms)
    QCoreApplication::processEvents(QEventLoop::AllEvents | QEventLoop::WaitForMoreEvents, 50);
  return done();
}

// The explorer's defaults (Qwen2.5-7B on h200-125g, RunOptions' defaults) at `context` tokens.
ExplorerSelection Selection(int64_t context) {
  ExplorerSelection s;
  s.model_name = "qwen2.5-7b";
  s.machine_name = "h200-125g";
  s.model = LoadModel(s.model_name);
  s.machine = LoadMachine(s.machine_name);
  s.options.context_tokens = context;
  return s;
}

// One grid at 128K for the tests that only read it: the computation is the slow part.
const TradeoffResult& Grid128K() {
  static const TradeoffResult result = TradeoffModel::Compute(Selection(128 * 1024), 1);
  return result;
}

class TradeoffModelTest : public ::testing::Test {
 protected:
  void SetUp() override { App(); }
};

TEST_F(TradeoffModelTest, GridHasEveryChoiceOnce) {
  const TradeoffResult& r = Grid128K();
  ASSERT_TRUE(r.ok()) << r.error;
  // 4 chunks x 2 pages x 3 budgets x 3 offload modes; at 128K no chunk exceeds the context.
  ASSERT_EQ(r.points.size(), 72u);
  std::set<std::string> labels;
  for (const TradeoffPoint& p : r.points) {
    labels.insert(p.label);
    EXPECT_EQ(p.options.context_tokens, 128 * 1024);
    EXPECT_EQ(p.options.offload, p.offload != OffloadMode::kOff) << p.label;
    EXPECT_EQ(p.gpu_tier_text, p.offload == OffloadMode::kHostWithTier ? "auto" : "off");
    // The selection's other options are kept.
    EXPECT_EQ(p.options.grad_dtype, r.selection.options.grad_dtype);
    EXPECT_EQ(p.options.optimizer, r.selection.options.optimizer);
    EXPECT_EQ(p.options.pipeline_stages, r.selection.options.pipeline_stages);
    EXPECT_EQ(p.options.sink_pages, r.selection.options.sink_pages);
    EXPECT_GT(p.tokens_per_second, 0.0) << p.label;  // predicted even where it does not fit
    EXPECT_GT(p.gpu_device, 0) << p.label;
    // Memory grows with the context, so fitting at 128K means fitting up to at least 128K.
    EXPECT_EQ(p.fits, p.max_context_tokens >= 128 * 1024) << p.label;
  }
  EXPECT_EQ(labels.size(), r.points.size());  // labels tell the points apart
  EXPECT_TRUE(labels.count("c4096 p128 k64 offload+tier")) << *labels.begin();
  EXPECT_TRUE(labels.count("c1024 p64 dense no-offload"));
  // The explorer's defaults (c4096 p128 k64, offload on, tier off) are on the grid.
  ASSERT_GE(r.selected_index, 0);
  EXPECT_EQ(r.points[r.selected_index].label, "c4096 p128 k64 offload");
  EXPECT_EQ(r.selected.max_context_tokens, r.points[r.selected_index].max_context_tokens);
  EXPECT_EQ(r.selected.tokens_per_second, r.points[r.selected_index].tokens_per_second);
  // At 128K every setting fits this 141 GB GPU; at 1M keeping the pages on the GPU does not.
  EXPECT_EQ(r.fitting(), 72);
}

TEST_F(TradeoffModelTest, AtOneMillionOnlyOffloadFits) {
  const TradeoffResult r = TradeoffModel::Compute(Selection(int64_t{1} << 20), 1);
  ASSERT_TRUE(r.ok()) << r.error;
  ASSERT_EQ(r.points.size(), 72u);
  for (const TradeoffPoint& p : r.points) {
    if (p.offload == OffloadMode::kOff) {
      EXPECT_FALSE(p.fits) << p.label;
      EXPECT_FALSE(p.fits_gpu) << p.label;
      EXPECT_FALSE(p.frontier) << p.label;
    }
  }
  EXPECT_GT(r.fitting(), 0);
  EXPECT_LE(r.fitting(), 48);
  EXPECT_GT(r.frontier_size(), 0);
}

TEST_F(TradeoffModelTest, FrontierIsPareto) {
  const TradeoffResult& r = Grid128K();
  ASSERT_TRUE(r.ok()) << r.error;
  ASSERT_GT(r.frontier_size(), 0);
  for (const TradeoffPoint& p : r.points) {
    if (!p.frontier) continue;
    EXPECT_TRUE(p.fits) << p.label;
    for (const TradeoffPoint& q : r.points) {
      if (!q.fits) continue;
      const bool dominates = q.max_context_tokens >= p.max_context_tokens &&
                             q.tokens_per_second >= p.tokens_per_second &&
                             (q.max_context_tokens > p.max_context_tokens ||
                              q.tokens_per_second > p.tokens_per_second);
      EXPECT_FALSE(dominates) << q.label << " dominates frontier point " << p.label;
    }
  }
  // And every fitting point off the frontier is dominated by one on it (the frontier is whole).
  for (const TradeoffPoint& p : r.points) {
    if (!p.fits || p.frontier) continue;
    const bool dominated = std::any_of(r.points.begin(), r.points.end(), [&](const auto& q) {
      return q.frontier && q.max_context_tokens >= p.max_context_tokens &&
             q.tokens_per_second >= p.tokens_per_second;
    });
    EXPECT_TRUE(dominated) << p.label;
  }
  // The top speed and the longest reach are both on it. (The first fastest point itself may
  // not be: at 128K the auto GPU tier holds every page, so "offload+tier" runs exactly as fast as
  // "no-offload" and reaches further; recommend keeps the first, the frontier the other.)
  ASSERT_GE(r.fastest_fitting(), 0);
  const double top = r.points[r.fastest_fitting()].tokens_per_second;
  EXPECT_TRUE(std::any_of(r.points.begin(), r.points.end(), [&](const TradeoffPoint& p) {
    return p.frontier && p.tokens_per_second == top;
  }));
  const auto longest = std::max_element(r.points.begin(), r.points.end(), [](auto& a, auto& b) {
    return (a.fits ? a.max_context_tokens : -1) < (b.fits ? b.max_context_tokens : -1);
  });
  EXPECT_TRUE(longest->frontier) << longest->label;
}

// recommend keeps the user's page budget and searches chunk, page, offload and the tier; asked
// the same space (no kept inputs or optimizer placement, which the grid leaves to the user),
// its fastest for each budget is the grid's fastest fitting point with that budget.
TEST_F(TradeoffModelTest, FastestMatchesRecommend) {
  const TradeoffResult& r = Grid128K();
  ASSERT_TRUE(r.ok()) << r.error;
  sim::RecommendSpace space;
  space.chunks = TradeoffModel::GridChunks();
  space.pages = TradeoffModel::GridPages();
  space.offload = {false, true};
  space.keep_layer_inputs = {r.selection.options.keep_layer_inputs};
  space.search_optimizer_placement = false;
  space.gpu_tiers = sim::SearchedGpuTiers("2GiB");
  double fastest_overall = 0;
  for (const int64_t budget : TradeoffModel::GridBudgets()) {
    SCOPED_TRACE(testing::Message() << "budget " << budget);
    RunOptions base = r.selection.options;
    base.page_budget = budget;
    const sim::Recommendation rec =
        sim::Recommend(r.selection.model, r.selection.machine, base, r.selection.gpu_tier, space);
    EXPECT_EQ(rec.evaluated, 24);  // the grid's 72 is these three searches together
    const TradeoffPoint* best = nullptr;
    for (const TradeoffPoint& p : r.points)
      if (p.fits && p.options.page_budget == budget &&
          (!best || p.tokens_per_second > best->tokens_per_second))
        best = &p;
    ASSERT_EQ(best != nullptr, rec.fastest.has_value());
    if (!best) continue;
    fastest_overall = std::max(fastest_overall, best->tokens_per_second);
    EXPECT_EQ(best->options.chunk_tokens, rec.fastest->options.chunk_tokens) << best->label;
    EXPECT_EQ(best->options.page_tokens, rec.fastest->options.page_tokens) << best->label;
    EXPECT_EQ(best->options.offload, rec.fastest->options.offload) << best->label;
    EXPECT_EQ(best->options.gpu_tier_pages, rec.fastest->options.gpu_tier_pages) << best->label;
    EXPECT_EQ(best->gpu_tier_text, sim::GpuTierFlag(rec.fastest->gpu_tier)) << best->label;
    EXPECT_DOUBLE_EQ(best->tokens_per_second, rec.fastest->report.tokens_per_second);
    EXPECT_EQ(best->max_context_tokens, rec.fastest->max_context_tokens);
  }
  ASSERT_GE(r.fastest_fitting(), 0);
  EXPECT_DOUBLE_EQ(r.points[r.fastest_fitting()].tokens_per_second, fastest_overall);
}

TEST_F(TradeoffModelTest, ShortContextSkipsChunksBeyondIt) {
  // At 2K the 4K and 8K chunks would plan as the 2K one: only the first chunk may exceed it.
  const TradeoffResult r = TradeoffModel::Compute(Selection(2048), 1);
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.points.size(), 36u);  // chunks 1024 and 2048
  // The selection (chunk 4096) is off this grid: still planned, for the highlight.
  EXPECT_EQ(r.selected_index, -1);
  EXPECT_GT(r.selected.tokens_per_second, 0.0);
}

TEST_F(TradeoffModelTest, CsvHasARowAPoint) {
  const TradeoffResult& r = Grid128K();
  ASSERT_TRUE(r.ok()) << r.error;
  std::ostringstream out;
  TradeoffModel::WriteCsv(out, r);
  std::istringstream in(out.str());
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), r.points.size() + 1);
  EXPECT_EQ(lines[0].rfind("label,chunk_tokens,", 0), 0u) << lines[0];
  const size_t columns = std::count(lines[0].begin(), lines[0].end(), ',');
  int frontier_rows = 0;
  for (size_t i = 1; i < lines.size(); ++i) {
    EXPECT_EQ(std::count(lines[i].begin(), lines[i].end(), ','), columns) << lines[i];
    EXPECT_EQ(lines[i].rfind(r.points[i - 1].label + ",", 0), 0u) << lines[i];
    // The frontier flag is the second-to-last column.
    const size_t last = lines[i].rfind(',');
    frontier_rows += lines[i].substr(lines[i].rfind(',', last - 1) + 1, 1) == "1";
  }
  EXPECT_EQ(frontier_rows, r.frontier_size());
}

TEST_F(TradeoffModelTest, AStaleRequestIsDropped) {
  TradeoffModel model;
  std::vector<TradeoffResult> results;
  std::vector<bool> busy;
  QObject::connect(&model, &TradeoffModel::resultReady,
                   [&](const TradeoffResult& r, quint64 generation) {
                     EXPECT_EQ(r.generation, generation);
                     results.push_back(r);
                   });
  QObject::connect(&model, &TradeoffModel::busyChanged, [&](bool b) { busy.push_back(b); });

  // Back to back: the first is stale before it starts or gives up at its next point.
  const uint64_t first = model.Request(Selection(64 * 1024));
  const uint64_t second = model.Request(Selection(256 * 1024));
  EXPECT_GT(second, first);
  EXPECT_TRUE(model.busy());
  ASSERT_TRUE(SpinUntil([&] { return !results.empty(); }));
  model.WaitForWorkers();
  QCoreApplication::processEvents();
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].generation, second);
  EXPECT_EQ(results[0].selection.options.context_tokens, 256 * 1024);
  EXPECT_EQ(model.result().generation, second);
  EXPECT_FALSE(model.busy());
  EXPECT_EQ(busy, (std::vector<bool>{true, false}));

  // A result that finished but had not been delivered when a newer request came is dropped.
  model.Request(Selection(64 * 1024));
  model.WaitForWorkers(/*deliver=*/false);
  const uint64_t newest = model.Request(Selection(32 * 1024));
  ASSERT_TRUE(SpinUntil([&] { return results.size() == 2; }));
  model.WaitForWorkers();
  QCoreApplication::processEvents();
  EXPECT_EQ(model.dropped_results(), 1u);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[1].generation, newest);
  EXPECT_EQ(results[1].selection.options.context_tokens, 32 * 1024);

  // ComputeNow makes a request in flight stale.
  model.Request(Selection(512 * 1024));
  const TradeoffResult now = model.ComputeNow(Selection(16 * 1024));
  model.WaitForWorkers();
  QCoreApplication::processEvents();
  EXPECT_EQ(model.result().generation, now.generation);
  EXPECT_EQ(results.back().generation, now.generation);
}

TEST_F(TradeoffModelTest, CancelledComputationGivesUpBetweenPoints) {
  int polls = 0;
  const TradeoffResult r = TradeoffModel::Compute(Selection(128 * 1024), 7, [&] {
    return ++polls > 3;  // the selection, then two points, then stale
  });
  EXPECT_EQ(r.error, "cancelled");
  EXPECT_TRUE(r.points.empty());
  EXPECT_EQ(polls, 4);
}

TEST_F(TradeoffModelTest, DestroyingTheModelWithWorkInFlightIsSafe) {
  for (int i = 0; i < 5; ++i) {
    TradeoffModel model;
    model.Request(Selection(int64_t{32 * 1024} << i));
    model.Request(Selection(int64_t{16 * 1024} << i));
  }
  QCoreApplication::processEvents();
}

}  // namespace
}  // namespace ctxplan::gui
