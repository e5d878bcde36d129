#!/usr/bin/env bash
# The multi-GPU and fault checks of issues 13 and 16, on a host of two or more GPUs (the lent
# nvidia-h200-x2): ctxtrain end to end on the GPUs (faults on one GPU and on one rank of two, a
# 2-GPU run traced, saved and resumed), the pipeline gradient and dead-rank tests, the 200-step
# soak, then a small model (and with QWEN=1 Qwen2.5-7B at 128K) over two GPUs traced and each
# rank's trace replayed against the planner. Run from the repository root given the folder holding
# the built binaries, e.g. `scripts/gpu-pipeline-checks.sh build`; replay tables go to $OUT (or
# /tmp).
set -uo pipefail
bin=${1:-build}
out=${OUT:-/tmp}
find_bin() { find "$bin" -name "$1" -type f -perm -u+x | head -1; }
if python3 -c "import nvidia.nccl" 2>/dev/null; then
  nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))")
  export LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-}
fi
export NCCL_NVLS_ENABLE=0
ctxtrain=$(find_bin ctxtrain)
ctxplan=$(find_bin ctxplan)
export CTXTRAIN_EXE=$ctxtrain
run_test() {  # binary, gtest filter, seconds
  local exe; exe=$(find_bin "$1")
  [ -n "$exe" ] || { echo "=== $1: not built"; return; }
  echo "=== $1 --gtest_filter=$2"
  local start=$SECONDS
  timeout "$3" "$exe" --gtest_filter="$2" 2>&1 | grep --line-buffered -vE "^\[ RUN|^$"
  echo "    (exit ${PIPESTATUS[0]}, $((SECONDS - start)) s)"
}
# ONLY=ctxtrain|pipeline|soak|runs runs one part (the whole script can pass one call's 600 s).
part() { [ -z "${ONLY:-}" ] || [ "$ONLY" = "$1" ]; }
part ctxtrain && run_test gpu_ctxtrain_test '*' 320
part pipeline && run_test gpu_pipeline_test '*' 240
part soak && run_test gpu_cuda_backend_test '*Soak*' 150
part runs || exit 0
# The machine preset of these GPUs, so that each trace names it and replay predicts for it.
machine=h200-x2
nvidia-smi -L | head -1 | grep -q H100 && machine=h100-x8
small=$out/small-untied.yaml
printf '%s\n' "name: small-untied" "model_type: qwen2" "hidden_size: 512" "intermediate_size: 1024" \
  "num_hidden_layers: 4" "num_attention_heads: 8" "num_key_value_heads: 2" "head_dim: 64" \
  "vocab_size: 4096" "max_position_embeddings: 65536" "tie_word_embeddings: false" \
  "attention_bias: true" "rope_theta: 10000.0" "rms_norm_eps: 1.0e-6" > "$small"
runs=("small --model $small --context 32K --chunk 2048 --page 128 --budget 8")
[ "${QWEN:-0}" = 1 ] && runs+=("qwen --model qwen2.5-7b --context 128K --chunk 4096 --page 128 --budget 64")
for run in "${runs[@]}"; do
  set -- $run
  name=$1; shift
  flags="$* --machine $machine --offload on --gpu-tier off --keep-layer-inputs off
         --optimizer adamw-gpu --gpus 2"
  echo "=== ctxtrain --backend cuda $flags --steps 1 --force --trace $out/$name.ctxtrace"
  timeout 300 "$ctxtrain" --backend cuda $flags --steps 1 --force --trace "$out/$name.ctxtrace" 2>&1 |
    grep -E "tokens/s|a step|rror|rank [0-9]"
  for t in $name $name.rank1; do
    echo "=== ctxplan replay $t.ctxtrace"
    model_flag=(); [ "$name" = small ] && model_flag=(--model "$small")
    "$ctxplan" replay "$out/$t.ctxtrace" "${model_flag[@]}" > "$out/replay-$t.txt" 2>&1
    echo "exit $?"; head -30 "$out/replay-$t.txt"
  done
done
rm -f "$out"/*.ctxtrace "$small"  # large; the replay tables came back
