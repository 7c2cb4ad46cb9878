"""bench/vllm_graph.py — moeflow's vLLM-facing kernel under a captured CUDA graph, beside the C bench.

Issue 25.4: "the vLLM-facing classes under a captured CUDA graph reach the C numbers within 2 us".
For each preset and T this builds what vLLM would run for one MoE layer on one EP rank (R = 1):
moeflow.vllm.make_kernel(FusedMoEConfig, FP8 block quant config, comm) -> a FusedMoEKernel whose
apply(x, w13, w2, topk_weights, topk_ids, SILU, E, None, False) runs the whole layer (mode
"layer": MoeflowPassThroughPrepareAndFinalize + MoeflowLayerExperts -> mf_moe_forward; mode
"dispatch": MoeflowPrepareAndFinalize + MoeflowExperts, MASKED), captures that call once per T into a
torch.cuda.CUDAGraph, as vLLM captures its decode steps, and times the replays.

    PYTHONPATH=python python3 bench/vllm_graph.py [--presets deepseek-v3,qwen3-235b-a22b]
        [--tokens 1,2,4,8] [--mode layer|dispatch] [--c-record C.json ...] [--out DIR]
    PYTHONPATH=python python3 bench/vllm_graph.py --smoke --backend cpu   # the tiny shape, eager

vLLM: the real one where it is importable; else (the H200 machine, which cannot install it)
tests/python/vllm_double.py, the test double of the vLLM calls moeflow.vllm makes, which CI checks
against vLLM 0.33 (test_vllm.py::test_double_matches_vllm); --double forces the double. The record's
meta.vllm says which ran.

Timing, as `python -m moeflow.bench` (moeflow.bench.Timer, schedule, aggregate_rounds): CUDA
events around each replay on the current stream, held (a spin kernel of moeflow.bench.HOLD_CYCLES
ahead of the begin event, so the replay is enqueued before the begin event fires: its device time
without the launch latency, as `moeflow bench --gated`; "gated": 1 in the rows), median of --iters after --warmup, --rounds times
over the whole T sweep (median round, min / max, spread; 5 % flagged), no L2 flush by default (as
`moeflow bench`, the numbers this is compared with; --flush on: a 512 MB fill before each replay,
outside the events). On the CPU there are no graphs: eager calls, wall clock (the smoke path).
Weights: moeflow.bench.make_weights on the device (random E4M3 codes, no fp32 temporary: deepseek-v3's
11.3 GB in well under a second on an H200); inputs: make_tokens (uniform distinct top-K, seed 1000 + T,
the same draw as moeflow.bench; with --c-record the C row's routing where its record carries it). S = the largest T (the C bench's default). Each T is checked
before it is timed: the first replay equals an eager apply bit for bit, and with --check (--smoke's
default; small shapes only) y meets moeflow.reference's fp64 layer.

--c-record takes `moeflow bench --json` records: each row beside the C row of the same shape
(op, dtype, dataflow, layout, R, E, K, H, I, T; gated, phase events off and the same S preferred:
moeflow.bench.match_c_row), the difference in us and whether it is within 2 us. Output: a table
(`#` header lines, fixed columns) and one record `<date>_vllm_graph_<mode>_R1_<commit>.json` under
--out in docs/DESIGN.md's schema, rows op "layer" with "launch", "l2_flush", "interface",
"replay_equals_eager", the rounds' fields and "c" where a C row matched.
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOUBLE_PATH = ROOT / "tests" / "python" / "vllm_double.py"
DEFAULT_PRESETS = "deepseek-v3,qwen3-235b-a22b"
DEFAULT_TOKENS = "1,2,4,8"
SMOKE_TOKENS = "1,3"

# virtual ranks on one GPU need both before the process first uses CUDA (docs/API.md section 10)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # a real vLLM on a CPU machine (CI)

import torch  # noqa: E402

from moeflow import bench  # noqa: E402
from moeflow.core import resolve_backend  # noqa: E402
from moeflow.torch import virtual_comms  # noqa: E402


def load_vllm(force_double):
    """(the vllm module, True when it is the test double): vLLM where importable (unless
    force_double), else tests/python/vllm_double.py installed as `vllm`. Before moeflow.vllm."""
    spec = importlib.util.spec_from_file_location("vllm_double", DOUBLE_PATH)
    double = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(double)
    if force_double:
        sys.modules["vllm"] = None  # `import vllm` fails, so install() registers the double
    vllm = double.install()
    return vllm, vllm.__version__.endswith("(moeflow test double)")


def vllm_configs(E, K, H, I, S, fp8, w13_scale, w2_scale, is_double, device):
    """(FusedMoEConfig, FusedMoEQuantConfig) of one MoE layer on EP rank 0 of 1: SiLU gate-and-up,
    bf16 input, FP8 128 x 128 weight blocks with dynamic 1 x 128 activations (or unquantised)."""
    from vllm.model_executor.layers.fused_moe import config as vcfg
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    if is_double:
        mc = vcfg.FusedMoEConfig(E, K, H, I, S, vcfg.FusedMoEParallelConfig(1, 1, 0))
    else:  # vLLM 0.33's own (tests/python/test_vllm.py moe_config, R = 1)
        pc = vcfg.FusedMoEParallelConfig(tp_size=1, tp_rank=0, pcp_size=1, pcp_rank=0, dp_size=1,
                                         dp_rank=0, ep_size=1, ep_rank=0, sp_size=1, use_ep=True,
                                         all2all_backend="allgather_reducescatter",
                                         enable_eplb=False)
        mc = vcfg.FusedMoEConfig(num_experts=E, experts_per_token=K, hidden_dim=H,
                                 intermediate_size=I, num_local_experts=E, num_logical_experts=E,
                                 activation=MoEActivation.SILU, device=device.type,
                                 routing_method=vcfg.RoutingMethodType.TopK, moe_parallel_config=pc,
                                 in_dtype=torch.bfloat16, max_num_tokens=S)
    if not fp8:
        return mc, vcfg.FusedMoEQuantConfig.make()
    return mc, vcfg.fp8_w8a8_moe_quant_config(w13_scale, w2_scale, block_shape=[128, 128])


def capture(step, args):
    """(graph, its output): `step(*args)` once eagerly on a side stream (as torch.cuda.graph
    wants; tests/python/test_vllm_cuda.py does the same), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step(*args)
    torch.cuda.synchronize()
    return graph, y


