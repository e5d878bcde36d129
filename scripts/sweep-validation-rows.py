#!/usr/bin/env python3
"""The groups-1-2 validation rows (models/gpu/validation/h200-attention-sweeps.csv) from
attention_bench's sweep CSVs.

usage: sweep-validation-rows.py KEYS RUN_DIR...

Each RUN_DIR holds one run's CSVs, named by what they swept: a64.csv / a128.csv (--heads 16x16),
k*.csv (16x16, page 128 at chunks 1024 / 4096 / 16384 and other --sparse-tokens), b64.csv /
b128.csv (16x8), b128-96.csv (16x8, chunks 3072 / 6144 / 12288, pages 96 / 192). Only the rows
whose key (direction .. tile_tokens, source) is in KEYS (an earlier version of the file) are
printed, in the runs' order, each the median of the runs' times and clocks.
"""
import csv
import glob
import os
import re
import statistics
import sys

SOURCES = {"a": "g62a", "k": "g62k", "b": "g62b", "b128-96": "g62c"}
SHAPE = re.compile(r"sweep_d(\d+)_h(\d+)x(\d+)_c(\d+)_p(\d+)_sparse_e(\d+)of(\d+)$")


def run_rows(run_dir):
    rows = []
    for path in sorted(glob.glob(os.path.join(run_dir, "*.csv"))):
        name = os.path.basename(path)[:-4]
        source = SOURCES["b128-96" if name == "b128-96" else name[0]]
        for r in csv.DictReader(open(path)):
            m = SHAPE.match(r["shape"])
            if not m:
                continue  # dense rows: not in the validation set
            hd, hq, hkv, chunk, page, tile, earlier = m.groups()
            for d in ("fwd", "bwd"):
                key = (d, hd, hq, hkv, chunk, page, earlier, tile, source)
                rows.append((key, float(r[d + "_ms"]), float(r[d + "_mhz"])))
    return rows


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    keys = set()
    for line in open(sys.argv[1]):
        f = line.strip().split(",")
        if line.startswith("#") or f[0] == "direction" or len(f) < 11:
            continue
        keys.add(tuple(f[:8] + [f[10]]))
    runs = [run_rows(d) for d in sys.argv[2:]]
    for i, (key, _, _) in enumerate(runs[0]):
        if any(len(r) != len(runs[0]) or r[i][0] != key for r in runs):
            sys.exit(f"the runs differ at row {i}: {key}")
        if key not in keys:
            continue
        ms = statistics.median(r[i][1] for r in runs)
        mhz = statistics.median(r[i][2] for r in runs)
        print(",".join(key[:8]) + f",{ms:.4f},{mhz:.0f},{key[8]}")


if __name__ == "__main__":
    main()
