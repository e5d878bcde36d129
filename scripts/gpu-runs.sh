#!/usr/bin/env bash
# The GPU measurements quoted in the issue notes: every GPU test, then ctxtrain on the
# Qwen2.5-7B shape against the planner's prediction. Run on the GPU machine, from a folder holding
# the built binaries (gpu_*_test, ctxtrain, ctxplan), e.g. `scripts/gpu-runs.sh build-cuda`.
set -uo pipefail
bin=${1:-build}
find_bin() { find "$bin" -name "$1" -type f -perm -u+x | head -1; }
export CTXTRAIN_EXE=$(find_bin ctxtrain)
for t in gpu_kernels_test gpu_attention_test gpu_cuda_backend_test gpu_runtime_cuda_test \
         gpu_ctxtrain_test gpu_cupti_attribution_test; do
  exe=$(find_bin $t)
  [ -n "$exe" ] || continue
  echo "=== $t"; timeout 300 "$exe" 2>&1 | grep -E "^\[  (PASSED|FAILED)|FAILED" | tail -6
done
ctxtrain=$CTXTRAIN_EXE
ctxplan=$(find_bin ctxplan)
# "context chunk keep-inputs budget offload grad-dtype optimizer steps"; tokens/s counts the
# steps after the first; TRACE=1 records the last step's CUPTI trace under $OUT (or /tmp).
run() {
  set -- $1
  local args="--model qwen2.5-7b --context $1 --chunk $2 --page 128 --budget $4 --query-tile 128
              --keep-layer-inputs $3 --offload $5 --grad-dtype $6 --optimizer $7"
  local trace=""
  [ -n "${TRACE:-}" ] && trace="--trace ${OUT:-/tmp}/7b-$1-k$4-$5.ctxtrace"
  echo "=== ctxtrain --backend cuda $args --task random --steps $8"
  "$ctxplan" plan $args --json | python3 -c 'import json,sys; j=json.load(sys.stdin);
print("predicted: step %.3f s, %.0f tok/s, arena %.2f GiB, device %.2f GiB, pinned %.2f GiB" % (
j["step"]["seconds"], j["step"]["tokens_per_second"], j["gpu_memory"]["allocated_bytes"]/2**30,
j["gpu_memory"]["device_bytes"]/2**30, j["host_memory"]["peak_bytes"]/2**30))'
  timeout 590 "$ctxtrain" --backend cuda $args --task random --steps "$8" $trace 2>&1 |
      grep -E "step [0-9]|loss|memory|error"
}
# Short contexts, dense: layer inputs kept, chunk 8192, bf16 gradients; with and without AdamW.
run "8K 8192 on all off bf16 none 4"
run "32K 8192 on all off bf16 none 3"
run "8K 8192 on all off bf16 adamw-gpu 3"
run "32K 8192 on all off bf16 adamw-gpu 3"
# Long contexts: page-sparse k 64 (and dense at 128K), offload on and off.
run "128K 4096 off all on bf16 none 1"
run "128K 4096 off 64 on bf16 none 2"
run "128K 4096 off 64 off bf16 none 2"
run "512K 4096 off 64 off bf16 none 1"
TRACE=1 run "512K 4096 off 64 on bf16 none 1"
TRACE=1 run "1M 4096 off 64 on bf16 none 1"   # 112 GiB pinned: needs ~125 GiB of host RAM
run "1M 4096 off 64 on bf16 adamw-gpu 1"
run "8K 8192 on all off bf16 adamw-host 3"
# LoRA rank 16 on the 7B shape (the base frozen on the GPU).
"$ctxtrain" --backend cuda --model qwen2.5-7b --context 32K --chunk 8192 --page 128 --budget all \
    --query-tile 128 --keep-layer-inputs on --offload off --grad-dtype bf16 --optimizer adamw-gpu \
    --lora-rank 16 --task random --steps 3 2>&1 | grep -E "step [0-9]|loss|memory|error"

# Gradients against PyTorch autograd (transformers' Qwen2), Qwen2.5-0.5B shape, same weights
# through safetensors, same tokens.
here=$(cd "$(dirname "$0")" && pwd)
for n in 8192 32768; do
  python3 -c "import numpy as np; np.random.seed(1); np.random.randint(0, 151936, $n + 1).astype(np.uint32).tofile('/tmp/ctxplan-tokens.bin')"
  rm -rf /tmp/ctxplan-hf
  echo "=== ctxtrain vs transformers, qwen2.5-0.5b, $n tokens"
  "$ctxtrain" --backend cuda --model qwen2.5-0.5b --context $n --chunk 4096 --page 128 --budget all \
      --query-tile 128 --optimizer none --grad-dtype fp32 --data /tmp/ctxplan-tokens.bin \
      --export-weights /tmp/ctxplan-hf --dump-grads /tmp/ctxplan-grads.safetensors 2>&1 | grep loss
  python3 "$here/hf_grad_check.py" /tmp/ctxplan-hf /tmp/ctxplan-tokens.bin \
      /tmp/ctxplan-grads.safetensors $n 2>&1 | grep -E "^loss|^worst"
done
