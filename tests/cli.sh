#!/usr/bin/env bash
# tests/cli.sh MOEFLOW — the `moeflow` command's exit statuses and early checks (README "The
# `moeflow` command"): 0 ok, 1 a check failed, 2 usage or a request this machine cannot serve, 3 an
# I/O or system failure. Runs a few tiny CPU problems; a few seconds in all. The cases that need a
# machine without a CUDA GPU (what CI has) SKIP where one is present.
set -uo pipefail
cli=${1:?usage: tests/cli.sh MOEFLOW}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tiny=(-R 2 -E 4 -K 2 -H 128 -I 128 -T 2) # a problem every backend runs in well under a second
failed=0 passed=0 skipped=0
limit=60 # seconds a case may take (a regression must not hang the suite)

# expect NAME STATUS [GREP_STDOUT_AND_STDERR] -- ARGS...: runs $cli ARGS, checks the status and,
# where given, that the output matches the extended regexp.
expect() {
    local name=$1 want=$2 pattern=$3
    shift 4
    timeout "$limit" "$cli" "$@" > "$tmp/out" 2>&1
    local got=$?
    if [ "$got" != "$want" ]; then
        echo "cli: FAIL $name: exit $got, expected $want: moeflow $*"
        sed 's/^/cli:   | /' "$tmp/out" | tail -8
        failed=$((failed + 1))
    elif [ -n "$pattern" ] && ! grep -qE -- "$pattern" "$tmp/out"; then
        echo "cli: FAIL $name: exit $got as expected, but the output does not match /$pattern/: moeflow $*"
        sed 's/^/cli:   | /' "$tmp/out" | tail -8
        failed=$((failed + 1))
    else
        passed=$((passed + 1))
    fi
}

fail() { echo "cli: FAIL $1"; failed=$((failed + 1)); }

# ---- 0: it ran, and passed -------------------------------------------------------------------
expect version 0 '^moeflow [0-9]+\.[0-9]+\.[0-9]+ \(libmoeflow [0-9]+\.[0-9]+\.[0-9]+' -- --version
expect help 0 'MF_TIMEOUT_MS' -- --help
grep -qE -- '--memory-limit' "$tmp/out" && grep -qE -- '--version' "$tmp/out" && grep -q 'Exit status' "$tmp/out" \
    || fail "help: --memory-limit, --version or the exit statuses are missing"
expect run 0 '^# PASS' -- run "${tiny[@]}" --backend cpu --json "$tmp/run.json"
[ -s "$tmp/run.json" ] && grep -q '"rows": \[' "$tmp/run.json" || fail "run: --json wrote no record"

# ---- bench in rounds (issue 25.3): the whole sweep once per round, min / median / max, spread flag
expect bench_rounds 0 '^# spread   [0-9]+ of 8 rows above 5%' -- \
    bench "${tiny[@]}" -T 1,2 -S T,4 --phases on,off --rounds 3 --dtype fp8 --backend cpu --json "$tmp/bench.json"
cp "$tmp/out" "$tmp/bench.out"
grep -qE '^#dtype .* S +events +time +min +max +spread' "$tmp/bench.out" \
    || fail "bench_rounds: the header lacks the S, events, min, max and spread columns"
# Separated rounds: every round runs all 8 rows, and round k + 1 starts only after round k ended.
sed -nE 's|^# round ([0-9]+)/3 .*|\1|p' "$tmp/bench.out" | tr '\n' ' ' \
    | grep -qx '1 1 1 1 1 1 1 1 2 2 2 2 2 2 2 2 3 3 3 3 3 3 3 3 ' \
    || fail "bench_rounds: the per-round lines are not 3 rounds of the whole 8-row sweep, one after the other"
if command -v python3 > /dev/null 2>&1; then
    python3 - "$tmp/bench.json" "$tmp/bench.out" > "$tmp/py.out" 2>&1 <<'PY' || { fail "bench_rounds JSON: $(tail -1 "$tmp/py.out")"; }
import json, re, sys
rec = json.load(open(sys.argv[1]))
assert {"card", "date", "commit", "command", "backend"} <= set(rec["meta"]), rec["meta"]
layer = [r for r in rec["rows"] if r["op"] == "layer"]
assert [(r["shape"]["T"], r["shape"]["S"], r["phase_events"]) for r in layer] == [
    (1, 1, 1), (1, 1, 0), (1, 4, 1), (1, 4, 0), (2, 2, 1), (2, 2, 0), (2, 4, 1), (2, 4, 0)], layer
