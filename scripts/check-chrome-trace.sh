#!/usr/bin/env bash
# Checks Chrome Trace Event Format files written by `ctxplan timeline -o` and `ctxtrain --trace`:
# structurally (fields per phase, numbers, nesting) and by loading each into speedscope
# (npm package, served from localhost) in headless Chromium. See chrome-trace-check/check.mjs.
#
#   scripts/check-chrome-trace.sh FILE...
#
# Installs what it needs on first use: npm ci in scripts/chrome-trace-check (node 18+), and
# Debian's chromium (apt-get, through sudo when not root) unless $CHROMIUM / /usr/bin/chromium exists.
# Writes FILE.speedscope.png next to each FILE, prints one line per file (OK/FAIL, events by
# phase, speedscope's view names) and exits 0 only if every file passes.
set -euo pipefail
here="$(cd "$(dirname "$0")/chrome-trace-check" && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 FILE..." >&2; exit 2; }
for f in "$@"; do [ -f "$f" ] || { echo "FAIL $f: no such file" >&2; exit 1; }; done

command -v node >/dev/null || { echo "check-chrome-trace: node is not installed (apt-get install nodejs npm)" >&2; exit 2; }
if [ ! -f "$here/node_modules/speedscope/dist/release/index.html" ] ||
   [ ! -f "$here/node_modules/playwright-core/package.json" ]; then
  echo "check-chrome-trace: npm ci in $here" >&2
  (cd "$here" && npm ci --no-audit --no-fund --loglevel=error) >&2
fi

chromium="${CHROMIUM:-/usr/bin/chromium}"
if [ ! -x "$chromium" ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "check-chrome-trace: installing Debian's chromium" >&2
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y chromium >&2 ||
    { $sudo apt-get update >&2 && $sudo apt-get install -y chromium >&2; }
  chromium=/usr/bin/chromium
fi

start=$(date +%s.%N)
rc=0
# one Chromium for all files; check.mjs prints one OK/FAIL line per file
CHROMIUM="$chromium" node "$here/check.mjs" "$@" 2>&1 || rc=$?
elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
echo "check-chrome-trace: $# file(s), $([ $rc -eq 0 ] && echo 'all passed' || echo 'FAILED') in $elapsed s"
exit $rc
