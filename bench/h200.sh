#!/usr/bin/env bash
# bench/h200.sh — the benchmark set behind docs/PERFORMANCE.md, for one H200 (run from the repo root
# after `make -j16 all lab`). Writes JSON records and logs into DIR and prints a short summary.
#
#   MF_COMMIT=<hash> bash bench/h200.sh DIR [gemm|layer|transport|balance|rebalance|capacity|smallbatch|small|timeline|targets|ncu|overlap|all]
#
# Everything lands in DIR and in one archive DIR.tgz (the device tool returns a limited number of
# files: take the archive).
#
# gemm:  moeflow bench gemm over its whole sweep (library kernels beside cuBLAS dense), uneven and
#        zipf counts on deepseek-v3, each merged with bench/peers.py (torch) on the same cases
# layer: moeflow bench layer for deepseek-v3, qwen3-235b-a22b and kimi-k2 at R = 8 (virtual ranks)
#        and R = 1, T 1..4096 per rank, the fused dataflow beside the unfused path in one process;
#        gated (device time without host launch gaps; a graph replay can still be a few us faster) unless
#        MF_LAUNCH=eager; every bench here runs 3 rounds (moeflow bench's default since issue 25:
#        ~3x the device time of the single-round records before it)
# transport: the R = 1 layer (deepseek-v3, T 1..4096) over the local transport and over ipc (one
#        rank process), each in its own process; the per-call synchronisation in each (a tiny
#        layer whose time is its syncs: R = 1, 2, 4 as threads and as processes time-sharing the
#        GPU); and deepseek-v3 at R = 8 virtual ranks for the plan that fetches routing once
# balance: balanced EP (issue 16) on CUDA: deepseek-v3, R = 8 virtual ranks, T = 128 and 512 per
#        rank, FP8, each row without and with B = 2 spare slots (mf_moe_prefetch between forwards),
#        under zipf 1.2 routing (what balancing is for) and uniform routing (what it costs when
#        there is nothing to balance); not in `all`
# rebalance: a staged expert map (mf_moe_stage_expert_map, issue 16 item 3) on CUDA: deepseek-v3,
#        R = 8 virtual ranks, T = 128, FP8, zipf 1.2; half of every rank's experts move, 4 per rank
#        per prefetch step; the forward time while staging and not, the step time, bytes per step;
#        not in `all`
# capacity: why a larger capacity S slowed a row (issue 25.3; hypotheses in docs/PERFORMANCE.md
#        "Timing method"): deepseek-v3, R = 1, FP8, gated, 3 rounds each, three processes (~3.5 min):
#        A  T = 512 and 513 (R T K = 4096 / 4104 routing entries: either side of the small plan's
#           bound) at S = T and S = 4096, phase events on and off;
#        B  the sweep that showed it, -T 1,2,4,8,32,128,512,4096 (S = 4096), events on and off;
#        C  A's T = 512 rows under MF_PDL=0 (no programmatic dependent launch: events change nothing).
#        Prints one table: preset, T, S, events, PDL, min / median / max us over the rounds, spread.
#        Not in `all`.
# smallbatch: issue 25's table in one call (~6 min): for deepseek-v3, kimi-k2 and qwen3-235b-a22b at
#        R = 1, FP8, T = 1..512: moeflow bench layer --gated --phases off (C, records carry their
#        routing), python -m moeflow.bench --launch graph against those records (the same routing:
#        moeflow as an engine runs it), then vLLM's Triton path (the layer peer, from
#        ${MF_PEERS:-../shared/peers}; never copied into the repository); table.md: the comparison
#        (bench/summarize.py smallbatch). Not in `all`.
# small: the small-batch kernel's A/B (issue 25 item 1): deepseek-v3, kimi-k2,
#        qwen3-235b-a22b at R = 1, FP8, gated, no phase events, T = 1..8 (where AUTO takes the kernel:
#        at most 64 routed rows, mf__small::kMaxRows), 3 rounds per process; each preset under every
#        MF_SMALL value of MF_SMALL_VALUES (default "4 5": its own plan with the L2 prefetch of a
#        waiting W2 unit, the library's default; 4 with the first unit's rows made from x by idle
#        warps; 0 is the two decode GEMMs
#        and the sum kernel, 1 the small kernel then the sum kernel, 2 the small kernel summing
#        itself, 3 its own plan), the order rotating per preset (~40 s a process on the H200: split
#        them with MF_PRESETS across two calls of the device tool); small_ab.md:
#        bench/summarize.py ab MF_SMALL; MF_PRESETS="a b" runs only those presets (a call of the
#        device tool lasts at most 600 s). Not in `all`.
# timeline: the small kernel's per-CTA stamps (moeflow bench layer --timeline) at T = 1..8 for
#        deepseek-v3, kimi-k2 and qwen3-235b-a22b (MF_PRESETS: only those), under each MF_SMALL value
#        of MF_SMALL_VALUES (default "4 5"; 4 is the library's default), ~3 min:
#        per row the phases' medians, then the late entries and their SMs, the producers' time per
#        W13 and W2 unit and the spread of their walks' ends; every CTA's stamps in
#        timeline_raw.jsonl (--timeline-raw) and timeline.md from them (bench/summarize.py timeline:
#        the W2 units at the seam, mid-walk and last, the CTAs' ends, the SM-time idle at the end).
#        Not in `all`.
# targets: issue 27's targets in one call (~6 min): moeflow bench gemm at M = 256, 1024, 4096 for
#        deepseek-v3 (L 32, 256), kimi-k2 (48, 384), qwen3-235b-a22b (16, 128) beside cuBLAS dense,
#        bench/peers.py (torch) on each record, the R = 1 layer at T = 4096. Not in `all`.
# ncu:   Nsight Compute on the TMA kernel, deepseek-v3 (~1.5 min): four launches' speed of light,
#        memory, compute and warp state, and --set full on FP8 and BF16 W13 at L = 32, M = 4096.
#        Not in `all`.
# overlap: moeflow bench overlap (issue 28: two micro-batches through the split halves beside the
#        pair back to back; deepseek-v3, T = 64, 128, R = 1, 8). Not in `all`.
set -u
dir=${1:?usage: bench/h200.sh DIR [gemm|layer|transport|balance|rebalance|capacity|smallbatch|small|timeline|targets|ncu|overlap|all]}
what=${2:-all}
mkdir -p "$dir"
: "${MF_COMMIT:=unknown}"
export MF_COMMIT
# the card every record names (meta.card): the GPU's, from nvidia-smi, unless MF_CARD says (the
# tools' own default is the label h200: an H100 run of 2026-12-05 was written as h200 that way)
if [ -z "${MF_CARD:-}" ]; then
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    case "$gpu" in
        *H200*) MF_CARD=h200 ;;
        *H100*) MF_CARD=h100 ;;
        *) MF_CARD=$(echo "${gpu:-unknown}" | tr -cs 'A-Za-z0-9' '-' | tr 'A-Z' 'a-z' | sed 's/^-*//; s/-*$//') ;;
    esac
