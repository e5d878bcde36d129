// ctxplan-gui: the explorer. Move chunk, page, budget, offload and context and watch peak GPU
// memory, host memory and tokens/s move (DESIGN.md, "Users": Explore).
//
//   ctxplan-gui [--model NAME] [--machine NAME] [--context TOKENS] [--gpus N] [--view VIEW]
//               [--trace FILE] [--screenshot FILE]
//
// --view opens on one of the views (memory, tradeoffs, timeline, replay, cost); --trace loads a
// recorded step into the replay view. --screenshot renders the window once the first result is
// in (and the view's own data), saves it as an image and exits: for documentation and for
// checking the layout on a machine without a display (QT_QPA_PLATFORM=offscreen). Exit codes as
// the CLI's: 2 for bad input.
#include <QApplication>
#include <QCommandLineParser>
#include <QPixmap>
#include <QTimer>

#include <cstdio>

#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "explorer_model.h"
#include "main_window.h"

int main(int argc, char** argv) {
  QApplication app(argc, argv);
  QApplication::setApplicationName("ctxplan-gui");
  QApplication::setApplicationVersion("0.1.0");

  QCommandLineParser parser;
  parser.setApplicationDescription(
      "ctxplan explorer: GPU memory and speed of long-context training");
  parser.addHelpOption();
  parser.addVersionOption();
  const QCommandLineOption model_option("model", "catalogue model or path to a model file", "NAME");
  const QCommandLineOption machine_option("machine", "machine preset", "NAME");
  const QCommandLineOption context_option("context", "context in tokens, e.g. 128K", "TOKENS");
  const QCommandLineOption gpus_option("gpus", "GPUs the layers are pipelined over", "N");
  const QCommandLineOption view_option(
      "view", "the view to show: memory, tradeoffs, timeline, replay or cost", "VIEW");
  const QCommandLineOption trace_option("trace", "a recorded .ctxtrace for the replay view",
                                        "FILE");
  const QCommandLineOption screenshot_option(
      "screenshot", "save the window to FILE (PNG) once computed, then exit", "FILE");
  parser.addOptions({model_option, machine_option, context_option, gpus_option, view_option,
                     trace_option, screenshot_option});
  parser.process(app);

  ctxplan::gui::ExplorerModel model;
  {
    // Bad command-line values end the program, as the CLI's do, before any window opens.
    QString error;
    const auto connection = QObject::connect(&model, &ctxplan::gui::ExplorerModel::errorOccurred,
                                             [&error](const QString& message) { error = message; });
    try {
      if (parser.isSet(model_option)) model.SetModelName(parser.value(model_option));
      if (error.isEmpty() && parser.isSet(machine_option))
        model.SetMachineName(parser.value(machine_option));
      if (error.isEmpty() && parser.isSet(context_option))
        model.SetContextTokens(
            ctxplan::ParseTokens(parser.value(context_option).toStdString(), "--context"));
      if (error.isEmpty() && parser.isSet(gpus_option)) {
        bool number = false;
        const int gpus = parser.value(gpus_option).toInt(&number);
        if (!number)
          error = "--gpus: '" + parser.value(gpus_option) + "' is not a count; accepted: 1 or more";
        else
          model.SetGpus(gpus);
      }
      const QString view = parser.value(view_option);
      if (error.isEmpty() && !view.isEmpty() &&
          !ctxplan::gui::MainWindow::ViewNames().contains(view))
        error = "--view: '" + view +
                "' is not a view; accepted: " + ctxplan::gui::MainWindow::ViewNames().join(", ");
    } catch (const ctxplan::InputError& e) {
      error = QString::fromStdString(e.what());
    }
    QObject::disconnect(connection);
    if (!error.isEmpty()) {
      std::fprintf(stderr, "ctxplan-gui: %s\n", qPrintable(error));
      return 2;
    }
  }

  ctxplan::gui::MainWindow window(model);
  window.resize(1440, 900);
  window.show();

  const QString view = parser.value(view_option), trace = parser.value(trace_option);
  if (!trace.isEmpty() && parser.value(screenshot_option).isEmpty()) window.OpenTrace(trace);
  if (!view.isEmpty() && parser.value(screenshot_option).isEmpty())
    QObject::connect(
        &model, &ctxplan::gui::ExplorerModel::resultReady, &window,
        [&window, view] { window.ShowViewNow(view); }, Qt::SingleShotConnection);
  const QString screenshot = parser.value(screenshot_option);
  if (!screenshot.isEmpty()) {
    QObject::connect(
        &model, &ctxplan::gui::ExplorerModel::resultReady, &window,
        [&window, screenshot, view, trace] {
          // The view's own data now, then let the layout and the charts settle before grabbing.
          if (!trace.isEmpty()) {
            const QString error = window.OpenTraceNow(trace);
            if (!error.isEmpty()) {
              std::fprintf(stderr, "ctxplan-gui: %s\n", qPrintable(error));
              QApplication::exit(2);
              return;
            }
          }
          if (!view.isEmpty()) window.ShowViewNow(view);
          QTimer::singleShot(500, &window, [&window, screenshot] {
            const bool saved = window.grab().save(screenshot);
            if (!saved)
              std::fprintf(stderr, "ctxplan-gui: cannot write %s\n", qPrintable(screenshot));
            QApplication::exit(saved ? 0 : 1);
          });
        },
        Qt::SingleShotConnection);
  }
  model.Refresh();
  return app.exec();
}
