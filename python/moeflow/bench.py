"""moeflow.bench — the layer and its GEMMs beside a torch peer, as JSON records and PNG plots.

    python3 -m moeflow.bench [--presets deepseek-v3,kimi-k2,qwen3-235b-a22b] [--tokens 1,8,32,128]
                             [--dtype fp8|bf16] [--ranks 1] [--launch auto|graph|eager]
                             [--flush on|off] [--c-record C.json ...] [--out DIR]
    python3 -m moeflow.bench --smoke --out DIR          # a tiny shape: seconds on a CPU
    python3 -m moeflow.bench --plot-records bench/results/h200/*.json --out docs/img

For each preset and T (tokens per rank) it times, in one run on one device:
  layer       moeflow's whole layer (mf_moe_forward, EXPERT_MAJOR) on R virtual ranks of this
              process, replays of a captured CUDA graph or eager calls (--launch, below),
              timed without profiling; a profiled twin layer's W13 and W2 phases are the
              "w13" / "w2" rows; each --dataflow
              (default auto; auto,unfused adds "layer_unfused" rows, as the CLI's records);
  torch peer  an unfused torch MoE layer on the same routing (all ranks' tokens, all experts):
              sort rows by expert, torch._grouped_mm (BF16) / torch._scaled_grouped_mm (FP8,
              row-wise scales: torch has no 128 x 128 block-scaled grouped GEMM) for W13, SwiGLU,
              (FP8: row-wise requantisation), W2, then the weighted index_add; where the grouped
              GEMMs are absent or refuse (e.g. FP8 on a CPU), per-expert matmuls on BF16 copies.
              Its W13 (plain, no SwiGLU) and W2 GEMMs alone are the w13 / w2 rows' peers;
  floor       tools/moeflow.c's: max(FLOPs / peak, bytes / copy rate) with the H200 ceilings of
              tools/bench.h (copy 4.24 TB/s, BF16 795, FP8 1436 TFLOP/s; docs/PERFORMANCE.md);
              bytes = the routed experts' weights once (+ FP8 scales) + x, y + the rows' payload
              and partials. CUDA only (the CPU has no ceiling: no floor, as the CLI).
Timing: CUDA events on each rank's stream, median of --iters after --warmup, a 512 MB fill before
each iteration (L2 flushed, outside the events; --flush off: none, as `moeflow bench`), the slowest
rank's median; on the CPU, wall clock.
Launch (--launch, issue 25.4): "graph" captures each T's forward once into a torch.cuda.CUDAGraph
(after one eager call of that T) and times its replays between the two events, held: a spin kernel
(HOLD_CYCLES) ahead of the begin event lets the host enqueue event, graph and end event first, so
the time is the replay's device time without its launch latency ("gated": 1, as the CLI's
--gated); "eager" calls the
forward every iteration, so the host's launch gaps (ctypes, the library's host code, ~10-20 us at
decode) are inside the events. The default "auto" is graph on CUDA with R = 1, because that is how
an engine runs the small batches this bench is about: vLLM and SGLang capture their decode steps
(batch sizes up to a few hundred tokens) into CUDA graphs and replay them, so an engine never pays
the Python or launch gaps there, and `moeflow bench --gated` (the C numbers) measures the same
device time without host gaps (measured on the H200: a replay can still be a few us faster).
Eager stays the default for R > 1 virtual ranks (one thread per rank,
each capturing while its peers wait in the collective is not supported here) and on the CPU (no
graphs). Rows carry "launch": "graph" | "eager" (the w13 / w2 rows and the torch peer, timed eagerly
by their nature: "eager") and "l2_flush". --c-record adds, per layer row, the C row of the same
shape from `moeflow bench --json` records ("c": its time, diff_us, within_tol = |diff| <= 2 us,
same_routing) and a "vs C" table; where the C record carries the row's routing ("topk_ids", small
problems) the Python rows replay that routing ("routing": "c_record"), so both sides stream the
same experts and the 2 us check compares like with like (other routings give other floors).
Rounds (--rounds N, default 3; issue 25): the whole T sweep runs N times, one round after the other
(round 1 over every T, then round 2, ...), for moeflow and for the torch peer alike; each row's
time_us is the median round, with the rounds' min / max and the spread (max - min) / median in the
record ("rounds", "round_us", "min_us", "median_us", "max_us", "spread", "spread_flagged"; a peer
entry the same) and on the console, where a spread above 5 % is marked `!` (docs/DESIGN.md
"Benchmark records"). A row's phases are its median round's.

Output under --out: one record per preset, `<date>_pybench_<preset>_R<R>_<dtype>_<commit>.json`
in docs/DESIGN.md's schema (rows op "layer", "w13", "w2", each with "peers"), and PNG plots
(`pybench_<dtype>_R<R>.png`: per preset, time against T and time over the floor). Without
matplotlib the records are written and a line says the plots were skipped.
"""
import argparse
import datetime
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys
import textwrap
import threading
import time

# virtual ranks on one GPU need both before the process first uses CUDA (docs/API.md section 10)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402

from . import _lib  # noqa: E402
from .core import Layer, resolve_backend  # noqa: E402
from .torch import virtual_comms  # noqa: E402

BLOCK = 128
FP8 = torch.float8_e4m3fn
# tools/moeflow.c's presets: E, K, H, I, the dtype the model ships (README "The moeflow command")
PRESETS = {
    "deepseek-v3": (256, 8, 7168, 2048, "fp8"),
    "kimi-k2": (384, 8, 7168, 2048, "fp8"),
    "qwen3-235b-a22b": (128, 8, 4096, 1536, "fp8"),
    "glm-4.5": (160, 8, 5120, 1536, "fp8"),
    "mixtral-8x7b": (8, 2, 4096, 14336, "bf16"),
    "tiny": (8, 2, 256, 128, "fp8"),  # the smoke shape: seconds on a CPU
}
DEFAULT_PRESETS = "deepseek-v3,kimi-k2,qwen3-235b-a22b"
DEFAULT_TOKENS = "1,8,32,128,512,4096"
SMOKE_TOKENS = "1,4,16"
# tools/bench.h (read from the checkout when present)
CEILINGS = {"H200_COPY_BYTES_PER_S": 4.24e12, "H200_BF16_FLOPS": 795e12, "H200_FP8_FLOPS": 1436e12}
FLUSH_BYTES = 512 << 20
DEFAULT_ROUNDS = 3
SPREAD_FLAG = 0.05  # (max - min) / median over the rounds above this: flagged (tools/moeflow.c)
# Graph replays are timed held: a spin kernel of this many clocks (~0.5 ms on an H200) runs ahead of
# the begin event, so that the host has enqueued the event, the graph and the end event before the
# begin event fires: the replay's device time without its host launch latency, as `moeflow bench
# --gated` holds each stream until the forward is enqueued. Far longer than the ~10-30 us enqueue.
HOLD_CYCLES = 1_000_000


