#!/usr/bin/env python3
"""PyTorch SDPA peers for kernels/bench/attention_bench: the flash and cuDNN backends on the same
shapes (bf16, head_dim 128, 28 query / 4 KV heads, causal, 64K tokens), and the comparison table.

    attention_bench --csv ours.csv && python3 sdpa_peer.py --ours ours.csv

Shapes (FLOPs as kernels/src/cost.cpp counts them: forward 4 * pairs * H_q * d_h, backward 10 *):
  full_64k      one causal 64K x 64K attention
  full_<n>k_h<H_q>x<H_kv>[_d<d_h>], full_<n>k_d<d_h>
                attention_bench --only full --heads / --head-dim rows: one causal call of their
                tokens, heads and head_dim (named like a sweep peer, _c<n>_kv<n>)
  chunked_64k   16 chunks of 4096 queries, chunk c over (c + 1) * 4096 keys, causal aligned to the
                bottom right (the chunk's last query sees every key); the sum of the 16 calls.
                Compared with every chunked_* row of ours (identity and shuffled page tables).
  last_chunk    the last chunk alone: 4096 queries over 65536 keys (ours: last_chunk_dense_*).
  sweep_*       attention_bench --only sweep's rows, named
                sweep_d<d_h>_h<H_q>x<H_kv>_c<chunk>_p<page>_dense_e<E> or ..._sparse_e<A>of<E>:
                the last chunk of <chunk> queries over E earlier tokens in pages, every one (dense)
                or A of them a 128-query tile (sparse). The peer is the contiguous attention with
                the same attended pairs, head_dim and heads: one bottom-right causal call of <chunk>
                queries over <chunk> + E keys (dense) or <chunk> + A (sparse: as if each tile's
                pages were gathered), one peer for every page size of a (d_h, heads, chunk, E/A).
                Measured only for the sweep rows --ours holds; when it holds nothing else, the 64K
                peers above are skipped (a line says so).
Inputs are laid out as ours, [tokens][heads][d_h], viewed as (1, heads, tokens, d_h). GQA: K/V
with H_kv heads through enable_gqa=True where the backend takes it, else expanded to H_q heads
(the arithmetic is the same). Timing: CUDA events, warm-up, median.
"""
import argparse
import csv
import math
import re
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 28, 4, 128  # the full / chunked / last_chunk shapes (Qwen2.5-7B)

# attention_bench --only sweep's shape names (kernels/bench/attention_bench.cpp, SweepChunk).
SWEEP_RE = re.compile(r"^sweep_d(\d+)_h(\d+)x(\d+)_c(\d+)_p(\d+)_(dense|sparse)_e(\d+)(?:of\d+)?$")


# Each repeat starts behind a ~200 us spin of the GPU, as attention_bench's do (its launches are
# enqueued before the first runs, so a short call is not timed with the host's launch latency).
HOLD_CYCLES = 400_000


def hold():
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(HOLD_CYCLES)


