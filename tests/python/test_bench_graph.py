"""The graph mode of python -m moeflow.bench and bench/vllm_graph.py (issue 25.4) where no GPU is
needed: --launch resolved and refused, the C record's row chosen for a Python row (shape, gated,
phase events, S) and the difference with its 2 us check, records and console tables of CPU runs
against a C record written by `moeflow bench` itself, and the vLLM script's smoke path on the CPU
(eager apply through vLLM's FusedMoEKernel, or its test double in a process of its own, checked
against moeflow.reference). The graph capture itself needs CUDA: test_vllm_cuda.py and
test_cuda.py capture the same calls on the H200."""
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeflow import bench

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "bench" / "vllm_graph.py"
TINY = {"E": 8, "K": 2, "H": 256, "I": 128}


# ---- --launch ------------------------------------------------------------------------------------
def test_resolve_launch():
    assert bench.resolve_launch("auto", "cuda", 1) == "graph"   # an engine's decode step
    assert bench.resolve_launch("auto", "cuda", 8) == "eager"   # virtual ranks: no capture here
    assert bench.resolve_launch("auto", "cpu", 1) == "eager"    # no graphs on the CPU
    assert bench.resolve_launch("graph", "cuda", 1) == "graph"
    assert bench.resolve_launch("eager", "cuda", 1) == "eager"
    with pytest.raises(ValueError, match="CUDA"):
        bench.resolve_launch("graph", "cpu", 1)
    with pytest.raises(ValueError, match="R = 1"):
        bench.resolve_launch("graph", "cuda", 2)
    with pytest.raises(ValueError):
        bench.resolve_launch("replay", "cuda", 1)


def test_launch_graph_refused_on_cpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--smoke", "--backend", "cpu", "--launch", "graph", "--out", str(tmp_path)])
    assert e.value.code == 2 and "needs the CUDA backend" in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # refused before anything ran


def test_time_moeflow_graph_needs_cuda_and_one_rank():
    import torch
    from moeflow.torch import virtual_comms

    comms = virtual_comms(1, "cpu")
    try:
        with pytest.raises(ValueError, match="CUDA backend and R = 1"):
            bench.time_moeflow(comms, (8, 2, 256, 128, True), bench.make_weights(8, 256, 128, True, torch.device("cpu")),
                               {1: bench.make_tokens(1, 1, 8, 2, 256, torch.device("cpu"), 1)}, 1, 0,
                               launch="graph")
    finally:
        comms[0].group.close()