fi
export MF_CARD
rc=0

if [ "$what" = gemm ] || [ "$what" = all ]; then
    # every shape of the sweep with equal counts; then uneven and zipf counts on deepseek-v3
    timeout 330 ./build/moeflow bench gemm --json "$dir/gemm.json" > "$dir/gemm.log" 2>&1 || rc=1
    for counts in uneven zipf; do
        timeout 120 ./build/moeflow bench gemm --model deepseek-v3 --layout expert_major --counts $counts \
            -M 8,64,128,256,1024,4096 --json "$dir/gemm_$counts.json" > "$dir/gemm_$counts.log" 2>&1 || rc=1
    done
    for rec in gemm gemm_uneven gemm_zipf; do
        timeout 300 python3 bench/peers.py --moeflow "$dir/$rec.json" --out "$dir/${rec}_peers.json" \
            > "$dir/${rec}_peers.log" 2>&1 || rc=1
    done
    grep -E "^ deepseek" "$dir/gemm_peers.log" | head -60
fi

if [ "$what" = layer ] || [ "$what" = all ]; then
    gate=--gated
    [ "${MF_LAUNCH:-gated}" = eager ] && gate=
    # R = 8 virtual ranks (time-sharing one GPU), fused dataflow beside the unfused path
    for preset in deepseek-v3 qwen3-235b-a22b kimi-k2; do
        timeout 300 ./build/moeflow bench layer --preset "$preset" -R 8 -T 1,8,32,128,512,4096 --dtype fp8 --per-rank $gate \
            --dataflow auto,unfused --no-check --iters 10 --warmup 2 --json "$dir/layer_${preset}_R8.json" \
            > "$dir/layer_${preset}_R8.log" 2>&1 || rc=1
        grep -E "^ +fp8 +(auto|unfused) +[0-9]+ +[0-9]+ " "$dir/layer_${preset}_R8.log" | sed "s/^/$preset R8 /"
    done
    # R = 1: every expert on one rank, no peers to wait for; T = 4096 is the prefill case
    for preset in deepseek-v3 qwen3-235b-a22b kimi-k2; do
        timeout 200 ./build/moeflow bench layer --preset "$preset" -R 1 -T 1,8,32,128,512,4096 --dtype fp8 $gate \
            --dataflow auto,unfused --no-check --iters 10 --warmup 2 --json "$dir/layer_${preset}_R1.json" \
            > "$dir/layer_${preset}_R1.log" 2>&1 || rc=1
        grep -E "^ +fp8 +(auto|unfused) +[0-9]+ +[0-9]+ " "$dir/layer_${preset}_R1.log" | sed "s/^/$preset R1 /"
    done