def time_ms(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        hold()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def make(tokens, heads, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, tokens, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return x.transpose(1, 2)  # (1, heads, tokens, d), strides of [tokens][heads][d]


class Attn:
    """One attention call of q_len queries over kv_len keys (bottom-right causal), with hq query
    heads, hkv KV heads and head_dim d."""

    def __init__(self, backend, q_len, kv_len, hq=HQ, hkv=HKV, d=D):
        self.backend = backend
        self.hq, self.hkv = hq, hkv
        self.q = make(q_len, hq, d, 1).requires_grad_()
        self.k4 = make(kv_len, hkv, d, 2).requires_grad_()
        self.v4 = make(kv_len, hkv, d, 3).requires_grad_()
        self.do = make(q_len, hq, d, 4)
        self.q_len, self.kv_len = q_len, kv_len
        self.mask = None
        if q_len != kv_len:
            from torch.nn.attention.bias import causal_lower_right
            self.mask = causal_lower_right(q_len, kv_len)
        self.gqa = True
        self.out = None

    def _call(self, k, v, gqa):
        kw = {"enable_gqa": True} if gqa else {}
        if self.mask is None:
            return F.scaled_dot_product_attention(self.q, k, v, is_causal=True, **kw)
        return F.scaled_dot_product_attention(self.q, k, v, attn_mask=self.mask, **kw)

    def forward(self):
        with sdpa_kernel([self.backend]):
            if self.gqa:
                try:
                    return self._call(self.k4, self.v4, True)
                except (RuntimeError, TypeError):
                    self.gqa = False
            rep = self.hq // self.hkv
            k = self.k4.repeat_interleave(rep, dim=1)
            v = self.v4.repeat_interleave(rep, dim=1)
            return self._call(k, v, False)

    def prepare_backward(self):
        self.out = self.forward()

    def backward(self):
        torch.autograd.grad(self.out, (self.q, self.k4, self.v4), self.do, retain_graph=True)


def causal_pairs(q_len, kv_len):
    # bottom-right causal: query i (0-based) sees kv_len - q_len + i + 1 keys
    return q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2


def measure(backend, shapes, reps, hq=HQ, hkv=HKV, d=D):
    """Sum of fwd and bwd medians over the calls of a shape; raises where the backend refuses."""
    fwd = bwd = 0.0
    pairs = 0.0
    for q_len, kv_len in shapes:
        a = Attn(backend, q_len, kv_len, hq, hkv, d)
        with torch.no_grad():
            fwd += time_ms(a.forward, reps)
        a.prepare_backward()
        bwd += time_ms(a.backward, reps)
        pairs += causal_pairs(q_len, kv_len)
        mode = "gqa" if a.gqa else "expanded"
        del a
        torch.cuda.empty_cache()
    return fwd, bwd, pairs, mode


def tflops(pairs, ms, factor, hq=HQ, d=D):
    return factor * pairs * hq * d / (ms * 1e-3) / 1e12


def sweep_peer(shape):
    """The peer of an attention_bench sweep row: (d, hq, hkv, chunk, keys beyond the chunk), or
    None for a row that is not one."""
    m = SWEEP_RE.match(shape)
    if not m:
        return None
    d, hq, hkv, c, _page, _mode, attended = m.groups()
    return (int(d), int(hq), int(hkv), int(c), int(attended))


FULL_RE = re.compile(r"^full_(\d+)k(?:_h(\d+)x(\d+))?(?:_d(\d+))?$")


def full_peer(shape):
    """The peer of an attention_bench --only full row of other heads or head_dim than Qwen2.5-7B's
    (full_<n>k_h<H_q>x<H_kv>, full_<n>k_d64, ...): one causal call of n x n keys, in the sweep
    peers' form (d, hq, hkv, n, 0); None for full_<n>k itself (the 64K peer) or another row."""
    m = FULL_RE.match(shape)
    if not m or (m.group(2) is None and m.group(4) is None):
        return None
    n = int(m.group(1)) * 1024
    hq, hkv = (int(m.group(2)), int(m.group(3))) if m.group(2) else (HQ, HKV)
    d = int(m.group(4)) if m.group(4) else D
    return (d, hq, hkv, n, 0)


def sweep_peer_name(peer):
    d, hq, hkv, c, attended = peer
    return f"sweep_d{d}_h{hq}x{hkv}_c{c}_kv{c + attended}"


def fail(message):
    """Bad input: one line on stderr, exit code 2."""
    print(f"sdpa_peer.py: {message}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        fail(f"{message}; see sdpa_peer.py --help")


def read_ours(path):
    """attention_bench's CSV rows; one clear line and exit code 2 when it cannot be used."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        fail(f"--ours: cannot read {path}: {e.strerror}")
    need = {"shape", "fwd_tflops", "bwd_tflops"}
    for line, row in enumerate(rows, start=2):
        missing = need - set(k for k, v in row.items() if v not in (None, ""))
        if missing:
            fail(f"{path}:{line}: missing {', '.join(sorted(missing))} "
                 "(attention_bench --csv writes shape,fwd_ms,fwd_tflops,bwd_ms,bwd_tflops,"
                 "fwd_mhz,bwd_mhz)")
        try:
            float(row["fwd_tflops"]), float(row["bwd_tflops"])
        except ValueError:
            fail(f"{path}:{line}: fwd_tflops / bwd_tflops are not numbers")
    return rows


def main():
    ap = Parser()
    ap.add_argument("--ours", help="CSV written by attention_bench --csv")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n, c = args.tokens, args.chunk
    if c <= 0 or n <= 0 or n % c != 0:
        fail("--tokens must be a positive multiple of --chunk")
    if args.reps < 1:
        fail("--reps must be at least 1")
    # Read ours first: a bad file is reported before minutes of peer measurements.
    ours = read_ours(args.ours) if args.ours else None
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN "
          f"{torch.backends.cudnn.version()}", flush=True)
    peer_shapes = {
        "full": [(n, n)],
        "chunked": [(c, (i + 1) * c) for i in range(n // c)],
        "last_chunk": [(c, n)],
    }
    # What to measure: (peer key, label, calls, H_q, H_kv, d_h). The 64K peers unless --ours holds
    # only attention_bench --only sweep rows; then one peer per sweep shape that --ours holds.
    jobs = []
    only_sweep = bool(ours) and all(row["shape"].startswith("sweep_") for row in ours)
    if only_sweep:
        print("PEER: --ours holds only sweep rows: the full / chunked / last_chunk peers are not "
              "measured", flush=True)
    else:
        jobs += [(shape, shape, calls, HQ, HKV, D) for shape, calls in peer_shapes.items()]
    for row in ours or []:
        peer = sweep_peer(row["shape"]) or full_peer(row["shape"])
        if peer is not None and all(job[0] != peer for job in jobs):
            d, hq, hkv, q_len, attended = peer
            jobs.append((peer, sweep_peer_name(peer), [(q_len, q_len + attended)], hq, hkv, d))
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    peers = {}  # (peer key, backend) -> (fwd_tflops, bwd_tflops, fwd_ms, bwd_ms)
    for key, label, calls, hq, hkv, d in jobs:
        for name, be in backends.items():
            try:
                fwd, bwd, pairs, mode = measure(be, calls, args.reps, hq, hkv, d)
                r = (tflops(pairs, fwd, 4, hq, d), tflops(pairs, bwd, 10, hq, d), fwd, bwd)
                peers[(key, name)] = r
                print(f"PEER,{label},{name},{mode},{fwd:.3f},{r[0]:.1f},{bwd:.3f},{r[1]:.1f}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"PEER,{label},{name},unavailable: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160]}", flush=True)
                torch.cuda.empty_cache()

    if ours is None:
        return 0

    def peer_key(shape):
        if re.fullmatch(r"full_\d+k", shape):  # Qwen2.5-7B's heads and head_dim
            return "full"
        if shape.startswith("full_"):
            return full_peer(shape)  # other heads or head_dim: its own causal call
        if shape.startswith("chunked_"):
            return "chunked"
        if shape.startswith("last_chunk_dense"):
            return "last_chunk"
        if shape.startswith("sweep_"):
            return sweep_peer(shape)  # None (n/a) for a name it does not know
        return None

    def fmt(x):
        return "   n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:6.1f}"

    def ratio(a, b):
        return "   n/a" if b is None else f"{a / b:6.2f}"

    w = max([34] + [len(row["shape"]) for row in ours])  # 34: the width before the sweep rows
    print("\nTFLOP/s (fwd 4*pairs*H*d, bwd 10*pairs*H*d); ratio = ours / peer")
    hdr = (f"{'shape':{w}s} | {'ours':>6s} {'flash':>6s} {'cudnn':>6s} {'/fl':>6s} {'/cu':>6s} |"
           f" {'ours':>6s} {'flash':>6s} {'cudnn':>6s} {'/fl':>6s} {'/cu':>6s}")
    print(f"{'':{w}s} | {'forward':^34s} | {'backward':^34s}")
    print(hdr)
    print("-" * len(hdr))
    for row in ours:
        shape = row["shape"]
        key = peer_key(shape)
        of, ob = float(row["fwd_tflops"]), float(row["bwd_tflops"])
        fl = peers.get((key, "flash")) if key else None
        cu = peers.get((key, "cudnn")) if key else None
        print(f"{shape:{w}s} | {of:6.1f} {fmt(fl and fl[0])} {fmt(cu and cu[0])} "
              f"{ratio(of, fl and fl[0])} {ratio(of, cu and cu[0])} | {ob:6.1f} "
              f"{fmt(fl and fl[1])} {fmt(cu and cu[1])} {ratio(ob, fl and fl[1])} "
              f"{ratio(ob, cu and cu[1])}")
    if any(row["shape"].startswith("sweep_") for row in ours):
        print("sweep rows: the peer is one contiguous bottom-right causal call of <chunk> queries "
              "over <chunk> + E keys (sparse: + A,\n  the tokens a tile attends, as if its pages "
              "were gathered): the same attended pairs, heads and head_dim, whatever the page size")
    return 0


if __name__ == "__main__":
    sys.exit(main())
