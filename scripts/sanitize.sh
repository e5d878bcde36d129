#!/usr/bin/env bash
# The CPU build and its tests under AddressSanitizer and UndefinedBehaviorSanitizer (issue 16):
# clang, into build-asan/ (no CUDA, no GUI). Any report fails the test that made it.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang++ >/dev/null || { echo "sanitize: clang++ is needed (apt-get install clang)" >&2; exit 2; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f build-asan/CMakeCache.txt ]; then
  cmake -S . -B build-asan "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -O1 -g" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
    -DCTXPLAN_CUDA=OFF -DCTXPLAN_GUI=OFF -DBUILD_TESTING=ON > /dev/null
fi
cmake --build build-asan --parallel "$(nproc)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure --parallel "$(nproc)" -LE gpu
