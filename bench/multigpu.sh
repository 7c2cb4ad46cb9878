#!/usr/bin/env bash
# bench/multigpu.sh — the multi-GPU benchmark set of issue 17 (EP across GPUs, one process per GPU),
# run from the repo root after `make -j16 all`. Writes JSON records (bench/results schema: card,
# date, command, commit) and logs into DIR, one archive DIR.tgz, and prints a table last.
#
#   MF_COMMIT=<hash> bash bench/multigpu.sh DIR [comm|layer|all]
#   MF_TRANSPORTS="ipc" MF_PRESETS="deepseek-v3" ... to run a part (the full set on 8 GPUs is more
#   than one 10-minute device call: e.g. `comm`, then `layer` once per transport)
#
# It counts the GPUs (nvidia-smi -L). With N >= 2 it measures, over the ipc transport and over the
# nccl transport, R = N ranks, one process per GPU (rank r on GPU r):
#   comm   mf_dispatch and mf_combine alone (FP8 dispatch, BF16 combine), deepseek-v3 routing shape
#          (E 256, K 8, H 7168; I 128: the expert size plays no part without GEMMs), T = 128 per
#          rank (latency, us) and T = 4096 (GB/s per rank counted as DeepEP counts: every top-k
#          selection moves H + H/128*4 + 16 bytes dispatched, 2H combined)
#   layer  the whole layer for deepseek-v3, kimi-k2 and qwen3-235b-a22b, T 1..4096 per rank, the
#          fused dataflow beside the unfused path, with the floor of the busiest rank's share
#          (floor/rk: its routed experts' weights at 4.24 TB/s, or its FLOPs at the dense peak)
# All gated (device time without host launch gaps, as under CUDA graph replay). NVLink multicast
# stays off (NCCL_NVLS_ENABLE=0, also set by the CLI).
#
# With one GPU it is a DRY RUN, labelled so in every line it prints: R = 2 processes share GPU 0
# over ipc (time-sliced: the times measure the sharing, not a link), the nccl transport at R = 1
# (NCCL refuses two ranks on one GPU), E 16 instead of the presets' experts, small T lists and few
# iterations: every path of this script in about 2 minutes, numbers meaningless.
set -u
dir=${1:?usage: bench/multigpu.sh DIR [comm|layer|all]}
what=${2:-all}
mkdir -p "$dir"
: "${MF_COMMIT:=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export MF_COMMIT
export NCCL_NVLS_ENABLE=0
cli=./build/moeflow
[ -x "$cli" ] || { echo "multigpu: $cli not built (make -j16 all)"; exit 2; }

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
ngpu=${ngpu:-0}
if [ "$ngpu" -ge 2 ]; then
    mode=full
    R=$ngpu
    export MF_CARD=${MF_CARD:-h200x$ngpu}
    transports=${MF_TRANSPORTS:-ipc nccl}
    comm_T=128,4096
    comm_iters="--iters 50 --warmup 10"
    layer_T=1,8,32,128,512,4096
    layer_iters="--iters 10 --warmup 2"
    shrink=""
    tmo=300
else
    mode=DRY-RUN
    R=2
    export MF_CARD=${MF_CARD:-h200}
    transports=${MF_TRANSPORTS:-ipc nccl}  # nccl runs at R = 1 below
    comm_T=8,128
    comm_iters="--iters 3 --warmup 1"
    layer_T=1,8,128
    layer_iters="--iters 2 --warmup 1"
    shrink="-E 16"         # the presets' shapes with 16 experts (weights drawn in seconds)
    tmo=100
fi
echo "# multigpu: $mode: $ngpu GPU(s) seen by nvidia-smi; R = $R; transports: $transports; commit $MF_COMMIT; card $MF_CARD"
[ "$mode" = DRY-RUN ] && echo "# multigpu: DRY RUN: one GPU: rank processes time-share it; these numbers are NOT multi-GPU results"
{
    echo "mode $mode"
    echo "gpus $ngpu"
    nvidia-smi -L 2>/dev/null
    nvidia-smi topo -m 2>/dev/null
} > "$dir/machine.txt"
rc=0

