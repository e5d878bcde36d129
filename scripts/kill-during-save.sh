#!/usr/bin/env bash
# Issue 16's experiment: SIGKILL ctxtrain at random moments of a run that saves a checkpoint every
# step (so often mid-write), N times (default 100), and check after each that the checkpoint on
# disk loads. Prints how many kills and loads. Run after scripts/build.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-100}
ctxtrain=build/runtime/ctxtrain
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
ckpt=$dir/run.ckpt
run() {
  "$ctxtrain" --backend cpu --model tiny --context 96 --chunk 32 --page 8 --query-tile 8 \
    --steps 100000 --save "$ckpt" --save-every 1 > /dev/null 2>&1 &
  echo $!
}
loaded=0
for i in $(seq 1 "$n"); do
  pid=$(run)
  while [ "$i" = 1 ] && [ ! -e "$ckpt" ]; do sleep 0.01; done
  sleep "0.$(printf '%03d' $((RANDOM % 400 + 20)))"
  kill -9 "$pid"; wait "$pid" 2> /dev/null
  # A resume of one step loads and checks the checkpoint (CRC-32C of every tensor).
  if "$ctxtrain" --backend cpu --model tiny --context 96 --chunk 32 --page 8 --query-tile 8 \
       --steps 1 --resume "$ckpt" > /dev/null 2> "$dir/err"; then
    loaded=$((loaded + 1))
  else
    echo "kill $i: the checkpoint does not load: $(cat "$dir/err")"
  fi
done
echo "kill-during-save: $n kills, the checkpoint loaded after $loaded"
[ "$loaded" = "$n" ]
