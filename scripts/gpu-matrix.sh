#!/usr/bin/env bash
# Records validation-matrix runs (traces/recorded/matrix.csv): runs ctxtrain once per line of
# ROWS_FILE on this GPU and prints each as a CSV row "ROW,<the matrix's columns>". A line:
#   model context chunk page budget keep-inputs offload grad-dtype optimizer lora-rank steps [trace]
# e.g. "llama-3.1-8b 32768 3072 96 48 off off bf16 none 0 2 l8-32k.ctxtrace" ('#' starts a comment).
# Run on the GPU machine: `scripts/gpu-matrix.sh BIN_DIR MACHINE ROWS_FILE` (MACHINE: the preset
# the runs are planned with and recorded under, e.g. h200-125g); logs and traces go under $OUT.
# HOST_ADAMW_GPARAMS, when set: this host's AdamW rate as `ctxplan-measure --only host` measured
# it in the same session (recorded with each row: the lent hosts differ by 25% there).
# GPU_TIER, when set: every run's --gpu-tier (off, auto or a size); the row records the pages a
# layer the run kept in the GPU tier (0: none).
set -uo pipefail
bin=${1:?bin dir holding ctxtrain}
machine=${2:?machine preset, e.g. h200-125g}
rows=${3:?rows file}
out=${OUT:-/tmp}
ctxtrain=$(find "$bin" -name ctxtrain -type f -perm -u+x | head -1)
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
date=$(date -u +%FT%H:%MZ)  # to the minute: sim/kernel_changes.h
grep -v '^\s*#' "$rows" | while read -r model ctx chunk page budget keep offload grad opt lora steps trace; do
  [ -z "$model" ] && continue
  args="--model $model --machine $machine --context $ctx --chunk $chunk --page $page
        --budget $budget --query-tile 128 --keep-layer-inputs $keep --offload $offload
        --grad-dtype $grad --optimizer $opt"
  [ "$lora" != 0 ] && args="$args --lora-rank $lora"
  [ -n "${trace:-}" ] && args="$args --trace $out/$trace"
  [ -n "${GPU_TIER:-}" ] && args="$args --gpu-tier $GPU_TIER"
  name=$model-$ctx-$chunk-$page-$budget-$keep-$offload-$grad-$opt-$lora
  log=$out/logs/$name.log
  mkdir -p "$out/logs"
  start=$(date +%s.%N)
  timeout 500 "$ctxtrain" --backend cuda $args --task random --steps "$steps" > "$log" 2>&1
  rc=$?
  wall=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $start}")
  tps=$(grep -oE "[0-9.]+ tokens/s" "$log" | tail -1 | cut -d' ' -f1)
  arena=$(grep -oE "arena allocated peak [0-9.]+" "$log" | tail -1 | awk '{print $4}')
  device=$(grep -oE "device-level peak [0-9.]+" "$log" | tail -1 | awk '{print $3}')
  host=$(grep -oE "optimizer state and staging\) [0-9.]+" "$log" | tail -1 | awk '{print $5}')
  startup=$(grep -oE "start-up [0-9.]+ s" "$log" | tail -1 | awk '{print $2}')
  clock=$(grep -oE "SM clock [0-9.]+ MHz" "$log" | tail -1 | awk '{print $3}')
  watts=$(grep -oE "board power [0-9.]+ W" "$log" | tail -1 | awk '{print $3}')
  tier=$(grep -oE "GPU tier of the first [0-9]+" "$log" | tail -1 | awk '{print $6}')
  echo "ROW,$machine,$model,$ctx,$chunk,$page,$budget,$keep,$offload,$grad,$opt,$lora,$steps,${tps:-},${arena:-},${device:-},${host:-},${startup:-},$gpu,$driver,$commit,$date,${trace:-},${clock:-},${watts:-},${HOST_ADAMW_GPARAMS:-},${tier:-0}" \
       "(rc $rc, wall $wall s)"
done