# the console's per-round times of each row, in sweep order
rounds = {}
for ln in open(sys.argv[2]):
    m = re.match(r"# round (\d)/3  fp8 auto T (\d+) S (\d+) events (on|off): ([0-9.]+) us", ln)
    if m:
        rounds.setdefault((int(m[2]), int(m[3]), m[4] == "on"), []).append(float(m[5]))
for r in layer:
    v = r["round_us"]
    assert r["rounds"] == 3 and len(v) == 3 and all(x > 0 for x in v), r
    got = rounds[(r["shape"]["T"], r["shape"]["S"], bool(r["phase_events"]))]
    assert all(abs(a - b) <= 0.051 + 1e-6 * b for a, b in zip(got, v)), (got, v)  # console prints 0.1 us
    lo, med, hi = sorted(v)
    assert r["min_us"] == lo and r["max_us"] == hi and r["median_us"] == med and r["time_us"] == med, r
    assert abs(r["spread"] - (hi - lo) / med) <= 1e-5 * max(1.0, r["spread"]), r
    assert r["spread_flagged"] == (r["spread"] > 0.05), r
    assert ("phases_us" in r) == bool(r["phase_events"]), r
phase_rows = [r for r in rec["rows"] if r["op"] in ("prepare", "dispatch", "w13", "w2", "combine")]
assert len(phase_rows) == 5 * 4 and all(r["phase_events"] == 1 for r in phase_rows), len(phase_rows)
print("ok")
PY
else
    echo "cli: SKIP bench_rounds JSON checks (no python3)"
    skipped=$((skipped + 1))
fi
expect bench_one_round 0 '^# rounds   1:' -- bench "${tiny[@]}" --rounds 1 --dtype fp8 --backend cpu --json "$tmp/one.json"
grep -q '^# round 1/1' "$tmp/out" && fail "bench_one_round: per-round lines with one round"
grep -qE '"rounds": 1, "round_us": \[[0-9.e+-]+\], .*"spread": null, "spread_flagged": false' "$tmp/one.json" \
    || fail "bench_one_round: the record lacks rounds 1 with a null spread"
expect bench_comm_rounds 0 '^# spread   [0-9]+ of 2 rows above' -- \
    bench "${tiny[@]}" --op comm --rounds 2 --dtype fp8 --backend cpu

# ---- 2: usage ----------------------------------------------------------------------------------
expect unknown_flag 2 "unknown option '--bogus'" -- run --bogus
expect unknown_command 2 "unknown command" -- frobnicate
expect bad_value 2 'outside' -- run -R 0
expect bad_combination 2 'multiple of -R' -- run -R 3 -E 4 --json "$tmp/not_made.json"
expect bad_rounds 2 "--rounds: 0 is outside" -- bench "${tiny[@]}" --rounds 0
expect run_rounds 2 '--rounds is for bench' -- run "${tiny[@]}" --rounds 3
expect capacity_below_T 2 '-S 1 is below -T 2' -- bench "${tiny[@]}" -S T,1
expect run_capacities 2 'run takes one -S' -- run "${tiny[@]}" -S 2,4
expect bad_phases 2 "--phases: 'maybe' is not on or off" -- bench "${tiny[@]}" --phases on,maybe
expect timeline_not_here 2 '--timeline is for bench of the layer on CUDA at R = 1' -- bench "${tiny[@]}" --backend cpu --timeline
expect timeline_raw_not_here 2 '--timeline is for bench of the layer on CUDA at R = 1' -- bench "${tiny[@]}" --backend cpu \
    --timeline-raw "$tmp/not_made.jsonl"
[ ! -e "$tmp/not_made.jsonl" ] || fail "timeline_raw_not_here: a refused --timeline-raw left $tmp/not_made.jsonl behind"
[ ! -e "$tmp/not_made.json" ] || fail "bad_combination: the --json check left $tmp/not_made.json behind"