# ---- rounds -------------------------------------------------------------------------------------
def schedule(tokens, rounds):
    """[(round, T)] in the order they run: the whole sweep once per round, rounds one after the
    other, so that a drift over the run shows as every row's spread."""
    return [(rnd, T) for rnd in range(rounds) for T in tokens]


def aggregate_rounds(values, flag=SPREAD_FLAG):
    """Each round's time -> the record's fields: the median of the rounds (the mean of the two
    middle ones when they are even), min, max, spread = (max - min) / median (None with one round)
    and whether it passes `flag`; "median_round" is the index of the lower middle round (the round
    whose phases a row reports)."""
    if not values:
        raise ValueError("aggregate_rounds: no rounds")
    order = sorted(range(len(values)), key=lambda i: values[i])
    n, mid = len(values), (len(values) - 1) // 2
    med = values[order[mid]] if n % 2 else 0.5 * (values[order[mid]] + values[order[mid + 1]])
    lo, hi = values[order[0]], values[order[-1]]
    spread = (hi - lo) / med if n > 1 and med > 0 else None
    return {"rounds": n, "round_us": [round(v, 3) for v in values], "min_us": round(lo, 3),
            "median_us": round(med, 3), "max_us": round(hi, 3),
            "spread": None if spread is None else round(spread, 5),
            "spread_flagged": spread is not None and spread > flag, "median_round": order[mid]}


def round_fields(agg):
    """The record's fields of an aggregate (without the helper's median_round)."""
    return {k: v for k, v in agg.items() if k != "median_round"}


def spread_cell(agg):
    """The console's spread: `1.2%`, `7.3%!` past the flag, `-` with one round."""
    if agg["spread"] is None:
        return "-"
    return f"{100 * agg['spread']:.1f}%" + ("!" if agg["spread_flagged"] else "")


# ---- the floor (tools/moeflow.c count()) --------------------------------------------------------
def ceilings():
    """(copy B/s, BF16 FLOP/s, FP8 FLOP/s): tools/bench.h of the checkout, else its values."""
    vals = dict(CEILINGS)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "bench.h")
    try:
        for k, v in re.findall(r"#define\s+(H200_\w+)\s+([0-9.eE+]+)", open(path).read()):
            if k in vals:
                vals[k] = float(v)
    except OSError:
        pass
    return vals["H200_COPY_BYTES_PER_S"], vals["H200_BF16_FLOPS"], vals["H200_FP8_FLOPS"]


def counts(R, T, H, I, rows, used, fp8):
    """FLOPs and bytes of the layer and of its W13 / W2 phases (tools/moeflow.c count())."""
    es = 1.0 if fp8 else 2.0
    ss, ws = (4.0 / BLOCK, 4.0 / (BLOCK * BLOCK)) if fp8 else (0.0, 0.0)
    layer = (2.0 * rows * H * I * 3,
             used * 3 * I * H * (es + ws) + 2.0 * R * T * H * 2 + rows * H * (es + 2))
    w13 = (2.0 * rows * H * 2 * I, used * 2 * I * H * (es + ws) + rows * H * (es + ss) + rows * I * (es + ss))
    w2 = (2.0 * rows * I * H, used * H * I * (es + ws) + rows * I * (es + ss) + rows * H * 2)
    return {"layer": layer, "w13": w13, "w2": w2}


def floor_us(flops, nbytes, fp8, ceil):
    copy, bf16, fp8p = ceil
    return max(flops / (fp8p if fp8 else bf16), nbytes / copy) * 1e6


# ---- problems ----------------------------------------------------------------------------------
def random_fp8(shape, device, gen_seed):
    """Random E4M3 codes of magnitude 0.5 .. 0.94 with random signs (never NaN), no fp32 temporary
    (bench/peers.py's trick)."""
    g = torch.Generator(device=device).manual_seed(gen_seed)
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)
    codes.bitwise_and_(0x87).bitwise_or_(0x30)
    return codes.view(FP8)


def make_weights(E, H, I, fp8, device, seed=1):
    """All E experts: w13 [E, 2I, H], w2 [E, H, I] with 128 x 128 scales (FP8) scaled so that
    outputs stay O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if fp8:
        w13, w2 = random_fp8((E, 2 * I, H), device, seed), random_fp8((E, H, I), device, seed + 1)
        s13 = torch.rand((E, 2 * I // BLOCK, H // BLOCK), generator=g, device=device).add_(0.5).mul_(math.sqrt(3.0 / H) / 0.75)
        s2 = torch.rand((E, H // BLOCK, I // BLOCK), generator=g, device=device).add_(0.5).mul_(math.sqrt(3.0 / I) / 0.75)
        return w13, s13, w2, s2
    w13 = torch.empty((E, 2 * I, H), dtype=torch.bfloat16, device=device).uniform_(-1, 1, generator=g)
    w2 = torch.empty((E, H, I), dtype=torch.bfloat16, device=device).uniform_(-1, 1, generator=g)
    return w13.mul_(math.sqrt(3.0 / H)), None, w2.mul_(math.sqrt(3.0 / I)), None


def make_tokens(R, T, E, K, H, device, seed, routing=None):
    """Per rank: x [T, H] bf16, uniform distinct top-K ids [T, K] int32 (or rank r's ids from
    `routing`, a list of R int32 [T, K] tensors: c_routing), weights summing to 1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(R):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
        if routing is not None:
            ids = routing[r]
        w = torch.rand(T, K, generator=g) + 0.05
        out.append((x.to(device), ids.contiguous().to(device), (w / w.sum(1, keepdim=True)).to(device)))
    return out


# ---- timing --------------------------------------------------------------------------------------
class Timer:
    """median_us(fn): CUDA events on the current stream after a 512 MB fill (L2 flushed; none with
    flush=False), held (hold=True: HOLD_CYCLES of spin before the begin event, for graph replays),
    or wall clock on the CPU."""

    def __init__(self, device, iters, warmup, flush=True, hold=False):
        self.cuda, self.iters, self.warmup = device.type == "cuda", iters, warmup
        self.hold = hold and self.cuda
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda and flush else None

    def samples(self, fn, before=None):
        times = []
        for it in range(self.warmup + self.iters):
            if before:
                before()
            if self.cuda:
                if self.flush is not None:
                    self.flush.fill_(it & 0xFF)
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                if self.hold:
                    torch.cuda._sleep(HOLD_CYCLES)  # the replay enqueued before the begin event fires
                ev[0].record()
                fn()
                ev[1].record()
                ev[1].synchronize()
                t = ev[0].elapsed_time(ev[1]) * 1e3
            else:
                t0 = time.perf_counter()
                fn()
                t = (time.perf_counter() - t0) * 1e6
            if it >= self.warmup:
                times.append(t)
        return times

    def median_us(self, fn):
        return statistics.median(self.samples(fn))


