#!/usr/bin/env python3
"""bench/summarize.py — markdown tables for docs/PERFORMANCE.md from benchmark records.

  python3 bench/summarize.py gemm RECORD.json [--layout expert_major] [--counts equal]
  python3 bench/summarize.py layer RECORD.json [RECORD.json ...]

gemm:  a `moeflow bench gemm --json` record merged by bench/peers.py: moeflow beside torch and cuBLAS
       (rate: effective weight TB/s at M <= 128 rows per expert, else TFLOP/s).
layer: `moeflow bench layer --json` records: the fused dataflow (auto) beside unfused, the floor,
       and the grouped GEMMs' own phases (W13 + W2 of the slowest rank) for the prefill ratio.
"""
import argparse
import json
import sys


def peer(row, prefix):
    for p in row.get("peers", []):
        if p["name"].startswith(prefix):
            return p["time_us"]
    return None


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def gemm(a):
    rec = json.load(open(a.record))
    m = rec["meta"]
    print(f"<!-- {a.record}: card {m.get('card')}, {m.get('date')}, commit {m.get('commit')} -->")
    print("| model | op | dtype | L | M | moeflow us | rate | % floor | torch us | torch / moeflow | cuBLAS dense us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rec["rows"]:
        if r.get("layout") != a.layout or r.get("counts") != a.counts:
            continue
        s = r["shape"]
        rate = f"{r['weight_tbps']:.2f} TB/s" if s["M"] <= 128 else f"{r['tflops']:.0f} TFLOP/s"
        torch = peer(r, "torch")
        speed = None if torch is None else torch / r["time_us"]
        op = "W13+SwiGLU" if r["kernel"].startswith("w13") else "W2"
        print(f"| {r['model']} | {op} | {r['dtype']} | {s['L']} | {s['M']} | {r['time_us']:.1f} | {rate} | "
              f"{r['pct_of_floor']:.1f} | {fmt(torch)} | {fmt(speed, '.2f')}x | {fmt(peer(r, 'cublas'))} |")


def layer(a):
    print("| preset | R | T / rank | fused us | unfused us | floor us | fused / floor | unfused / fused | "
          "W13 + W2 us (fused) | fused / GEMMs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in a.records:
        rec = json.load(open(path))
        m = rec["meta"]
        print(f"<!-- {path}: card {m.get('card')}, {m.get('date')}, commit {m.get('commit')} -->")
        rows = [r for r in rec["rows"] if r["op"] in ("layer", "layer_unfused")]
        preset = m.get("command", "").split("--preset ")[-1].split()[0] if "--preset" in m.get("command", "") else "-"
        for r in rows:
            if r["op"] != "layer":
                continue
            s = r["shape"]
            un = next((u for u in rows if u["op"] == "layer_unfused" and u["shape"] == s), None)
            gem = r["phases_us"]["w13"] + r["phases_us"]["w2"] if "phases_us" in r else None
            print(f"| {preset} | {s['R']} | {s['T']} | {r['time_us']:.0f} | {fmt(un and un['time_us'], '.0f')} | "
                  f"{r['floor_us']:.0f} | {r['time_us'] / r['floor_us']:.2f}x | "
                  f"{fmt(un and un['time_us'] / r['time_us'], '.2f')}x | {fmt(gem, '.0f')} | "
                  f"{fmt(gem and r['time_us'] / gem, '.2f')}x |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gemm")
    g.add_argument("record")
    g.add_argument("--layout", default="expert_major")
    g.add_argument("--counts", default="equal")
    g.set_defaults(fn=gemm)
    l = sub.add_parser("layer")
    l.add_argument("records", nargs="+")
    l.set_defaults(fn=layer)
    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
