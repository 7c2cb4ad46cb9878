"""python -m moeflow.bench: a tiny CPU run writes docs/DESIGN.md's records (layer, w13, w2 rows
with a torch peer) and plots; the floor is the CLI's; existing H200 records plot; no matplotlib
degrades to JSON only."""
import glob
import json
import os
import subprocess
import sys

import pytest

from moeflow import bench

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
H200 = os.path.join(ROOT, "bench", "results", "h200")


def has_matplotlib():
    return bench._pyplot() is not None


def read_records(out):
    files = sorted(glob.glob(os.path.join(out, "*_pybench_*.json")))
    return files, [json.load(open(f)) for f in files]


def test_smoke_run_records_and_plots(tmp_path, capsys):
    out = str(tmp_path)
    assert bench.main(["--smoke", "--backend", "cpu", "--tokens", "1,3", "--out", out]) == 0
    files, recs = read_records(out)
    assert len(files) == 1 and "_pybench_tiny_R1_fp8_" in files[0]
    meta, rows = recs[0]["meta"], recs[0]["rows"]
    assert {"card", "date", "commit", "command", "backend"} <= set(meta) and meta["backend"] == "cpu"
    assert [(r["op"], r["shape"]["T"]) for r in rows] == [
        ("layer", 1), ("w13", 1), ("w2", 1), ("layer", 3), ("w13", 3), ("w2", 3)]
    for r in rows:
        assert set(r["shape"]) == {"R", "E", "K", "H", "I", "T", "L", "M", "S"} and r["shape"]["S"] == 3
        assert r["shape"]["M"] == 2 * r["shape"]["T"]  # K = 2, no drops: every (t, k) a row
        assert r["time_us"] > 0 and r["dtype"] == "fp8" and r["layout"] == "expert_major"
        assert "floor_us" not in r  # the CPU has no ceiling
        assert len(r["peers"]) == 1 and r["peers"][0]["time_us"] > 0, r["peers"]
    assert set(rows[0]["phases_us"]) == {"prepare", "dispatch", "w13", "w2", "combine"}
    assert rows[1]["time_us"] == rows[0]["phases_us"]["w13"]
    text = capsys.readouterr().out
    assert [ln.split()[3] for ln in text.splitlines() if not ln.startswith("#")] == ["1", "3"]
    if has_matplotlib():
        assert os.path.getsize(os.path.join(out, "pybench_fp8_R1.png")) > 1000


def test_two_ranks_bf16_dataflows_no_peers(tmp_path):
    out = str(tmp_path)
    assert bench.main(["--smoke", "--backend", "cpu", "-R", "2", "--dtype", "bf16", "--tokens", "2",
                       "--dataflow", "auto,unfused", "--no-peers", "--no-plots", "--out", out]) == 0
    _, recs = read_records(out)
    rows = recs[0]["rows"]
    assert [(r["op"], r["dataflow"]) for r in rows] == [
        ("layer", "auto"), ("w13", "auto"), ("w2", "auto"), ("layer_unfused", "unfused")]
    assert rows[0]["shape"]["R"] == 2 and rows[0]["shape"]["L"] == 4 and rows[0]["dtype"] == "bf16"
    assert all(r["peers"] == [] for r in rows) and "phases_us" in rows[3]
    assert set(bench.layer_series(rows)["tiny"]) == {"moeflow", "moeflow unfused"}
    assert not glob.glob(os.path.join(out, "*.png"))


def test_floor_is_the_clis():
    """deepseek-v3, R = 1, T = 1, FP8: the CLI's record says floor 83.1623 us (8 routed experts
    streamed once at 4.24 TB/s), W13 55.4279 us."""
    ceil = bench.ceilings()
    assert ceil == (4.24e12, 795e12, 1436e12)
    c = bench.counts(1, 1, 7168, 2048, rows=8, used=8, fp8=True)
    assert bench.floor_us(*c["layer"], True, ceil) == pytest.approx(83.1623, rel=1e-5)
    assert bench.floor_us(*c["w13"], True, ceil) == pytest.approx(55.4279, rel=1e-5)
    rec = json.load(open(os.path.join(H200, "2026-12-03_layer_deepseek-v3_R8_gated_55234b8.json")))
    row = next(r for r in rec["rows"] if r["op"] == "layer" and r["shape"]["T"] == 4096)
    s = row["shape"]  # T = 4096 x 8 ranks: every expert is routed
    c = bench.counts(s["R"], s["T"], s["H"], s["I"], s["M"], s["E"], True)
    assert bench.floor_us(*c["layer"], True, ceil) == pytest.approx(row["floor_us"], rel=1e-5)


@pytest.mark.skipif(not has_matplotlib(), reason="needs matplotlib")
def test_plot_existing_h200_records(tmp_path):
    paths = [os.path.join(H200, "2026-12-03_layer_*_R1_gated_55234b8.json"),
             os.path.join(H200, "2026-12-03_gemm_uneven_peers.json")]
    written = bench.plot_records(paths, str(tmp_path))
    names = sorted(os.path.basename(w) for w in written)
    assert names == ["h200_gemm_uneven_peers.png", "h200_layer_R1_gated_55234b8.png"]
    assert all(os.path.getsize(w) > 1000 for w in written)
    series = bench.layer_series(json.load(open(os.path.join(
        H200, "2026-12-03_layer_kimi-k2_R1_gated_55234b8.json")))["rows"])
    assert set(series) == {"kimi-k2"}
    assert {"moeflow", "moeflow unfused", "floor"} <= set(series["kimi-k2"])


def test_without_matplotlib_json_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_pyplot", lambda: None)
    out = str(tmp_path)
    assert bench.main(["--smoke", "--backend", "cpu", "--tokens", "1", "--no-peers", "--out", out]) == 0
    assert len(read_records(out)[0]) == 1 and not glob.glob(os.path.join(out, "*.png"))
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert bench.plot_records([os.path.join(H200, "*.json")], out) == []


def test_runs_as_a_module():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-m", "moeflow.bench", "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and "--presets" in r.stdout