fi
if [ "$what" = transport ]; then
    for tr in local ipc; do
        timeout 150 ./build/moeflow bench layer --preset deepseek-v3 -R 1 -T 1,8,128,4096 --dtype fp8 --gated \
            --transport $tr --no-check --iters 10 --warmup 2 --json "$dir/layer_deepseek-v3_R1_$tr.json" \
            > "$dir/layer_deepseek-v3_R1_$tr.log" 2>&1 || rc=1
        grep -E "^ +fp8 +auto +[0-9]+ +[0-9]+ " "$dir/layer_deepseek-v3_R1_$tr.log" | sed "s/^/deepseek-v3 R1 $tr /"
    done
    # the syncs: E 8, K 2, H = I = 128, T = 1: the GEMMs and moves are a few us
    for R in 1 2 4; do
        for tr in local ipc; do
            timeout 120 ./build/moeflow bench layer -R $R -E 8 -K 2 -H 128 -I 128 -T 1 --dtype bf16 --gated \
                --transport $tr --no-check --iters 50 --warmup 5 --timeout-ms 60000 --json "$dir/sync_R${R}_$tr.json" \
                > "$dir/sync_R${R}_$tr.log" 2>&1 || rc=1
            grep -E "^ +bf16 +auto +[0-9]+ +[0-9]+ " "$dir/sync_R${R}_$tr.log" | sed "s/^/sync R$R $tr /"
        done
    done
    timeout 150 ./build/moeflow bench layer --preset deepseek-v3 -R 8 -T 1,128,4096 --dtype fp8 --gated \
        --no-check --iters 10 --warmup 2 --json "$dir/layer_deepseek-v3_R8_local.json" \
        > "$dir/layer_deepseek-v3_R8_local.log" 2>&1 || rc=1
    grep -E "^ +fp8 +auto +[0-9]+ +[0-9]+ " "$dir/layer_deepseek-v3_R8_local.log" | sed "s/^/deepseek-v3 R8 local /"
