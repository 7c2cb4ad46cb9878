"""bench/summarize.py timeline: the small-batch kernel's raw stamps (`moeflow bench layer
--timeline-raw`) turned into the unit, end and idle numbers, on a run whose answer is known."""
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "bench", "summarize.py")

# Three CTAs, ns after the first entry: [block, SM, entry, tables, first position, end, publish,
# [[unit, kind (0 W13, 1 W2, 2 past the end), ticket time] ...]]
RUN = {
    "preset": "deepseek-v3", "dtype": "fp8", "T": 1, "S": 512, "events": 0, "round": 0, "MF_SMALL": "5",
    "MF_DECODE_TOKENS": "",
    "ctas": [
        [0, 10, 0, 1000, 2000, 50000, 0,
         [[0, 0, 3000], [130, 1, 20000], [140, 1, 30000], [150, 1, 38000], [160, 2, 45000]]],
        [1, 11, 500, 1200, 2500, 25000, 0, [[128, 1, 1500], [132, 1, 12000], [170, 2, 20000]]],
        [2, 12, 800, 1500, 3000, 60000, 0, [[1, 0, 2500], [171, 2, 52000]]],
    ],
}


def load():
    spec = importlib.util.spec_from_file_location("summarize", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_timeline_row_numbers():
    r = load().timeline_row(RUN)
    assert r["ctas"] == 3 and r["span"] == 60.0
    assert r["stream"] == 2.5  # first positions 2.0, 2.5, 3.0
    assert r["w13"] == (49.5, 49.5, 2)  # 17 and 49.5 us (CTA 2's only unit runs to its end ticket)
    assert r["seam"] == (10.5, 2)  # CTA 0's first W2 after its W13 (10 us), CTA 1's first unit (10.5)
    assert r["mid"] == (8.0, 1)  # CTA 0's W2 after a W2, not its last
    assert r["last"] == (8.0, 2)  # the units before the end tickets: 7 and 8 us
    assert r["halves"] == (None, 0)  # no half W2 unit (kind 3) in this run
    assert r["ends"] == (25.0, 50.0, 60.0, 60.0)
    assert abs(r["idle"][0] - 15.0) < 1e-9  # (10 + 35 + 0) / 3
    assert abs(r["idle"][1] - 25.0) < 1e-9  # 45 of 180 SM-us


def test_timeline_halves():
    """The removed halves switch's W2 units (kind 3, in its records): W2 for the seam / mid / last split, and in `halves`."""
    run = dict(RUN, ctas=[[0, 10, 0, 1000, 2000, 30000, 0,
                           [[0, 0, 3000], [130, 3, 20000], [131, 3, 24000], [132, 2, 28000]]]])
    r = load().timeline_row(run)
    assert r["w13"] == (17.0, 17.0, 1) and r["seam"] == (4.0, 1) and r["last"] == (4.0, 1) and r["mid"] == (None, 0)
    assert r["halves"] == (4.0, 2)


def test_timeline_table(tmp_path):
    raw = tmp_path / "t.jsonl"
    raw.write_text(json.dumps(RUN) + "\n\n" + json.dumps(dict(RUN, round=1)) + "\n")
    out = subprocess.run([sys.executable, SCRIPT, "timeline", str(raw)], check=True, capture_output=True,
                         text=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| deepseek-v3 ")]
    assert len(rows) == 2
    assert "| 5 | 0 | 3 | 60.0 |" in rows[0] and "| 5 | 1 | 3 | 60.0 |" in rows[1]
    assert "15.0 (25.0 %)" in rows[0]
