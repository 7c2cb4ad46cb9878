"""moeflow.vllm against vLLM itself (vllm==0.33.0, CPU tensors, VLLM_TARGET_DEVICE=cpu): vLLM's
real FusedMoEKernel built from moeflow's classes (the fused layer; dispatch/combine with moeflow's
grouped GEMMs; dispatch/combine with vLLM's own batched experts), BF16 and FP8 block, R = 1, 2 and
4 virtual ranks and gloo processes, uneven and round-robin placement, EPLB's physical ids with
replicas, T = 0 on some ranks, and the refusals. Skipped only where vLLM is not installed; CI
installs it and sets MOEFLOW_REQUIRE_VLLM=1, which turns the skip into a failure."""
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("MOEFLOW_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI: the conformance tests must run)
elif pytest.importorskip("vllm").__version__.endswith("(moeflow test double)"):
    pytest.skip("vLLM is not installed here (`vllm` is test_vllm_cuda.py's test double)", allow_module_level=True)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch.nn.functional as F  # noqa: E402
from vllm.model_executor.layers.fused_moe import modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
    RoutingMethodType,
    fp8_w8a8_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe  # noqa: E402

from conftest import run_layer_ranks  # noqa: E402
from moeflow import reference as ref  # noqa: E402
from moeflow import vllm as mv  # noqa: E402
from moeflow import weights as W  # noqa: E402
from moeflow.torch import virtual_comms  # noqa: E402

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
K, H, I = 3, 256, 128
PREFIX = "model.layers.0.mlp"


# ---- vLLM's objects for one rank ------------------------------------------------------------------
def moe_config(E, R, r, S, placement="linear", topk=K, eplb=False):
    pc = FusedMoEParallelConfig(tp_size=1, tp_rank=0, pcp_size=1, pcp_rank=0, dp_size=R,
                                dp_rank=r, ep_size=R, ep_rank=r, sp_size=1, use_ep=True,
                                all2all_backend="allgather_reducescatter", enable_eplb=eplb)
    L = int((mv.placement_expert_map(placement, E, R, r) >= 0).sum())
    return FusedMoEConfig(num_experts=E, experts_per_token=topk, hidden_dim=H,
                          intermediate_size=I, num_local_experts=L, num_logical_experts=E,
                          activation=MoEActivation.SILU, device="cpu",
                          routing_method=RoutingMethodType.TopK, moe_parallel_config=pc,
                          in_dtype=BF16, max_num_tokens=S)


def quant_config(dtype, w):
    if dtype == BF16:
        return FusedMoEQuantConfig.make()
    return fp8_w8a8_moe_quant_config(w["w13_scale"], w["w2_scale"], block_shape=[128, 128])


def local_ids(placement, E, R, r):
    """Global ids of rank r's experts in local order."""
    return list(W.local_expert_ids(r, R, E, placement))


# vLLM's batched experts ask torch.accelerator.current_stream() whether a CUDA graph is being
# captured, which a CUDA build of torch answers only with a GPU driver: on this CPU-only machine
# nothing is ever captured.
fused_batched_moe._is_capturing_or_compiling = lambda: False


class TorchActivationNaiveBatchedExperts(fused_batched_moe.NaiveBatchedExperts):
    """vLLM's NaiveBatchedExperts (its torch reference experts for the batched format) with the
    SiLU-and-mul written in torch: vLLM's compiled silu_and_mul needs a GPU driver."""

    def activation(self, activation, output, input, **kwargs):
        n = output.shape[-1]
        output.copy_(F.silu(input[..., :n].float()) * input[..., n:].float())


def run(R, fn):
    comms = virtual_comms(R, "cpu")
    try:
        return run_layer_ranks(comms, fn)
    finally:
        comms[0].group.close()


def layer_problem(dtype, E, R, tokens, seed, placement="linear"):
    sd = W.make_state_dict(E, H, I, dtype=dtype, layer_prefix=PREFIX, seed=seed)
    p = ref.make_problem(R, E, K, H, I, tokens, dtype=dtype, seed=seed + 1, drop=0.1)
    full = W.load_experts(sd, PREFIX, range(E))
    want = [ref.reference_moe(p.x[r], p.topk_ids[r], p.topk_weights[r], full["w13"],
                              full["w13_scale"], full["w2"], full["w2_scale"]) for r in range(R)]
    return sd, p, want


def run_kernel(dtype, E, R, tokens, p, sd, mode, placement="linear", experts=None, ids64=True,
               ids_of=None, weights_of=None):
    """y of every rank through vLLM's FusedMoEKernel.apply, twice (buffer reuse)."""
    S = max(max(tokens), 1)

    def rank(r, comm, ready):
        w = weights_of(r) if weights_of else W.load_experts(sd, PREFIX, local_ids(placement, E, R, r))
        mc, qc = moe_config(E, R, r, S, placement), quant_config(dtype, w)
        ex = None
        if experts == "vllm":
            ex = TorchActivationNaiveBatchedExperts(mc, qc, max_num_tokens=S, num_dispatchers=R)
        kernel = mv.make_kernel(mc, qc, comm, mode=mode, placement=placement, experts=ex)
        assert isinstance(kernel, mk.FusedMoEKernel)
        emap = mv.placement_expert_map(placement, E, R, r)
        ids = (ids_of(r) if ids_of else p.topk_ids[r])
        ids = ids.long() if ids64 else ids.int()
        ready()
        try:
            return [kernel.apply(p.x[r], w["w13"], w["w2"], p.topk_weights[r], ids,
                                 MoEActivation.SILU, E, emap, False) for _ in range(2)]
        finally:
            kernel.moeflow_layer.close()

    return run(R, rank)


# ---- the fused layer and dispatch/combine, against the fp64 reference ------------------------------
CASES = [(1, [9]), (2, [6, 0]), (2, [5, 7]), (4, [3, 0, 8, 1])]


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("R,tokens", CASES, ids=[f"R{r}-{t}" for r, t in CASES])
def test_layer_and_dispatch_kernels_match_reference_and_each_other(dtype, R, tokens):
    E = 8
    sd, p, want = layer_problem(dtype, E, R, tokens, seed=20 + R)
    ys = {mode: run_kernel(dtype, E, R, tokens, p, sd, mode) for mode in ("layer", "dispatch")}
    for r in range(R):
        for mode, y in ys.items():
            assert y[r][0].shape == (tokens[r], H) and y[r][0].dtype == BF16
            ref.assert_close(y[r][0], want[r], dtype, oracle=True)
            assert torch.equal(y[r][0], y[r][1]), f"{mode}: the second call differs"
        # dispatch -> moeflow's grouped GEMMs -> combine is the fused layer, bit for bit (CPU)
        assert torch.equal(ys["layer"][r][0], ys["dispatch"][r][0])


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_prepare_finalize_with_vllms_own_batched_experts(dtype):
    """moeflow's dispatch/combine around vLLM's NaiveBatchedExperts (a1q [L, R*S, H], FP8 scales
    [L, R*S, H/128] fp32, expert_num_tokens): vLLM's experts read what moeflow delivers."""
    E, R, tokens = 8, 2, [7, 4]
    sd, p, want = layer_problem(dtype, E, R, tokens, seed=40)
    ys = run_kernel(dtype, E, R, tokens, p, sd, "dispatch", experts="vllm")
    for r in range(R):
        # vLLM's naive experts keep W13's output and SwiGLU in bf16 and (FP8) dequantise the
        # intermediate unquantised: close to the reference, not at moeflow's rounding points
        assert ref.diff(ys[r][0], want[r]) < (1e-4 if dtype == BF16 else 1e-3)


def test_int32_ids_and_the_prepare_contract():
    """int32 ids (the prepare's topk_indices_dtype) give the int64 result; the prepare/finalize
    reports vLLM's batched contract."""
    E, R, tokens = 8, 2, [5, 3]
    sd, p, _ = layer_problem(BF16, E, R, tokens, seed=50)
    a = run_kernel(BF16, E, R, tokens, p, sd, "dispatch", ids64=True)
    b = run_kernel(BF16, E, R, tokens, p, sd, "dispatch", ids64=False)
    for r in range(R):
        assert torch.equal(a[r][0], b[r][0])

    def rank(r, comm, ready):
        kernel = mv.make_kernel(moe_config(E, R, r, 5), None, comm, mode="dispatch")
        try:
            pf = kernel.prepare_finalize
            return (pf.activation_format, pf.num_dispatchers(), pf.max_num_tokens_per_rank(),
                    pf.output_is_reduced(), pf.topk_indices_dtype(),
                    type(kernel.fused_experts).activation_format())
        finally:
            kernel.moeflow_layer.close()

    for got in run(R, rank):
        assert got == (mk.FusedMoEActivationFormat.BatchedExperts, R, 5, True, torch.int32,
                       mk.FusedMoEActivationFormat.BatchedExperts)


def test_vllms_kernel_oracle_accepts_what_moeflow_serves():
    """vLLM's own selection check (FusedMoEExperts.is_supported_config) passes moeflow's experts
    for BF16 and FP8 block in their formats, and turns away other schemes and activations."""
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu
    mc = moe_config(8, 2, 0, 4)
    fmt = mk.FusedMoEActivationFormat
    for cls, form in ((mv.MoeflowExperts, fmt.BatchedExperts), (mv.MoeflowLayerExperts, fmt.Standard)):
        ok = mk.FusedMoEExperts.is_supported_config
        assert ok(cls, mc, None, None, form) == (True, None)
        assert ok(cls, mc, qu.kFp8Static128BlockSym, qu.kFp8Dynamic128Sym, form) == (True, None)
        assert not ok(cls, mc, qu.kFp8StaticTensorSym, qu.kFp8DynamicTokenSym, form)[0]
        other = fmt.Standard if form == fmt.BatchedExperts else fmt.BatchedExperts
        assert not ok(cls, mc, None, None, other)[0]
        gelu = moe_config(8, 2, 0, 4)
        gelu.activation = MoEActivation.GELU
        assert not ok(cls, gelu, None, None, form)[0]


def test_router_weight_on_input_top1():
    """apply_router_weight_on_input with top-1 (as vLLM's Llama-4 style layers ask): x is scaled
    by the router weight before dispatch and combine applies 1; K > 1 is refused."""
    E, R, tokens = 8, 2, [5, 4]
    sd = W.make_state_dict(E, H, I, dtype=BF16, layer_prefix=PREFIX, seed=80)
    p = ref.make_problem(R, E, 1, H, I, tokens, dtype=BF16, seed=81)
    full = W.load_experts(sd, PREFIX, range(E))

    def rank(r, comm, ready):
        w = W.load_experts(sd, PREFIX, local_ids("linear", E, R, r))
        kernel = mv.make_kernel(moe_config(E, R, r, 5, topk=1), None, comm, mode="dispatch")
        emap = mv.placement_expert_map("linear", E, R, r)
        ready()
        try:
            y = kernel.apply(p.x[r], w["w13"], w["w2"], p.topk_weights[r], p.topk_ids[r].long(),
                             MoEActivation.SILU, E, emap, True)
            with pytest.raises(ValueError, match="top-1"):  # refused before any collective
                kernel.prepare_finalize.prepare(p.x[r], torch.ones(tokens[r], 2),
                                                torch.zeros(tokens[r], 2, dtype=torch.int64), E,
                                                emap, True, FusedMoEQuantConfig.make())
            return y
        finally:
            kernel.moeflow_layer.close()

    ys = run(R, rank)
    for r in range(R):
        xs = (p.x[r].float() * p.topk_weights[r]).to(BF16)
        want = ref.reference_moe(xs, p.topk_ids[r], torch.ones(tokens[r], 1), full["w13"], None,
                                 full["w2"], None)
        ref.assert_close(ys[r], want, BF16, oracle=True)


# ---- placements vLLM hands over ---------------------------------------------------------------
PLACEMENT_CASES = [("linear", 10, 4, [4, 6, 0, 5]), ("linear", 7, 2, [5, 5]),
                   ("round_robin", 8, 2, [6, 3]), ("round_robin", 10, 4, [2, 0, 7, 4])]


@pytest.mark.parametrize("mode", ["layer", "dispatch"])
@pytest.mark.parametrize("placement,E,R,tokens", PLACEMENT_CASES,
                         ids=[f"{c[0]}-E{c[1]}-R{c[2]}" for c in PLACEMENT_CASES])
def test_uneven_and_round_robin_placement(mode, placement, E, R, tokens):
    """vLLM's uneven linear split (the first E % R ranks hold one more expert) and round-robin
    placement: y bit for bit the linear layer's with E % R == 0 (the same routing; R = 1)."""
    sd, p, want = layer_problem(BF16, E, R, tokens, seed=60 + E + R)
    ys = run_kernel(BF16, E, R, tokens, p, sd, mode, placement=placement)
    for r in range(R):
        ref.assert_close(ys[r][0], want[r], BF16, oracle=True)
    one = ref.make_problem(1, E, K, H, I, [sum(tokens)], dtype=BF16, seed=1)
    one.x, one.topk_ids, one.topk_weights = ([torch.cat(t)] for t in (p.x, p.topk_ids,
                                                                       p.topk_weights))
    single = run_kernel(BF16, E, 1, [sum(tokens)], one, sd, mode)[0][0]
    assert torch.equal(torch.cat([y[0] for y in ys]), single)


def test_placement_maps_are_vllms():
    """moeflow's placements are vLLM's: placement_expert_map equals vLLM's determine_expert_map
    (and moeflow.weights.local_expert_ids its local order) for even, uneven and round-robin splits."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    for placement in ("linear", "round_robin"):
        for E, R in ((8, 2), (10, 4), (128, 6), (7, 3), (5, 5)):
            for r in range(R):
                n, want, _ = determine_expert_map(R, r, E, placement)
                got = mv.placement_expert_map(placement, E, R, r)
                assert torch.equal(got, want.to(torch.int32)), (placement, E, R, r)
                assert n == len(local_ids(placement, E, R, r))


# ---- EPLB: physical ids, replicas ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["layer", "dispatch"])
@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_eplb_physical_ids_with_replicas(mode, dtype):
    """Under EPLB vLLM's router hands over physical ids (global_num_experts = P physical slots,
    each holding a logical expert; hot experts have replicas on several ranks): the moeflow layer
    is made with E = P, each rank holding its slots' weights. y is bit for bit the same routing
    through logical ids on a layer without replicas."""
    E, R, tokens = 8, 2, [9, 6]
    phys_to_logical = [0, 1, 2, 3, 4, 5, 6, 7, 1, 3, 5, 2]  # P = 12: 1, 2, 3 and 5 twice
    P = len(phys_to_logical)
    sd, p, want = layer_problem(dtype, E, R, tokens, seed=70)
    g = torch.Generator().manual_seed(71)

    def physical(logical):  # vLLM's router: each (token, k) to one replica of its expert
        out = logical.clone()
        for idx in (logical >= 0).nonzero().tolist():
            reps = [q for q, e in enumerate(phys_to_logical) if e == logical[tuple(idx)]]
            out[tuple(idx)] = reps[torch.randint(len(reps), (1,), generator=g).item()]
        return out

    phys_ids = [physical(p.topk_ids[r]) for r in range(R)]

    def slot_weights(r):
        slots = [phys_to_logical[q] for q in local_ids("linear", P, R, r)]
        return W.load_experts(sd, PREFIX, slots)

    y_phys = run_kernel(dtype, P, R, tokens, p, sd, mode, ids_of=lambda r: phys_ids[r],
                        weights_of=slot_weights)
    y_log = run_kernel(dtype, E, R, tokens, p, sd, mode)
    for r in range(R):
        assert torch.equal(y_phys[r][0], y_log[r][0])
        ref.assert_close(y_phys[r][0], want[r], dtype, oracle=True)


# ---- refusals -----------------------------------------------------------------------------------
def test_refusals_are_clear_and_leave_the_comm_usable():
    E, R, S = 8, 1, 4
    comms = virtual_comms(R, "cpu")
    try:
        comm = comms[0]
        mc = moe_config(E, R, 0, S)
        w = W.load_experts(W.make_state_dict(E, H, I, dtype=FP8, layer_prefix=PREFIX, seed=3),
                           PREFIX, range(E))
        fp8_qc = quant_config(FP8, w)
        # an FP8-block quant config on a BF16 layer: refused at construction, nothing silently bf16
        bf16_layer = mv.make_layer(mc, None, comm, layout="masked")
        try:
            with pytest.raises(ValueError, match="quant config asks for torch.float8_e4m3fn"):
                mv.MoeflowPrepareAndFinalize(bf16_layer, fp8_qc)
            with pytest.raises(ValueError, match="quant config asks for"):
                mv.MoeflowExperts(mc, fp8_qc, bf16_layer)
            with pytest.raises(ValueError, match="quant config asks for"):
                mv.MoeflowLayerExperts(mc, fp8_qc, bf16_layer)
        finally:
            bf16_layer.close()
        # quantisation schemes moeflow does not have
        per_tensor = fp8_w8a8_moe_quant_config(torch.ones(E), torch.ones(E))
        with pytest.raises(ValueError, match="block_shape"):
            mv.make_kernel(mc, per_tensor, comm)
        per_token = fp8_w8a8_moe_quant_config(torch.ones(E), torch.ones(E),
                                              per_act_token_quant=True)
        with pytest.raises(ValueError, match="per-token"):
            mv.layer_dtype(per_token)
        static = fp8_w8a8_moe_quant_config(w["w13_scale"], w["w2_scale"], a1_scale=torch.ones(1),
                                           block_shape=[128, 128])
        with pytest.raises(ValueError, match="static activation scales"):
            mv.layer_dtype(static)
        # the activation and the layout
        relu = moe_config(E, R, 0, S)
        relu.activation = MoEActivation.GELU
        with pytest.raises(NotImplementedError, match="SILU"):
            mv.make_layer(relu, None, comm)
        layer = mv.make_layer(mc, None, comm, layout="expert_major")
        try:
            with pytest.raises(ValueError, match="layout='masked'"):
                mv.MoeflowPrepareAndFinalize(layer)
        finally:
            layer.close()
        # the kernel: wrong E, a foreign expert_map, prepare twice, finalize first
        kernel = mv.make_kernel(mc, None, comm, mode="dispatch")
        try:
            pf = kernel.prepare_finalize
            p = ref.make_problem(1, E, K, H, I, [S], dtype=BF16, seed=4)
            x, ids, wts = p.x[0], p.topk_ids[0], p.topk_weights[0]
            qc = FusedMoEQuantConfig.make()
            with pytest.raises(ValueError, match="global_num_experts"):
                pf.prepare(x, wts, ids, E + 1, None, False, qc)
            with pytest.raises(NotImplementedError, match="expert_map"):
                pf.prepare(x, wts, ids, E, torch.arange(E, dtype=torch.int32).flip(0), False, qc)
            with pytest.raises(RuntimeError, match="without a prepare"):
                pf.finalize(torch.empty_like(x), torch.empty(1), wts, ids, False,
                            kernel.fused_experts.finalize_weight_and_reduce_impl())
            a = pf.prepare(x, wts, ids, E, None, False, qc)
            with pytest.raises(RuntimeError, match="again before finalize"):
                pf.prepare(x, wts, ids, E, None, False, qc)
            out = torch.empty_like(x)
            pf.finalize(out, torch.zeros_like(a[0]), wts, ids, False,
                        kernel.fused_experts.finalize_weight_and_reduce_impl())
            assert torch.equal(out, torch.zeros_like(out))  # zeros in, zeros out; usable again
        finally:
            kernel.moeflow_layer.close()
    finally:
        comms[0].group.close()


# ---- overlap: prepare_async / finalize_async (vLLM's dual-batch overlap) ----------------------------
def test_vllms_kernel_runs_the_async_halves():
    """supports_async: vLLM's FusedMoEKernel.apply takes prepare_async / finalize_async (hook, then
    receiver), and gives the synchronous prepare/finalize's y bit for bit."""
    E, R, tokens = 8, 2, [5, 3]
    sd, p, want = layer_problem(BF16, E, R, tokens, seed=60)
    calls = []
    orig_p, orig_f = mv.MoeflowPrepareAndFinalize.prepare_async, mv.MoeflowPrepareAndFinalize.finalize_async

    def spy_p(self, *a, **k):
        calls.append("prepare_async")
        return orig_p(self, *a, **k)

    def spy_f(self, *a, **k):
        calls.append("finalize_async")
        return orig_f(self, *a, **k)

    mv.MoeflowPrepareAndFinalize.prepare_async, mv.MoeflowPrepareAndFinalize.finalize_async = spy_p, spy_f
    try:
        got = run_kernel(BF16, E, R, tokens, p, sd, "dispatch")
    finally:
        mv.MoeflowPrepareAndFinalize.prepare_async, mv.MoeflowPrepareAndFinalize.finalize_async = orig_p, orig_f
    assert calls.count("prepare_async") == 2 * R and calls.count("finalize_async") == 2 * R
    sync = mv.MoeflowPrepareAndFinalize.supports_async
    mv.MoeflowPrepareAndFinalize.supports_async = lambda self: False
    try:
        base = run_kernel(BF16, E, R, tokens, p, sd, "dispatch")
    finally:
        mv.MoeflowPrepareAndFinalize.supports_async = sync
    for r in range(R):
        assert torch.equal(got[r][0], base[r][0]) and torch.equal(got[r][1], base[r][1])
        ref.assert_close(got[r][0], want[r], BF16, oracle=True)


