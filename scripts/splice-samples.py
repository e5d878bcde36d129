#!/usr/bin/env python3
"""Re-measure only what a kernel change touched: splice rows of a new ctxplan-measure sample file
into a GPU's committed samples (models/gpu/calibration/<gpu>-samples.csv).

The lent machines of one GPU kind differ by machine alone (GEMM rate, power, PCIe, host CPU), so
re-calibrating everything after each kernel change would move every prediction with no kernel
change behind it. This replaces the base's rows of the named ops whose shape the change touched
(a head dim, or a page size) by the new file's rows of the same shape, keeps every other row,
takes the new file's date, commit, sparse_bwd, own_bwd, fwd_rows_d64 and fwd_sparse_d64 (the
kernels the profile now describes) and adds a comment line saying which rows came from where.
Touched rows of shapes the base lacks (a grid grown since) are added at the end. Refit with
`ctxplan calibrate --samples`.

usage: splice-samples.py BASE NEW OUT --note TEXT [--ops attention_fwd,attention_bwd]
                         [--head-dims 64] [--pages 32,48,96,192] [--missing-only]
A row is replaced when its op is listed and its head_dim is in --head-dims or its page_tokens is
in --pages; with --missing-only none is, and only the touched shapes the base lacks are added (a
grid grown since, measured with the same kernels). Exit 2 with one line on a bad file or a shape
missing from NEW.
"""
import argparse
import os
import sys
import tempfile

# Header lines that describe the kernels measured: the new file's replace the base's.
KERNEL_HEADERS = ("date", "commit", "sparse_bwd", "own_bwd", "fwd_rows_d64", "fwd_sparse_d64")
KEY_COLUMNS = ("op", "m", "n", "k", "heads", "kv_heads", "head_dim", "page_tokens", "pages",
               "pages_per_tile")


def read(path):
    with open(path) as f:
        lines = f.read().rstrip("\n").split("\n")
    columns = next((l.split(",") for l in lines if l.startswith("op,")), None)
    if columns is None or any(c not in columns for c in KEY_COLUMNS):
        raise ValueError(f"{path}: no sample header naming {', '.join(KEY_COLUMNS)}")
    return lines, columns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("out")
    ap.add_argument("--note", required=True, help="why, for the comment line (no colon)")
    ap.add_argument("--ops", default="attention_fwd,attention_bwd")
    ap.add_argument("--head-dims", default="")
    ap.add_argument("--pages", default="")
    ap.add_argument("--missing-only", action="store_true")
    a = ap.parse_args()
    if ":" in a.note:
        print("splice-samples: --note must not hold a colon (it would read as a header key)",
              file=sys.stderr)
        return 2
    ops = set(filter(None, a.ops.split(",")))
    head_dims = set(filter(None, a.head_dims.split(",")))
    pages = set(filter(None, a.pages.split(",")))
    try:
        base, columns = read(a.base)
        new, new_columns = read(a.new)
    except (OSError, ValueError) as e:
        print(f"splice-samples: {e}", file=sys.stderr)
        return 2
    at = {c: columns.index(c) for c in KEY_COLUMNS}
    new_at = {c: new_columns.index(c) for c in KEY_COLUMNS}

    def touched(fields, where):
        return (fields[where["op"]] in ops and
                (fields[where["head_dim"]] in head_dims or fields[where["page_tokens"]] in pages))

    def key(fields, where):
        return tuple(fields[where[c]] for c in KEY_COLUMNS)

    replacements = {}
    for line in new:
        if line.startswith("#") or line.startswith("op,"):
            continue
        fields = line.split(",")
        if touched(fields, new_at):
            replacements.setdefault(key(fields, new_at), []).append(line)
    header = {l.split(":", 1)[0][1:].strip(): l for l in new if l.startswith("#") and ":" in l}
    out, replaced, used = [], 0, set()
    seen = set()
    for line in base:
        name = line.split(":", 1)[0][1:].strip() if line.startswith("#") and ":" in line else ""
        if name in KERNEL_HEADERS:
            out.append(header.get(name, line))
            seen.add(name)
            continue
        if line.startswith("op,"):
            # What describes the new file's kernels that the base did not say (sparse_bwd).
            out.extend(header[n] for n in KERNEL_HEADERS if n in header and n not in seen)
            out.append(f"# {a.note}")
            out.append(line)
            continue
        if line.startswith("#"):
            out.append(line)
            continue
        fields = line.split(",")
        if not touched(fields, at):
            out.append(line)
            continue
        k = key(fields, at)
        if a.missing_only:
            out.append(line)
            used.add(k)
            continue
        if k not in replacements:
            print(f"splice-samples: {a.new} has no row of shape {','.join(k)}", file=sys.stderr)
            return 2
        if k not in used:  # every row of that shape, once, where the first base row stood
            out.extend(replacements[k])
            used.add(k)
        replaced += 1
    added = [line for k, lines in replacements.items() if k not in used for line in lines]
    out.extend(added)
    directory = os.path.dirname(os.path.abspath(a.out))
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False) as f:
        f.write("\n".join(out) + "\n")
    os.replace(f.name, a.out)
    print(f"splice-samples: {replaced} rows of {a.base} replaced by "
          f"{sum(map(len, replacements.values())) - len(added)} of {a.new}, {len(added)} added")
    return 0


if __name__ == "__main__":
    sys.exit(main())
