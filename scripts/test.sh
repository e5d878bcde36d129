#!/usr/bin/env bash
# README command 2 (and CI): set up, build with tests, run every test that needs no GPU, run them
# again under ASan + UBSan (scripts/sanitize.sh, clang), run the tests of the host threads under
# ThreadSanitizer (scripts/tsan.sh), then fuzz the parsers of user files 40 s each
# (scripts/fuzz.sh).
# GPU tests carry the ctest label `gpu` and skip themselves without one.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
scripts/build.sh -DBUILD_TESTING=ON
ctest --test-dir build --output-on-failure --parallel "$(nproc)"
scripts/sanitize.sh
scripts/tsan.sh
scripts/fuzz.sh 40
