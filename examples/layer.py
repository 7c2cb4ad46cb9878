#!/usr/bin/env python3
"""layer.py — the fused moeflow layer on one rank, from a Hugging Face-style checkpoint.

Builds a small synthetic checkpoint of one MoE layer in the layout DeepSeek-V3 / Kimi-K2 / Qwen3
FP8 releases ship (per expert gate_proj / up_proj / down_proj, FP8 with 128 x 128
weight_scale_inv; or BF16), loads it into moeflow's layout (moeflow.weights), routes tokens with a
softmax top-k gate, runs the whole layer (dispatch, W13 -> SwiGLU -> W2, combine: one call) and
checks y against the fp64 reference. Exit status 0 on a match, 1 on a mismatch.

    python3 examples/layer.py                      # CPU (or CUDA when the build and a GPU have it)
    python3 examples/layer.py --backend cuda --dtype bf16 --tokens 64
"""
import argparse
import os
import sys

try:
    import moeflow
except ImportError:  # run from a checkout: python/ beside examples/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import moeflow
import torch

from moeflow import reference, weights
from moeflow.torch import MoELayer, virtual_comms

PREFIX = "model.layers.3.mlp"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("-E", "--experts", type=int, default=16)
    ap.add_argument("-K", "--topk", type=int, default=4)
    ap.add_argument("-H", "--hidden", type=int, default=512)
    ap.add_argument("-I", "--inter", type=int, default=256)
    ap.add_argument("-T", "--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    dtype = torch.float8_e4m3fn if a.dtype == "fp8" else torch.bfloat16
    E, K, H, I, T = a.experts, a.topk, a.hidden, a.inter, a.tokens

    # 1. a checkpoint as the release ships it, then this rank's experts in moeflow's layout
    state_dict = weights.make_state_dict(E, H, I, dtype=dtype, layer_prefix=PREFIX, seed=a.seed)
    comm = virtual_comms(1, a.backend)[0]          # one rank: R = 1 owns every expert
    dev = torch.device("cuda", comm.device) if comm.backend == "cuda" else torch.device("cpu")
    w = weights.load_experts(state_dict, PREFIX, weights.local_expert_ids(comm.rank, comm.size, E),
                             device=dev)

    # 2. tokens and a softmax top-k router, as the model's gate computes them
    gen = torch.Generator().manual_seed(a.seed + 1)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    gate = torch.randn(E, H, generator=gen) / H ** 0.5
    topk_weights, topk_ids = torch.softmax(x.float() @ gate.T, dim=-1).topk(K, dim=-1)
    topk_weights = (topk_weights / topk_weights.sum(-1, keepdim=True)).contiguous()

    # 3. the layer: created on the comm, weights borrowed, one forward
    layer = MoELayer(comm, E, K, H, I, max_tokens=T, dtype=dtype)
    layer.set_weights(w["w13"], w["w2"], w["w13_scale"], w["w2_scale"])
    y = layer(x.to(dev), topk_ids.to(dev), topk_weights.to(dev)).cpu()
    layer.close()
    comm.group.close()

    # 4. the check: the fp64 reference of the layer's numerics over the whole checkpoint
    full = weights.load_experts(state_dict, PREFIX, range(E))
    ref = reference.reference_moe(x, topk_ids.int(), topk_weights, full["w13"], full["w13_scale"],
                                  full["w2"], full["w2_scale"])
    d = reference.diff(y, ref)
    try:
        reference.assert_close(y, ref, dtype, oracle=False)
    except AssertionError as e:
        print(f"layer.py: {comm.backend} {a.dtype} E {E} K {K} H {H} I {I} T {T}: MISMATCH "
              f"(diff {d:.3g}): {e}")
        return 1
    print(f"layer.py: {comm.backend} {a.dtype} E {E} K {K} H {H} I {I} T {T}: y matches the fp64 "
          f"reference (diff {d:.3g}, max |y - ref| {(y.float() - ref.float()).abs().max():.3g}): PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
