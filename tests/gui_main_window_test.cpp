// The explorer's window, offscreen: every view shows, renders something and exports. The views'
// own tests check their content; this one checks that the window puts them together.
#include <gtest/gtest.h>

#include <QApplication>
#include <QCheckBox>
#include <QComboBox>
#include <QEventLoop>
#include <QFile>
#include <QImage>
#include <QSpinBox>
#include <QTemporaryDir>

#include <chrono>

#include "main_window.h"

namespace ctxplan::gui {
namespace {

QApplication& App() {
  static QApplication* app = [] {
    qputenv("QT_QPA_PLATFORM", "offscreen");
    static int argc = 1;
    static char name[] = "gui_main_window_test";
    static char* argv[] = {name, nullptr};
    return new QApplication(argc, argv);
  }();
  return *app;
}

// Pixels that differ from the bottom-right corner's colour (the background).
int DrawnPixels(const QImage& image) {
  const QRgb background = image.pixel(image.width() - 1, image.height() - 1);
  int drawn = 0;
  for (int y = 0; y < image.height(); y += 2)
    for (int x = 0; x < image.width(); x += 2) drawn += image.pixel(x, y) != background;
  return drawn;
}

TEST(MainWindow, EveryViewShowsRendersAndExports) {
  App();
  ExplorerModel model;
  ASSERT_TRUE(model.SetContextTokens(32 * 1024));
  MainWindow window(model);
  window.resize(1440, 900);
  window.show();
  bool ready = false;
  QObject::connect(&model, &ExplorerModel::resultReady, &window, [&ready] { ready = true; });
  model.Refresh();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!ready && std::chrono::steady_clock::now() < deadline)
    QCoreApplication::processEvents(QEventLoop::AllEvents, 50);
  ASSERT_TRUE(ready) << "no result within 30 s";

  QTemporaryDir dir;
  const QString trace =
      QString(CTXPLAN_SOURCE_DIR) + "/traces/recorded/qwen2.5-7b-32k-k64-h200.ctxtrace";
  ASSERT_EQ(window.OpenTraceNow(trace), "");
  for (const QString& view : MainWindow::ViewNames()) {
    SCOPED_TRACE(view.toStdString());
    ASSERT_TRUE(window.ShowViewNow(view));
    QCoreApplication::processEvents();
    const QImage image = window.grab().toImage();
    EXPECT_GT(DrawnPixels(image), 20000);
    for (const QString format : {"png", "svg", "csv"}) {
      const QString path = dir.filePath(view + "." + format);
      QString error;
      EXPECT_TRUE(window.ExportCurrentView(path, &error)) << error.toStdString();
      EXPECT_GT(QFile(path).size(), 100) << path.toStdString();
      if (format == "svg") {
        QFile file(path);
        ASSERT_TRUE(file.open(QIODevice::ReadOnly));
        EXPECT_TRUE(file.readAll().contains("<svg")) << path.toStdString();
      }
    }
    QString error;
    EXPECT_FALSE(window.ExportCurrentView(dir.filePath(view + ".bmp"), &error));
    EXPECT_TRUE(error.contains(view)) << error.toStdString();
  }
  EXPECT_FALSE(window.ShowViewNow("flamegraph"));
}

// The run options beyond chunk, page and budget (issue 15): LoRA, query tile, sinks, kept layer
// inputs. Each control sets the model; a selection made elsewhere (Recommend, a refusal) shows in
// the controls.
TEST(MainWindow, RunOptionControlsFollowTheModel) {
  App();
  ExplorerModel model;
  MainWindow window(model);
  auto* lora = window.findChild<QSpinBox*>("lora_rank");
  auto* tile = window.findChild<QComboBox*>("query_tile");
  auto* sinks = window.findChild<QSpinBox*>("sinks");
  auto* keep = window.findChild<QCheckBox*>("keep_layer_inputs");
  ASSERT_TRUE(lora && tile && sinks && keep);
  lora->setValue(16);
  EXPECT_EQ(model.selection().options.lora_rank, 16);
  tile->setCurrentText("256");
  EXPECT_EQ(model.selection().options.query_tile, 256);
  sinks->setValue(3);
  EXPECT_EQ(model.selection().options.sink_pages, 3);
  keep->setChecked(true);
  EXPECT_TRUE(model.selection().options.keep_layer_inputs);
  // The other way: the model's selection shows.
  ASSERT_TRUE(model.SetLoraRank(0));
  ASSERT_TRUE(model.SetSinkPages(1));
  ASSERT_TRUE(model.SetKeepLayerInputs(false));
  EXPECT_EQ(lora->value(), 0);
  EXPECT_EQ(lora->text(), "off (full fine-tune)");
  EXPECT_EQ(sinks->value(), 1);
  EXPECT_FALSE(keep->isChecked());
  // A refused value springs back to the model's: a query tile past the chunk.
  tile->setCurrentText("64");
  ASSERT_TRUE(model.SetChunkTokens(256));
  tile->setCurrentText("512");
  EXPECT_EQ(model.selection().options.query_tile, 64);
  EXPECT_EQ(tile->currentText(), "64");
  model.WaitForWorkers();
}

}  // namespace
}  // namespace ctxplan::gui
