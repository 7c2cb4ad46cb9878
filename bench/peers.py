#!/usr/bin/env python3
"""peers.py - the PyTorch peers of `moeflow bench gemm`, timed on the same GPU and shapes.

    torch_grouped_mm         torch._grouped_mm, BF16: a[rows, K] (2-D) x w[L, K, N] (3-D, each
                             expert's [N, K] weight transposed, K innermost) with offs = the
                             cumulative row counts (int32) -> out[rows, N] bf16
    torch_scaled_grouped_mm  torch._scaled_grouped_mm, FP8 E4M3 with row-wise fp32 scales:
                             scale_a [rows], scale_b [L, N]; same offs; out_dtype bf16;
                             use_fast_accum as --fast-accum says (default off)

Both run the compact layout (groups back to back, no padding) whatever moeflow's layout was, and
W13 is the plain GEMM (N = 2I, no SwiGLU epilogue, 2x the output) - the work a torch MoE does
before its separate SwiGLU kernel. The FP8 peer uses row-wise (per row / per column) scales, not
moeflow's 1x128 / 128x128 blocks: torch has no block-scaled grouped GEMM on sm_90.

Timing as moeflow's: --warmup untimed then --iters timed calls, each after a 512 MB fill of a
scratch buffer (L2 flushed, outside the events), torch.cuda.Event pairs, median. Every case is
run under try/except: a refusal or error is recorded with its message and the sweep goes on.

    python3 bench/peers.py [case options]            the sweep of `moeflow bench gemm` (same
                                                      options and defaults; --json FILE)
    python3 bench/peers.py --moeflow GEMM.json [--out MERGED.json]
                                                      the cases of a `moeflow bench gemm --json`
                                                      record (exact per-expert counts); writes the
                                                      record with each row's peers extended and
                                                      prints moeflow, torch, cuBLAS dense, floor

Pure standard library + torch (2.11 on the GPU machine). Without torch or without a CUDA device
it prints a skip line and exits 0, so `python3 bench/peers.py --help` works anywhere.
"""

import argparse
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys

# ---- the sweep of tools/bench_gemm.c (keep in step) ---------------------------------------------
MODELS = {  # name: (H, I, E, default L list)
    "deepseek-v3": (7168, 2048, 256, [32, 256]),
    "qwen3-235b-a22b": (4096, 1536, 128, [16]),
    "kimi-k2": (7168, 2048, 384, [48]),
}
DEFAULT_M = [8, 16, 32, 64, 128, 256, 1024, 4096, 8192]
QUICK_M = [8, 64, 256, 1024, 4096]
QUICK_L_DEEPSEEK = 32
OPS = {"w13": "w13_swiglu", "w2": "w2"}  # --op name: JSON kernel
COUNTS = ["equal", "uneven", "zipf"]
ZIPF_S = 1.2
UNEVEN_SPREAD = 0.3
SEGMENT_ALIGN = 128
QBLOCK = 128
DEF_CAPACITY = 1024
MAX_CASE_BYTES = 60e9
FLUSH_BYTES = 512 << 20
DEF_ITERS, DEF_WARMUP, DEF_SEED = 20, 3, 1
MASK64 = (1 << 64) - 1


