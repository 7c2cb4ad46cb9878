#!/usr/bin/env python3
"""bench/summarize.py — markdown tables for docs/PERFORMANCE.md from benchmark records.

  python3 bench/summarize.py gemm RECORD.json [--layout expert_major] [--counts equal]
                                   [--model NAME ...] [--dtype bf16|fp8] [--M 8,64,...]
  python3 bench/summarize.py layer RECORD.json [RECORD.json ...] [--no-phases]
  python3 bench/summarize.py capacity RECORD.json [RECORD.json ...]
  python3 bench/summarize.py smallbatch DIR
  python3 bench/summarize.py ab KEY RECORD.json [RECORD.json ...]
  python3 bench/summarize.py timeline RAW.jsonl [RAW.jsonl ...]

Every figure is printed beside the peers of the same record (one run, one machine state), and the
comparison columns compare only like with like:

gemm:  a `moeflow bench gemm --json` record merged by bench/peers.py. `best grouped peer` is the
       fastest grouped GEMM over the same experts and rows (torch._grouped_mm / _scaled_grouped_mm;
       DeepGEMM when a record has it), `peer / moeflow` > 1 when moeflow is faster. torch's W13 is
       the plain GEMM without SwiGLU (moeflow's W13 includes it): the comparison favours torch.
       cuBLAS dense, one GEMM of the same FLOPs, reads one expert-sized weight instead of L: it is a
       compute ceiling, not a peer. Its time is shown on every row, but `dense / moeflow` only where
       the shape is compute-bound (M >= 256 rows per expert); at M <= 128 the cell reads `ceiling
       only` (moeflow streams L experts' weights there; dense reads one). A row without a grouped
       peer in its record reads `none in this run`.
       rate: effective weight TB/s at M <= 128 rows per expert, else TFLOP/s.
layer: `moeflow bench layer --json` records: the fused dataflow (auto) beside unfused (the same
       run's peer), the floor, and the grouped GEMMs' own phases (W13 + W2 of the slowest rank) for
       the prefill ratio. These records carry no torch or cuBLAS run: the `torch peer` column says
       so (`python3 -m moeflow.bench` records an unfused torch layer beside moeflow; none is
       recorded yet on the H200).
       Records written with rounds (`moeflow bench --rounds`, the default since issue 25) show the
       rounds' range in the fused cell, `median (min-max)`, and `!` where the spread (max - min) /
       median passes 5 %; a record with several capacities S or --phases on,off names them in the
       preset cell. Older records (one measurement per row, no S in the shape) read as before.
capacity: one line per layer row of each record: preset, T, S, phase events, PDL (the record's
       meta.env MF_PDL), rounds, min / median / max us and the spread (bench/h200.sh DIR capacity).
smallbatch: the directory of `bench/h200.sh DIR smallbatch` (issue 25's table, one device call):
       per preset and T, moeflow under a CUDA graph (`python -m moeflow.bench --launch graph` on the
       routing of the C record) and `moeflow bench layer --gated` (C), each as time / its own floor,
       beside vLLM's Triton path (peer/vllm_layer_peer.json: the best of its layer with torch glue,
       with one-kernel glue and its small-batch path, on its own routing, over its own floor by
       moeflow's formula). `mf / peer` compares the two ratios: <= 1 where moeflow is at least as
       fast; the verdict column says which side wins.
ab:    an A/B over one environment switch KEY (e.g. MF_SMALL, bench/h200.sh DIR small): the layer rows
       of every record grouped by preset and T, one column per value of KEY in the records' meta.env
       (unset reads "default"), each `median (min-max)` over its rounds, and the change of each value
       against the first (KEY=0 when present: the switch off).
timeline: the small-batch kernel's raw stamps (`moeflow bench layer --timeline-raw FILE`, one JSON
       line per run: bench/h200.sh DIR timeline), one row per run, times in us after the earliest
       CTA's entry: `stream` the median CTA's first full ring position (weights and rows landed);
       per unit, a producer's ticket to its next (its first MF__GEMM_SMALL_UNIT_STAMPS tickets):
       W13, and W2 by what ran before it: `seam` the first W2 unit after W13 (or a CTA's first
       unit: it holds the wait for its expert's W13 tiles), `mid` a W2 unit after a W2 unit that is
       not the CTA's last, `last` the CTA's last unit before its end ticket (a half W2 unit of the
       small kernel's removed halves switch, kind 3 in its 2026-12-05 records, counts as W2 there
       and in `halves`); then the CTAs' ends
       (consumers done) at the 10th / 50th / 90th percentile and the last, and `idle` the SM-time
       the CTAs spent ended before the last one, as us of the span (the mean over CTAs) and as a
       share of all SM-time from the first entry: what a perfectly even end would give back.
"""
import argparse
import json
import sys

