"""python -m moeflow.bench in rounds (issue 25): the aggregation of the rounds (min / median / max,
the spread and its 5 % flag), the order the rounds run in (the whole sweep once per round, not one
row's rounds back to back), and a CPU run whose records carry the rounds of every layer row and of
the torch peer."""
import glob
import json
import os

import pytest

from moeflow import bench


def test_aggregate_odd_rounds():
    a = bench.aggregate_rounds([110.0, 100.0, 104.0])
    assert (a["rounds"], a["min_us"], a["median_us"], a["max_us"]) == (3, 100.0, 104.0, 110.0)
    assert a["round_us"] == [110.0, 100.0, 104.0]  # in the order they ran
    assert a["spread"] == pytest.approx(10.0 / 104.0, abs=1e-5) and a["spread_flagged"]  # 9.6 % > 5 %
    assert a["median_round"] == 2  # the round whose phases the row reports


def test_aggregate_even_rounds_and_flag_bound():
    a = bench.aggregate_rounds([100.0, 103.0, 101.0, 102.0])
    assert a["median_us"] == 101.5 and (a["min_us"], a["max_us"]) == (100.0, 103.0)
    assert a["spread"] == pytest.approx(3.0 / 101.5, abs=1e-5) and not a["spread_flagged"]
    assert a["median_round"] == 2  # lower middle: 101.0
    assert not bench.aggregate_rounds([100.0, 105.0, 102.5])["spread_flagged"]  # 5 / 102.5 < 5 %
    assert bench.aggregate_rounds([100.0, 106.0, 103.0])["spread_flagged"]      # 6 / 103 > 5 %
    assert bench.aggregate_rounds([100.0, 106.0, 103.0], flag=0.1)["spread_flagged"] is False


def test_aggregate_one_round_and_none():
    a = bench.aggregate_rounds([42.0])
    assert (a["min_us"], a["median_us"], a["max_us"], a["spread"], a["spread_flagged"]) == (42.0, 42.0, 42.0, None, False)
    assert bench.spread_cell(a) == "-"
    assert bench.spread_cell(bench.aggregate_rounds([100.0, 107.0, 103.0])) == "6.8%!"
    with pytest.raises(ValueError):
        bench.aggregate_rounds([])


def test_schedule_separates_rounds():
    """Round k + 1 starts only after round k ran every T: a drift over the run reaches every row."""
    assert bench.schedule([1, 4, 16], 3) == [(0, 1), (0, 4), (0, 16), (1, 1), (1, 4), (1, 16),
                                             (2, 1), (2, 4), (2, 16)]
    assert bench.schedule([8], 1) == [(0, 8)]


def test_cpu_run_in_rounds(tmp_path, capsys):
    """The layer's calls run in the schedule's order, and the record's rounds are the rows'."""
    from moeflow.torch import virtual_comms
    import torch

    E, K, H, I = 8, 2, 256, 128
    spec = (E, K, H, I, True)
    weights = bench.make_weights(E, H, I, True, torch.device("cpu"))
    tokens = {T: bench.make_tokens(2, T, E, K, H, torch.device("cpu"), seed=1000 + T) for T in (1, 3)}
    comms = virtual_comms(2, "cpu")
    trace = []
    try:
        timed = bench.time_moeflow(comms, spec, weights, tokens, 2, 1, "auto", rounds=3, trace=trace)
    finally:
        comms[0].group.close()
    assert trace == [(0, 1), (0, 3), (1, 1), (1, 3), (2, 1), (2, 3)]
    for T, (agg, phases) in timed.items():
        assert agg["rounds"] == 3 and len(agg["round_us"]) == 3
        assert agg["min_us"] <= agg["median_us"] <= agg["max_us"]
        assert sorted(agg["round_us"])[1] == agg["median_us"]
        assert set(phases) == {"prepare", "dispatch", "w13", "w2", "combine"}

    out = str(tmp_path)
    assert bench.main(["--smoke", "--backend", "cpu", "--tokens", "1,3", "--rounds", "3", "--no-plots",
                       "--out", out]) == 0
    rec = json.load(open(glob.glob(os.path.join(out, "*_pybench_*.json"))[0]))
    layers = [r for r in rec["rows"] if r["op"] == "layer"]
    assert [r["shape"]["T"] for r in layers] == [1, 3]
    for r in layers:
        v = r["round_us"]
        assert r["rounds"] == 3 and len(v) == 3
        assert (r["min_us"], r["median_us"], r["max_us"]) == (min(v), sorted(v)[1], max(v))
        assert r["time_us"] == r["median_us"]
        assert r["spread"] == pytest.approx((max(v) - min(v)) / sorted(v)[1], abs=1e-4)
        assert r["spread_flagged"] == (r["spread"] > 0.05)
        peer = r["peers"][0]  # the torch peer ran in rounds too
        assert peer["rounds"] == 3 and peer["time_us"] == peer["median_us"] == sorted(peer["round_us"])[1]
    text = capsys.readouterr().out
    data = [ln.split() for ln in text.splitlines() if not ln.startswith("#")]
    assert [d[3] for d in data] == ["1", "3"]
    for d, r in zip(data, layers):  # console: ..., min, max, spread at the end
        assert float(d[-3]) == pytest.approx(r["min_us"], abs=0.051)
        assert float(d[-2]) == pytest.approx(r["max_us"], abs=0.051)
        assert d[-1] == bench.spread_cell(r)