def ceilings():
    """The H200 ceilings of tools/bench.h (copy B/s, bf16 FLOP/s, fp8 FLOP/s), or None."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "bench.h")
    try:
        text = open(path).read()
    except OSError:
        return None
    vals = dict(re.findall(r"#define\s+(H200_\w+)\s+([0-9.eE+]+)", text))
    try:
        return (float(vals["H200_COPY_BYTES_PER_S"]), float(vals["H200_BF16_FLOPS"]), float(vals["H200_FP8_FLOPS"]))
    except KeyError:
        return None


class Rng:
    """splitmix64, as rng_next / rng_unit in tools/bench_gemm.c."""

    def __init__(self, state):
        self.s = state & MASK64

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & MASK64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def unit(self):
        return (self.next() >> 11) * (1.0 / 9007199254740992.0)


def make_counts(kind, L, M, seed):
    """Rows per expert, summing to M * L: a port of make_counts in tools/bench_gemm.c."""
    kind_i = COUNTS.index(kind)
    rng = Rng(seed ^ (kind_i << 56) ^ (L << 32) ^ M)
    total = M * L
    counts = [M] * L
    if kind == "uneven":
        lo, hi = int(math.floor(M * (1 - UNEVEN_SPREAD))), int(math.ceil(M * (1 + UNEVEN_SPREAD)))
        counts = [int(math.floor(M * (1 + UNEVEN_SPREAD * (2 * rng.unit() - 1)) + 0.5)) for _ in range(L)]
        s, e, step = sum(counts), 0, 0
        while s != total and step < L * (hi - lo + 2):
            if s > total and counts[e] > lo:
                counts[e] -= 1
                s -= 1
            elif s < total and counts[e] < hi:
                counts[e] += 1
                s += 1
            step += 1
            e = (e + 1) % L
    elif kind == "zipf":
        order = list(range(L))
        for e in range(L - 1, 0, -1):
            j = rng.next() % (e + 1)
            order[e], order[j] = order[j], order[e]
        sum_w = 0.0
        for r in range(L):
            sum_w += math.pow(r + 1, -ZIPF_S)
        frac = [0.0] * L
        assigned = 0
        for r in range(L):
            x = float(total) * (math.pow(r + 1, -ZIPF_S) / sum_w)
            fl = math.floor(x)
            counts[order[r]] = int(fl)
            frac[order[r]] = x - fl
            assigned += int(fl)
        taken = [False] * L
        for _ in range(total - assigned):
            best = -1
            for e in range(L):
                if not taken[e] and (best < 0 or frac[e] > frac[best]):
                    best = e
            taken[best] = True
            counts[best] += 1
    return counts


def geometry(kernel, H, I):
    """(N, K) of a GEMM: W13 N = 2I, K = H; W2 N = H, K = I."""
    return (2 * I, H) if kernel.startswith("w13") else (H, I)


def floor_us(kernel, dtype, H, I, counts, ceil):
    """moeflow's floor of a case (plan_case in tools/bench_gemm.c), or None without ceilings."""
    if ceil is None:
        return None
    copy, bf16, fp8p = ceil
    fp8 = dtype == "fp8"
    N, K = geometry(kernel, H, I)
    es, ss, ws = (1, 4 / QBLOCK, 4 / (QBLOCK * QBLOCK)) if fp8 else (2, 0, 0)
    out_cols, out_es, oss = (I, es, ss) if kernel == "w13_swiglu" else (H, 2, 0) if kernel == "w2" else (N, 2, 0)
    rows, used = sum(counts), sum(1 for c in counts if c > 0)
    flops = 2.0 * rows * N * K
    nbytes = used * N * K * (es + ws) + rows * K * (es + ss) + rows * out_cols * (out_es + oss)
    return max(flops / (fp8p if fp8 else bf16), nbytes / copy) * 1e6


def round_up(x, a):
    return (x + a - 1) // a * a


def operand_bytes(kernel, dtype, H, I, L, counts, layout, capacity):
    """Bytes of moeflow's operands in a case (for the same skip rule as the C sweep)."""
    fp8 = dtype == "fp8"
    N, K = geometry(kernel, H, I)
    es, ss, ws = (1, 4 / QBLOCK, 4 / (QBLOCK * QBLOCK)) if fp8 else (2, 0, 0)
    out_cols, out_es, oss = (I, es, ss) if kernel == "w13_swiglu" else (H, 2, 0)
    if layout == "masked":
        buf_rows = L * max(capacity, round_up(max(counts), SEGMENT_ALIGN))
    else:
        buf_rows = sum(round_up(c, SEGMENT_ALIGN) for c in counts)
    return buf_rows * K * (es + ss) + L * N * K * (es + ws) + buf_rows * out_cols * (out_es + oss)


