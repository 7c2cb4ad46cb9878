"""moeflow.torch on virtual ranks: the layer against the fp64 reference, dispatch and combine
bit for bit, int64 ids, the custom ops' registration (opcheck) and torch.compile."""
import pytest
import torch

from conftest import device_of, drain, run_layer_ranks, to_host
from moeflow import reference as ref
from moeflow.torch import MoELayer, virtual_comms

DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
E, K, H, I = 8, 3, 256, 128


def run_forward(problem, comms, dtype, layout="expert_major", max_tokens=None):
    """Every rank's y for problem on comms."""
    dev = device_of(comms[0].backend)
    S = max_tokens or max(x.shape[0] for x in problem.x)
    inputs = [(problem.x[r].to(dev), problem.topk_ids[r].to(dev),
               problem.topk_weights[r].to(dev),
               [w if w is None else w.to(dev) for w in problem.local_weights(r)])
              for r in range(len(comms))]

    def rank(r, comm, ready):
        x, ids, wts, weights = inputs[r]
        layer = MoELayer(comm, problem.num_experts, ids.shape[1], x.shape[1],
                         problem.w2.shape[2], S, dtype=dtype, layout=layout)
        layer.set_weights(*weights)
        torch.empty_like(x)  # warms the allocator for the op's output, before the collective
        ready()
        try:
            return to_host(layer(x, ids, wts))
        finally:
            layer.close()

    return run_layer_ranks(comms, rank)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("ranks,tokens,layout", [
    (1, [33], "expert_major"),
    (2, [16, 0], "expert_major"),   # an idle rank
    (4, [7, 20, 1, 12], "masked"),
])
def test_forward_matches_reference(backend, dtype, ranks, tokens, layout):
    p = ref.make_problem(ranks, E, K, H, I, tokens, dtype=dtype, seed=ranks, drop=0.1)
    comms = virtual_comms(ranks, backend)
    try:
        ys = run_forward(p, comms, dtype, layout)
    finally:
        comms[0].group.close()
    for r in range(ranks):
        ref.assert_close(ys[r], p.reference(r), dtype, oracle=backend == "cpu")


def test_int64_ids_give_the_same_y(backend):
    p = ref.make_problem(2, E, K, H, I, 9, dtype=torch.bfloat16, seed=7)
    comms = virtual_comms(2, backend)
    try:
        y32 = run_forward(p, comms, torch.bfloat16)
        p.topk_ids = [i.long() for i in p.topk_ids]
        y64 = run_forward(p, comms, torch.bfloat16)
    finally:
        comms[0].group.close()
    for a, b in zip(y32, y64):
        assert torch.equal(a, b)


def expert_of(recv_x, recv_scales, local_expert, dtype):
    """A stand-in expert computed in fp32: (l + 1) * dequantised row, as bf16."""
    x = recv_x.to(torch.float32)
    if dtype == torch.float8_e4m3fn:
        x = x * recv_scales.repeat_interleave(ref.BLOCK, -1)
    return (x * (local_expert + 1)).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["expert_major", "masked"])
def test_dispatch_combine(backend, dtype, layout):
    """Every received row is its source token (quantised as the library does); combine of a
    known expert function equals the fp32 K-sum computed here, bit for bit."""
    R, tokens = 2, [11, 6]
    p = ref.make_problem(R, E, K, H, I, tokens, dtype=dtype, seed=3, drop=0.2)
    dev = device_of(backend)
    comms = virtual_comms(R, backend)
    L = E // R

    def rank(r, comm, ready):
        x, ids, wts = (t.to(dev) for t in (p.x[r], p.topk_ids[r], p.topk_weights[r]))
        layer = MoELayer(comm, E, K, H, I, max(tokens), dtype=dtype, layout=layout)
        layer._dispatch_outputs(torch.empty)  # warms the allocator (CUDA) for the ops' outputs
        torch.empty_like(x)
        out = torch.zeros((*layer._rows_shape(), H), dtype=torch.bfloat16, device=dev)
        ready()
        try:
            d = layer.dispatch(x, ids)
            drain(dev)
            counts = d.expert_counts.cpu().tolist()
            rows = []  # (local expert, row index of recv_x)
            for l in range(L):
                start = 0 if layout == "masked" else d.expert_offsets[l].item()
                for i in range(counts[l]):
                    rows.append((l, (l, i) if layout == "masked" else (start + i,)))
            for l, at in rows:
                sc = d.recv_scales[at] if d.recv_scales is not None else None
                out[at] = expert_of(d.recv_x[at], sc, l, dtype)
            y = layer.combine(out, wts, d)
            drain(dev)
            recv = [(l, d.recv_x[at].cpu(), None if d.recv_scales is None else
                     d.recv_scales[at].cpu(), d.recv_src[at].tolist()) for l, at in rows]
            return y.cpu(), recv
        finally:
            layer.close()

    try:
        out = run_layer_ranks(comms, rank)
    finally:
        comms[0].group.close()

    expect = [torch.zeros(t, H, dtype=torch.float32) for t in tokens]
    sent = [ref.quantize_fp8(x, 1) if dtype == torch.float8_e4m3fn else (x, None) for x in p.x]
    partial = {}
    for r in range(R):
        for l, row, scales, (src_rank, t, k) in out[r][1]:
            q, s = sent[src_rank]
            assert p.topk_ids[src_rank][t, k].item() == r * L + l, "row sent to the wrong expert"
            assert torch.equal(row.view(torch.uint8) if dtype != torch.bfloat16 else row, q[t].view(
                torch.uint8) if dtype != torch.bfloat16 else q[t]), f"row of {(src_rank, t, k)}"
            if scales is not None:
                assert torch.equal(scales, s[t])
            partial[(src_rank, t, k)] = expert_of(row, scales, l, dtype).to(torch.float32)
    for r in range(R):
        n_routed = int((p.topk_ids[r] >= 0).sum())
        assert sum(1 for key in partial if key[0] == r) == n_routed
        for t in range(tokens[r]):
            for k in range(K):  # fp32 multiply-add in ascending k, as the library
                if (r, t, k) in partial:
                    expect[r][t] = expect[r][t] + p.topk_weights[r][t, k] * partial[(r, t, k)]
        assert torch.equal(out[r][0], expect[r].to(torch.bfloat16))


def test_opcheck_and_compile():
    """The custom op's registration (schema, fake impl) and a torch.compile'd layer, one rank."""
    p = ref.make_problem(1, E, K, H, I, 5, dtype=torch.float8_e4m3fn, seed=4)
    comms = virtual_comms(1, "cpu")
    layer = MoELayer(comms[0], E, K, H, I, 8)
    try:
        layer.set_weights(*p.local_weights(0))
        args = (layer.handle, p.x[0], p.topk_ids[0], p.topk_weights[0])
        torch.library.opcheck(torch.ops.moeflow.forward.default, args)
        eager = layer(*args[1:])
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(*args[1:]), eager)
    finally:
        layer.close()
        comms[0].group.close()
