#!/usr/bin/env bash
# The multi-GPU measurements of traces/recorded/pipeline-runs.csv (issues 13 and 17), on a host
# of two or more GPUs (the lent nvidia-h200-x2, nvidia-h100-x4): the NCCL links and pipeline
# gradient tests, the host's PCIe links, then by default Qwen2.5-7B at 128K, 1M on one GPU and
# two, and 2M on two, each beside the planner's prediction. Run from a folder holding the built
# binaries, e.g. `scripts/gpu-pipeline.sh build`; the 1M and 2M steps take 4-7 minutes each with
# start-up. NCCL: the toolkit's, or the Python package's where the image has no other (found
# below). NVLink multicast stays off.
set -uo pipefail
bin=${1:-build}
find_bin() { find "$bin" -name "$1" -type f -perm -u+x | head -1; }
if python3 -c "import nvidia.nccl" 2>/dev/null; then
  nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))")
  export LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-}
fi
export NCCL_NVLS_ENABLE=0
for t in gpu_peer_links_test gpu_pipeline_test; do
  exe=$(find_bin $t)
  [ -n "$exe" ] || continue
  echo "=== $t"; timeout 300 "$exe" 2>&1 | grep -E "GPUs,|^\[  (PASSED|FAILED)|FAILED" | tail -8
done
ctxtrain=$(find_bin ctxtrain)
ctxplan=$(find_bin ctxplan)
# MACHINE and RUNS ("context gpus steps", ...) choose other hosts and runs: on the x4 host,
# MACHINE=h100-x4 RUNS="4194304 4 1" GPU_TIER=auto is the 4M step over 4 GPUs with the earliest
# pages in GPU memory (--gpu-tier), RUNS="2097152 4 1" the 2M step with every page on the host
# (traces/recorded/pipeline-runs.csv); on the 4x H200 host (issue 17), MACHINE=h200-x4
# RUNS="4194304 4 1" GPU_TIER=auto TRACE=/tmp/t also traces it and replays each rank's trace.
# First the host's links, where ctxplan-measure is there.
measure=$(find_bin ctxplan-measure)
if [ -n "$measure" ]; then
  echo "=== ctxplan-measure --only links"
  timeout 120 "$measure" --only links -o links.csv 2>&1 | grep note
fi
machine=${MACHINE:-h200-x2}
runs=${RUNS:-"128K 1 2,128K 2 2,1M 1 1,1M 2 1,2097152 2 1"}
flags="--model qwen2.5-7b --machine $machine --chunk 4096 --page 128 --budget 64 --offload on
       --gpu-tier ${GPU_TIER:-off} --keep-layer-inputs off --optimizer adamw-gpu"
IFS=, read -ra run_list <<< "$runs"
for run in "${run_list[@]}"; do
  set -- $run
  echo "=== ctxtrain --backend cuda $flags --context $1 --gpus $2 --steps $3 --force"
  # --force: the lent hosts' MemTotal starts low (31 GiB on x2) and grows as memory is used.
  # TRACE=DIR: each run traced (one file a rank) and each rank's trace replayed against the plan.
  trace=()
  if [ -n "${TRACE:-}" ]; then
    mkdir -p "$TRACE/$1-$2"
    trace=(--trace "$TRACE/$1-$2/run.ctxtrace")
  fi
  timeout 590 "$ctxtrain" --backend cuda $flags --context "$1" --gpus "$2" --steps "$3" --force \
    "${trace[@]}" 2>&1 | grep -E "tokens/s|a step|start-up|memory|rank [0-9]|rror"
  "$ctxplan" plan $flags --context "$1" --gpus "$2" | grep -E "^Step|allocated|Pinned|host links"
  if [ -n "${TRACE:-}" ]; then
    for f in "$TRACE/$1-$2"/*.ctxtrace; do
      [ -f "$f" ] || continue
      echo "=== ctxplan replay $f"
      timeout 120 "$ctxplan" replay "$f" > "${f%.ctxtrace}.replay.txt" 2>&1
      head -12 "${f%.ctxtrace}.replay.txt"
    done
  fi
done
