#include "main_window.h"

#include <QBuffer>
#include <QCheckBox>
#include <QComboBox>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QHBoxLayout>
#include <QLabel>
#include <QPainter>
#include <QPushButton>
#include <QSignalBlocker>
#include <QSlider>
#include <QSpinBox>
#include <QSplitter>
#include <QStatusBar>
#include <QSvgGenerator>
#include <QTabWidget>
#include <QVBoxLayout>

#include <algorithm>
#include <cmath>
#include <string>

#include "chart_adapter.h"
#include "ctxplan/models/catalog.h"
#include "ctxplan/models/units.h"
#include "views/cost_view.h"
#include "views/replay_view.h"
#include "views/timeline_view.h"
#include "views/tradeoff_view.h"

namespace ctxplan::gui {
namespace {

constexpr int kSliderMinLog2 = 12;  // 4K
constexpr int kSliderMaxLog2 = 23;  // 8M

// A spin box whose arrows double and halve: chunk sizes and page budgets are explored in
// powers of two, while typing still accepts any value (and the model refuses the invalid ones).
// `zero_is_special`: 0 is the special value ("all") just below 1.
class DoublingSpinBox final : public QSpinBox {
 public:
  explicit DoublingSpinBox(bool zero_is_special) : zero_is_special_(zero_is_special) {
    setKeyboardTracking(false);  // one change per edit, not one per keystroke
  }

  void stepBy(int steps) override {
    int value = this->value();
    for (; steps > 0; --steps) value = zero_is_special_ && value == 0 ? 1 : value * 2;
    for (; steps < 0; ++steps) value = zero_is_special_ && value == 1 ? 0 : value / 2;
    setValue(std::clamp(value, minimum(), maximum()));
  }

 protected:
  StepEnabled stepEnabled() const override { return StepUpEnabled | StepDownEnabled; }