# ---- the C row of a Python row -----------------------------------------------------------------------
def c_row(T, us, gated=1, events=0, S=8, op="layer", dtype="fp8", dataflow="auto", R=1, E=256, H=7168):
    """A row as `moeflow bench --json` writes it (tools/moeflow.c write_json)."""
    return {"op": op, "dataflow": dataflow, "dtype": dtype, "layout": "expert_major",
            "transport": "local", "gated": gated,
            "shape": {"R": R, "E": E, "K": 8, "H": H, "I": 2048, "T": T, "L": E // R, "M": 8 * T, "S": S},
            "phase_events": events, "time_us": us, "rounds": 3, "round_us": [us] * 3, "min_us": us,
            "median_us": us, "max_us": us, "spread": 0.0, "spread_flagged": False}


def py_row(T, us, S=8, dtype="fp8", E=256, H=7168):
    return {"op": "layer", "preset": "deepseek-v3", "dataflow": "auto", "dtype": dtype,
            "layout": "expert_major", "launch": "graph", "time_us": us,
            "shape": {"R": 1, "E": E, "K": 8, "H": H, "I": 2048, "T": T, "L": E, "M": 8 * T, "S": S}}


def write_c(tmp_path, rows, name="c.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"meta": {"card": "h200", "commit": "abc1234"}, "rows": rows}))
    return str(path)


def test_match_prefers_gated_then_no_events_then_same_S(tmp_path):
    rows = [c_row(1, 150.0, gated=0, events=0), c_row(1, 141.0, gated=1, events=1),
            c_row(1, 139.0, gated=1, events=0, S=4096), c_row(1, 138.0, gated=1, events=0, S=8),
            c_row(2, 200.0), c_row(1, 99.0, op="w13"), c_row(1, 90.0, dtype="bf16"),
            c_row(1, 91.0, R=8), c_row(1, 92.0, dataflow="unfused", op="layer_unfused"),
            c_row(1, 93.0, dataflow="direct")]
    path = write_c(tmp_path, rows)
    c = bench.load_c_rows([path])
    assert [r["op"] for _, r in c].count("w13") == 0  # phase rows are not layer rows
    p, m = bench.match_c_row(c, py_row(1, 140.0, S=8))
    assert p == path and (m["time_us"], m["gated"], m["phase_events"], m["shape"]["S"]) == (138.0, 1, 0, 8)
    assert bench.match_c_row(c, py_row(1, 140.0, S=16))[1]["time_us"] == 139.0  # first gated, events off
    assert bench.match_c_row(c, py_row(2, 1.0))[1]["time_us"] == 200.0
    assert bench.match_c_row(c, py_row(4, 1.0)) is None                 # no C row of that T
    assert bench.match_c_row(c, py_row(1, 1.0, dtype="bf16"))[1]["time_us"] == 90.0
    assert bench.match_c_row(c, py_row(1, 1.0, E=384)) is None          # another preset
    # without a gated row the events-off one, without that what there is
    c2 = bench.load_c_rows([write_c(tmp_path, [c_row(1, 5.0, gated=0, events=1),
                                                c_row(1, 6.0, gated=0, events=0)], "c2.json")])
    assert bench.match_c_row(c2, py_row(1, 1.0))[1]["time_us"] == 6.0


def test_c_entry_diff_and_tolerance(tmp_path):
    path = write_c(tmp_path, [c_row(1, 100.0, S=8), c_row(2, 200.0, S=8), c_row(4, 300.0, S=8)])
    c = bench.load_c_rows([path])
    rows = [py_row(1, 102.0), py_row(2, 197.5), py_row(4, 302.01), py_row(8, 400.0)]
    assert bench.attach_c(rows, c) == 3
    assert [r["c"]["diff_us"] for r in rows[:3]] == [2.0, -2.5, 2.01]
    assert [r["c"]["within_tol"] for r in rows[:3]] == [True, False, False]  # 2 us is the bound
    assert "c" not in rows[3]
    e = rows[0]["c"]
    assert (e["record"], e["time_us"], e["gated"], e["phase_events"], e["S"], e["tol_us"]) == \
        ("c.json", 100.0, 1, 0, 8, 2.0)
    assert bench.c_cells(rows[0]) == ("    100.0", "    +2.0", " yes")
    assert bench.c_cells(rows[1])[1:] == ("    -2.5", "  NO")
    assert bench.c_cells(rows[3]) == ("        -", "       -", "   -")
    assert bench.c_entry(py_row(1, 97.0), (path, c_row(1, 100.0)), tol=3.0)["within_tol"]


def test_c_record_without_layer_rows_is_refused(tmp_path, capsys):
    path = write_c(tmp_path, [c_row(1, 5.0, op="w13")])
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--backend", "cpu", "--c-record", path, "--out", str(tmp_path / "o")])
    assert "no layer rows" in capsys.readouterr().err


# ---- CPU runs against a record of `moeflow bench` itself ------------------------------------------------
def moeflow_cli():
    lib = os.environ.get("MOEFLOW_LIB")
    for d in ([os.path.dirname(lib)] if lib else []) + [str(ROOT / "build")]:
        if os.path.isfile(os.path.join(d, "moeflow")):
            return os.path.join(d, "moeflow")
    pytest.skip("the moeflow CLI is not built next to the library")


def c_record_of_cli(tmp_path, tokens="1,3"):
    """`moeflow bench layer` on the CPU at the smoke shape, R = 1, phase events on and off."""
    path = str(tmp_path / "c_tiny.json")
    cmd = [moeflow_cli(), "bench", "layer", "--backend", "cpu", "-R", "1", "-E", "8", "-K", "2", "-H", "256",
           "-I", "128", "-T", tokens, "--dtype", "fp8", "--rounds", "1", "--iters", "2", "--warmup", "1",
           "--phases", "on,off", "--no-check", "--json", path]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return path


def test_cpu_bench_with_c_record(tmp_path, capsys):
    cpath = c_record_of_cli(tmp_path)
    c_rows = [r for _, r in bench.load_c_rows([cpath])]
    assert {(r["shape"]["T"], r["phase_events"]) for r in c_rows if r["op"] == "layer"} == \
        {(1, 0), (1, 1), (3, 0), (3, 1)}
    for c in c_rows:  # the C rows carry their routing: R lists of T x K ids in [0, E)
        T = c["shape"]["T"]
        assert len(c["topk_ids"]) == 1 and len(c["topk_ids"][0]) == T * 2
        assert all(0 <= e < 8 for e in c["topk_ids"][0])
    # c_routing: that routing as tensors for the same shape, None for another
    got = bench.c_routing([(cpath, c) for c in c_rows], 1, 8, 2, 256, 128, 3)
    want = next(c for c in c_rows if c["shape"]["T"] == 3)["topk_ids"][0]
    assert got[0].dtype == torch.int32 and got[0].shape == (3, 2) and got[0].reshape(-1).tolist() == want
    assert bench.c_routing([(cpath, c) for c in c_rows], 1, 8, 2, 256, 128, 5) is None
    assert bench.c_routing([(cpath, c) for c in c_rows], 1, 16, 2, 256, 128, 3) is None
    out = str(tmp_path / "py")
    assert bench.main(["--smoke", "--backend", "cpu", "--tokens", "1,3", "--rounds", "1", "--no-plots",
                       "--no-peers", "--flush", "off", "--c-record", cpath, "--out", out]) == 0
    rec = json.load(open(glob.glob(os.path.join(out, "*_pybench_tiny_*.json"))[0]))
    layers = [r for r in rec["rows"] if r["op"] == "layer"]
    assert [r["shape"]["T"] for r in layers] == [1, 3]
    for r in rec["rows"]:
        assert (r["launch"], r["gated"], r["l2_flush"]) == ("eager", 0, False)  # the CPU: no graphs, no flush
    for r in layers:
        want = next(c for c in c_rows if c["op"] == "layer" and c["shape"]["T"] == r["shape"]["T"]
                    and c["phase_events"] == 0)  # events off: the graph-like C row
        assert r["c"]["time_us"] == want["time_us"] and r["c"]["phase_events"] == 0
        assert r["c"]["diff_us"] == pytest.approx(r["time_us"] - want["time_us"], abs=1e-3)
        assert r["c"]["within_tol"] == (abs(r["c"]["diff_us"]) <= 2.0)
        assert r["c"]["record"] == "c_tiny.json"
        assert r["routing"] == "c_record" and r["c"]["same_routing"] is True  # the C row's experts
        assert r["shape"]["M"] == want["shape"]["M"]
    text = capsys.readouterr().out
    assert "# launch   eager" in text
    table = text[text.index("# vs C"):].splitlines()
    data = [ln.split() for ln in table if not ln.startswith("#")]
    assert [(d[0], d[1], d[2], d[3]) for d in data] == [("tiny", "layer", "eager", "1"), ("tiny", "layer", "eager", "3")]
    for d, r in zip(data, layers):  # python, C, diff, ok, C's S, C's events
        assert float(d[4]) == pytest.approx(r["time_us"], abs=0.051)
        assert float(d[5]) == pytest.approx(r["c"]["time_us"], abs=0.051)
        assert float(d[6]) == pytest.approx(r["c"]["diff_us"], abs=0.051)
        assert d[7] == ("yes" if r["c"]["within_tol"] else "NO") and d[9] == "0" and d[10] == "same"


# ---- bench/vllm_graph.py --------------------------------------------------------------------------------
def run_script(args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return subprocess.run([sys.executable, str(SCRIPT)] + args, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(ROOT))


def check_script_record(out, want_double, cpath=None):
    rec = json.load(open(glob.glob(os.path.join(out, "*_vllm_graph_layer_R1_*.json"))[0]))
    assert rec["meta"]["vllm_double"] is want_double
    assert rec["meta"]["vllm"].endswith("(moeflow test double)") == want_double
    rows = rec["rows"]
    assert [(r["op"], r["preset"], r["shape"]["T"], r["shape"]["S"]) for r in rows] == \
        [("layer", "tiny", 1, 3), ("layer", "tiny", 3, 3)]
    for r in rows:
        assert {k: r["shape"][k] for k in TINY} == TINY and r["shape"]["R"] == 1
        assert (r["launch"], r["gated"], r["l2_flush"], r["interface"], r["replay_equals_eager"],
                r["checked_reference"]) == ("eager", 0, False, "vllm_kernel_layer", True, True)
        assert r["rounds"] == 2 and r["time_us"] == r["median_us"] and len(r["round_us"]) == 2
        assert r["min_us"] <= r["time_us"] <= r["max_us"]
        if cpath:
            assert r["c"]["phase_events"] == 0
            assert r["c"]["diff_us"] == pytest.approx(r["time_us"] - r["c"]["time_us"], abs=1e-3)
            assert r["routing"] == "c_record" and r["c"]["same_routing"] is True
        else:
            assert r["routing"] == "own"
    return rows


def test_vllm_graph_smoke_under_the_double(tmp_path):
    """The H200's configuration (no vLLM: the double) on CPU tensors, in a process of its own
    (the double is registered as `vllm` there): the kernel built, apply run and checked against
    moeflow.reference, the record and the table."""
    cpath = c_record_of_cli(tmp_path)
    out = str(tmp_path / "out")
    p = run_script(["--smoke", "--backend", "cpu", "--double", "--rounds", "2", "--c-record", cpath,
                    "--out", out])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = check_script_record(out, True, cpath)
    data = [ln.split() for ln in p.stdout.splitlines() if not ln.startswith("#")]
    assert [d[:3] for d in data] == [["tiny", "eager", "1"], ["tiny", "eager", "3"]]
    for d, r in zip(data, rows):  # T | python | C | diff | ok
        assert float(d[3]) == pytest.approx(r["time_us"], abs=0.051)
        assert float(d[4]) == pytest.approx(r["c"]["time_us"], abs=0.051)
        assert float(d[5]) == pytest.approx(r["c"]["diff_us"], abs=0.051)
        assert d[6] == ("yes" if r["c"]["within_tol"] else "NO")
    assert "matched rows within 2 us" in p.stdout


def test_vllm_graph_usage_errors(tmp_path):
    p = run_script(["--backend", "cpu", "--presets", "nope", "--out", str(tmp_path)])
    assert p.returncode == 2 and "unknown 'nope'" in p.stderr
    p = run_script(["--backend", "cpu", "--tokens", "0", "--out", str(tmp_path)])
    assert p.returncode == 2 and "T >= 1" in p.stderr


def require_real_vllm():
    """Skips unless the real vLLM imports: where it is missing (the H200), test_vllm_cuda.py
    registered the test double as `vllm` when pytest collected it."""
    vllm = pytest.importorskip("vllm")
    if vllm.__version__.endswith("(moeflow test double)"):
        pytest.skip("vLLM is not installed here (`vllm` is the test double)")


def test_vllm_graph_smoke_with_vllm(tmp_path):
    """The same path through vLLM 0.33's own FusedMoEKernel, in this process (where CI has it)."""
    require_real_vllm()
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import vllm_graph
    finally:
        sys.path.remove(str(SCRIPT.parent))
    out = str(tmp_path / "out")
    assert vllm_graph.main(["--smoke", "--backend", "cpu", "--rounds", "2", "--out", out]) == 0
    rows = check_script_record(out, False)
    assert all("c" not in r for r in rows)


def test_vllm_graph_check_catches_a_wrong_layer(tmp_path, monkeypatch):
    """--check is a real check: against a reference with halved router weights the run fails."""
    require_real_vllm()
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import vllm_graph
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from moeflow import reference as ref

    real = ref.reference_moe
    monkeypatch.setattr(ref, "reference_moe", lambda x, ids, w, *a, **k: real(x, ids, w * 0.5, *a, **k))
    with pytest.raises(AssertionError):
        vllm_graph.main(["--smoke", "--backend", "cpu", "--rounds", "1", "--out", str(tmp_path)])
