#!/usr/bin/env bash
# The host code's threads under ThreadSanitizer (issue 16): clang, -fsanitize=thread, into
# build-tsan/ (no CUDA). Only the tests that start threads are built and run, to keep CI short:
#   host_threads_test         HostAdamWStep's pool (--optimizer adamw-host, ctxplan-measure) and
#                             RandomWeights' block pool (every run that starts from random weights)
#   gui_explorer_model_test   the explorer's two QThreadPool workers (compute and recommend, timeline
#                             export), their mailboxes, and edits and planning on the model's
#                             thread while both run; built when Qt6 is installed (headless)
# The CUDA backend's host threads (its AdamW calls the same HostAdamWStep; the NVML clock sampler;
# the CUPTI buffer callbacks) need a GPU and are not run here. Any report fails the stage.
#
# Qt is not built with the sanitizer, and synchronises its own threads with futexes it cannot see
# (QMutex, a pooled thread's exit), so the allocations, frees and pthread objects Qt's code
# handles look racy to it. For the Qt test, ignore_noninstrumented_modules=1 leaves out what the
# intercepted functions do when called from a library not built with it; our code, the Qt
# templates it instantiates included, is checked as everywhere else. The explorer passes its data
# between threads under a std::mutex, which the sanitizer sees (gui/src/explorer_model.h).
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
  tests+=(gui_explorer_model_test)
else
  echo "tsan: Qt6 not found: the explorer's worker pools are not checked" >&2
fi
cmake --build build-tsan --parallel "$(nproc)" --target "${tests[@]}"

options="halt_on_error=1:second_deadlock_stack=1"
export QT_QPA_PLATFORM=offscreen
status=0
ran=0
for t in "${tests[@]}"; do
  log=build-tsan/$t.log
  extra=""
  [[ $t == gui_* ]] && extra=":ignore_noninstrumented_modules=1"
  ok=0
  TSAN_OPTIONS="$options$extra" build-tsan/tests/$t > "$log" 2>&1 || ok=$?
  # clang 14's runtime cannot map its shadow where the kernel randomises mmap with more bits
  # (vm.mmap_rnd_bits > 28): run once more without address randomisation.
  if grep -q "unexpected memory mapping" "$log"; then
    ok=0
    TSAN_OPTIONS="$options$extra" setarch "$(uname -m)" -R build-tsan/tests/$t > "$log" 2>&1 || ok=$?
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
  echo "tsan: ${#tests[@]} test programs, $ran tests, no data race reported ($((SECONDS - start)) s)"
fi
exit $status