# R for a transport: every rank its own GPU for nccl (R = 1 in the dry run)
ranks_for() { if [ "$1" = nccl ] && [ "$ngpu" -lt "$R" ]; then echo 1; else echo "$R"; fi; }

if [ "$what" = comm ] || [ "$what" = all ]; then
    for tr in $transports; do
        r=$(ranks_for $tr)
        name=comm_deepseek-v3_R${r}_$tr
        timeout $tmo $cli bench --op comm --preset deepseek-v3 -I 128 -R "$r" -T $comm_T --dtype fp8 --gated \
            --transport $tr $comm_iters --json "$dir/$name.json" > "$dir/$name.log" 2>&1 || { rc=1; tail -3 "$dir/$name.log"; }
        grep -E "^ +fp8 +(dispatch|combine) " "$dir/$name.log" | sed "s/^/$mode $name /"
    done
fi

if [ "$what" = layer ] || [ "$what" = all ]; then
    for tr in $transports; do
        r=$(ranks_for $tr)
        for preset in ${MF_PRESETS:-deepseek-v3 kimi-k2 qwen3-235b-a22b}; do
            [ "$mode" = DRY-RUN ] && [ "$tr" = nccl ] && [ "$preset" != deepseek-v3 ] && continue  # one is enough
            name=layer_${preset}_R${r}_$tr
            # shellcheck disable=SC2086
            timeout $tmo $cli bench layer --preset "$preset" $shrink -R "$r" -T $layer_T --dtype fp8 --gated \
                --dataflow auto,unfused --no-check --transport $tr $layer_iters --per-rank \
                --json "$dir/$name.json" > "$dir/$name.log" 2>&1 || { rc=1; tail -3 "$dir/$name.log"; }
            grep -E "^ +fp8 +(auto|unfused) +[0-9]+ +[0-9]+ " "$dir/$name.log" | sed "s/^/$mode $name /"
        done
    done
fi

# The table: every record of this run, beside the issue's targets and the published figures.
python3 - "$dir" "$mode" > "$dir/table.txt" <<'EOF' || rc=1
import glob, json, os, sys
d, mode = sys.argv[1], sys.argv[2]
print(f"# multigpu table ({mode}{': rank processes time-sharing ONE GPU, not multi-GPU numbers' if mode != 'full' else ''})")
print("# targets (issue 17, EP8): dispatch <= 30 us, combine <= 45 us at T 128; >= 400 GB/s at T 4096;"
      " deepseek-v3 fused layer <= 400 us at T 128")
print("# published (Hopper): DeepEP LL EP8 on H20 dispatch 37 us / combine 59 us; intranode 320-380 GB/s;"
      " fused EP8 deepseek-v3 on 8 H200 at T 128: 490 us fused, 562 us dispatch + GEMM + combine")
print(f"{'record':<36} {'op':>13} {'T':>5} {'us':>9} {'GB/s':>7} {'floor/rk':>9} {'x floor':>7}")
for f in sorted(glob.glob(os.path.join(d, "*.json"))):
    try:
        rec = json.load(open(f))
    except Exception as e:
        print(f"{os.path.basename(f):<36} unreadable: {e}")
        continue
    for r in rec["rows"]:
        if r["op"] not in ("dispatch", "combine", "layer", "layer_unfused"):
            continue
        fr = r.get("floor_rank_us")
        x = f"{r['time_us'] / fr:7.2f}" if fr else f"{'-':>7}"
        frs = f"{fr:9.1f}" if fr else f"{'-':>9}"
        gb = f"{r['gbps']:7.1f}" if r["op"] in ("dispatch", "combine") else f"{'-':>7}"
        print(f"{os.path.basename(f)[:-5]:<36} {r['op']:>13} {r['shape']['T']:>5} {r['time_us']:9.1f} {gb} {frs} {x}")
EOF
cat "$dir/table.txt"
tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
exit $rc