def test_dual_batch_overlap_schedule():
    """Two micro-batches the way vLLM's DBO drives one prepare/finalize object: A's prepare_async,
    its hook registered on B and run by B before B's own send, B's hook run by A, A's receiver,
    A's finalize_async, ... y of each micro-batch equals prepare/finalize's, bit for bit."""
    E, R, dtype = 8, 2, BF16
    pa = ref.make_problem(R, E, K, H, I, [6, 2], dtype=dtype, seed=70, drop=0.1)
    pb = ref.make_problem(R, E, K, H, I, [3, 6], dtype=dtype, seed=71, drop=0.1)

    def experts(a):  # a stand-in for the batched experts: bf16 rows, recv_x's layout
        return (a.float() * 0.25).to(BF16)

    def rank(r, comm, ready):
        kernel = mv.make_kernel(moe_config(E, R, r, 6), None, comm, mode="dispatch", max_in_flight=2,
                                experts=None)
        pf = kernel.prepare_finalize
        nored = kernel.fused_experts.finalize_weight_and_reduce_impl()
        qc, emap = FusedMoEQuantConfig.make(), mv.placement_expert_map("linear", E, R, r)
        mbs = [(pa.x[r], pa.topk_ids[r], pa.topk_weights[r]), (pb.x[r], pb.topk_ids[r], pb.topk_weights[r])]
        ready()
        try:
            want = []
            for x, ids, wts in mbs:
                a = pf.prepare(x, wts, ids, E, emap, False, qc)
                out = torch.empty_like(x)
                pf.finalize(out, experts(a[0]), wts, ids, False, nored)
                want.append(out)
            outs = [torch.empty_like(x) for x, _, _ in mbs]
            (xa, ia, wa), (xb, ib, wb) = mbs
            hook_a, recv_a = pf.prepare_async(xa, wa, ia, E, emap, False, qc)
            hook_a()                                   # run by B (dbo_maybe_run_recv_hook)
            hook_b, recv_b = pf.prepare_async(xb, wb, ib, E, emap, False, qc)
            a_out = recv_a()
            fhook_a, frecv_a = pf.finalize_async(outs[0], experts(a_out[0]), wa, ia, False, nored)
            hook_b()                                   # run by A at its yield
            b_out = recv_b()
            fhook_b, frecv_b = pf.finalize_async(outs[1], experts(b_out[0]), wb, ib, False, nored)
            fhook_a()
            frecv_a()
            fhook_b()
            frecv_b()
            return [torch.equal(w_, o) for w_, o in zip(want, outs)]
        finally:
            kernel.moeflow_layer.close()

    for r, same in enumerate(run(R, rank)):
        assert all(same), f"rank {r}: the overlapped micro-batches differ from prepare/finalize: {same}"


