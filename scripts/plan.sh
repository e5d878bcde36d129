#!/usr/bin/env bash
# README command 1: set up a fresh Debian 12 machine, build, and answer the main question on the
# embedded defaults: the longest context Qwen2.5-7B trains on an H200 with 125 GiB host RAM.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
scripts/build.sh
./build/sim/ctxplan max-context "$@"
