#!/usr/bin/env bash
# compute-sanitizer over the GPU tests (issue 16): memcheck, racecheck, synccheck and initcheck,
# one job per (test case, tool), many at once over the GPUs there are (JOBS, default 16), each
# bounded by a timeout (seconds, default 300). Per binary and tool, one summary line in
# $OUT/sanitize-summary.txt (or /tmp): errors, cases passed / failed / timed out, and the places
# the errors were reported at, counted (so a summary alone says where to look); full logs under
# /tmp/sanitize. Run from the repository root given the folder of the built binaries, e.g.
# `scripts/gpu-sanitize.sh build [seconds]`; GPU=N pins every job to GPU N; TESTS="a b" and
# TOOLS="memcheck synccheck" narrow the run to those binaries and tools. The last 80 lines of each
# failed or timed-out job's log go to $OUT/sanitize-fail/.
# Left out: the CUPTI tests (CUPTI and the sanitizer both take the profiling interface:
# gpu_cupti_attribution_test, CuptiTracer.*, the traced ctxtrain run), the cases whose point is a
# failing CUDA call or an injected fault (the sanitizer reports those, rightly), the two-GPU cases
# (NCCL under the sanitizer is not ours to check; they run plainly in gpu-pipeline-checks.sh).
# racecheck cannot follow the mbarrier / TMA synchronisation of cuBLASLt's nvjet kernels: its
# reports inside them are counted apart.
set -uo pipefail
bin=${1:-build}
limit=${2:-300}
out=${OUT:-/tmp}
logs=/tmp/sanitize
rm -rf "$logs" && mkdir -p "$logs"
find_bin() { find "$bin" -name "$1" -type f -perm -u+x | head -1; }
export CTXTRAIN_EXE=$(find_bin ctxtrain)
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 1 ] || gpus=1
skip='(Fault|Failure|TwoGpus|ReportsMemory|^CuptiTracer\.)'
jobs=() heavy=()  # heavy: cases that start ctxtrain processes (each reserves its GPU arena)
all_tests="gpu_kernels_test gpu_attention_test gpu_runtime_cuda_test gpu_cuda_backend_test
           gpu_ctxtrain_test"
all_tools="memcheck racecheck synccheck initcheck"
for t in ${TESTS:-$all_tests}; do
  exe=$(find_bin $t)
  [ -n "$exe" ] || continue
  # "Suite.Case" names from --gtest_list_tests (suite lines end with '.', cases are indented).
  for c in $("$exe" --gtest_list_tests | awk '/^[^ ]/{s=$1} /^  /{print s $1}' | grep -vE "$skip"); do
    for tool in ${TOOLS:-$all_tools}; do
      if [ $t = gpu_ctxtrain_test ]; then heavy+=("$t $tool $exe $c"); else jobs+=("$t $tool $exe $c"); fi
    done
  done
done
n=0
run_one() {
  set -- $1
  local t=$1 tool=$2 exe=$3 c=$4 slot=$5
  local log="$logs/$t.$tool.$c.log"
  CUDA_VISIBLE_DEVICES=${GPU:-$((slot % gpus))} timeout "$limit" compute-sanitizer --tool "$tool" \
    --target-processes all --print-limit 50 "$exe" --gtest_filter="$c" > "$log" 2>&1
  echo "$? $t $tool $c" > "$log.rc"
}
export -f run_one
export limit logs gpus
for j in "${jobs[@]}"; do echo "$j $((n++))"; done |
  xargs -P "${JOBS:-16}" -I{} bash -c 'run_one "{}"'
# 16 ctxtrain processes under the sanitizer on one 80 GB GPU ran it out of memory (2026-11-26):
# those cases run HEAVY_JOBS at a time, default 2 a GPU.
for j in "${heavy[@]}"; do echo "$j $((n++))"; done |
  xargs -P "${HEAVY_JOBS:-$((2 * gpus))}" -I{} bash -c 'run_one "{}"'
{
  echo "compute-sanitizer over $((${#jobs[@]} + ${#heavy[@]})) (case, tool) jobs, ${limit} s each, $(date -u +%F)"
  for t in ${TESTS:-$all_tests}; do
    for tool in ${TOOLS:-$all_tools}; do
      ls "$logs/$t.$tool."*.log >/dev/null 2>&1 || continue
      errors=0 passed=0 failed=0 skipped=0 timeouts=0
      for rc in "$logs/$t.$tool."*.log.rc; do
        read -r code _ < "$rc"
        log=${rc%.rc}
        e=$(grep -oE "(ERROR SUMMARY: |RACECHECK SUMMARY: [0-9]+ hazards displayed \()[0-9]+" "$log" |
            grep -oE "[0-9]+$" | tail -1)
        if [ "$code" != 0 ] || [ "${e:-0}" != 0 ]; then
          mkdir -p "$out/sanitize-fail"
          tail -80 "$log" > "$out/sanitize-fail/$(basename "$log")"
        fi
        [ "$code" = 124 ] && { timeouts=$((timeouts + 1)); continue; }
        if grep -q "^\[  PASSED  \] 1 test" "$log"; then passed=$((passed + 1))
        elif grep -q "^\[  SKIPPED \] 1 test" "$log"; then skipped=$((skipped + 1))
        else failed=$((failed + 1)); fi
        errors=$((errors + ${e:-0}))
      done
      where=$(cat "$logs/$t.$tool."*.log | grep -E "^=========     at " |
              sed -E 's/^=========     at ([^ (]+).* in ([^ ]+).*/\1 \2/' | sort | uniq -c |
              sort -rn | head -4 | awk '{$1=$1; print}' | paste -sd ';' -)
      # What the reports are (the tool's first line of each, addresses cut): synccheck's name no
      # kernel in an "at" line when they come from a child process's host-side API checks.
      what=$(cat "$logs/$t.$tool."*.log | grep -E "^========= [A-Z]" |
             grep -vE "COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|Target application|Saved host" |
             sed -E 's/0x[0-9a-f]+/0x./g; s/[0-9,]+ bytes/N bytes/' | sort | uniq -c | sort -rn |
             head -3 | awk '{$1=$1; print}' | paste -sd ';' -)
      nvjet=""
      [ "$tool" = racecheck ] && nvjet=", of them in cuBLASLt nvjet: $(cat "$logs/$t.$tool."*.log | grep -E 'Race reported' | grep -c nvjet)"
      echo "$t $tool: $errors errors$nvjet; cases passed $passed, failed $failed, skipped $skipped, timed out $timeouts${where:+; at: $where}${what:+; what: $what}"
    done
  done
} | tee "$out/sanitize-summary.txt"
