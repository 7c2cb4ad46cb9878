#!/usr/bin/env python3
"""vllm_layer.py — moeflow as the MoE kernel of a real vLLM 0.33 MoE layer, one rank per process.

Each process joins vLLM's distributed environment (gloo here; NCCL on GPUs), with expert
parallelism over R ranks, and builds vLLM's own MoE layer (FusedMoEFactory -> RoutedExperts, which
decides the placement: its expert_map and local experts). After its weights are loaded, one call
puts moeflow in:

    comm = moeflow.vllm.comm_from_ep_group()           # moeflow's comm over vLLM's EP group
    kernel = moeflow.vllm.install(routed_experts, comm, mode="layer")   # or mode="dispatch"

and vLLM's forward (routed_experts.forward_modular(x, topk_weights, topk_ids)) runs moeflow:
  --mode layer     the whole EP layer in one collective (MoeflowLayerExperts);
  --mode dispatch  moeflow's dispatch and combine around moeflow's grouped GEMMs
                   (MoeflowPrepareAndFinalize + MoeflowExperts).
--dtype fp8 builds the kernel from vLLM's block-FP8 quant config (fp8_w8a8_moe_quant_config with
128 x 128 weight blocks) with moeflow.vllm.make_kernel instead, since a real FP8 layer needs a
checkpoint. Every rank checks y against the fp64 reference and prints PASS or FAIL; exit status 0
when every rank matched.

    python3 examples/vllm_layer.py                          # 2 processes, CPU, BF16, both modes
    python3 examples/vllm_layer.py -R 4 -E 10 --placement round_robin --idle 1
"""
import argparse
import os
import socket
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # this example runs on the CPU backend
try:
    import moeflow  # noqa: F401
except ImportError:  # run from a checkout: python/ beside examples/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import torch
import torch.multiprocessing as mp

PREFIX = "model.layers.3.mlp"


def rank_main(rank, a, port):
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    from moeflow import reference, weights
    from moeflow import vllm as mv

    R, E, K, H, I = a.ranks, a.experts, a.topk, a.hidden, a.inter
    tokens = [0 if r == a.idle else a.tokens + 3 * r for r in range(R)]
    fp8 = a.dtype == "fp8"
    cfg = VllmConfig(parallel_config=ParallelConfig(enable_expert_parallel=True,
                                                    expert_placement_strategy=a.placement))
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(world_size=R, rank=rank, local_rank=rank, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel(tensor_model_parallel_size=R, backend="gloo")
        # vLLM's own MoE layer: with EP over R ranks it places the experts (its expert_map);
        # vLLM places round robin only for grouped top-k routing (DeepSeek's), hence the groups
        grouped = dict(use_grouped_topk=True, num_expert_group=2, topk_group=2)
        runner = FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                 params_dtype=torch.bfloat16, reduce_results=False,
                                 prefix=f"{PREFIX}.experts",
                                 **(grouped if a.placement == "round_robin" else {}))
        layer = runner.routed_experts
    assert layer.expert_placement_strategy == a.placement, layer.expert_placement_strategy
    m = layer.expert_map  # global id -> local index, -1 elsewhere (None without EP)
    local = (list(range(E)) if m is None else
             sorted((int(g) for g in (m >= 0).nonzero().flatten()), key=lambda g: int(m[g])))

    # "load" the checkpoint: every process draws the same one and keeps its own experts
    sd = weights.make_state_dict(E, H, I, dtype=a_dtype(a), layer_prefix=PREFIX, seed=31)
    w = weights.load_experts(sd, PREFIX, local)
    full = weights.load_experts(sd, PREFIX, range(E))
    p = reference.make_problem(R, E, K, H, I, tokens, dtype=a_dtype(a), seed=32, drop=0.05)
    x, ids, wts = p.x[rank], p.topk_ids[rank].long(), p.topk_weights[rank]
    want = reference.reference_moe(x, p.topk_ids[rank], wts, full["w13"], full["w13_scale"],
                                   full["w2"], full["w2_scale"])

    comm = mv.comm_from_ep_group(backend="cpu")                     # collective
    failed, lines = 0, []
    for mode in ("layer", "dispatch") if a.mode == "both" else (a.mode,):
        if not fp8:
            with torch.no_grad():
                layer.w13_weight.copy_(w["w13"])
                layer.w2_weight.copy_(w["w2"])
            kernel = mv.install(layer, comm, mode=mode)            # collective
            y = layer.forward_modular(x, wts, ids)                 # vLLM's forward
        else:
            qc = fp8_w8a8_moe_quant_config(w["w13_scale"], w["w2_scale"], block_shape=[128, 128])
            kernel = mv.make_kernel(layer.moe_config, qc, comm, mode=mode,
                                    placement=a.placement)         # collective
            y = kernel.apply(x, w["w13"], w["w2"], wts, ids, layer.activation, E,
                             layer.expert_map, False)
        kernel.moeflow_layer.close()
        try:
            reference.assert_close(y, want, a_dtype(a), oracle=True)
            status = "ok"
        except AssertionError as e:
            status, failed = f"MISMATCH: {e}", 1
        lines.append(f"vllm_layer.py: rank {rank}/{R} {a.dtype} {a.placement} mode {mode}: T "
                     f"{tokens[rank]} local experts {len(local)} diff "
                     f"{reference.diff(y, want):.3g} {status}")
    comm.close()                                                     # collective
    every = [None] * R                                               # rank 0 prints, in order
    torch.distributed.all_gather_object(every, (failed, lines), group=ps.get_world_group().cpu_group)
    failed = any(f for f, _ in every)
    if rank == 0:
        print("\n".join(line for _, ls in every for line in ls))
        print(f"vllm_layer.py: R {R} {a.dtype} {a.placement}: {'FAIL' if failed else 'PASS'}")
    sys.stdout.flush()
    os._exit(1 if failed else 0)  # see distributed.py: torch's exit-time destructors


def a_dtype(a):
    return torch.float8_e4m3fn if a.dtype == "fp8" else torch.bfloat16


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", choices=["cpu"],
                    help="the CPU backend (vLLM on a GPU machine: the same calls, NCCL groups)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--mode", default="both", choices=["both", "layer", "dispatch"])
    ap.add_argument("--placement", default="linear", choices=["linear", "round_robin"])
    ap.add_argument("-R", "--ranks", type=int, default=2)
    ap.add_argument("-E", "--experts", type=int, default=8)
    ap.add_argument("-K", "--topk", type=int, default=2)
    ap.add_argument("-H", "--hidden", type=int, default=256)
    ap.add_argument("-I", "--inter", type=int, default=128)
    ap.add_argument("-T", "--tokens", type=int, default=6)
    ap.add_argument("--idle", type=int, default=-1, help="a rank with no tokens")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(rank_main, args=(a, port), nprocs=a.ranks, join=True)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        print(f"vllm_layer.py: a rank failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
