#!/usr/bin/env bash
# The host code's threads under ThreadSanitizer (issue 16): clang, -fsanitize=thread, into
# build-tsan/ (no CUDA). Only the tests that start threads are built and run, to keep CI short:
#   host_threads_test         HostAdamWStep's pool (--optimizer adamw-host, ctxplan-measure) and
#                             RandomWeights' block pool (every run that starts from random weights)
#   dist_test                 rank 0's TCP rendezvous, with threads as its ranks on 127.0.0.1
# and, when Qt6 is installed (headless, QT_QPA_PLATFORM=offscreen), the explorer's worker threads:
#   gui_explorer_model_test   its two QThreadPool workers (compute and recommend, timeline
#                             export), their mailboxes, and edits and planning on the model's
#                             thread while both run
#   gui_tradeoff_model_test   TradeoffModel's worker (gui/src/model/): newest request wins, stale
#                             grids given up between points or dropped on delivery, teardown with
#                             work in flight
#   gui_timeline_test         WorkerQueue (the Mailbox pair that TimelineModel and ReplayModel
#   gui_replay_test           share): simulations and trace loads abandoned, dropped or posted and
#                             never delivered when the model goes; their views paint offscreen on
#                             the test's thread. Not LargeTraceLoadsAndPaints: it starts no
#                             thread (LoadNow) and takes half the program's time under the
#                             sanitizer
#   gui_main_window_test      the window: the explorer's, trade-off and timeline workers started by
#                             selection and tab changes while the GUI thread computes the same
#                             views (ComputeNow) and paints them
# gui_tradeoff_view_test is left out: its views are fed results computed on the test's thread, so
# it starts no thread of ours. The CUDA backend's host threads (its AdamW calls the same
# HostAdamWStep; the NVML clock sampler; the CUPTI buffer callbacks) need a GPU and are not run
# here. Any report fails the stage. On 2 cores it takes about 130 s from a clean build-tsan/:
# 105 s compiling (the GUI's views included), 25 s running.
#
# Qt is not built with the sanitizer, and synchronises its own threads with futexes it cannot see
# (QMutex, a pooled thread's exit; QtGui converts large images on threads of its own, which
# libpng then reads), so the allocations, frees, copies and pthread objects Qt's code handles look
# racy to it: without the option below these programs give 50-odd reports, in each of which both
# accesses come from Qt or libpng, none from our code. For the Qt tests,
# ignore_noninstrumented_modules=1 leaves out what the intercepted functions do when called from a
# library not built with it; our code, the Qt templates it instantiates and the jobs it runs on
# Qt's pool threads included, is checked as everywhere else (a plain int written by a QThreadPool
# job and read by the main thread is reported). The explorer's models pass their data between
# threads only under a std::mutex (gui/src/model/mailbox.h) or in atomics, which the sanitizer
# sees, and Qt only wakes the receiving thread (gui/src/explorer_model.h).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang++ >/dev/null || { echo "tsan: clang++ is needed (apt-get install clang)" >&2; exit 2; }
start=$SECONDS
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f build-tsan/CMakeCache.txt ]; then
  # The GUI is left to CMake's detection (ON where Qt6 Widgets + Charts are found).
  cmake -S . -B build-tsan "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer -O1 -g" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" \
    -DCTXPLAN_CUDA=OFF -DBUILD_TESTING=ON > /dev/null
fi
tests=(host_threads_test dist_test)
if grep -q '^CTXPLAN_GUI:BOOL=ON' build-tsan/CMakeCache.txt; then
  tests+=(gui_explorer_model_test gui_tradeoff_model_test gui_timeline_test gui_replay_test
    gui_main_window_test)
else
  echo "tsan: Qt6 not found: the explorer's worker threads are not checked" >&2
fi
# Tests a program leaves out (why: above).
declare -A filter=([gui_replay_test]="-GuiReplayTest.LargeTraceLoadsAndPaints")
cmake --build build-tsan --parallel "$(nproc)" --target "${tests[@]}"
built=$SECONDS

options="halt_on_error=1:second_deadlock_stack=1"
export QT_QPA_PLATFORM=offscreen
status=0
ran=0
for t in "${tests[@]}"; do
  log=build-tsan/$t.log
  extra=""
  [[ $t == gui_* ]] && extra=":ignore_noninstrumented_modules=1"
  ok=0
  args=()
  [[ -n ${filter[$t]:-} ]] && args=(--gtest_filter="${filter[$t]}")
  TSAN_OPTIONS="$options$extra" build-tsan/tests/$t "${args[@]}" > "$log" 2>&1 || ok=$?
  # clang 14's runtime cannot map its shadow where the kernel randomises mmap with more bits
  # (vm.mmap_rnd_bits > 28): run once more without address randomisation.
  if grep -q "unexpected memory mapping" "$log"; then
    ok=0
    TSAN_OPTIONS="$options$extra" setarch "$(uname -m)" -R build-tsan/tests/$t "${args[@]}" \
      > "$log" 2>&1 || ok=$?
  fi
  if [ $ok -eq 0 ] && ! grep -q "WARNING: ThreadSanitizer" "$log"; then
    ran=$((ran + $(grep -oE '^\[==========\] [0-9]+ tests? ' "$log" | tail -1 | grep -oE '[0-9]+')))
  else
    echo "tsan: $t FAILED (see $log):" >&2
    grep -E "WARNING: ThreadSanitizer|SUMMARY: ThreadSanitizer|\[  FAILED  \]" "$log" | head -5 >&2
    status=1
  fi
done
if [ $status -eq 0 ]; then
  echo "tsan: ${#tests[@]} test programs, $ran tests, no data race reported" \
    "($((SECONDS - start)) s: build $((built - start)) s, tests $((SECONDS - built)) s)"
fi
exit $status
