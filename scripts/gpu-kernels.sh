#!/usr/bin/env bash
# The kernel measurements quoted in the issue notes (issue 3): the kernel GPU tests, their
# compute-sanitizer runs, the memory-bound/GEMM benchmark, and the attention benchmark with the
# PyTorch SDPA peers (flash, cuDNN) in the same run. Run on the GPU machine from the repository
# root, given the folder holding the built binaries, e.g. `scripts/gpu-kernels.sh build-cuda`;
# results also go under $OUT (or /tmp) as kernels_bench.txt, kernels.csv, attention.txt, ours.csv,
# sdpa.txt. SWEEP=1 runs only the kernel tests (no sanitizer) and issue 14's sweep over page size,
# head dim and chunk with its SDPA peers (sweep.txt, sweep.csv, sweep-sdpa.txt).
# GATHERED=1: the page-sparse backward's fixed cost (below).
set -uo pipefail
bin=${1:-build}
out=${OUT:-/tmp}
find_bin() { find "$bin" -name "$1" -type f -perm -u+x | head -1; }
here=$(cd "$(dirname "$0")" && pwd)
if [ "${GATHERED:-0}" = 1 ]; then
  # Issue 14: what the page-sparse (gathered) backward pays beyond its items (its dKV atomics:
  # kernels/PERF.md, 2026-11-28). The d_h 64 sweep at the d_h 128 rows' GQA group (28/4: 14 items
  # a gathered block, against 8 at 32/8), then ncu's full set on one gathered d_h 64 launch
  # (qtile's first) with the stall samples by SASS instruction (ncu-gathered-sass.csv).
  ab=$(find_bin attention_bench)
  echo "=== attention_bench --only sweep --heads 28x4"
  timeout 200 "$ab" --only sweep --heads 28x4 --reps 3 --csv "$out/sweep-28x4.csv" \
    > "$out/sweep-28x4.txt" 2>&1
  grep -E "^SWEEP" "$out/sweep-28x4.txt"
  echo "=== ncu --set full, one gathered d_h 64 backward launch"
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 300 "$ncu" --set full --import-source no --kernel-name-base mangled \
    -k regex:AttnBwdWgmmaKernelILi64ELi2ELb0ELb1 --launch-count 1 -o "$out/ncu-gathered" \
    "$ab" --only qtile --reps 1 > "$out/ncu-gathered.log" 2>&1
  tail -3 "$out/ncu-gathered.log"
  "$ncu" --import "$out/ncu-gathered.ncu-rep" --page source --csv --print-source sass \
    > "$out/ncu-gathered-sass.csv" 2>&1
  "$ncu" --import "$out/ncu-gathered.ncu-rep" --page details > "$out/ncu-gathered.txt" 2>&1
  grep -E "Duration|Throughput|Hit Rate|Issue Slots|Warp Cycles" "$out/ncu-gathered.txt" | head -20
  exit 0
fi
if [ "${SWEEP:-0}" = 1 ]; then
  for t in gpu_kernels_test gpu_attention_test; do
    echo "=== $t"; timeout 300 "$(find_bin $t)" 2>&1 | grep -E "^\[  (PASSED|FAILED)|FAILED" | tail -8
  done
  echo "=== attention_bench --only sweep, then the SDPA peers on the same attended pairs"
  timeout 420 "$(find_bin attention_bench)" --only sweep --reps 3 --csv "$out/sweep.csv" \
    > "$out/sweep.txt" 2>&1
  grep -E "^SWEEP|^(dense|sparse) " "$out/sweep.txt"
  timeout 300 python3 "$here/../kernels/bench/sdpa_peer.py" --ours "$out/sweep.csv" \
    > "$out/sweep-sdpa.txt" 2>&1
  tail -40 "$out/sweep-sdpa.txt"
  exit 0
fi
for t in gpu_kernels_test gpu_attention_test; do
  exe=$(find_bin $t)
  [ -n "$exe" ] || { echo "=== $t: not built"; continue; }
  echo "=== $t"; timeout 300 "$exe" 2>&1 | grep -E "^\[  (PASSED|FAILED)|FAILED" | tail -6
  for tool in memcheck racecheck; do
    # racecheck cannot follow the mbarrier / TMA synchronisation of cuBLASLt's own GEMM kernels
    # (nvjet_*) and reports races inside them; every report is kept (leaving those kernels out
    # with --kernel-name-exclude made the sanitizer fail inside them), then counted per kernel.
    echo "--- compute-sanitizer --tool $tool $t"
    timeout 600 compute-sanitizer --tool $tool --print-limit 100000 "$exe" > "$out/$t.$tool.log" 2>&1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/$t.$tool.log" | tail -1
    if [ $tool = racecheck ]; then
      grep -E "Race reported between" "$out/$t.$tool.log" |
        sed -E 's/.* access at ([^+ ]+).*/\1/' | sort | uniq -c | head -12
      echo "race reports outside cuBLASLt's nvjet kernels:" \
        "$(grep -E 'Race reported between' "$out/$t.$tool.log" | grep -vc nvjet)"
    fi
  done
done
echo "=== kernels_bench --quick"
timeout 300 "$(find_bin kernels_bench)" --quick --csv "$out/kernels.csv" > "$out/kernels_bench.txt" 2>&1
sed -n '/^kernel /,$p' "$out/kernels_bench.txt"
echo "=== attention_bench, then the SDPA peers on the same shapes"
timeout 400 "$(find_bin attention_bench)" --reps 5 --csv "$out/ours.csv" > "$out/attention.txt" 2>&1
grep -E "SPARSE|PAGING|FUSED|SELECT" "$out/attention.txt"
timeout 300 python3 "$here/../kernels/bench/sdpa_peer.py" --ours "$out/ours.csv" > "$out/sdpa.txt" 2>&1
tail -16 "$out/sdpa.txt"
