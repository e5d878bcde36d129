#!/usr/bin/env bash
# The GPU measurements quoted in the issue notes: every GPU test, then ctxtrain on the
# Qwen2.5-7B shape against the planner's prediction. Run on the GPU machine, from a folder holding
# the built binaries (gpu_*_test, ctxtrain, ctxplan), e.g. `scripts/gpu-runs.sh build-cuda`.
set -uo pipefail
bin=${1:-build}
find_bin() { find "$bin" -name "$1" -type f -perm -u+x | head -1; }
for t in gpu_kernels_test gpu_attention_test gpu_cuda_backend_test gpu_runtime_cuda_test; do
  exe=$(find_bin $t)
  [ -n "$exe" ] || continue
  echo "=== $t"; timeout 300 "$exe" 2>&1 | grep -E "^\[  (PASSED|FAILED)|FAILED" | tail -6
done
ctxtrain=$(find_bin ctxtrain)
ctxplan=$(find_bin ctxplan)
run() {  # model context keep budget steps
  local args="--model $1 --context $2 --chunk 4096 --page 128 --budget $4 --query-tile 128
              --keep-layer-inputs $3 --optimizer none --grad-dtype fp32"
  echo "=== ctxtrain --backend cuda $args --task random --steps $5"
  timeout 300 "$ctxtrain" --backend cuda $args --task random --steps "$5" 2>&1 | tail -5
  "$ctxplan" plan $args --json | python3 -c 'import json,sys; j=json.load(sys.stdin);
print("predicted: step %.3f s, %.0f tok/s, arena %.2f GiB, pinned %.2f GiB" % (j["step"]["seconds"],
j["step"]["tokens_per_second"], j["gpu_memory"]["allocated_bytes"]/2**30, j["host_memory"]["peak_bytes"]/2**30))'
}
run qwen2.5-7b 8K on all 4
run qwen2.5-7b 32K on all 3
run qwen2.5-7b 128K off 64 2
run qwen2.5-7b 8K off all 3

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