def sweep_cases(a):
    """The cases of `moeflow bench gemm` with the same options, in its order, as dicts."""
    models = list(MODELS) if a.model == "all" else a.model.split(",")
    for m in models:
        if m not in MODELS:
            sys.exit(f"peers.py: --model: unknown model '{m}' ({', '.join(MODELS)}, all)")
    Ms = [int(x) for x in a.rows.split(",")] if a.rows else (QUICK_M if a.quick else DEFAULT_M)
    ops = list(OPS) if a.op == "all" else [a.op]
    dtypes = ["bf16", "fp8"] if a.dtype == "all" else [a.dtype]
    layouts = ["expert_major", "masked"] if a.layout == "all" else [a.layout]
    counts_kinds = COUNTS if a.counts == "all" else [a.counts]
    cases = []
    for m in models:
        H, I, E, Ls = MODELS[m]
        if a.experts:
            Ls = [int(x) for x in a.experts.split(",")]
        elif a.quick and m == "deepseek-v3":
            Ls = [QUICK_L_DEEPSEEK]
        for L in Ls:
            for M in Ms:
                for ck in counts_kinds:
                    counts = make_counts(ck, L, M, a.seed)
                    for op in ops:
                        for dt in dtypes:
                            for lay in layouts:
                                kernel = OPS[op]
                                C = max(a.capacity, round_up(max(counts), SEGMENT_ALIGN)) if lay == "masked" else None
                                if len(layouts) == 2 and lay == "masked" and ck == "equal" and C == M:
                                    continue  # the expert_major problem byte for byte (as the C sweep)
                                if operand_bytes(kernel, dt, H, I, L, counts, lay, a.capacity) > MAX_CASE_BYTES:
                                    continue
                                cases.append({"op": "gemm", "kernel": kernel, "model": m, "dtype": dt, "layout": lay,
                                              "counts": ck, "shape": {"E": E, "H": H, "I": I, "L": L, "M": M},
                                              "rows": M * L, "expert_rows": counts, "peers": []})
    return cases


# ---- timing ----------------------------------------------------------------------------------------
class Timer:
    def __init__(self, torch, iters, warmup):
        self.torch, self.iters, self.warmup = torch, iters, warmup
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def median_us(self, fn):
        times = []
        for it in range(self.warmup + self.iters):
            self.flush.fill_(it & 0xFF)  # L2 flushed, outside the events
            self.ev[0].record()
            fn()
            self.ev[1].record()
            self.ev[1].synchronize()
            if it >= self.warmup:
                times.append(self.ev[0].elapsed_time(self.ev[1]) * 1e3)
        return statistics.median(times)


def make_weights(torch, dtype, L, N, K):
    """w [L, K, N] as a transposed view of [L, N, K] (K innermost) + row-wise scales for FP8."""
    if dtype == "bf16":
        w = torch.empty((L, N, K), dtype=torch.bfloat16, device="cuda").uniform_(-1.0, 1.0)
        w.mul_(math.sqrt(3.0 / K))
        return w.transpose(-2, -1), None
    # random E4M3 codes of magnitude 0.5 .. 0.94, random sign (never NaN): no fp32 temporary
    codes = torch.randint(0, 256, (L, N, K), dtype=torch.uint8, device="cuda")
    codes.bitwise_and_(0x87).bitwise_or_(0x30)
    w = codes.view(torch.float8_e4m3fn)
    scale_b = torch.rand((L, N), dtype=torch.float32, device="cuda").add_(0.5).mul_(math.sqrt(3.0 / K))
    return w.transpose(-2, -1), scale_b


def make_acts(torch, dtype, rows, K):
    if dtype == "bf16":
        return torch.empty((rows, K), dtype=torch.bfloat16, device="cuda").uniform_(-1.0, 1.0), None
    codes = torch.randint(0, 256, (rows, K), dtype=torch.uint8, device="cuda")
    codes.bitwise_and_(0x87).bitwise_or_(0x30)
    return codes.view(torch.float8_e4m3fn), torch.rand((rows,), dtype=torch.float32, device="cuda").add_(0.5)


def peer_name(dtype):
    return "torch_grouped_mm" if dtype == "bf16" else "torch_scaled_grouped_mm"


