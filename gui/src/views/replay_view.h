// A recorded step against its prediction: a summary line (step measured vs predicted), the
// by-kind table of `ctxplan replay` with the selected kind's chunks beside it, and two timelines,
// the recorded step above the predicted one, whose visible ranges move together (zoom or pan
// either). The window adds the file dialog and calls OpenTrace(); loading runs off the GUI thread
// in the view's ReplayModel, and the view redraws when it lands.
//
// No Q_OBJECT: the view follows its model's signals with lambdas.
#pragma once

#include <QString>
#include <QWidget>

#include "model/replay_model.h"
#include "views/timeline_view.h"

QT_BEGIN_NAMESPACE
class QLabel;
class QTableWidget;
QT_END_NAMESPACE

namespace ctxplan::gui {

class ReplayView : public QWidget {
 public:
  explicit ReplayView(QWidget* parent = nullptr);
  ~ReplayView() override;

  // Loads `path` (a .ctxtrace) on the model's worker; the view shows it when it lands, or the
  // error in the summary line (the model's errorOccurred() carries it too).
  void OpenTrace(const QString& path);
  // The same on the calling thread; returns the error, empty on success. For tests and scripts.
  QString OpenTraceNow(const QString& path);

  // Its model: loaded(), errorOccurred() and busyChanged() for the window's status bar.
  ReplayModel& model() { return model_; }
  const ReplayModel& model() const { return model_; }
  TimelineView& measured_view() { return *measured_; }
  TimelineView& predicted_view() { return *predicted_; }
  QTableWidget& kind_table() { return *kinds_; }
  QTableWidget& chunk_table() { return *chunks_; }
  QString summary() const;

  // Fills the chunk table with `kind`'s ops chunk by chunk (a by-kind row's name).
  void ShowChunks(const QString& kind);

  // The by-kind table as CSV; the whole view as PNG or SVG (at its current size).
  bool SaveKindCsv(const QString& path, QString* error = nullptr) const;
  bool SavePng(const QString& path, QString* error = nullptr);
  bool SaveSvg(const QString& path, QString* error = nullptr);

 private:
  void ShowData();

  ReplayModel model_;
  QLabel* summary_ = nullptr;
  QTableWidget* kinds_ = nullptr;
  QTableWidget* chunks_ = nullptr;
  TimelineView* measured_ = nullptr;
  TimelineView* predicted_ = nullptr;
};

}  // namespace ctxplan::gui