# Grouped GEMM peers: like with like (the same experts, rows per expert and weights read).
GROUPED_PEERS = ("torch_grouped_mm", "torch_scaled_grouped_mm", "deepgemm")
DENSE_PEER = "cublas_dense"
COMPUTE_BOUND_M = 256  # rows per expert from which a GEMM is compute-shaped (docs/DESIGN.md floors)


def peer(row, prefix):
    for p in row.get("peers", []):
        if p["name"].startswith(prefix):
            return p["time_us"]
    return None


def best_grouped(row):
    """(name, time_us) of the fastest grouped peer in the row's record, or (None, None)."""
    best = (None, None)
    for p in row.get("peers", []):
        if p["name"].startswith(GROUPED_PEERS) and (best[1] is None or p["time_us"] < best[1]):
            best = (p["name"], p["time_us"])
    return best


def short(name):
    return {"torch_grouped_mm": "torch", "torch_scaled_grouped_mm": "torch (scaled)"}.get(name, name)


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def gemm(a):
    rec = json.load(open(a.record))
    m = rec["meta"]
    pm = m.get("peers", {})
    print(f"<!-- {a.record}: card {m.get('card')}, {m.get('date')}, commit {m.get('commit')}; peers "
          f"{pm.get('date', '-')}, torch {pm.get('torch', '-')} -->")
    print("| model | counts | op | dtype | L | M | moeflow us | rate | % floor | best grouped peer (same run) | "
          "peer us | peer / moeflow | cuBLAS dense us (ceiling) | dense / moeflow |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rec["rows"]:
        if r.get("layout") != a.layout or r.get("counts") != a.counts:
            continue
        if a.model and r["model"] not in a.model:
            continue
        if a.dtype and r["dtype"] != a.dtype:
            continue
        if a.M and r["shape"]["M"] not in a.M:
            continue
        s = r["shape"]
        rate = f"{r['weight_tbps']:.2f} TB/s" if s["M"] < COMPUTE_BOUND_M else f"{r['tflops']:.0f} TFLOP/s"
        name, t = best_grouped(r)
        op = "W13+SwiGLU" if r["kernel"].startswith("w13") else "W2"
        dense = peer(r, DENSE_PEER)
        if dense is None:
            dense_cell, dense_ratio = "not run", "-"
        elif s["M"] < COMPUTE_BOUND_M:
            dense_cell, dense_ratio = f"{dense:.1f}", "ceiling only"
        else:
            dense_cell, dense_ratio = f"{dense:.1f}", f"{dense / r['time_us']:.2f}x"
        peer_cells = ("none in this run", "-", "-") if t is None else (short(name), f"{t:.1f}",
                                                                       f"{t / r['time_us']:.2f}x")
        print(f"| {r['model']} | {r['counts']} | {op} | {r['dtype']} | {s['L']} | {s['M']} | {r['time_us']:.1f} | "
              f"{rate} | {r['pct_of_floor']:.1f} | {' | '.join(peer_cells)} | {dense_cell} | {dense_ratio} |")


def rounds_cell(r, spec=".0f"):
    """`median (min-max)` with `!` past the spread flag, for a row with several rounds; else the time."""
    if r.get("rounds", 1) > 1 and r.get("min_us") is not None:
        flag = "!" if r.get("spread_flagged") else ""
        return f"{format(r['time_us'], spec)} ({format(r['min_us'], spec)}-{format(r['max_us'], spec)}){flag}"
    return format(r["time_us"], spec)


def variant(r):
    """(S, phase events) of a layer row; (None, None) for records older than both fields."""
    return r["shape"].get("S"), r.get("phase_events")


def layer(a):
    recs = [(path, json.load(open(path))) for path in a.records]
    for path, rec in recs:  # sources first: a comment line inside a table would split it
        m = rec["meta"]
        print(f"<!-- {path}: card {m.get('card')}, {m.get('date')}, commit {m.get('commit')} -->")
    print("| preset | R | T / rank | fused us | unfused us (same run) | torch peer | floor us | fused / floor | "
          "unfused / fused | W13 + W2 us (fused) | fused / GEMMs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path, rec in recs:
        m = rec["meta"]
        rows = [r for r in rec["rows"] if r["op"] in ("layer", "layer_unfused")]
        preset = m.get("command", "").split("--preset ")[-1].split()[0] if "--preset" in m.get("command", "") else "-"
        several = len({variant(r) for r in rows}) > 1  # -S lists or --phases on,off: name them
        for r in rows:
            if r["op"] != "layer":
                continue
            s = r["shape"]
            un = next((u for u in rows if u["op"] == "layer_unfused" and u["shape"] == s
                       and u.get("phase_events") == r.get("phase_events")), None)
            name = preset
            if several:
                S, ev = variant(r)
                name += f" (S {S}" + ("" if ev is None else f", events {'on' if ev else 'off'}") + ")"
            floor = r.get("floor_us")  # none on the CPU backend
            tp = peer(r, "torch")  # python -m moeflow.bench: torch_unfused_<op> in the layer row's peers
            gem = r["phases_us"]["w13"] + r["phases_us"]["w2"] if "phases_us" in r and not a.no_phases else None
            print(f"| {name} | {s['R']} | {s['T']} | {rounds_cell(r)} | {fmt(un and un['time_us'], '.0f')} | "
                  f"{'not run' if tp is None else format(tp, '.0f')} | "
                  f"{fmt(floor, '.0f')} | {ratio(floor and r['time_us'] / floor)} | "
                  f"{ratio(un and un['time_us'] / r['time_us'])} | {fmt(gem, '.0f')} | "
                  f"{ratio(gem and r['time_us'] / gem)} |")


def capacity(a):
    """bench/h200.sh DIR capacity: every layer row's rounds, one line each."""
    print(f"#{'record':<22} {'preset':<16} {'T':>5} {'S':>5} {'events':>6} {'PDL':>3} {'rounds':>6} {'min':>9} "
          f"{'median':>9} {'max':>9} {'spread':>7}")
    for path in a.records:
        try:
            rec = json.load(open(path))
        except (OSError, ValueError) as e:
            print(f"# {path}: {e}")
            continue
        m = rec["meta"]
        cmd = m.get("command", "")
        preset = cmd.split("--preset ")[-1].split()[0] if "--preset" in cmd else "-"
        env = m.get("env", {})  # records before the CLI wrote it: a hand-written "MF_PDL=0" string
        env = env if isinstance(env, dict) else dict(v.split("=", 1) for v in str(env).split() if "=" in v)
        pdl = env.get("MF_PDL", "1")
        tag = path.rsplit("/", 1)[-1].removesuffix(".json")
        for r in rec["rows"]:
            if r["op"] not in ("layer", "layer_unfused"):
                continue
            S, ev = variant(r)
            ev_s = "-" if ev is None else "on" if ev else "off"
            sp = r.get("spread")
            sp_s = "-" if sp is None else f"{100 * sp:.1f}%" + ("!" if r.get("spread_flagged") else "")
            print(f" {tag[:22]:<22} {preset:<16} {r['shape']['T']:>5} {fmt(S, 'd'):>5} {ev_s:>6} {pdl:>3} "
                  f"{r.get('rounds', 1):>6} {fmt(r.get('min_us', r['time_us'])):>9} {r['time_us']:>9.1f} "
                  f"{fmt(r.get('max_us', r['time_us'])):>9} {sp_s:>7}")


def smallbatch(a):
    import glob
    import os
    peers = {}
    with open(os.path.join(a.dir, "peer", "vllm_layer_peer.json")) as f:
        for r in json.load(f)["rows"]:
            naive = r.get("naive") or {}
            cands = [("torch glue", r.get("time_us")), ("1-kernel glue", r.get("time_triton_glue_us")),
                     ("small-batch", naive.get("time_us")),
                     ("small-batch 1-kernel glue", naive.get("time_triton_glue_us"))]
            name, best = min(((n, t) for n, t in cands if t), key=lambda x: x[1])
            peers[(r["preset"], r["T"])] = (best, r["floor_us"], name)
    print("| preset | T | floor (us) | moeflow graph (us) | x floor | moeflow C gated (us) | x floor "
          "| vLLM Triton best (us) | x its floor | its variant | mf / peer | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in sorted(glob.glob(os.path.join(a.dir, "*pybench_*.json"))):
        with open(path) as f:
            rows = [r for r in json.load(f)["rows"] if r["op"] == "layer" and r.get("launch") == "graph"]
        for r in rows:
            T, P = r["shape"]["T"], r["preset"]
            mf = r.get("median_us", r["time_us"])
            c = (r.get("c") or {}).get("time_us")
            pk = peers.get((P, T))
            x = mf / r["floor_us"]
            cells = [P, str(T), fmt(r["floor_us"]), fmt(mf), fmt(x, ".3f"), fmt(c) if c else "-",
                     fmt(c / r["floor_us"], ".3f") if c else "-"]
            if pk:
                px = pk[0] / pk[1]
                cells += [fmt(pk[0]), fmt(px, ".3f"), pk[2], fmt(x / px, ".3f"), "moeflow" if x <= px else "**vLLM**"]
            else:
                cells += ["-", "-", "-", "-", "no peer row"]
            print("| " + " | ".join(cells) + " |")


def ab(a):
    """Layer rows grouped by (preset, T), one column per value of the switch a.key."""
    cells, values, order = {}, [], []
    for path in a.records:
        rec = json.load(open(path))
        m = rec["meta"]
        env = m.get("env", {}) if isinstance(m.get("env"), dict) else {}
        v = env.get(a.key, "default")
        if v not in values:
            values.append(v)
        cmd = m.get("command", "")
        preset = cmd.split("--preset ")[-1].split()[0] if "--preset" in cmd else "-"
        print(f"<!-- {path}: card {m.get('card')}, {m.get('date')}, commit {m.get('commit')}, {a.key}={v} -->")
        for r in rec["rows"]:
            if r["op"] != "layer":
                continue
            k = (preset, r["shape"]["T"])
            if k not in order:
                order.append(k)
            cells.setdefault(k, {}).setdefault(v, []).append(r)
    values.sort(key=lambda v: v != "0")  # the switch off first: the base of the change columns
    print("| preset | T | floor us | " + " | ".join(f"{a.key}={v} us" for v in values) + " | " +
          " | ".join(f"{a.key}={v} vs {values[0]}" for v in values[1:]) + " |")
    print("|---|---|---|" + "---|" * (2 * len(values) - 1))
    for k in order:
        got = cells[k]
        floor = next((r.get("floor_us") for rs in got.values() for r in rs), None)
        med = {v: sum(r["time_us"] for r in rs) / len(rs) for v, rs in got.items()}
        row = [k[0], str(k[1]), fmt(floor, ".1f")]
        row += [" / ".join(rounds_cell(r, ".1f") for r in got[v]) if v in got else "-" for v in values]
        row += [f"{100 * (med[v] / med[values[0]] - 1):+.1f} %" if v in med and values[0] in med else "-"
                for v in values[1:]]
        print("| " + " | ".join(row) + " |")


def pct(v, q):
    """The q-quantile of v (nearest rank, v non-empty), or None."""
    if not v:
        return None
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def timeline_row(run):
    """One run's numbers (us) from its CTAs' raw stamps (see the module doc)."""
    ctas = run["ctas"]
    w13, seam, mid, last, halves = [], [], [], [], []
    for c in ctas:
        units = c[7]
        for k, (idx, kind, when) in enumerate(units):
            if kind == 2 or k + 1 >= len(units):
                break
            us = (units[k + 1][2] - when) * 1e-3
            if kind == 3:
                halves.append(us)
            if kind == 0:
                w13.append(us)
            elif units[k + 1][1] == 2:
                last.append(us)
            elif k and units[k - 1][1] in (1, 3):
                mid.append(us)
            else:
                seam.append(us)
    ends = [c[5] * 1e-3 for c in ctas]
    span = max(ends)
    idle = [span - e for e in ends]
    return {
        "ctas": len(ctas), "span": span, "stream": pct([c[4] * 1e-3 for c in ctas], 0.5),
        "w13": (pct(w13, 0.5), pct(w13, 0.9), len(w13)), "seam": (pct(seam, 0.5), len(seam)),
        "mid": (pct(mid, 0.5), len(mid)), "last": (pct(last, 0.5), len(last)),
        "halves": (pct(halves, 0.5), len(halves)),
        "ends": (pct(ends, 0.1), pct(ends, 0.5), pct(ends, 0.9), span),
        "idle": (sum(idle) / len(idle), 100.0 * sum(idle) / (len(ctas) * span) if span > 0 else 0.0),
    }


def timeline(a):
    """One row per run of the raw timeline files."""
    print("| preset | T | MF_SMALL | round | CTAs | span | stream | W13 unit (p90, n) | W2 seam (n) | W2 mid (n) "
          "| W2 last (n) | W2 halves (n) | ends p10 / p50 / p90 / last | idle us (% SM-time) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in a.files:
        for line in open(path):
            line = line.strip()
            if not line:
                continue
            run = json.loads(line)
            if not run.get("ctas"):
                continue
            r = timeline_row(run)
            w13, ends = r["w13"], r["ends"]
            cell = lambda v: f"{fmt(v[0])} ({v[1]})" if v[-1] else "-"
            print(f"| {run['preset']} | {run['T']} | {run.get('MF_SMALL') or 'default'} | {run['round']} | {r['ctas']} "
                  f"| {fmt(r['span'])} | {fmt(r['stream'])} "
                  f"| {fmt(w13[0])} ({fmt(w13[1])}, {w13[2]}) | {cell(r['seam'])} | {cell(r['mid'])} "
                  f"| {cell(r['last'])} | {cell(r['halves'])} | {' / '.join(fmt(e) for e in ends)} "
                  f"| {fmt(r['idle'][0])} ({fmt(r['idle'][1])} %) |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gemm")
    g.add_argument("record")
    g.add_argument("--layout", default="expert_major")
    g.add_argument("--counts", default="equal")
    g.add_argument("--model", nargs="*", default=None, help="only these models")
    g.add_argument("--dtype", default=None, help="only this dtype (bf16 or fp8)")
    g.add_argument("--M", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="only these rows per expert, e.g. 8,64,128,256,1024,4096,8192")
    g.set_defaults(fn=gemm)
    l = sub.add_parser("layer")
    l.add_argument("records", nargs="+")
    l.add_argument("--no-phases", action="store_true",
                   help="leave the GEMM-phase columns empty (R > 1 virtual ranks: a rank's phases hold others' work)")
    l.set_defaults(fn=layer)
    c = sub.add_parser("capacity")
    c.add_argument("records", nargs="+")
    c.set_defaults(fn=capacity)
    sb = sub.add_parser("smallbatch")
    sb.add_argument("dir")
    sb.set_defaults(fn=smallbatch)
    ab_ = sub.add_parser("ab")
    ab_.add_argument("key")
    ab_.add_argument("records", nargs="+")
    ab_.set_defaults(fn=ab)
    tl = sub.add_parser("timeline")
    tl.add_argument("files", nargs="+")
    tl.set_defaults(fn=timeline)
    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
