#!/usr/bin/env bash
# Fuzzes the parsers of user files (issue 16): builds the libFuzzer targets of fuzz/ with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer into build-fuzz/, seeds them from the catalogue
# and from files the main build writes (a trace, a checkpoint), and runs each for SECONDS
# (default 60; CI runs 40, `scripts/fuzz.sh 3600` runs them long). Fails on any crash, hang or
# sanitizer report; the input that caused it is left in build-fuzz/ (crash-*, timeout-*).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
command -v clang++ >/dev/null || { echo "fuzz: clang++ is needed (apt-get install clang)" >&2; exit 2; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
if [ ! -f build-fuzz/CMakeCache.txt ]; then
  cmake -S . -B build-fuzz "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS="$flags" \
    -DCTXPLAN_CUDA=OFF -DCTXPLAN_GUI=OFF -DBUILD_TESTING=OFF -DCTXPLAN_FUZZ=ON > /dev/null
fi
targets="model_config ctxtrace checkpoint safetensors_index token_file json run_flags"
cmake --build build-fuzz --parallel "$(nproc)" --target $(printf 'fuzz_%s ' $targets)

# Seeds: the small corpora of fuzz/seeds/, the catalogue's files (the parser is chosen by the
# first byte), a trace and a checkpoint written by the main build when it is there.
seeds=build-fuzz/seeds
rm -rf "$seeds"
for target in $targets; do mkdir -p "$seeds/$target"; done
for d in fuzz/seeds/*/; do cp "$d"* "$seeds/$(basename "$d")/"; done
i=0
for f in models/llm/*.yaml; do printf '\x00' | cat - "$f" > "$seeds/model_config/m$((i++))"; done
for f in models/gpu/*.yaml; do printf '\x02' | cat - "$f" > "$seeds/model_config/g$((i++))"; done
for f in models/machine/*.yaml; do printf '\x03' | cat - "$f" > "$seeds/model_config/h$((i++))"; done
printf '\x01{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}' > "$seeds/model_config/hf"
if [ -x build/sim/ctxplan ]; then
  build/sim/ctxplan timeline --model tiny --context 1024 --chunk 256 --page 64 --budget 4 \
    --query-tile 64 --format ctxtrace -o "$seeds/ctxtrace/tiny.ctxtrace" 2> /dev/null || true
fi
if [ -x build/runtime/ctxtrain ]; then
  # The fuzz target's own small model (fuzz/fuzz-model.yaml): with AdamW state and without.
  for optimizer in adamw-gpu none; do
    build/runtime/ctxtrain --backend cpu --model fuzz/fuzz-model.yaml --context 64 --chunk 32 \
      --page 16 --budget all --query-tile 16 --optimizer $optimizer --steps 1 \
      --save "$seeds/checkpoint/$optimizer.ckpt" > /dev/null 2>&1 || true
  done
fi

status=0
for target in $targets; do
  corpus=build-fuzz/corpus/$target
  mkdir -p "$corpus"
  log=build-fuzz/fuzz_$target.log
  if (cd build-fuzz && "./fuzz/fuzz_$target" -max_total_time="$seconds" -timeout=10 \
        -rss_limit_mb=4096 -print_final_stats=1 "corpus/$target" "seeds/$target") > "$log" 2>&1; then
    runs=$(grep -oE "stat::number_of_executed_units: *[0-9]+" "$log" | grep -oE "[0-9]+$" || echo "?")
    echo "fuzz: $target: $runs executions in ${seconds} s, nothing found"
  else
    echo "fuzz: $target FAILED (see $log):" >&2
    grep -E "ERROR|SUMMARY|Test unit written" "$log" | head -5 >&2
    status=1
  fi
done
exit $status
