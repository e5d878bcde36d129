#!/usr/bin/env bash
# The README's screenshots, made by the explorer itself (ctxplan-gui --screenshot, offscreen):
# Qwen2.5-7B on h200-125g at 256K tokens. Run after scripts/build.sh; writes docs/*.png.
set -euo pipefail
cd "$(dirname "$0")/.."
gui=build/gui/ctxplan-gui
[ -x "$gui" ] || { echo "screenshots: $gui not built (Qt6 missing?)" >&2; exit 2; }
mkdir -p docs
QT_QPA_PLATFORM=offscreen "$gui" --context 256K --screenshot docs/explorer.png
echo "screenshots: docs/explorer.png"
