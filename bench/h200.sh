#!/usr/bin/env bash
# bench/h200.sh — the benchmark set behind docs/PERFORMANCE.md, for one H200 (run from the repo root
# after `make -j16 all lab`). Writes JSON records and logs into DIR and prints a short summary.
#
#   MF_COMMIT=<hash> bash bench/h200.sh DIR [gemm|layer|all]
#
# Everything lands in DIR and in one archive DIR.tgz (the device tool returns a limited number of
# files: take the archive).
#
# gemm:  moeflow bench gemm over its whole sweep (library kernels beside cuBLAS dense), uneven and
#        zipf counts on deepseek-v3, each merged with bench/peers.py (torch) on the same cases
# layer: moeflow bench layer for deepseek-v3, qwen3-235b-a22b and kimi-k2 at R = 8 (virtual ranks)
#        and R = 1, T 1..4096 per rank, the fused dataflow beside the unfused path in one process;
#        gated (device time without host launch gaps, as under CUDA graph replay) unless
#        MF_LAUNCH=eager
set -u
dir=${1:?usage: bench/h200.sh DIR [gemm|layer|all]}
what=${2:-all}
mkdir -p "$dir"
: "${MF_COMMIT:=unknown}"
export MF_COMMIT
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
        timeout 150 ./build/moeflow bench layer --preset "$preset" -R 8 -T 1,8,32,128,512,4096 --dtype fp8 --per-rank $gate \
            --dataflow auto,unfused --no-check --iters 10 --warmup 2 --json "$dir/layer_${preset}_R8.json" \
            > "$dir/layer_${preset}_R8.log" 2>&1 || rc=1
        grep -E "^ +fp8 +(auto|unfused) +[0-9]+ +[0-9]+ " "$dir/layer_${preset}_R8.log" | sed "s/^/$preset R8 /"
    done
    # R = 1: every expert on one rank, no peers to wait for; T = 4096 is the prefill case
    for preset in deepseek-v3 qwen3-235b-a22b kimi-k2; do
        timeout 100 ./build/moeflow bench layer --preset "$preset" -R 1 -T 1,8,32,128,512,4096 --dtype fp8 $gate \
            --dataflow auto,unfused --no-check --iters 10 --warmup 2 --json "$dir/layer_${preset}_R1.json" \
            > "$dir/layer_${preset}_R1.log" 2>&1 || rc=1
        grep -E "^ +fp8 +(auto|unfused) +[0-9]+ +[0-9]+ " "$dir/layer_${preset}_R1.log" | sed "s/^/$preset R1 /"
    done
fi
tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
exit $rc