_DTYPES = {torch.bfloat16: _lib.DTYPE["bf16"], FP8: _lib.DTYPE["fp8"], torch.float32: _lib.DTYPE["fp32"],
           torch.int32: _lib.DTYPE["int32"]}


def _desc(t):
    return _lib.tensor(t.data_ptr() if t.numel() else 0, _DTYPES[t.dtype], t.shape)


def time_moeflow(comms, spec, weights, tokens_by_t, iters, warmup, dataflow="auto", rounds=1, trace=None,
                 launch="eager", flush=True):
    """{T: (rounds, phases_us)}: the layer (`dataflow`) on every rank (one thread each), timed by
    CUDA events without profiling, then a profiled twin layer's phases (eager calls); `rounds`
    times over the whole T sweep (schedule()). Per round, the slowest rank's median total; rounds:
    aggregate_rounds() of those, phases_us: the median round's slowest rank's phase medians.
    launch "eager": a forward call per timed iteration; "graph" (CUDA, R = 1: resolve_launch()):
    the forward captured once per T into a torch.cuda.CUDAGraph (after an eager call of that T) and
    the graph replayed between the events, held (HOLD_CYCLES). flush: the 512 MB fill before each iteration (outside
    the events), as the module docstring; False: none, as the CLI. `trace` (a list) gets each
    (round, T) as rank 0 starts it."""
    R = len(comms)
    E, K, H, I, fp8 = spec
    S = max(tokens_by_t)
    cuda = comms[0].backend == "cuda"
    graph = launch == "graph"
    if graph and (not cuda or R != 1):
        raise ValueError(f"time_moeflow: launch 'graph' needs the CUDA backend and R = 1 (got "
                         f"{comms[0].backend}, R = {R}; resolve_launch())")
    device = torch.device("cuda", comms[0].device) if cuda else torch.device("cpu")
    barrier = threading.Barrier(R)
    L = E // R

    def rank_main(r):
        stream = torch.cuda.Stream(device) if cuda else None
        ctx = torch.cuda.stream(stream) if cuda else _Null()
        with ctx:
            # Timed without profiling (its events cost time); the phases come from a profiled
            # twin layer run after the timed calls.
            layer, prof = (Layer(comms[r], E, K, H, I, S, dtype="fp8" if fp8 else "bf16",
                                 profile=p, dataflow=dataflow) for p in (False, True))
            try:
                w13, s13, w2, s2 = (None if w is None else w[r * L:(r + 1) * L] for w in weights)
                for lay in (layer, prof):
                    lay.set_weights(_desc(w13), _desc(s13) if fp8 else _lib.Tensor(), _desc(w2),
                                    _desc(s2) if fp8 else _lib.Tensor())
                fill = (torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
                        if cuda and flush and r == 0 else None)
                if cuda:  # a stream's first launch must not be inside a collective (API.md section 10)
                    torch.zeros(1, device=device).add_(1)
                    stream.synchronize()
                graphs = capture_graphs(layer, tokens_by_t, stream) if graph else {}
                out = {}
                for rnd, T in schedule(list(tokens_by_t), rounds):
                    if trace is not None and r == 0:
                        trace.append((rnd, T))
                    x, ids, wts = tokens_by_t[T][r]
                    y = torch.empty_like(x)
                    st = stream.cuda_stream if cuda else None
                    times, phases = [], []
                    if cuda:
                        stream.synchronize()
                    for it in range(2 * (warmup + iters)):
                        profiled = it >= warmup + iters
                        lay = prof if profiled else layer
                        if cuda:
                            if fill is not None:
                                fill.fill_(it & 0xFF)  # L2 flushed, outside the events
                            stream.synchronize()
                        barrier.wait()
                        if cuda:
                            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                            if graph and not profiled:
                                torch.cuda._sleep(HOLD_CYCLES)  # held: HOLD_CYCLES' comment
                            ev[0].record(stream)
                            if graph and not profiled:
                                graphs[T][0].replay()  # on the current stream: this rank's
                            else:
                                lay.forward(_desc(x), _desc(ids), _desc(wts), _desc(y), st)
                            ev[1].record(stream)
                            ev[1].synchronize()
                            t = ev[0].elapsed_time(ev[1]) * 1e3
                        else:
                            t0 = time.perf_counter()
                            lay.forward(_desc(x), _desc(ids), _desc(wts), _desc(y), st)
                            t = (time.perf_counter() - t0) * 1e6
                        if (it % (warmup + iters)) < warmup:
                            continue
                        if profiled:
                            phases.append(lay.phase_times())
                        else:
                            times.append(t)
                    out[(rnd, T)] = (statistics.median(times),
                              {k: statistics.median(p[k] for p in phases)
                               for k in ("prepare", "dispatch", "w13", "w2", "combine")})
                return out
            except BaseException:
                barrier.abort()  # the peers' next wait raises instead of hanging
                raise
            finally:
                if cuda:
                    stream.synchronize()
                graphs = None  # the graphs go before their layer
                layer.close()
                prof.close()

    from .core import run_ranks
    per_rank = run_ranks(rank_main, R)
    result = {}
    for T in tokens_by_t:
        per_round = [max((per_rank[r][(rnd, T)] for r in range(R)), key=lambda v: v[0]) for rnd in range(rounds)]
        agg = aggregate_rounds([t for t, _ in per_round])
        result[T] = (agg, per_round[agg["median_round"]][1])
    return result


def capture_graphs(layer, tokens_by_t, stream):
    """{T: (torch.cuda.CUDAGraph, its tensors)} of `layer`'s forward (a moeflow.core.Layer of one rank, R = 1) on
    each T's tokens of rank 0, captured on `stream` (the rank's own, current) after one eager call
    of that T; each graph writes its own y (allocated before its capture: the graph's pool holds
    nothing of torch's). Replays re-run the captured forward on the same tensors (docs/API.md
    section 10: what a captured forward bakes in)."""
    graphs = {}
    for T, per_rank in tokens_by_t.items():
        x, ids, wts = per_rank[0]
        y = torch.empty_like(x)
        args = (_desc(x), _desc(ids), _desc(wts), _desc(y))
        layer.forward(*args, stream.cuda_stream)  # the eager call torch.cuda.graph wants first
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            layer.forward(*args, stream.cuda_stream)
        stream.synchronize()
        graphs[T] = (g, (x, ids, wts, y))  # the tensors live as long as the graph
    return graphs


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- the torch peer ------------------------------------------------------------------------------
def _rowwise_fp8(a):
    """a [M, N] -> (FP8 [M, N], fp32 scales [M]): one scale per row (torch's FP8 grouped GEMM)."""
    amax = a.abs().amax(dim=1).float().clamp(min=1e-4)
    scale = amax / 448.0
    return (a.float() / scale[:, None]).to(FP8), scale