 private:
  bool zero_is_special_;
};

QComboBox* NewCombo(const QStringList& items) {
  auto* box = new QComboBox;
  box->addItems(items);
  return box;
}

QStringList ToStringList(const std::vector<std::string>& names) {
  QStringList list;
  for (const std::string& name : names) list.append(QString::fromStdString(name));
  return list;
}

// Selects `text` in `box`, adding it first if the list lacks it (a value set from the command
// line or a test, such as overlap:0.3).
void SelectText(QComboBox* box, const QString& text) {
  int index = box->findText(text);
  if (index < 0) {
    box->addItem(text);
    index = box->count() - 1;
  }
  box->setCurrentIndex(index);
}

QString Html(const std::string& text) {
  return QString::fromStdString(text).toHtmlEscaped();
}
QString GiBText(int64_t bytes) {
  return Html(FormatGiB(bytes));
}
QString Verdict(bool fits) {
  return fits ? "<span style='color:#2ca02c'>&#10004; fits</span>"
              : "<span style='color:#d62728'>&#10008; does not fit</span>";
}
QString Row(const QString& name, const QString& value) {
  return "<tr><td style='padding-right:10px'><b>" + name + "</b></td><td>" + value + "</td></tr>";
}

}  // namespace

int64_t MainWindow::SliderTokens(int position) {
  const double tokens =
      std::ldexp(1.0, kSliderMinLog2) * std::exp2(static_cast<double>(position) / kStepsPerOctave);
  // Whole 256-token units: the labels stay readable and nothing needs finer steps.
  return std::max<int64_t>(256, std::llround(tokens / 256.0) * 256);
}

int MainWindow::SliderPosition(int64_t tokens) {
  const double octaves =
      std::log2(static_cast<double>(std::max<int64_t>(tokens, 1))) - kSliderMinLog2;
  const int position = static_cast<int>(std::lround(octaves * kStepsPerOctave));
  return std::clamp(position, 0, (kSliderMaxLog2 - kSliderMinLog2) * kStepsPerOctave);
}

MainWindow::MainWindow(ExplorerModel& model, QWidget* parent)
    : QMainWindow(parent), model_(model), charts_(std::make_unique<ChartAdapter>()) {
  setWindowTitle("ctxplan explorer");
  auto* splitter = new QSplitter(Qt::Horizontal);
  splitter->addWidget(BuildControls());
  splitter->addWidget(BuildResults());
  splitter->setStretchFactor(1, 1);
  setCentralWidget(splitter);
  SyncControls();

  connect(&model_, &ExplorerModel::resultReady, this, [this](const ExplorerResult& result) {
    ShowResult(result);
    RefreshCurrentView();
  });
  connect(&tradeoffs_, &TradeoffModel::resultReady, this,
          [this](const TradeoffResult& result, quint64) { tradeoff_view_->Show(result); });
  connect(&tradeoffs_, &TradeoffModel::busyChanged, this,
          [this](bool busy) { tradeoff_view_->SetBusy(busy); });
  connect(&timeline_, &TimelineModel::errorOccurred, this,
          [this](const QString& message) { ShowError(message); });
  connect(tabs_, &QTabWidget::currentChanged, this, [this] { RefreshCurrentView(); });
  connect(&model_, &ExplorerModel::errorOccurred, this,
          [this](const QString& message) { ShowError(message); });
  connect(&model_, &ExplorerModel::selectionChanged, this, [this] {
    error_label_->clear();
    SyncControls();
  });
  connect(&model_, &ExplorerModel::busyChanged, this, [this](bool busy) {
    if (busy)
      statusBar()->showMessage("computing…");
    else
      statusBar()->clearMessage();
  });
  connect(&model_, &ExplorerModel::timelineFinished, this, [this](bool ok, const QString& text) {
    timeline_button_->setEnabled(true);
    if (ok)
      statusBar()->showMessage(text, 15000);
    else
      ShowError(text);
  });
  if (model_.result().generation != 0) ShowResult(model_.result());
}

MainWindow::~MainWindow() = default;

QWidget* MainWindow::BuildControls() {
  model_box_ = NewCombo(ToStringList(CatalogModelNames()));
  machine_box_ = NewCombo(ToStringList(CatalogMachineNames()));

  context_slider_ = new QSlider(Qt::Horizontal);
  context_slider_->setRange(0, (kSliderMaxLog2 - kSliderMinLog2) * kStepsPerOctave);
  context_slider_->setPageStep(kStepsPerOctave);
  context_slider_->setTickInterval(kStepsPerOctave);
  context_slider_->setTickPosition(QSlider::TicksBelow);
  context_label_ = new QLabel;
  max_button_ = new QPushButton("Go to max context");
  max_button_->setEnabled(false);
  max_button_->setToolTip("Set the context to the largest that fits in GPU and host memory");

  chunk_box_ = new DoublingSpinBox(false);
  chunk_box_->setRange(16, 1 << 20);
  chunk_box_->setSuffix(" tokens");
  page_box_ = NewCombo({"16", "32", "48", "64", "96", "128", "192", "256", "512", "1024"});
  budget_box_ = new DoublingSpinBox(true);
  budget_box_->setRange(0, 1 << 20);
  budget_box_->setSpecialValueText("all (dense)");
  budget_box_->setSuffix(" pages");
  budget_box_->setToolTip("Pages each query tile attends, plus the sink page; all = dense");
  gpus_box_ = new QSpinBox;
  gpus_box_->setRange(1, 64);
  gpus_box_->setToolTip(
      "GPUs the layers are pipelined over, chunks as micro-batches (memory is per GPU; more "
      "than the machine has spans several machines like it)");
  offload_box_ = new QCheckBox("KV/dKV pages in pinned host memory");
  gpu_tier_box_ = NewCombo({"off", "auto", "16GiB", "32GiB", "64GiB"});
  gpu_tier_box_->setToolTip(
      "With offload: keep the earliest pages' KV and dKV in GPU memory (auto: what the plan "
      "leaves free, less 2 GiB); they never cross PCIe");
  grad_box_ = NewCombo({"bf16", "fp32"});
  optimizer_box_ = NewCombo({"adamw-gpu", "adamw-host", "none"});
  selection_box_ = NewCombo({"disjoint", "shared", "overlap:0.25", "overlap:0.5", "overlap:0.75"});
  selection_box_->setToolTip(
      "Union of the query tiles' page selections: disjoint is the worst case (safe), shared the "
      "best case, overlap:F a measured overlap");
  lora_box_ = new QSpinBox;
  lora_box_->setObjectName("lora_rank");
  lora_box_->setRange(0, 1024);
  lora_box_->setSpecialValueText("off (full fine-tune)");
  lora_box_->setToolTip("LoRA adapters of this rank on every projection; the base is frozen");
  query_tile_box_ = NewCombo({"64", "128", "256", "512"});
  query_tile_box_->setObjectName("query_tile");
  query_tile_box_->setToolTip("Queries that share one page selection (at most the chunk)");
  sinks_box_ = new QSpinBox;
  sinks_box_->setObjectName("sinks");
  sinks_box_->setRange(0, 64);
  sinks_box_->setToolTip("Pages every query tile attends besides its budget (attention sinks)");
  keep_inputs_box_ = new QCheckBox("keep them from the fill (no recompute)");
  keep_inputs_box_->setObjectName("keep_layer_inputs");
  keep_inputs_box_->setToolTip(
      "Keep every chunk's layer inputs from the first pass instead of recomputing them: one "
      "forward less, GPU memory growing with the context");
  recommend_button_ = new QPushButton("Recommend settings");
  recommend_button_->setToolTip(
      "Select the fastest chunk, page, offload, kept inputs and optimizer placement that fit at "
      "this context (ctxplan recommend)");
  timeline_button_ = new QPushButton("Export timeline…");
  timeline_button_->setToolTip(
      "Simulate the selected step op by op and write it as Chrome trace JSON (Perfetto)");
  error_label_ = new QLabel;
  error_label_->setWordWrap(true);
  error_label_->setStyleSheet("color: #d62728");
  error_label_->setTextInteractionFlags(Qt::TextSelectableByMouse);

  // Each control forwards to one setter; a refusal comes back as errorOccurred.
  ExplorerModel* m = &model_;
  connect(model_box_, &QComboBox::currentTextChanged, m, &ExplorerModel::SetModelName);
  connect(machine_box_, &QComboBox::currentTextChanged, m, &ExplorerModel::SetMachineName);
  connect(context_slider_, &QSlider::valueChanged, this,
          [this](int position) { model_.SetContextTokens(SliderTokens(position)); });
  connect(max_button_, &QPushButton::clicked, this, [this] {
    if (model_.result().max_context_tokens > 0)
      model_.SetContextTokens(model_.result().max_context_tokens);
  });
  connect(chunk_box_, &QSpinBox::valueChanged, m, &ExplorerModel::SetChunkTokens);
  connect(page_box_, &QComboBox::currentTextChanged, this,
          [this](const QString& text) { model_.SetPageTokens(text.toLongLong()); });
  connect(budget_box_, &QSpinBox::valueChanged, m, &ExplorerModel::SetPageBudget);
  connect(offload_box_, &QCheckBox::toggled, m, &ExplorerModel::SetOffload);
  connect(gpus_box_, &QSpinBox::valueChanged, m, &ExplorerModel::SetGpus);
  connect(gpu_tier_box_, &QComboBox::currentTextChanged, m, &ExplorerModel::SetGpuTier);
  connect(grad_box_, &QComboBox::currentTextChanged, m, &ExplorerModel::SetGradDtype);
  connect(optimizer_box_, &QComboBox::currentTextChanged, m, &ExplorerModel::SetOptimizer);
  connect(selection_box_, &QComboBox::currentTextChanged, m, &ExplorerModel::SetSelectionModel);
  connect(lora_box_, &QSpinBox::valueChanged, m, &ExplorerModel::SetLoraRank);
  connect(query_tile_box_, &QComboBox::currentTextChanged, this,
          [this](const QString& text) { model_.SetQueryTile(text.toLongLong()); });
  connect(sinks_box_, &QSpinBox::valueChanged, m, &ExplorerModel::SetSinkPages);
  connect(keep_inputs_box_, &QCheckBox::toggled, m, &ExplorerModel::SetKeepLayerInputs);
  connect(timeline_button_, &QPushButton::clicked, this, [this] { ExportTimeline(); });
  connect(recommend_button_, &QPushButton::clicked, m, &ExplorerModel::Recommend);
  connect(m, &ExplorerModel::recommendationDone, this, [this](bool applied, const QString& text) {
    error_label_->setText(applied ? QString() : "Recommend: " + text);
  });

  auto* context_row = new QVBoxLayout;
  context_row->addWidget(context_slider_);
  context_row->addWidget(context_label_);
  context_row->addWidget(max_button_);

  auto* form = new QFormLayout;
  form->addRow("Model", model_box_);
  form->addRow("Machine", machine_box_);
  form->addRow("Context", context_row);
  form->addRow("Chunk", chunk_box_);
  form->addRow("Page", page_box_);
  form->addRow("Budget", budget_box_);
  form->addRow("Offload", offload_box_);
  form->addRow("GPUs", gpus_box_);
  form->addRow("GPU tier", gpu_tier_box_);
  form->addRow("Gradients", grad_box_);
  form->addRow("Optimizer", optimizer_box_);
  form->addRow("Selection", selection_box_);
  form->addRow("Query tile", query_tile_box_);
  form->addRow("Sink pages", sinks_box_);
  form->addRow("Layer inputs", keep_inputs_box_);
  form->addRow("LoRA rank", lora_box_);

  auto* panel = new QWidget;
  auto* layout = new QVBoxLayout(panel);
  layout->addLayout(form);
  layout->addWidget(recommend_button_);
  layout->addWidget(timeline_button_);
  layout->addWidget(error_label_);
  layout->addStretch(1);
  panel->setMinimumWidth(320);
  panel->setMaximumWidth(420);
  return panel;
}

const QStringList& MainWindow::ViewNames() {
  static const QStringList names = {"memory", "tradeoffs", "timeline", "replay", "cost"};
  return names;
}

void MainWindow::RefreshCurrentView() {
  const uint64_t generation = model_.result().generation;
  if (generation == 0 || !model_.result().ok()) return;
  const QString view = ViewNames().value(tabs_->currentIndex());
  if (view == "tradeoffs" && tradeoffs_for_ != generation) {
    tradeoffs_for_ = generation;
    tradeoffs_.Request(model_.result().selection);
  } else if (view == "timeline" && timeline_for_ != generation) {
    timeline_for_ = generation;
    timeline_.Request(model_.result().selection);
  }
}

// A point of the trade-off map becomes the selection: its chunk before its page (a page must
// divide the chunk), its tier by name (options alone cannot tell auto from a size).
void MainWindow::ChooseTradeoff(const RunOptions& o) {
  const TradeoffPoint* point = tradeoff_view_->PointFor(o);
  model_.SetChunkTokens(o.chunk_tokens);
  model_.SetPageTokens(o.page_tokens);
  model_.SetPageBudget(o.page_budget);
  model_.SetOffload(o.offload);
  if (point != nullptr) model_.SetGpuTier(QString::fromStdString(point->gpu_tier_text));
  tabs_->setCurrentIndex(0);
}

bool MainWindow::ShowViewNow(const QString& name) {
  const int index = static_cast<int>(ViewNames().indexOf(name));
  if (index < 0) return false;
  tabs_->setCurrentIndex(index);
  const ExplorerResult& result = model_.result();
  if (name == "tradeoffs" && result.ok()) {
    tradeoffs_for_ = result.generation;
    tradeoff_view_->Show(tradeoffs_.ComputeNow(result.selection));
  } else if (name == "timeline" && result.ok()) {
    timeline_for_ = result.generation;
    const QString error = timeline_.ComputeNow(result.selection);
    if (!error.isEmpty()) ShowError(error);
    timeline_view_->SetTimeline(timeline_.timeline());
  } else if (name == "cost" && result.ok()) {
    cost_view_->Show(result.report);
  }
  return true;
}

void MainWindow::OpenTrace(const QString& path) {
  tabs_->setCurrentIndex(static_cast<int>(ViewNames().indexOf("replay")));
  replay_view_->OpenTrace(path);
}

QString MainWindow::OpenTraceNow(const QString& path) {
  tabs_->setCurrentIndex(static_cast<int>(ViewNames().indexOf("replay")));
  return replay_view_->OpenTraceNow(path);
}

namespace {

// A widget as a picture: PNG as grabbed, SVG as it paints itself into a QSvgGenerator; written
// whole or not at all (SaveBytes).
bool SaveWidgetPicture(QWidget* widget, const QString& path, bool svg, QString* error) {
  QByteArray bytes;
  QBuffer buffer(&bytes);
  buffer.open(QIODevice::WriteOnly);
  if (svg) {
    QSvgGenerator generator;
    generator.setOutputDevice(&buffer);
    generator.setSize(widget->size());
    generator.setViewBox(widget->rect());
    generator.setTitle("ctxplan explorer");
    QPainter painter(&generator);
    widget->render(&painter);
  } else if (!widget->grab().save(&buffer, "PNG")) {
    if (error != nullptr) *error = "PNG encoding failed";
    return false;
  }
  return SaveBytes(path, bytes, error);
}

// The memory-and-speed curve: one row a context.
QByteArray CurveCsv(const ExplorerResult& result) {
  QByteArray csv =
      "context_tokens,gpu_allocated_bytes,gpu_device_bytes,host_peak_bytes,fits_gpu,fits_host,"
      "tokens_per_second,step_seconds\n";
  for (const CurvePoint& p : result.curve)
    csv += QString("%1,%2,%3,%4,%5,%6,%7,%8\n")
               .arg(p.context_tokens)
               .arg(p.gpu_allocated)
               .arg(p.gpu_device)
               .arg(p.host_peak)
               .arg(p.fits_gpu ? 1 : 0)
               .arg(p.fits_host ? 1 : 0)
               .arg(p.tokens_per_second, 0, 'f', 1)
               .arg(p.step_seconds, 0, 'f', 6)
               .toUtf8();
  return csv;
}

}  // namespace

bool MainWindow::ExportCurrentView(const QString& path, QString* error) {
  const QString view = ViewNames().value(tabs_->currentIndex());
  const QString suffix = QFileInfo(path).suffix().toLower();
  QString why;
  bool ok = false;
  if (suffix != "png" && suffix != "svg" && suffix != "csv") {
    why = "'." + suffix + "' is not a format; accepted: .png, .svg, .csv";
  } else if (view == "tradeoffs") {
    ok = suffix == "png"   ? tradeoff_view_->SavePng(path)
         : suffix == "svg" ? tradeoff_view_->SaveSvg(path)
                           : tradeoff_view_->SaveCsv(path);
  } else if (view == "timeline") {
    ok = suffix == "png"   ? timeline_view_->SavePng(path, &why)
         : suffix == "svg" ? timeline_view_->SaveSvg(path, &why)
                           : timeline_view_->SaveCsv(path, &why);
  } else if (view == "replay") {
    ok = suffix == "png"   ? replay_view_->SavePng(path, &why)
         : suffix == "svg" ? replay_view_->SaveSvg(path, &why)
                           : replay_view_->SaveKindCsv(path, &why);
  } else if (suffix == "csv") {  // memory: the curve; cost: its figures
    ok = view == "memory" ? SaveBytes(path, CurveCsv(model_.result()), &why)
                          : cost_view_->SaveCsv(path);
  } else {
    ok = SaveWidgetPicture(tabs_->currentWidget(), path, suffix == "svg", &why);
  }
  if (!ok && error != nullptr)
    *error = "cannot export the " + view + " view to " + path + (why.isEmpty() ? "" : ": " + why);
  return ok;
}

QWidget* MainWindow::BuildResults() {
  summary_ = new QLabel;
  summary_->setTextFormat(Qt::RichText);
  summary_->setWordWrap(true);
  summary_->setAlignment(Qt::AlignTop | Qt::AlignLeft);
  summary_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  summary_->setMinimumWidth(380);

  auto* bottom = new QWidget;
  auto* row = new QHBoxLayout(bottom);
  row->setContentsMargins(0, 0, 0, 0);
  row->addWidget(charts_->category_view(), 3);
  row->addWidget(summary_, 2);

  auto* splitter = new QSplitter(Qt::Vertical);
  splitter->addWidget(charts_->curve_view());
  splitter->addWidget(bottom);
  // Stretch factors apply only to growth; give the curve, the main answer, most of the height.
  splitter->setSizes({540, 340});

  tradeoff_view_ = new TradeoffView([this](const RunOptions& o) { ChooseTradeoff(o); });
  timeline_view_ = new TimelineView;
  timeline_view_->Follow(timeline_);
  timeline_view_->SetTitle("simulated step");
  replay_view_ = new ReplayView;
  open_trace_button_ = new QPushButton("Open trace…");
  open_trace_button_->setToolTip("A .ctxtrace recorded by ctxtrain --trace, against the plan");
  connect(open_trace_button_, &QPushButton::clicked, this, [this] {
    const QString path =
        QFileDialog::getOpenFileName(this, "Open trace", QString(), "ctxplan traces (*.ctxtrace)");
    if (!path.isEmpty()) OpenTrace(path);
  });
  auto* replay_tab = new QWidget;
  auto* replay_layout = new QVBoxLayout(replay_tab);
  replay_layout->addWidget(open_trace_button_, 0, Qt::AlignLeft);
  replay_layout->addWidget(replay_view_, 1);
  cost_view_ = new CostView;

  tabs_ = new QTabWidget;
  tabs_->addTab(splitter, "Memory and speed");
  tabs_->addTab(tradeoff_view_, "Trade-offs");
  tabs_->addTab(timeline_view_, "Step timeline");
  tabs_->addTab(replay_tab, "Replay");
  tabs_->addTab(cost_view_, "Cost");
  export_view_button_ = new QPushButton("Export view…");
  export_view_button_->setToolTip("The view shown: PNG, SVG or CSV (by the file's suffix)");
  tabs_->setCornerWidget(export_view_button_);
  connect(export_view_button_, &QPushButton::clicked, this, [this] {
    const QString path = QFileDialog::getSaveFileName(this, "Export view", "ctxplan-view.png",
                                                      "PNG (*.png);;SVG (*.svg);;CSV (*.csv)");
    QString error;
    if (!path.isEmpty() && !ExportCurrentView(path, &error)) ShowError(error);
  });
  return tabs_;
}

void MainWindow::SyncControls() {
  const ExplorerSelection& s = model_.selection();
  const RunOptions& o = s.options;
  const QSignalBlocker b1(model_box_), b2(machine_box_), b3(context_slider_), b4(chunk_box_),
      b5(page_box_), b6(budget_box_), b7(offload_box_), b8(grad_box_), b9(optimizer_box_),
      b10(selection_box_), b11(gpu_tier_box_), b12(gpus_box_), b13(lora_box_), b14(query_tile_box_),
      b15(sinks_box_), b16(keep_inputs_box_);
  SelectText(model_box_, QString::fromStdString(s.model_name));
  SelectText(machine_box_, QString::fromStdString(s.machine_name));
  context_slider_->setValue(SliderPosition(o.context_tokens));
  context_label_->setText(QString::fromStdString(FormatTokens(o.context_tokens)) + " tokens");
  chunk_box_->setValue(static_cast<int>(o.chunk_tokens));
  SelectText(page_box_, QString::number(o.page_tokens));
  budget_box_->setValue(static_cast<int>(o.page_budget));
  offload_box_->setChecked(o.offload);
  gpus_box_->setValue(o.pipeline_stages);
  SelectText(gpu_tier_box_, QString::fromStdString(s.gpu_tier_text));
  SelectText(grad_box_, QString::fromUtf8(GradDtypeName(o.grad_dtype)));
  SelectText(optimizer_box_, QString::fromUtf8(OptimizerName(o.optimizer)));
  SelectText(selection_box_, QString::fromStdString(SelectionModelName(o.selection)));
  lora_box_->setValue(static_cast<int>(o.lora_rank));
  SelectText(query_tile_box_, QString::number(o.query_tile));
  sinks_box_->setValue(static_cast<int>(o.sink_pages));
  keep_inputs_box_->setChecked(o.keep_layer_inputs);
}

void MainWindow::ShowError(const QString& message) {
  error_label_->setText(message);
  SyncControls();  // the model kept its state: show that state again
}

void MainWindow::ShowResult(const ExplorerResult& result) {
  if (!result.ok()) return;  // errorOccurred already showed why
  charts_->Show(result);
  cost_view_->Show(result.report);
  const sim::PlanReport& r = result.report;
  const ExplorerSelection& s = result.selection;
  max_button_->setEnabled(result.max_context_tokens > 0);

  QString html = "<p><b>" + Html(s.model_name) + "</b> on <b>" + Html(s.machine_name) + "</b> (" +
                 Html(s.machine.gpu.display_name) + ", " + GiBText(s.machine.host_ram_bytes) +
                 " host RAM)</p><table>";
  html += Row("context", Html(FormatTokens(r.context_tokens)) + " tokens, " +
                             Html(FormatCount(r.chunks)) + " chunks");
  html += Row("GPU peak", "allocated " + GiBText(r.gpu_memory.allocated) + "<br>reserved " +
                              GiBText(r.gpu_memory.reserved) + "<br>device " +
                              GiBText(r.gpu_memory.device) + " of " + GiBText(r.gpu_capacity) +
                              " " + Verdict(r.fits_gpu));
  html += Row("host peak", GiBText(r.host_peak) + " pinned of " + GiBText(r.host_capacity) +
                               " usable " + Verdict(r.fits_host));
  html += Row("step", QString("%1 s, %2 tokens/s, %3 TFLOP/s")
                          .arg(r.prediction.step_seconds(), 0, 'f', 2)
                          .arg(Html(FormatCount(std::llround(r.tokens_per_second))))
                          .arg(r.achieved_tflops, 0, 'f', 0));
  html += Row("bottleneck", Html(std::string(sim::BottleneckName(r.bottleneck))) +
                                QString(" (busy: compute %1%, H2D %2%, D2H %3%)")
                                    .arg(std::lround(100 * r.compute_utilisation))
                                    .arg(std::lround(100 * r.h2d_utilisation))
                                    .arg(std::lround(100 * r.d2h_utilisation)));
  QString max_context;
  if (result.limit == sim::CapacityLimit::kNothingFits) {
    max_context = "nothing fits: the fixed buffers alone exceed a capacity";
  } else {
    max_context = Html(FormatTokens(result.max_context_tokens)) + " tokens, bound by " +
                  Html(std::string(sim::CapacityLimitName(result.limit))) +
                  QString(" (%1 tokens/s there)")
                      .arg(Html(FormatCount(std::llround(result.at_max.tokens_per_second))));
  }
  html += Row("max context", max_context);
  html += "</table>";
  summary_->setText(html);
}

void MainWindow::ExportTimeline() {
  const QString path = QFileDialog::getSaveFileName(
      this, "Export timeline", "ctxplan-timeline.json", "Chrome trace JSON (*.json)");
  if (path.isEmpty()) return;
  timeline_button_->setEnabled(false);
  statusBar()->showMessage("simulating the step op by op for the timeline…");
  model_.ExportTimeline(path);
}

}  // namespace ctxplan::gui