fi
if [ "$what" = balance ]; then
    for routing in zipf:1.2 uniform; do
        name=balance_deepseek-v3_R8_${routing/:/}
        timeout 150 ./build/moeflow bench layer --preset deepseek-v3 -R 8 -T 128,512 --dtype fp8 --gated \
            --routing "$routing" --balance 2 --no-check --iters 10 --warmup 2 --json "$dir/$name.json" \
            > "$dir/$name.log" 2>&1 || rc=1
        grep -E "^ +fp8 +auto +[0-9]+ +[0-9]+ +[0-9]+ " "$dir/$name.log" | sed "s/^/$routing rows /"
        grep -E "^ +fp8 +auto +[0-9]+ +[0-9]+ +[0-9]+\.[0-9]+ +[0-9]+\.[0-9]+ " "$dir/$name.log" | sed "s/^/$routing balance /"
    done
    # the short table: per routing and T, B = 0 beside B = 2 (cost = time_on / time_off - 1)
    python3 - "$dir" <<'PY' || rc=1
import json, sys, os
d = sys.argv[1]
print("# balance summary: deepseek-v3 R=8 fp8 (virtual ranks on one H200: time = all ranks' work)")
print("%-9s %5s %9s %9s %7s %8s %8s %8s %8s %7s %7s %12s %10s %8s %9s" % ("routing", "T", "off_us", "on_us",
      "cost", "disp0", "disp2", "gemm0", "gemm2", "mx/mn0", "mx/mn2", "moved_first", "moved_last", "pf_ms", "model_on"))
for routing in ("zipf1.2", "uniform"):
    path = os.path.join(d, "balance_deepseek-v3_R8_%s.json" % routing)
    if not os.path.exists(path):
        print("%-9s (no record)" % routing)
        continue
    rows = [r for r in json.load(open(path))["rows"] if r["op"] == "layer"]
    for T in sorted({r["shape"]["T"] for r in rows}):
        off = [r for r in rows if r["shape"]["T"] == T and "balance" not in r]
        on = [r for r in rows if r["shape"]["T"] == T and "balance" in r]
        if not off or not on:
            print("%-9s %5d (a row failed: see the log)" % (routing, T))
            continue
        a, b = off[0], on[0]
        bb = b["balance"]
        pa, pb = a.get("phases_us", {}), b.get("phases_us", {})
        g = lambda ph: ph.get("w13", 0) + ph.get("w2", 0)
        print("%-9s %5d %9.1f %9.1f %6.1f%% %8.1f %8.1f %8.1f %8.1f %7.3f %7.3f %12d %10d %8.3f %9.1f" % (routing, T,
              a["time_us"], b["time_us"], 100.0 * (b["time_us"] / a["time_us"] - 1), pa.get("dispatch", 0),
              pb.get("dispatch", 0), g(pa), g(pb), bb["rank_max_over_mean_home"], bb["rank_max_over_mean"],
              bb["moved_first_bytes"], bb["moved_last_bytes"], bb["prefetch_ms"], bb.get("model_us", 0)))
PY
fi
if [ "$what" = rebalance ]; then
    name=rebalance_deepseek-v3_R8_zipf1.2
    timeout 150 ./build/moeflow bench layer --preset deepseek-v3 -R 8 -T 128 --dtype fp8 --gated \
        --routing zipf:1.2 --rebalance 4 --no-check --iters 20 --warmup 2 --json "$dir/$name.json" \
        > "$dir/$name.log" 2>&1 || rc=1
    grep -E "^#dtype +dataflow +T +B +steps" "$dir/$name.log" | sed "s/^#/rebalance /"
    grep -E "^ +fp8 +auto +128 +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+\.[0-9]" "$dir/$name.log" | sed "s/^/rebalance /"
    tail -1 "$dir/$name.log"
