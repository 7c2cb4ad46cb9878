"""moeflow.adapter: vLLM's modular-kernel shape (prepare / experts.apply / finalize) on moeflow,
R = 1 and R = 2 virtual ranks, against the fp64 reference; prepare's rows bit for bit (identity
payloads); the contract's refusals; the three examples run and pass."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import device_of, run_layer_ranks
from moeflow import adapter as A
from moeflow import reference as ref
from moeflow import weights as W
from moeflow.torch import MoELayer, virtual_comms

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
E, K, H, I = 8, 3, 256, 128
P = "model.layers.0.mlp"


def warm_allocator(dev):
    """CUDA: cache allocator blocks (small and large pools) for the torch experts' temporaries,
    so that nothing calls cudaMalloc between dispatch and combine (virtual ranks share a GPU)."""
    if torch.device(dev).type == "cuda":
        warm = [torch.empty(n, dtype=torch.uint8, device=dev) for n in (1 << 19, 64 << 20)]
        del warm


def run(backend, R, fn):
    comms = virtual_comms(R, backend)
    try:
        return run_layer_ranks(comms, fn)
    finally:
        comms[0].group.close()


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["torch", "layer"])
@pytest.mark.parametrize("R,tokens,layout", [(1, [9], "expert_major"), (2, [6, 0], "masked"),
                                             (2, [5, 7], "expert_major")])
def test_fused_moe_matches_reference(backend, dtype, mode, R, tokens, layout):
    sd = W.make_state_dict(E, H, I, dtype=dtype, layer_prefix=P, seed=R)
    full = W.load_experts(sd, P, range(E))
    p = ref.make_problem(R, E, K, H, I, tokens, dtype=dtype, seed=10 + R, drop=0.1)
    dev = device_of(backend)

    def rank(r, comm, ready):
        w = W.load_experts(sd, P, W.local_expert_ids(r, R, E), device=dev)
        qc = A.QuantConfig(w["w13_scale"], w["w2_scale"])
        moe = A.MoeflowFusedMoE.create(comm, E, K, H, I, max(tokens), dtype=dtype, layout=layout,
                                       mode=mode, quant_config=qc)
        x, ids, wts = p.x[r].to(dev), p.topk_ids[r].to(dev).long(), p.topk_weights[r].to(dev)
        warm_allocator(dev)
        ready()
        try:
            return [moe(x, w["w13"], w["w2"], wts, ids).cpu() for _ in range(2)]  # twice: reuse
        finally:
            moe.close()

    ys = run(backend, R, rank)
    for r in range(R):
        want = ref.reference_moe(p.x[r], p.topk_ids[r], p.topk_weights[r], full["w13"],
                                 full["w13_scale"], full["w2"], full["w2_scale"])
        # the fused layer on the CPU meets the oracle's bounds; the torch experts (fp32 GEMMs,
        # another summation order) and CUDA the bounds of any backend
        ref.assert_close(ys[r][0], want, dtype, oracle=backend == "cpu" and mode == "layer")
        assert torch.equal(ys[r][0], ys[r][1])


@pytest.mark.parametrize("layout", ["expert_major", "masked"])
def test_prepare_rows_and_finalize_sum_bit_for_bit(backend, layout):
    """BF16 identity payloads: every delivered row is its source token's x row (recv_src says
    which), segments match the counts, and finalize of expert_out = a1q is sum_k w x in fp32."""
    R, T = 2, [4, 6]
    p = ref.make_problem(R, E, K, H, I, T, dtype=BF16, seed=5, drop=0.2)
    dev = device_of(backend)

    def rank(r, comm, ready):
        pf = A.MoeflowPrepareAndFinalize(MoELayer(comm, E, K, H, I, max(T), dtype=BF16, layout=layout))
        x, ids, wts = p.x[r].to(dev), p.topk_ids[r].to(dev), p.topk_weights[r].to(dev)
        ready()
        try:
            a = pf.prepare(x, wts, ids, E)
            meta = a.expert_tokens_meta
            out = torch.empty_like(x)
            pf.finalize(out, a.a1q, wts, ids, False, A.TopKWeightAndReduceNoOP())
            return (a.a1q.cpu(), meta.recv_src.cpu(), meta.expert_num_tokens.cpu(),
                    None if meta.expert_offsets is None else meta.expert_offsets.cpu(), out.cpu(),
                    pf.activation_format, pf.layer.info.first_expert)
        finally:
            pf.layer.close()

    outs = run(backend, R, rank)
    L = E // R
    for r, (a1q, src, counts, offsets, y, fmt, first) in enumerate(outs):
        assert fmt == ("batched" if layout == "masked" else "standard")
        n = 0
        for e, start, c in A.expert_segments(counts, offsets):
            rows = a1q[e, start:start + c] if offsets is None else a1q[start:start + c]
            srcs = src[e, start:start + c] if offsets is None else src[start:start + c]
            for row, (sr, st, sk) in zip(rows, srcs.tolist()):
                assert p.topk_ids[sr][st, sk] == first + e
                assert torch.equal(row, p.x[sr][st])
            n += c
        assert n == sum(int((p.topk_ids[q] // L == r).sum()) for q in range(R))
        w = torch.where(p.topk_ids[r] >= 0, p.topk_weights[r], 0.0)
        acc = torch.zeros(T[r], H)
        for k in range(K):
            acc += w[:, k:k + 1] * p.x[r].float()
        assert torch.equal(y, acc.to(BF16))


def test_router_weight_on_input_expert_map_inplace(backend):
    """K = 1 with apply_router_weight_on_input; the linear expert_map is accepted; inplace."""
    R, T, K1 = 1, 6, 1
    p = ref.make_problem(R, E, K1, H, I, T, dtype=BF16, seed=6)
    sd = W.make_state_dict(E, H, I, dtype=BF16, layer_prefix=P, seed=6)
    dev = device_of(backend)
    w = W.load_experts(sd, P, range(E), device=dev)

    def rank(r, comm, ready):
        moe = A.MoeflowFusedMoE.create(comm, E, K1, H, I, T, dtype=BF16, mode="torch")
        x, ids, wts = p.x[0].to(dev), p.topk_ids[0].to(dev), p.topk_weights[0].to(dev)
        warm_allocator(dev)
        ready()
        try:
            y = moe(x, w["w13"], w["w2"], wts, ids, apply_router_weight_on_input=True,
                    expert_map=torch.arange(E, dtype=torch.int32))
            x2 = x.clone()
            y2 = moe(x2, w["w13"], w["w2"], wts, ids, inplace=True)
            assert y2 is x2
            return y.cpu(), y2.cpu()
        finally:
            moe.close()

    (y_in, y_out), = run(backend, R, rank)
    xs = (p.x[0].float() * p.topk_weights[0]).to(BF16)  # the weight applied before the experts
    want_in = ref.reference_moe(xs, p.topk_ids[0], torch.ones(T, 1), w["w13"].cpu(), None, w["w2"].cpu(), None)
    want_out = ref.reference_moe(p.x[0], p.topk_ids[0], p.topk_weights[0], w["w13"].cpu(), None,
                                 w["w2"].cpu(), None)
    ref.assert_close(y_in, want_in, BF16, oracle=False)
    ref.assert_close(y_out, want_out, BF16, oracle=False)


def test_contract_refusals():
    """R = 1, CPU: prepare twice, finalize first, a reducing weight_and_reduce, a non-linear
    expert_map, apply() on the layer mode; the layer stays usable after each."""
    comms = virtual_comms(1, "cpu")
    layer = MoELayer(comms[0], E, K, H, I, 4, dtype=BF16)
    try:
        pf = A.MoeflowPrepareAndFinalize(layer)
        p = ref.make_problem(1, E, K, H, I, 4, dtype=BF16, seed=1)
        x, ids, wts = p.x[0], p.topk_ids[0], p.topk_weights[0]
        out = torch.empty_like(x)
        with pytest.raises(RuntimeError, match="without a prepare"):
            pf.finalize(out, torch.zeros(1, H, dtype=BF16), wts, ids)
        with pytest.raises(NotImplementedError, match="expert_map"):
            pf.prepare(x, wts, ids, E, expert_map=torch.arange(E).flip(0))
        with pytest.raises(ValueError, match="num_experts"):
            pf.prepare(x, wts, ids, E + 1)
        a = pf.prepare(x, wts, ids, E)
        with pytest.raises(RuntimeError, match="again before finalize"):
            pf.prepare(x, wts, ids, E)

        class TopKWeightAndReduceContiguous:
            pass

        with pytest.raises(TypeError, match="TopKWeightAndReduceNoOP"):
            pf.finalize(out, a.a1q, wts, ids, False, TopKWeightAndReduceContiguous())
        pf.finalize(out, a.a1q, wts, ids)  # the pending dispatch is still combinable
        with pytest.raises(RuntimeError, match="whole layer"):
            A.MoeflowExperts("layer", layer=layer).apply(out, a.a1q, None, None)
        with pytest.raises(ValueError, match="mode"):
            A.MoeflowExperts("fused")
    finally:
        layer.close()
        comms[0].group.close()


EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


@pytest.mark.parametrize("script,args", [
    ("layer.py", ["-T", "8"]),
    ("dispatch_combine.py", ["-T", "5"]),
    ("distributed.py", ["-T", "3"]),
])
def test_examples_run_and_pass(script, args):
    """The examples on the CPU: exit 0 and print PASS."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--backend", "cpu", *args],
                       capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