# ---- the memory check: a limit that nothing fits, the fp8 hint only for BF16, no check -----------
expect memory_fp8 2 'more than the --memory-limit of' -- run "${tiny[@]}" --dtype fp8 --memory-limit 0.000001
grep -q -- '--dtype fp8' "$tmp/out" && fail "memory_fp8: the --dtype fp8 hint is printed for an fp8 problem"
expect memory_bf16 2 '--dtype fp8 \(half the weight bytes\)' -- run "${tiny[@]}" --dtype bf16 --memory-limit 0.000001
expect memory_off 0 '^# memory .*no check' -- run "${tiny[@]}" --backend cpu --memory-limit 0
expect memory_default 0 '^# memory .*of (MemAvailable|free pages) ' -- run "${tiny[@]}" --backend cpu
if want_kb=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo 2>/dev/null) && [ -n "$want_kb" ]; then
    # The figure the check used is the kernel's MemAvailable (within what other processes change).
    got_gb=$(sed -nE 's/^# memory .*of MemAvailable ([0-9.]+) GB\)$/\1/p' "$tmp/out")
    awk -v got="$got_gb" -v want="$want_kb" 'BEGIN { w = want * 1024 / 1e9; d = got - w; if (d < 0) d = -d;
        exit !(got != "" && d <= 0.2 * w + 1) }' \
        || fail "memory_default: the check read ${got_gb:-nothing} GB; /proc/meminfo says MemAvailable $want_kb kB"
fi

# ---- 3: I/O, before any work --------------------------------------------------------------------
# deepseek-v3 draws GBs of weights for a minute before the run; the refusal must come at once.
start=$(date +%s)
limit=10
expect json_missing_dir 3 "--json $tmp/no/such/dir/x.json: No such file" -- \
    run --preset deepseek-v3 --json "$tmp/no/such/dir/x.json"
limit=60
[ $(($(date +%s) - start)) -le 5 ] || fail "json_missing_dir: took $(($(date +%s) - start)) s (not before the run)"
expect json_directory 3 "--json $tmp: Is a directory" -- run "${tiny[@]}" --json "$tmp"
if [ "$(id -u)" != 0 ]; then # root writes anyway
    : > "$tmp/read_only.json"
    chmod 444 "$tmp/read_only.json"
    expect json_read_only 3 'Permission denied' -- run "${tiny[@]}" --json "$tmp/read_only.json"
else
    echo "cli: SKIP json_read_only (running as root)"
    skipped=$((skipped + 1))
fi

# bench overlap's flags (a build without CUDA refuses before it reads them)
expect bench_overlap_R 2 'R must divide E = 256|needs a CUDA GPU' -- bench overlap -R 3
expect bench_overlap_T 2 '-T: a list of T >= 1|needs a CUDA GPU' -- bench overlap -T 0
expect bench_overlap_flag 2 "unknown option '--nope'|needs a CUDA GPU" -- bench overlap --nope 1
expect bench_gemm_family 2 "--family: 'any' is not auto, decode or tma|this build has no CUDA" -- bench gemm --family any
if "$cli" bench gemm --dry-run --model qwen3-235b-a22b -M 32 > /dev/null 2>&1; then # a build with CUDA
    expect bench_gemm_family_dry 0 '^# family   tma at every M' -- \
        bench gemm --family tma --dry-run --model qwen3-235b-a22b -M 32
else
    echo "cli: SKIP bench_gemm_family_dry (this build has no CUDA)"
    skipped=$((skipped + 1))
fi

# ---- 2: what this machine cannot serve: a CUDA GPU ----------------------------------------------
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q '^GPU '; then
    echo "cli: SKIP bench_gemm_no_gpu, bench_overlap_no_gpu, backend_cuda_no_gpu (a GPU is present)"
    skipped=$((skipped + 3))
else
    expect bench_gemm_no_gpu 2 '^moeflow bench gemm: needs a CUDA GPU' -- bench gemm
    expect bench_overlap_no_gpu 2 '^moeflow bench overlap: needs a CUDA GPU' -- bench overlap -T 4 --preset tiny
    expect backend_cuda_no_gpu 2 '^moeflow: --backend cuda: ' -- run "${tiny[@]}" --backend cuda
fi

echo "cli: $passed passed, $failed failed, $skipped skipped ($cli)"
[ "$failed" = 0 ]