def test_dual_batch_overlap_takes_its_micro_batches_from_vllms_config():
    """A dispatch-mode kernel holds as many exchanges in flight as vLLM's config runs
    micro-batches (2 with enable_dbo), and refuses a third prepare_async clearly."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    E, R = 8, 1
    p = ref.make_problem(R, E, K, H, I, [4], dtype=BF16, seed=80)

    def rank(r, comm, ready):
        config = VllmConfig(parallel_config=ParallelConfig())
        config.parallel_config.enable_dbo = True  # (vLLM's CPU platform turns it off at validation)
        with set_current_vllm_config(config):
            kernel = mv.make_kernel(moe_config(E, R, r, 4), None, comm, mode="dispatch")
        pf, qc = kernel.prepare_finalize, FusedMoEQuantConfig.make()
        ready()
        try:
            assert kernel.moeflow_layer.max_in_flight == 2
            x, ids, wts = p.x[r], p.topk_ids[r], p.topk_weights[r]
            rets = [pf.prepare_async(x, wts, ids, E, None, False, qc) for _ in range(2)]
            with pytest.raises(RuntimeError, match="max_in_flight = 2"):
                pf.prepare_async(x, wts, ids, E, None, False, qc)
            nored = kernel.fused_experts.finalize_weight_and_reduce_impl()
            for hook, recv in rets:
                hook()
                a = recv()
                out = torch.empty_like(x)
                fhook, frecv = pf.finalize_async(out, torch.zeros_like(a[0]), wts, ids, False, nored)
                fhook()
                frecv()
            return True
        finally:
            kernel.moeflow_layer.close()

    assert all(run(R, rank))


# ---- one rank per process: vLLM's own layer and EP group over gloo ----------------------------------
EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                       "vllm_layer.py")
GLOO_CASES = [["-R", "2"], ["-R", "4", "-E", "10", "--idle", "1"],
              ["-R", "3", "-E", "8", "--placement", "round_robin", "--idle", "2"],
              ["-R", "2", "--dtype", "fp8", "--idle", "0"]]


@pytest.mark.parametrize("args", GLOO_CASES, ids=["-".join(a) for a in GLOO_CASES])
def test_gloo_processes_run_vllms_own_layer(args):
    """examples/vllm_layer.py: R processes in vLLM's distributed environment over gloo, vLLM's
    RoutedExperts (FusedMoEFactory; vLLM places the experts: uneven linear with E = 10 on R = 4,
    round-robin), moeflow installed as its moe_kernel from vLLM's EP group (the ipc transport
    between the processes), both modes, an idle rank; every rank against the fp64 reference."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(q for q in sys.path if q))
    r = subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, env=env,
                       timeout=600)
    out = r.stdout + r.stderr
    R = int(args[1])
    assert r.returncode == 0 and ": PASS" in r.stdout, out[-4000:]
    assert r.stdout.count(" ok\n") == R * 2, out[-4000:]  # every rank, both modes


