#!/usr/bin/env bash
# Re-records rows of traces/recorded/h200-7b-runs.csv: runs ctxtrain (Qwen2.5-7B shape, random
# weights and tokens) once per line of ROWS_FILE and prints each as a CSV row ("ROW," + the CSV's
# columns). A line of ROWS_FILE: "context chunk budget keep-inputs offload grad-dtype optimizer
# lora-rank steps", e.g. "131072 4096 64 off on bf16 none 0 2". Run on the GPU machine:
# `scripts/gpu-record-runs.sh <bin dir holding ctxtrain> ROWS_FILE`; logs go under $OUT (or /tmp).
set -uo pipefail
bin=${1:?bin dir}
rows=${2:?rows file}
out=${OUT:-/tmp}
ctxtrain=$(find "$bin" -name ctxtrain -type f -perm -u+x | head -1)
while read -r ctx chunk budget keep offload grad opt lora steps; do
  [ -z "$ctx" ] && continue
  args="--model qwen2.5-7b --context $ctx --chunk $chunk --page 128 --budget $budget
        --query-tile 128 --keep-layer-inputs $keep --offload $offload --grad-dtype $grad
        --optimizer $opt"
  [ "$lora" != 0 ] && args="$args --lora-rank $lora"
  log=$out/run-$ctx-$chunk-$budget-$keep-$offload-$grad-$opt-$lora.log
  start=$(date +%s)
  timeout 590 "$ctxtrain" --backend cuda $args --task random --steps "$steps" > "$log" 2>&1
  rc=$?
  tps=$(grep -oE "[0-9.]+ tokens/s" "$log" | tail -1 | cut -d' ' -f1)
  arena=$(grep -oE "arena allocated peak [0-9.]+" "$log" | tail -1 | awk '{print $4}')
  device=$(grep -oE "device-level peak [0-9.]+" "$log" | tail -1 | awk '{print $3}')
  host=$(grep -oE "optimizer state and staging\) [0-9.]+" "$log" | tail -1 | awk '{print $5}')
  echo "ROW,$ctx,$chunk,$budget,$keep,$offload,$grad,$opt,$lora,$tps,$arena,$device,$host" \
       "(rc $rc, $(($(date +%s) - start)) s)"
done < "$rows"