def bench_preset(name, tokens, device, mode, is_double, timer, rounds, check, ceil, log, c_rows=()):
    """Rows (moeflow.bench's record rows, op "layer") of one preset at R = 1: the kernel built
    once (S = max T), per T a graph captured (CUDA) and checked, then `rounds` rounds over the
    sweep (moeflow.bench.schedule) of timer.samples(replay) (eager apply on the CPU)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from moeflow import vllm as mv

    E, K, H, I, dt = bench.PRESETS[name]
    fp8 = dt == "fp8"
    cuda = device.type == "cuda"
    S = max(max(tokens), 1)
    log(f"# {name}: E {E} K {K} H {H} I {I} {dt} S {S}: weights ...")
    w13, s13, w2, s2 = bench.make_weights(E, H, I, fp8, device)
    mc, qc = vllm_configs(E, K, H, I, S, fp8, s13, s2, is_double, device)
    comms = virtual_comms(1, "cuda" if cuda else "cpu")
    kernel = mv.make_kernel(mc, qc, comms[0], mode=mode)
    try:
        def step(x, ids, wts):
            return kernel.apply(x, w13, w2, wts, ids, MoEActivation.SILU, E, None, False)

        cases = {}
        for T in tokens:  # capture and check every T before any is timed
            routing = bench.c_routing(c_rows, 1, E, K, H, I, T)  # the C row's experts where it has them
            x, ids, wts = bench.make_tokens(1, T, E, K, H, device, seed=1000 + T, routing=routing)[0]
            args = (x, ids, wts)
            if cuda:
                graph, y = capture(step, args)
                graph.replay()
                run = graph.replay
            else:
                y, graph, run = step(*args), None, (lambda a=args: step(*a))
            eager = step(*args)
            if cuda:
                torch.cuda.synchronize()
            same = bool(torch.equal(y, eager))
            if not same:
                raise RuntimeError(f"{name} T = {T}: the replay differs from an eager apply")
            if check:
                from moeflow import reference as ref
                want = ref.reference_moe(x.cpu(), ids.cpu(), wts.cpu(), w13.cpu(),
                                         None if s13 is None else s13.cpu(), w2.cpu(),
                                         None if s2 is None else s2.cpu())
                ref.assert_close(y, want, bench.FP8 if fp8 else torch.bfloat16, oracle=False)
            cases[T] = (graph, run, args, y, same, routing is not None)
        per_t = {T: [] for T in tokens}
        for _, T in bench.schedule(tokens, rounds):
            per_t[T].append(statistics.median(timer.samples(cases[T][1])))
        rows = []
        for T in tokens:
            agg = bench.aggregate_rounds(per_t[T])
            ids = cases[T][2][1]
            nrows = int((ids >= 0).sum())
            used = int(torch.unique(ids[ids >= 0]).numel())
            shape = {"R": 1, "E": E, "K": K, "H": H, "I": I, "T": T, "L": E, "M": nrows, "S": S}
            row = bench._row("layer", agg["median_us"], name, "auto", fp8, shape,
                             bench.counts(1, T, H, I, nrows, used, fp8)["layer"],
                             ceil if cuda else None, timer.iters, timer.warmup)
            row["layout"] = "masked" if mode == "dispatch" else "expert_major"
            row.update(bench.round_fields(agg))
            row["routing"] = "c_record" if cases[T][5] else "own"
            row.update({"launch": "graph" if cuda else "eager", "gated": int(timer.hold),
                        "l2_flush": timer.flush is not None,
                        "interface": f"vllm_kernel_{mode}", "replay_equals_eager": cases[T][4],
                        "checked_reference": bool(check)})
            rows.append(row)
        return rows
    finally:
        if cuda:
            torch.cuda.synchronize()
        cases = None
        kernel.moeflow_layer.close()
        comms[0].group.close()


def print_rows(rows, out=None):
    """The table: T | python graph us | C us | diff | ok | min | max | spread."""
    out = out or sys.stdout
    for r in rows:
        cu, d, ok = bench.c_cells(r)
        print(f" {r['preset']:<16} {r['launch']:>6} {r['shape']['T']:>5} {r['time_us']:10.1f} {cu} {d} {ok} "
              f"{r['min_us']:9.1f} {r['max_us']:9.1f} {bench.spread_cell(r):>7}", file=out, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench/vllm_graph.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", help=f"comma list of moeflow.bench presets (default {DEFAULT_PRESETS}; tiny on a CPU)")
    ap.add_argument("--tokens", help=f"T, comma list (default {DEFAULT_TOKENS}; {SMOKE_TOKENS} on a CPU)")
    ap.add_argument("--mode", default="layer", choices=["layer", "dispatch"],
                    help="moeflow.vllm.make_kernel's mode (default layer: the fused layer, as `moeflow bench`)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--double", action="store_true", help="the vLLM test double even where vLLM is installed")
    ap.add_argument("--iters", type=int, help="timed replays per round (default 20 CUDA, 2 CPU)")
    ap.add_argument("--warmup", type=int, help="untimed replays first (default 5 CUDA, 1 CPU)")
    ap.add_argument("--rounds", type=int, default=bench.DEFAULT_ROUNDS, help="rounds over the sweep (default 3)")
    ap.add_argument("--flush", default="off", choices=["on", "off"],
                    help="CUDA: a 512 MB fill before each replay (default off, as `moeflow bench`)")
    ap.add_argument("--check", action="store_true", help="y against moeflow.reference too (small shapes)")
    ap.add_argument("--c-record", nargs="+", metavar="JSON", help="`moeflow bench --json` records (globs)")
    ap.add_argument("--out", default="bench_out", help="directory for the record")
    ap.add_argument("--smoke", action="store_true", help=f"--presets tiny --tokens {SMOKE_TOKENS} --check "
                                                         "(seconds on a CPU)")
    a = ap.parse_args(argv)

    backend = resolve_backend(a.backend)
    cuda = backend == "cuda"
    if a.smoke:
        a.presets, a.tokens, a.check = a.presets or "tiny", a.tokens or SMOKE_TOKENS, True
    presets = bench.parse_list(a.presets or (DEFAULT_PRESETS if cuda else "tiny"))
    tokens = bench.parse_list(a.tokens or (DEFAULT_TOKENS if cuda else SMOKE_TOKENS), int)
    iters = a.iters or (20 if cuda else 2)
    warmup = a.warmup if a.warmup is not None else (5 if cuda else 1)
    for p in presets:
        if p not in bench.PRESETS:
            ap.error(f"--presets: unknown '{p}' ({', '.join(bench.PRESETS)})")
    if iters < 1 or warmup < 0 or a.rounds < 1 or not tokens or min(tokens) < 1:
        ap.error("--iters >= 1, --warmup >= 0, --rounds >= 1 and T >= 1 are required")
    c_rows = bench.load_c_rows(a.c_record) if a.c_record else []
    if a.c_record and not c_rows:
        ap.error(f"--c-record: no layer rows in {' '.join(a.c_record)}")

    vllm, is_double = load_vllm(a.double)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    timer = bench.Timer(device, iters, warmup, flush=a.flush == "on", hold=cuda)
    commit, date = bench.git_commit(), bench.now_utc()
    dev_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    print(f"# vllm_graph: {backend} ({dev_name}), torch {torch.__version__}, vllm {vllm.__version__}, commit "
          f"{commit}, R 1, make_kernel mode {a.mode}; median of {iters} after {warmup}, {a.rounds} rounds")
    print(f"# launch   {'graph: kernel.apply captured once per T, held replays between CUDA events' if cuda else 'eager (no graphs on the CPU), wall clock'}"
          f"{'; 512 MB fill before each' if cuda and a.flush == 'on' else ''}")
    print(f"# C        {'diff = python - C (gated, phase events off preferred); ok: |diff| <= %g us' % bench.C_TOLERANCE_US if c_rows else 'no --c-record'}")
    print(f"#{'preset':<16} {'launch':>6} {'T':>5} {'python':>10} {'C':>9} {'diff':>8} {'ok':>4} {'min':>9} {'max':>9} {'spread':>7}")
    print(f"#{'':<16} {'':>6} {'':>5} {'(us)':>10} {'(us)':>9} {'(us)':>8} {'':>4} {'(us)':>9} {'(us)':>9} {'':>7}")
    rows = []
    for name in presets:
        pr = bench_preset(name, tokens, device, a.mode, is_double, timer, a.rounds, a.check,
                          bench.ceilings(), log, c_rows)
        bench.attach_c(pr, c_rows)
        print_rows(pr)
        rows.extend(pr)
        if cuda:
            torch.cuda.empty_cache()
    if c_rows:
        matched = [r for r in rows if "c" in r]
        ok = sum(r["c"]["within_tol"] for r in matched)
        print(f"# vs C     {ok} of {len(matched)} matched rows within {bench.C_TOLERANCE_US:g} us"
              f"{'' if len(matched) == len(rows) else f' ({len(rows) - len(matched)} rows without a C row)'}")
    os.makedirs(a.out, exist_ok=True)
    rec = {"meta": {"card": os.environ.get("MF_CARD", "h200") if cuda else "cpu", "date": date, "commit": commit,
                    "command": "python3 bench/vllm_graph.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    "backend": backend, "torch": torch.__version__, "device": dev_name,
                    "vllm": vllm.__version__, "vllm_double": is_double,
                    "c_records": [os.path.basename(p) for p in a.c_record or []]},
           "rows": rows}
    path = os.path.join(a.out, f"{date[:10]}_vllm_graph_{a.mode}_R1_{commit}.json")
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    print(f"# record: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
