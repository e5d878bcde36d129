// A recorded step (.ctxtrace: measured by ctxtrain, or predicted by ctxplan) against the
// planner's prediction of the same plan, without widgets: what `ctxplan replay` computes, as rows
// for a table and as two timelines (measured and predicted) for TimelineViews.
//
// Loading rebuilds the plan and the machine from the trace's metadata exactly as the replay
// command does (sim::MachineOfTrace, RunOptionsFromMetadata), so the table matches its output.
// It runs off the GUI thread (a newer Open() abandons an older one); LoadNow() is the same on
// the calling thread, for tests. A file that cannot be read or replayed gives an error string.
#pragma once

#include <QObject>
#include <QString>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ctxplan/sim/kernel_changes.h"
#include "ctxplan/sim/replay.h"
#include "model/timeline_model.h"

namespace ctxplan::gui {

// One line of `ctxplan replay`'s "by kind" table.
struct KindRow {
  OpKind kind = OpKind::kAlloc;
  OpPart part = OpPart::kNone;
  std::string name;  // "attention_bwd.paged", as the replay command prints it
  int64_t count = 0;
  double measured_seconds = 0;  // summed over the kind's ops
  double predicted_seconds = 0;

  double ratio() const { return predicted_seconds > 0 ? measured_seconds / predicted_seconds : 0; }
};

// One kind (and part) in one chunk (-1: ops of no chunk).
struct ChunkRow {
  std::string name;
  int32_t chunk = -1;
  int64_t count = 0;
  double measured_seconds = 0;  // summed over the chunk's ops of the kind
  double predicted_seconds = 0;

  double ratio() const { return predicted_seconds > 0 ? measured_seconds / predicted_seconds : 0; }
};

struct ReplayData {
  uint64_t generation = 0;  // 0: nothing loaded yet
  std::string path;
  std::string error;   // non-empty: the load failed and nothing below is valid
  std::string source;  // the trace's "source": ctxtrain, ctxplan prediction
  std::string model_name;
  std::string machine_name;
  std::string machine_origin;  // "from the trace", or "default h200-125g: <why>"
  // Kernel changes between the run and the calibration of the profile it is replayed against
  // (sim/kernel_changes.h): where not empty, the replay sets one kernel's times against another's.
  std::vector<sim::KernelChange> kernel_changes;
  sim::ReplayResult result;
  std::vector<KindRow> by_kind;  // as result.by_kind: largest measured time first
  // The trace's op records (each on its plan op's rank) with its memory records, and the same
  // plan as simulated. Never null; empty before a load and after a failed one.
  std::shared_ptr<const Timeline> measured = std::make_shared<const Timeline>();
  std::shared_ptr<const Timeline> predicted = std::make_shared<const Timeline>();

  bool ok() const { return generation != 0 && error.empty(); }
  // "step: measured 5.280 s, predicted 4.996 s (measured/predicted 1.057); ...", and a note for
  // each kernel change between the run and the profile.
  std::string Summary() const;
  // The ops of `kind` ("attention_bwd", or "attention_bwd.paged") chunk by chunk, ordered by
  // kind, part and chunk, as `ctxplan replay --by-chunk`; empty when the trace has none.
  std::vector<ChunkRow> ByChunk(const std::string& kind) const;
  // The by-kind table as CSV (name, kind, part, count, measured_s, predicted_s, ratio), written
  // atomically; throws InputError naming the file when it cannot.
  void SaveKindCsv(const std::string& path) const;
};

class ReplayModel : public QObject {
  Q_OBJECT

 public:
  explicit ReplayModel(QObject* parent = nullptr);
  ~ReplayModel() override;

  // The newest load applied (generation 0 before the first).
  const ReplayData& data() const { return data_; }
  bool busy() const { return busy_; }

  // Loads and replays `path` on the worker thread; loaded() when it lands (errors too).
  void Open(const QString& path);
  // The same on the calling thread, applied as the newest. For tests and scripted use.
  const ReplayData& LoadNow(const QString& path);
  // Blocks until the worker is idle and applies what it finished. For tests.
  void WaitForWorkers() { worker_.Wait(true); }

  // The load itself: pure, thread-safe, never throws (errors land in ReplayData::error).
  // `cancelled` is polled between stages and during the simulation.
  static ReplayData Load(const std::string& path, uint64_t generation,
                         const std::function<bool()>& cancelled = {});

 signals:
  void loaded();
  void errorOccurred(const QString& message);
  void busyChanged(bool busy);

 private:
  Q_INVOKABLE void RunPosted() { worker_.RunPosted(); }  // see WorkerQueue
  void Apply(ReplayData data);
  void SetBusy(bool busy);

  ReplayData data_;
  bool busy_ = false;
  WorkerQueue worker_;  // last: its destructor stops the worker before the rest goes
};

}  // namespace ctxplan::gui