def run_peers(torch, rows_in, a):
    """Times the torch peer of every row (rows sharing kernel, dtype and counts share one
    measurement); appends {"name", "time_us"} or {"name", "error"} to each row's peers."""
    timer = Timer(torch, a.iters, a.warmup)
    groups = {}  # (model, L, kernel, dtype) -> rows, in first-seen order
    for r in rows_in:
        key = (r["model"], r["shape"]["L"], r["kernel"], r["dtype"])
        groups.setdefault(key, []).append(r)
    for (model, L, kernel, dtype), rows in groups.items():
        H, I = rows[0]["shape"]["H"], rows[0]["shape"]["I"]
        N, K = geometry(kernel, H, I)
        name = peer_name(dtype)
        done = {}  # tuple(counts) -> result
        w = scale_b = a_full = scale_a_full = None
        try:
            w, scale_b = make_weights(torch, dtype, L, N, K)
            max_rows = max(sum(r["expert_rows"]) for r in rows)
            a_full, scale_a_full = make_acts(torch, dtype, max_rows, K)
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            for r in rows:
                r["peers"].append({"name": name, "error": err})
            print(f"# peers.py: {model} L {L} {kernel} {dtype}: setup failed: {err}", file=sys.stderr)
            w = scale_b = a_full = scale_a_full = None
            torch.cuda.empty_cache()
            continue
        for r in rows:
            counts = tuple(r["expert_rows"])
            if counts not in done:
                rows_n = sum(counts)
                offs = act = None
                try:
                    offs = torch.tensor(list(_cumsum(counts)), dtype=torch.int32, device="cuda")
                    act = a_full[:rows_n]
                    if dtype == "bf16":
                        fn = lambda: torch._grouped_mm(act, w, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
                    else:
                        sa = scale_a_full[:rows_n]
                        fn = lambda: torch._scaled_grouped_mm(  # noqa: E731
                            act, w, sa, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=a.fast_accum)
                    done[counts] = {"name": name, "time_us": round(timer.median_us(fn), 3)}
                except Exception as e:  # noqa: BLE001
                    msg = str(e).splitlines()[0] if str(e) else ""
                    done[counts] = {"name": name, "error": f"{type(e).__name__}: {msg}"}
                    print(f"# peers.py: {model} {kernel} {dtype} L {L} M {r['shape']['M']}: {done[counts]['error']}",
                          file=sys.stderr)
                del offs, act
            r["peers"].append(dict(done[counts]))
        del w, scale_b, a_full, scale_a_full
        torch.cuda.empty_cache()


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


# ---- output ----------------------------------------------------------------------------------------
def peer_time(row, name):
    for p in row.get("peers", []):
        if p.get("name") == name and "time_us" in p:
            return p["time_us"]
    return None


def fmt(x, spec="10.1f"):
    return format(x, spec) if isinstance(x, (int, float)) else format("-", ">" + spec.split(".")[0])


def print_table(rows, ceil):
    print("# side by side: times in us (median); best = the fastest grouped peer's time / moeflow's (> 1: moeflow is\n"
          "# faster; like with like: torch's grouped GEMM); dense = cuBLAS dense / moeflow, a compute ceiling that reads\n"
          "# one expert's weights, not a peer")
    print(f"#{'model':<15} {'op':<4} {'type':<4} {'layout':<12} {'counts':<6} {'L':>4} {'M':>5} {'moeflow':>10} "
          f"{'torch':>10} {'cublas':>10} {'floor':>10} {'%floor':>7} {'best':>6} {'dense':>6}")
    for r in rows:
        s = r["shape"]
        mf = r.get("time_us")
        torch_t = peer_time(r, peer_name(r["dtype"]))
        cb = peer_time(r, "cublas_dense")
        fl = r.get("floor_us")
        if fl is None:
            fl = floor_us(r["kernel"], r["dtype"], s["H"], s["I"], r["expert_rows"], ceil)
        best = torch_t / mf if mf and torch_t is not None else None
        dense = cb / mf if mf and cb is not None else None
        pct = 100.0 * fl / mf if mf and fl else None
        op = "w13" if r["kernel"] == "w13_swiglu" else "w13p" if r["kernel"] == "w13" else r["kernel"]
        print(f" {r['model']:<15} {op:<4} {r['dtype']:<4} {r['layout']:<12} {r.get('counts', '-'):<6} {s['L']:>4} "
              f"{s['M']:>5} {fmt(mf)} {fmt(torch_t)} {fmt(cb)} {fmt(fl)} {fmt(pct, '6.1f')}{'%' if pct else ' '} "
              f"{fmt(best, '6.2f')} {fmt(dense, '6.2f')}")


def git_commit():
    env = os.environ.get("MF_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def now_utc():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def main():
    p = argparse.ArgumentParser(
        description="Time the PyTorch peers (torch._grouped_mm BF16, torch._scaled_grouped_mm FP8 row-wise) "
                    "of `moeflow bench gemm` on the same shapes, and merge them into its JSON record.",
        epilog="Without torch or a CUDA device: prints a skip line and exits 0.")
    p.add_argument("--moeflow", metavar="FILE", help="a `moeflow bench gemm --json` record: time its cases, merge")
    p.add_argument("--out", metavar="FILE", help="merged record (default: FILE with .peers.json)")
    p.add_argument("--json", metavar="FILE", help="without --moeflow: write the peers' record here")
    p.add_argument("--model", default="all")
    p.add_argument("--op", default="all", choices=["w13", "w2", "all"])
    p.add_argument("-M", "--rows", help="rows per expert list (default: as moeflow bench gemm)")
    p.add_argument("-L", "--experts", help="local experts list, for every model")
    p.add_argument("--dtype", default="all", choices=["bf16", "fp8", "all"])
    p.add_argument("--layout", default="all", choices=["expert_major", "masked", "all"])
    p.add_argument("--counts", default="equal", choices=COUNTS + ["all"])
    p.add_argument("-C", "--capacity", type=int, default=DEF_CAPACITY)
    p.add_argument("--quick", action="store_true", help="-M 8,64,256,1024,4096 and L 32 for deepseek-v3")
    p.add_argument("--iters", type=int, default=DEF_ITERS)
    p.add_argument("--warmup", type=int, default=DEF_WARMUP)
    p.add_argument("--seed", type=int, default=DEF_SEED)
    p.add_argument("--fast-accum", action="store_true", help="FP8: use_fast_accum=True")
    a = p.parse_args()
    if a.iters < 1 or a.warmup < 0:
        sys.exit("peers.py: --iters must be >= 1 and --warmup >= 0")

    try:
        import torch  # noqa: PLC0415 - optional: CI machines have none
    except ImportError:
        print("# peers.py: SKIP (no torch here)")
        return 0
    if not torch.cuda.is_available():
        print(f"# peers.py: SKIP (torch {torch.__version__} finds no CUDA device)")
        return 0

    ceil = ceilings()
    if a.moeflow:
        with open(a.moeflow) as f:
            record = json.load(f)
        rows = [r for r in record.get("rows", []) if r.get("op") == "gemm" and r.get("kernel") in ("w13_swiglu", "w2")]
        for r in rows:
            if "expert_rows" not in r:
                r["expert_rows"] = [r["shape"]["M"]] * r["shape"]["L"]
    else:
        record = None
        rows = sweep_cases(a)

    dev = torch.cuda.get_device_properties(0)
    print(f"# peers.py: torch {torch.__version__} (CUDA {torch.version.cuda}) on {dev.name}; {len(rows)} rows; "
          f"median of {a.iters} after {a.warmup} warm-up, 512 MB fill before each call")
    print("# peers    torch_grouped_mm (bf16), torch_scaled_grouped_mm (fp8 row-wise scales, use_fast_accum "
          f"{a.fast_accum}); compact layout; W13 without SwiGLU")
    run_peers(torch, rows, a)

    meta_peers = {"command": " ".join(sys.argv), "date": now_utc(), "torch": torch.__version__,
                  "fast_accum": a.fast_accum}
    if record is not None:
        record.setdefault("meta", {})["peers"] = meta_peers
        out = a.out or re.sub(r"(\.json)?$", ".peers.json", a.moeflow, count=1)
        with open(out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"# merged record: {out}")
    elif a.json:
        for r in rows:
            fl = floor_us(r["kernel"], r["dtype"], r["shape"]["H"], r["shape"]["I"], r["expert_rows"], ceil)
            if fl is not None:
                r["floor_us"] = round(fl, 3)
        rec = {"meta": {"card": os.environ.get("MF_CARD", "h200"), "date": now_utc(), "commit": git_commit(),
                        "command": " ".join(sys.argv), "backend": "torch", "peers": meta_peers}, "rows": rows}
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)
        print(f"# record: {a.json}")
    print_table(rows, ceil)
    return 0


if __name__ == "__main__":
    sys.exit(main())
