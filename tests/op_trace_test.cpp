// The compact op trace: round trip, validation of damaged files, and replay of a prediction
// against itself and against a different plan.
#include <gtest/gtest.h>

#include <cstring>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/run_metadata.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/replay.h"
#include "ctxplan/sim/trace_recorder.h"
#include "ctxplan/traces/op_trace.h"

namespace ctxplan {
namespace {

namespace fs = std::filesystem;

class OpTraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        fs::temp_directory_path() /
        ("ctxplan_op_trace_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
         "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Bytes(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  void Write(const fs::path& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
  }

  fs::path dir_;
};

TEST_F(OpTraceTest, RoundTripsRecordsAndMetadata) {
  const fs::path path = dir_ / "a.ctxtrace";
  TraceMetadata metadata{{"model", "qwen2.5-7b"}, {"odd", "quote \" backslash \\ newline \n"}};
  {
    OpTraceWriter writer(path, metadata);
    for (uint64_t i = 0; i < 1000; ++i)
      writer.Op({i, static_cast<int64_t>(10 * i), static_cast<int64_t>(10 * i + 7),
                 static_cast<uint8_t>(i % 20), static_cast<uint8_t>(i % 3), 2, 1,
                 static_cast<int32_t>(i / 100), static_cast<int32_t>(i % 28)});
    writer.Memory({5, 0, 3, int64_t{1} << 40});
    writer.Union({2, 31, 27, 1913});
    writer.Finish();
  }
  const OpTrace trace = ReadOpTrace(path);
  EXPECT_EQ(trace.metadata, metadata);
  ASSERT_EQ(trace.unions.size(), 1u);
  EXPECT_EQ(trace.unions[0].phase, 2);
  EXPECT_EQ(trace.unions[0].chunk, 31);
  EXPECT_EQ(trace.unions[0].layer, 27);
  EXPECT_EQ(trace.unions[0].pages, 1913);
  ASSERT_EQ(trace.ops.size(), 1000u);
  EXPECT_EQ(trace.ops[999].op_id, 999u);
  EXPECT_EQ(trace.ops[999].end_ns, 9997);
  EXPECT_EQ(trace.ops[999].layer, 999 % 28);
  ASSERT_EQ(trace.memory.size(), 1u);
  EXPECT_EQ(trace.memory[0].space_total_bytes, int64_t{1} << 40);
}

TEST_F(OpTraceTest, UnfinishedWriterLeavesNoFile) {
  const fs::path path = dir_ / "b.ctxtrace";
  {
    OpTraceWriter writer(path, {});
    writer.Op({});
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(OpTraceTest, EveryTruncationIsAClearError) {
  const fs::path path = dir_ / "c.ctxtrace";
  {
    OpTraceWriter writer(path, {{"k", "v"}});
    for (uint64_t i = 0; i < 5; ++i) writer.Op({i, 0, 1, 0, 0, 0, 0, 0, 0});
    writer.Memory({1, 0, 0, 64});
    writer.Finish();
  }
  const std::string whole = Bytes(path);
  for (size_t cut = 0; cut < whole.size(); ++cut) {
    Write(path, whole.substr(0, cut));
    try {
      ReadOpTrace(path);
      FAIL() << "a file cut at byte " << cut << " was accepted";
    } catch (const InputError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(path.string()), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  }
}

TEST_F(OpTraceTest, DamagedFilesAreClearErrors) {
  const fs::path path = dir_ / "d.ctxtrace";
  {
    OpTraceWriter writer(path, {{"k", "v"}});
    writer.Op({0, 5, 9, 0, 0, 0, 0, 0, 0});
    writer.Finish();
  }
  const std::string good = Bytes(path);
  auto expect_error = [&](const std::string& bytes, const std::string& needle) {
    Write(path, bytes);
    try {
      ReadOpTrace(path);
      FAIL() << "accepted a file that should fail with '" << needle << "'";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error("not a trace at all", "not a ctxplan op trace");
  expect_error(good + "x", "bytes after the footer");
  uint32_t metadata_bytes = 0;
  std::memcpy(&metadata_bytes, good.data() + 8, 4);
  const size_t record = 8 + 4 + metadata_bytes;  // the first record, after magic and metadata
  std::string bad_tag = good;
  bad_tag[record] = 7;
  expect_error(bad_tag, "unknown record tag 7");
  std::string backwards = good;
  backwards[record + 1 + 8] = 100;  // start_ns = 100 > end_ns = 9
  expect_error(backwards, "ends before it starts");
  std::string bad_metadata = good;
  bad_metadata[8 + 4] = '[';
  expect_error(bad_metadata, "metadata");
  std::string bad_count = good;
  bad_count[good.size() - 20] = 3;  // footer claims 3 ops (before its 4-byte checksum)
  expect_error(bad_count, "footer counts 3 ops");
  // A flipped bit no structural check sees (op 0's layer) fails the checksum.
  std::string flipped = good;
  flipped[record + 1 + 8 + 8 + 8 + 4 + 4] ^= 0x04;
  expect_error(flipped, "fails its CRC-32C");
  // Cut just before its checksum: not taken for a trace from before checksums.
  expect_error(good.substr(0, good.size() - 4), "ends before its checksum");
  EXPECT_THROW(ReadOpTrace(dir_ / "missing.ctxtrace"), InputError);
}

TEST_F(OpTraceTest, ReplayOfAPredictionMatchesItself) {
  const ModelSpec model = LoadModel("qwen2.5-7b");
  const MachineSpec machine = LoadMachine("h200-125g");
  RunOptions options;
  options.context_tokens = 20'000;
  const StepPlan plan(model, options);
  const sim::KernelTimeModel time_model(machine);
  RunMetadata metadata{{"model", model.name}};
  AddRunOptions(options, metadata);
  const fs::path path = dir_ / "prediction.ctxtrace";
  {
    OpTraceWriter writer(path, metadata);
    sim::TraceRecorder recorder(writer);
    sim::EventSimulator(time_model).Run(plan, &recorder);
    writer.Finish();
  }
  const OpTrace trace = ReadOpTrace(path);
  EXPECT_EQ(RunOptionsFromMetadata(trace.metadata, "t").context_tokens, 20'000);
  const sim::ReplayResult r = sim::Replay(trace, plan, time_model, "t");
  EXPECT_EQ(r.traced_ops, r.plan_ops);
  EXPECT_GT(r.plan_ops, 1000u);
  EXPECT_NEAR(r.measured_step_seconds, r.predicted_step_seconds, 1e-6);
  // The trace's memory records are the plan's alloc/free ops as they were when it was recorded;
  // the memory accounting may have been refined since (it counts kernel workspaces now).
  EXPECT_NEAR(static_cast<double>(r.measured_gpu_peak) / static_cast<double>(r.predicted_gpu_peak),
              1.0, 0.05);
  EXPECT_EQ(r.measured_host_peak, r.predicted_host_peak);
  for (const sim::KindComparison& k : r.by_kind)
    EXPECT_NEAR(k.measured_seconds, k.predicted_seconds, 1e-9 * k.count + 1e-9);
  // Chunk by chunk, each kind's ops add up to its total.
  for (const sim::KindComparison& k : r.by_kind) {
    int64_t count = 0;
    double measured = 0.0;
    for (const sim::ChunkComparison& c : r.by_chunk) {
      if (c.kind != k.kind || c.part != k.part) continue;
      count += c.count;
      measured += c.measured_seconds;
      EXPECT_GE(c.chunk, -1);
      EXPECT_LT(c.chunk, PlanGeometry(model, options).num_chunks());
    }
    EXPECT_EQ(count, k.count) << OpKindName(k.kind);
    EXPECT_NEAR(measured, k.measured_seconds, 1e-9 * k.count + 1e-9) << OpKindName(k.kind);
  }
  EXPECT_EQ(r.unions.layers, 0);  // a prediction records no unions
  // Host copies phase by phase add up to their kinds' totals; the backward's bring back KV and
  // dKV, so more bytes than the recompute's KV alone.
  std::map<OpKind, std::pair<int64_t, double>> copies;
  std::map<Phase, double> h2d_bytes;
  for (const sim::PhaseComparison& c : r.copies_by_phase) {
    copies[c.kind].first += c.count;
    copies[c.kind].second += c.measured_seconds;
    EXPECT_NEAR(c.measured_seconds, c.predicted_seconds, 1e-9 * c.count + 1e-9);
    if (c.kind == OpKind::kCopyH2D) h2d_bytes[c.phase] = c.predicted_bytes;
  }
  for (const sim::KindComparison& k : r.by_kind) {
    if (k.kind != OpKind::kCopyH2D && k.kind != OpKind::kCopyD2H) continue;
    EXPECT_EQ(copies[k.kind].first, k.count);
    EXPECT_NEAR(copies[k.kind].second, k.measured_seconds, 1e-9 * k.count + 1e-9);
  }
  EXPECT_EQ(copies.size(), 2u);
  EXPECT_GT(h2d_bytes[Phase::kBackward], h2d_bytes[Phase::kRecompute]);
  EXPECT_GT(h2d_bytes[Phase::kRecompute], 0.0);
  // The compute stream's waits: the same in the trace as in the plan, gap by gap (this plan's
  // offloaded copies leave the stream some).
  EXPECT_GT(r.predicted_compute_idle_seconds, 0.0);
  EXPECT_NEAR(r.measured_compute_idle_seconds, r.predicted_compute_idle_seconds, 1e-6);
  ASSERT_FALSE(r.compute_idle.empty());
  for (const sim::IdleComparison& g : r.compute_idle) {
    EXPECT_EQ(g.measured_count, g.predicted_count);
    EXPECT_NEAR(g.measured_seconds, g.predicted_seconds, 1e-9 * g.measured_count + 1e-9);
  }
  // Every compute op from the middle one on 1 ms later: one more wait of 1 ms, charged to that
  // op's phase and kind after the op before it.
  OpTrace late = trace;
  std::vector<OpRecord*> compute;
  for (OpRecord& m : late.ops)
    if (m.stream == static_cast<uint8_t>(Stream::kCompute)) compute.push_back(&m);
  std::sort(compute.begin(), compute.end(),
            [](const OpRecord* a, const OpRecord* b) { return a->start_ns < b->start_ns; });
  const size_t k = compute.size() / 2;
  for (size_t i = k; i < compute.size(); ++i) {
    compute[i]->start_ns += 1'000'000;
    compute[i]->end_ns += 1'000'000;
  }
  const sim::ReplayResult shifted = sim::Replay(late, plan, time_model, "t");
  EXPECT_NEAR(shifted.measured_compute_idle_seconds, r.measured_compute_idle_seconds + 1e-3, 1e-6);
  bool charged = false;
  for (const sim::IdleComparison& g : shifted.compute_idle)
    if (g.phase == static_cast<Phase>(compute[k]->phase) &&
        g.after == static_cast<OpKind>(compute[k]->kind) &&
        g.before == static_cast<OpKind>(compute[k - 1]->kind))
      charged = g.measured_seconds >= g.predicted_seconds + 1e-3 - 1e-6;
  EXPECT_TRUE(charged);

  // A slower machine predicts the same ops slower.
  const sim::KernelTimeModel slower(LoadMachine("h100-125g"));
  EXPECT_GT(sim::Replay(trace, plan, slower, "t").predicted_step_seconds, r.predicted_step_seconds);

  // The same trace against other options: op ids no longer line up with the same kinds.
  RunOptions other = options;
  other.offload = false;
  EXPECT_THROW(sim::Replay(trace, StepPlan(model, other), time_model, "t"), InputError);
  // Metadata of another plan version is refused before any comparison.
  RunMetadata old = trace.metadata;
  old["plan_version"] = "0";
  EXPECT_THROW(RunOptionsFromMetadata(old, "t"), InputError);
  old = trace.metadata;
  old.erase("chunk_tokens");
  EXPECT_THROW(RunOptionsFromMetadata(old, "t"), InputError);
  // A GPU tier travels with the options; a trace without one reads as none.
  EXPECT_EQ(RunOptionsFromMetadata(trace.metadata, "t").gpu_tier_pages, 0);
  RunOptions tiered = options;
  tiered.gpu_tier_pages = 37;
  RunMetadata with_tier;
  AddRunOptions(tiered, with_tier);
  EXPECT_EQ(RunOptionsFromMetadata(with_tier, "t").gpu_tier_pages, 37);
}

}  // namespace
}  // namespace ctxplan

namespace ctxplan {
namespace {

// A step recorded on an H200 by ctxtrain (traces/recorded/README.md) loads, names its run, and
// replays against the plan its metadata describes, op for op.
// Unions recorded as the plan expects them compare equal, and read as independent draws; smaller
// ones (tiles overlapping more) as fewer independent tiles.
// A pipelined run writes one trace a GPU, each of its own rank's ops and memory: replay compares
// it with that rank's ops, that GPU's predicted peak and that GPU's own share of the host's
// pinned memory (not the machine's sum over its GPUs; the other GPU's ops are not missing).
TEST_F(OpTraceTest, ReplayOfOneRankOfAPipelinedPlan) {
  const ModelSpec model = LoadModel("qwen2.5-7b");
  const MachineSpec machine = LoadMachine("h200-x2");
  RunOptions options;
  options.context_tokens = 20'000;
  options.pipeline_stages = 2;
  const StepPlan plan(model, options);
  const sim::KernelTimeModel time_model(machine);
  const fs::path path = dir_ / "prediction.ctxtrace";
  {
    RunMetadata metadata{{"model", model.name}};
    AddRunOptions(options, metadata);
    OpTraceWriter writer(path, metadata);
    sim::TraceRecorder recorder(writer);
    sim::EventSimulator(time_model).Run(plan, &recorder);
    writer.Finish();
  }
  const OpTrace both = ReadOpTrace(path);
  const sim::StepPrediction prediction = sim::EventSimulator(time_model).Run(plan);
  ASSERT_EQ(prediction.gpu_peak_by_rank.size(), 2u);
  ASSERT_EQ(prediction.host_peak_by_rank.size(), 2u);
  // Both GPUs pin pages on one host: each share is part of the machine's peak, and together they
  // hold at least it (their peaks need not fall at one moment). The analytic path agrees.
  for (const int64_t share : prediction.host_peak_by_rank) {
    EXPECT_GT(share, 0);
    EXPECT_LT(share, prediction.host.peak_bytes);
  }
  EXPECT_GE(prediction.host_peak_by_rank[0] + prediction.host_peak_by_rank[1],
            prediction.host.peak_bytes);
  EXPECT_EQ(sim::AnalyticModel(time_model).Predict(plan.geometry()).host_peak_by_rank,
            prediction.host_peak_by_rank);
  uint64_t ops_of_rank[2] = {0, 0};
  std::vector<int32_t> rank_of;
  auto ops = plan.Ops();
  while (ops.Next()) {
    const Op& op = ops.Current();
    if (rank_of.size() <= op.id) rank_of.resize(op.id + 1, -1);
    rank_of[op.id] = op.rank;
    if (!IsMemory(op.kind)) ++ops_of_rank[op.rank];
  }
  for (int rank : {0, 1}) {
    OpTrace one = both;
    one.metadata["rank"] = std::to_string(rank);
    std::erase_if(one.ops, [&](const OpRecord& m) { return rank_of[m.op_id] != rank; });
    one.memory.clear();
    const sim::ReplayResult r = sim::Replay(one, plan, time_model, "t");
    EXPECT_EQ(r.rank, rank);
    EXPECT_EQ(r.plan_ops, ops_of_rank[rank]) << rank;
    EXPECT_EQ(r.traced_ops, r.plan_ops) << rank;
    EXPECT_EQ(r.predicted_gpu_peak, prediction.gpu_peak_by_rank[static_cast<size_t>(rank)]);
    EXPECT_EQ(r.predicted_host_peak, prediction.host_peak_by_rank[static_cast<size_t>(rank)]);
    for (const sim::KindComparison& k : r.by_kind)
      EXPECT_NEAR(k.measured_seconds, k.predicted_seconds, 1e-9 * k.count + 1e-9);
  }
  EXPECT_NE(prediction.gpu_peak_by_rank[0], prediction.gpu_peak_by_rank[1]);
  // A trace naming no rank (the prediction of every GPU, as `ctxplan timeline` writes it): all.
  const sim::ReplayResult all = sim::Replay(both, plan, time_model, "t");
  EXPECT_EQ(all.rank, -1);
  EXPECT_EQ(all.plan_ops, ops_of_rank[0] + ops_of_rank[1]);
  EXPECT_EQ(all.traced_ops, all.plan_ops);
  // A rank outside the plan's stages, or not an integer: one line naming the key.
  for (const char* rank : {"2", "-1", "1x", ""}) {
    OpTrace bad = both;
    bad.metadata["rank"] = rank;
    try {
      sim::Replay(bad, plan, time_model, "t.ctxtrace");
      ADD_FAILURE() << "rank '" << rank << "' accepted";
    } catch (const InputError& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind("t.ctxtrace: metadata key 'rank': ", 0), 0u) << what;
      EXPECT_NE(what.find("accepted: "), std::string::npos) << what;
    }
  }
}

TEST(TraceUnions, ComparedWithThePlansExpectedUnion) {
  const ModelSpec model = LoadModel("llama-3.1-8b");
  const MachineSpec machine = LoadMachine("h200-125g");
  RunOptions options;
  options.context_tokens = 131'072;
  options.page_budget = 16;  // 32 tiles of 16 pages leave pages untouched: the union tells
  const StepPlan plan(model, options);
  const sim::KernelTimeModel time_model(machine);
  OpTrace with_unions;
  const PlanGeometry& geometry = plan.geometry();
  int64_t expected = 0;
  for (int32_t c = 0; c < geometry.num_chunks(); ++c) {
    const ChunkGeometry chunk = geometry.Chunk(c);
    if (!chunk.sparse) continue;
    for (int32_t layer = 0; layer < model.num_hidden_layers; ++layer) {
      with_unions.unions.push_back({1, c, layer, static_cast<int32_t>(chunk.expected_union_pages)});
      expected += chunk.expected_union_pages;
    }
  }
  ASSERT_GT(expected, 0);
  const sim::UnionComparison same = sim::Replay(with_unions, plan, time_model, "t").unions;
  EXPECT_EQ(same.layers, static_cast<int64_t>(with_unions.unions.size()));
  EXPECT_DOUBLE_EQ(same.measured_pages, static_cast<double>(expected));
  EXPECT_DOUBLE_EQ(same.predicted_pages, static_cast<double>(expected));
  EXPECT_NEAR(same.independent_tiles, same.planned_independent_tiles, 0.02);
  EXPECT_GT(same.planned_independent_tiles, 0.2);  // tiles alike, not one draw for all
  EXPECT_LT(same.planned_independent_tiles, 1.0);
  for (UnionRecord& u : with_unions.unions) u.pages = static_cast<int32_t>(0.8 * u.pages);
  const sim::UnionComparison fewer = sim::Replay(with_unions, plan, time_model, "t").unions;
  EXPECT_LT(fewer.measured_pages, fewer.predicted_pages);
  EXPECT_LT(fewer.independent_tiles, 0.9 * same.planned_independent_tiles);
  EXPECT_GT(fewer.independent_tiles, 0.0);
}

TEST(RecordedTrace, H200StepLoadsAndReplays) {
  const std::string path =
      std::string(CTXPLAN_SOURCE_DIR) + "/traces/recorded/qwen2.5-7b-32k-k64-h200.ctxtrace";
  const OpTrace trace = ReadOpTrace(path);
  EXPECT_EQ(trace.metadata.at("source"), "ctxtrain");
  EXPECT_EQ(trace.metadata.at("gpu"), "NVIDIA H200");
  const RunOptions options = RunOptionsFromMetadata(trace.metadata, path);
  EXPECT_EQ(options.context_tokens, 32768);
  const ModelSpec model = LoadModel(trace.metadata.at("model"));
  const StepPlan plan(model, options);
  const sim::KernelTimeModel time_model(LoadMachine("h200-125g"));
  const sim::ReplayResult r = sim::Replay(trace, plan, time_model, path);
  EXPECT_EQ(r.traced_ops, r.plan_ops);
  // The trace's memory records are the plan's alloc/free ops as they were when it was recorded;
  // the memory accounting may have been refined since (it counts kernel workspaces now).
  EXPECT_NEAR(static_cast<double>(r.measured_gpu_peak) / static_cast<double>(r.predicted_gpu_peak),
              1.0, 0.05);
  // The measured step and the prediction are within a factor of 1.5 of each other.
  EXPECT_GT(r.measured_step_seconds, 1.0);
  EXPECT_LT(r.measured_step_seconds / r.predicted_step_seconds, 1.5);
  EXPECT_GT(r.measured_step_seconds / r.predicted_step_seconds, 1.0 / 1.5);
  // Every linear layer's GEMMs are attributed to their ops (cuBLASLt launches them through the
  // driver API, which the tracer records): each GEMM kind's measured time is that of real GPU
  // work, within a factor of 1.5 of the roofline prediction, not the ~0 of an unclaimed launch.
  int gemm_kinds = 0;
  for (const sim::KindComparison& k : r.by_kind) {
    if (k.kind != OpKind::kLinearForward && k.kind != OpKind::kLinearBackwardInput &&
        k.kind != OpKind::kLinearBackwardWeight)
      continue;
    ++gemm_kinds;
    EXPECT_GT(k.measured_seconds / k.predicted_seconds, 1.0 / 1.5)
        << OpKindName(k.kind) << "." << OpPartName(k.part);
    EXPECT_LT(k.measured_seconds / k.predicted_seconds, 1.5)
        << OpKindName(k.kind) << "." << OpPartName(k.part);
  }
  EXPECT_EQ(gemm_kinds, 12);  // 3 kinds x 4 parts (QKV, O, gate/up, down)
  // Chunk by chunk: the paged attention backward runs once a layer in every chunk with earlier
  // pages (all but the first), and takes real time there.
  std::vector<int64_t> paged_per_chunk(
      static_cast<size_t>(options.context_tokens / options.chunk_tokens), 0);
  for (const sim::ChunkComparison& c : r.by_chunk) {
    if (c.kind != OpKind::kAttentionBackward || c.part != OpPart::kPaged) continue;
    ASSERT_GE(c.chunk, 0);
    ASSERT_LT(c.chunk, static_cast<int32_t>(paged_per_chunk.size()));
    paged_per_chunk[static_cast<size_t>(c.chunk)] = c.count;
    EXPECT_GT(c.measured_seconds / static_cast<double>(c.count), 1e-3) << "chunk " << c.chunk;
  }
  EXPECT_EQ(paged_per_chunk[0], 0);
  for (size_t chunk = 1; chunk < paged_per_chunk.size(); ++chunk)
    EXPECT_EQ(paged_per_chunk[chunk], model.num_hidden_layers) << "chunk " << chunk;
}

}  // namespace
}  // namespace ctxplan

namespace ctxplan {
namespace {

// The machine replay predicts for when the command line names none: the trace's planning machine,
// rebuilt; h200-125g with the reason when the trace names none or it cannot be rebuilt here.
TEST(TraceMachine, RebuildsThePlanningMachineOrSaysWhyNot) {
  const std::string kDefault = "default h200-125g: ";
  // Recorded before the keys existed: the default, saying so.
  sim::ReplayMachine r = sim::MachineOfTrace({{"model", "tiny"}}, "old.ctxtrace");
  EXPECT_EQ(r.machine.name, "h200-125g");
  EXPECT_EQ(r.origin, kDefault + "the trace names no machine");

  // A preset, as ctxtrain writes it.
  const MachineSpec h100 = LoadMachine("h100-125g");
  RunMetadata m;
  AddPlanMachine({"h100-125g", "", h100.host_ram_bytes, h100.name}, m);
  r = sim::MachineOfTrace(m, "t");
  EXPECT_EQ(r.machine.name, "h100-125g");
  EXPECT_EQ(r.machine.gpu.name, h100.gpu.name);
  EXPECT_EQ(r.origin, "from the trace");
  // The preset with its host RAM overridden (--machine h100-125g --host-ram 200GiB).
  m["plan_host_ram_bytes"] = std::to_string(int64_t{200} << 30);
  m["plan_machine_name"] = "h100-125g+200GiB";
  r = sim::MachineOfTrace(m, "t");
  EXPECT_EQ(r.machine.name, "h100-125g+200GiB");
  EXPECT_EQ(r.machine.host_ram_bytes, int64_t{200} << 30);
  EXPECT_EQ(r.machine.host_reserved_bytes, h100.host_reserved_bytes);

  // A GPU YAML by path, while it exists; the default, naming the file, once it is gone.
  const fs::path dir = fs::temp_directory_path() /
                       ("ctxplan_trace_machine_" +
                        std::to_string(::testing::UnitTest::GetInstance()->random_seed()));
  fs::create_directories(dir);
  const fs::path yaml = dir / "my-gpu.yaml";
  fs::copy_file(fs::path(CTXPLAN_SOURCE_DIR) / "models/gpu/h100-sxm.yaml", yaml,
                fs::copy_options::overwrite_existing);
  RunMetadata g;
  AddPlanMachine({"", yaml.string(), int64_t{250} << 30, "x"}, g);
  r = sim::MachineOfTrace(g, "t");
  EXPECT_EQ(r.origin, "from the trace");
  EXPECT_EQ(r.machine.gpu.name, LoadGpu("h100-sxm").name);
  EXPECT_EQ(r.machine.host_ram_bytes, int64_t{250} << 30);
  // Edited since into something that no longer loads: the default, with the loader's reason.
  std::ofstream(yaml) << "not: [a gpu";
  r = sim::MachineOfTrace(g, "t");
  EXPECT_EQ(r.machine.name, "h200-125g");
  EXPECT_TRUE(r.origin.starts_with(kDefault + "the trace's GPU '" + yaml.string() +
                                   "' cannot be rebuilt here"))
      << r.origin;
  fs::remove_all(dir);
  r = sim::MachineOfTrace(g, "t");
  EXPECT_EQ(r.machine.name, "h200-125g");
  EXPECT_EQ(r.origin,
            kDefault + "the trace's GPU '" + yaml.string() + "' is no longer a readable file here");

  // A GPU that left the catalogue.
  RunMetadata gone;
  AddPlanMachine({"", "tpu-v9", int64_t{125} << 30, "tpu-v9+125GiB"}, gone);
  r = sim::MachineOfTrace(gone, "t");
  EXPECT_EQ(r.machine.name, "h200-125g");
  EXPECT_NE(r.origin.find("the trace's GPU 'tpu-v9' cannot be rebuilt here"), std::string::npos)
      << r.origin;

  // ctxplan's own predictions name a machine only: a preset rebuilds, a custom one does not.
  r = sim::MachineOfTrace({{"machine", "h200-512g"}}, "t");
  EXPECT_EQ(r.machine.name, "h200-512g");
  EXPECT_EQ(r.origin, "from the trace");
  r = sim::MachineOfTrace({{"machine", "h100-sxm+64GiB"}}, "t");
  EXPECT_EQ(r.machine.name, "h200-125g");
  EXPECT_NE(r.origin.find("'h100-sxm+64GiB' is not a preset"), std::string::npos) << r.origin;

  // Damaged keys are errors naming the trace, not a silent default.
  RunMetadata bad = m;
  bad["plan_host_ram_bytes"] = "lots";
  EXPECT_THROW(sim::MachineOfTrace(bad, "t"), InputError);
}

}  // namespace
}  // namespace ctxplan