fi
if [ "$what" = small ]; then
    common=(-R 1 --dtype fp8 --gated --phases off --no-check --rounds 3 -T 1,2,4,8)
    values=(${MF_SMALL_VALUES:-4 5})
    n=0
    for preset in ${MF_PRESETS:-deepseek-v3 kimi-k2 qwen3-235b-a22b}; do
        for k in "${!values[@]}"; do
            v=${values[$(((k + n) % ${#values[@]}))]}
            MF_SMALL=$v timeout 150 ./build/moeflow bench layer --preset $preset "${common[@]}" \
                --json "$dir/small_${preset}_$v.json" > "$dir/small_${preset}_$v.log" 2>&1 || rc=1
        done
        n=$((n + 1))
    done
    recs=()
    for v in "${values[@]}"; do recs+=("$dir"/small_*_"$v".json); done
    python3 bench/summarize.py ab MF_SMALL "${recs[@]}" | tee "$dir/small_ab.md" || rc=1
fi

if [ "$what" = timeline ]; then
    # where the small kernel's time goes, per CTA (moeflow bench layer --timeline), under each switch
    # of MF_SMALL_VALUES (default 4 and 5: the library's default, 4 with the first unit's rows
    # from x):
    # deepseek-v3, kimi-k2 (deepseek-v3's shapes at E = 384) and qwen3-235b-a22b (MF_PRESETS: only
    # those), T = 1..8, one round
    for preset in ${MF_PRESETS:-deepseek-v3 kimi-k2 qwen3-235b-a22b}; do
        for v in ${MF_SMALL_VALUES:-4 5}; do
            MF_SMALL=$v timeout 120 ./build/moeflow bench layer --preset $preset -R 1 --dtype fp8 --gated \
                --phases off --no-check --rounds 1 -T 1,2,4,8 --timeline-raw "$dir/timeline_raw.jsonl" \
                > "$dir/timeline_${preset}_$v.log" 2>&1 || rc=1
            grep -E "^# timeline|^# +late entries" "$dir/timeline_${preset}_$v.log" | sed "s/^/$preset MF_SMALL=$v /"
        done
    done
    python3 bench/summarize.py timeline "$dir/timeline_raw.jsonl" | tee "$dir/timeline.md" || rc=1
fi

if [ "$what" = capacity ]; then
    common=(--preset deepseek-v3 -R 1 --dtype fp8 --gated --no-check --rounds 3 --iters 10 --warmup 3 --phases on,off)
    timeout 110 ./build/moeflow bench layer "${common[@]}" -T 512,513 -S T,4096 \
        --json "$dir/capacity_A.json" > "$dir/capacity_A.log" 2>&1 || rc=1
    timeout 200 ./build/moeflow bench layer "${common[@]}" -T 1,2,4,8,32,128,512,4096 \
        --json "$dir/capacity_B.json" > "$dir/capacity_B.log" 2>&1 || rc=1
    MF_PDL=0 timeout 80 ./build/moeflow bench layer "${common[@]}" -T 512 -S 512,4096 \
        --json "$dir/capacity_C_pdl0.json" > "$dir/capacity_C_pdl0.log" 2>&1 || rc=1
    python3 bench/summarize.py capacity "$dir/capacity_A.json" "$dir/capacity_B.json" "$dir/capacity_C_pdl0.json" \
        | tee "$dir/capacity_summary.txt" || rc=1
fi
if [ "$what" = smallbatch ]; then
    tokens=1,2,4,8,16,32,64,128,256,512
    presets=(deepseek-v3 kimi-k2 qwen3-235b-a22b)
    crec=()
    for P in "${presets[@]}"; do
        timeout 200 ./build/moeflow bench layer --preset "$P" -R 1 -T $tokens --dtype fp8 --gated --phases off \
            --no-check --json "$dir/c_$P.json" > "$dir/c_$P.log" 2>&1 || rc=1
        crec+=("$dir/c_$P.json")
    done
    PYTHONPATH=python MOEFLOW_LIB=build/libmoeflow.so timeout 240 python3 -m moeflow.bench \
        --presets "$(IFS=,; echo "${presets[*]}")" --tokens $tokens --launch graph --flush off --no-peers \
        --no-plots --c-record "${crec[@]}" --out "$dir" > "$dir/pybench_graph.log" 2>&1 || rc=1
    OUT="$dir/peer" timeout 300 bash "${MF_PEERS:-../shared/peers}/run_layer_peers.sh" \
        --presets "$(IFS=,; echo "${presets[*]}")" --tokens $tokens --budget-s 240 > "$dir/peer.log" 2>&1 || rc=1
    sed -n '/^# vs C/,$p' "$dir/pybench_graph.log"
    tail -30 "$dir/peer.log"
    python3 bench/summarize.py smallbatch "$dir" > "$dir/table.md" 2>&1 || rc=1
    cat "$dir/table.md"
fi
if [ "$what" = targets ]; then
    # issue 27's targets: M >= 256 at L at EP8 and at R = 1, beside cuBLAS dense (same process) and
    # torch (peers.py, same call); then the R = 1 layer at T = 4096. Build every tree first: a build
    # on the device's CPUs during this run spoiled rows of the a545663 record.
    for pl in "deepseek-v3 32,256" "kimi-k2 48,384" "qwen3-235b-a22b 16,128"; do
        set -- $pl
        timeout 150 ./build/moeflow bench gemm --model "$1" -L "$2" -M 256,1024,4096 --layout expert_major --iters 10 \
            --warmup 2 --json "$dir/gemm_$1.json" > "$dir/gemm_$1.log" 2>&1 || rc=1
        timeout 120 python3 bench/peers.py --moeflow "$dir/gemm_$1.json" --out "$dir/gemm_$1_peers.json" --iters 10 \
            --warmup 2 > "$dir/gemm_$1_peers.log" 2>&1 || rc=1
    done
    for preset in deepseek-v3 kimi-k2 qwen3-235b-a22b; do
        timeout 60 ./build/moeflow bench layer --preset "$preset" -R 1 -T 4096 --dtype fp8 --gated --no-check --iters 10 \
            --warmup 2 --json "$dir/layer4096_$preset.json" > "$dir/layer4096_$preset.log" 2>&1 || rc=1
        grep -E "^ +fp8 +auto +4096 " "$dir/layer4096_$preset.log" | sed "s/^/$preset /"
    done
fi
if [ "$what" = ncu ]; then
    # Nsight Compute on one TMA launch per case (deepseek-v3): speed of light, memory, compute, warp
    # state; `--set full` for the two W13 cases at L = 32, M = 4096
    for c in "fp8 w13 32 4096" "bf16 w13 32 4096" "fp8 w2 32 4096" "fp8 w13 256 256"; do
        set -- $c
        timeout 60 ncu --clock-control none -k regex:sm90_tma_kernel -c 1 --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
            ./build/moeflow bench gemm --model deepseek-v3 --dtype "$1" --op "$2" -L "$3" -M "$4" --layout expert_major \
            --iters 1 --warmup 0 --no-cublas > "$dir/ncu_$1_$2_$3_$4.txt" 2>&1 || rc=1
        grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|L2 Hit Rate" "$dir/ncu_$1_$2_$3_$4.txt" |
            sed "s/^/$1 $2 L$3 M$4 /"
    done
    for dt in fp8 bf16; do
        timeout 120 ncu --clock-control none -k regex:sm90_tma_kernel -c 1 --set full ./build/moeflow bench gemm \
            --model deepseek-v3 --dtype $dt --op w13 -L 32 -M 4096 --layout expert_major --iters 1 --warmup 0 --no-cublas \
            > "$dir/ncufull_${dt}_w13_32_4096.txt" 2>&1 || rc=1
    done
fi
if [ "$what" = overlap ]; then
    timeout 240 ./build/moeflow bench overlap --json "$dir/overlap.json" > "$dir/overlap.log" 2>&1 || rc=1
    cat "$dir/overlap.log"
fi
tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
exit $rc
