// The explorer's window: controls on the left, charts and a summary on the right. It holds no
// logic of its own: every control calls an ExplorerModel setter, and the window redraws from
// the model's signals. No Q_OBJECT: connections are lambdas, which keeps moc to one class.
#pragma once

#include <QMainWindow>

#include <memory>

#include "explorer_model.h"
#include "model/timeline_model.h"
#include "model/tradeoff_model.h"

QT_BEGIN_NAMESPACE
class QCheckBox;
class QComboBox;
class QLabel;
class QPushButton;
class QSlider;
class QSpinBox;
class QTabWidget;
QT_END_NAMESPACE

namespace ctxplan::gui {

class ChartAdapter;
class CostView;
class ReplayView;
class TimelineView;
class TradeoffView;

class MainWindow : public QMainWindow {
 public:
  explicit MainWindow(ExplorerModel& model, QWidget* parent = nullptr);
  ~MainWindow() override;

  // The context slider: log scale, kStepsPerOctave positions per doubling from 4K to 8M.
  static constexpr int kStepsPerOctave = 8;
  static int64_t SliderTokens(int position);
  static int SliderPosition(int64_t tokens);

  // The views, as tabs: memory (memory and speed against context), tradeoffs (the choices at
  // this context), timeline (the simulated step), replay (a recorded trace against it), cost.
  static const QStringList& ViewNames();
  // Shows the named view with its data computed now (the screenshots; the app computes them in
  // the background). False for a name that is not a view.
  bool ShowViewNow(const QString& name);
  // Loads a recorded trace into the replay view (in the background); its result shows there.
  void OpenTrace(const QString& path);
  // The same, now: the error (naming the file), or empty.
  QString OpenTraceNow(const QString& path);
  // Saves the current view as PNG, SVG or CSV, by the file's suffix; an error names the file.
  bool ExportCurrentView(const QString& path, QString* error);

 private:
  QWidget* BuildControls();
  QWidget* BuildResults();
  // Sets every control from the model's selection without echoing back into the model: after
  // a refused change this puts the control back to what the model still holds.
  void SyncControls();
  void ShowResult(const ExplorerResult& result);
  void ShowError(const QString& message);
  void ExportTimeline();
  // Asks the current tab's background model for the selection now shown, when it has not yet.
  void RefreshCurrentView();
  void ChooseTradeoff(const RunOptions& options);

  ExplorerModel& model_;
  std::unique_ptr<ChartAdapter> charts_;
  TradeoffModel tradeoffs_;
  TimelineModel timeline_;
  // The explorer generation each background view last asked for (0: none yet).
  uint64_t tradeoffs_for_ = 0, timeline_for_ = 0;

  QTabWidget* tabs_ = nullptr;
  TradeoffView* tradeoff_view_ = nullptr;
  TimelineView* timeline_view_ = nullptr;
  ReplayView* replay_view_ = nullptr;
  CostView* cost_view_ = nullptr;
  QPushButton* open_trace_button_ = nullptr;
  QPushButton* export_view_button_ = nullptr;

  QComboBox* model_box_ = nullptr;
  QComboBox* machine_box_ = nullptr;
  QSlider* context_slider_ = nullptr;
  QLabel* context_label_ = nullptr;
  QSpinBox* chunk_box_ = nullptr;
  QComboBox* page_box_ = nullptr;
  QSpinBox* budget_box_ = nullptr;
  QCheckBox* offload_box_ = nullptr;
  QSpinBox* gpus_box_ = nullptr;
  QComboBox* gpu_tier_box_ = nullptr;
  QPushButton* recommend_button_ = nullptr;
  QComboBox* grad_box_ = nullptr;
  QComboBox* optimizer_box_ = nullptr;
  QComboBox* selection_box_ = nullptr;
  QSpinBox* lora_box_ = nullptr;
  QComboBox* query_tile_box_ = nullptr;
  QSpinBox* sinks_box_ = nullptr;
  QCheckBox* keep_inputs_box_ = nullptr;
  QPushButton* max_button_ = nullptr;
  QPushButton* timeline_button_ = nullptr;
  QLabel* error_label_ = nullptr;
  QLabel* summary_ = nullptr;
};

}  // namespace ctxplan::gui
