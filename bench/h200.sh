#!/usr/bin/env bash
# bench/h200.sh — the benchmark set behind docs/PERFORMANCE.md, for one H200 (run from the repo root
# after `make -j16 all lab`). Writes JSON records and logs into DIR and prints a short summary.
#
#   MF_COMMIT=<hash> bash bench/h200.sh DIR [gemm|layer|all]
#
# Everything lands in DIR and in one archive DIR.tgz (the device tool returns a limited number of
# files: take the archive).
#
# gemm:  moeflow bench gemm --quick (library kernels beside cuBLAS dense) + bench/peers.py (torch)
# layer: moeflow bench layer for deepseek-v3, qwen3-235b-a22b and kimi-k2 (R = 8 virtual ranks),
#        fused dataflows beside the unfused path in the same process
set -u
dir=${1:?usage: bench/h200.sh DIR [gemm|layer|all]}
what=${2:-all}
mkdir -p "$dir"
: "${MF_COMMIT:=unknown}"
export MF_COMMIT
rc=0

if [ "$what" = gemm ] || [ "$what" = all ]; then
    timeout 240 ./build/moeflow bench gemm --quick --json "$dir/gemm.json" > "$dir/gemm.log" 2>&1 || rc=1
    timeout 200 python3 bench/peers.py --moeflow "$dir/gemm.json" --out "$dir/gemm_peers.json" > "$dir/peers.log" 2>&1 || rc=1
    grep -E "^ deepseek" "$dir/peers.log" | head -40
fi

if [ "$what" = layer ] || [ "$what" = all ]; then
    for preset in deepseek-v3 qwen3-235b-a22b kimi-k2; do
        timeout 300 ./build/moeflow bench layer --preset "$preset" -R 8 -T 1,8,32,128,512 --dtype fp8 --per-rank \
            --dataflow auto,unfused --no-check --iters 10 --warmup 2 --json "$dir/layer_$preset.json" \
            > "$dir/layer_$preset.log" 2>&1 || rc=1
        grep -E "^ +fp8 +(auto|unfused) +[0-9]+ +[0-9]+ " "$dir/layer_$preset.log" | sed "s/^/$preset /"
    done
    # one rank (no peers to wait for) and prefill-sized T, deepseek-v3 only
    timeout 300 ./build/moeflow bench layer --preset deepseek-v3 -R 1 -E 32 -T 128,4096 --dtype fp8 \
        --dataflow auto,unfused --no-check --iters 5 --warmup 1 --json "$dir/layer_deepseek-v3_R1.json" \
        > "$dir/layer_deepseek-v3_R1.log" 2>&1 || rc=1
    grep -E "^ +fp8 +(auto|unfused) +[0-9]+ +[0-9]+ " "$dir/layer_deepseek-v3_R1.log" | sed "s/^/deepseek-v3 R1 /"
fi
tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
exit $rc