class TorchPeer:
    """An unfused torch MoE layer over all E experts (module docstring). Its weights are its own:
    FP8 [E, N, K] codes with row-wise scales (for torch._scaled_grouped_mm), else BF16."""

    def __init__(self, E, H, I, fp8, device):
        self.E, self.H, self.I, self.fp8, self.device = E, H, I, fp8, device
        self.mode = None
        if fp8:
            self.w13, self.w2 = random_fp8((E, 2 * I, H), device, 7), random_fp8((E, H, I), device, 8)
            g = torch.Generator(device=device).manual_seed(9)
            self.sb13 = torch.rand((E, 2 * I), generator=g, device=device).add_(0.5).mul_(math.sqrt(3.0 / H))
            self.sb2 = torch.rand((E, H), generator=g, device=device).add_(0.5).mul_(math.sqrt(3.0 / I))
        else:
            w13, _, w2, _ = make_weights(E, H, I, False, device, seed=7)
            self.w13, self.w2 = w13, w2
        self.w13_bf16 = self.w2_bf16 = None

    def _bf16_weights(self):
        if self.w13_bf16 is None:
            if self.fp8:
                self.w13_bf16 = (self.w13.float() * self.sb13[:, :, None]).to(torch.bfloat16)
                self.w2_bf16 = (self.w2.float() * self.sb2[:, :, None]).to(torch.bfloat16)
            else:
                self.w13_bf16, self.w2_bf16 = self.w13, self.w2
        return self.w13_bf16, self.w2_bf16

    def route(self, x, ids, wts):
        """Rows sorted by expert: (rows [M, H], token of each row, its weight, offs [E] int32,
        counts list)."""
        K = ids.shape[1]
        flat = ids.reshape(-1).long()
        valid = (flat >= 0).nonzero().squeeze(1)
        order = valid[torch.argsort(flat[valid], stable=True)]
        tok = order // K
        counts = torch.bincount(flat[order], minlength=self.E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return x[tok], tok, wts.reshape(-1)[order], offs

    def _gemm(self, a, which, offs, mode):
        """One grouped GEMM: a [M, K] by every expert's `which` weight -> [M, N] bf16."""
        if mode == "scaled_grouped_mm":
            w, sb = (self.w13, self.sb13) if which == "w13" else (self.w2, self.sb2)
            aq, sa = _rowwise_fp8(a)
            return torch._scaled_grouped_mm(aq, w.transpose(-2, -1), sa, sb, offs=offs,
                                            out_dtype=torch.bfloat16)
        w13, w2 = self._bf16_weights()
        w = w13 if which == "w13" else w2
        if mode == "grouped_mm":
            return torch._grouped_mm(a.to(torch.bfloat16), w.transpose(-2, -1), offs=offs,
                                     out_dtype=torch.bfloat16)
        out = torch.empty(a.shape[0], w.shape[1], dtype=torch.bfloat16, device=a.device)
        bounds = [0] + offs.tolist()
        for e in range(self.E):
            if bounds[e + 1] > bounds[e]:
                out[bounds[e]:bounds[e + 1]] = a[bounds[e]:bounds[e + 1]].to(torch.bfloat16) @ w[e].T
        return out

    def forward(self, x, ids, wts, mode):
        rows, tok, w, offs = self.route(x, ids, wts)
        gu = self._gemm(rows, "w13", offs, mode)
        g, u = gu[:, :self.I], gu[:, self.I:]
        h = torch.nn.functional.silu(g) * u
        out = self._gemm(h, "w2", offs, mode)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        y.index_add_(0, tok, out.float() * w[:, None])
        return y.to(torch.bfloat16)

    def pick_mode(self, x, ids, wts):
        """The first of scaled_grouped_mm (FP8), grouped_mm, loop that runs here."""
        modes = (["scaled_grouped_mm"] if self.fp8 else []) + ["grouped_mm", "loop"]
        errors = []
        for m in modes:
            if m != "loop" and not hasattr(torch, "_" + m):
                continue
            try:
                self.forward(x, ids, wts, m)
                self.mode = m
                return m, errors
            except Exception as e:  # noqa: BLE001 - the next mode is tried, the refusal kept
                errors.append(f"{m}: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
        raise RuntimeError("; ".join(errors))

    def name(self):
        return {"scaled_grouped_mm": "torch_scaled_grouped_mm", "grouped_mm": "torch_grouped_mm",
                "loop": "torch_matmul_loop"}[self.mode] + ("_bf16" if self.fp8 and self.mode != "scaled_grouped_mm" else "")

    def time(self, timer, x, ids, wts):
        """{"layer": us, "w13": us, "w2": us} on this routing."""
        rows, _, _, offs = self.route(x, ids, wts)
        h = torch.randn(rows.shape[0], self.I, device=x.device).to(torch.bfloat16)
        return {"layer": timer.median_us(lambda: self.forward(x, ids, wts, self.mode)),
                "w13": timer.median_us(lambda: self._gemm(rows, "w13", offs, self.mode)),
                "w2": timer.median_us(lambda: self._gemm(h, "w2", offs, self.mode))}


# ---- one preset ----------------------------------------------------------------------------------
def bench_preset(name, spec, tokens, R, backend, device, iters, warmup, peers, ceil, log,
                 dataflows=("auto",), rounds=1, launch="eager", flush=True, c_rows=()):
    E, K, H, I, fp8 = spec
    if E % R:
        raise ValueError(f"{name}: E = {E} does not divide over {R} ranks")
    L = E // R
    cuda = device.type == "cuda"
    log(f"# {name}: E {E} K {K} H {H} I {I} {'fp8' if fp8 else 'bf16'} R {R}: weights ...")
    weights = make_weights(E, H, I, fp8, device)
    # the C record's routing where it carries one for this shape (the same experts, so the same floor)
    routing = {T: c_routing(c_rows, R, E, K, H, I, T) for T in tokens}
    tokens_by_t = {T: make_tokens(R, T, E, K, H, device, seed=1000 + T, routing=routing[T]) for T in tokens}
    comms = virtual_comms(R, backend)
    try:
        timed = {df: time_moeflow(comms, spec, weights, tokens_by_t, iters, warmup, df, rounds, launch=launch,
                                  flush=flush) for df in dataflows}
    finally:
        comms[0].group.close()
    del weights
    peer, peer_err = None, None
    if peers:
        try:
            peer = TorchPeer(E, H, I, fp8, device)
            x0, i0, w0 = _all_tokens(tokens_by_t[tokens[0]])
            _, refusals = peer.pick_mode(x0, i0, w0)
            for r in refusals:
                log(f"# {name}: torch peer: {r}")
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            peer, peer_err = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log(f"# {name}: torch peer unavailable: {peer_err}")
    timer = Timer(device, iters, warmup, flush)
    # the torch peer in rounds too: the whole sweep per round (schedule()), then each op's rounds
    peer_rounds = {T: {} for T in tokens}
    if peer is not None:
        for _, T in schedule(tokens, rounds):
            if "error" in peer_rounds[T]:
                continue
            try:
                for op, us in peer.time(timer, *_all_tokens(tokens_by_t[T])).items():
                    peer_rounds[T].setdefault(op, []).append(us)
            except Exception as e:  # noqa: BLE001
                peer_rounds[T] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    S = max(tokens) if max(tokens) > 0 else 1  # one layer per rank over the sweep (time_moeflow)
    rows_out = []
    for T in tokens:
        x, ids, wts = _all_tokens(tokens_by_t[T])
        flat = ids.reshape(-1)
        nrows = int((flat >= 0).sum())
        used = int(torch.unique(flat[flat >= 0]).numel())
        cnt = counts(R, T, H, I, nrows, used, fp8)
        pt = None
        if peer is not None:
            pr = peer_rounds[T]
            pt = dict(pr) if "error" in pr else {op: aggregate_rounds(v) for op, v in pr.items()}
        shape = {"R": R, "E": E, "K": K, "H": H, "I": I, "T": T, "L": L, "M": nrows, "S": S}
        for n_df, df in enumerate(dataflows):
            agg, phases = timed[df][T]
            t_us = agg["median_us"]
            # the first dataflow's rows carry the GEMM phases and the peers; the others the layer
            if n_df == 0:
                ops = (("layer", t_us), ("w13", phases["w13"]), ("w2", phases["w2"]))
            else:
                ops = (("layer_unfused" if df == "unfused" else "layer", t_us),)
            for op, us in ops:
                row = _row(op, us, name, df, fp8, shape, cnt["layer" if op == "layer_unfused" else op],
                           ceil if cuda else None, iters, warmup)
                # the layer rows as timed; the phases (w13, w2) always from the eager profiled twin
                row["launch"] = launch if op in ("layer", "layer_unfused") else "eager"
                row["gated"] = int(row["launch"] == "graph")  # held replays (HOLD_CYCLES), as the CLI's
                row["l2_flush"] = cuda and flush
                row["routing"] = "c_record" if routing[T] is not None else "own"
                if op in ("layer", "layer_unfused"):
                    row.update(round_fields(agg))  # the rounds (module docstring)
                    row["phases_us"] = {k: round(v, 3) for k, v in phases.items()}
                if n_df == 0:
                    row["peers"] = _peers_of(op, peer, pt, peer_err)
                rows_out.append(row)
            peer_s = f"{pt['layer']['median_us']:10.1f}" if n_df == 0 and pt and "layer" in pt else f"{'-':>10}"
            fl_s = f"{floor_us(*cnt['layer'], fp8, ceil):10.1f}" if cuda else f"{'-':>10}"
            print(f" {name:<16} {df:>8} {R:>2} {T:>6} {nrows:>8} {t_us:10.1f} {phases['w13']:9.1f} "
                  f"{phases['w2']:9.1f} {peer_s} {fl_s} {agg['min_us']:10.1f} {agg['max_us']:10.1f} "
                  f"{spread_cell(agg):>8}", flush=True)
    del peer
    if cuda:
        torch.cuda.empty_cache()
    return rows_out


def _row(op, us, preset, dataflow, fp8, shape, flops_bytes, ceil, iters, warmup):
    """One DESIGN.md record row (floor only with ceilings, i.e. on CUDA)."""
    flops, nbytes = flops_bytes
    row = {"op": op, "preset": preset, "dataflow": dataflow, "dtype": "fp8" if fp8 else "bf16",
           "layout": "expert_major", "shape": dict(shape), "time_us": round(us, 3),
           "tflops": flops / us / 1e6 if us > 0 else None, "gbps": nbytes / us / 1e3 if us > 0 else None}
    if ceil is not None:
        fl = floor_us(flops, nbytes, fp8, ceil)
        row["floor_us"] = round(fl, 3)
        row["pct_of_floor"] = round(100.0 * fl / us, 2) if us > 0 else None
    row["iters"], row["warmup"], row["peers"] = iters, warmup, []
    return row


def _peers_of(op, peer, pt, peer_err):
    """The peers entry of a row: the torch peer's time for this op, or why there is none."""
    if pt is not None and "error" in pt:
        return [{"name": peer.name(), "error": pt["error"]}]
    if pt is not None:
        pname = peer.name() if op != "layer" else "torch_unfused_" + peer.name().removeprefix("torch_")
        return [{"name": pname, "time_us": pt[op]["median_us"], "launch": "eager", **round_fields(pt[op])}]
    if peer_err:
        return [{"name": "torch", "error": peer_err}]
    return []


def _all_tokens(per_rank):
    """Every rank's tokens as one problem (the peer runs the whole layer on one device)."""
    xs, ids, ws = zip(*per_rank)
    return torch.cat(xs), torch.cat(ids), torch.cat(ws)


# ---- records -------------------------------------------------------------------------------------
def git_commit():
    env = os.environ.get("MF_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def now_utc():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_records(paths):
    """[(path, record)] of the JSON records among `paths` (globs allowed)."""
    out = []
    for p in paths:
        for f in sorted(glob.glob(p)) or [p]:
            if f.endswith(".json"):
                with open(f) as fh:
                    out.append((f, json.load(fh)))
    return out


def preset_of(shape):
    for name, (E, K, H, I, _) in PRESETS.items():
        if (shape.get("E"), shape.get("H"), shape.get("I")) == (E, H, I):
            return name
    return f"E{shape.get('E')}_H{shape.get('H')}_I{shape.get('I')}"


# ---- the C bench's numbers beside these (issue 25.4) -----------------------------------------------
C_TOLERANCE_US = 2.0  # issue 25.4: Python's small-batch numbers within 2 us of the C bench's
_C_MATCH_SHAPE = ("R", "E", "K", "H", "I", "T")


def load_c_rows(paths):
    """[(path, row)]: the layer rows ("layer", "layer_unfused") with a time of the
    `moeflow bench ... --json` records among `paths` (globs allowed)."""
    return [(path, row) for path, rec in load_records(paths) for row in rec.get("rows", [])
            if row.get("op") in ("layer", "layer_unfused") and row.get("time_us") is not None]


def c_routing(c_rows, R, E, K, H, I, T):
    """The routing of a C layer row of shape (R, E, K, H, I, T) that carries one ("topk_ids",
    `moeflow bench --json` writes it for small problems): a list of R int32 [T, K] tensors, or None."""
    want = {"R": R, "E": E, "K": K, "H": H, "I": I, "T": T}
    for _, c in c_rows:
        ids = c.get("topk_ids")
        if ids is not None and all(c.get("shape", {}).get(k) == v for k, v in want.items()):
            return [torch.tensor(r, dtype=torch.int32).reshape(T, K) for r in ids]
    return None


def match_c_row(c_rows, row):
    """The (path, row) of `c_rows` that times what `row` (a Python record's row) times: the same
    op, dtype, dataflow, layout and shape R, E, K, H, I, T; among several, the one nearest a graph
    replay: gated first, then without phase events (phase_events 0: one event before and one after
    the forward, as here), then the same capacity S. None when no row matches."""
    S = row["shape"].get("S")
    cands = [(p, c) for p, c in c_rows
             if c["op"] == row["op"] and c.get("dtype") == row.get("dtype")
             and c.get("dataflow", "auto") == row.get("dataflow", "auto")
             and c.get("layout", "expert_major") == row.get("layout", "expert_major")
             and all(c.get("shape", {}).get(k) == row["shape"].get(k) for k in _C_MATCH_SHAPE)]
    if not cands:
        return None
    return min(cands, key=lambda pc: (pc[1].get("gated", 0) != 1, pc[1].get("phase_events", 1) != 0,
                                      pc[1]["shape"].get("S") != S))


def c_entry(row, match, tol=C_TOLERANCE_US):
    """A row's "c" field: the matched C row (match_c_row) and diff_us = this row's time_us minus
    the C row's; within_tol: |diff_us| <= tol (issue 25.4's 2 us)."""
    path, c = match
    diff = row["time_us"] - c["time_us"]
    return {"record": os.path.basename(path), "time_us": c["time_us"], "gated": c.get("gated"),
            "phase_events": c.get("phase_events"), "S": c.get("shape", {}).get("S"),
            "spread": c.get("spread"), "diff_us": round(diff, 3), "within_tol": abs(diff) <= tol,
            "tol_us": tol, "same_routing": row.get("routing") == "c_record" and c.get("topk_ids") is not None}


def attach_c(rows, c_rows, tol=C_TOLERANCE_US):
    """Adds "c" (c_entry) to every layer row of `rows` that a C row matches; returns how many."""
    n = 0
    for row in rows:
        if row.get("op") in ("layer", "layer_unfused") and row.get("time_us") is not None:
            m = match_c_row(c_rows, row)
            if m is not None:
                row["c"] = c_entry(row, m, tol)
                n += 1
    return n


def c_cells(row):
    """The console's C columns of a row: (C us, diff us, ok), '-' without a match."""
    c = row.get("c")
    if c is None:
        return f"{'-':>9}", f"{'-':>8}", f"{'-':>4}"
    return (f"{c['time_us']:9.1f}", f"{c['diff_us']:+8.1f}", f"{'yes' if c['within_tol'] else 'NO':>4}")


def print_c_table(rows, out=None):
    """The layer rows beside their C rows (attach_c): fixed columns, `#` header lines."""
    out = out or sys.stdout
    print(f"#\n# vs C     time_us - the C row's (gated, phase events off preferred); ok: within "
          f"{C_TOLERANCE_US:g} us", file=out)
    print(f"#{'preset':<16} {'op':>13} {'launch':>6} {'T':>6} {'python':>9} {'C':>9} {'diff':>8} {'ok':>4} "
          f"{'C S':>6} {'C ev':>4} {'routing':>8}", file=out)
    for r in rows:
        if r.get("op") not in ("layer", "layer_unfused"):
            continue
        c = r.get("c") or {}
        cu, d, ok = c_cells(r)
        print(f" {r.get('preset') or preset_of(r['shape']):<16} {r['op']:>13} {r.get('launch', '-'):>6} "
              f"{r['shape']['T']:>6} {r['time_us']:9.1f} {cu} {d} {ok} {str(c.get('S', '-')):>6} "
              f"{str(c.get('phase_events', '-')):>4} "
              f"{'-' if not c else 'same' if c.get('same_routing') else 'differs':>8}", file=out)


# ---- plots ---------------------------------------------------------------------------------------
def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def _peer_time(row, prefix="torch"):
    for p in row.get("peers", []):
        if p.get("name", "").startswith(prefix) and "time_us" in p:
            return p["time_us"]
    return None


_COLORS = {"moeflow": "C0", "moeflow unfused": "C1", "torch (unfused)": "C3", "floor": "k"}


def _style(label, styles):
    """One color per label across every panel of a figure; the floor dotted."""
    if label not in styles:
        styles[label] = _COLORS.get(label, f"C{4 + len(styles)}")
    if label == "floor":
        return dict(color="k", ls=":", marker=None)
    return dict(color=styles[label], ls="--" if label.startswith("torch") else "-",
                marker="x" if label.startswith("torch") else "o")


def _log2_x(ax):
    """Log-2 x axis labelled with plain numbers (1, 8, 32, ...)."""
    from matplotlib.ticker import FuncFormatter
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def plot_layer_series(series, path, title):
    """series: {preset: {label: [(T, time_us)], "floor": [(T, us)]}} -> one PNG: a row per preset,
    time against T (log-log) and time over the floor against T. Returns path, or None without
    matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    presets = list(series)
    has_floor = any(s.get("floor") for s in series.values())
    ncols = 2 if has_floor else 1
    fig, axes = plt.subplots(len(presets), ncols, figsize=(6.2 * ncols, 3.3 * len(presets)), squeeze=False)
    styles = {}
    for i, preset in enumerate(presets):
        s = series[preset]
        ax = axes[i][0]
        for label, pts in s.items():
            if not pts:
                continue
            pts = sorted(pts)
            st = _style(label, styles)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, ms=4, **st)
        _log2_x(ax)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens per rank)")
        ax.set_ylabel("time (us)")
        ax.set_title(f"{preset}: time")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        if has_floor:
            ax2 = axes[i][1]
            floor = dict(s.get("floor", []))
            for label, pts in s.items():
                if label == "floor" or not pts:
                    continue
                r = sorted((T, us / floor[T]) for T, us in pts if floor.get(T))
                if r:
                    ax2.plot([p[0] for p in r], [p[1] for p in r], label=label, ms=4, **_style(label, styles))
            ax2.axhline(1.0, color="k", ls=":", lw=1)
            _log2_x(ax2)
            ax2.set_xlabel("T (tokens per rank)")
            ax2.set_ylabel("time / floor")
            ax2.set_title(f"{preset}: against the floor (1 = floor)")
            ax2.grid(True, which="both", alpha=0.3)
            ax2.legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 75 * ncols), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def layer_series(rows):
    """{preset: {label: [(T, us)]}} of a bench's rows or a record's: op "layer" (moeflow, its
    dataflow), "layer_unfused", their torch peers, and the floor."""
    series = {}
    for r in rows:
        if r.get("op") not in ("layer", "layer_unfused") or r.get("time_us") is None:
            continue
        s = r["shape"]
        preset = r.get("preset") or preset_of(s)
        d = series.setdefault(preset, {})
        label = "moeflow unfused" if r["op"] == "layer_unfused" else (
            "moeflow" if r.get("dataflow", "auto") == "auto" else f"moeflow {r['dataflow']}")
        d.setdefault(label, []).append((s["T"], r["time_us"]))
        pt = _peer_time(r)
        if pt is not None:
            d.setdefault("torch (unfused)", []).append((s["T"], pt))
        if r.get("floor_us") and r["op"] == "layer":
            d.setdefault("floor", []).append((s["T"], r["floor_us"]))
    return series


def plot_gemm_record(rows, path, title):
    """A `moeflow bench gemm` + bench/peers.py record: time / floor against rows per expert M,
    moeflow (solid) and torch (dashed) per model and L, a panel per (op, dtype)."""
    plt = _pyplot()
    if plt is None:
        return None
    rows = [r for r in rows if r.get("op") == "gemm" and r.get("floor_us") and r.get("time_us")
            and r.get("layout", "expert_major") == "expert_major"]
    if not rows:
        return None
    ops = sorted({r["kernel"] for r in rows})
    dts = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(len(ops), len(dts), figsize=(6.2 * len(dts), 3.6 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        for j, dt in enumerate(dts):
            ax = axes[i][j]
            groups = {}
            for r in rows:
                if r["kernel"] == op and r["dtype"] == dt:
                    c = r.get("counts", "equal")
                    model = r.get("model", preset_of(r["shape"])) + ("" if c == "equal" else f" {c}")
                    groups.setdefault((model, r["shape"]["L"]), []).append(r)
            for n, ((model, L), rs) in enumerate(sorted(groups.items())):
                rs.sort(key=lambda r: r["shape"]["M"])
                color = f"C{n}"
                ax.plot([r["shape"]["M"] for r in rs], [r["time_us"] / r["floor_us"] for r in rs],
                        marker="o", ms=4, color=color, label=f"moeflow {model} L={L}")
                tp = [(r["shape"]["M"], _peer_time(r, "torch")) for r in rs]
                tp = [(m, t / r["floor_us"]) for (m, t), r in zip(tp, rs) if t]
                if tp:
                    ax.plot([p[0] for p in tp], [p[1] for p in tp], marker="x", ms=4, ls="--", color=color,
                            label=f"torch {model} L={L}")
            ax.axhline(1.0, color="k", ls=":", lw=1)
            _log2_x(ax)
            ax.set_xlabel("M (rows per expert)")
            ax.set_ylabel("time / floor")
            ax.set_title(f"{'W13+SwiGLU' if op == 'w13_swiglu' else op.upper()} {dt}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_records(paths, out_dir, prefix="h200"):
    """PNGs of existing records (bench/results/<card>/*.json): layer records (one PNG per R and
    record kind: fused, unfused and floor per preset) and GEMM records with peers. Returns the
    PNG paths written (empty without matplotlib)."""
    if _pyplot() is None:
        print("# moeflow.bench: matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    os.makedirs(out_dir, exist_ok=True)
    written = []
    layer_rows = {}   # (R, tag) -> rows
    sources = {}
    for path, rec in load_records(paths):
        rows = rec.get("rows", [])
        base = os.path.basename(path)
        if any(r.get("op") == "gemm" for r in rows):
            name = re.sub(r"^\d{4}-\d{2}-\d{2}_", "", base[:-5])
            out = os.path.join(out_dir, f"{prefix}_{name}.png")
            m = rec.get("meta", {})
            if plot_gemm_record(rows, out, f"{base}: grouped GEMMs against the floor "
                                f"(moeflow solid, torch dashed; {m.get('card', '')} {m.get('commit', '')})"):
                written.append(out)
            continue
        layers = [r for r in rows if r.get("op") in ("layer", "layer_unfused")]
        if not layers:
            continue
        R = layers[0]["shape"]["R"]
        m = re.search(r"_R\d+_(\w+?)_[0-9a-f]{7}\.json$", base)
        tag = m.group(1) if m else "layer"
        key = (R, tag, rec.get("meta", {}).get("commit", ""))
        layer_rows.setdefault(key, []).extend(layers)
        sources.setdefault(key, []).append(base)
    for (R, tag, commit), rows in sorted(layer_rows.items()):
        out = os.path.join(out_dir, f"{prefix}_layer_R{R}_{tag}_{commit}.png")
        title = (f"moeflow layer on one {prefix.upper()}, R = {R}, records {tag} @ {commit} "
                 f"({len(sources[(R, tag, commit)])} files: bench/results/{prefix}/*_R{R}_{tag}_{commit}.json)")
        if plot_layer_series(layer_series(rows), out, title):
            written.append(out)
    return written


# ---- main ----------------------------------------------------------------------------------------
def parse_list(s, kind=str):
    return [kind(v) for v in s.split(",") if v.strip()]


LAUNCHES = ("auto", "graph", "eager")


def resolve_launch(launch, backend, R):
    """--launch -> "graph" or "eager". auto: graph on CUDA with R = 1 (an engine's decode step is a
    graph replay), else eager (the CPU has no graphs; virtual ranks' threads are not captured
    here); graph elsewhere: ValueError."""
    if launch not in LAUNCHES:
        raise ValueError(f"--launch: one of {', '.join(LAUNCHES)}, not {launch!r}")
    if launch == "auto":
        return "graph" if backend == "cuda" and R == 1 else "eager"
    if launch == "graph" and backend != "cuda":
        raise ValueError("--launch graph needs the CUDA backend (the CPU backend has no graphs)")
    if launch == "graph" and R != 1:
        raise ValueError(f"--launch graph is for R = 1 (got R = {R}): virtual ranks run eager "
                         f"(--launch eager or auto)")
    return launch


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m moeflow.bench",
                                 description="Time moeflow's layer and GEMMs beside a torch peer; "
                                             "JSON records and PNG plots.")
    ap.add_argument("--presets", help=f"comma list of {', '.join(PRESETS)} (default: {DEFAULT_PRESETS}; "
                                      "tiny on a CPU)")
    ap.add_argument("--tokens", help=f"T per rank, comma list (default {DEFAULT_TOKENS}; {SMOKE_TOKENS} on a CPU)")
    ap.add_argument("--dtype", choices=["fp8", "bf16", "preset"], default="preset",
                    help="weights and payload (default: the dtype the model ships)")
    ap.add_argument("-R", "--ranks", type=int, default=1, help="virtual ranks on this device (default 1)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dataflow", default="auto",
                    help="comma list of auto, direct, pull, unfused (docs/API.md section 5); the first "
                         "gives the GEMM rows and the peers (default auto)")
    ap.add_argument("--iters", type=int, help="timed iterations (default 10 CUDA, 3 CPU)")
    ap.add_argument("--warmup", type=int, help="untimed iterations first (default 2 CUDA, 1 CPU)")
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                    help=f"run the whole T sweep this many times, one round after the other; rows report "
                         f"the median round, min / max and flag a spread above {100 * SPREAD_FLAG:.0f}%% "
                         f"(default {DEFAULT_ROUNDS})")
    ap.add_argument("--launch", default="auto", choices=LAUNCHES,
                    help="graph: each T's forward captured once into a CUDA graph and the replays timed "
                         "(CUDA, R = 1); eager: a call per iteration (host launch gaps included); auto "
                         "(default): graph on CUDA at R = 1, else eager")
    ap.add_argument("--flush", default="on", choices=["on", "off"],
                    help="CUDA: a 512 MB fill before each iteration, outside the events (on, the default: "
                         "L2 flushed); off: none, as `moeflow bench`")
    ap.add_argument("--c-record", nargs="+", metavar="JSON",
                    help=f"`moeflow bench --json` records (globs): each layer row beside the C row of the "
                         f"same shape (gated, no phase events, same S preferred), the difference and "
                         f"whether it is within {C_TOLERANCE_US:g} us (the record's \"c\")")
    ap.add_argument("--out", default="bench_out", help="directory for records and plots")
    ap.add_argument("--no-peers", action="store_true", help="moeflow only")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--smoke", action="store_true", help=f"--presets tiny --tokens {SMOKE_TOKENS} --iters 2 "
                                                         "--warmup 1 (seconds on a CPU)")
    ap.add_argument("--plot-records", nargs="+", metavar="JSON",
                    help="only draw these existing records (globs) into --out, then exit")
    ap.add_argument("--prefix", default="h200", help="--plot-records: PNG name prefix (the card)")
    a = ap.parse_args(argv)

    if a.plot_records:
        written = plot_records(a.plot_records, a.out, a.prefix)
        for w in written:
            print(f"# plot: {w}")
        return 0

    backend = resolve_backend(a.backend)
    cuda = backend == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if a.smoke:
        a.presets, a.tokens = a.presets or "tiny", a.tokens or SMOKE_TOKENS
        a.iters, a.warmup = a.iters or 2, a.warmup if a.warmup is not None else 1
    presets = parse_list(a.presets or (DEFAULT_PRESETS if cuda else "tiny"))
    tokens = parse_list(a.tokens or (DEFAULT_TOKENS if cuda else SMOKE_TOKENS), int)
    iters = a.iters or (10 if cuda else 3)
    warmup = a.warmup if a.warmup is not None else (2 if cuda else 1)
    dataflows = parse_list(a.dataflow)
    for df in dataflows:
        if df not in _lib.DATAFLOW:
            ap.error(f"--dataflow: unknown '{df}' ({', '.join(_lib.DATAFLOW)})")
    for p in presets:
        if p not in PRESETS:
            ap.error(f"--presets: unknown '{p}' ({', '.join(PRESETS)})")
    if iters < 1 or warmup < 0 or a.ranks < 1 or not tokens or min(tokens) < 0 or a.rounds < 1:
        ap.error("--iters >= 1, --warmup >= 0, --ranks >= 1, --rounds >= 1 and T >= 0 are required")
    try:
        launch = resolve_launch(a.launch, backend, a.ranks)
    except ValueError as e:
        ap.error(str(e))
    flush = a.flush == "on"
    c_rows = load_c_rows(a.c_record) if a.c_record else []
    if a.c_record and not c_rows:
        ap.error(f"--c-record: no layer rows in {' '.join(a.c_record)}")
    os.makedirs(a.out, exist_ok=True)
    ceil = ceilings()
    commit, date = git_commit(), now_utc()
    card = os.environ.get("MF_CARD", "h200") if cuda else "cpu"
    dev_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    print(f"# moeflow.bench: {backend} ({dev_name}), torch {torch.__version__}, commit {commit}, R {a.ranks}; "
          f"median of {iters} after {warmup}; "
          f"{('CUDA events, ' + ('512 MB fill before each' if flush else 'no L2 flush')) if cuda else 'wall clock'}; "
          f"{a.rounds} rounds over the sweep (median round, min, max; spread (max - min) / median > "
          f"{100 * SPREAD_FLAG:.0f}% marked !)")
    if cuda:
        print(f"# floor    max(FLOPs / peak, bytes / {ceil[0] / 1e12:.2f} TB/s), peak {ceil[1] / 1e12:.0f} (bf16) / "
              f"{ceil[2] / 1e12:.0f} (fp8) TFLOP/s (tools/bench.h)")
    else:
        print("# floor    - (no CPU ceiling is defined)")
    print(f"# launch   {launch}: " + ("each T's forward captured once into a CUDA graph, replays timed "
                                      "(phases w13 / w2 and the torch peer: eager)" if launch == "graph" else
                                      "a call per iteration, host launch gaps included"))
    print(f"#{'preset':<16} {'dataflow':>8} {'R':>2} {'T':>6} {'rows':>8} {'moeflow':>10} {'w13':>9} {'w2':>9} "
          f"{'torch':>10} {'floor':>10} {'min':>10} {'max':>10} {'spread':>8}")
    print(f"#{'':<16} {'':>8} {'':>2} {'':>6} {'':>8} {'(us)':>10} {'(us)':>9} {'(us)':>9} {'(us)':>10} {'(us)':>10} "
          f"{'(us)':>10} {'(us)':>10} {'':>8}")
    all_rows, written = [], []
    for name in presets:
        E, K, H, I, dt = PRESETS[name]
        dt = dt if a.dtype == "preset" else a.dtype
        rows = bench_preset(name, (E, K, H, I, dt == "fp8"), tokens, a.ranks, backend, device, iters, warmup,
                            not a.no_peers, ceil, log, dataflows, a.rounds, launch, flush, c_rows)
        attach_c(rows, c_rows)
        all_rows.extend(rows)
        rec = {"meta": {"card": card, "date": date, "commit": commit,
                        "command": "python3 -m moeflow.bench " + " ".join(sys.argv[1:] if argv is None else argv),
                        "backend": backend, "torch": torch.__version__, "device": dev_name},
               "rows": rows}
        path = os.path.join(a.out, f"{date[:10]}_pybench_{name}_R{a.ranks}_{dt}_{commit}.json")
        with open(path, "w") as f:
            json.dump(rec, f, indent=1)
        written.append(path)
        print(f"# record: {path}", flush=True)
    if c_rows:
        print_c_table(all_rows)
    if not a.no_plots:
        by_dtype = {}
        for r in all_rows:
            by_dtype.setdefault(r["dtype"], []).append(r)
        if _pyplot() is None:
            print("# moeflow.bench: matplotlib is not installed: JSON records only (pip install matplotlib)")
        else:
            for dt, rows in by_dtype.items():
                png = os.path.join(a.out, f"pybench_{dt}_R{a.ranks}.png")
                plot_layer_series(layer_series(rows), png,
                                  f"python -m moeflow.bench: {dev_name}, {dt}, R = {a.ranks}, commit {commit} "
                                  f"(moeflow layer vs unfused torch peer)")
                print(f"# plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