# ---- the H200's test double stands for this vLLM ---------------------------------------------------
def test_double_matches_vllm():
    """tests/python/vllm_double.py (what test_vllm_cuda.py runs on a machine without vLLM) names
    what the real vLLM 0.33 has: every module and attribute, the enum members, and the parameter
    names of every method and function the double defines."""
    import importlib
    import inspect

    import vllm_double

    def params(f):
        return [q for q in inspect.signature(f).parameters if q not in ("kwargs",)]

    for name, attrs in vllm_double.MODULES.items():
        real = importlib.import_module(name)
        for attr, fake in attrs.items():
            if attr.startswith("__"):
                continue
            assert hasattr(real, attr), f"{name}.{attr}: not in vLLM"
            got = getattr(real, attr)
            if isinstance(fake, type) and issubclass(fake, vllm_double.enum.Enum):
                assert {m.name for m in fake} <= {m.name for m in got}, f"{name}.{attr} members"
            elif isinstance(fake, type) and not hasattr(fake, "__dataclass_fields__"):
                for meth, f in vars(fake).items():
                    if callable(f) and not meth.startswith("_") or meth == "__init__":
                        assert params(getattr(got, meth)) == params(f), f"{name}.{attr}.{meth}"
            elif inspect.isfunction(fake):  # called with keywords: the names must exist
                assert set(params(fake)) <= set(params(got)), f"{name}.{attr}"
    # the fields and properties moeflow reads off the double's configs exist on vLLM's
    for cls, real in ((vllm_double.FusedMoEQuantConfig, FusedMoEQuantConfig),
                      (vllm_double.FusedMoEConfig, FusedMoEConfig),
                      (vllm_double.FusedMoEParallelConfig, FusedMoEParallelConfig)):
        for f in cls.__dataclass_fields__:
            assert hasattr(real, f) or f in real.__dataclass_fields__, f"{real.__name__}.{f}"
