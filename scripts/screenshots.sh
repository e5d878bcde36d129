#!/usr/bin/env bash
# The README's screenshots, made by the explorer itself (ctxplan-gui --screenshot, offscreen): one
# a view, Qwen2.5-7B on h200-125g at 256K tokens (the replay view: the recorded 32K step). Run
# after scripts/build.sh; writes docs/explorer*.png.
set -euo pipefail
cd "$(dirname "$0")/.."
gui=build/gui/ctxplan-gui
[ -x "$gui" ] || { echo "screenshots: $gui not built (Qt6 missing?)" >&2; exit 2; }
mkdir -p docs
export QT_QPA_PLATFORM=offscreen
shot() {  # file, then ctxplan-gui's flags
  local file=$1
  shift
  "$gui" "$@" --screenshot "$file" 2> >(grep -v "propagateSizeHints\|XDG_RUNTIME_DIR" >&2)
  echo "screenshots: $file"
}
shot docs/explorer.png --context 256K
shot docs/explorer-tradeoffs.png --context 256K --view tradeoffs
shot docs/explorer-timeline.png --context 256K --view timeline
shot docs/explorer-cost.png --context 256K --view cost
shot docs/explorer-replay.png --context 32K --view replay \
  --trace traces/recorded/qwen2.5-7b-32k-k64-h200.ctxtrace
