#include "views/replay_view.h"

#include <QBuffer>
#include <QHeaderView>
#include <QImage>
#include <QLabel>
#include <QPainter>
#include <QSplitter>
#include <QSvgGenerator>
#include <QTableWidget>
#include <QVBoxLayout>

#include <algorithm>

namespace ctxplan::gui {
namespace {

QTableWidget* MakeTable(const QStringList& headers) {
  auto* table = new QTableWidget(0, static_cast<int>(headers.size()));
  table->setHorizontalHeaderLabels(headers);
  table->setEditTriggers(QAbstractItemView::NoEditTriggers);
  table->setSelectionBehavior(QAbstractItemView::SelectRows);
  table->setSelectionMode(QAbstractItemView::SingleSelection);
  table->verticalHeader()->setVisible(false);
  table->horizontalHeader()->setStretchLastSection(true);
  return table;
}

// Numbers right-aligned, as the replay command prints them.
QTableWidgetItem* Cell(const QString& text, bool number) {
  auto* item = new QTableWidgetItem(text);
  item->setTextAlignment(number ? (Qt::AlignRight | Qt::AlignVCenter)
                                : (Qt::AlignLeft | Qt::AlignVCenter));
  return item;
}

}  // namespace

ReplayView::ReplayView(QWidget* parent) : QWidget(parent) {
  summary_ = new QLabel("no trace loaded");
  summary_->setWordWrap(true);
  summary_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  kinds_ = MakeTable({"kind", "count", "measured s", "predicted s", "ratio"});
  chunks_ = MakeTable({"chunk", "ops", "measured ms/op", "predicted ms/op", "ratio"});
  measured_ = new TimelineView;
  predicted_ = new TimelineView;
  measured_->SetTitle("recorded");
  predicted_->SetTitle("predicted");

  auto* tables = new QSplitter(Qt::Horizontal);
  tables->addWidget(kinds_);
  tables->addWidget(chunks_);
  tables->setStretchFactor(0, 3);
  tables->setStretchFactor(1, 2);
  auto* split = new QSplitter(Qt::Vertical);
  split->addWidget(tables);
  split->addWidget(measured_);
  split->addWidget(predicted_);
  split->setStretchFactor(0, 1);
  split->setStretchFactor(1, 2);
  split->setStretchFactor(2, 2);
  auto* layout = new QVBoxLayout(this);
  layout->addWidget(summary_);
  layout->addWidget(split, 1);

  // Zooming or panning either timeline moves the other: SetVisibleRange only calls back when
  // the range changed, so the echo stops at the second view.
  measured_->SetRangeChangedCallback(
      [this](int64_t begin, int64_t end) { predicted_->SetVisibleRange(begin, end); });
  predicted_->SetRangeChangedCallback(
      [this](int64_t begin, int64_t end) { measured_->SetVisibleRange(begin, end); });

  connect(kinds_, &QTableWidget::itemSelectionChanged, this, [this] {
    const QList<QTableWidgetItem*> selected = kinds_->selectedItems();
    if (!selected.isEmpty()) ShowChunks(kinds_->item(selected.front()->row(), 0)->text());
  });
  connect(&model_, &ReplayModel::loaded, this, [this] { ShowData(); });
}

ReplayView::~ReplayView() = default;

void ReplayView::OpenTrace(const QString& path) {
  summary_->setText("loading " + path + "...");
  model_.Open(path);
}

QString ReplayView::OpenTraceNow(const QString& path) {
  return QString::fromStdString(model_.LoadNow(path).error);  // loaded() has shown it
}

QString ReplayView::summary() const {
  return summary_->text();
}

void ReplayView::ShowData() {
  const ReplayData& d = model_.data();
  summary_->setText(QString::fromStdString(d.Summary()));
  summary_->setStyleSheet(d.error.empty() ? QString() : QString("color: #b00020"));

  kinds_->setRowCount(0);
  chunks_->setRowCount(0);
  kinds_->setRowCount(static_cast<int>(d.by_kind.size()));
  for (int row = 0; row < static_cast<int>(d.by_kind.size()); ++row) {
    const KindRow& k = d.by_kind[static_cast<size_t>(row)];
    kinds_->setItem(row, 0, Cell(QString::fromStdString(k.name), false));
    kinds_->setItem(row, 1, Cell(QString::number(k.count), true));
    kinds_->setItem(row, 2, Cell(QString::number(k.measured_seconds, 'f', 6), true));
    kinds_->setItem(row, 3, Cell(QString::number(k.predicted_seconds, 'f', 6), true));
    kinds_->setItem(row, 4, Cell(QString::number(k.ratio(), 'f', 3), true));
  }
  kinds_->resizeColumnsToContents();

  const QString source = QString::fromStdString(d.source);
  measured_->SetTitle(source.isEmpty() ? QString("recorded") : "recorded (" + source + ")");
  predicted_->SetTitle(d.machine_name.empty()
                           ? QString("predicted")
                           : "predicted (" + QString::fromStdString(d.machine_name) + ")");
  measured_->SetTimeline(d.measured);
  predicted_->SetTimeline(d.predicted);
  // One time axis for both: each clamps to the union, so a range set on one fits the other.
  const int64_t begin = std::min(measured_->bounds_begin_ns(), predicted_->bounds_begin_ns());
  const int64_t end = std::max(measured_->bounds_end_ns(), predicted_->bounds_end_ns());
  measured_->SetTimeBounds(begin, end);
  predicted_->SetTimeBounds(begin, end);
  measured_->Fit();
  predicted_->Fit();
  if (!d.by_kind.empty()) kinds_->selectRow(0);  // its chunks beside it
}

void ReplayView::ShowChunks(const QString& kind) {
  const std::vector<ChunkRow> rows = model_.data().ByChunk(kind.toStdString());
  chunks_->setRowCount(0);
  chunks_->setRowCount(static_cast<int>(rows.size()));
  for (int row = 0; row < static_cast<int>(rows.size()); ++row) {
    const ChunkRow& c = rows[static_cast<size_t>(row)];
    // Per op, as `ctxplan replay --by-chunk` prints it.
    const double n = static_cast<double>(std::max<int64_t>(1, c.count));
    chunks_->setItem(row, 0, Cell(QString::number(c.chunk), true));
    chunks_->setItem(row, 1, Cell(QString::number(c.count), true));
    chunks_->setItem(row, 2, Cell(QString::number(c.measured_seconds * 1e3 / n, 'f', 4), true));
    chunks_->setItem(row, 3, Cell(QString::number(c.predicted_seconds * 1e3 / n, 'f', 4), true));
    chunks_->setItem(row, 4, Cell(QString::number(c.ratio(), 'f', 3), true));
  }
  chunks_->resizeColumnsToContents();
}

bool ReplayView::SaveKindCsv(const QString& path, QString* error) const {
  try {
    model_.data().SaveKindCsv(path.toStdString());
    return true;
  } catch (const std::exception& e) {
    if (error != nullptr) *error = QString::fromStdString(e.what());
    return false;
  }
}

bool ReplayView::SavePng(const QString& path, QString* error) {
  QByteArray bytes;
  QBuffer buffer(&bytes);
  buffer.open(QIODevice::WriteOnly);
  if (!grab().toImage().save(&buffer, "PNG")) {
    if (error != nullptr) *error = "cannot encode the PNG";
    return false;
  }
  return SaveBytes(path, bytes, error);
}

bool ReplayView::SaveSvg(const QString& path, QString* error) {
  QByteArray bytes;
  QBuffer buffer(&bytes);
  buffer.open(QIODevice::WriteOnly);
  QSvgGenerator svg;
  svg.setOutputDevice(&buffer);
  svg.setSize(size());
  svg.setViewBox(QRect(QPoint(0, 0), size()));
  svg.setResolution(logicalDpiX());  // text as large as on screen (the default is 72 dpi)
  svg.setTitle("ctxplan replay");
  {
    QPainter p;
    if (!p.begin(&svg)) {
      if (error != nullptr) *error = "cannot start the SVG";
      return false;
    }
    render(&p);  // the children paint through the SVG painter (their paintEvents redirected)
  }
  return SaveBytes(path, bytes, error);
}

}  // namespace ctxplan::gui
