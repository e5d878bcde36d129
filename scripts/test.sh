#!/usr/bin/env bash
# README command 2 (and CI): set up, build with tests, run every test that needs no GPU, then fuzz
# the parsers of user files for a minute each (scripts/fuzz.sh: clang, ASan, UBSan).
# GPU tests carry the ctest label `gpu` and skip themselves without one.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
scripts/build.sh -DBUILD_TESTING=ON
ctest --test-dir build --output-on-failure --parallel "$(nproc)"
scripts/fuzz.sh 60
