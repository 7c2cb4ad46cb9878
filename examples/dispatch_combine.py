#!/usr/bin/env python3
"""dispatch_combine.py — an engine that brings its own expert GEMMs: moeflow moves the tokens.

R virtual ranks of this process (one thread each, as moeflow's collectives need). Each rank:
  1. dispatch: layer.dispatch(x, topk_ids) sends every (token, k) to the rank that owns expert
     topk_ids[t, k] and returns, on this rank, the rows grouped by local expert (EXPERT_MAJOR:
     recv_x [rows, H], segment e at expert_offsets[e] with expert_counts[e] rows; FP8 layers
     deliver FP8 rows with 1 x 128 scales);
  2. the engine's GEMMs: here plain torch matmuls per local expert, W13 -> SwiGLU -> W2, written
     in recv_x's row positions (bf16, unweighted);
  3. combine: layer.combine(expert_out, topk_weights, d) returns every row to its token's rank
     and sums sum_k topk_weights[t, k] * row there.
y is checked against the fp64 reference; exit status 0 on a match, 1 on a mismatch.

    python3 examples/dispatch_combine.py                    # CPU, 2 ranks, FP8
    python3 examples/dispatch_combine.py --backend cuda --ranks 4 --dtype bf16
"""
import argparse
import contextlib
import os
import sys
import threading

# virtual ranks on one GPU need both before the process first uses CUDA (docs/API.md section 10)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
try:
    import moeflow
except ImportError:  # run from a checkout: python/ beside examples/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import moeflow
import torch

from moeflow import reference
from moeflow.torch import MoELayer, virtual_comms

BLOCK = 128


def dequant(w, scale):
    """FP8 [M, N] with 128 x 128 block scales -> fp32 (BF16: just fp32)."""
    if scale is None:
        return w.float()
    return w.float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)


def engine_experts(d, w13, w2, s13, s2, out):
    """The engine's own GEMMs on the dispatched rows, into out [max_recv_rows, H] bf16 (recv_x's
    row positions; padding rows are not read by combine)."""
    counts, offsets = d.expert_counts.tolist(), d.expert_offsets.tolist()
    for e, (start, n) in enumerate(zip(offsets, counts)):
        if n == 0:
            continue
        rows = d.recv_x[start:start + n].float()
        if d.recv_scales is not None:  # FP8 rows: 1 x 128 scales along H
            rows = rows * d.recv_scales[start:start + n].repeat_interleave(BLOCK, 1)
        gate_up = rows @ dequant(w13[e], None if s13 is None else s13[e]).T
        g, u = gate_up.chunk(2, dim=1)                         # gate rows first, then up
        h = torch.nn.functional.silu(g) * u
        if s2 is not None:  # FP8 W2: requantise h 1 x 128 as the layer does
            h = reference.fake_quantize_fp8(h).float()
        else:
            h = h.bfloat16().float()
        out[start:start + n] = (h @ dequant(w2[e], None if s2 is None else s2[e]).T).bfloat16()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("-R", "--ranks", type=int, default=2)
    ap.add_argument("-E", "--experts", type=int, default=8)
    ap.add_argument("-K", "--topk", type=int, default=3)
    ap.add_argument("-H", "--hidden", type=int, default=256)
    ap.add_argument("-I", "--inter", type=int, default=128)
    ap.add_argument("-T", "--tokens", type=int, default=16)
    a = ap.parse_args()
    dtype = torch.float8_e4m3fn if a.dtype == "fp8" else torch.bfloat16
    R, E, K, H, I, T = a.ranks, a.experts, a.topk, a.hidden, a.inter, a.tokens

    # tokens per rank differ (one rank idle), some slots skipped (-1)
    tokens = [T + 3 * r for r in range(R)]
    tokens[-1] = 0 if R > 1 else T
    p = reference.make_problem(R, E, K, H, I, tokens, dtype=dtype, seed=7, drop=0.1)
    comms = virtual_comms(R, a.backend)
    cuda = comms[0].backend == "cuda"
    dev = torch.device("cuda", comms[0].device) if cuda else torch.device("cpu")
    barrier = threading.Barrier(R)

    def rank_main(r):
        stream = torch.cuda.Stream() if cuda else None  # R > 1 on one GPU: a stream per rank
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            layer = MoELayer(comms[r], E, K, H, I, max(tokens), dtype=dtype)  # collective
            w13, w2, s13, s2 = [t if t is None else t.to(dev) for t in p.local_weights(r)]
            x, ids, wts = p.x[r].to(dev), p.topk_ids[r].to(dev), p.topk_weights[r].to(dev)
            # buffers before the first collective: with virtual ranks sharing one GPU, a
            # cudaMalloc between dispatch and combine may wait behind a peer's spinning kernel
            expert_out = torch.zeros(layer.info.max_recv_rows, H, dtype=torch.bfloat16, device=dev)
            if cuda:  # and cache allocator blocks for the GEMMs' temporaries (small and large)
                warm = [torch.empty(n, dtype=torch.uint8, device=dev) for n in (1 << 19, 64 << 20)]
                del warm  # freed into the cache, not to the device
                stream.synchronize()
            barrier.wait()  # every rank set up before the first data-path collective
            d = layer.dispatch(x, ids)                       # collective
            engine_experts(d, w13, w2, s13, s2, expert_out)
            y = layer.combine(expert_out, wts, d)            # collective
            y = y.cpu()
            layer.close()
            return y

    try:
        ys = moeflow.run_ranks(rank_main, R)
    finally:
        comms[0].group.close()
    bad = 0
    for r in range(R):
        ref = p.reference(r)
        try:
            reference.assert_close(ys[r], ref, dtype, oracle=False)
            status = "ok"
        except AssertionError as e:
            status, bad = f"MISMATCH: {e}", bad + 1
        print(f"dispatch_combine.py: rank {r} T {tokens[r]}: diff {reference.diff(ys[r], ref):.3g} {status}")
    print(f"dispatch_combine.py: {comms[0].backend} {a.dtype} R {R} E {E} K {K} H {H} I {I}: "
          f"{'PASS' if not bad else 'FAIL'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
