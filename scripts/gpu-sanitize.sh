#!/usr/bin/env bash
# compute-sanitizer over the GPU tests (issue 16): memcheck, racecheck, synccheck and initcheck
# over each GPU test binary, several at once on one GPU (CUDA_VISIBLE_DEVICES picks it), each
# bounded by a timeout; one summary line per (test, tool) in $OUT/sanitize-summary.txt (or /tmp),
# the full logs under /tmp/sanitize. Run from the repository root given the folder of the built
# binaries, e.g. `scripts/gpu-sanitize.sh build [seconds]`. Left out: the CUPTI tests (CUPTI and
# the sanitizer both take the profiling interface: gpu_cupti_attribution_test, CuptiTracer.*, the
# traced ctxtrain run), the tests whose point is a failing CUDA call or an injected fault (the
# sanitizer reports those as errors, rightly), the 200-step soak and the two-GPU tests (they run
# plainly in gpu-pipeline-checks.sh).
set -uo pipefail
bin=${1:-build}
limit=${2:-300}
out=${OUT:-/tmp}
logs=/tmp/sanitize
mkdir -p "$logs"
find_bin() { find "$bin" -name "$1" -type f -perm -u+x | head -1; }
export CTXTRAIN_EXE=$(find_bin ctxtrain)
jobs=()
for t in gpu_kernels_test gpu_attention_test gpu_runtime_cuda_test gpu_cuda_backend_test \
         gpu_ctxtrain_test; do
  exe=$(find_bin $t)
  [ -n "$exe" ] || continue
  for tool in memcheck racecheck synccheck initcheck; do
    jobs+=("$t $tool $exe")
  done
done
run_one() {
  set -- $1
  local t=$1 tool=$2 exe=$3 start=$SECONDS
  # ctxtrain runs as a child of gpu_ctxtrain_test: the sanitizer follows it.
  timeout "$limit" compute-sanitizer --tool "$tool" --target-processes all --print-limit 200 \
    "$exe" --gtest_filter='-*Soak*:*TwoGpus*:*Fault*:*Failure*:CuptiTracer.*:*ReportsMemory*' \
    > "$logs/$t.$tool.log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$logs/$t.$tool.log" | tail -1)
  local tests
  tests=$(grep -E "^\[  (PASSED|FAILED)  \]" "$logs/$t.$tool.log" | tr '\n' ' ')
  [ $rc = 124 ] && summary="TIMEOUT after ${limit} s ($(grep -c '^\[       OK' "$logs/$t.$tool.log") tests done)"
  local outside=""
  [ "$tool" = racecheck ] && outside="; races outside cuBLASLt nvjet: $(grep -E 'Race reported between' "$logs/$t.$tool.log" | grep -vc nvjet)"
  echo "$t $tool: ${summary:-no summary (rc $rc)}; $tests; $((SECONDS - start)) s$outside"
}
export -f run_one
export limit logs
printf '%s\n' "${jobs[@]}" | xargs -P "${JOBS:-6}" -I{} bash -c 'run_one "{}"' | sort | tee "$out/sanitize-summary.txt"
